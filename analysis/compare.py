"""Simulator versus service, request by request, and run against prediction.

**Replay** (:func:`compare`). A live run (rows from ``qlab replay``) is replayed
in qsim with what the gate knew of each request at the time (the columns
:mod:`live.rows` writes), so that a disagreement measures the machine, not the
comparison:

* arrivals: the gate's (``server_arrival_s``), else the send times: in a burst
  the server takes requests in over tens of milliseconds and in an order of
  its own, and the simulator must see the order the gate saw;
* the policy, engines, stall rule, tracker weight, whether the estimate is
  fixed, and the tracker's factor at the run's start, all from the server's
  /stats (constant columns), passed to :func:`qsim.simulate` as they are;
* a request the engine took holds its engine for ``engine_returned_s -
  engine_started_s`` (what the gate counted busy: the engine's time plus the
  hand-back), and teaches the tracker ``engine_reported_s`` (what the gate's
  tracker was given); a failed run is a failure (holds its engine, teaches
  nothing, ends as an error);
* a stalled run holds its engine until that engine next took a request (the
  gate never reports the hand-back of a stalled run), or past the run's end;
* **a request the engine never took** (refused, dropped, or run only in the
  simulator) gets what was known at its arrival and nothing later: its
  estimate then, ``calibrated_est_s x arrival_speed_factor`` (the tracker's
  factor at its arrival; the run's initial factor where the answer did not
  say). Column ``replayed_with`` names the rule each request got.

The two outcomes of each request are then joined on request_id
(:func:`join`). A disagreement is **independent** when the simulator met the
same queue at that arrival as the gate did, and **cascade** otherwise (it
inherits an earlier divergence). The same queue means, precisely: equal
``queued_at_arrival``, ``queued_work_at_arrival_s`` within
:data:`TOLERANCE_S`, the same speed factor (within 1e-9), and no earlier
arrival still in the system on either side (until the later of its two ends)
whose trajectory diverged (outcome, engine start or end differ by more than
:data:`TOLERANCE_S`). The first divergence is the gate time of the first
arrival that diverged or met a different queue.

**Prediction** (:func:`predict`): would the simulator have predicted this run?
Only the arrivals are kept; service times come from the calibrated model at the
speed probed before the run (``speed_before``, from ``qlab live``; a run of
``qlab replay`` alone has no probe, and the server's speed factor at the run's
start stands in), times lognormal noise of a given CV, over many seeds. Share
in time, goodput and latency percentiles are compared with the live run's, with
95 % Student-t intervals of the mean across seeds and the 2.5-97.5 % range of
the seeds, as Vidur-like simulators report their error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from qsim import Policy, from_arrays, simulate
from qsim.policy import on_time, policy_from_fields
from qsim.queue import StallRule
from qsim.records import ANSWERED, OUTCOMES
from qsim.workload import lognormal_noise

from .metrics import mean_ci, run_duration, summary

RUN_COLUMNS = ("calibrated_est_s", "engine_s", "policy", "engines", "max_queue", "max_queued_seconds",
               "predictive", "expire_at_front", "policy_deadline_s", "fixed_estimate", "initial_speed_factor")
#: What the gate knew per request (live.rows); a run file from an older qlab replay lacks them (see _known).
REPLAY_COLUMNS = ("server_arrival_s", "arrival_speed_factor", "engine_started_s", "engine_returned_s",
                  "engine_reported_s", "failed", "stalled", "server_finish_s", "stall_factor", "stall_floor_s",
                  "tracker_weight")
SIM_OUTCOMES = tuple(o for o in OUTCOMES if o != "abandoned")
REFUSED = ("rejected", "expired")
#: Engine failures the simulator replays; any other live error (transport, 4xx) it cannot.
ENGINE_REASONS = ("engine_exception", "engine_stalled")
#: Two times (or queued works) closer than this are the same: far below any service time, far above rounding.
TOLERANCE_S = 1e-6
#: The rule each replayed request's engine time came from (column replayed_with).
RULES = {"held": "returned - started (what the gate counted busy)",
         "engine_s": "the engine's own time (an older run file: no hand-back known)",
         "stalled": "a stalled run: until its engine next took a request",
         "estimate": "never started: calibrated estimate x speed factor at its arrival"}


@dataclass(frozen=True)
class RunSetup:
    """How the live server was configured, read back from the run's constant columns."""

    policy: Policy
    engines: int
    fixed_estimate: bool
    initial_speed_factor: float
    stall: StallRule | None = StallRule()
    tracker_weight: float = 0.2


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
    if "policy_fields" in run.columns:  # every field, a policy class's own parameters too
        policy = policy_from_fields(json.loads(str(_constant(run, "policy_fields"))))
    else:
        bound = _constant(run, "max_queue")
        work = _constant(run, "max_queued_seconds")
        policy = Policy(str(_constant(run, "policy")), max_queue=None if bound is None else int(bound),
                        max_queued_seconds=None if work is None else float(work),
                        predictive=bool(_constant(run, "predictive")),
                        deadline_s=float(_constant(run, "policy_deadline_s")),
                        expire_at_front=bool(_constant(run, "expire_at_front")),
                        # A run file from before disciplines: the gate served FIFO.
                        discipline=str(_constant(run, "discipline")) if "discipline" in run.columns else "fifo")
    # An older run file does not say: the gate's defaults then (StallRule(), weight 0.2).
    factor = _constant(run, "stall_factor") if "stall_factor" in run.columns else None
    floor = _constant(run, "stall_floor_s") if "stall_floor_s" in run.columns else None
    stall = StallRule() if factor is None or floor is None else StallRule(float(factor), float(floor))
    weight = _constant(run, "tracker_weight") if "tracker_weight" in run.columns else None
    return RunSetup(policy, int(_constant(run, "engines")), bool(_constant(run, "fixed_estimate")),
                    float(_constant(run, "initial_speed_factor")), stall, 0.2 if weight is None else float(weight))


