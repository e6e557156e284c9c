"""Lab 11, one training loop with every strategy behind one interface: one notebook (labs/11_strategy_benchmark),
this package, its tests. The one lab package that reads other labs' code: the students' lab 06 DDP classes and lab 07
ShardedOptimizer are rows of its table (the import contracts in pyproject.toml allow lab 11 -> labs 06 and 07, and
nothing else between labs).

How one exercise travels: the notebook writes ``strategies_impl.py`` (exercise 1: ``YourDDP``, lab 06's classes and
lab 07's ShardedOptimizer behind ``strategies.Strategy``); a visible check drives it in the notebook's own process
on one rank; ``launch.run("strategy_benchmark", {"impl": "strategies_impl.py", "standins": True, ...})`` starts
``run`` under torchrun, where every row trains the course GPT on the same batches and rank 0 writes the table as
JSON (each row's full weights against one process within a derived rounding scale, its ranks bit for bit, memory
by kind, collectives, paired step times); back in the notebook the table's verdicts are checked. Exercise 2
(rebuilding full weights from DTensor shards) is checked in the notebook's process against ``shards``' observation
of DTensor itself.

Modules:
- ``strategies``  the interface (wrap_model, wrap_optimizer, forward_backward, sync_gradients, full_weights) and
                  PyTorch's strategies behind it (DDP, ZeroRedundancyOptimizer, FSDP2, tensor parallel, a pipeline)
- ``rows``        the rows built from the students' labs 06-08 files, and stand-ins built on PyTorch where a file is
                  missing or unwritten; DeepSpeed's ZeRO 1-3 when installed
- ``shards``      exercise 2 observed: the shards DTensor gives each mesh coordinate, FSDP2 x TP's placements, and a
                  guard against DTensor's layout helpers
- ``run``         the torchrun step ``strategy_benchmark``: every row trained and checked, one table
"""
