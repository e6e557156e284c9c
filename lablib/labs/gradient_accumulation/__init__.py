"""Lab 01, gradient accumulation: one notebook (labs/01_gradient_accumulation), this package, its tests.

How one exercise travels: the notebook writes ``accum_impl.py`` (``accumulation_step``); the notebook checks it first
in its own process, one accumulated step against one large-batch step from the same weights; then
``launch.run("grad_accum", {"impl": "accum_impl.py", ...})`` starts ``run_grad_accum`` under torchrun, where every
rank trains the course MLP under DDP with the student's step three times, taking turns step by step (with ``no_sync``
as written; with ``no_sync`` made a do-nothing, so every backward all-reduces; as written again, the noise floor of the
timing), the all-reduces counted by a DDP communication hook, and rank 0 trains one process on each whole global
batch and writes the JSON (all-reduces per step, step times and their per-round ratios, the largest weight
difference and its rounding estimate); back in the notebook the test cell judges the counts (K x buckets against
buckets) and the difference against the estimate. The other exercises (the micro-batch share of a token-mean loss, the
learning-rate scaling) run in the notebook's process alone.

Modules: ``run_grad_accum`` (the torchrun step ``grad_accum``).
"""
