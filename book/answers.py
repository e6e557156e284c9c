"""nbgrader's solution regions as the self-study book shows them (book/build.py stages every lab through here).

A free-text answer is a markdown cell with nbgrader metadata ``solution: true``; its answer stands between
``### BEGIN SOLUTION`` and ``### END SOLUTION`` lines, its rubric for the grader in a paragraph that starts with
**Rubric...** (or between ``=== BEGIN MARK SCHEME ===`` and ``=== END MARK SCHEME ===``). Left as they are, the
marker lines render as headings, ``### BEGIN SOLUTION`` one in the page's contents too; here the answer goes into
a MyST admonition titled "Model answer" and the rubric into one titled "Rubric for the grader", and the markers go.
In code cells the markers become comments that say where the model answer starts and ends.

A reader who wants to try an exercise first must not meet its answer on the way: the boxes of a free-text answer are
folded into one native HTML ``<details>`` element ("Show the model answer"; it needs no script, so the book works
offline; book/_static/book.css opens it in print), and book/build.py folds the model-answer code cells the same way
(MyST-NB's ``hide-input``). Cells holding the grader's hidden tests are not shown at all (``remove-cell``).
"""

from __future__ import annotations

import re

# nbgrader's region markers: "### BEGIN SOLUTION" in code and markdown, "=== BEGIN MARK SCHEME ===" (the rubric,
# removed from the release) in markdown. nbgrader takes any line that contains the words for a marker.
MARKDOWN_MARKER = re.compile(r"\b(BEGIN|END) (SOLUTION|MARK SCHEME)\b")
CODE_MARKER = re.compile(r"^([ \t]*)#+[ \t]*(BEGIN|END) SOLUTION[ \t]*$", re.M)
CODE_MARKER_SHOWN = {"BEGIN": "# --- model answer ---", "END": "# --- end of the model answer ---"}
ANSWER_LABEL = re.compile(r"^\s*\*\*Model answer\.?\*\*\.?[ \t]*")
RUBRIC_LABEL = re.compile(r"^\*\*Rubric(?: for the grader)?[ \t]*(?:\(([^)\n]*)\))?\.?\*\*\.?[ \t]*", re.M)
MODEL_ANSWER, RUBRIC = "Model answer", "Rubric for the grader"
HIDDEN_TESTS = re.compile(r"\bBEGIN HIDDEN TESTS\b")   # nbgrader's hidden-test region of a test cell
SHOW_ANSWER, HIDE_ANSWER = "Show the model answer", "Hide the model answer"
FOLD_CLASS = "model-answer-fold"


def is_hidden_test_cell(cell) -> bool:
    """A code cell with a hidden-test region: the grader's code, which the book never shows."""
    return cell.cell_type == "code" and bool(HIDDEN_TESTS.search(cell.source))


def is_answer_code_cell(cell) -> bool:
    """A code cell with a model answer between nbgrader's solution markers (an exercise's cell)."""
    return cell.cell_type == "code" and bool(CODE_MARKER.search(cell.source))


def fold(markdown: str) -> str:
    """Markdown folded behind a "Show the model answer" control: a native <details> element shaped like MyST-NB's
    folded code cells (so that mystnb.css draws both alike), raw HTML blocks around the markdown, which MyST parses
    as usual between them (the blank lines end the HTML blocks)."""
    return (f'<details class="admonition hide {FOLD_CLASS}">\n<summary aria-label="Toggle hidden content">\n'
            f'<p class="collapsed admonition-title">{SHOW_ANSWER}</p>\n'
            f'<p class="expanded admonition-title">{HIDE_ANSWER}</p>\n</summary>\n\n{markdown.strip()}\n\n</details>')


def is_answer_cell(cell) -> bool:
    """A free-text answer: a markdown cell nbgrader treats as a solution (graded by hand)."""
    return cell.cell_type == "markdown" and bool(cell.metadata.get("nbgrader", {}).get("solution"))


def code_as_shown(source: str) -> str:
    """A code cell's source as the book shows it: nbgrader's solution markers become plain comments that say
    where the model answer starts and ends (a comment for a comment: the code and its line numbers stay)."""
    return CODE_MARKER.sub(lambda m: m.group(1) + CODE_MARKER_SHOWN[m.group(2)], source)


def fence_for(body: str) -> str:
    """A backtick fence longer than any run of backticks in the body, so that fenced blocks inside it nest."""
    return "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", body)), default=0))


def admonition(title: str, body: str) -> str:
    """A MyST admonition box (class model-answer or grader-rubric); its fence is longer than any run of backticks in
    the body, so that code blocks inside it nest."""
    fence = fence_for(body)
    css = "model-answer tip" if title == MODEL_ANSWER else "grader-rubric note"
    return f"{fence}{{admonition}} {title}\n:class: {css}\n\n{body.strip()}\n{fence}"


def answer_boxes(region: str, kind: str) -> list[str]:
    """One nbgrader region of a free-text answer cell as boxes: a SOLUTION region is the model answer, from its
    first paragraph that starts with **Rubric...** on the rubric; a MARK SCHEME region is all rubric."""
    label = RUBRIC_LABEL.search(region)
    before, after = (region[:label.start()], region[label.end():]) if label else (region, "")
    answer, rubric = ("", before + after) if kind == "MARK SCHEME" else (before, after)
    points = label.group(1) if label and label.group(1) else ""
    boxes = [admonition(MODEL_ANSWER, ANSWER_LABEL.sub("", answer))] if answer.strip() else []
    if rubric.strip():
        boxes.append(admonition(f"{RUBRIC} ({points})" if points else RUBRIC, rubric))
    return boxes


def free_text_answer(markdown: str) -> str:
    """A markdown solution cell as the book shows it: the text between nbgrader's markers in labelled boxes, folded,
    the markers gone (as lines they render as headings, "### BEGIN SOLUTION" one in the page's contents too),
    the text around the markers (a question in the same cell) as it is. Without markers nbgrader takes the whole
    cell for the answer, and so does the book."""
    if not MARKDOWN_MARKER.search(markdown):
        return fold("\n\n".join(answer_boxes(markdown, "SOLUTION"))) + "\n"
    blocks, region, kind = [""], [], None
    for line in markdown.splitlines():
        marker = MARKDOWN_MARKER.search(line)
        if marker and marker.group(1) == "BEGIN":
            kind, region = marker.group(2), []
        elif marker:   # END (a stray one is dropped too)
            if kind:
                blocks += [fold("\n\n".join(answer_boxes("\n".join(region), kind))), ""]
            kind = None
        elif kind:
            region.append(line)
        else:
            blocks[-1] += line + "\n"
    if kind:   # a region nbgrader would refuse (no END): its text is still the answer
        blocks.append(fold("\n\n".join(answer_boxes("\n".join(region), kind))))
    return "\n\n".join(block.strip("\n") for block in blocks if block.strip()) + "\n"
