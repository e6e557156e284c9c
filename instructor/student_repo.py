"""The repository students clone: the released labs and what runs them, and nothing an answer can be read from.

    launchers/release --student-repo DIR        (python -m instructor.student_repo DIR)

The course repository carries ``solutions/`` (the answers), the hidden tests inside them, ``tests/`` (with
``tests/labs/``) and this package. The student repository gets ``labs/``, ``lablib/``, the
``lab`` launcher with its set-up script, ``environment.yml``, ``requirements.txt``, ``pyproject.toml``
and a README written for students, committed as a fresh git repository with no history. ``audit`` then
reads every file written and refuses the result if any holds a line of a solution or a hidden test.
"""

from __future__ import annotations

import argparse
import io
import re
import tokenize
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from instructor.course import LABS, REPO, SOLUTIONS, all_labs

SHIPPED = ["labs", "lablib", "launchers/lab", "launchers/_setup.sh", "launchers/multinode", "launchers/slurm.sbatch",
           "launchers/deepspeed", "launchers/gpu-check", "environment.yml", "requirements.txt", "requirements-deepspeed.txt", "pyproject.toml"]
NEVER = re.compile(r"(__pycache__|\.ipynb_checkpoints|\.egg-info|_impl\.py$|\.pyc$)")
SOLUTION_REGION = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)
HIDDEN_REGION = re.compile(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", re.S)
MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")


def substantial(line: str) -> bool:
    """A line worth protecting: 25+ non-space characters of code, not a comment or a docstring quote."""
    line = line.strip()
    return len(code_key(line)) >= 25 and not line.startswith(("#", '"""', "'''"))


def code_key(line: str) -> str:
    """A line's code with its comment and every space taken out, so that ``x = f(a)  # why`` and ``x=f(a)`` compare
    equal: a trailing comment or a reformatting does not hide a copied answer line. A line that is part of a longer
    statement (an open bracket, a string that goes on) keeps the tokens read before the break."""
    kept = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline):
            if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                  tokenize.ENDMARKER):
                kept.append(token.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        if not kept:   # e.g. the middle of a triple-quoted string: its text, without spaces
            return "".join(line.split())
    return "".join("".join(kept).split())


# Answer lines that are fair to share, each with the reason (compared as code, like every other line).
FAIR_TO_SHARE = {code_key(line): why for line, why in {
    "model.finish_gradient_synchronization()":
        "lab 11's sync_gradients for lab 06's classes is lab 06's published contract (both released notebooks name "
        "the method: wait for every handle); the course's own runs of lab 06's classes "
        "(lablib.labs.ddp_from_scratch.run_ddp_overlap) make the same call, and the exercise grades the plumbing around it",
    "dist.destroy_process_group()":
        "lab 00's script skeleton ends with it in `finally`, as every course step does (lablib.jobs.distenv); the "
        "exercise grades where it stands and what surrounds it, not the call",
    "n, rank = comm.world_size, comm.rank":
        "an unpacking of the communicator's two public fields, which any code over that communicator starts with",
    "q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))":
        "the course GPT's own head split (lablib.course.models, which lab 08 parallelises): the exercise is which "
        "heads each rank keeps and the f/g around them, not the reshape",
}.items()}


def library_lines() -> set[str]:
    """The code of every line of the package students install (lablib), keyed as ``code_key`` keys them."""
    return {code_key(line) for path in (REPO / "lablib").rglob("*.py") for line in path.read_text().splitlines()}


def protected_lines() -> dict[str, tuple[str, str]]:
    """Every substantial line of a solution region or hidden test -> (the lab it comes from, the line), keyed by its code
    (``code_key``), leaving out lines that the source also shows outside those regions (a visible line a hidden test
    repeats is no secret), the few lines of FAIR_TO_SHARE, and hidden-test lines that lablib itself holds (a hidden
    test that calls the library as any caller does, e.g. ``owned = not dist.is_initialized()``, tells a student
    nothing the installed package does not; a solution line in lablib is still a leak, whatever the hidden tests say)."""
    protected: dict[str, tuple[str, str]] = {}
    library = library_lines()
    for lab in all_labs():
        cells = nbformat.read(SOLUTIONS / lab / f"{lab}.ipynb", as_version=4).cells
        visible = {code_key(line) for cell in cells
                   for line in HIDDEN_REGION.sub("", SOLUTION_REGION.sub("", cell.source)).splitlines()}
        for cell in cells:
            regions = [(region, False) for region in SOLUTION_REGION.findall(cell.source)]
            regions += [(region, True) for region in HIDDEN_REGION.findall(cell.source)]
            for region, hidden_test in regions:
                for line in region.splitlines():
                    key = code_key(line)
                    if hidden_test and key in library:
                        continue
                    if substantial(line) and key not in visible and key not in FAIR_TO_SHARE:
                        protected.setdefault(key, (lab, line.strip()))
    return protected


# Code that reaches the instructor's package (its answer-equal references above all): a shipped module or cell that
# imports it would either fail for the student or, were the package ever shipped, hand over the references.
REACHES_INSTRUCTOR = re.compile(r"^\s*(?:from\s+instructor\b|import\s+instructor\b)|\binstructor\.references\b|"
                                r"\bimportlib\.import_module\(\s*[\"']instructor\b", re.M)


def audit(root: Path) -> list[str]:
    """'path: what' for each file under root that holds a solution or hidden-test line, their markers, or code
    that reaches the instructor's package (``instructor.references``: the hidden tests' answer-equal references)."""
    protected = protected_lines()
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and ".git" not in p.relative_to(root).parts):
        text = path.read_text(errors="replace")
        if path.suffix == ".ipynb":  # compare cell sources line by line, as the student reads them
            text = "\n".join(c.source for c in nbformat.reads(text, as_version=4).cells)
        for marker in MARKERS:
            if marker in text:
                found.append(f"{path.relative_to(root)}: marker {marker!r}")
        if path.suffix in (".py", ".ipynb") and REACHES_INSTRUCTOR.search(text):
            found.append(f"{path.relative_to(root)}: reaches the instructor's package: "
                         f"{REACHES_INSTRUCTOR.search(text).group(0).strip()!r}")
        for line in text.splitlines():
            if code_key(line) in protected:
                found.append(f"{path.relative_to(root)}: a line of {protected[code_key(line)][0]}'s answers: {line.strip()!r}")
    return found


