"""Figures of a sweep (matplotlib, no screen needed): the study's views of goodput and latency.

Every function takes the sweep's summary tables (or rows) and returns a Figure;
:func:`save_all` writes each as PNG and SVG. Bands and error bars are 95 %
confidence intervals across seeds. A policy has one colour in every figure
(:mod:`analysis.styles`); legends sit outside the panels or in an empty one, never over a
curve; a figure of one panel per policy wraps them into rows of at most four. Objectives
(:mod:`analysis.objectives`) are drawn as a dash-dotted black line on each panel of their metric.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

# No backend is forced: without a display matplotlib picks Agg, and in a notebook the kernel's
# inline one.
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter

from .metrics import _class_key, aggregate
from .objectives import Objective
from .styles import MARKERS, OUTCOME_COLORS, policy_color, policy_order, policy_styles

#: Panels in a row before a figure of one panel per policy wraps to the next row.
MAX_COLUMNS = 4
#: The metrics some figure draws against its y axis (or, for a latency percentile, on the CDF):
#: where an objective's line can go.
DRAWN_METRICS = ("share_good", "goodput_rps", "good_tokens_per_s", "share_refused")
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


def check_objectives(objectives: Sequence[Objective]) -> None:
    """ValueError for an objective no figure can draw (its metric is on none of their axes)."""
    for o in objectives:
        if o.metric not in DRAWN_METRICS and o.quantile is None:
            raise ValueError(
                f"objective {o.metric}: no figure draws it; one of "
                f"{', '.join(DRAWN_METRICS)} "
                "or a latency percentile (latency_p99_s)"
            )


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


NO_CLIENT_LABEL = "no client named"


def _by_group(
    table: pd.DataFrame,
    group: str,
    what: str,
    panels: list[tuple[str, str]],
    extra=None,
    objectives: Sequence[Objective] | None = None,
) -> plt.Figure:
    """A row per policy; a panel per metric with a band per group value (and client set, and speed)
    against load; ``extra(ax, policy)`` draws one more panel at the end of each row."""
    table = table.assign(
        clients=table["clients"].astype(object).where(table["clients"].notna(), "none")
        if "clients" in table
        else "-",
        **{group: table[group].astype(object).where(table[group].notna(), NO_CLIENT_LABEL)},
    )
    policies = _policies(table)
    n_cols = len(panels) + (extra is not None)
    fig, axes = plt.subplots(
        len(policies),
        n_cols,
        figsize=(4.3 * n_cols + 2.2, 3.2 * len(policies)),
        squeeze=False,
        layout="constrained",
    )
    agg = aggregate(table, ["policy", "clients", "speed", group, "load"], [m for m, _ in panels])
    lines = sorted(
        {(c, s, v) for c, s, v in zip(table["clients"], table["speed"], table[group])},
        key=lambda k: (str(k[0]), k[1], k[2] == NO_CLIENT_LABEL, k[2]),
    )
    many_sets, many_speeds = table["clients"].nunique() > 1, table["speed"].nunique() > 1
    for row, policy in zip(axes, policies):
        for ax, (metric, unit) in zip(row, panels):
            for i, (clients, speed, value) in enumerate(lines):
                part = agg[
                    (agg["policy"] == policy)
                    & (agg["clients"] == clients)
                    & (agg["speed"] == speed)
                    & (agg[group] == value)
                ]
                label = value if value == NO_CLIENT_LABEL else f"{what} {value}"
                label = ", ".join([f"{clients}: {label}"] if many_sets else [label]) + (
                    f", x{speed:g}" if many_speeds else ""
                )
                if len(part):
                    _band(ax, part, "load", metric, label, color=f"C{i % 10}")
            _objective_lines(ax, metric, objectives)
            ax.set(title=f"{policy}: {unit.split(' (')[0]}", xlabel=LOAD_LABEL, ylabel=unit)
            ax.set_ylim(*((0, 1.02) if metric.startswith("share") else (0, None)))
            ax.grid(alpha=0.3)
        if extra is not None:
            extra(row[-1], policy)
    _legend(fig, axes[:, : len(panels)], title=what)
    if extra is not None:  # the extra panel's own entries, below the first
        _legend(fig, axes[:, -1], loc="outside right lower")
    return fig


#: Jain's index, one client set after another: greys, never one of the clients' colours (C0, C1,
#: ...).
JAIN_COLORS = ("#000000", "#666666", "#999999")


def by_client(
    table: pd.DataFrame, summary: pd.DataFrame, objectives: Sequence[Objective] | None = None
) -> plt.Figure:
    """Per policy (a row each): each client's share in time and good tokens/s against load (from
    summary_by_client), and Jain's index across the clients (from summary: over good tokens/s
    solid, over share in time dashed; 1/n, its floor for n clients, dotted)."""
    fair = (
        summary[summary["jain_goodput"].notna()] if "jain_goodput" in summary else summary.iloc[:0]
    )
    fair = fair.assign(clients=fair["clients"].astype(object) if "clients" in fair else "-")
    agg = aggregate(fair, ["policy", "clients", "speed", "load"], ["jain_goodput", "jain_share"])
    named = table[table["client_id"].notna()]
    n_clients = set(
        named.groupby(["cell_id"] if "cell_id" in named else ["policy"])["client_id"].nunique()
    )
    many_sets, many_speeds = agg["clients"].nunique() > 1, agg["speed"].nunique() > 1

    def jain(ax, policy):
        for i, ((clients, speed), part) in enumerate(
            agg[agg["policy"] == policy].groupby(["clients", "speed"])
        ):
            name = ", ".join([str(clients)] * many_sets + [f"x{speed:g}"] * many_speeds)
            name = f" ({name})" if name else ""
            # Not a client's colour: the clients' panels beside it use C0, C1, ... for the clients.
            style = {
                "color": JAIN_COLORS[i % len(JAIN_COLORS)],
                "marker": MARKERS[i % len(MARKERS)],
            }
            _band(ax, part, "load", "jain_goodput", f"Jain over good tokens/s{name}", **style)
            _band(
                ax, part, "load", "jain_share", f"Jain over share in time{name}", ls="--", **style
            )
        for n in sorted(n_clients):
            ax.axhline(1 / n, color="grey", lw=0.8, ls=":")
        ax.set(
            title=f"{policy}: Jain's index",
            ylabel="Jain's index across clients (1/n dotted)",
            xlabel=LOAD_LABEL,
            ylim=(0, 1.02),
        )
        ax.grid(alpha=0.3)

    return _by_group(
        table,
        "client_id",
        "client",
        [
            ("share_good", "share in time (answered within deadline)"),
            ("good_tokens_per_s", "good tokens/s"),
        ],
        extra=jain,
        objectives=objectives,
    )


def by_priority(table: pd.DataFrame, objectives: Sequence[Objective] | None = None) -> plt.Figure:
    """Per policy (a row each): each priority's share in time, good tokens/s and share refused
    against load."""
    return _by_group(
        table,
        "priority",
        "priority",
        [
            ("share_good", "share in time (answered within deadline)"),
            ("good_tokens_per_s", "good tokens/s"),
            ("share_refused", "share refused (rejected or expired)"),
        ],
        objectives=objectives,
    )


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


def per_client_set(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its policy labelled "POLICY / CLIENTS" where it holds more than one client set
    (the sweep's ``clients`` axis; "no clients" for requests naming none), else as it is."""
    if "clients" not in table:
        return table
    sets = _axis_text(table, "clients")
    if sets.nunique() < 2:
        return table
    return table.assign(policy=table["policy"].astype(str) + " / " + sets)