def measured_speed(run: pd.DataFrame) -> float:
    """Median of measured engine time over the calibrated estimate, among the served; NaN if none was.

    The run's speed after the fact, for its effective load (nominal x this); the replay does not use
    it (it would hand a request information from the run's future)."""
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


def _known(run: pd.DataFrame) -> pd.DataFrame:
    """The replay columns, filled the old way where a run file predates them (NaN: not known)."""
    out = pd.DataFrame(index=run.index)
    nan = pd.Series(np.nan, index=run.index)
    for name in ("arrival_speed_factor", "engine_started_s", "engine_returned_s", "server_finish_s"):
        out[name] = run[name].astype(float) if name in run.columns else nan
    out["engine_reported_s"] = (run["engine_reported_s"] if "engine_reported_s" in run.columns
                                else run["engine_s"]).astype(float)
    reason = run["reason"].astype("string")
    for name, why in (("failed", "engine_exception"), ("stalled", "engine_stalled")):
        out[name] = run[name].astype(bool) if name in run.columns else (reason.eq(why).fillna(False)
                                                                          & run["outcome"].eq("error")).astype(bool)
    return out


def replay_inputs(run: pd.DataFrame, setup: RunSetup) -> pd.DataFrame:
    """Per request (in the run's row order): hold_s (engine time in the replay), reported_s (what the
    tracker learns), failed, and replayed_with (which rule of :data:`RULES` gave hold_s)."""
    known = _known(run)
    started = known["engine_started_s"].to_numpy(float)
    held = known["engine_returned_s"].to_numpy(float) - started
    engine_s = known["engine_reported_s"].to_numpy(float)
    failed = known["failed"].to_numpy(bool)
    stalled = known["stalled"].to_numpy(bool) & np.isfinite(started)
    ran = run["outcome"].isin(ANSWERED).to_numpy() | failed
    ran_old = ~np.isfinite(held) & ~stalled & np.isfinite(engine_s) & ran
    factor = known["arrival_speed_factor"].to_numpy(float)
    factor = np.where(np.isfinite(factor), factor, 1.0 if setup.fixed_estimate else setup.initial_speed_factor)
    estimate = run["calibrated_est_s"].to_numpy(float) * factor
    rule = np.where(np.isfinite(held), "held", np.where(ran_old, "engine_s", np.where(stalled, "stalled", "estimate")))
    hold = np.select([rule == "held", rule == "engine_s"], [held, engine_s], estimate)
    if stalled.any():
        hold[stalled] = _stalled_hold(run, started, stalled)
    reported = np.where(np.isfinite(engine_s) & np.isin(rule, ["held", "engine_s"]), engine_s, hold)
    return pd.DataFrame({"hold_s": np.maximum(hold, 0.0), "reported_s": reported,
                         "failed": failed & (rule != "estimate"), "replayed_with": rule}, index=run.index)


