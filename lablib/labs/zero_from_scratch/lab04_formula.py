"""Lab 04's ``bytes_per_rank`` as the reader wrote it, for lab 07 to compare its measurements with.

Read from the lab 04 notebook beside the lab 07 notebook (``../04_zero_memory/04_zero_memory.ipynb`` from the
folder the notebook runs in), else from the student repository's ``labs/`` next to this package: the reader's own
answer, never a copy shipped with lablib (it is lab 04's graded exercise).
"""

from __future__ import annotations

import json
from pathlib import Path

from lablib.measure import memory

LAB04 = "04_zero_memory"


def lab04_bytes_per_rank(folder=None):
    """Lab 04's ``bytes_per_rank(n_params, world_size, stage, recipe)``, the reader's own: the exercise cell
    (grade_id ``zero_bytes_per_rank``) of the lab 04 notebook beside this lab (``../04_zero_memory``), else of the
    repository's ``labs/04_zero_memory``. Returns (function, path), or (None, why) when no copy has it written (a
    stub raises NotImplementedError)."""
    here = Path(folder or Path.cwd()).resolve()
    repo = Path(__file__).resolve().parents[2]
    candidates = dict.fromkeys([here.parent / LAB04, repo / "labs" / LAB04])
    why = []
    for candidate in candidates:
        path = candidate / f"{LAB04}.ipynb"
        if not path.is_file():
            continue
        # json, not nbformat: importing nbformat (jsonschema's format checkers) costs seconds on a 2-core machine
        cells = [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
                 if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "zero_bytes_per_rank"]
        namespace = {**vars(memory)}
        try:
            source = "".join(cells[0]["source"]) if isinstance(cells[0]["source"], list) else cells[0]["source"]
            exec(compile(source, str(path), "exec"), namespace)   # noqa: S102 - the reader's own cell
            namespace["bytes_per_rank"](1000, 2, 1, memory.FP32_ADAM)
        except Exception as exc:  # noqa: BLE001 - a stub or a broken cell: try the next copy
            why.append(f"{path}: {type(exc).__name__}")
            continue
        return namespace["bytes_per_rank"], str(path)
    return None, "no lab 04 notebook with bytes_per_rank written beside this one: " + ("; ".join(why) or "none found")
