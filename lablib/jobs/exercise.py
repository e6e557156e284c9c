"""Load the module file a notebook exercise wrote (``%%writefile my_impl.py``) into a run script: ``load_module``,
or ``load_fresh`` for a file that imports another exercise file beside it; ``require_file`` refuses an unwritten one.

The student's code reaches the torchrun processes only this way: by path, so a fresh process always
runs what the notebook cell last wrote, and a clear error says which cell to run when the file is missing.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType


def require_file(path: str) -> Path:
    """The exercise module's absolute path, or an error naming the notebook cell that writes it."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"exercise module {path} does not exist (looked in {file.parent}). "
                                f"Run the exercise cell that starts with %%writefile {Path(path).name} first.")
    return file


def load_module(path: str, required: tuple[str, ...] = ()) -> ModuleType:
    file = require_file(path)
    spec = importlib.util.spec_from_file_location(f"student_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    missing = [name for name in required if not hasattr(module, name)]
    if missing:
        raise AttributeError(f"{file.name} defines no {', '.join(missing)}; the exercise cell must define "
                             f"{', '.join(required)} with the signature given in the notebook")
    return module


def load_fresh(path: str, required: tuple[str, ...] = (), stand_ins: dict[str, ModuleType] | None = None
               ) -> ModuleType:
    """``load_module`` for an exercise file that imports another exercise file beside it (lab 06's exercise 3
    imports exercise 2's ``buckets_impl``, lab 08's layers import exercise 1's f and g). The file's folder becomes
    importable and every module loaded earlier from that folder is dropped first, so the files as last written are
    what runs. ``stand_ins`` (module name -> module) answer those imports instead of the student's files while the
    module loads (a check graded against a reference that the student's other answers cannot break); the names
    they replaced are restored afterwards."""
    folder = str(require_file(path).parent)
    for name, module in list(sys.modules.items()):
        if os.path.dirname(str(getattr(module, "__file__", "") or "")) == folder:
            del sys.modules[name]
    if folder not in sys.path:
        sys.path.insert(0, folder)
    saved = {name: sys.modules.get(name) for name in (stand_ins or {})}
    sys.modules.update(stand_ins or {})
    try:
        return load_module(path, required=required)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def unwritten(path: str | Path) -> list[str]:
    """The functions (and methods) of an exercise module that are still stubs: their body, after a docstring,
    is only nbgrader's stub, ``raise NotImplementedError()`` with no message (what a released notebook's
    exercise cell holds). A student's own ``raise NotImplementedError("...")`` (an abstract helper, a refused
    case) is code they wrote, not a stub. Read from the source without running it; a file that does not parse
    is left to the import to report."""
    import ast

    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    stubs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if (node.body and isinstance(node.body[0], ast.Expr)
                                     and isinstance(node.body[0].value, ast.Constant)
                                     and isinstance(node.body[0].value.value, str)) else node.body
            if len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].exc is not None:
                exc = body[0].exc
                bare = not isinstance(exc, ast.Call) or (not exc.args and not exc.keywords)
                name = exc.func if isinstance(exc, ast.Call) else exc
                if bare and isinstance(name, ast.Name) and name.id == "NotImplementedError":
                    stubs.append(node.name)
    return stubs