def _stalled_hold(run: pd.DataFrame, started: np.ndarray, stalled: np.ndarray) -> np.ndarray:
    """A stalled run held its engine until the engine next took a request; if it never did, until a
    second after the run's last event (it hung past the end)."""
    engine = run["engine"].to_numpy(dtype=float, na_value=np.nan)
    end = float(np.nanmax(run["finish_s"].to_numpy(float))) + 1.0
    out = []
    for i in np.flatnonzero(stalled):
        later = started[(engine == engine[i]) & (started > started[i])]
        out.append((later.min() if later.size else max(end, started[i] + 1.0)) - started[i])
    return np.asarray(out)


def _in_arrival_order(run: pd.DataFrame, origin: str) -> tuple[pd.DataFrame, np.ndarray]:
    """The run's rows in the order the gate took them, and their arrival times (see :func:`arrival_times`)."""
    arrival = arrival_times(run, origin)
    order = np.lexsort((run["request_id"].to_numpy(), arrival))
    return run.iloc[order], arrival[order]


def _simulate(ordered: pd.DataFrame, arrival: np.ndarray, setup: RunSetup, true_s: np.ndarray, name: str,
              **faults) -> pd.DataFrame:
    """The run's arrivals through qsim as the server was set up, each request held for ``true_s``."""
    trace = from_arrays(arrival, ordered["max_new_tokens"].to_numpy(), true_service_s=true_s,
                        est_service_s=ordered["calibrated_est_s"].to_numpy(float),
                        deadline_s=ordered["deadline_s"].to_numpy(), priority=ordered["priority"].to_numpy(),
                        client_id=ordered["client_id"].astype(object).where(ordered["client_id"].notna(), None).to_numpy(),
                        name=name)
    return simulate(trace, setup.policy, setup.engines, fixed_estimate=setup.fixed_estimate,
                    tracker_weight=setup.tracker_weight, initial_speed_factor=setup.initial_speed_factor,
                    stall=setup.stall, **faults)


def simulate_run(run: pd.DataFrame, origin: str = "server") -> pd.DataFrame:
    """qsim's rows for the run's arrivals, in the run's request order and ids (times on the run's clock).

    Extra columns: speed_factor_at_arrival (est_service_s / calibrated) and replayed_with."""
    setup = run_setup(run)
    ordered, arrival = _in_arrival_order(run, origin)
    given = replay_inputs(ordered, setup)
    base = ordered["calibrated_est_s"].to_numpy(float)
    sim = _simulate(ordered, arrival, setup, given["hold_s"].to_numpy(), "live-arrivals",
                    failed=given["failed"].to_numpy(), reported_s=given["reported_s"].to_numpy())
    sim["request_id"] = ordered["request_id"].to_numpy()
    sim["speed_factor_at_arrival"] = sim["est_service_s"].to_numpy(float) / base
    sim["replayed_with"] = given["replayed_with"].to_numpy()
    return sim.sort_values("request_id", ignore_index=True)


def join(run: pd.DataFrame, sim: pd.DataFrame) -> pd.DataFrame:
    """One row per request: live and simulated outcome, reason, latency, queue at arrival, and agreement.

    Latencies are the client's: live_latency_s as measured; sim_latency_s is the simulator's own
    time in the gate (its finish, from its own start and hold, less the gate arrival) plus the trips
    the client measured (send to gate arrival, gate end to answer), so latency_error_s is the time
    in the gate the simulator got wrong. A simulated answer is good or late by that latency, as
    the live one is by the client's; sim_outcome_at_gate keeps the simulator's own verdict.
    """
    known = _known(run)
    live = run[["request_id", "size_class", "max_new_tokens", "deadline_s", "outcome", "reason", "arrival_s",
                "finish_s", "queued_at_arrival", "queued_work_at_arrival_s"]].assign(
        gate_arrival_s=arrival_times(run), live_start_s=known["engine_started_s"].to_numpy(),
        live_end_s=known["server_finish_s"].to_numpy(), live_speed_factor=known["arrival_speed_factor"].to_numpy())
    simmed = sim[["request_id", "outcome", "reason", "start_s", "finish_s", "latency_s", "queued_at_arrival",
                  "queued_work_at_arrival_s", "speed_factor_at_arrival", "replayed_with"]].rename(
        columns={"start_s": "sim_start_s", "finish_s": "sim_end_s", "latency_s": "sim_gate_latency_s",
                 "speed_factor_at_arrival": "sim_speed_factor"})
    both = live.merge(simmed, on="request_id", suffixes=("_live", "_sim"), validate="one_to_one")
    both = both.rename(columns={"outcome_live": "live_outcome", "outcome_sim": "sim_outcome_at_gate",
                                "reason_live": "live_reason", "reason_sim": "sim_reason"})
    both["live_latency_s"] = both["finish_s"] - both["arrival_s"]
    live_gate = both["live_end_s"] - both["gate_arrival_s"]
    trips = (both["live_latency_s"] - live_gate).where(live_gate.notna(), both["gate_arrival_s"] - both["arrival_s"])
    both["sim_latency_s"] = both["sim_gate_latency_s"] + trips
    in_time = np.where(on_time(both["sim_latency_s"], both["deadline_s"]), "good", "late")
    sim_answered = both["sim_outcome_at_gate"].isin(ANSWERED)
    both["sim_outcome"] = both["sim_outcome_at_gate"].where(~sim_answered, pd.Series(in_time, index=both.index))
    both = both.drop(columns=["finish_s"])
    both["agree"] = both["live_outcome"].eq(both["sim_outcome"]).astype(bool)
    answered = both["live_outcome"].isin(ANSWERED) & both["sim_outcome"].isin(ANSWERED)
    both["latency_error_s"] = (both["sim_latency_s"] - both["live_latency_s"]).where(answered)
    both["modelled"] = (both["live_outcome"].ne("error") | both["live_reason"].isin(ENGINE_REASONS)).astype(bool)
    return _divergence(both)


