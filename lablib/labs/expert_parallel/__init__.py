"""Lab 13, expert parallelism: one notebook (labs/13_expert_parallel), this package, its tests.

How one exercise travels: the notebook writes ``ep_dispatch_impl.py``; ``probes.rehearse_dispatch`` runs it on
thread ranks (``lablib.probes.group_rehearsal``'s all_to_all_single); ``launch.run("expert_parallel", ...)`` starts
``run`` under torchrun, where every rank runs ``ep_dispatch.probe`` on each case (the student's dispatch against one
process's float64 MoE from ``moe``, the all-to-alls counted where the code calls them) and rank 0 writes the
records; the notebook's ``probes.check_records`` judges them. Hidden cases are drawn in the solution notebook's
hidden tests; nothing here lists them.

Modules: ``moe`` (the layer in one process, its formulas, the grouped product), ``probes`` (what the notebook
calls), ``ep_dispatch`` (exercise 3), ``ep_grads`` (exercise 4), ``run`` (the torchrun step ``expert_parallel``).
"""
