"""What the feedback students get back may show: each graded cell's outputs and points, never the hidden tests.

nbgrader's feedback renders the autograded notebook. ``ClearHiddenTests`` (configured in nbgrader_config.py) removes the
hidden regions from the cells' source, but a failing test cell's traceback quotes the lines around the failure, hidden
ones included. ``ShortTracebacks`` keeps of every graded cell's error only its last line, the exception and its message
(the check's own words: what was expected, what came back, the hint).
"""

from __future__ import annotations

from nbconvert.preprocessors import Preprocessor
from traitlets import Bool


class ShortTracebacks(Preprocessor):
    # nbconvert's preprocessors start disabled (nbgrader's own start enabled): this one runs whenever it is listed
    enabled = Bool(True).tag(config=True)

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code" and cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
            for output in cell.get("outputs", []):
                if output.get("output_type") == "error":
                    output["traceback"] = [f"{output.get('ename', 'Error')}: {output.get('evalue', '')}"]
        return cell, resources
