"""The labs' exercise modules that the steps import (``accum_impl.py``, ``ddp_bucketed_impl.py``, ...), put in one
folder per lab, as the notebooks leave them beside themselves (lab 11's step finds labs 06-08's files there).

Where they come from, first found first:
- the course repository's solution notebooks (``solutions/NN_*/NN_*.ipynb``): each cell that starts with
  ``%%writefile NAME`` is written as a notebook would write it (nothing of it lives in ``lablib``);
- a student's copy: the files their notebooks wrote in ``labs/NN_*/``, if none of their functions is still a stub.
A lab with neither has steps that report what is missing instead of running.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lablib.jobs import exercise

WRITEFILE = "%%writefile"


def writefile_cells(notebook: Path) -> dict[str, str]:
    """{file name: source} of the notebook's ``%%writefile`` cells (the last one wins, as when it is run)."""
    cells = json.loads(notebook.read_text())["cells"]
    files = {}
    for cell in cells:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        first, _, body = source.partition("\n")
        if cell["cell_type"] == "code" and first.startswith(WRITEFILE):
            parts = first.split()
            if len(parts) == 2:
                files[parts[1]] = body if body.endswith("\n") else body + "\n"
    return files


def prepare(repo: Path, lab: str, needed: tuple[str, ...], folder: Path) -> tuple[str, str]:
    """Write the lab's exercise files into ``folder``; (where they came from, what is missing: "" when nothing)."""
    folder.mkdir(parents=True, exist_ok=True)
    if not needed:
        return "", ""
    notebook = repo / "solutions" / lab / f"{lab}.ipynb"
    if notebook.is_file():
        files = writefile_cells(notebook)
        missing = [name for name in needed if name not in files]
        if not missing:
            for name, source in files.items():
                (folder / name).write_text(source)
            return f"solutions/{lab} (%%writefile cells)", ""
    student = repo / "labs" / lab
    present = [name for name in needed if (student / name).is_file()]
    stubs = [name for name in present if exercise.unwritten(student / name)]
    absent = [name for name in needed if name not in present]
    if absent or stubs:
        why = []
        if absent:
            why.append(f"{', '.join(absent)} not written yet")
        if stubs:
            why.append(f"{', '.join(stubs)} still hold the released stubs")
        return "", (f"needs lab {lab[:2]}'s exercise files in labs/{lab}/ ({'; '.join(why)}): run the lab's "
                    f"%%writefile exercise cells first")
    for path in student.glob("*_impl.py"):
        shutil.copy(path, folder / path.name)
    return f"labs/{lab} (your files)", ""
