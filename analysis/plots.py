"""Figures of a sweep (matplotlib, no screen needed): the study's views of goodput and latency.

Every function takes the sweep's summary tables (or rows) and returns a Figure;
:func:`save_all` writes each as PNG and SVG. Bands and error bars are 95 %
confidence intervals across seeds.
"""

from __future__ import annotations

from pathlib import Path

# No backend is forced: without a display matplotlib picks Agg, and in a notebook the kernel's inline one.
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .metrics import _class_key, aggregate

POLICY_ORDER = ["none", "bounded", "bounded-deadline", "predictive"]
OUTCOME_COLORS = {"good": "#2a9d8f", "late": "#e9c46a", "rejected": "#e76f51", "expired": "#8d99ae", "error": "#264653",
                  "abandoned": "#b56576"}


def _policies(frame: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(frame["policy"]))
    return [p for p in POLICY_ORDER if p in present] + [p for p in present if p not in POLICY_ORDER]


def _speeds(frame: pd.DataFrame) -> list[float]:
    return sorted(frame["speed"].unique())


def _band(ax, agg: pd.DataFrame, x: str, y: str, label: str, **style) -> None:
    ax.plot(agg[x], agg[y], marker="o", ms=3, label=label, **style)
    # A t-interval over few seeds can reach below zero; nothing plotted here can.
    low = agg[f"{y}_low"].clip(lower=0)
    ax.fill_between(agg[x], low, agg[f"{y}_high"], alpha=0.2, color=ax.lines[-1].get_color())


