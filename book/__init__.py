"""The self-study book of the course (launchers/book): Sphinx + MyST-NB over the executed solutions."""
