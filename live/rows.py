"""What one exchange with the live service means, as a row of qsim's schema.

Pure functions, no I/O: :mod:`live.loadgen` sends the requests and hands over
what came back (:class:`Exchange`), and :func:`to_frame` turns the lot into one
row per request. The outcome is the client's view: good or late by the latency
it measured against the deadline, rejected for a 503 ``overloaded``, expired
for a 503 ``deadline_exceeded``, error for anything else (transport failures,
timeouts, 4xx, 5xx, an answer that is not the contract's).

arrival_s is the actual send time. Columns beyond qsim's schema:
scheduled_s, sent_s, send_lateness_s, http_status, error; the service's own
timings (engine_s, queue_s, server_total_s), tokens, prompt_tokens (the prompt's length
in the server's tokens, as sent), answered_prompt_tokens (the prompt's tokens as the answer
counted them: an upstream engine's own count, e.g. vLLM's tokenizer; <NA>: the answer did not say);
cached_prompt_tokens (of them, found in the gate's prefix cache, ``--prefix-caching``; <NA>: none);
calibrated_est_s (the server's estimate before speed tracking);
server_arrival_s (when the gate took it, see :func:`_received`); and the
server's configuration (:meth:`ServerInfo.columns`), so that ``qlab compare``
can replay the run in the simulator without being told how it ran.

What the gate knew of each request, at the time, for the replay (:mod:`analysis.compare`):
arrival_speed_factor (the tracker's factor when it arrived) and arrival_est_s
(calibrated_est_s x that factor: the estimate the admission decision used);
engine_started_s / engine_returned_s (the gate's clock, mapped onto the run's
as server_arrival_s is, when the engine took the request and when the gate got
it back: the engine counted busy in between); engine_reported_s (the engine's
own time, what the gate's speed tracker was given; also for a failed run,
which teaches the tracker nothing); failed (the engine raised: reason
engine_exception) and stalled (the gate gave up on it: engine_stalled). A
stalled run's hand-back is never reported to its client: its
engine_returned_s is NaN and its engine_started_s is the answer's arrival at
the client less the ``running_s`` the gate reported. server_finish_s: when the
gate ended the request (see :func:`_gate_end`).
queued_at_arrival is <NA> where the service did not report it (-1 on the way
in: qsim.records.from_arrays reads -1 in an Int64 column as missing).

Clients that give up and retry (:class:`qsim.runfile.ClientSettings`, :mod:`qsim.clients`): every
attempt is a row (``first_request_id``, ``attempt``; a retry's request_id follows the
trace's, in the order the retries were decided). An attempt whose client hung up is
``abandoned`` (reason client_left, or client_timeout for the retry policy's per-attempt
timeout). Columns: patience_s (the request's patience from its first send; NaN: none),
hangup_s (when the client would hang up on this attempt, on the run's clock; NaN: never),
client_next (what the client did next: "retry", or why not, :class:`qsim.clients.Decision`;
<NA> without a retry policy), and the constant retry_policy (the policy's fields as JSON;
<NA>: none), retry_seed and patience_until, from which ``qlab compare`` rebuilds the clients.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from qsim import ServiceModel, Trace, preset, records
from qsim.config import ServerConfig, StallRule
from qsim.runfile import ClientSettings, engine_columns, server_columns
from qsim.service import SpeedSchedule
from qsim.policy import on_time, policy_from_fields

from .contract import EngineFacts, ErrorDetail, Numbers, Stats, Timings
from .contract_clients import read_error
from .contract_clients import read_answer as answer_of
from .contract_fields import num
from .gate_errors import NEVER_IN_TIME


@dataclass(frozen=True)
class ServerInfo:
    """What the server says about itself in /stats, as the simulator needs it: its configuration,
    with the tracker's factor at this reading as its initial_speed_factor (a resident server's speed
    carries over from run to run), and a synthetic engine's speed over time with the server's clock
    when its seconds began (NaN: unknown)."""

    config: ServerConfig
    speed_schedule: SpeedSchedule | None = None
    schedule_zero: float = math.nan
    # the server reported its calibration (config.model); else the trace's estimates stand
    model_known: bool = True
    # the engine's info() in /stats (None: not said), for the model-only prediction
    engine: dict | None = None
    fleet: dict | None = None  # a fleet gate's FleetSpec fields in /stats (None: one server)

    def columns(self, n: int, server_zero: float = math.nan) -> dict[str, Any]:
        """Constant per-run columns (:func:`qsim.runfile.server_columns`,
        :func:`qsim.runfile.engine_columns`): the contract between a run file and ``qlab compare``.
        server_zero: the server's clock at the run's time 0, which puts the speed schedule on the
        run's clock."""
        return {
            **server_columns(
                self.config,
                n,
                self._schedule_on_run_clock(server_zero),
                self._fleet_on_run_clock(server_zero),
            ),
            **engine_columns(self.engine, n),
        }

    def _fleet_on_run_clock(self, server_zero: float) -> dict | None:
        """The fleet's fields with --replica-down's and --replica-drain's windows in the run's
        seconds (they count from the gate's start, ``down_started_at``): a window before the run's
        start is left out, one that began before it begins at 0. As said where the clocks are
        unknown."""
        fleet = self.fleet
        if fleet is None or "down_started_at" not in fleet or not math.isfinite(server_zero):
            return fleet
        shift = num(fleet["down_started_at"]) - server_zero
        rest = {k: v for k, v in fleet.items() if k != "down_started_at"}
        # A fleet's fields say drain only where there is one (FleetSpec.to_fields).
        windows = [key for key in ("down", "drain") if key in fleet]
        return {**rest, **{key: _shifted(fleet[key], shift) for key in windows}}

    def _schedule_on_run_clock(self, server_zero: float) -> str | None:
        """The speed schedule as JSON ({"base", "steps"}) with its steps in the run's seconds; a
        step before the run's start sets the base. None where there is none or the clocks are
        unknown."""
        schedule, shift = self.speed_schedule, self.schedule_zero - server_zero
        if schedule is None or not math.isfinite(shift):
            return None
        base, steps = schedule.base, []
        for t, speed in schedule.steps:
            if t + shift <= 0:
                base = speed
            else:
                steps.append([t + shift, speed])
        return json.dumps({"base": base, "steps": steps})


