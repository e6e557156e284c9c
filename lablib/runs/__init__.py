"""The multi-process steps of the labs: one module per step, each started by ``lablib.jobs.launch.run``.

Each module has a ``Config`` dataclass, a ``run(env, config) -> dict`` and a ``main()``; its docstring
shows the torchrun command that runs it by hand.
"""