def share_in_time(summary: pd.DataFrame) -> plt.Figure:
    """Share of requests answered within the deadline against load, per policy; a panel per speed."""
    speeds = _speeds(summary)
    fig, axes = plt.subplots(1, len(speeds), figsize=(5.5 * len(speeds), 4), sharey=True, squeeze=False)
    agg = aggregate(summary, ["policy", "speed", "load"], ["share_good"])
    for ax, speed in zip(axes[0], speeds):
        for policy in _policies(summary):
            part = agg[(agg["policy"] == policy) & (agg["speed"] == speed)]
            _band(ax, part, "load", "share_good", policy)
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
        ax.set(title=f"service times x{speed:g}", xlabel="load (utilisation at the simulated speed)",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share answered within deadline")
    axes[0][0].legend(title="policy")
    fig.tight_layout()
    return fig


def goodput(summary: pd.DataFrame) -> plt.Figure:
    """Goodput in requests/s and good tokens/s against load, capacity marked; rows per speed."""
    speeds = _speeds(summary)
    fig, axes = plt.subplots(len(speeds), 2, figsize=(11, 3.8 * len(speeds)), squeeze=False)
    cols = ["goodput_rps", "good_tokens_per_s", "capacity_rps", "capacity_tokens_per_s"]
    agg = aggregate(summary, ["policy", "speed", "load"], cols)
    for row, speed in zip(axes, speeds):
        for ax, (metric, cap, unit) in zip(row, [("goodput_rps", "capacity_rps", "good requests/s"),
                                                 ("good_tokens_per_s", "capacity_tokens_per_s", "good tokens/s")]):
            for policy in _policies(summary):
                part = agg[(agg["policy"] == policy) & (agg["speed"] == speed)]
                _band(ax, part, "load", metric, policy)
            capacity = agg.loc[agg["speed"] == speed, cap].iloc[0]
            ax.axhline(capacity, color="black", ls="--", lw=1, label=f"capacity ({capacity:.3g})")
            ax.set(title=f"{unit}, service times x{speed:g}", xlabel="load (utilisation at the simulated speed)",
                   ylabel=unit)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def share_by_class(by_class: pd.DataFrame) -> plt.Figure:
    """Share in time by size class against load: a panel per policy (first speed in solid, others dashed)."""
    policies = _policies(by_class)
    fig, axes = plt.subplots(1, len(policies), figsize=(4.2 * len(policies), 3.8), sharey=True, squeeze=False)
    agg = aggregate(by_class, ["policy", "speed", "size_class", "load"], ["share_good"])
    classes = sorted(by_class["size_class"].unique(), key=_class_key)
    for ax, policy in zip(axes[0], policies):
        for i, speed in enumerate(_speeds(by_class)):
            for j, cls in enumerate(classes):
                part = agg[(agg["policy"] == policy) & (agg["speed"] == speed) & (agg["size_class"] == cls)]
                ax.plot(part["load"], part["share_good"], marker="o", ms=3, color=f"C{j}",
                        ls="-" if i == 0 else "--", label=f"<= {cls} tokens, x{speed:g}")
        ax.set(title=policy, xlabel="load (utilisation at the simulated speed)", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share answered within deadline")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def latency_cdf(rows: pd.DataFrame, deadline_s: float | None = None) -> plt.Figure:
    """Empirical CDF of the latency of the answered (good or late), one curve per policy."""
    fig, ax = plt.subplots(figsize=(6, 4))
    answered = rows[rows["outcome"].isin(["good", "late"])]
    for policy in _policies(rows):
        lat = np.sort(answered.loc[answered["policy"] == policy, "latency_s"].to_numpy())
        if lat.size:
            ax.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post", label=policy)
    if deadline_s:
        ax.axvline(deadline_s, color="black", ls="--", lw=1, label=f"deadline {deadline_s:g} s")
    ax.set(xlabel="latency of the answered (s)", ylabel="share of answered requests", ylim=(0, 1.01))
    ax.set_xscale("symlog", linthresh=0.1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


SHORT = {"none": "none", "bounded": "bnd", "bounded-deadline": "bnd+dl", "predictive": "pred"}


def outcome_bars(summary: pd.DataFrame) -> plt.Figure:
    """Stacked shares of each outcome, one bar per policy at each load; a panel per speed."""
    speeds = _speeds(summary)
    outcomes = [o for o in OUTCOME_COLORS if o in summary.columns and summary[o].sum() > 0]
    shares = summary.assign(**{o: summary[o] / summary["requests"] for o in outcomes})
    mean = shares.groupby(["speed", "load", "policy"])[outcomes].mean().reset_index()
    policies = _policies(summary)
    fig, axes = plt.subplots(len(speeds), 1, figsize=(12, 3.9 * len(speeds)), squeeze=False)
    width = 0.8 / len(policies)
    for ax, speed in zip(axes[:, 0], speeds):
        loads = sorted(mean.loc[mean["speed"] == speed, "load"].unique())
        ticks, labels = [], []
        for i, policy in enumerate(policies):
            part = mean[(mean["speed"] == speed) & (mean["policy"] == policy)].set_index("load").reindex(loads)
            x = np.arange(len(loads)) + (i - (len(policies) - 1) / 2) * width
            bottom = np.zeros(len(loads))
            for outcome in outcomes:
                ax.bar(x, part[outcome], width * 0.95, bottom=bottom, color=OUTCOME_COLORS[outcome],
                       label=outcome if i == 0 else None)
                bottom += part[outcome].fillna(0).to_numpy()
            ticks += list(x)
            labels += [SHORT.get(policy, policy)] * len(loads)
        ax.set_xticks(ticks, labels, rotation=90, fontsize=7)
        for j, load in enumerate(loads):
            ax.text(j, 1.02, f"load {load:g}", ha="center", va="bottom", fontsize=8)
        ax.set(title=f"outcomes by policy and load (utilisation at the simulated speed), service times x{speed:g}",
               ylabel="share of requests", ylim=(0, 1.1))
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return fig


def save_all(summary: pd.DataFrame, by_class: pd.DataFrame, rows: pd.DataFrame | None, out: str | Path) -> list[Path]:
    """Write every figure as PNG and SVG into ``out``; return the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "share_in_time": share_in_time(summary),
        "goodput": goodput(summary),
        "share_by_class": share_by_class(by_class),
        "outcomes": outcome_bars(summary),
    }
    if rows is not None and len(rows):
        deadline = float(summary["deadline_s"].mode().iloc[0]) if "deadline_s" in summary else None
        figures["latency_cdf"] = latency_cdf(rows, deadline)
    paths = []
    for name, fig in figures.items():
        for ext in ("png", "svg"):
            path = out / f"{name}.{ext}"
            fig.savefig(path, dpi=130)
            paths.append(path)
        plt.close(fig)
    return paths