#: Axes of a sweep that label a policy's curve when they hold more than one value (None: "none").
VARIANT_AXES = (
    "clients",
    "retry",
    "patience",
    "used",
    "speed_schedule",
    "estimator",
    "fixed_estimate",
    "cancel_at_deadline",
    "arrivals",
    "policy_args",
)
#: How a yes/no axis reads in a label: (its False, its True).
FLAG_LABELS = {
    "fixed_estimate": ("tracking", "fixed estimate"),
    "cancel_at_deadline": ("runs on", "cut at deadline"),
}


#: What a cell without an axis's value is, in a label: "none / none" said nothing of which "none"
#: was the policy and which the client set.
NONE_WORDS = {
    "clients": "no clients",
    "retry": "no retries",
    "patience": "no patience",
    "used": "full lengths",
    "speed_schedule": "steady speed",
    "estimator": "own estimator",
    "policy_args": "preset",
}


def _axis_text(table: pd.DataFrame, axis: str) -> pd.Series:
    """An axis's values as label text: a cell without in words (NONE_WORDS; "none" for any other),
    a yes/no axis in words."""
    none = NONE_WORDS.get(axis, "none")
    if axis in FLAG_LABELS:
        no, yes = FLAG_LABELS[axis]
        return table[axis].map(lambda v: none if pd.isna(v) else yes if bool(v) else no).astype(str)
    text = table[axis].astype(object).where(table[axis].notna(), "none").astype(str)
    return text.where(text != "none", none)