def _shifted(windows: list, shift: float) -> list:
    """Windows [replica, from_s, to_s] moved by ``shift`` seconds: one that ended before 0 is left
    out, one that began before 0 begins at 0."""
    return [[r, max(0.0, a + shift), b + shift] for r, a, b in windows if b + shift > 0]


def _speed_schedule(engine: EngineFacts | None) -> tuple[SpeedSchedule | None, float]:
    """A synthetic engine's schedule and its start (its info() in /stats); (None, NaN) for other
    engines."""
    if engine is None or engine.engine != "synthetic" or engine.speed is None:
        return None, math.nan
    return SpeedSchedule(engine.speed, tuple(engine.schedule or ())), num(
        engine.schedule_started_at
    )


def server_info(stats: Any) -> ServerInfo:
    """Read /stats (a parsed body, through :class:`live.contract.Stats`; ValueError when it is not
    one): ``policy`` as a preset name or a dict of Policy fields."""
    parsed = Stats.model_validate(stats)
    raw = parsed.policy
    if isinstance(raw, str):
        policy = preset(raw)
    elif isinstance(raw, dict):
        policy = policy_from_fields(raw)
    else:
        raise ValueError(f"/stats does not say which policy the server runs: {raw!r}")
    factor = num(parsed.speed_factor)
    if parsed.server_config is not None:  # the whole configuration, as the gate holds it
        config = ServerConfig.from_fields(parsed.server_config).replace(policy=policy)
        known = True
    else:  # a server from before /stats carried it: the settings it reported one by one
        stall, model, weight = parsed.stall_rule, parsed.service_model, num(parsed.tracker_weight)
        known = model is not None
        stall_rule = None if stall is None else (num(stall.factor), num(stall.floor_s))
        config = ServerConfig(
            policy,
            parsed.engines,
            ServiceModel()
            if model is None
            else ServiceModel(
                intercept_s=model.intercept_s,
                per_token_s=model.per_token_s,
                per_prompt_token_s=model.per_prompt_token_s,
            ),
            fixed_estimate=parsed.fixed_estimate,
            tracker_weight=weight if math.isfinite(weight) else 0.2,
            stall=StallRule(*stall_rule)
            if stall_rule and all(map(math.isfinite, stall_rule))
            else StallRule(),
        )
    if math.isfinite(factor) and factor > 0:
        config = config.replace(initial_speed_factor=factor)
    engine = None if parsed.engine is None else parsed.engine.model_dump(mode="json")
    return ServerInfo(
        config,
        *_speed_schedule(parsed.engine),
        model_known=known,
        engine=engine,
        fleet=parsed.fleet,
    )


