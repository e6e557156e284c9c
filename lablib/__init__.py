"""lablib: the library behind the Distributed Training Labs.

Read it like a table of contents:

- ``lablib.distenv``   the process environment: one frozen ``DistEnv`` built from torchrun's variables
- ``lablib.launch``    ``run(step, options, nproc=...)``: a ``lablib.runs.<step>`` under torchrun, its result;
                       ``run_script(path, nproc=...)``: any script, with each rank's output and stacks
- ``lablib.multinode`` a step across machines: the torchrun command each node runs (``launchers/multinode``,
                       ``launchers/slurm.sbatch``), and several nodes on this machine (a node leaves or joins)
- ``lablib.processes`` the launcher-rank contract (run folder, logs, errors, timeouts) and process supervision
- ``lablib.config``    typed, strict option parsing shared by the launcher and the run scripts
- ``lablib.script``    the skeleton every run script shares (errors, JSON output, clean shutdown)
- ``lablib.exercise``  loading the module file a notebook exercise wrote into a run script
- ``lablib.data``      Tiny Shakespeare: download/verify/cache, character tokenizer, batches
- ``lablib.models``    a small GPT (nanoGPT names) and a small MLP; no parallelism inside
- ``lablib.counting``  the one layer that counts collectives (name, bytes, bus bytes, group) where the course
                       calls them, DDP's buckets included
- ``lablib.timing``    the one definition of a step's time across ranks (slowest rank per step, median)
- ``lablib.p2p``       point-to-point sends and receives that count their bytes (lab 02)
- ``lablib.commcost``  the alpha-beta cost model, its fit, interconnects and model sizes (lab 02)
- ``lablib.scaling``   lab 03's strong-scaling formulas, the explicit all-reduce and DDP's bucket timer
- ``lablib.memory``    bytes held in parameters, gradients, optimizer state; the one saved-activation counter
- ``lablib.activation_checkpointing``  activation checkpointing applied to a plain model from outside
- ``lablib.training``  lab 05's one training loop for a single process, DDP, accumulation and FSDP2
- ``lablib.probes``    reading what lab 05's exercise code does on the ranks, for its graded checks
- ``lablib.ddp_probes`` lab 06's probe of the students' DDP classes on the ranks, and its graded checks
- ``lablib.zero_probes`` lab 07's probe of the students' ZeRO-1 and ZeRO-2 classes (bit-exact vs AdamW, the state
                       and gradient bytes each rank holds), and its graded checks
- ``lablib.zero3_probes`` lab 07's probe of the students' ZeRO-3 (gathered per block, vs AdamW and FSDP2), its checks
- ``lablib.rehearsal`` ranks as threads of this process: an exercise rehearsed in a second before a torchrun start
                       (collectives for lab 07, point-to-point for lab 02), a deadlock named at once
- ``lablib.tp_probes`` lab 08's probe of the students' tensor-parallel f and g, MLP and attention, and its checks
- ``lablib.tensor_parallel``  tensor parallelism applied to the course GPT from outside: the students' classes,
                       DTensor's ``parallelize_module`` (vocabulary, sequence parallel) and a 2-D mesh with FSDP2
- ``lablib.pipeline``  pipeline parallelism applied to the course GPT from outside: its stages, and GPipe,
                       a given per-rank schedule played tick by tick (deadlocks named), Megatron's interleaving
- ``lablib.pipeline_probes`` lab 09's probe of the students' pipeline engine on the ranks (order, timeline,
                       saved bytes, who waited on whom in a deadlock), and its graded checks
- ``lablib.checkpointing`` lab 10's resumable run (global sampler, per-rank RNG, faults), ``lablib.ft_probes`` its checks
- ``lablib.benchmark`` ``StepMeter``: one way to measure every variant's step (time, memory, collectives) from
                       the modules above (lab 05)
- ``lablib.rankcheck`` which samples each rank saw, and whether the ranks' weights agree (lab 05)
- ``lablib.checks``    the assertions the notebooks' graded tests use (clear messages, with hints); a stub's error in one line
- ``lablib.plots``     the course's matplotlib conventions
- ``lablib.runs``      the multi-process steps, one module per step

Instructor tooling (release, autograde, the student repository) is the ``instructor`` package beside
``lablib`` in the course repository; it is not part of what students install.
"""

__version__ = "0.1.0"
