"""Every test file in exactly one tier (tests/conftest.py TIERS), every tier's file present, no two test files with
one name (pytest imports them by name): so `-m unit`, `-m ranks`, `-m labs` and `-m system` split the suite."""

from collections import Counter
from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent


def test_every_test_file_is_in_exactly_one_tier():
    files = sorted(TESTS.rglob("test_*.py"))
    names = Counter(p.stem for p in files)
    assert not [n for n, k in names.items() if k > 1], f"two test files share a name: {[n for n, k in names.items() if k > 1]}"
    listed = Counter(stem for stems in conftest.TIERS.values() for stem in stems)
    assert not [s for s, k in listed.items() if k > 1], f"in two tiers: {[s for s, k in listed.items() if k > 1]}"
    assert set(listed) == set(names), (f"files in no tier: {sorted(set(names) - set(listed))}; "
                                       f"tiers naming no file: {sorted(set(listed) - set(names))}")


def test_one_labs_own_tests_stand_in_its_folder():
    labs = {p.name for p in (TESTS / "labs").iterdir() if p.is_dir() and p.name[:2].isdigit()}
    import labkit

    assert labs == set(labkit.labs()), f"tests/labs/ folders {sorted(labs ^ set(labkit.labs()))} match no lab (or a lab has none)"
    for lab in labs:
        assert (TESTS / "labs" / lab / "answers.py").is_file(), f"tests/labs/{lab}/answers.py is missing"
        strays = [p.name for p in (TESTS / "labs" / lab).glob("*.py")
                  if p.stem not in labkit.ANSWER_FILES and not p.name.startswith("test_")]
        assert not strays, f"tests/labs/{lab}/ holds {strays}: a lab's folder holds answers.py, redteam.py and test_*.py"
