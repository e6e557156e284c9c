"""Lab 08, tensor parallelism: one notebook (labs/08_tensor_parallel), this package, its tests.

How one exercise travels: the notebook writes ``tp_mlp_impl.py`` (exercise 2; it imports f and g from exercise 1's
``tp_comm_impl.py``); ``probe.load_impl`` loads it with DTensor's own f and g standing in for exercise 1's
(``probe.DTensorFG``), ``probe.probe_without_processes`` runs it at world size 1 and ``probe.rehearse`` on thread
ranks, each in a second; ``launch.run("tensor_parallel", {"impl": "tp_mlp_impl.py", "exercise": "mlp", ...})``
starts ``run`` under torchrun, where each group's ranks run ``layers.probe_layer`` on each case (the layer against
the full module in one process, the collectives counted where the code calls them) and rank 0 writes the merged
records as JSON; back in the notebook ``probe.check_record`` judges them. The hidden cases are chosen in the
solution notebook's hidden tests.

Modules: ``probe`` (what the notebook calls: loading, the groups a run checks, the ranks' records merged, the
rehearsal), ``f_g`` (exercise 1, Megatron's f and g), ``layers`` (exercises 2 and 3: the column- and row-parallel
layers, MLP and attention), ``heads`` (whole heads, sizes that do not divide refused), ``run`` (the torchrun step
``tensor_parallel``), ``run_tp_gpt`` (the step ``tp_gpt``: the course GPT by hand and with DTensor's plans),
``run_tp_2d`` (the step ``tp_2d``: FSDP2 x tensor parallelism on a 2 x 2 mesh). The parallelisms themselves
(``apply_by_hand``, ``apply_dtensor``, ``apply_2d``) stay in ``lablib.parallel.tensor_parallel``: lab 11 uses them.
"""
