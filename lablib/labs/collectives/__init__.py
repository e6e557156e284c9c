"""Lab 00, collectives and the torchrun job: one notebook (labs/00_collectives), this package, its tests.

How one exercise travels (exercise 2): the notebook writes ``job_setup_impl.py`` (``setup_distributed``, ``log0``,
``checkpoint_round_trip``, ``run_job``); ``job_setup.rehearse_setups`` runs it first in the notebook's process, one
local rank at a time as a group of one, on simulated machines (GPUs per node, a second node); then the notebook
starts ``run_collectives_job`` under torchrun by its path (``launch.run_script``), where every rank runs the
student's job with its setup calls recorded (``job_setup.Recorder``: how ``init_process_group``, ``set_device``,
``torch.save``/``torch.load`` and ``barrier`` were called, a slow file system) and prints an ``@@job`` JSON line per
scenario; back in the notebook ``check_job`` judges every rank's lines.

Exercise 1 (predict what each collective leaves on every rank) is judged against ``run``, the torchrun step
``collectives``: every rank runs each collective on the inputs the notebook drew (``collective_cases``) and rank 0
writes what torch left, the errors it raised and the bandwidth sweep. Exercise 3 (a script that hangs, fixed) is
rehearsed on thread ranks (``job_setup.rehearse_script``) and run by ``run_collectives_job --counted``, which
counts its collectives.

Modules: ``collective_cases`` (each collective on a rank's tensors, the errors torch raises, the check cases),
``job_setup`` (exercise 2's calls recorded, simulated GPUs and nodes; exercise 3's script on thread ranks),
``run`` (the torchrun step ``collectives``), ``bench`` (its timings: the bandwidth sweep and what DETAIL costs, in
windows sized from the ranks' barrier skew, with a noise floor), ``run_collectives_job`` (the torchrun step ``collectives_job``:
exercise 2's job, exercise 3's script counted).
"""
