"""Lab 07, ZeRO from scratch: one notebook (labs/07_zero_from_scratch), this package, its tests.

How one exercise travels: the notebook writes ``zero3_impl.py``; ``zero3.rehearse`` runs it on thread ranks in
seconds, each case checked as it ends; ``launch.run("zero_scratch", {"impl": "zero3_impl.py", "exercise": "zero3",
...})`` starts ``run_zero_scratch`` under torchrun, where every rank runs ``zero3.probe`` on each (world size, case)
and rank 0 writes the records as JSON; back in the notebook ``zero3.check`` judges them (the shards' gradients against
the all-reduced mean within its rounding bound, the update bit for bit against AdamW, the bytes held at rest and
gathered per block, the collectives by kind and dtype, FSDP2's first loss). Exercises 1 and 2 travel the same way
through ``zero12``. The hidden cases are named in the solution notebook's hidden tests; nothing here lists them.

Modules:
- ``cases``           the test models, batches, optimizer settings and lr schedule of the three exercises
- ``zero12``          the probe of ``ShardedOptimizer`` (ZeRO-1) and ``ZeRO2``: vs AdamW, bytes held, collectives
- ``zero3``           the probe of ``ZeRO3``: gathered per block in both passes, vs AdamW and FSDP2, mixed precision
- ``zero3_cases``     ZeRO-3's cases: models cut into units, each rank's batch, FSDP2 on the same data
- ``step_checks``     the checks ZeRO-2 and ZeRO-3 share (gradient tap, mean and its rounding bound, the update)
- ``comm``            the collectives the students' classes call, recorded on thread or torchrun ranks, and checked
- ``held``            what a rank holds under the students' classes, counted from storages (lab 11 reads it too)
- ``precision``       section 4b's mixed-precision measurements: loss curves, fp16 underflow, GradScaler
- ``lab04_formula``   lab 04's ``bytes_per_rank`` as the reader wrote it, read from lab 04's notebook
- ``run_zero_scratch`` the torchrun step ``zero_scratch``: the graded exercises on 2-4 real ranks
- ``run_zero_stages``  the torchrun step ``zero_stages``: the students' ZeRO-1/2/3 beside DDP,
                       ZeroRedundancyOptimizer and FSDP2 (bytes at three moments, collectives, paired step times)
"""
