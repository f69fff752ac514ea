"""Figures of a band per client or per priority (summary_by_client, summary_by_priority): a row per
policy, a panel per metric against load, and Jain's index across the clients."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import pandas as pd

from .metrics import aggregate
from .objectives import Objective
from .plot_panels import LOAD_LABEL, _band, _legend, _objective_lines, _policies
from .styles import MARKERS


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
