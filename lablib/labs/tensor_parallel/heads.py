"""Lab 08: what the checks ask of a split that cannot be made, and of an attention's split by heads.

- ``head_split_problems``: given where each rank's c_attn rows and c_proj columns were found in the full weights
  (by value), whether each rank holds whole heads, every head on exactly one rank.
- ``probe_indivisible`` / ``check_indivisible``: a size the group does not divide must be refused up front with a
  ``ValueError`` raised by the student's own code (not by a torch operation that fails later), whose message gives
  both numbers as numbers (``5`` in "n_head=5", not inside "15" or "0.5"), for two sizes, so neither a fixed text
  nor a message that happens to contain the digits passes: the attention's head count (n_head = N + 1 and 2N + 1),
  and the linear layers' widths (``ColumnParallelLinear``'s output features, ``RowParallelLinear``'s input
  features, N + 1 and 2N + 1).
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import torch.nn as nn

from lablib import checks
from lablib.course.models import CausalSelfAttention, GPTConfig

REFUSED = {"attention": "TensorParallelAttention", "column": "ColumnParallelLinear", "row": "RowParallelLinear"}
WHAT = {"attention": "n_head", "column": "out_features", "row": "in_features"}


def head_split_problems(rows: list[list[int]], columns: list[list[int]], n_embd: int, n_head: int) -> list[str]:
    """What is wrong with an attention's split over ranks, given where each rank's c_attn rows (``rows[r]``, indices
    into the full c_attn's 3 * n_embd rows: q, then k, then v) and c_proj columns (``columns[r]``, into its n_embd
    input columns) sit in the full weights, -1 for one found nowhere. Right: each rank holds the q, k and v rows of
    whole heads (head h: rows h * head_size .. (h + 1) * head_size - 1 of each of q, k and v) and c_proj's columns
    of the same heads, in any order; every head on exactly one rank. [] when all is right."""
    size = n_embd // n_head
    problems, heads_per_rank = [], []
    for r, (mine, cols) in enumerate(zip(rows, columns)):
        if -1 in mine:
            problems.append(f"rank {r}: row {mine.index(-1)} of its c_attn (with its bias) is no row of the full "
                            f"c_attn: copy whole rows of the weight and the same rows of the bias")
            continue
        if -1 in cols:
            problems.append(f"rank {r}: column {cols.index(-1)} of its c_proj.weight is no column of the full one: "
                            f"copy whole columns")
            continue
        heads = sorted({j % n_embd // size for j in mine})
        whole = sorted(part * n_embd + h * size + c for part in range(3) for h in heads for c in range(size))
        if sorted(mine) != whole:
            problems.append(f"rank {r}: its c_attn rows are not the q, k and v rows of whole heads (they touch heads "
                            f"{heads}; head h is rows h*{size}..h*{size}+{size - 1} of each of q, k and v, "
                            f"head_size={size}, and all {3 * size} of them belong on one rank)")
            continue
        if sorted(cols) != sorted(h * size + c for h in heads for c in range(size)):
            problems.append(f"rank {r}: its c_proj columns are not the channels of the heads its c_attn holds, "
                            f"{heads}: the output projection takes the same heads' outputs")
            continue
        heads_per_rank.append(heads)
    if not problems and sorted(h for heads in heads_per_rank for h in heads) != list(range(n_head)):
        problems.append(f"heads per rank {heads_per_rank}: each of the {n_head} heads must be on exactly one rank "
                        f"(rank r = dist.get_rank(group) keeps its own n_head / N of them)")
    return problems


def _has_number(message: str, n: int) -> bool:
    """n written as a number of its own in message: not a digit of a longer number or of a decimal."""
    return re.search(rf"(?<![\d.]){n}(?![\d]|\.\d)", message) is not None


def probe_indivisible(impl, kind: str, tp: int, group) -> dict:
    """The student's class built with a size tp does not divide, twice (N + 1 and 2N + 1): what it raised, where
    (the innermost frame's file: the student's own module, or a library's), and its message."""
    out = {"kind": kind, "tp": tp, "what": WHAT[kind], "tries": []}
    own = Path(impl.__file__).resolve()
    for size in (tp + 1, 2 * tp + 1):
        if kind == "attention":
            module = CausalSelfAttention(GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=size, n_embd=4 * size))
        else:
            module = nn.Linear(5, size) if kind == "column" else nn.Linear(size, 5)
        tried = {"size": size, "raised": None, "message": "", "in_own_code": False, "raised_at": ""}
        try:
            getattr(impl, REFUSED[kind])(module, group)
        except Exception as exc:  # noqa: BLE001 - which error is the result
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            tried.update(raised=type(exc).__name__, message=str(exc), raised_at=f"{Path(frame.filename).name}:{frame.lineno}",
                         in_own_code=Path(frame.filename).resolve() == own)
        out["tries"].append(tried)
    return out


def check_indivisible(r: dict) -> None:
    cls = REFUSED[r["kind"]]
    for t in r["tries"]:
        where = f"{cls} with {r['what']}={t['size']} on {r['tp']} ranks"
        checks.check_equal(t["raised"], "ValueError", f"{where}: the error raised",
                           hint="check the size up front, in __init__, and raise ValueError")
        checks.check_true(t["in_own_code"], f"{where}: the ValueError came from {t['raised_at']}, not from your own "
                          f"check: {t['message']!r}", hint="test the size yourself and raise before any tensor is split")
        checks.check_true(_has_number(t["message"], t["size"]) and _has_number(t["message"], r["tp"]),
                          f"{where}: the message must give {r['what']} ({t['size']}) and the tensor-parallel size "
                          f"({r['tp']}) as numbers; got {t['message']!r}",
                          hint=f"e.g. f\"{r['what']}={{...}} does not split over {{N}} ranks\"")
