"""Answer-equal references for the hidden tests: code that computes a graded exercise's answer.

Only the course repository has this package (``instructor/`` is never shipped to students, and
``launchers/release --student-repo`` refuses to build if anything it ships names it). A solution notebook's hidden
test cells import it (``from instructor.references import ...``); a visible check never does: it grades properties
a student's other answers cannot break and no reference has to equal (sums, shapes, collectives by kind and bytes,
agreement with PyTorch's own implementations, invariants of a schedule).
"""