@dataclass(frozen=True)
class Exchange:
    """One attempt as the client saw it; times are seconds since the replay's start clock.

    first: the trace position of its request (-1: its position among the exchanges, one attempt
    each); attempt counts from 1. left: why the client hung up before the answer (client_left,
    client_timeout), making it abandoned. hangup_s: when the client would have hung up (NaN: never);
    next: what the client did after it ("retry" or why not; None without a retry policy).
    reason: with ``error``, why (the replayer's own refusal to send: prompt_cannot_fit);
    first_token_s and last_token_s: when the first and the last piece of text arrived (a streamed
    answer; NaN: not seen); pieces: how many pieces of text came.
    """

    scheduled_s: float
    sent_s: float
    done_s: float
    status: int | None = None
    body: Any = None
    retry_after: str | None = None
    error: str | None = None
    first: int = -1
    attempt: int = 1
    left: str | None = None
    hangup_s: float = math.nan
    next: str | None = None
    reason: str | None = None
    first_token_s: float = math.nan
    last_token_s: float = math.nan
    pieces: int = 0


_NO_ERROR = ErrorDetail(type="")
#: What an exchange without an answer's timings reads: every number null (NaN).
_NO_TIMINGS = Timings(
    queue_s=None, engine_s=None, total_s=None, est_service_s=None, started_at=None, returned_at=None
)


def _error_of(body: Any) -> ErrorDetail:
    """The envelope's error (:class:`live.contract.ErrorDetail`); an empty one when the body is
    not an envelope."""
    return read_error(body) or _NO_ERROR


def classify(ex: Exchange, deadline_s: float) -> tuple[str, str | None, str | None]:
    """(outcome, reason, error) of one exchange; good/late by the client-measured latency.
    A 200 whose body is not the contract's answer (:func:`answer_of`) is an error."""
    if ex.left is not None:
        return "abandoned", ex.left, None
    if ex.error is not None:
        return "error", ex.reason, ex.error
    if ex.status == 200 and answer_of(ex.body) is not None:
        return ("good" if on_time(ex.done_s - ex.sent_s, deadline_s) else "late"), None, None
    error = _error_of(ex.body)
    if (ex.status, error.type) in (
        (503, "overloaded"),
        (429, "rate_limited"),
    ) or error.reason == NEVER_IN_TIME:
        # overload, a client over its rate, or never answerable in time
        return "rejected", error.reason, None
    if ex.status == 503 and error.type == "deadline_exceeded":
        return "expired", error.reason, None
    if ex.status == 504 and error.type == "deadline_exceeded":  # cut in service at its deadline
        return "cancelled", error.reason, None
    detail = error.message or (str(ex.body)[:200] if ex.body is not None else "no JSON body")
    return "error", error.reason, f"HTTP {ex.status} {error.type}: {detail}".strip()


def retry_after_s(ex: Exchange) -> int:
    """Retry-After in whole seconds from the header (else the envelope); -1 when absent."""
    for value in (ex.retry_after, _error_of(ex.body).retry_after_s):
        try:
            return int(value)
        except (TypeError, ValueError):
            continue
    return -1


def _row(
    ex: Exchange, deadline_s: float, base_est_s: float, server_zero: float, no_replica: int = 0
) -> dict[str, Any]:
    """The per-request values one exchange gives, NaN or -1 (missing) where the answer does not
    say."""
    outcome, reason, error = classify(ex, deadline_s)
    answer = answer_of(ex.body) if ex.status == 200 else None
    answered = outcome in records.ANSWERED and answer is not None
    timings = answer.timings if answered else _NO_TIMINGS
    # The gate's view at arrival: an answer's admission, a refusal's (or drop's, or failure's)
    # numbers.
    seen = (
        Numbers.model_validate(answer.admission, from_attributes=True)
        if answered
        else _error_of(ex.body).numbers
    )
    est = next(
        (v for v in (num(timings.est_service_s), num(seen.est_service_s)) if math.isfinite(v)),
        base_est_s,
    )
    failed = outcome == "error" and reason == "engine_exception"
    stalled = outcome == "error" and reason == "engine_stalled"
    # The run's clock readings and own time: an answer's timings, a failure's numbers.
    # its numbers say when the engine took it and how long it ran until the cut
    cut = outcome == "cancelled"
    ran = timings if answered else seen if failed or cut else _NO_TIMINGS
    if stalled and math.isfinite(num(seen.running_s)):  # ended running_s after the engine took it
        started, returned = ex.done_s - num(seen.running_s), math.nan
    else:
        started, returned = num(ran.started_at) - server_zero, num(ran.returned_at) - server_zero
    return {
        "outcome": outcome,
        "reason": reason,
        "error": error,
        "est": est,
        "engine_s": num(timings.engine_s),
        "queue_s": num(timings.queue_s),
        "total_s": num(timings.total_s),
        "tokens": answer.tokens if answered else -1,
        "answered_prompt": _int_or(answer.prompt_tokens, -1) if answered else -1,
        "cached_prompt": _int_or(answer.cached_prompt_tokens, -1) if answered else -1,
        "engine": answer.engine if answered else _int_or(seen.engine, -1),
        # A fleet's replica (an answer's admission says it beside its fields); no_replica where
        # none is named: 0 for one server, -1 (<NA>, as the simulator's) for a fleet's request
        # routed nowhere (refused at its gate, or never bound under a central queue).
        "replica": _int_or(
            (answer.admission.model_extra or {}).get("replica") if answered else seen.replica,
            no_replica,
        ),
        "queued": _int_or(seen.queued, -1),
        "queued_work": num(seen.queued_work_s),
        "in_service": num(seen.in_service_s),
        "idle": _int_or(seen.idle, -1),
        "retry_after": retry_after_s(ex),
        "status": -1 if ex.status is None else ex.status,
        "received": _received(ex, outcome, timings, seen, server_zero),
        "speed_factor": num(seen.speed_factor),
        "started": started,
        "returned": returned,
        "reported": num(ran.engine_s),
        "failed": failed,
        "stalled": stalled,
        # a drop's wait, or one's that waited at a replica that went down (--replica-down)
        "waited": num(seen.waited_s)
        if outcome == "expired" or reason == "shutting_down"
        else 0.0
        if outcome == "rejected"
        else math.nan,
        # a run's that ended running: stalled, cut, or its replica went down (failed, no hand-back)
        "running": num(seen.running_s) if stalled or cut or failed else math.nan,
    }


