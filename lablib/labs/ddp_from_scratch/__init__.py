"""Lab 06, DDP from scratch: one notebook (labs/06_ddp_from_scratch), this package, its tests.

How one exercise travels: the notebook writes ``ddp_bucketed_impl.py`` (exercise 3; it imports exercise 2's
``buckets_impl.py``); ``lablib.parallel.ddp_buckets.load_bucketed_impl`` loads it with PyTorch's bucket assignment
standing in for exercise 2, and ``probe.probe_without_processes`` runs it at world size 1 in the notebook's process in
a second; ``launch.run("ddp_scratch", {"impl": "ddp_bucketed_impl.py", "wrapper": "bucketed", ...})`` starts
``run_ddp_scratch`` under torchrun, where every rank runs ``probe.probe_case`` on each (world size, case) (the
collectives counted where the student's code calls them, the order of events, the weights against one process)
and rank 0 writes the records as JSON; back in the notebook ``probe.check_probe`` judges each record (``order``'s
verdicts, the rounding bound). The hidden cases are chosen in the solution notebook's hidden tests.

Modules: ``probe`` (the students' classes on the ranks and the graded checks), ``cases`` (the test models, batches
and the single-process reference's loss), ``order`` (the overlap verdicts from the order of events), ``timeline``
(one step's per-rank timeline: CPU clocks on gloo, a profiler trace on GPUs), ``run_ddp_scratch`` (the torchrun
step ``ddp_scratch``: the graded runs), ``run_ddp_overlap`` (the step ``ddp_overlap``: the timeline, the bucket
sweep, the paired benchmark against DDP, compression hooks).
"""
