"""Simulator versus service, request by request (``qlab compare``): a live run replayed in the
simulator with what the gate knew (:mod:`analysis.replay`), joined to the run and diagnosed
(:mod:`analysis.diagnosis`), and drawn. The model-only prediction of a run from its arrivals alone
is :mod:`analysis.prediction`'s.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .diagnosis import confusion, first_divergence, join, per_request, reasons, summarize
from .replay import replay
from .replay_clients import clients_of
from .replay_inputs import measured_speed

#: What the per-request replay of a live run ("with what the gate knew") should reach: the most
#: share of the requests the service handled on whose outcome the simulator disagrees (issue 22).
REPLAY_DISAGREEMENT_TARGET = 0.005


@dataclass(frozen=True)
class Comparison:
    joined: pd.DataFrame
    confusion: pd.DataFrame
    summary: dict[str, float]
    reasons: pd.DataFrame | None = None
    # Per request, end to end (:func:`analysis.diagnosis.per_request`): runs whose clients gave up
    # or retried.
    requests: pd.DataFrame | None = None
    first_divergence: dict | None = None  # :func:`analysis.diagnosis.first_divergence`


def has_clients(run: pd.DataFrame) -> bool:
    """Whether the run's clients could give up or retry: a patience, or a retry policy that
    retries."""
    patient = (
        "patience_s" not in run.columns or not np.isfinite(run["patience_s"].to_numpy(float)).any()
    )
    return not patient or clients_of(run)[1]


def compare(run: pd.DataFrame, origin: str = "server") -> Comparison:
    """Replay the run in the simulator (arrivals the gate's by default, see
    :func:`analysis.replay_inputs.arrival_times`), join and diagnose it."""
    joined = join(run, *replay(run, origin))
    requests = per_request(run, joined) if has_clients(run) else None
    return Comparison(
        joined,
        confusion(joined),
        summarize(joined, measured_speed(run), requests),
        reasons(joined),
        requests,
        first_divergence(joined),
    )


def figure(result: Comparison, path: str | Path) -> None:
    """Three panels: the confusion heatmap (with refusal reasons agreeing), the distribution of
    latency errors (sim - live) of requests both answered, and disagreements over the run's time,
    independent and cascade, with the first divergence marked and its cause named."""
    import matplotlib.pyplot as plt

    fig = draw(result)
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: Characters of a panel's title line: a longer title is wrapped, not cut at the panel's edge.
TITLE_WIDTH = 52


def _title(ax, text: str) -> None:
    ax.set_title(textwrap.fill(text, TITLE_WIDTH), fontsize=9)


def draw(result: Comparison):
    """:func:`figure`'s figure, not yet saved. Constrained layout makes room for the wrapped titles
    and the confusion matrix's outcome names, upright so that long ones do not run into each
    other."""
    # No backend is forced (as in analysis.plots): without a display matplotlib picks Agg by itself.
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 5), layout="constrained")
    table = result.confusion
    left.imshow(table.to_numpy(), cmap="Blues")
    left.set_xticks(range(table.shape[1]), table.columns, rotation=90)
    left.set_yticks(range(table.shape[0]), table.index)
    left.set_xlabel("simulator")
    left.set_ylabel("live service")
    for (i, j), v in np.ndenumerate(table.to_numpy()):
        left.text(
            j,
            i,
            str(v),
            ha="center",
            va="center",
            color="black" if v < table.to_numpy().max() / 2 else "white",
        )
    s = result.summary
    _title(
        left,
        f"outcomes: {int(s['disagreements'])} disagree ({s['disagreement_rate']:.1%}); "
        f"refusal reasons agree {int(s['reasons_agree'])}/{int(s['both_refused'])}",
    )
    error_ms = result.joined["latency_error_s"].dropna().to_numpy() * 1e3
    if error_ms.size:
        middle.hist(error_ms, bins=min(50, max(5, error_ms.size // 5)), color="tab:blue", alpha=0.7)
        cdf = middle.twinx()
        cdf.plot(np.sort(error_ms), np.linspace(0, 1, error_ms.size), color="tab:orange")
        cdf.set_ylabel("cumulative share")
        cdf.set_ylim(0, 1)
    middle.set_xlabel("latency error, simulator - live (ms)")
    middle.set_ylabel("requests")
    _title(
        middle,
        f"both answered: {int(s['both_answered'])}, |error| p50 "
        f"{s['latency_abs_error_p50_s'] * 1e3:.1f} ms, p99 "
        f"{s['latency_abs_error_p99_s'] * 1e3:.1f} ms",
    )
    joined = result.joined.sort_values("gate_arrival_s")
    for kind, color in (("independent", "tab:red"), ("cascade", "tab:gray")):
        mine = joined["disagreement"].eq(kind).to_numpy()
        right.step(
            joined["gate_arrival_s"],
            np.cumsum(mine),
            where="post",
            color=color,
            label=f"{kind}: {int(mine.sum())}",
        )
    if math.isfinite(s["first_divergence_s"]):
        cause = "" if result.first_divergence is None else f" ({result.first_divergence['cause']})"
        right.axvline(
            s["first_divergence_s"],
            color="tab:orange",
            linestyle="--",
            label=f"first divergence {s['first_divergence_s']:.2f} s{cause}",
        )
    right.set_xlabel("arrival at the gate (s)")
    right.set_ylabel("disagreements so far")
    right.legend(fontsize=8, loc="upper left")
    _title(
        right,
        f"independent (same queue at arrival) vs cascade; by cause: rule "
        f"{int(s['rule_disagreements'])}, timing {int(s['timing_disagreements'])}, unknown "
        f"{int(s['unknown_cause_disagreements'])}",
    )
    return fig