def _close(a: pd.Series, b: pd.Series, tol: float) -> np.ndarray:
    """Equal within tol, NaN equal to NaN."""
    a, b = a.to_numpy(float), b.to_numpy(float)
    return (np.abs(a - b) <= tol) | (np.isnan(a) & np.isnan(b))


def _divergence(both: pd.DataFrame) -> pd.DataFrame:
    """Mark each request's trajectory (diverged), the queue it met (same_queue), and its disagreement
    as independent or cascade; see the module docstring for the definitions."""
    order = np.lexsort((both["request_id"].to_numpy(), both["gate_arrival_s"].to_numpy(float)))
    b = both.iloc[order].copy()
    live_end = b["live_end_s"].fillna(b["arrival_s"] + b["live_latency_s"])
    b["diverged"] = ~(b["agree"].to_numpy() & _close(b["live_start_s"], b["sim_start_s"], TOLERANCE_S)
                      & _close(live_end, b["sim_end_s"], TOLERANCE_S))
    counts = b["queued_at_arrival_live"].astype("Float64").to_numpy(dtype=float, na_value=np.nan)
    sim_counts = b["queued_at_arrival_sim"].astype("Float64").to_numpy(dtype=float, na_value=np.nan)
    same = np.isnan(counts) | (counts == sim_counts)
    work = b["queued_work_at_arrival_s_live"].to_numpy(float)
    same &= np.isnan(work) | (np.abs(work - b["queued_work_at_arrival_s_sim"].to_numpy(float)) <= TOLERANCE_S)
    factor = b["live_speed_factor"].to_numpy(float)
    same &= np.isnan(factor) | (np.abs(factor - b["sim_speed_factor"].to_numpy(float)) <= 1e-9)
    # Still in the system at this arrival: an earlier diverged request whose later end is after it.
    reach = np.where(b["diverged"], np.fmax(live_end.to_numpy(float), b["sim_end_s"].to_numpy(float)), -np.inf)
    reach = np.where(np.isnan(reach), np.inf, reach)
    before = np.concatenate([[-np.inf], np.maximum.accumulate(reach)[:-1]])
    b["same_queue"] = same & (before <= b["gate_arrival_s"].to_numpy(float))
    wrong = ~b["agree"] & b["modelled"]
    b["disagreement"] = np.where(wrong, np.where(b["same_queue"], "independent", "cascade"), "")
    return b.sort_values("request_id", ignore_index=True)


def confusion(joined: pd.DataFrame) -> pd.DataFrame:
    """Counts of (live outcome, simulated outcome), every outcome shown even when zero."""
    table = pd.crosstab(joined["live_outcome"].astype(str), joined["sim_outcome"].astype(str))
    table = table.reindex(index=list(OUTCOMES), columns=list(SIM_OUTCOMES), fill_value=0)
    table.index.name, table.columns.name = "live", "sim"
    return table


