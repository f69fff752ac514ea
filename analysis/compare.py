"""Simulator versus service, request by request.

A live run (rows from ``qlab replay``) is replayed in qsim with the same
arrival times, policy, engines and deadlines, and with
the engine times the service measured. Requests the service never ran take the
calibrated estimate scaled by the run's measured speed factor (median of
measured engine time over the calibrated estimate among the served). The two
outcomes of each request are then joined on request_id.

Arrival times are the gate's where the run can tell them (``server_arrival_s``,
estimated by the replayer from each answer's timings), else the send times: in a
burst the server takes the requests in over tens of milliseconds and in an
order of its own, and the simulator must see the order the gate saw.

The run file must carry the columns ``qlab replay`` writes beside qsim's
schema: calibrated_est_s, engine_s, the policy's fields (policy, max_queue,
max_queued_seconds, predictive, expire_at_front, policy_deadline_s),
engines, fixed_estimate and initial_speed_factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from qsim import Policy, from_arrays, simulate
from qsim.policy import on_time
from qsim.records import ANSWERED, OUTCOMES

RUN_COLUMNS = ("calibrated_est_s", "engine_s", "policy", "engines", "max_queue", "max_queued_seconds",
               "predictive", "expire_at_front", "policy_deadline_s", "fixed_estimate", "initial_speed_factor")
SIM_OUTCOMES = tuple(o for o in OUTCOMES if o != "error")


@dataclass(frozen=True)
class RunSetup:
    """How the live server was configured, read back from the run's constant columns."""

    policy: Policy
    engines: int
    fixed_estimate: bool
    initial_speed_factor: float


def _constant(run: pd.DataFrame, column: str):
    values = run[column].drop_duplicates()
    if len(values) != 1:
        raise ValueError(f"run column {column} must hold one value for the whole run, found {list(values)[:5]}")
    value = values.iloc[0]
    return None if pd.isna(value) else value


def run_setup(run: pd.DataFrame) -> RunSetup:
    missing = [c for c in RUN_COLUMNS if c not in run.columns]
    if missing:
        raise ValueError(f"not a live run file (from qlab replay): it lacks columns {missing}")
    if run.empty:
        raise ValueError("the run has no requests")
    bound = _constant(run, "max_queue")
    work = _constant(run, "max_queued_seconds")
    policy = Policy(str(_constant(run, "policy")), max_queue=None if bound is None else int(bound),
                    max_queued_seconds=None if work is None else float(work),
                    predictive=bool(_constant(run, "predictive")), deadline_s=float(_constant(run, "policy_deadline_s")),
                    expire_at_front=bool(_constant(run, "expire_at_front")))
    return RunSetup(policy, int(_constant(run, "engines")), bool(_constant(run, "fixed_estimate")),
                    float(_constant(run, "initial_speed_factor")))


def measured_speed(run: pd.DataFrame) -> float:
    """Median of measured engine time over the calibrated estimate, among the served; NaN if none was."""
    served = run["outcome"].isin(ANSWERED) & run["engine_s"].gt(0)
    ratio = run.loc[served, "engine_s"] / run.loc[served, "calibrated_est_s"]
    return float(ratio.median()) if len(ratio) else math.nan


def arrival_times(run: pd.DataFrame, origin: str = "server") -> np.ndarray:
    """When each request reached the system: the gate's arrival where the run knows it
    (``origin="server"``), else, or with ``origin="sent"``, the client's send time."""
    if origin not in ("server", "sent"):
        raise ValueError(f"arrival origin must be server or sent, got {origin!r}")
    sent = run["arrival_s"].to_numpy(float)
    if origin == "sent" or "server_arrival_s" not in run.columns:
        return sent
    server = run["server_arrival_s"].to_numpy(float)
    return np.where(np.isfinite(server), server, sent)


