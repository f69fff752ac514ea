"""The parts the figures of a sweep are built from (:mod:`analysis.plots` and the figure modules
beside it): a line with its 95 % band, an objective's line, a grid of panels wrapping at
MAX_COLUMNS, a title wrapped to the figure's width, one legend over nothing; and a table's
policies and speeds in figure order."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .objectives import Objective
from .styles import policy_order


#: Panels in a row before a figure of one panel per policy wraps to the next row.
MAX_COLUMNS = 4


LOAD_LABEL = "load (utilisation at the simulated speed)"


def _policies(frame: pd.DataFrame) -> list[str]:
    """The policies (or variant labels) of ``frame`` in figure order
    (analysis.styles.policy_order)."""
    return policy_order(frame["policy"])


def _speeds(frame: pd.DataFrame) -> list[float]:
    return sorted(frame["speed"].unique())


def _band(ax, agg: pd.DataFrame, x: str, y: str, label: str, **style) -> None:
    style = {"marker": "o", "ms": 3, **style}
    ax.plot(agg[x], agg[y], label=label, **style)
    # A t-interval over few seeds can reach below zero, or past 1 for a share; nothing plotted here
    # can.
    low, high = agg[f"{y}_low"].clip(lower=0), agg[f"{y}_high"]
    if y.startswith(("share", "jain")):
        high = high.clip(upper=1)
    ax.fill_between(agg[x], low, high, alpha=0.2, color=ax.lines[-1].get_color(), lw=0)


def _objective_lines(ax, metric: str, objectives: Sequence[Objective] | None) -> None:
    for o in objectives or ():
        if o.metric == metric:
            ax.axhline(o.value, color="black", ls="-.", lw=1, label=f"objective {o}")


def _grid(
    panels: int, size: tuple[float, float], blocks: int = 1, **subplots
) -> tuple[plt.Figure, list, list]:
    """A figure of ``blocks`` blocks of ``panels`` panels each, at most MAX_COLUMNS a row, each
    block starting a row of its own: the figure, each block's axes, and the spare axes (turned off:
    room for a legend)."""
    cols = min(panels, MAX_COLUMNS)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(
        rows * blocks,
        cols,
        figsize=(size[0] * cols, size[1] * rows * blocks),
        squeeze=False,
        layout="constrained",
        **subplots,
    )
    flat = list(axes.flat)
    per_block = rows * cols
    used = [flat[b * per_block : b * per_block + panels] for b in range(blocks)]
    spare = [ax for b in range(blocks) for ax in flat[b * per_block + panels : (b + 1) * per_block]]
    for ax in spare:
        ax.axis("off")
    return fig, used, spare


def _suptitle(fig: plt.Figure, text: str, fontsize: float = 10, **style) -> None:
    """The figure's title, wrapped to the figure's width: a title longer than the panels is cut
    at both sides when saved."""
    chars = max(20, int(fig.get_figwidth() * 72 / (fontsize * 0.6)))
    fig.suptitle(textwrap.fill(text, chars), fontsize=fontsize, **style)


def _legend(
    fig: plt.Figure, axes, spare: list | None = None, loc: str | None = None, **style
) -> None:
    """One legend for the figure, over nothing: every entry of ``axes`` once, in the first spare
    (empty) panel if there is one, else outside the panels (``loc``; default on the right, at the
    top, or halfway down where the figure has a title across it, which would run into the legend).
    Call it after suptitle."""
    entries = {}
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if not entries:
        return
    style = {"fontsize": 8, **style}
    if spare:
        spare[0].legend(entries.values(), entries.keys(), loc="center", **style)
    else:
        loc = loc or ("outside right center" if fig.get_suptitle() else "outside right upper")
        fig.legend(entries.values(), entries.keys(), loc=loc, **style)
