"""What a live run file says of the server it ran against: written by the replayer, read by the
comparison.

A run file (one row per request, from ``qlab replay``) carries the server's
:class:`~qsim.config.ServerConfig` as JSON in the constant column ``server_config``, with the
policy's name and the engine count beside it for people reading the table, and the synthetic
engine's speed schedule on the run's clock (``speed_schedule``), and a batching server's steps
during the run (``batch_steps``, :func:`batch_step_times`). A run file from before the
config column has the older per-setting columns, which :func:`server_config` still reads. The
replay's clients (their retry policy, its seed, what patience waits for) are constant columns too
(:class:`ClientSettings`, read back by :func:`client_settings`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from .clients import RetryPolicy
from .config import ServerConfig, StallRule
from .engines import StepModel
from .fleet import FleetSpec
from .policy import Policy, policy_from_fields
from .service import ServiceModel, SpeedSchedule

#: The column holding the server's ServerConfig as JSON.
SERVER_CONFIG = "server_config"
#: The column holding a fleet gate's FleetSpec as JSON (empty: one server).
FLEET = "fleet"
#: What a run file from before the config column had instead (qlab 0.1 run files).
LEGACY_COLUMNS = (
    "policy",
    "engines",
    "max_queue",
    "max_queued_seconds",
    "predictive",
    "expire_at_front",
    "policy_deadline_s",
    "fixed_estimate",
    "initial_speed_factor",
)


def server_columns(
    config: ServerConfig, n: int, speed_schedule: str | None = None, fleet: dict | None = None
) -> dict[str, Any]:
    """The constant columns a run file of ``n`` rows gets from its server (speed_schedule: JSON, see
    :func:`speed_schedule`; fleet: a fleet gate's :meth:`~qsim.fleet.FleetSpec.to_fields`)."""
    columns = {
        SERVER_CONFIG: pd.array([config.to_json()] * n, dtype="string"),
        "policy": pd.array([config.policy.name] * n, dtype="string"),
        "engines": np.full(n, config.engines, dtype=np.int64),
        "speed_schedule": pd.array([speed_schedule] * n, dtype="string"),
    }
    if fleet is not None:  # one server's run file keeps the columns it had
        columns[FLEET] = pd.array([json.dumps(fleet)] * n, dtype="string")
    return columns


def fleet_spec(run: pd.DataFrame) -> FleetSpec | None:
    """The fleet a run ran against (None: one server, or a run file from before fleets)."""
    if FLEET not in run.columns:
        return None
    raw = constant(run, FLEET)
    return None if raw is None else FleetSpec.from_fields(json.loads(str(raw)))


def constant(run: pd.DataFrame, column: str):
    """The one value a run column holds for the whole run (None where it is missing); ValueError
    otherwise."""
    values = run[column].drop_duplicates()
    if len(values) != 1:
        raise ValueError(
            f"run column {column} must hold one value for the whole run, found {list(values)[:5]}"
        )
    value = values.iloc[0]
    return None if pd.isna(value) else value


def server_config(run: pd.DataFrame) -> ServerConfig:
    """The server a run file ran against. ValueError when the frame is not a run file."""
    if run.empty:
        raise ValueError("the run has no requests")
    if SERVER_CONFIG in run.columns:
        return ServerConfig.from_json(str(constant(run, SERVER_CONFIG)))
    missing = [c for c in LEGACY_COLUMNS if c not in run.columns]
    if missing:
        raise ValueError(
            f"not a live run file (from qlab replay): it lacks columns {[SERVER_CONFIG, *missing]}"
        )
    return _legacy(run)


def _legacy(run: pd.DataFrame) -> ServerConfig:
    """A run file's server from the per-setting columns of the run files before
    ``server_config``."""

    def maybe(column: str):
        return constant(run, column) if column in run.columns else None

    if "policy_fields" in run.columns:  # every field, a policy class's own parameters too
        policy = policy_from_fields(json.loads(str(constant(run, "policy_fields"))))
    else:
        bound, work = maybe("max_queue"), maybe("max_queued_seconds")
        policy = Policy(
            str(constant(run, "policy")),
            max_queue=None if bound is None else int(bound),
            max_queued_seconds=None if work is None else float(work),
            predictive=bool(constant(run, "predictive")),
            deadline_s=float(constant(run, "policy_deadline_s")),
            expire_at_front=bool(constant(run, "expire_at_front")),
            # A run file from before disciplines: the gate served FIFO.
            discipline=str(maybe("discipline") or "fifo"),
        )
    # An older run file does not say: the gate's defaults then (StallRule(), weight 0.2).
    factor, floor, weight, model = (
        maybe("stall_factor"),
        maybe("stall_floor_s"),
        maybe("tracker_weight"),
        maybe("service_model"),
    )
    stall = (
        StallRule() if factor is None or floor is None else StallRule(float(factor), float(floor))
    )
    return ServerConfig(
        policy,
        int(constant(run, "engines")),
        ServiceModel() if model is None else ServiceModel.from_fields(json.loads(str(model))),
        fixed_estimate=bool(constant(run, "fixed_estimate")),
        tracker_weight=0.2 if weight is None or not math.isfinite(float(weight)) else float(weight),
        initial_speed_factor=float(constant(run, "initial_speed_factor")),
        stall=stall,
    )


def speed_schedule(run: pd.DataFrame) -> SpeedSchedule | None:
    """The synthetic engine's speed schedule on the run's clock, where the run file has one."""
    raw = constant(run, "speed_schedule") if "speed_schedule" in run.columns else None
    if raw is None:
        return None
    data = json.loads(str(raw))
    return SpeedSchedule(float(data["base"]), tuple((float(t), float(v)) for t, v in data["steps"]))


#: The column of a batching server's steps during the run: JSON [[woken_s, began_s, ended_s,
#: engine_s, model_s, prefill_tokens, sampling, context], ...] (a :class:`LoggedStep` each), times
#: on the run's clock.
BATCH_STEPS = "batch_steps"


class LoggedStep(NamedTuple):
    """One step of a batching gate's step log (``/stats?steps_since=``'s ``step_log``, a run file's
    ``batch_steps``): when an arrival woke the idle engine for it (its start where it followed a
    step), when the core began it, when the gate had it back (the gate's clock, or the run's), the
    engine's own seconds, the gate's step model's seconds for it; and what it computed, as the step
    model reads it: prefill tokens, the sequences that produced a token, the context tokens held
    (-1: a log from before they were recorded). What ``qlab compare`` replays with, and ``qlab
    calibrate`` fits a step model to."""

    woken: float
    began: float
    ended: float
    engine_s: float
    model_s: float
    prefill_tokens: int = -1
    sampling: int = -1
    context: int = -1


def batch_step_columns(steps: list, n: int, models: list = ()) -> dict[str, Any]:
    """The constant columns of a run of ``n`` rows against a batching server whose steps were
    ``steps`` (:class:`LoggedStep` fields each, times on the run's clock) and which took the step
    ``models`` while they ran ([the steps before it, b0, b1, b2, b3, cv] each: it planned the steps
    after those with it)."""
    return {
        BATCH_STEPS: pd.array([json.dumps(steps)] * n, dtype="string"),
        STEP_MODELS: pd.array([json.dumps(list(models))] * n, dtype="string"),
    }


#: The column of the step models a batching gate took during the run (a learner's refits): JSON
#: [[steps before it, b0, b1, b2, b3, cv], ...]. A run file from before it has none: its gate
#: planned with one model throughout.
STEP_MODELS = "batch_step_models"


def batch_step_times(run: pd.DataFrame) -> list[tuple] | None:
    """A batching server's steps as the run's replay takes them (``simulate(step_times=)``):
    (seconds from its wake to its start, seconds it ran as the gate's core counted it, seconds the
    engine reported, the step model the gate planned with from the next step on, or None: the same
    as before) each; None where the run file has none."""
    raw = constant(run, BATCH_STEPS) if BATCH_STEPS in run.columns else None
    if raw is None:
        return None
    steps = [LoggedStep(*row) for row in json.loads(str(raw))]
    said = constant(run, STEP_MODELS) if STEP_MODELS in run.columns else None
    after = {int(k): StepModel(*fields) for k, *fields in json.loads(str(said or "[]"))}
    return [
        (
            float(s.began) - float(s.woken),
            float(s.ended) - float(s.began),
            float(s.engine_s),
            after.get(k + 1),
        )
        for k, s in enumerate(steps)
    ]


@dataclass(frozen=True)
class ClientSettings:
    """The replay's clients besides their sends: the retry policy (None: never again), its jitter's
    seed, and what the trace's patience waits for; constant columns of the run file
    (:mod:`live.rows` writes them)."""

    retry: RetryPolicy | None = None
    retry_seed: int = 0
    patience_until: str = "answer"

    def columns(self, n: int) -> dict[str, Any]:
        policy = (
            None
            if self.retry is None
            else json.dumps(dataclasses.asdict(self.retry), sort_keys=True)
        )
        return {
            "retry_policy": pd.array([policy] * n, dtype="string"),
            "retry_seed": pd.array(
                [None if self.retry is None else self.retry_seed] * n, dtype="Int64"
            ),
            "patience_until": pd.array([self.patience_until] * n, dtype="string"),
        }


def client_settings(run: pd.DataFrame) -> tuple[ClientSettings, np.ndarray]:
    """The clients of a run file, and each row's patience (seconds from its request's first send;
    inf: none). A run file from before clients gave up and retried: patient clients that never
    retry."""
    patience = (
        run["patience_s"].to_numpy(float)
        if "patience_s" in run.columns
        else np.full(len(run), np.nan)
    )
    patience = np.where(np.isnan(patience), math.inf, patience)
    if "retry_policy" not in run.columns or run.empty:
        return ClientSettings(), patience
    values = run["retry_policy"].dropna().unique()
    if len(values) > 1:
        raise ValueError(
            "run column retry_policy must hold one value for the whole run, found "
            f"{list(values)[:3]}"
        )
    retry = RetryPolicy.from_table(json.loads(values[0])) if len(values) else None
    seed = run["retry_seed"].dropna()
    until = (
        run["patience_until"].dropna()
        if "patience_until" in run.columns
        else pd.Series([], dtype=object)
    )
    return (
        ClientSettings(
            retry,
            int(seed.iloc[0]) if len(seed) else 0,
            str(until.iloc[0]) if len(until) else "answer",
        ),
        patience,
    )


# ---------------------------------------------------------------- what the model-only prediction
# reads

#: The column holding the engine's own description (its ``info()`` in the gate's /stats) as JSON:
#: what ``qlab compare --predict`` reads of the engine (the synthetic engine's noise and speed
#: settings, a GPT-2 engine's model). A run file from before it lacks the column
#: (:func:`engine_info` is then None).
ENGINE_INFO = "engine_info"
#: The speed probes a run file may carry (``qlab live``, ``qlab replay --probe``): the machine's
#: speed over the calibration, one request at a time on the idle server, before and after the run.
SPEED_PROBES = ("speed_before", "speed_after")


def engine_columns(info: dict | None, n: int) -> dict[str, Any]:
    """The constant column a run file of ``n`` rows gets from its engine's description (None: not
    known)."""
    text = None if info is None else json.dumps(info, sort_keys=True, default=str)
    return {ENGINE_INFO: pd.array([text] * n, dtype="string")}


def engine_info(run: pd.DataFrame) -> dict | None:
    """The engine's description that the run file recorded; None where it does not say (an older run
    file, or a server that is not a qlab gate)."""
    raw = constant(run, ENGINE_INFO) if ENGINE_INFO in run.columns and not run.empty else None
    return None if raw is None else json.loads(str(raw))


def speed_probe(run: pd.DataFrame) -> float:
    """The speed probed before the run (NaN where the run file has no probe)."""
    if SPEED_PROBES[0] not in run.columns:
        return math.nan
    probes = run[SPEED_PROBES[0]].astype(float).dropna()
    return float(probes.iloc[0]) if len(probes) else math.nan
