"""lablib: the library behind the Distributed Training Labs, what students install.

Read it like a table of contents. ``lablib.labs`` holds one package per lab: everything only that lab uses (its
formulas, probes, checks and torchrun steps). The other folders hold what two or more labs share, one job each:

``lablib.jobs``: running a step
- ``lablib.jobs.launch``    ``run(step, options, nproc=...)``: a step (``lablib.labs.<lab>.run`` / ``run_<step>``, or ``lablib.runs.<step>``)
                            under torchrun, its result;
                            ``run_script(path, nproc=...)``: any script, with each rank's output and stacks
- ``lablib.jobs.supervisor`` the one loop that watches processes: output, deadline, stopping every process
- ``lablib.jobs.outcome``   what a run gives back: ``RunResult``, ``ScriptRun``, the errors and how a failure is read
- ``lablib.jobs.processes`` the launcher-rank contract (run folder, logs, errors by restart attempt, deliberate kills)
- ``lablib.jobs.multinode`` a step across machines: the torchrun command each node runs (``launchers/multinode``,
                            ``launchers/slurm.sbatch``), and several nodes on this machine (a node leaves or joins)
- ``lablib.jobs.distenv``   the process environment: one frozen ``DistEnv`` built from torchrun's variables;
                            ``gather_objects``: every rank's object on each rank (per-rank figures brought together)
- ``lablib.jobs.config``    typed, strict option parsing shared by the launcher and the run scripts
- ``lablib.jobs.script``    the skeleton every run script shares (errors, JSON output, clean shutdown)
- ``lablib.jobs.exercise``  loading the module file a notebook exercise wrote into a run script (``load_fresh``: one
                            that imports another exercise file beside it); the refusal of one not yet written
- ``lablib.jobs.job``       the launcher's own record of a job it started (pids, process groups, sessions) and
                            the escalating stop (SIGINT, SIGTERM, SIGKILL on a deadline) an interrupt or a timeout uses

``lablib.measure``: what happened
- ``lablib.measure.timing``    the one definition of a step's time across ranks (slowest rank per step, median)
- ``lablib.measure.counting``  the one layer that counts collectives (name, bytes, bus bytes, group, launch and
                               completion) at torch's communication ops, however the caller spelled the call
- ``lablib.measure.collective_log`` what a count records: ``Call``, ``CollectiveLog``, names and bus factors
- ``lablib.measure.c10d_ops``  the layer under counting: a kernel on torch's c10d and functional-collective ops
- ``lablib.measure.memory``    bytes held in parameters, gradients, optimizer state; the one saved-activation counter
- ``lablib.measure.benchmark`` ``StepMeter``: one way to measure every variant's step (time, memory, collectives)
- ``lablib.measure.rankcheck`` which samples each rank saw, whether the ranks' weights agree, and the rounding
                               bounds two runs that differ only in summation order must stay within
- ``lablib.measure.p2p``       point-to-point sends and receives that count their bytes (lab 02)

``lablib.course``: the course's models, data and formulas (no parallelism inside)
- ``lablib.course.models``   a small GPT (nanoGPT names) and a small MLP
- ``lablib.course.data``     Tiny Shakespeare: download/verify/cache, character tokenizer, batches; the regression task
- ``lablib.course.commcost`` the alpha-beta cost model, its fit, interconnects and model sizes (lab 02)
- ``lablib.course.scaling``  lab 03's strong-scaling formulas, the explicit all-reduce and DDP's bucket timer
- ``lablib.course.plots``    the course's matplotlib conventions and widgets

``lablib.parallel``: parallelisms applied to a plain model from outside
- ``lablib.parallel.pipeline``        the course GPT cut into stages; a given schedule played tick by tick
- ``lablib.parallel.tensor_parallel`` the students' classes, DTensor's ``parallelize_module`` and a 2-D mesh with FSDP2
- ``lablib.parallel.activation_checkpointing``  activation checkpointing applied to a plain model
- ``lablib.parallel.ddp_buckets``     PyTorch DDP's bucket assignment standing in for lab 06's exercise 2 (labs 06, 11)
- ``lablib.parallel.zero_states``     the model-state setups labs 04 and 07 count (DDP, ZeroRedundancyOptimizer, FSDP2)

``lablib.probes``: observers of the students' code behind the visible checks (properties, never an answer)
- ``lablib.probes.rehearsal``       ranks as threads of this process: collectives rehearsed in a second before torchrun
- ``lablib.probes.ring_rehearsal``  lab 02's ring rehearsed on threads (sends and receives matched as gloo matches them)
- ``lablib.probes.harness``         around a student's code on the ranks: a sub-group as the default group, plain SGD
- ``lablib.probes.group_rehearsal`` labs 12 and 13 on thread ranks: all_to_all_single (equal or uneven), sub-groups

``lablib.labs``: one package per lab, everything only that lab uses: its formulas, its probes and checks, its run
script (``run``, the torchrun step named after the package); a lab package imports the shared folders, never another
lab, and no shared folder imports a lab (import-linter contracts in pyproject.toml)
- ``lablib.labs.collectives`` lab 00, collectives and the torchrun job: read ``collective_cases`` (exercise 1 on the
                                   ranks), ``job_setup`` (exercises 2 and 3 watched), then ``run`` and ``run_collectives_job``
- ``lablib.labs.collectives.bench`` the step's timings: each collective per call over sizes, in windows sized from the
                                   ranks' barrier skew, with a noise floor; what DETAIL adds to a small all-reduce
- ``lablib.labs.collectives.collective_cases`` exercise 1 on the ranks: every collective, the errors torch raises, the cases
- ``lablib.labs.collectives.job_setup`` exercise 2 watched: a script's setup calls recorded, simulated GPUs, a slow disk;
                                   exercise 3's script on thread ranks
- ``lablib.labs.collectives.run`` the torchrun step ``collectives``: each collective on 2-4 ranks, the bandwidth sweep
- ``lablib.labs.collectives.run_collectives_job`` the torchrun step ``collectives_job``: exercise 2's job in its
                                   scenarios, exercise 3's script with its collectives counted
- ``lablib.labs.gradient_accumulation`` lab 01, gradient accumulation: ``run_grad_accum``
- ``lablib.labs.gradient_accumulation.run_grad_accum`` the torchrun step ``grad_accum``: the student's accumulation
                                   under DDP with and without ``no_sync``, all-reduces counted, vs one process
- ``lablib.labs.ring_allreduce`` lab 02, the ring all-reduce: ``run`` (the rehearsal and the counting comm are shared)
- ``lablib.labs.ring_allreduce.run`` the torchrun step ``ring_allreduce``: the student's ring vs ``dist.all_reduce``
                                   (sums, bytes, peers) and timed against the naive scheme and gloo's all-reduce
- ``lablib.labs.amdahl_scaling`` lab 03, Amdahl's law and strong scaling: ``run`` (its formulas and bucket timer are
                                   ``lablib.course.scaling``'s, shared with labs 06 and 11)
- ``lablib.labs.amdahl_scaling.run`` the torchrun step ``amdahl_scaling``: world sizes 1, 2, 4 taking turns, compute
                                   and communication timed apart (explicit all-reduce) and under DDP
- ``lablib.labs.zero_memory``      lab 04, ZeRO memory: ``run`` alone (its setups and counters are shared with labs 05, 07)
- ``lablib.labs.zero_memory.run``  the torchrun step ``zero_memory``: DDP, ZeRO-1, FSDP2 x 2 trained, bytes each rank holds
- ``lablib.labs.gpt_migration``    lab 05, from one process to DDP, FSDP2 and Accelerate: read ``training``, then ``probes``, ``run``
- ``lablib.labs.gpt_migration.training`` the one training loop for a single process, DDP, accumulation and FSDP2
- ``lablib.labs.gpt_migration.probes``   the exercises' code on the ranks (loader orders, the mean, the FSDP2 plan)
- ``lablib.labs.gpt_migration.run``      the torchrun step ``gpt_migration``: every variant measured the same way
- ``lablib.labs.fault_tolerance``  lab 10, fault tolerance: read ``checkpointing`` (what a run saves), then
                                   ``checkpoint_run`` (the loop around the students' start/save), ``probes``, ``run``
- ``lablib.labs.fault_tolerance.checkpointing``  the resumable run: global sampler, per-rank RNG, recipe, one step
- ``lablib.labs.fault_tolerance.checkpoint_run`` the loop around the students' start/save: faults, log, what a run held
- ``lablib.labs.fault_tolerance.probes``         the graded checks: a resumed run against the uninterrupted one, reshards,
                                                 the restart's timeline
- ``lablib.labs.fault_tolerance.async_checkpoint`` ``dcp.save`` against ``dcp.async_save``: the time the job waits
- ``lablib.labs.fault_tolerance.checkpoint_interval`` the checkpoint interval simulated (failures at random)
- ``lablib.labs.fault_tolerance.run``            the torchrun step ``fault_tolerance``: checkpoint, be killed, resume
- ``lablib.labs.context_parallel`` lab 12, context parallelism: read ``cp_model`` (the numbers), then ``cp_ring`` and
                                   ``cp_ulysses`` (the exercises checked on ranks), ``cp_split``, ``cp_idle``, ``run``
- ``lablib.labs.context_parallel.cp_model``   how a sequence is split over context-parallel ranks, work, bytes, memory
- ``lablib.labs.context_parallel.cp_ring``    ring attention forward and backward on ranks vs one process
- ``lablib.labs.context_parallel.cp_events``  the ring watched: when each receive was posted and waited (overlap)
- ``lablib.labs.context_parallel.cp_split``   the zigzag split and idle fraction checked by their properties
- ``lablib.labs.context_parallel.cp_ulysses`` Ulysses' re-shard on ranks (bit for bit, all-to-alls counted)
- ``lablib.labs.context_parallel.cp_idle``    the idle time of the contiguous and zigzag splits, measured on a ring
- ``lablib.labs.context_parallel.cp_torch``   torch's own FlexAttention context parallelism against one process
- ``lablib.labs.context_parallel.run``        the torchrun step ``context_parallel``: the exercises and the timings
- ``lablib.labs.ddp_from_scratch`` lab 06, DDP from scratch: read ``probe`` (what the notebook calls), then ``order``,
                                   ``cases``, ``run_ddp_scratch``; the measurements: ``timeline``, ``run_ddp_overlap``
- ``lablib.labs.ddp_from_scratch.probe``   the students' DDP classes on the ranks vs one process, and the graded checks
- ``lablib.labs.ddp_from_scratch.cases``   the test models (tied, frozen, unused, reordered, routed) and batches
- ``lablib.labs.ddp_from_scratch.order``   the overlap verdicts from the order of events (PyTorch's reducer's rules)
- ``lablib.labs.ddp_from_scratch.timeline`` one step's per-rank timeline (CPU clocks on gloo, a profiler trace on GPUs)
- ``lablib.labs.ddp_from_scratch.training`` the batches, the GPT, the wrappers and the timed SGD step the measurements share
- ``lablib.labs.ddp_from_scratch.run_ddp_scratch`` the torchrun step ``ddp_scratch``: the graded runs of exercises 1 and 3
- ``lablib.labs.ddp_from_scratch.run_ddp_overlap`` the torchrun step ``ddp_overlap``: timeline, bucket sweep, benchmark
- ``lablib.labs.tensor_parallel``  lab 08, tensor parallelism: read ``probe`` (what the notebook calls), then ``f_g``,
                                   ``layers``, ``heads``, ``run``; the GPT steps ``run_tp_gpt`` and ``run_tp_2d``
- ``lablib.labs.tensor_parallel.probe``  DTensor's f and g (the stand-in), loading, the groups a run checks, the records
- ``lablib.labs.tensor_parallel.f_g``    exercise 1's f and g (autograd Functions, sums, collectives, any input)
- ``lablib.labs.tensor_parallel.layers`` the column/row-parallel layers, MLP and attention vs one process
- ``lablib.labs.tensor_parallel.heads``  whole heads, and sizes that do not divide refused in full
- ``lablib.labs.tensor_parallel.run``    the torchrun step ``tensor_parallel``: exercises 1-3 on groups of ranks
- ``lablib.labs.tensor_parallel.run_tp_gpt`` the step ``tp_gpt``: the course GPT by hand and with DTensor's plans
- ``lablib.labs.tensor_parallel.run_tp_2d``  the step ``tp_2d``: FSDP2 x tensor parallelism on a 2 x 2 mesh
- ``lablib.labs.pipeline_parallel`` lab 09, pipeline parallelism: read ``probe`` (what the notebook calls), then
                                   ``schedules``, ``recorder``, ``rehearsal``, ``run_pipeline``; the measurements:
                                   ``costs``, ``run_pipeline_torch``
- ``lablib.labs.pipeline_parallel.probe``     the students' engine on the ranks (order, timeline, saved bytes, who waited)
- ``lablib.labs.pipeline_parallel.schedules`` exercise 1 graded by what any schedule must do (the 1F1B rule played)
- ``lablib.labs.pipeline_parallel.recorder``  what a pipeline stage ran and when, and the activations it saved
- ``lablib.labs.pipeline_parallel.rehearsal`` the engine on threads as ranks before torchrun (gloo's send/recv matching)
- ``lablib.labs.pipeline_parallel.costs``     a measured step as stage times, latency and gap; played again with them
- ``lablib.labs.pipeline_parallel.run_pipeline``       the torchrun step ``pipeline``: the students' engine on ranks
- ``lablib.labs.pipeline_parallel.run_pipeline_torch`` the step ``pipeline_torch``: torch's pipelining schedules timed
- ``lablib.labs.zero_from_scratch`` lab 07, ZeRO from scratch: read ``cases``, then ``zero12`` and ``zero3`` (the
                                   exercises' probes), ``comm``, ``held``, ``step_checks``, the two steps
- ``lablib.labs.zero_from_scratch.cases``       lab 07's test models, batches, optimizer settings and lr schedule
- ``lablib.labs.zero_from_scratch.zero12``      ZeRO-1 and ZeRO-2 on ranks (vs AdamW, bytes each rank holds, collectives)
- ``lablib.labs.zero_from_scratch.zero3``       ZeRO-3 on ranks (gathered per block in both passes, vs AdamW and FSDP2)
- ``lablib.labs.zero_from_scratch.zero3_cases`` ZeRO-3's cases: models cut into units, batches, FSDP2 on the same data
- ``lablib.labs.zero_from_scratch.step_checks`` the checks ZeRO-2 and ZeRO-3 share (gradient tap, mean and its bound)
- ``lablib.labs.zero_from_scratch.comm``        the collectives the classes call, recorded on thread or torchrun ranks
- ``lablib.labs.zero_from_scratch.held``        what a rank holds under the classes, counted from storages
- ``lablib.labs.zero_from_scratch.precision``   mixed-precision ZeRO-3 measured (loss curves, fp16 underflow, GradScaler)
- ``lablib.labs.zero_from_scratch.lab04_formula`` lab 04's ``bytes_per_rank`` as the reader wrote it, for lab 07
- ``lablib.labs.zero_from_scratch.run_zero_scratch`` the torchrun step ``zero_scratch``: the exercises on 2-4 ranks
- ``lablib.labs.zero_from_scratch.run_zero_stages``  the torchrun step ``zero_stages``: ZeRO-1/2/3 beside DDP and FSDP2
- ``lablib.labs.strategy_benchmark`` lab 11, every strategy behind one interface: read ``strategies``, then ``rows``
                                   (labs 06-08's classes as rows, stand-ins), ``run``, ``shards``
- ``lablib.labs.strategy_benchmark.strategies`` the strategy interface (wrap_model, wrap_optimizer, sync_gradients,
                                                full_weights) and PyTorch's strategies behind it
- ``lablib.labs.strategy_benchmark.rows``       the rows from the students' labs 06-08, and stand-ins for missing files
- ``lablib.labs.strategy_benchmark.shards``     exercise 2 observed: DTensor's own shards and FSDP2 x TP's placements
- ``lablib.labs.strategy_benchmark.run``        the torchrun step ``strategy_benchmark``: every row trained, one table
- ``lablib.labs.expert_parallel``  lab 13, expert parallelism: read ``moe`` (the layer in one process), then ``probes``
                                   (what the notebook calls), ``ep_dispatch``, ``ep_grads``, ``run``
- ``lablib.labs.expert_parallel.moe``         the mixture-of-experts MLP in one process (router, gated sum, MoE GPT, formulas)
- ``lablib.labs.expert_parallel.probes``      the probes as the notebook reaches them (capacity and loss properties)
- ``lablib.labs.expert_parallel.ep_dispatch`` dispatch and combine on ranks vs one process (values, rows, bytes)
- ``lablib.labs.expert_parallel.ep_grads``    the gradient reduction on a dp x ep mesh (values, groups)
- ``lablib.labs.expert_parallel.run``         the torchrun step ``expert_parallel``: exercises 3 and 4 on ranks

``lablib.gpucheck``: the course on a GPU (``launchers/gpu-check``): every lab's steps at a student's sizes, the checks only
a GPU can make, one report
- ``lablib.gpucheck.__main__``       the command line (``python -m lablib.gpucheck``)
- ``lablib.gpucheck.steps``          each lab's multi-process steps and how each result is judged (the lab's own probes)
- ``lablib.gpucheck.exercise_files`` the exercise files a step needs, from the solutions or a student's labs/
- ``lablib.gpucheck.gpu_checks``     what only a GPU shows: memory vs max_memory_allocated, torch's context parallelism
- ``lablib.gpucheck.runner``         the budget, each step's limit, the comparison with the CPU run, the report

- ``lablib.checks``    the assertions the notebooks' checks use (clear messages, with hints)
- ``lablib.runs``      the multi-process steps, one module per step; a step never imports another

What only the course repository holds, and students never install: the instructor's package (release,
autograding, the student repository) and its references folder, instructor/references/ (the answer-equal
references the hidden tests compare with).
"""

__version__ = "0.1.0"
