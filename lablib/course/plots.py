"""The course's matplotlib conventions: every axis titled and labelled with units, measured points as
markers, formula predictions as lines on the same axes."""

from __future__ import annotations

import os

import matplotlib.pyplot as plt

MEASURED = dict(marker="o", linestyle="none", markersize=6)
FORMULA = dict(linestyle="--", linewidth=1.5)


def axes(title: str, xlabel: str, ylabel: str, ax=None, figsize=(6.4, 4.0)):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return ax


def grid(n: int, figsize=None):
    fig, axs = plt.subplots(1, n, figsize=figsize or (5.2 * n, 3.8))
    return fig, list(axs) if n > 1 else [axs]


def annotate_bars(ax, bars, fmt: str = "{:.0f}") -> None:
    for bar in bars:
        ax.annotate(fmt.format(bar.get_height()), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)


def front_end_attached() -> bool:
    """True when the running cell was sent by an interactive front end (JupyterLab, Notebook 7, VS Code
    put a ``cellId`` in every execute request; nbclient, nbconvert and nbgrader send none)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None:  # plain Python or terminal IPython: no widgets there
        return False
    parent = kernel.get_parent() or {}
    return "cellId" in (parent.get("metadata") or {})


def headless() -> bool:
    """True when nobody can move a slider: nbgrader (NBGRADER_EXECUTION), launchers/lab --execute and the
    tests (LABLIB_HEADLESS=1), or any run without a front end. LABLIB_WIDGETS=1 forces widgets on for a
    front end that sends no cellId; grading always wins."""
    if os.environ.get("NBGRADER_EXECUTION") or os.environ.get("LABLIB_HEADLESS"):
        return True
    if os.environ.get("LABLIB_WIDGETS", "").strip().lower() in ("1", "true", "yes"):
        return False
    return not front_end_attached()


def explore(func, make_controls):
    """``ipywidgets.interact(func, **make_controls())`` for a person in JupyterLab.

    Headless, call ``func()`` once with its default arguments instead, and create no widget at all:
    widget output is not saved in an executed notebook, and nbclient can wait out a whole cell timeout
    after a cell that creates widgets (seen here: 600 s; jupyter/nbclient#312). So func's defaults are
    the static figure, and make_controls returns {argument name: ipywidget}, called only for a person.
    """
    if headless():
        return func()
    import ipywidgets

    return ipywidgets.interact(func, **make_controls())