def student_readme() -> str:
    table = re.search(r"## The labs\n\n(\|.*?)\n\n", (REPO / "README.md").read_text(), re.S)
    return f"""# Distributed Training Labs

Graded Jupyter labs on distributed training in PyTorch that run for real on a laptop CPU (several
processes talking through gloo) and unchanged on a GPU machine (NCCL, one GPU per process).

```bash
launchers/lab     # open the labs in JupyterLab (creates .venv the first time, ~1-3 min; then seconds)
```

You need Python 3.10+ (3.11 recommended) and `bash`. The first run installs the pinned environment from
`requirements.txt` (torch 2.13.0, JupyterLab, ...) into `.venv/`; later runs reuse it.
Conda users: `conda env create -f environment.yml`, then `jupyter lab` inside `labs/`.
Optional, for lab 11's DeepSpeed rows: `launchers/deepspeed` (needs a C++ compiler; its first run builds an op).

## The labs

{table.group(1) if table else ''}

Open `labs/NN_name/NN_name.ipynb`, run it top to bottom and fill in the cells marked `YOUR CODE HERE` /
`YOUR ANSWER HERE`. The check after each exercise says what was expected and what came back. The graded
version of each check may run more cases (other world sizes, shapes and dtypes) than you see.

Multi-process steps run as real `torchrun` jobs started from the notebook (`lablib/labs/<lab>/run.py` or
`run_<step>.py`); a timeout or "interrupt kernel" stops every process. If a step reports that a rank was
*killed by a signal*, that is the machine, not your code: run the cell again.

On several machines, every node runs the same command (step options after `--`), or Slurm starts one per node:
`launchers/multinode STEP --nnodes 2 --nproc-per-node 4 --rdzv-endpoint FIRST_NODE:29500`, or
`sbatch --nodes 2 launchers/slurm.sbatch STEP`. Rank 0's result goes to `results/<step>-<job id>.json`.

Hand in the notebook file itself (`labs/NN_name/NN_name.ipynb`), the way your course asks.
"""


def build(dest: Path) -> Path:
    """Write the student repository into dest (which must be empty or absent) and commit it."""
    dest = Path(dest).resolve()
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"{dest} is not empty; give a new folder for the student repository")
    if REPO in dest.parents or dest == REPO:
        raise SystemExit(f"{dest} is inside the course repository; give a folder outside it")
    missing = [lab for lab in all_labs() if not (LABS / lab / f"{lab}.ipynb").exists()]
    if missing:
        raise SystemExit(f"labs/ lacks {missing}: run launchers/release first")
    dest.mkdir(parents=True, exist_ok=True)
    for item in SHIPPED:
        source = REPO / item
        if source.is_dir():
            shutil.copytree(source, dest / item, ignore=lambda d, names: [n for n in names if NEVER.search(n)])
        else:
            (dest / item).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / item)
    (dest / "README.md").write_text(student_readme())
    (dest / ".gitignore").write_text(".venv/\n__pycache__/\n*.pyc\n.ipynb_checkpoints/\n*.egg-info/\n"
                                     "*_impl.py\nexecuted/\n")
    problems = audit(dest)
    if problems:
        shutil.rmtree(dest)
        raise SystemExit("the student repository would give answers away; nothing was written:\n" + "\n".join(problems))
    if shutil.which("git"):
        git = ["git", "-C", str(dest), "-c", "user.name=Course staff", "-c", "user.email=staff@example.invalid"]
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", "Distributed Training Labs (student release)"], check=True)
    return dest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="launchers/release --student-repo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path, help="a new folder, outside the course repository")
    args = parser.parse_args(argv)
    dest = build(args.dest)
    files = sum(1 for p in dest.rglob("*") if p.is_file() and ".git" not in p.relative_to(dest).parts)
    print(f"student repository: {dest} ({files} files, labs {', '.join(all_labs())}); audited: no answer in it")


if __name__ == "__main__":
    main(sys.argv[1:])
