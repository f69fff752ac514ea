"""What the gate knew of a live run's requests, and the replay's inputs made of it
(:mod:`analysis.replay`): the server the run ran against, each request's gate arrival, the engine
time it holds in the replay and what it teaches the tracker (by the rules of :data:`RULES`), the
tokens it generated; and the run's arrivals through qsim as the server was set up."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd

from qsim import from_arrays, simulate
from qsim.config import ServerConfig
from qsim.outcomes import ANSWERED
from qsim.fleet import FleetSpec
from qsim.prefix import SEGMENTS, Tokens
from qsim.runfile import server_config
from qsim.service import SpeedSchedule


#: Columns of a live run file besides the server's configuration (qsim.runfile).
RUN_COLUMNS = ("calibrated_est_s", "engine_s")
#: What the gate knew per request (live.rows); a run file from an older qlab replay lacks them
#: (see :func:`gate_knew`).
REPLAY_COLUMNS = (
    "server_arrival_s",
    "arrival_speed_factor",
    "engine_started_s",
    "engine_returned_s",
    "engine_reported_s",
    "failed",
    "stalled",
    "server_finish_s",
    "stall_factor",
    "stall_floor_s",
    "tracker_weight",
)
#: Rows of a run with retries are attempts: (first_request_id, attempt) names one on both sides.
KEYS = ["first_request_id", "attempt"]
#: Two times (or queued works) closer than this are the same: far below any service time, far above
#: rounding.
TOLERANCE_S = 1e-6
#: The rule each replayed request's engine time came from (column replayed_with).
RULES = {
    "held": "returned - started (what the gate counted busy)",
    "engine_s": "the engine's own time (an older run file: no hand-back known)",
    "stalled": "a stalled run: until its engine next took a request",
    "down": "a run its replica's going down ended (qlab serve --replica-down: no hand-back "
    "known): until its engine next took a request",
    "estimate": "never started: calibrated estimate x speed factor at its arrival",
    "cancelled": "its client hung up while it ran: until the hang-up reached the gate",
    "cut": "cut at its deadline live: its deadline plus its estimate, so that it passes it "
    "wherever it starts",
    "steps": "a batching engine: the run's steps in order, each as long as it ran live",
}


def run_setup(run: pd.DataFrame) -> ServerConfig:
    """The server the run ran against (:func:`qsim.runfile.server_config`), checked to be a live
    run file."""
    missing = [c for c in RUN_COLUMNS if c not in run.columns]
    if missing:
        raise ValueError(f"not a live run file (from qlab replay): it lacks columns {missing}")
    return server_config(run)


def measured_speed(run: pd.DataFrame) -> float:
    """Median of measured engine time over the calibrated estimate, among the served; NaN if none
    was.

    The run's typical speed after the fact (its effective load is :func:`engine_time_ratio`'s); the
    replay does not use it (it would hand a request information from the run's future)."""
    served = run["outcome"].isin(ANSWERED) & run["engine_s"].gt(0)
    ratio = run.loc[served, "engine_s"] / run.loc[served, "calibrated_est_s"]
    return float(ratio.median()) if len(ratio) else math.nan


def engine_time_ratio(run: pd.DataFrame) -> float:
    """Total measured engine time over the total calibrated estimate, among the served; NaN if none
    was.

    The run's effective load is its nominal load x this: the engines' busy time over what the
    calibration promised, so long runs weigh as much as they took (the median ratio,
    :func:`measured_speed`, can read 1.04 on a run whose engines were busy 1.28x the calibrated
    total)."""
    served = run["outcome"].isin(ANSWERED) & run["engine_s"].gt(0)
    calibrated = float(run.loc[served, "calibrated_est_s"].sum())
    return float(run.loc[served, "engine_s"].sum()) / calibrated if calibrated > 0 else math.nan


def arrival_times(run: pd.DataFrame, origin: str = "server") -> np.ndarray:
    """When each request reached the system: the gate's arrival where the run knows it
    (``origin="server"``), else, or with ``origin="sent"``, the client's send time. Where the
    gate's is unknown (no answer: the client hung up, or the transport failed) and others are
    known, the send time plus the run's median trip to the gate (:func:`trip_s`)."""
    if origin not in ("server", "sent"):
        raise ValueError(f"arrival origin must be server or sent, got {origin!r}")
    sent = run["arrival_s"].to_numpy(float)
    if origin == "sent" or "server_arrival_s" not in run.columns:
        return sent
    server = run["server_arrival_s"].to_numpy(float)
    if np.isfinite(server).all():
        return server
    return np.where(np.isfinite(server), server, sent + trip_s(run))


def trip_s(run: pd.DataFrame) -> float:
    """The median time from a send to the gate taking the request (0 where the run does not say)."""
    if "server_arrival_s" not in run.columns:
        return 0.0
    trip = (run["server_arrival_s"] - run["arrival_s"]).to_numpy(float)
    trip = trip[np.isfinite(trip)]
    return float(max(0.0, np.median(trip))) if trip.size else 0.0


def gate_knew(run: pd.DataFrame) -> pd.DataFrame:
    """The replay columns, filled the old way where a run file predates them (NaN: not known)."""
    out = pd.DataFrame(index=run.index)
    nan = pd.Series(np.nan, index=run.index)
    for name in (
        "arrival_speed_factor",
        "engine_started_s",
        "engine_returned_s",
        "server_finish_s",
    ):
        out[name] = run[name].astype(float) if name in run.columns else nan
    out["engine_reported_s"] = (
        run["engine_reported_s"] if "engine_reported_s" in run.columns else run["engine_s"]
    ).astype(float)
    reason = run["reason"].astype("string")
    for name, why in (("failed", "engine_exception"), ("stalled", "engine_stalled")):
        out[name] = (
            run[name].astype(bool)
            if name in run.columns
            else (reason.eq(why).fillna(False) & run["outcome"].eq("error")).astype(bool)
        )
    return out


def replay_inputs(run: pd.DataFrame, setup: ServerConfig) -> pd.DataFrame:
    """Per request (in the run's row order): hold_s (engine time in the replay), reported_s (what
    the tracker learns), failed, and replayed_with (which rule of :data:`RULES` gave hold_s)."""
    known = gate_knew(run)
    started = known["engine_started_s"].to_numpy(float)
    held = known["engine_returned_s"].to_numpy(float) - started
    engine_s = known["engine_reported_s"].to_numpy(float)
    failed = known["failed"].to_numpy(bool)
    stalled = known["stalled"].to_numpy(bool) & np.isfinite(started)
    # Ended as an engine's error while it ran, its hand-back never said: its replica went down
    # (the gate ends it then; its engine runs it out, as the simulator's replica_down).
    down = failed & np.isfinite(started) & ~np.isfinite(held) & ~np.isfinite(engine_s)
    ran = run["outcome"].isin(ANSWERED).to_numpy() | failed
    ran_old = ~np.isfinite(held) & ~stalled & np.isfinite(engine_s) & ran
    factor = known["arrival_speed_factor"].to_numpy(float)
    factor = np.where(
        np.isfinite(factor), factor, 1.0 if setup.fixed_estimate else setup.initial_speed_factor
    )
    estimate = run["calibrated_est_s"].to_numpy(float) * factor
    cut = run["outcome"].eq("cancelled").to_numpy()
    rule = np.where(
        np.isfinite(held),
        "held",
        np.where(
            ran_old,
            "engine_s",
            np.where(stalled, "stalled", np.where(down, "down", "estimate")),
        ),
    )
    rule = np.where(cut, "cut", rule)
    hold = np.select(
        [rule == "held", rule == "engine_s", rule == "cut"],
        [held, engine_s, run["deadline_s"].to_numpy(float) + estimate],
        estimate,
    )
    if stalled.any():
        hold[stalled] = _stalled_hold(run, started, stalled)
    if down.any():
        hold[down] = _stalled_hold(run, started, down)
    if setup.policy.cancel_at_deadline:
        # Answered, so handed back before its cut was due, though the gate read its clock a little
        # later (a busy loop): the replay's run ends just inside its deadline, which the live one
        # beat.
        left = arrival_times(run) + run["deadline_s"].to_numpy(float) - started - TOLERANCE_S
        beat = (rule == "held") & run["outcome"].isin(ANSWERED).to_numpy() & (hold > left)
        hold[beat] = np.maximum(left[beat], 0.0)
    reported = np.where(np.isfinite(engine_s) & np.isin(rule, ["held", "engine_s"]), engine_s, hold)
    return pd.DataFrame(
        {
            "hold_s": np.maximum(hold, 0.0),
            "reported_s": reported,
            "failed": failed & (rule != "estimate"),
            "replayed_with": rule,
        },
        index=run.index,
    )


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


def in_arrival_order(
    run: pd.DataFrame, arrival: np.ndarray, rows: np.ndarray | None = None
) -> tuple[pd.DataFrame, np.ndarray]:
    """The run's rows (those ``rows`` marks, default all) in the order the gate took them, and their
    arrival times (``arrival``, one per row of the run; see :func:`arrival_times`)."""
    if rows is not None:
        run, arrival = run[rows], arrival[rows]
    order = np.lexsort((run["request_id"].to_numpy(), arrival))
    return run.iloc[order], arrival[order]


def simulate_arrivals(
    ordered: pd.DataFrame,
    arrival: np.ndarray,
    setup: ServerConfig,
    true_s: np.ndarray,
    name: str,
    generated: np.ndarray | None = None,
    schedule: SpeedSchedule | None = None,
    fleet: FleetSpec | None = None,
    **faults,
) -> pd.DataFrame:
    """The run's arrivals through qsim as the server was set up (``fleet``: replicas of it behind
    its router, as the gate ran them), each request held for ``true_s`` (times the speed
    ``schedule``, where given), generating ``generated`` tokens (default: its limit)."""
    trace = from_arrays(
        arrival,
        ordered["max_new_tokens"].to_numpy(),
        true_service_s=true_s,
        est_service_s=ordered["calibrated_est_s"].to_numpy(float),
        deadline_s=ordered["deadline_s"].to_numpy(),
        priority=ordered["priority"].to_numpy(),
        client_id=ordered["client_id"]
        .astype(object)
        .where(ordered["client_id"].notna(), None)
        .to_numpy(),
        name=name,
    )
    if generated is not None:
        trace = dataclasses.replace(trace, tokens_generated=np.asarray(generated, dtype=np.int64))
    # the prompts as sent: the estimator's work has their term too
    if "prompt_tokens" in ordered.columns:
        trace = dataclasses.replace(
            trace, prompt_tokens=ordered["prompt_tokens"].to_numpy(np.int64)
        )
    tokens = recorded_tokens(ordered)
    if tokens is not None:
        trace = dataclasses.replace(trace, tokens=tokens)
    if fleet is not None:
        faults = {
            **faults,
            "replicas": fleet.replicas,
            "router": fleet.router,
            "replica_speeds": fleet.speeds,
            "replica_down": fleet.down,
            "replica_drain": fleet.drain,
            "admission_at": fleet.admission,
        }
    return simulate(trace, setup, speed_schedule=schedule, **faults)


def recorded_tokens(ordered: pd.DataFrame) -> np.ndarray | None:
    """Per row of ``ordered``: the tokens its prompt carried, as the run file keeps them (column
    :data:`SEGMENTS`, :meth:`qsim.prefix.Tokens.spec`), for a prefix cache to share as the gate's
    did. A row without (a dataset's text: unknown) shares nothing, its keys negative so that they
    meet no recorded key; None: a run file without the column (each prompt its own, as before)."""
    if SEGMENTS not in ordered.columns or ordered[SEGMENTS].isna().all():
        return None
    out = np.empty(len(ordered), dtype=object)
    lengths = ordered["prompt_tokens"].to_numpy(np.int64)
    for j, spec in enumerate(ordered[SEGMENTS].to_numpy(dtype=object, na_value=None)):
        if spec is None:
            own = ((-2 * j - 2, int(lengths[j])),) if lengths[j] else ()
            out[j] = Tokens(own, -2 * j - 3)
        else:
            out[j] = Tokens.parse(spec)
    return out


def generated_tokens(run: pd.DataFrame, ordered: pd.DataFrame) -> np.ndarray:
    """Per row of ``ordered``: the tokens its request's answered attempt generated live (column
    ``tokens``), else its limit (the synthetic engine always generates it; a run cut short teaches
    nothing anyway)."""
    limit = ordered["max_new_tokens"].to_numpy(np.int64)
    if "tokens" not in run.columns:
        return limit
    tokens = run["tokens"].astype("Float64")
    known = run[tokens.notna().to_numpy()]
    by_request = known.groupby("first_request_id")["tokens"].last()
    found = (
        ordered["first_request_id"]
        .map(by_request)
        .astype("Float64")
        .to_numpy(dtype=float, na_value=np.nan)
    )
    return np.where(np.isfinite(found), found, limit).astype(np.int64)
