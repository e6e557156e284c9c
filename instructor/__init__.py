"""Instructor tooling (release, headless execution, autograding, the student repository). It lives beside
``lablib``, not in it: students install ``lablib``; this package stays in the instructors' repository."""