def held_s(run: pd.DataFrame, waited_s: float = 1e-4) -> np.ndarray:
    """How long each answered request held its engine, as the gate saw it; NaN for the unserved.

    The engine's own time misses the hand-back to the gate (thread to event
    loop, under a burst up to a millisecond), during which the gate still
    counts the engine busy. Where the next request on the same engine had been
    waiting, the gate started it the moment this one was handed back: the gap
    between the two starts is the holding time. Elsewhere: engine_s plus the
    median hand-back seen in those gaps.
    """
    served = run["outcome"].isin(ANSWERED).to_numpy() & run["engine_s"].gt(0).to_numpy()
    held = np.where(served, run["engine_s"].to_numpy(float), np.nan)
    if "engine" not in run.columns or not served.any():
        return held
    part = run.loc[served, ["start_s", "engine_s", "queue_s", "engine"]].assign(pos=np.flatnonzero(served))
    part = part.dropna(subset=["engine"]).sort_values(["engine", "start_s"])
    nxt = part.groupby("engine")[["start_s", "queue_s"]].shift(-1)
    handed = nxt["queue_s"].gt(waited_s)  # the next one waited, so it started at this one's hand-back
    gaps = (nxt["start_s"] - part["start_s"])[handed]
    overhead = float(np.median(gaps - part.loc[handed, "engine_s"])) if handed.any() else 0.0
    held[part["pos"].to_numpy()] = np.where(handed, nxt["start_s"] - part["start_s"],
                                            part["engine_s"] + max(0.0, overhead))
    return held


def simulate_run(run: pd.DataFrame, origin: str = "server") -> pd.DataFrame:
    """qsim's rows for the run's arrivals, in the run's request order and ids (times on the run's clock)."""
    setup = run_setup(run)
    speed = measured_speed(run)
    speed = setup.initial_speed_factor if math.isnan(speed) else speed
    arrival = arrival_times(run, origin)
    order = np.lexsort((run["request_id"].to_numpy(), arrival))
    ordered = run.iloc[order]
    held = held_s(ordered)
    true = np.where(np.isfinite(held), held, ordered["calibrated_est_s"] * speed)
    # The server's speed tracker may not start at 1 (it is resident across runs). Scaling the base
    # estimate by its starting factor is exactly a tracker that starts there: it then learns
    # true / (base * f0), and every estimate it makes is base * f0 * that, the same numbers.
    scale = 1.0 if setup.fixed_estimate else setup.initial_speed_factor
    trace = from_arrays(arrival[order], ordered["max_new_tokens"].to_numpy(),
                        true_service_s=true, est_service_s=ordered["calibrated_est_s"].to_numpy() * scale,
                        deadline_s=ordered["deadline_s"].to_numpy(), name="live-arrivals")
    sim = simulate(trace, setup.policy, setup.engines, fixed_estimate=setup.fixed_estimate)
    sim["request_id"] = ordered["request_id"].to_numpy()
    sim.attrs["measured_speed"] = speed
    return sim.sort_values("request_id", ignore_index=True)


def join(run: pd.DataFrame, sim: pd.DataFrame) -> pd.DataFrame:
    """One row per request: live and simulated outcome, reason and latency, and whether they agree.

    Both latencies run from the client's send time (the simulator's arrival may be the
    gate's, a little later), so latency_error_s = sim finish - live finish: the service
    times and queueing the simulator got wrong, not the trip to the server. For the
    same reason a simulated answer is good or late by that latency, as the live one
    is by the client's; sim_outcome_at_gate keeps the simulator's own verdict.
    """
    live = run[["request_id", "size_class", "max_new_tokens", "deadline_s", "outcome", "reason", "arrival_s",
                "finish_s"]]
    simmed = sim[["request_id", "outcome", "reason", "finish_s"]]
    both = live.merge(simmed, on="request_id", suffixes=("_live", "_sim"), validate="one_to_one")
    both = both.rename(columns={"outcome_live": "live_outcome", "outcome_sim": "sim_outcome_at_gate",
                                "reason_live": "live_reason", "reason_sim": "sim_reason"})
    both["live_latency_s"] = both["finish_s_live"] - both["arrival_s"]
    both["sim_latency_s"] = both["finish_s_sim"] - both["arrival_s"]
    in_time = np.where(on_time(both["sim_latency_s"], both["deadline_s"]), "good", "late")
    sim_answered = both["sim_outcome_at_gate"].isin(ANSWERED)
    both["sim_outcome"] = both["sim_outcome_at_gate"].where(~sim_answered, pd.Series(in_time, index=both.index))
    both = both.drop(columns=["finish_s_live", "finish_s_sim"])
    both["agree"] = both["live_outcome"].eq(both["sim_outcome"]).astype(bool)
    answered = both["live_outcome"].isin(ANSWERED) & both["sim_outcome"].isin(ANSWERED)
    both["latency_error_s"] = (both["sim_latency_s"] - both["live_latency_s"]).where(answered)
    return both


