"""Figures of what the controller knows (issue 12): the estimation, stale-estimate and cancellation
experiments (estimation.toml, stale.toml, cancellation.toml), from the tables of
:mod:`analysis.estimation`."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .plot_labels import FLAG_LABELS, _axis_text
from .plot_panels import _band, _legend, _policies, _suptitle
from .styles import policy_color


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
