"""Wrong answers for lab 03 (tests/labkit.py: the lab's answer files)."""

_GUSTAFSON_OK = '''

def gustafson_speedup(p, world_size):
    return (1.0 - p) + p * world_size
'''

_AMDAHL_OK = '''def amdahl_speedup(p, world_size):
    return 1.0 / ((1.0 - p) + p / world_size)

'''

_PREDICT_SPEEDUP_OK = '''

def predict_speedup(t_compute, t_opt, t_comm, overlap, world_size):
    return predict_step_time(t_compute, t_opt, 0.0, overlap, 1) / predict_step_time(t_compute, t_opt, t_comm, overlap, world_size)
'''

WRONG_ANSWERS = {
    "amdahl_laws": [
        ("returns the normalised time (1-p) + p/N instead of its reciprocal", '''
def amdahl_speedup(p, world_size):
    return (1.0 - p) + p / world_size
''' + _GUSTAFSON_OK),
        ("swaps the serial and the parallel fraction", '''
def amdahl_speedup(p, world_size):
    return 1.0 / (p + (1.0 - p) / world_size)
''' + _GUSTAFSON_OK),
        ("Gustafson's law written as Amdahl's", _AMDAHL_OK + '''
def gustafson_speedup(p, world_size):
    return 1.0 / ((1.0 - p) + p / world_size)
'''),
        ("Gustafson with the serial fraction also multiplied by N", _AMDAHL_OK + '''
def gustafson_speedup(p, world_size):
    return world_size * ((1.0 - p) + p)
'''),
        ("an if on the values (N = 1 special-cased): breaks on NumPy arrays of world sizes", '''
def amdahl_speedup(p, world_size):
    if world_size == 1:
        return 1.0
    return 1.0 / ((1.0 - p) + p / world_size)
''' + _GUSTAFSON_OK),
        ("float() around Gustafson's result: works on numbers, fails on arrays", '''
def amdahl_speedup(p, world_size):
    return 1.0 / ((1.0 - p) + p / world_size)


def gustafson_speedup(p, world_size):
    return float((1.0 - p) + p * world_size)
'''),
    ],
    "fit_amdahl_p": [
        ("drops the N = 1 baseline from the caller's lists in place (del), copying only tuples and arrays", '''
def fit_amdahl_p(world_sizes, speedups):
    if not isinstance(world_sizes, list):
        world_sizes, speedups = list(world_sizes), list(speedups)
    while 1 in world_sizes:                      # the baseline says nothing about p: drop it
        i = world_sizes.index(1)
        del world_sizes[i], speedups[i]
    if not world_sizes:
        raise ValueError("need a point with N > 1")
    xs = [1 - 1 / n for n in world_sizes]
    ys = [1 - 1 / s for s in speedups]
    return float(sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
'''),
        ("fits the speedup instead of the time (least squares on S, by a fine grid search)", '''
import numpy as np

def fit_amdahl_p(world_sizes, speedups):
    n = np.asarray(world_sizes, dtype=float)
    s = np.asarray(speedups, dtype=float)
    if np.all(n == 1):
        raise ValueError("need a point with N > 1")
    grid = np.linspace(-2.0, 1.0, 300001)
    errors = [np.sum((s - 1.0 / ((1.0 - p) + p / n)) ** 2) for p in grid]
    best = grid[int(np.argmin(errors))]
    fine = np.linspace(best - 1e-5, best + 1e-5, 2001)
    errors = [np.sum((s - 1.0 / ((1.0 - p) + p / n)) ** 2) for p in fine]
    return float(fine[int(np.argmin(errors))])
'''),
        ("averages the per-point estimates of p instead of a least-squares fit", '''
def fit_amdahl_p(world_sizes, speedups):
    estimates = [(1 - 1 / s) / (1 - 1 / n) for n, s in zip(world_sizes, speedups) if n > 1]
    if not estimates:
        raise ValueError("need a point with N > 1")
    return float(sum(estimates) / len(estimates))
'''),
        ("treats the speedup as the normalised time: fits S = (1-p) + p/N (the law not inverted)", '''
def fit_amdahl_p(world_sizes, speedups):
    xs = [1 - 1 / n for n in world_sizes]
    ys = [1 - s for s in speedups]
    sxx = sum(x * x for x in xs)
    if sxx == 0:
        raise ValueError("need a point with N > 1")
    return float(sum(x * y for x, y in zip(xs, ys)) / sxx)
'''),
        ("ordinary linear regression with an intercept (the model has none)", '''
import numpy as np

def fit_amdahl_p(world_sizes, speedups):
    x = 1 - 1 / np.asarray(world_sizes, dtype=float)
    y = 1 - 1 / np.asarray(speedups, dtype=float)
    if np.all(x == 0):
        raise ValueError("need a point with N > 1")
    slope, intercept = np.polyfit(x, y, 1)
    return float(slope)
'''),
        ("caps p at 1 (a superlinear speedup taken for noise)", '''
def fit_amdahl_p(world_sizes, speedups):
    xs = [1 - 1 / n for n in world_sizes]
    ys = [1 - 1 / s for s in speedups]
    sxx = sum(x * x for x in xs)
    if sxx == 0:
        raise ValueError("need a point with N > 1")
    return float(min(1.0, sum(x * y for x, y in zip(xs, ys)) / sxx))
'''),
        ("averages the speedups of each world size before fitting (fewer points, a different p)", '''
def fit_amdahl_p(world_sizes, speedups):
    by_n = {}
    for n, s in zip(world_sizes, speedups):
        by_n.setdefault(n, []).append(s)
    xs = [1 - 1 / n for n in by_n]
    ys = [1 - len(v) / sum(v) for v in by_n.values()]
    sxx = sum(x * x for x in xs)
    if sxx == 0:
        raise ValueError("need a point with N > 1")
    return float(sum(x * y for x, y in zip(xs, ys)) / sxx)
'''),
        ("np.linalg.lstsq's solution returned as is: an array of shape (1,), not a float", '''
import numpy as np

def fit_amdahl_p(world_sizes, speedups):
    x = 1 - 1 / np.asarray(world_sizes, dtype=float)
    y = 1 - 1 / np.asarray(speedups, dtype=float)
    if not np.any(x):
        raise ValueError("need a point with N > 1")
    return np.linalg.lstsq(x[:, None], y, rcond=None)[0]
'''),
        ("clips p to [0, 1], hiding a slowdown", '''
def fit_amdahl_p(world_sizes, speedups):
    xs = [1 - 1 / n for n in world_sizes]
    ys = [1 - 1 / s for s in speedups]
    sxx = sum(x * x for x in xs)
    if sxx == 0:
        raise ValueError("need a point with N > 1")
    return float(min(1.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sxx)))
'''),
    ],
    "predict_speedup": [
        ("forgets the overlap: all communication exposed", '''
def predict_step_time(t_compute, t_opt, t_comm, overlap, world_size):
    return t_compute / world_size + t_opt + t_comm
''' + _PREDICT_SPEEDUP_OK),
        ("uses overlap instead of (1 - overlap)", '''
def predict_step_time(t_compute, t_opt, t_comm, overlap, world_size):
    return t_compute / world_size + t_opt + overlap * t_comm
''' + _PREDICT_SPEEDUP_OK),
        ("divides the optimizer step by N too", '''
def predict_step_time(t_compute, t_opt, t_comm, overlap, world_size):
    return (t_compute + t_opt) / world_size + (1 - overlap) * t_comm
''' + _PREDICT_SPEEDUP_OK),
        ("inverted speedup: t_N / t_1", '''
def predict_step_time(t_compute, t_opt, t_comm, overlap, world_size):
    return t_compute / world_size + t_opt + (1 - overlap) * t_comm


def predict_speedup(t_compute, t_opt, t_comm, overlap, world_size):
    return predict_step_time(t_compute, t_opt, t_comm, overlap, world_size) / predict_step_time(t_compute, t_opt, 0.0, overlap, 1)
'''),
        ("forgets the optimizer step in the single-rank time", '''
def predict_step_time(t_compute, t_opt, t_comm, overlap, world_size):
    return t_compute / world_size + t_opt + (1 - overlap) * t_comm


def predict_speedup(t_compute, t_opt, t_comm, overlap, world_size):
    return t_compute / predict_step_time(t_compute, t_opt, t_comm, overlap, world_size)
'''),
        ("divides the communication by N as well (it does not shrink)", '''
def predict_step_time(t_compute, t_opt, t_comm, overlap, world_size):
    return t_compute / world_size + t_opt + (1 - overlap) * t_comm / world_size
''' + _PREDICT_SPEEDUP_OK),
        ("hard-codes the visible example's world size (compute / 4)", '''
def predict_step_time(t_compute, t_opt, t_comm, overlap, world_size):
    return t_compute / 4 + t_opt + (1 - overlap) * t_comm
''' + _PREDICT_SPEEDUP_OK),
        ("charges the communication to the single-rank baseline too", '''
def predict_step_time(t_compute, t_opt, t_comm, overlap, world_size):
    return t_compute / world_size + t_opt + (1 - overlap) * t_comm


def predict_speedup(t_compute, t_opt, t_comm, overlap, world_size):
    return predict_step_time(t_compute, t_opt, t_comm, overlap, 1) / predict_step_time(t_compute, t_opt, t_comm, overlap, world_size)
'''),
    ],
    "lr_answer": [
        ("linear scaling without warm-up", 'lr_answer = "b"'),
        ("keeps the learning rate", 'lr_answer = "a"'),
    ],
    "serial_answer": [
        ("all communication counted as serial", 'serial_answer = "a"'),
        ("assumes DDP hides all communication", 'serial_answer = "c"'),
    ],
}

