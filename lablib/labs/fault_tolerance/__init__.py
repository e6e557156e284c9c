"""Lab 10, fault tolerance: one notebook (labs/10_fault_tolerance), this package, its tests.

How one exercise travels: the notebook writes ``ft_impl.py`` (``AppState``, ``start``, ``save``; it imports
``checkpointing.per_rank`` and ``this_rank``); ``probes.precheck`` runs it at world size 1 in the notebook's process
(stopped after a step, resumed, compared) in seconds; ``launch.run("fault_tolerance", {"impl": "ft_impl.py", "faults":
("kill:1@5",), "reference": True, ...}, max_restarts=...)`` starts ``run`` under torchrun, whose every attempt runs
``checkpoint_run.train`` (the students' ``start`` and ``save`` around ``checkpointing.train_step``, the faults played,
every step logged to a file that outlives the processes); the last attempt's rank 0 writes the whole log as JSON;
back in the notebook ``probes.check_resumed`` compares every step of every attempt with the uninterrupted run, bit
for bit, and ``probes.check_reshard`` resumes the 2-rank checkpoint on 1 rank against what the run held.

Modules: ``checkpointing`` (what a resumable run is: sampler, seeds, recipe, one step), ``checkpoint_run`` (the loop
around the students' start/save, faults, log, reshards), ``probes`` (the graded checks and the restart's timeline),
``async_checkpoint`` (``dcp.save`` against ``dcp.async_save``), ``checkpoint_interval`` (Young/Daly simulated),
``run`` (the torchrun step ``fault_tolerance``).
"""
