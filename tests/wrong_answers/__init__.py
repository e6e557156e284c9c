"""Per lab, the mistakes students really make: WRONG_ANSWERS = {exercise grade_id: [(description, cell source)]}.

tests/test_labs.py replaces each exercise cell with each wrong source in a kernel that ran the solution,
re-runs that exercise's test cells (grade_id test_<exercise>...), and requires that some of them fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

_SOLUTIONS = Path(__file__).resolve().parents[2] / "solutions"
_MARKERS = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*(\n|$)", re.MULTILINE)


class SolutionCells:
    """A lab's solution cells as answers: ``source(grade_id)`` is the cell without the solution markers, and
    ``changed(grade_id, (old, new), ...)`` is that cell with one mistake put in. It checks that each text it
    replaces is there, so a change to the solution cannot silently turn a wrong answer into the right one.

        _cells = SolutionCells("06_ddp_from_scratch")
        WRONG_ANSWERS = {"assign_buckets": [("returns the buckets last first",
                         _cells.changed("assign_buckets", ("    return buckets\\n", "    return buckets[::-1]\\n")))]}
    """

    def __init__(self, lab: str):
        self.lab = lab
        self.nb = nbformat.read(_SOLUTIONS / lab / f"{lab}.ipynb", as_version=4)

    def source(self, grade_id: str) -> str:
        for cell in self.nb.cells:
            if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id:
                return _MARKERS.sub("", cell.source)
        raise KeyError(f"{self.lab} has no cell with grade_id {grade_id!r}")

    def changed(self, grade_id: str, *replacements: tuple[str, str]) -> str:
        source = self.source(grade_id)
        for old, new in replacements:
            assert old in source, f"{self.lab} {grade_id}: the solution no longer contains {old!r}"
            source = source.replace(old, new)
        return source
