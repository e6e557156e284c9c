"""One command that runs the course's multi-process steps on this machine's GPUs and writes one report.

    launchers/gpu-check                       # every lab's steps, then the GPU-only checks (8 minutes on one GPU)
    LABLIB_DEVICE=cpu launchers/gpu-check     # the quick path on the CPU (what CI runs, so the script cannot rot)
    launchers/gpu-check --steps 04,11         # only some labs (or step names: zero_memory, gpu:cp_sdpa)

The parts, one idea each:
- ``steps``: what runs. Every lab's multi-process steps (each lab package's run scripts, through ``lablib.jobs.launch.run``)
  with the options and rank counts the solution notebooks start them with, and the checks only a GPU can show. A
  step passes when its run ends well and, where the lab has them in ``lablib.probes``, the lab's own checks of its
  result pass (the report says which).
  Which device and backend each rank gets is ``lablib.jobs.distenv``'s choice, as in the labs: NCCL with one rank
  per GPU where there are enough GPUs, all ranks on GPU 0 over gloo where there are not (a step whose collectives
  gloo cannot run on GPU tensors falls back to the CPU, and the report lists it).
- ``exercise_files``: the labs' exercise modules the steps import: from the solution notebooks' ``%%writefile``
  cells where the course repository is here, else the files a student's notebooks wrote in ``labs/``.
- ``gpu_checks``: a torchrun script for the GPU-only checks that no run script covers (lab 04's counted bytes
  against ``torch.cuda.max_memory_allocated``, lab 12's ``context_parallel`` on SDPA).
- ``runner``: the time budget (each step's limit, the whole run's), the CPU runs the GPU figures are compared
  with, and the report (``results/gpu-check-<time>.json`` and ``.md``).
"""
