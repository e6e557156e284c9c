"""Lab 02, the ring all-reduce: one notebook (labs/02_ring_allreduce), this package, its tests.

How one exercise travels: the notebook writes ``ring_impl.py`` (``ring_all_reduce(tensor, comm)``, talking only
through ``lablib.measure.p2p.CountingComm``); ``lablib.probes.ring_rehearsal.rehearse_ring`` runs it on 2, 3 and 4
thread ranks in a second (sends and receives matched as gloo matches them, a deadlock named); then
``launch.run("ring_allreduce", {"impl": "ring_impl.py", ...})`` starts ``run`` under torchrun, where every rank runs
the student's ring and ``dist.all_reduce`` on the same small-integer tensors for each world size, dtype and shape
(``lablib.measure.p2p.summarise``: difference, bytes sent and received per rank, peers, largest message, any
``torch.distributed`` call made past the comm) and rank 0 writes the rows as JSON; back in the notebook the test
cells judge the rows (the sum exact, a ring's neighbours only, the exact traffic: 2(N-1)M bytes over the ranks).
The same step with ``bench_bytes`` times the ring, the naive gather-and-broadcast and gloo's own all-reduce for the
latency-bandwidth fit.
The ring's formulas (exercise 1) and the gradient's cost (exercise 3) run in the notebook's process alone.

The rehearsal and the counting comm stay shared (``lablib.probes.ring_rehearsal``, used by labs 02, 09 and 12;
``lablib.measure.p2p``, used by labs 02 and 12).

Modules: ``run`` (the torchrun step ``ring_allreduce``: the check, the benchmark, the naive baseline).
"""
