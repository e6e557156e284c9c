"""Lab 12, context parallelism: one notebook (labs/12_context_parallel), this package, its tests.

How one exercise travels: the notebook writes ``cp_ring_impl.py``; ``cp_ring.rehearse`` runs it on thread ranks in a
second; ``launch.run("context_parallel", {"impl": "cp_ring_impl.py", ...})`` starts ``run`` under torchrun, where
every rank runs ``cp_ring.probe_ring`` on each case and rank 0 writes the records as JSON; back in the notebook
``cp_ring.check_ring`` judges them (values within ``cp_ring.error_bounds``, bytes against ``cp_model``'s formula,
the largest score tensor held, every receive overlapped). The hidden cases are drawn in the solution notebook's
hidden tests when the grader runs them; nothing here lists them.

Modules: ``cp_model`` (the lab's numbers), ``cp_ring`` and ``cp_events`` (ring attention), ``cp_ulysses``,
``cp_split``, ``cp_idle`` (the measured idle time and the gathered-K/V comparison), ``cp_torch`` (torch's own
FlexAttention context parallelism), ``run`` (the torchrun step ``context_parallel``).
"""
