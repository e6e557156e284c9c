"""Lab 04, ZeRO memory: one notebook (labs/04_zero_memory), this package, its tests.

How one exercise travels: exercise 1's ``bytes_per_rank`` stays in the notebook (a formula, graded there on numbers);
``launch.run("zero_memory", {"steps": ..., "variants": ...}, nproc=2 and 4)`` starts ``run`` under torchrun, where
every rank trains the course GPT under DDP, ZeRO-1, FSDP2 without and with resharding (``lablib.parallel.zero_states``,
shared with lab 07) and counts the bytes it holds from storages (``lablib.measure.memory``); rank 0 gathers the counts
and writes them as JSON with ``formula_slack_bytes`` (what the formula leaves out); back in the notebook the check
puts the fullest rank's peak between the student's formula and the formula plus that slack. Exercise 2's activation
estimate is checked in the notebook against ``memory.saved_activation_bytes`` (what autograd saves).

Modules: ``run`` (the torchrun step ``zero_memory``). The setups, the counters and the activation checkpointing it
uses are shared with labs 05 and 07 and stay in ``lablib.parallel`` and ``lablib.measure``.
"""