def confusion(joined: pd.DataFrame) -> pd.DataFrame:
    """Counts of (live outcome, simulated outcome), every outcome shown even when zero."""
    table = pd.crosstab(joined["live_outcome"].astype(str), joined["sim_outcome"].astype(str))
    table = table.reindex(index=list(OUTCOMES), columns=list(SIM_OUTCOMES), fill_value=0)
    table.index.name, table.columns.name = "live", "sim"
    return table


def summarize(joined: pd.DataFrame, speed: float) -> dict[str, float]:
    """Disagreements (among requests the service handled: live errors are counted apart),
    outcome counts both ways, and the absolute latency error of requests both answered."""
    handled = joined[joined["live_outcome"] != "error"]
    wrong = int((~handled["agree"]).sum())
    error = joined["latency_error_s"].dropna()
    row: dict[str, float] = {
        "requests": len(joined),
        "live_errors": int((joined["live_outcome"] == "error").sum()),
        "disagreements": wrong,
        "disagreement_rate": wrong / len(handled) if len(handled) else math.nan,
        "both_answered": len(error),
        "latency_abs_error_p50_s": error.abs().quantile(0.5),
        "latency_abs_error_p90_s": error.abs().quantile(0.9),
        "latency_abs_error_p99_s": error.abs().quantile(0.99),
        "latency_error_mean_s": error.mean(),
        "measured_speed": speed,
    }
    for outcome in OUTCOMES:
        row[f"live_{outcome}"] = int((joined["live_outcome"] == outcome).sum())
        row[f"sim_{outcome}"] = int((joined["sim_outcome"] == outcome).sum())
    return {k: float(v) for k, v in row.items()}


@dataclass(frozen=True)
class Comparison:
    joined: pd.DataFrame
    confusion: pd.DataFrame
    summary: dict[str, float]


def compare(run: pd.DataFrame, origin: str = "server") -> Comparison:
    """Simulate the run's arrivals (the gate's by default, see :func:`arrival_times`) and join."""
    sim = simulate_run(run, origin)
    joined = join(run, sim)
    return Comparison(joined, confusion(joined), summarize(joined, sim.attrs["measured_speed"]))


def figure(result: Comparison, path: str | Path) -> None:
    """Confusion heatmap beside the distribution of latency errors (sim - live) of requests both answered."""
    # No backend is forced (as in analysis.plots): without a display matplotlib picks Agg by itself.
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    table = result.confusion
    left.imshow(table.to_numpy(), cmap="Blues")
    left.set_xticks(range(table.shape[1]), table.columns)
    left.set_yticks(range(table.shape[0]), table.index)
    left.set_xlabel("simulator")
    left.set_ylabel("live service")
    for (i, j), v in np.ndenumerate(table.to_numpy()):
        left.text(j, i, str(v), ha="center", va="center", color="black" if v < table.to_numpy().max() / 2 else "white")
    s = result.summary
    left.set_title(f"outcomes: {int(s['disagreements'])} disagree ({s['disagreement_rate']:.1%})")
    error_ms = result.joined["latency_error_s"].dropna().to_numpy() * 1e3
    if error_ms.size:
        right.hist(error_ms, bins=min(50, max(5, error_ms.size // 5)), color="tab:blue", alpha=0.7)
        cdf = right.twinx()
        cdf.plot(np.sort(error_ms), np.linspace(0, 1, error_ms.size), color="tab:orange")
        cdf.set_ylabel("cumulative share")
        cdf.set_ylim(0, 1)
    right.set_xlabel("latency error, simulator - live (ms)")
    right.set_ylabel("requests")
    right.set_title(f"both answered: {int(s['both_answered'])}, |error| p50 {s['latency_abs_error_p50_s'] * 1e3:.1f} ms, "
                    f"p99 {s['latency_abs_error_p99_s'] * 1e3:.1f} ms", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
