"""Per lab, the mistakes students really make: WRONG_ANSWERS = {exercise grade_id: [(description, cell source)]}.

tests/test_labs.py replaces each exercise cell with each wrong source in a kernel that ran the solution,
re-runs that exercise's test cells (grade_id test_<exercise>...), and requires that some of them fail.
"""
