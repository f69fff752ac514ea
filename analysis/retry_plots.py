"""Figures of clients that retry (a sweep's retry axis): goodput and offered attempts over time
(timeseries.parquet) and the recovery after a surge, a line per retry behaviour (or other axis
that varies within a policy)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .metrics import aggregate
from .plot_panels import _legend, _policies, _suptitle


RETRY_ORDER = ["none", "immediate", "exponential", "retry-after", "budget"]
#: The axes other than the policy (a panel each) that may tell a time series' lines apart.
_LINE_AXES = (
    "retry",
    "patience",
    "clients",
    "estimator",
    "used",
    "speed_schedule",
    "fixed_estimate",
    "cancel_at_deadline",
    "arrivals",
    "policy_args",
    "load",
    "speed",
    "engines",
    "mix",
    "deadline_s",
    "max_queue",
)


def _lines(table: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """``table`` with a ``line`` label from the axes that vary within a policy (retry first; an
    effective bound or deadline that only follows the policy's preset makes no line), and the labels
    in order."""
    axes = [
        a
        for a in _LINE_AXES
        if a in table
        and table[a].astype(object).fillna("none").groupby(table["policy"]).nunique().max() > 1
    ]
    if not axes:
        return table.assign(line="-"), ["-"]
    text = {a: table[a].astype(object).where(table[a].notna(), "none").astype(str) for a in axes}
    label = (
        text[axes[0]]
        if len(axes) == 1
        else pd.Series(
            [", ".join(f"{a} {v}" for a, v in zip(axes, vs)) for vs in zip(*text.values())],
            index=table.index,
        )
    )
    present = list(dict.fromkeys(label))
    rank = {r: i for i, r in enumerate(RETRY_ORDER)}
    order = sorted(
        present, key=lambda v: (rank.get(v.split(", ")[0].removeprefix("retry "), len(rank)), v)
    )
    return table.assign(line=label), order


def retries(
    series: pd.DataFrame, surge: tuple[float, float] | None = None, smooth_s: float = 5.0
) -> plt.Figure:
    """Over time (timeseries.parquet): good requests/s end to end (by first send), good answers/s
    (attempt-level, by answer) and offered attempts/s, a column per policy and a line per retry
    behaviour (or other varying axis), each the mean over seeds smoothed by a centred ``smooth_s``
    moving average; the surge shaded."""
    series, lines = _lines(series)
    policies = _policies(series)
    panels = [
        ("goodput_e2e_rps", "good requests/s, end to end\n(by first send)"),
        ("goodput_rps", "good answers/s (attempt-level)"),
        ("attempts_per_s", "offered attempts/s"),
    ]
    fig, axes = plt.subplots(
        len(panels),
        len(policies),
        figsize=(4.2 * len(policies) + 1.8, 2.8 * len(panels)),
        sharex=True,
        sharey="row",
        squeeze=False,
        layout="constrained",
    )
    mean = (
        series.groupby(["policy", "line", "t_s"], sort=True)[[m for m, _ in panels]]
        .mean()
        .reset_index()
    )
    step = (
        float(np.median(np.diff(np.unique(series["t_s"])))) if series["t_s"].nunique() > 1 else 1.0
    )
    width = max(1, int(round(smooth_s / step)))
    for j, policy in enumerate(policies):
        for i, line in enumerate(lines):
            part = mean[(mean["policy"] == policy) & (mean["line"] == line)]
            for row, (metric, _) in enumerate(panels):
                smooth = part[metric].rolling(width, center=True, min_periods=1).mean()
                axes[row][j].plot(part["t_s"], smooth, color=f"C{i % 10}", lw=1.2, label=line)
        for row, (_, unit) in enumerate(panels):
            ax = axes[row][j]
            if surge is not None:
                ax.axvspan(
                    *surge,
                    color="grey",
                    alpha=0.15,
                    lw=0,
                    label="surge" if j == 0 and row == 0 else None,
                )
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel(unit)
        axes[0][j].set_title(policy)
        axes[-1][j].set_xlabel("time (s)")
    for row in axes:  # once every panel of the row is drawn (they share their y axis)
        row[0].set_ylim(bottom=0)
    seeds = series.groupby(["policy", "line"])["seed"].nunique().max() if "seed" in series else 1
    _suptitle(
        fig, f"goodput and offered attempts over time, {smooth_s:g} s moving average", fontsize=10
    )
    _legend(
        fig,
        axes,
        title=f"retry (mean of {seeds} seeds)" if "retry" in series else None,
        title_fontsize=8,
    )
    return fig


def recovery(summary: pd.DataFrame, after_s: float | None = None) -> plt.Figure:
    """Seconds from the surge's end until end-to-end goodput is back (the summary's recovery_s):
    mean over the seeds with 95 % CI, a bar per line (retry behaviour) in a group per policy. Where
    some seed never recovered the bar is hatched and reaches ``after_s`` (the rest of the run),
    labelled with how many seeds did not."""
    table, lines = _lines(summary)
    policies = _policies(table)
    fig, ax = plt.subplots(
        figsize=(3.4 + 1.2 * len(policies) * max(len(lines), 1) / 2.5, 3.8), layout="constrained"
    )
    width = 0.8 / max(len(lines), 1)
    agg = aggregate(table, ["policy", "line"], ["recovery_s", "recovered"])
    top = after_s if after_s is not None else float(np.nanmax(table["recovery_s"], initial=1.0))
    for i, line in enumerate(lines):
        for j, policy in enumerate(policies):
            part = agg[(agg["policy"] == policy) & (agg["line"] == line)]
            if part.empty:
                continue
            row = part.iloc[0]
            x = j + (i - (len(lines) - 1) / 2) * width
            label = line if j == 0 else None
            if row["recovered"] < 1:
                ax.bar(
                    x, top, width * 0.95, color=f"C{i % 10}", alpha=0.35, hatch="//", label=label
                )
                never = int(round((1 - row["recovered"]) * row["n"]))
                ax.text(
                    x, top, f"never\n{never}/{int(row['n'])}", ha="center", va="bottom", fontsize=6
                )
            else:
                low, high = max(row["recovery_s_low"], 0.0), row["recovery_s_high"]
                err = (
                    None
                    if np.isnan(high)
                    else [[row["recovery_s"] - low], [high - row["recovery_s"]]]
                )
                ax.bar(
                    x,
                    row["recovery_s"],
                    width * 0.95,
                    color=f"C{i % 10}",
                    yerr=err,
                    capsize=2,
                    label=label,
                )
    ax.set_xticks(np.arange(len(policies)), policies)
    ax.set(
        ylabel="seconds after the surge until\nend-to-end goodput is back",
        ylim=(0, top * 1.15 + 1),
        title="recovery after the surge (mean over seeds, 95 % CI; hatched: some seed never "
        "recovered)",
    )
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3, axis="y")
    _legend(fig, [ax], title="retry" if "retry" in table else None, title_fontsize=8)
    return fig
