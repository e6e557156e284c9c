"""lablib.course.commcost: the alpha-beta fit recovers known parameters; bad input fails with a clear message."""

import math

import pytest

from lablib.course import commcost


def test_fit_recovers_exact_line():
    alpha, beta = 50e-6, 1 / 2e9
    xs = [2.0 ** k for k in range(10, 27, 2)]
    ts = [commcost.alpha_beta_time(alpha, beta, x) for x in xs]
    a, b = commcost.fit_alpha_beta(xs, ts)
    assert math.isclose(a, alpha, rel_tol=1e-9)
    assert math.isclose(b, beta, rel_tol=1e-9)
    assert math.isclose(commcost.crossover_bytes(a, b), alpha / beta, rel_tol=1e-9)


def test_fit_weights_small_messages():
    # 10% noise on the largest point must not swamp the latency estimate (relative weighting).
    alpha, beta = 100e-6, 1e-9
    xs = [1e3, 1e4, 1e5, 1e6, 1e7, 1e8]
    ts = [alpha + beta * x for x in xs]
    ts[-1] *= 1.1
    a, _ = commcost.fit_alpha_beta(xs, ts)
    assert 0.8 * alpha < a < 1.2 * alpha


def test_steps_multiply_latency():
    assert commcost.alpha_beta_time(1e-6, 1e-9, 1000, steps=6) == pytest.approx(6e-6 + 1e-6)


@pytest.mark.parametrize("xs, ts, match", [([1.0], [1.0], "at least two"), ([1.0, 2.0], [1.0, 0.0], "positive"),
                                          ([5.0, 5.0], [1.0, 1.0], "different message sizes")])
def test_fit_rejects_bad_input(xs, ts, match):
    with pytest.raises(ValueError, match=match):
        commcost.fit_alpha_beta(xs, ts)


def test_tables_are_numbers():
    assert set(commcost.INTERCONNECTS) == {"NVLink", "PCIe", "InfiniBand"}
    assert all(v > 1e9 for v in commcost.INTERCONNECTS.values())
    assert commcost.MODELS["LLaMA-7B"] == 6.74e9


def test_flat_times_give_no_crossover():
    """Equal times at two sizes fit beta = 0 (a latency-bound curve): the crossover is refused with a message, not a
    ZeroDivisionError."""
    a, beta = commcost.fit_alpha_beta([1e3, 1e6], [1e-3, 1e-3])
    assert beta == pytest.approx(0.0, abs=1e-15)
    with pytest.raises(ValueError, match="positive beta"):
        commcost.crossover_bytes(a, beta)
