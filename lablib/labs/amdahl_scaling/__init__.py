"""Lab 03, Amdahl's law and strong scaling: one notebook (labs/03_amdahl_scaling), this package, its tests.

How the lab's measurement travels: the notebook calls ``launch.run("amdahl_scaling", {"world_sizes": (1, 2, 4),
...}, threads_per_rank=1)``, which starts ``run`` under torchrun on 4 processes; the first N ranks train the course MLP
as a group of their own at each world size N in turn, once with one explicit all-reduce after the backward
(compute, wait, communication and optimizer step timed apart) and once under DDP (each bucket's all-reduce timed by
``lablib.course.scaling.BucketTimer``), and rank 0 writes the medians, every rank's per-step times and the weights'
distance from one process's as JSON. Back in the notebook the student's formulas (exercises: Amdahl's and
Gustafson's laws, the fit of p to the measured speedups, the predicted step time) are checked on numbers in the
notebook's own process and then fed the measured parts; the measurement itself is not graded.

The formulas and the bucket timer stay shared (``lablib.course.scaling``: ``bucketed_backward`` and ``BucketTimer``
are also labs 06 and 11's).

Modules: ``run`` (the torchrun step ``amdahl_scaling``).
"""
