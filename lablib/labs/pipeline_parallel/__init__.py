"""Lab 09, pipeline parallelism: one notebook (labs/09_pipeline_parallel), this package, its tests.

How one exercise travels: the notebook writes ``engine_impl.py`` (exercise 2's ``pipeline_step``); ``probe.load_engine``
loads it, ``probe.probe_without_processes`` runs one stage in the notebook's process and ``rehearsal.rehearse`` runs
every stage on thread ranks (gloo's send/recv matching, a deadlock named), each in a second;
``launch.run("pipeline", {"impl": "engine_impl.py", **probe.case_options(orders), ...})`` starts ``run_pipeline``
under torchrun, where each case's ranks run ``probe.probe_engine`` (one step of the course GPT cut into stages, what
each stage ran and when recorded by ``recorder``, the sends and receives counted) and rank 0 writes the summaries as
JSON; back in the notebook ``probe.check_engine`` judges them (the order each stage ran, losses and gradients against
one process). The hidden cases are chosen in the solution notebook's hidden tests.

Modules: ``probe`` (what the notebook calls), ``schedules`` (exercise 1 graded by what any schedule must do),
``recorder`` (what a stage ran and when, and the activations it saved), ``rehearsal`` (the engine on thread ranks),
``costs`` (a measured step as stage times, latency and gap, and the schedule played again with them),
``run_pipeline`` (the torchrun step ``pipeline``), ``run_pipeline_torch`` (the step ``pipeline_torch``: torch's own
schedules timed). The stages and the schedule player stay in ``lablib.parallel.pipeline``: lab 11 uses them.
"""