def _received(
    ex: Exchange, outcome: str, timings: Timings, seen: Numbers, server_zero: float
) -> float:
    """When the gate took the request, on the run's clock; NaN when the answer cannot tell.

    The send time is not it: a burst's requests wait in the server's accept
    queue and event loop for tens of milliseconds, and are taken in an order
    of the server's choosing. Best is the gate's own arrival time
    (``arrived_at``, its clock) mapped through the clocks' offset. Failing
    that, an estimate: an answer left queue_s + engine_s after the gate took
    it, a drop waited_s after, a refusal at once (the trip back on loopback is
    far below a millisecond, but a busy server delays answers by milliseconds,
    enough to swap requests that arrived a fraction of one apart).
    """
    exact = num(seen.arrived_at) - server_zero
    if math.isfinite(exact):
        return exact
    in_gate = num(timings.queue_s) + num(timings.engine_s)
    back = {"good": in_gate, "late": in_gate, "expired": num(seen.waited_s), "rejected": 0.0}.get(
        outcome, math.nan
    )
    return max(ex.sent_s, ex.done_s - back) if math.isfinite(back) else math.nan


def to_frame(
    trace: Trace,
    exchanges: list[Exchange],
    info: ServerInfo,
    prompt_tokens,
    server_zero: float = math.nan,
    clients: ClientSettings = ClientSettings(),
) -> pd.DataFrame:
    """Rows of qsim's schema plus the live columns, built through :func:`qsim.records.from_arrays`:
    one per exchange (attempt), in the order given (the trace's first attempts, then the retries).

    calibrated_est_s is the server's own calibrated estimate (before speed
    tracking) when /stats reports its model: the number its gate started from.
    server_zero: the server's clock at the run's time 0 (NaN: unknown).
    """
    first = np.array(
        [k if ex.first < 0 else ex.first for k, ex in enumerate(exchanges)], dtype=np.int64
    )
    n = len(exchanges)
    deadline = np.where(
        np.isnan(trace.deadline_s), info.config.policy.deadline_s, trace.deadline_s
    )[first]
    # The server's line with its prompt term, over the prompts as sent: what the gate's estimate
    # started from.
    model = info.config.model
    base = (
        model.estimate(trace.max_new_tokens, np.asarray(prompt_tokens, dtype=np.int64))
        if info.model_known
        else np.asarray(trace.est_service_s, dtype=float)
    )[first]
    rows = pd.DataFrame(
        [
            _row(ex, d, b, server_zero, 0 if info.fleet is None else -1)
            for ex, d, b in zip(exchanges, deadline, base)
        ]
    )
    sent = np.array([ex.sent_s for ex in exchanges], dtype=float)
    done = np.array([ex.done_s for ex in exchanges], dtype=float)
    scheduled = np.array([ex.scheduled_s for ex in exchanges], dtype=float)
    answered = rows["outcome"].isin(records.ANSWERED).to_numpy()
    # The engine started queue_s after the gate took the request (the send time if that is unknown).
    taken = rows["received"].fillna(pd.Series(sent)).to_numpy(float)
    start = np.where(answered, taken + rows["queue_s"].fillna(0.0).to_numpy(), np.nan)
    # A run cut at its deadline started when the gate's numbers say (the engine took it).
    start = np.where(
        rows["outcome"].eq("cancelled").to_numpy(), rows["started"].to_numpy(float), start
    )
    patience = np.asarray(trace.patience_s, dtype=float)[first]
    frame = records.from_arrays(
        {
            "request_id": np.arange(n, dtype=np.int64),
            "first_request_id": first,
            "attempt": np.array([ex.attempt for ex in exchanges], dtype=np.int64),
            "arrival_s": sent,
            "size_class": trace.size_class[first],
            "max_new_tokens": trace.max_new_tokens[first],
            "est_service_s": rows["est"].to_numpy(float),
            "true_service_s": rows["engine_s"].to_numpy(float),
            "deadline_s": deadline,
            "priority": trace.priority[first],
            "client_id": trace.client_id[first],
            "outcome": rows["outcome"].tolist(),
            "reason": rows["reason"].tolist(),
            "start_s": start,
            "finish_s": done,
            "latency_s": done - sent,
            # The schema's int64 column cannot hold "unknown": -1 marks a count the service did not
            # report.
            "queued_at_arrival": rows["queued"].to_numpy(np.int64),
            "queued_work_at_arrival_s": rows["queued_work"].to_numpy(float),
            "in_service_work_at_arrival_s": rows["in_service"].to_numpy(float),
            "idle_at_arrival": rows["idle"].to_numpy(np.int64),
            "retry_after_s": rows["retry_after"].to_numpy(np.int64),
            "engine": rows["engine"].to_numpy(np.int64),
            "replica": rows["replica"].to_numpy(np.int64),
            "scheduled_s": scheduled,
            "sent_s": sent,
            "send_lateness_s": sent - scheduled,
            "http_status": _nullable_int(rows["status"]),
            "error": pd.array(rows["error"].tolist(), dtype="string"),
            "calibrated_est_s": np.asarray(base, dtype=float),
            "engine_s": rows["engine_s"].to_numpy(float),
            "queue_s": rows["queue_s"].to_numpy(float),
            "server_total_s": rows["total_s"].to_numpy(float),
            "tokens": _nullable_int(rows["tokens"]),
            "prompt_tokens": np.asarray(prompt_tokens, dtype=np.int64)[first],
            "answered_prompt_tokens": _nullable_int(rows["answered_prompt"]),
            # a prefix cache's (qlab serve --prefix-caching), <NA> where the answer says none
            "cached_prompt_tokens": rows["cached_prompt"].to_numpy(np.int64),
            "server_arrival_s": rows["received"].to_numpy(float),
            "arrival_speed_factor": rows["speed_factor"].to_numpy(float),
            "arrival_est_s": np.asarray(base, dtype=float) * rows["speed_factor"].to_numpy(float),
            "engine_started_s": rows["started"].to_numpy(float),
            "engine_returned_s": rows["returned"].to_numpy(float),
            "engine_reported_s": rows["reported"].to_numpy(float),
            "failed": rows["failed"].to_numpy(bool),
            "stalled": rows["stalled"].to_numpy(bool),
            "server_finish_s": _gate_end(rows),
            "patience_s": np.where(np.isfinite(patience), patience, np.nan),
            "hangup_s": np.array([ex.hangup_s for ex in exchanges], dtype=float),
            "client_next": pd.array([ex.next for ex in exchanges], dtype="string"),
            **info.columns(n, server_zero),
            **clients.columns(n),
        }
    )
    return records.validate(frame)


def _gate_end(rows: pd.DataFrame) -> np.ndarray:
    """When the gate ended each request, on the run's clock: the hand-back of a run, the arrival of
    a refusal, arrival + waited_s of a drop (or of one waiting at a replica that went down), start +
    running_s of a stalled run (or one its replica's going down ended); NaN when unknown."""
    ran = rows["returned"].to_numpy(float)
    refused = rows["received"].to_numpy(float) + rows["waited"].to_numpy(float)
    stalled = rows["started"].to_numpy(float) + rows["running"].to_numpy(float)
    return np.where(np.isfinite(ran), ran, np.where(np.isfinite(refused), refused, stalled))


def _int_or(value: Any, default: int) -> int:
    return (
        int(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else default
    )


def _nullable_int(values) -> pd.arrays.IntegerArray:
    """Int64 with -1 meaning missing, as in :func:`qsim.records.from_arrays`."""
    values = np.asarray(values, dtype=np.int64)
    out = pd.array(values, dtype="Int64")
    out[values < 0] = pd.NA
    return out