def reasons(joined: pd.DataFrame) -> pd.DataFrame:
    """Counts of (live reason, simulated reason) among requests both refused or dropped."""
    refused = joined[joined["live_outcome"].isin(REFUSED) & joined["sim_outcome"].isin(REFUSED)]
    table = pd.crosstab(refused["live_reason"].astype(str), refused["sim_reason"].astype(str))
    table.index.name, table.columns.name = "live", "sim"
    return table


def summarize(joined: pd.DataFrame, speed: float = math.nan) -> dict[str, float]:
    """Disagreements among requests the service handled (live errors apart; engine failures are
    replayed and counted as failure_disagreements), independent and cascade, the first divergence,
    refusal reasons both ways, outcome counts both ways and the latency error of requests both answered."""
    handled = joined[joined["live_outcome"] != "error"]
    wrong = ~handled["agree"]
    failures = joined[joined["live_outcome"].eq("error") & joined["modelled"]]
    error = joined["latency_error_s"].dropna()
    refused = joined["live_outcome"].isin(REFUSED) & joined["sim_outcome"].isin(REFUSED)
    same_reason = joined.loc[refused, "live_reason"].astype(str).eq(joined.loc[refused, "sim_reason"].astype(str))
    apart = joined["diverged"] | ~joined["same_queue"]
    row: dict[str, float] = {
        "requests": len(joined),
        "live_errors": int((joined["live_outcome"] == "error").sum()),
        "engine_failures": len(failures),
        "disagreements": int(wrong.sum()),
        "disagreement_rate": wrong.sum() / len(handled) if len(handled) else math.nan,
        "independent_disagreements": int((handled["disagreement"] == "independent").sum()),
        "cascade_disagreements": int((handled["disagreement"] == "cascade").sum()),
        "failure_disagreements": int((~failures["agree"]).sum()),
        "first_divergence_s": joined.loc[apart, "gate_arrival_s"].min() if apart.any() else math.nan,
        "first_disagreement_s": handled.loc[wrong, "gate_arrival_s"].min() if wrong.any() else math.nan,
        "both_refused": int(refused.sum()),
        "reasons_agree": int(same_reason.sum()),
        "reasons_disagree": int((~same_reason).sum()),
        "both_answered": len(error),
        "latency_abs_error_p50_s": error.abs().quantile(0.5),
        "latency_abs_error_p90_s": error.abs().quantile(0.9),
        "latency_abs_error_p99_s": error.abs().quantile(0.99),
        "latency_error_mean_s": error.mean(),
        "measured_speed": speed,
    }
    for rule in RULES:
        row[f"replayed_{rule}"] = int((joined["replayed_with"] == rule).sum())
    for outcome in OUTCOMES:
        row[f"live_{outcome}"] = int((joined["live_outcome"] == outcome).sum())
        row[f"sim_{outcome}"] = int((joined["sim_outcome"] == outcome).sum())
    return {k: float(v) for k, v in row.items()}


@dataclass(frozen=True)
class Comparison:
    joined: pd.DataFrame
    confusion: pd.DataFrame
    summary: dict[str, float]
    reasons: pd.DataFrame | None = None


def compare(run: pd.DataFrame, origin: str = "server") -> Comparison:
    """Replay the run in the simulator (arrivals the gate's by default, see :func:`arrival_times`) and join."""
    joined = join(run, simulate_run(run, origin))
    return Comparison(joined, confusion(joined), summarize(joined, measured_speed(run)), reasons(joined))


# ---------------------------------------------------------------- prediction

#: Metrics a prediction is judged on (analysis.metrics.summary's names).
PREDICTED = ("share_good", "goodput_rps", "latency_p50_s", "latency_p99_s")


@dataclass(frozen=True)
class Prediction:
    table: pd.DataFrame  # one row per metric: live, sim mean, intervals, error
    per_seed: pd.DataFrame  # one row per seed: the metrics
    speed: float
    speed_source: str
    noise_cv: float


def prediction_speed(run: pd.DataFrame) -> tuple[float, str]:
    """The speed the prediction runs at, and where it came from."""
    if "speed_before" in run.columns and np.isfinite(run["speed_before"].astype(float)).any():
        return float(run["speed_before"].astype(float).dropna().iloc[0]), "probed before the run (speed_before)"
    return (float(_constant(run, "initial_speed_factor")),
            "the server's speed factor at the run's start (the run file has no probe: "
            "qlab replay alone does not probe)")


def run_seconds(run: pd.DataFrame) -> float:
    """The run's arrival window (from the replay's metadata) else its makespan: goodput is per these seconds."""
    meta = run.attrs.get("qlab_run") if isinstance(run.attrs.get("qlab_run"), dict) else {}
    return run_duration(run, meta.get("duration_s"))