# Correct answers written differently: each must keep full marks on its exercise's test cells, visible and
# hidden (tests/test_lablib_scaling.py runs them against the solution's test cells, without a kernel).
CORRECT_VARIANTS = {
    "amdahl_laws": [
        ("NumPy ufuncs, and the algebraically equal forms N / (N(1-p) + p) and N - (1-p)(N-1)", '''
import numpy as np

def amdahl_speedup(p, world_size):
    return np.divide(world_size, np.multiply(world_size, 1 - p) + p)


def gustafson_speedup(p, world_size):
    return world_size - (1 - p) * (world_size - 1)
'''),
    ],
    "fit_amdahl_p": [
        ("NumPy dot products, N = 1 points dropped first", '''
import numpy as np

def fit_amdahl_p(world_sizes, speedups):
    n = np.asarray(world_sizes, dtype=float)
    s = np.asarray(speedups, dtype=float)
    keep = n > 1
    if not keep.any():
        raise ValueError(f"no world size above 1 in {list(world_sizes)}: nothing to fit")
    x, y = 1 - 1 / n[keep], 1 - 1 / s[keep]
    return float(x @ y / (x @ x))
'''),
        ("np.linalg.lstsq on a one-column design matrix, converted to float", '''
import numpy as np

def fit_amdahl_p(world_sizes, speedups):
    x = 1 - 1 / np.asarray(world_sizes, dtype=float)
    y = 1 - 1 / np.asarray(speedups, dtype=float)
    if not np.any(x):
        raise ValueError("need at least one point with N > 1")
    return float(np.linalg.lstsq(x[:, None], y, rcond=None)[0][0])
'''),
    ],
    "predict_speedup": [
        ("the speedup written out without calling predict_step_time; hidden share subtracted", '''
def predict_step_time(t_compute, t_opt, t_comm, overlap, world_size):
    hidden = overlap * t_comm
    return t_compute / world_size + t_opt + t_comm - hidden


def predict_speedup(t_compute, t_opt, t_comm, overlap, world_size):
    return (t_compute + t_opt) / (t_compute / world_size + t_opt + (1 - overlap) * t_comm)
'''),
    ],
}
