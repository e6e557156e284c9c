"""nbgrader configuration for the course (read by `nbgrader ...` run from the repository root).

solutions/NN_name/NN_name.ipynb is the instructor source; labs/NN_name/ is the student release.
Grading work folders live under grading/ (ignored by git); see launchers/grade.
"""

import os

c = get_config()  # noqa: F821 - provided by nbgrader

HERE = os.path.dirname(os.path.abspath(__file__))
# The gradebook lives in grading/, which a fresh clone does not have (git ignores it): without the folder
# SQLite cannot open the gradebook and Formgrader's assignment list fails (HTTP 500, "Loading..." for ever).
os.makedirs(os.path.join(HERE, "grading"), exist_ok=True)

c.CourseDirectory.root = HERE
c.CourseDirectory.course_id = "distributed-training-labs"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "labs"
c.CourseDirectory.submitted_directory = "grading/submitted"
c.CourseDirectory.autograded_directory = "grading/autograded"
c.CourseDirectory.feedback_directory = "grading/feedback"
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(HERE, "grading", "gradebook.db")
# Files a lab writes while it runs (exercise modules, JSON results, saved tensors) are never released.
c.CourseDirectory.ignore = [
    ".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback",
    "*_impl.py", "*.json", "*.pt",
]

# A cell that launches a torchrun step can take minutes; the launcher has its own, shorter timeout.
c.Execute.timeout = 600
c.Execute.startup_timeout = 120
# A student who deletes or reorders graded cells gets them back from the source when grading.
c.OverwriteCells.add_missing_cells = True
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
# Feedback goes back to students: it shows each graded cell's outputs and points, never the hidden tests' source
# (nbgrader's default feedback renders the autograded notebook, hidden regions included; ClearHiddenTests removes them
# after the grades are read, and instructor.feedback.ShortTracebacks keeps of a failing test cell's traceback only the
# check's message, since a traceback quotes the hidden lines around the failure).
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
    "nbgrader.preprocessors.ClearHiddenTests",
    "instructor.feedback.ShortTracebacks",
]
