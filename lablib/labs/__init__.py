"""One package per lab: everything only that lab uses, in one folder (see lablib/__init__.py's table of contents).

A lab package holds the lab's formulas, its probes and checks, and its torchrun step as ``run`` (``launch.run(name,
...)`` finds ``lablib.labs.<name>.run`` before ``lablib.runs.<name>``, so a notebook keeps its step names). It imports
the shared folders (``jobs``, ``measure``, ``course``, ``parallel``, ``probes``, ``checks``) and never another lab;
no shared folder imports a lab (the import-linter contracts in pyproject.toml, run by tests/test_layout.py).
"""