def predict(run: pd.DataFrame, seeds: int = 20, noise_cv: float = 0.1, origin: str = "server",
            level: float = 0.95) -> Prediction:
    """Simulate the run's arrivals with modelled service times over ``seeds`` seeds; compare the metrics."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    setup = run_setup(run)
    speed, source = prediction_speed(run)
    ordered, arrival = _in_arrival_order(run, origin)
    base = ordered["calibrated_est_s"].to_numpy(float)
    seconds = run_seconds(run)
    rows = []
    for seed in range(seeds):
        true = base * speed * lognormal_noise(np.random.default_rng(seed), len(base), noise_cv)
        got = summary(_simulate(ordered, arrival, setup, true, "predicted"), seconds)
        rows.append({"seed": seed, **{m: got[m] for m in PREDICTED}})
    per_seed = pd.DataFrame(rows)
    live = summary(run, seconds)
    table = []
    for m in PREDICTED:
        mean, low, high = mean_ci(per_seed[m], level)
        values = per_seed[m].dropna()
        lo_q, hi_q = (values.quantile(0.025), values.quantile(0.975)) if len(values) else (math.nan, math.nan)
        error = mean - live[m]
        table.append({"metric": m, "live": live[m], "sim_mean": mean, "ci_low": low, "ci_high": high,
                      "seeds_p2_5": lo_q, "seeds_p97_5": hi_q, "error": error,
                      "relative_error": error / live[m] if live[m] else math.nan,
                      "live_within_seeds": bool(lo_q <= live[m] <= hi_q)})
    return Prediction(pd.DataFrame(table).set_index("metric"), per_seed, speed, source, noise_cv)


def figure(result: Comparison, path: str | Path) -> None:
    """Three panels: the confusion heatmap (with refusal reasons agreeing), the distribution of latency
    errors (sim - live) of requests both answered, and disagreements over the run's time, independent
    and cascade, with the first divergence marked."""
    # No backend is forced (as in analysis.plots): without a display matplotlib picks Agg by itself.
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    table = result.confusion
    left.imshow(table.to_numpy(), cmap="Blues")
    left.set_xticks(range(table.shape[1]), table.columns)
    left.set_yticks(range(table.shape[0]), table.index)
    left.set_xlabel("simulator")
    left.set_ylabel("live service")
    for (i, j), v in np.ndenumerate(table.to_numpy()):
        left.text(j, i, str(v), ha="center", va="center", color="black" if v < table.to_numpy().max() / 2 else "white")
    s = result.summary
    left.set_title(f"outcomes: {int(s['disagreements'])} disagree ({s['disagreement_rate']:.1%}); refusal reasons "
                   f"agree {int(s['reasons_agree'])}/{int(s['both_refused'])}", fontsize=9)
    error_ms = result.joined["latency_error_s"].dropna().to_numpy() * 1e3
    if error_ms.size:
        middle.hist(error_ms, bins=min(50, max(5, error_ms.size // 5)), color="tab:blue", alpha=0.7)
        cdf = middle.twinx()
        cdf.plot(np.sort(error_ms), np.linspace(0, 1, error_ms.size), color="tab:orange")
        cdf.set_ylabel("cumulative share")
        cdf.set_ylim(0, 1)
    middle.set_xlabel("latency error, simulator - live (ms)")
    middle.set_ylabel("requests")
    middle.set_title(f"both answered: {int(s['both_answered'])}, |error| p50 "
                     f"{s['latency_abs_error_p50_s'] * 1e3:.1f} ms, p99 {s['latency_abs_error_p99_s'] * 1e3:.1f} ms", fontsize=9)
    joined = result.joined.sort_values("gate_arrival_s")
    for kind, color in (("independent", "tab:red"), ("cascade", "tab:gray")):
        mine = joined["disagreement"].eq(kind).to_numpy()
        right.step(joined["gate_arrival_s"], np.cumsum(mine), where="post", color=color,
                   label=f"{kind}: {int(mine.sum())}")
    if math.isfinite(s["first_divergence_s"]):
        right.axvline(s["first_divergence_s"], color="tab:orange", linestyle="--",
                      label=f"first divergence {s['first_divergence_s']:.2f} s")
    right.set_xlabel("arrival at the gate (s)")
    right.set_ylabel("disagreements so far")
    right.legend(fontsize=8, loc="upper left")
    right.set_title("independent (same queue at arrival) vs cascade", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
