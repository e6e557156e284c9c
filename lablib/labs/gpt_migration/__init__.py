"""Lab 05, from one process to DDP, FSDP2 and Accelerate: one notebook (labs/05_gpt_migration), this package, its tests.

How one exercise travels: the notebook writes ``ddp_impl.py`` (``wrap_model``, ``make_loader``, ``start_epoch``,
``mean_across_ranks``); ``probes.loader_probe_without_processes`` and ``probes.mean_probe_without_processes`` look at
it on thread ranks in a second; ``launch.run("gpt_migration", {"variants": "ddp,ddp_accum", "ddp_impl":
"ddp_impl.py", ...})`` starts ``run`` under torchrun, where every rank loads the file, feeds its parts to
``training.train_loop`` (the one loop every variant shares) and records what ``probes.probe_loader``,
``probes.probe_mean`` and ``probes.fsdp_plan`` see, with the collectives counted and the shards recorded; rank 0 writes
the JSON; back in the notebook the checks compare the curves with the single-process baseline (the same ``run`` in
the notebook's process, ``lablib.jobs.script.run_in_this_process``) and the records with what the exercise promises.
Exercise 2 (``fsdp_impl.py``'s ``apply_fsdp``) travels the same way; exercise 3 (``accelerate_impl.py``'s
``train_loop``) too, its loop run in place of ``training.train_loop``.

Modules: ``training`` (the training loop and its reference parts, the workload's GPT, the evaluation steps),
``probes`` (the exercises' code looked at on ranks or threads), ``run`` (the torchrun step ``gpt_migration``).
"""