def per_variant(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its policy labelled "POLICY / CLIENTS / RETRY / PATIENCE", naming each of
    those axes that holds more than one value (NONE_WORDS for a cell without), else as it is; with
    only a clients axis the same as :func:`per_client_set`."""
    parts = []
    for axis in VARIANT_AXES:
        if axis in table:
            values = _axis_text(table, axis)
            if values.nunique() > 1:
                parts.append(values)
    if not parts:
        return table
    label = table["policy"].astype(str)
    for values in parts:
        label = label + " / " + values
    return table.assign(policy=label)


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


# ------------------------------------------------------------------ what the controller knows
# (issue 12)

ESTIMATOR_ORDER = ["limit", "learned", "oracle"]


def _bars(
    ax,
    agg: pd.DataFrame,
    groups: list,
    group_col: str,
    bars: list,
    bar_col: str,
    metric: str,
    labels: dict | None = None,
    colors: dict | None = None,
) -> None:
    """Grouped bars of ``metric`` (mean, 95 % CI as error bars) with a group per ``groups`` value on
    x; ``colors`` by bar value (default: the colour cycle in order)."""
    width = 0.8 / max(len(bars), 1)
    for i, bar in enumerate(bars):
        part = agg[agg[bar_col] == bar].set_index(group_col).reindex(groups)
        x = np.arange(len(groups)) + (i - (len(bars) - 1) / 2) * width
        mean = part[metric].to_numpy(dtype=float)
        low = np.clip(part[f"{metric}_low"].to_numpy(dtype=float), 0, None)
        high = part[f"{metric}_high"].to_numpy(dtype=float)
        err = np.nan_to_num(
            np.vstack([mean - np.minimum(low, mean), np.maximum(high, mean) - mean])
        )
        ax.bar(
            x,
            mean,
            width * 0.95,
            yerr=err,
            capsize=2,
            color=(colors or {}).get(bar, f"C{i % 10}"),
            label=(labels or {}).get(bar, str(bar)),
        )
    ax.set_xticks(
        np.arange(len(groups)), [f"{g:g}" if isinstance(g, float) else str(g) for g in groups]
    )
    ax.grid(alpha=0.3, axis="y")


def estimation(summary: pd.DataFrame) -> plt.Figure:
    """The estimation experiment: goodput, share refused, refused that would have fit and admitted
    that missed, against load (the work actually done), a band per estimator (estimation.toml)."""
    from .estimation import estimation_table

    agg = estimation_table(summary)
    present = list(dict.fromkeys(agg["estimator"]))
    estimators = [e for e in ESTIMATOR_ORDER if e in present] + [
        e for e in present if e not in ESTIMATOR_ORDER
    ]
    panels = [
        ("goodput_rps", "good requests/s"),
        ("share_refused", "share refused"),
        ("refused_would_fit", "refused that would have fit\n(share of all requests)"),
        ("admitted_missed", "admitted that missed\n(late, expired, cut; share of all)"),
    ]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.2 * len(panels) + 1.4, 3.6), squeeze=False, layout="constrained"
    )
    for ax, (metric, unit) in zip(axes[0], panels):
        for estimator in estimators:
            _band(
                ax,
                agg[agg["estimator"] == estimator].sort_values("load"),
                "load",
                metric,
                estimator,
            )
        ax.set(xlabel="load (utilisation in the work actually done)", ylabel=unit)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    policy = ", ".join(map(str, dict.fromkeys(summary["policy"])))
    _suptitle(
        fig,
        f"estimates from the limit, learned, or exact: {policy}, requests stop early "
        "(mean over seeds, 95 % CI)",
        fontsize=10,
    )
    _legend(fig, axes, title="estimator")
    return fig


def stale(summary: pd.DataFrame) -> plt.Figure:
    """The stale-estimator experiment: the late share of the completed before and after the
    machine's speed changes, and goodput, a bar per tracking or fixed estimate in a group per policy
    (stale.toml)."""
    from .estimation import stale_table

    agg = stale_table(summary)
    agg["label"] = (
        _axis_text(agg.replace({"fixed_estimate": {"none": None}}), "fixed_estimate")
        if "fixed_estimate" in agg
        else "tracking"
    )
    policies = _policies(agg)
    labels = list(dict.fromkeys(agg["label"]))
    panels = [
        ("late_share_before_change", "late share of the completed,\nbefore the change"),
        ("late_share_after_change", "late share of the completed,\nfrom the change on"),
        ("goodput_rps", "good requests/s"),
    ]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.2 * len(panels) + 1.6, 3.6), squeeze=False, layout="constrained"
    )
    for ax, (metric, unit) in zip(axes[0], panels):
        _bars(ax, agg, policies, "policy", labels, "label", metric)
        ax.set(ylabel=unit)
        ax.set_ylim(bottom=0)
    change = (
        ", ".join(map(str, dict.fromkeys(summary["speed_schedule"].dropna())))
        if "speed_schedule" in summary
        else "none"
    )
    _suptitle(
        fig,
        f"a machine that slows down mid-run (speed schedule {change}): tracking against "
        "a fixed estimate "
        "(mean over seeds, 95 % CI)",
        fontsize=10,
    )
    _legend(fig, axes, title="estimate")
    return fig


def cancellation(summary: pd.DataFrame) -> plt.Figure:
    """The cancellation experiment: goodput against load cutting at the deadline (solid) or not
    (dashed) per policy; the engine seconds cutting saved; the goodput it gained, paired by seed
    (cancellation.toml)."""
    from .estimation import cancellation_table

    agg = cancellation_table(summary)
    policies = _policies(agg)
    fig, axes = plt.subplots(1, 3, figsize=(15.5, 3.8), squeeze=False, layout="constrained")
    ax = axes[0][0]
    for policy in policies:
        for cut, style in ((True, "-"), (False, "--")):
            part = agg[(agg["policy"] == policy) & (agg["cancel_at_deadline"] == cut)].sort_values(
                "load"
            )
            if len(part):
                _band(
                    ax,
                    part,
                    "load",
                    "goodput_rps",
                    f"{policy}, {FLAG_LABELS['cancel_at_deadline'][cut]}",
                    color=policy_color(policy),
                    ls=style,
                )
    ax.set(xlabel="load", ylabel="good requests/s", title="goodput (solid: cut at the deadline)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    cut = agg[agg["cancel_at_deadline"] == True]  # noqa: E712 (numpy bools)
    loads = sorted(cut["load"].unique())
    panels = [
        ("engine_s_saved", "engine seconds saved\nper cell (one run of the trace)"),
        ("goodput_gained_rps", "goodput gained (requests/s),\npaired by seed"),
    ]
    for ax, (metric, unit) in zip(axes[0][1:], panels):
        _bars(
            ax,
            cut,
            loads,
            "load",
            policies,
            "policy",
            metric,
            colors={p: policy_color(p) for p in policies},
        )
        ax.axhline(0, color="black", lw=0.8)
        ax.set(xlabel="load", ylabel=unit)
    # The bars are in the policies' colours of the goodput panel's lines: one legend serves all
    # three.
    _suptitle(fig, "cutting a run at its deadline (mean over seeds, 95 % CI)", fontsize=10)
    _legend(fig, [axes[0][0]], title="policy")
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


def _with_args(table: pd.DataFrame) -> pd.Series:
    """The policy column, with its [policy_args] variant where the row has one: "adaptive-lifo /
    lifo_threshold=4"."""
    if "policy_args" not in table:
        return table["policy"].astype(str)
    args = table["policy_args"].astype(object)
    return table["policy"].astype(str) + args.map(
        lambda a: "" if a is None or a != a else f" / {a}"
    )
