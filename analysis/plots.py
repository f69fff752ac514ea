"""Figures of a sweep (matplotlib, no screen needed): the study's views of goodput and latency.

Every function takes the sweep's summary tables (or rows) and returns a Figure;
:func:`save_all` writes each as PNG and SVG. Bands and error bars are 95 %
confidence intervals across seeds. A policy has one colour in every figure
(:mod:`analysis.styles`); legends sit outside the panels or in an empty one, never over a
curve; a figure of one panel per policy wraps them into rows of at most four. Objectives
(:mod:`analysis.objectives`) are drawn as a dash-dotted black line on each panel of their metric.

The figures' parts are :mod:`analysis.plot_panels`'s and their curves' labels
:mod:`analysis.plot_labels`'s; the figures per client and per priority are in
:mod:`analysis.group_plots`, those of retrying clients in :mod:`analysis.retry_plots`, and those of
what the controller knows in :mod:`analysis.estimation_plots`. This module draws the study's main
views and :func:`capacity`, and :func:`save_all` writes every figure of a sweep.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# No backend is forced: without a display matplotlib picks Agg, and in a notebook the kernel's
# inline one.
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter

from .estimation_plots import cancellation, estimation, stale
from .group_plots import by_client, by_priority
from .metrics import _class_key, aggregate
from .objectives import Objective
from .plot_labels import _with_args, per_client_set, per_variant
from .plot_panels import (
    LOAD_LABEL,
    MAX_COLUMNS,
    _band,
    _grid,
    _legend,
    _objective_lines,
    _policies,
    _speeds,
    _suptitle,
)
from .retry_plots import recovery, retries
from .styles import OUTCOME_COLORS, policy_order, policy_styles

#: The metrics some figure draws against its y axis (or, for a latency percentile, on the CDF):
#: where an objective's line can go.
DRAWN_METRICS = ("share_good", "goodput_rps", "good_tokens_per_s", "share_refused")


def check_objectives(objectives: Sequence[Objective]) -> None:
    """ValueError for an objective no figure can draw (its metric is on none of their axes)."""
    for o in objectives:
        if o.metric not in DRAWN_METRICS and o.quantile is None:
            raise ValueError(
                f"objective {o.metric}: no figure draws it; one of "
                f"{', '.join(DRAWN_METRICS)} "
                "or a latency percentile (latency_p99_s)"
            )


def share_in_time(
    summary: pd.DataFrame, objectives: Sequence[Objective] | None = None
) -> plt.Figure:
    """Share of requests answered within the deadline against load, per policy; a panel per
    speed."""
    speeds = _speeds(summary)
    fig, axes = plt.subplots(
        1,
        len(speeds),
        figsize=(4.8 * len(speeds) + 1.8, 3.8),
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    agg = aggregate(summary, ["policy", "speed", "load"], ["share_good"])
    styles = policy_styles(_policies(summary))
    for ax, speed in zip(axes[0], speeds):
        for policy, style in styles.items():
            part = agg[(agg["policy"] == policy) & (agg["speed"] == speed)]
            _band(ax, part, "load", "share_good", policy, **style.line())
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
        _objective_lines(ax, "share_good", objectives)
        ax.set(title=f"service times x{speed:g}", xlabel=LOAD_LABEL, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share answered within deadline")
    _legend(fig, axes, title="policy")
    return fig


def goodput(summary: pd.DataFrame, objectives: Sequence[Objective] | None = None) -> plt.Figure:
    """Goodput in requests/s and good tokens/s against load, capacity marked; rows per speed."""
    speeds = _speeds(summary)
    fig, axes = plt.subplots(
        len(speeds), 2, figsize=(11.5, 3.6 * len(speeds)), squeeze=False, layout="constrained"
    )
    cols = ["goodput_rps", "good_tokens_per_s", "capacity_rps", "capacity_tokens_per_s"]
    agg = aggregate(summary, ["policy", "speed", "load"], cols)
    styles = policy_styles(_policies(summary))
    for row, speed in zip(axes, speeds):
        for ax, (metric, cap, unit) in zip(
            row,
            [
                ("goodput_rps", "capacity_rps", "good requests/s"),
                ("good_tokens_per_s", "capacity_tokens_per_s", "good tokens/s"),
            ],
        ):
            for policy, style in styles.items():
                part = agg[(agg["policy"] == policy) & (agg["speed"] == speed)]
                _band(ax, part, "load", metric, policy, **style.line())
            capacity = agg.loc[agg["speed"] == speed, cap].iloc[0]
            ax.axhline(capacity, color="black", ls="--", lw=1, label="capacity")
            _objective_lines(ax, metric, objectives)
            ax.set(
                title=f"{unit}, service times x{speed:g} (capacity {capacity:.3g})",
                xlabel=LOAD_LABEL,
                ylabel=unit,
            )
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    _legend(fig, axes, title="policy")
    return fig


def share_by_class(
    by_class: pd.DataFrame, objectives: Sequence[Objective] | None = None
) -> plt.Figure:
    """Share in time by size class against load: a panel per policy, wrapped into rows (first speed
    in solid, others dashed)."""
    policies = _policies(by_class)
    fig, (axes,), spare = _grid(len(policies), (3.6, 3.1), sharey=True)
    agg = aggregate(by_class, ["policy", "speed", "size_class", "load"], ["share_good"])
    classes = sorted(by_class["size_class"].unique(), key=_class_key)
    speeds = _speeds(by_class)
    for ax, policy in zip(axes, policies):
        for i, speed in enumerate(speeds):
            for j, cls in enumerate(classes):
                part = agg[
                    (agg["policy"] == policy) & (agg["speed"] == speed) & (agg["size_class"] == cls)
                ]
                # One entry per class (the colour); the speed is the line style, said once below.
                ax.plot(
                    part["load"],
                    part["share_good"],
                    marker="o",
                    ms=3,
                    color=f"C{j}",
                    ls="-" if i == 0 else "--",
                    label=f"<= {cls} tokens" if i == 0 else "_",
                )
        _objective_lines(ax, "share_good", objectives)
        ax.set(title=policy, xlabel="load", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    for ax in axes[::MAX_COLUMNS]:
        ax.set_ylabel("share answered within deadline")
    _suptitle(
        fig,
        "share answered in time by size class (max_new_tokens up to), "
        + _speeds_said(speeds)
        + "; load: utilisation at the simulated speed",
        fontsize=10,
    )
    _legend(fig, axes, spare, title="size class")
    return fig


def _speeds_said(speeds: list[float]) -> str:
    """The speeds of a figure whose legend leaves them out: "service times x1", or which line style
    is which speed."""
    if len(speeds) == 1:
        return f"service times x{speeds[0]:g}"
    return (
        f"service times x{speeds[0]:g} solid, "
        + ", ".join(f"x{v:g}" for v in speeds[1:])
        + (" dashed")
    )


def _latency_scale(ax, latencies: np.ndarray) -> None:
    """Log where the latencies span a factor of 20 or more (and none is 0), else linear from 0."""
    if latencies.size and latencies.min() > 0 and latencies.max() / latencies.min() >= 20:
        ax.set_xscale("log")
        # 0.1, 1, 10 rather than 10^-1: latencies in seconds read as numbers.
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    else:
        ax.set_xlim(left=0)


def _only(rows: pd.DataFrame, column: str) -> float | None:
    """The one value of ``column`` in ``rows``, or None where it has none or several."""
    if column not in rows:
        return None
    values = rows[column].dropna().unique()
    return float(values[0]) if len(values) == 1 else None


def latency_cdf(
    rows: pd.DataFrame,
    deadline_s: float | None = None,
    objectives: Sequence[Objective] | None = None,
) -> plt.Figure:
    """Empirical CDF of the latency of the answered (good or late), one curve per policy, titled by
    the load (and speed) of ``rows``; an objective on a latency percentile is a dash-dotted cross at
    (value, quantile)."""
    fig, ax = plt.subplots(figsize=(7.4, 4), layout="constrained")
    answered = rows[rows["outcome"].isin(["good", "late"])]
    for policy, style in policy_styles(_policies(rows)).items():
        lat = np.sort(answered.loc[answered["policy"] == policy, "latency_s"].to_numpy())
        if lat.size:
            ax.step(
                lat,
                np.arange(1, lat.size + 1) / lat.size,
                where="post",
                label=policy,
                color=style.color,
                ls=style.linestyle,
            )
    if deadline_s:
        ax.axvline(deadline_s, color="black", ls="--", lw=1, label=f"deadline {deadline_s:g} s")
    for o in objectives or ():
        if o.quantile is not None:
            ax.axvline(o.value, color="black", ls="-.", lw=1, label=f"objective {o}")
            ax.axhline(o.quantile, color="black", ls="-.", lw=1)
    _latency_scale(ax, answered["latency_s"].to_numpy())
    load, speed = _only(rows, "load"), _only(rows, "speed")
    where = "".join(
        [
            f" at load {load:g}" if load is not None else "",
            f", service times x{speed:g}" if speed is not None else "",
        ]
    )
    ax.set(
        title=f"latency of the answered{where}",
        xlabel="latency of the answered (s)",
        ylabel="share of answered requests",
        ylim=(0, 1.01),
    )
    ax.grid(alpha=0.3)
    _legend(fig, [ax])
    return fig


def policy_comparison(
    summary: pd.DataFrame,
    by_class: pd.DataFrame,
    speed: float | None = None,
    objectives: Sequence[Objective] | None = None,
) -> plt.Figure:
    """Every policy on one figure at one speed (default: the first): good tokens/s and share in time
    against load, and the share in time by size class at the highest load. Client sets are told
    apart (see :func:`per_client_set`)."""
    summary, by_class = per_client_set(summary), per_client_set(by_class)
    speed = _speeds(summary)[0] if speed is None else speed
    summary, by_class = summary[summary["speed"] == speed], by_class[by_class["speed"] == speed]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2), layout="constrained")
    agg = aggregate(summary, ["policy", "load"], ["good_tokens_per_s", "share_good"])
    policies = _policies(summary)
    styles = policy_styles(policies)
    for policy, style in styles.items():
        part = agg[agg["policy"] == policy]
        _band(axes[0], part, "load", "good_tokens_per_s", policy, **style.line())
        _band(axes[1], part, "load", "share_good", policy, **style.line())
    capacity = summary["capacity_tokens_per_s"].iloc[0]
    axes[0].axhline(capacity, color="black", ls="--", lw=1, label="capacity")
    axes[0].set(
        title=f"good tokens/s, service times x{speed:g} (capacity {capacity:.3g})",
        ylabel="good tokens/s",
        ylim=(0, None),
    )
    axes[1].set(
        title=f"share in time, service times x{speed:g}",
        ylabel="share answered within deadline",
        ylim=(0, 1.02),
    )
    for ax, metric in zip(axes[:2], ("good_tokens_per_s", "share_good")):
        _objective_lines(ax, metric, objectives)
        ax.set_xlabel(LOAD_LABEL)
        ax.grid(alpha=0.3)
    top = by_class["load"].max()
    classes = sorted(by_class["size_class"].unique(), key=_class_key)
    mean = (
        aggregate(by_class[by_class["load"] == top], ["policy", "size_class"], ["share_good"])
        .pivot_table(index="size_class", columns="policy", values="share_good")
        .reindex(classes)
    )
    width = 0.8 / max(len(policies), 1)
    for i, policy in enumerate(policies):
        if policy in mean:
            axes[2].bar(
                np.arange(len(classes)) + (i - (len(policies) - 1) / 2) * width,
                mean[policy],
                width * 0.95,
                **styles[policy].bar(),
            )
    _objective_lines(axes[2], "share_good", objectives)
    axes[2].set_xticks(np.arange(len(classes)), classes)
    axes[2].set(
        title=f"share in time by size class at load {top:g}",
        xlabel="size class (max_new_tokens up to)",
        ylabel="share answered within deadline",
        ylim=(0, 1.02),
    )
    axes[2].grid(alpha=0.3, axis="y")
    _legend(fig, axes, title="policy")
    return fig


def outcome_bars(summary: pd.DataFrame) -> plt.Figure:
    """Stacked shares of each outcome against load: a panel per policy (named in full), wrapped into
    rows of at most four; a block of rows per speed."""
    speeds = _speeds(summary)
    outcomes = [o for o in OUTCOME_COLORS if o in summary.columns and summary[o].sum() > 0]
    shares = summary.assign(**{o: summary[o] / summary["requests"] for o in outcomes})
    mean = shares.groupby(["speed", "load", "policy"])[outcomes].mean().reset_index()
    policies = _policies(summary)
    fig, blocks, spare = _grid(len(policies), (3.4, 2.9), blocks=len(speeds), sharey=True)
    for axes, speed in zip(blocks, speeds):
        loads = sorted(mean.loc[mean["speed"] == speed, "load"].unique())
        for ax, policy in zip(axes, policies):
            part = (
                mean[(mean["speed"] == speed) & (mean["policy"] == policy)]
                .set_index("load")
                .reindex(loads)
            )
            bottom = np.zeros(len(loads))
            for outcome in outcomes:
                ax.bar(
                    np.arange(len(loads)),
                    part[outcome],
                    0.8,
                    bottom=bottom,
                    color=OUTCOME_COLORS[outcome],
                    label=outcome,
                )
                bottom += part[outcome].fillna(0).to_numpy()
            ax.set_xticks(np.arange(len(loads)), [f"{v:g}" for v in loads])
            ax.set(
                title=policy if len(speeds) == 1 else f"{policy}, service times x{speed:g}",
                xlabel="load",
                ylim=(0, 1),
            )
        for ax in axes[::MAX_COLUMNS]:
            ax.set_ylabel("share of requests")
    _suptitle(
        fig,
        "outcomes by policy and load (utilisation at the simulated speed)"
        + (f", service times x{speeds[0]:g}" if len(speeds) == 1 else ""),
        fontsize=10,
    )
    _legend(fig, [blocks[0][0]], spare, title="outcome")
    return fig


def goodput_vs_refused(
    summary: pd.DataFrame, objectives: Sequence[Objective] | None = None
) -> plt.Figure:
    """Goodput against the share refused, one line per policy through its loads (rising along
    the line), error bars the 95 % CIs of both: what a policy buys with the requests it turns away.
    Left panel goodput in requests/s, right the share answered well; a batching sweep's view
    (experiments/batching.toml), where a request is good when it meets every objective it has
    (DistServe's goodput)."""
    agg = aggregate(summary, ["policy", "load"], ["goodput_rps", "share_good", "share_refused"])
    fig, axes = plt.subplots(1, 2, figsize=(11.5, 4.2), squeeze=False, layout="constrained")
    styles = policy_styles(_policies(summary))
    for ax, (metric, unit) in zip(
        axes[0],
        [("goodput_rps", "good requests/s"), ("share_good", "share good (every objective met)")],
    ):
        for policy, style in styles.items():
            part = agg[agg["policy"] == policy].sort_values("load")
            if not len(part):
                continue
            line = style.line()
            xerr = [
                part["share_refused"] - part["share_refused_low"].clip(lower=0),
                part["share_refused_high"].clip(upper=1) - part["share_refused"],
            ]
            yerr = [
                part[metric] - part[f"{metric}_low"].clip(lower=0),
                part[f"{metric}_high"] - part[metric],
            ]
            ax.errorbar(
                part["share_refused"],
                part[metric],
                xerr=xerr,
                yerr=yerr,
                label=policy,
                capsize=2,
                elinewidth=0.8,
                **{"marker": "o", "ms": 3, **line},
            )
        loads = sorted(agg["load"].unique())
        if "capacity_rps" in summary and metric == "goodput_rps":
            capacity = float(summary["capacity_rps"].iloc[0])
            ax.axhline(capacity, color="black", ls="--", lw=1, label="capacity")
        _objective_lines(ax, metric, objectives)
        ax.set(xlabel="share refused at arrival", ylabel=unit, xlim=(-0.02, 1.02))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    _suptitle(
        fig,
        f"goodput against the share refused, loads {', '.join(f'{v:g}' for v in loads)} "
        "along each line "
        "(mean over seeds, 95 % CI)",
        fontsize=10,
    )
    _legend(fig, axes, title="policy")
    return fig


def save_all(
    summary: pd.DataFrame,
    by_class: pd.DataFrame,
    rows: pd.DataFrame | None,
    out: str | Path,
    by_client_table: pd.DataFrame | None = None,
    by_priority_table: pd.DataFrame | None = None,
    timeseries: pd.DataFrame | None = None,
    surge: tuple[float, float] | None = None,
    objectives: Sequence[Objective] = (),
    extra: dict[str, plt.Figure] | None = None,
) -> list[Path]:
    """Write every figure as PNG and SVG into ``out``; return the paths.

    ``objectives`` are drawn on each panel of their metric (see :func:`check_objectives`).
    by_client and by_priority are drawn when their tables (summary_by_client.parquet,
    summary_by_priority.parquet) are given and not empty; retries when the sweep has a retry axis
    and its time series (timeseries.parquet) is given, with recovery when the summary has recovery_s
    (surge arrivals, ``surge`` = (start_s, end_s)); estimation, stale and cancellation where the
    sweep has an estimator axis (of several), a speed schedule, or cutting at the deadline both on
    and off; and the ``extra`` figures, by name (a capacity search's).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # The per-policy figures tell client sets, retry policies and patiences apart ("predictive /
    # immediate") when there are several.
    per_set, by_class, rows = (
        None if t is None else per_variant(t) for t in (summary, by_class, rows)
    )
    figures = {
        "share_in_time": share_in_time(per_set, objectives),
        "goodput": goodput(per_set, objectives),
        "share_by_class": share_by_class(by_class, objectives),
        "outcomes": outcome_bars(per_set),
    }
    if rows is not None and len(rows):
        deadline = float(summary["deadline_s"].mode().iloc[0]) if "deadline_s" in summary else None
        figures["latency_cdf"] = latency_cdf(rows, deadline, objectives)
    if by_client_table is not None and len(by_client_table):
        figures["by_client"] = by_client(by_client_table, summary, objectives)
    if by_priority_table is not None and len(by_priority_table):
        figures["by_priority"] = by_priority(by_priority_table, objectives)
    # The experiments of what the controller knows, where the sweep has their axes.
    if "estimator" in summary and summary["estimator"].nunique() > 1:
        figures["estimation"] = estimation(summary)
    if "speed_schedule" in summary and summary["speed_schedule"].notna().any():
        figures["stale"] = stale(summary)
    if "cancel_at_deadline" in summary and summary["cancel_at_deadline"].nunique() > 1:
        figures["cancellation"] = cancellation(summary)
    # a batching engine
    if "kv_blocks_peak_p99" in summary and summary["kv_blocks_peak_p99"].notna().any():
        figures["goodput_vs_refused"] = goodput_vs_refused(per_set, objectives)
    if timeseries is not None and len(timeseries) and "retry" in summary:
        figures["retries"] = retries(timeseries, surge)
        if "recovery_s" in summary:
            end = float(summary["duration_s"].max()) - surge[1] if surge is not None else None
            figures["recovery"] = recovery(summary, end)
    figures.update(extra or {})
    paths = []
    for name, fig in figures.items():
        for ext in ("png", "svg"):
            path = out / f"{name}.{ext}"
            fig.savefig(path, dpi=130)
            paths.append(path)
        plt.close(fig)
    return paths


def capacity(summary: pd.DataFrame, results: list[dict], objective: Objective) -> plt.Figure:
    """A capacity search (``qlab capacity``): the objective's metric against load at every load
    tried (mean and 95 % band over the seeds), a panel per arrival process, the objective's line,
    and each policy's capacity with its 95 % interval marked on it. ``results`` are capacity.json's
    (policy, policy_args, arrivals, load, ci_low, ci_high); a policy's parameter variants are curves
    of their own ("adaptive-lifo / lifo_threshold=4")."""
    metric = objective.metric
    labelled = summary.assign(policy=_with_args(summary))
    results = [{**r, "policy": _with_args(pd.DataFrame([r])).iloc[0]} for r in results]
    processes = list(dict.fromkeys(r["arrivals"] for r in results))
    styles = policy_styles(policy_order(r["policy"] for r in results))
    fig, (axes,), spare = _grid(len(processes), (5.2, 4.0))
    for ax, process in zip(axes, processes):
        part = labelled[labelled["arrivals"] == process] if "arrivals" in labelled else labelled
        agg = aggregate(part, ["policy", "load"], [metric])
        mine = [r for r in results if r["arrivals"] == process]
        for policy, style in styles.items():
            _band(ax, agg[agg["policy"] == policy], "load", metric, policy, **style.line())
            for r in (r for r in mine if r["policy"] == policy and r["load"] is not None):
                low, high = (
                    r["ci_low"] or 0.0,
                    r["ci_high"] if r["ci_high"] is not None else r["load"],
                )
                ax.errorbar(
                    [r["load"]],
                    [objective.value],
                    xerr=[[r["load"] - low], [high - r["load"]]],
                    fmt="D",
                    color=style.color,
                    ms=6,
                    capsize=4,
                    zorder=5,
                )
        _objective_lines(ax, metric, [objective])
        # Up to a little past the highest interval: the loads far beyond are bracketing, not the
        # answer.
        right = max((r["ci_high"] or r["load"] or 0.0) for r in mine) * 1.6
        ax.set(
            title=f"{process} arrivals",
            xlabel=LOAD_LABEL,
            ylabel=metric,
            xlim=(0, right if right > 0 else None),
        )
        ax.grid(alpha=0.3)
    _suptitle(
        fig,
        f"{metric} against load: each capacity (diamond) and its 95 % interval (bar) "
        f"at {objective.value:g}",
        fontsize=10,
    )
    _legend(fig, [axes], spare, title="policy")
    return fig
