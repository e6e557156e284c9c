"""Load the module file a notebook exercise wrote (``%%writefile my_impl.py``) into a run script.

The student's code reaches the torchrun processes only this way: by path, so a fresh process always
runs what the notebook cell last wrote, and a clear error says which cell to run when the file is missing.
"""

from __future__ import annotations

import importlib.util
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
