"""A live run replayed in the simulator with what the gate knew, request by request.

**Replay** (:func:`simulate_run`). A live run (rows from ``qlab replay``) is replayed
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
* a run the gate cut at its deadline (``Policy.cancel_at_deadline``, outcome
  ``cancelled``) would have run past it: it holds its engine for its deadline plus
  its estimate, longer than any start leaves it, so the simulator cuts it too (rule ``cut``);
* the policy's estimator learns from the tokens each answered run generated (column
  ``tokens``; the limit where the run does not say), scaled by the server's own
  calibration (column ``service_model``), as the gate's did. The synthetic engine's
  speed schedule (column ``speed_schedule``, on the run's clock) is not replayed: the
  held times already carry it; :func:`analysis.prediction.predict`, which draws its service
  times, applies it;
* **a request the engine never took** (refused, dropped, or run only in the
  simulator) gets what was known at its arrival and nothing later: its
  estimate then, ``calibrated_est_s x arrival_speed_factor`` (the tracker's
  factor at its arrival; the run's initial factor where the answer did not
  say). Column ``replayed_with`` names the rule each request got.

**Clients that give up and retry** (run files of ``qlab replay`` with patience or a retry
policy; :mod:`qsim.clients`). The simulator is run with the run's retry policy and jitter
seed and each request's patience (columns ``retry_policy``, ``retry_seed``, ``patience_s``;
:func:`qsim.runfile.client_settings`): it is given the *first* attempts at the gate's arrivals
and decides the retries itself, so a retry it sends at another time, or does not send,
is a disagreement. Each request's patience runs out at the moment the live client's did
(its first send + patience, on the run's clock). A request's engine time is that of the
attempt that ran live (at most one does, unless an attempt timed out while running); one
that ran only in the simulator gets its estimate at its last live arrival. A run the
live client hung up on while it ran (the gate tells the engine to stop, and the stopped
run teaches nothing) holds its engine in the replay until the hang-up reached the gate
(the hang-up plus the run's median trip to the gate), teaching nothing: rule
``cancelled``, found by a first pass; whether it was stopped or ran to its end (and what it
taught) is read from the tracker's factor the gate reported around its end
(:class:`_TrackerEvidence`). A simulated answer that would reach its client after the live
client hung up (the run's median trip back) is ``abandoned``, as live. The replay's rows are
then joined to the run's on (first_request_id, attempt) and diagnosed (:mod:`analysis.diagnosis`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from qsim import from_arrays, simulate
from qsim.clients import Decision, Retrier
from qsim.config import ServerConfig
from qsim.engines import OneAtATime
from qsim.outcomes import ANSWERED
from qsim.fleet import FleetSpec
from qsim.runfile import batch_step_times, fleet_spec, server_config
from qsim.service import SpeedSchedule, SpeedTracker

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
        np.where(ran_old, "engine_s", np.where(stalled, "stalled", "estimate")),
    )
    rule = np.where(cut, "cut", rule)
    hold = np.select(
        [rule == "held", rule == "engine_s", rule == "cut"],
        [held, engine_s, run["deadline_s"].to_numpy(float) + estimate],
        estimate,
    )
    if stalled.any():
        hold[stalled] = _stalled_hold(run, started, stalled)
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
    if fleet is not None:
        faults = {
            **faults,
            "replicas": fleet.replicas,
            "router": fleet.router,
            "replica_speeds": fleet.speeds,
            "replica_down": fleet.down,
            "admission_at": fleet.admission,
        }
    return simulate(trace, setup, speed_schedule=schedule, **faults)


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


def clients_of(run: pd.DataFrame):
    """The run's clients (:func:`qsim.runfile.client_settings`) and whether they retried."""
    from qsim.runfile import client_settings

    clients, _ = client_settings(run)
    return clients, clients.retry is not None and clients.retry.retries


def client_faults(
    run: pd.DataFrame, ordered: pd.DataFrame, arrival: np.ndarray, notice: np.ndarray | float = 0.0
) -> dict:
    """simulate()'s arguments for the run's clients: each request's patience, running out when the
    live client's did (its first send + patience) and ``notice`` later (when the gate heard of it),
    and the retry policy with its jitter seed."""
    clients, retrying = clients_of(run)
    out = {}
    if "patience_s" in ordered.columns:
        patience = ordered["patience_s"].to_numpy(float)
        hangup = (
            ordered["arrival_s"].to_numpy(float)
            + np.where(np.isnan(patience), np.inf, patience)
            + notice
        )
        if np.isfinite(hangup).any():
            out.update(cancel_after_s=hangup - arrival, cancel_until=clients.patience_until)
    if retrying:
        out.update(retry=clients.retry, retry_seed=clients.retry_seed)
    return out


class _LiveRetrier(Retrier):
    """The run's clients as the simulator's, on the gate's clock: :class:`qsim.clients.Retrier`
    itself, told each attempt's end when the live client learnt it and answering when the retry
    reached the gate.

    The simulator's clients hear an attempt's end at the gate's end and send again straight into the
    gate; the live client heard it ``out`` later (the answer's trip back; its hang-up for an attempt
    it left) and its retry reached the gate ``back`` after the time the retrier gave (send lateness
    and the trip in). Both are the run's own, per attempt, where the run sent that attempt (else the
    run's medians), so a retry both sides send arrives when it did. Requests are the run's (the
    jitter is drawn per request id), the budget counts the run's first sends, and a patience runs
    out when the client's did (the simulator's ends ``notice`` later, when the gate heard of it).
    """

    def __init__(
        self,
        policy,
        ids: np.ndarray,
        first_sends,
        seed: int,
        out: dict,
        back: dict,
        usual: tuple,
        notice: np.ndarray,
    ) -> None:
        super().__init__(policy, np.sort(first_sends), seed)
        self.ids, self.out, self.back, self.usual, self.notice = ids, out, back, usual, notice

    def after(
        self, request, attempt, first_sent_s, now, status, retry_after_s=None, patience_s=math.inf
    ):
        first = int(self.ids[request])
        heard = now + self.out.get((first, attempt), self.usual[0])
        decision = super().after(
            first,
            attempt,
            first_sent_s,
            heard,
            status,
            retry_after_s,
            patience_s - self.notice[request],
        )
        if decision.at_s is None:
            return decision
        return Decision(
            decision.at_s + self.back.get((first, attempt + 1), self.usual[1]), decision.why
        )


def _live_retrier(
    run: pd.DataFrame, arrival: np.ndarray, ids: np.ndarray, retrying, notice: np.ndarray
):
    """The :class:`_LiveRetrier` of ``run`` that :func:`qsim.simulate` takes for its clients (None:
    no retries).

    retrying: the run's retry policy and seed, or None."""
    if not retrying:
        return None
    live_end = np.where(
        run["outcome"].eq("abandoned"), run["hangup_s"], gate_knew(run)["server_finish_s"]
    )
    out = (run["finish_s"] - live_end).to_numpy(float)
    back = arrival - run["scheduled_s"].to_numpy(float)
    keys = list(zip(run["first_request_id"].tolist(), run["attempt"].tolist()))
    known = np.isfinite(out)
    usual = (
        float(np.median(out[known])) if known.any() else 0.0,
        float(np.median(back[run["attempt"].gt(1).to_numpy()]))
        if run["attempt"].gt(1).any()
        else trip_s(run),
    )
    firsts = run.loc[run["attempt"].eq(1), "scheduled_s"].to_numpy(float)
    policy, seed = retrying
    return _LiveRetrier(
        policy,
        ids,
        firsts,
        seed,
        {k: v for k, v in zip(keys, out) if math.isfinite(v)},
        dict(zip(keys, back)),
        usual,
        notice,
    )


def _per_request(run: pd.DataFrame, given: pd.DataFrame) -> pd.DataFrame:
    """replay_inputs per request (indexed by first_request_id): the attempt that ran live (the last,
    if several did), else the last attempt whose speed factor at arrival is known, else the last."""
    factor = (
        run["arrival_speed_factor"]
        if "arrival_speed_factor" in run.columns
        else pd.Series(np.nan, index=run.index)
    )
    g = given.assign(
        first=run["first_request_id"].to_numpy(),
        attempt=run["attempt"].to_numpy(),
        ran=given["replayed_with"].ne("estimate").to_numpy(),
        known=np.isfinite(factor.to_numpy(float)),
    )
    pick = (
        g.sort_values(["first", "ran", "known", "attempt"], kind="stable").groupby("first").tail(1)
    )
    return pick.set_index("first")[["hold_s", "reported_s", "failed", "replayed_with"]]


def simulate_run(run: pd.DataFrame, origin: str = "server") -> pd.DataFrame:
    """qsim's rows for the run's arrivals, with the run's request ids (times on the run's clock).

    With retries the simulator gets the first attempts and its own clients send the rest; a
    simulated attempt takes the run's request_id of the same (first_request_id, attempt), and one
    the run lacks an id after the run's. Extra columns: speed_factor_at_arrival (est_service_s /
    calibrated) and replayed_with."""
    return replay(run, origin)[0]


@dataclass
class Unsaid:
    """What the run does not say, as the replay takes it: each row's gate arrival (estimated where
    no answer gave it), and how long after a client hung up the gate let its request go
    (``notice_s``; per request where the queue others saw says otherwise, in ``late``). ``settled``:
    the engine times the last replay settled on for the runs whose clients hung up (request_id ->
    hold, reported, failed, rule), and ``usual`` its delay from a hang-up to the next start, where
    the next replay starts from (it differs by one arrival or hang-up moved, so it settles in a few
    passes, not one per such run again)."""

    arrival: np.ndarray
    notice_s: float
    late: dict
    settled: dict = dataclasses.field(default_factory=dict)
    usual: list = dataclasses.field(default_factory=list)

    def notice(self, firsts) -> np.ndarray:
        return np.array([self.late.get(int(f), self.notice_s) for f in firsts], dtype=float)


def replay(run: pd.DataFrame, origin: str) -> tuple[pd.DataFrame, Unsaid]:
    """:func:`simulate_run`, and what it took for what the run does not say (:class:`Unsaid`).

    An attempt the gate never answered (its client hung up) has no known gate arrival: it is placed
    at its send plus the run's median trip; a client's hang-up reaches the gate that median trip
    after it. Where either puts an arrival or a departure on the wrong side of a request that came
    within the run's spread of trips of it (that request's queue at arrival, as the gate reported
    it, says so), it is moved just across and the run replayed again."""
    setup = run_setup(run)
    unsaid = Unsaid(arrival_times(run, origin).copy(), trip_s(run), {})
    guessed = _guessed(run, origin)
    moved: set = set()
    for _ in range(int(guessed.sum()) + int(run["outcome"].eq("abandoned").sum()) + 1):
        sim = _replay_once(run, setup, unsaid)
        if not _misplaced(run, sim, unsaid, guessed, moved):
            break
    return sim, unsaid


def _guessed(run: pd.DataFrame, origin: str) -> np.ndarray:
    """Rows whose gate arrival :func:`arrival_times` estimated (no answer said when the gate took
    them)."""
    if origin != "server" or "server_arrival_s" not in run.columns:
        return np.zeros(len(run), dtype=bool)
    known = np.isfinite(run["server_arrival_s"].to_numpy(float))
    return ~known if known.any() else np.zeros(len(run), dtype=bool)


def _replay_once(run: pd.DataFrame, setup: ServerConfig, unsaid: Unsaid) -> pd.DataFrame:
    """One replay of the run with these gate arrivals and hang-ups (see :func:`simulate_run`)."""
    _, retrying = clients_of(run)
    arrival = unsaid.arrival
    first_attempts = run["attempt"].eq(1).to_numpy() if retrying else None
    ordered, first_arrival = in_arrival_order(run, arrival, first_attempts)
    if retrying:
        given = _per_request(run, replay_inputs(run, setup)).loc[ordered["request_id"].to_numpy()]
    else:
        given = replay_inputs(ordered, setup)
    if setup.batching:
        given = given.assign(replayed_with="steps")
    hold = given["hold_s"].to_numpy(float).copy()
    reported = given["reported_s"].to_numpy(float).copy()
    failed = given["failed"].to_numpy(bool).copy()
    rule = given["replayed_with"].to_numpy(object).copy()
    ids = ordered["request_id"].to_numpy()
    for j, first in enumerate(ids):
        if first in unsaid.settled:
            hold[j], reported[j], failed[j], rule[j] = unsaid.settled[first]
    # the delay from a hang-up to its engine's next start, once a pass has seen it
    usual = unsaid.usual
    # Each pass settles at least the earliest run a live client hung up on that the last one had
    # wrong (a later one's start moves with it): at most one pass per such attempt, and one to
    # confirm.
    for _ in range(int(run["outcome"].eq("abandoned").sum()) + 1):
        notice = unsaid.notice(ordered["first_request_id"])
        faults = client_faults(run, ordered, first_arrival, notice)
        retrier = _live_retrier(
            run,
            arrival,
            ordered["request_id"].to_numpy(),
            (faults["retry"], faults["retry_seed"]) if retrying else None,
            notice,
        )
        # A batching engine's steps take the run's step times, in order (the core decides the rest,
        # as live); its requests have no run time of their own.
        # Engines one at a time held their engines for the times the run says, slowdown included
        # (held).
        runs = (
            {"step_times": batch_step_times(run)}
            if setup.batching
            else {"failed": failed, "reported_s": reported, "held": True}
        )
        sim = simulate_arrivals(
            ordered,
            first_arrival,
            setup,
            hold,
            "live-arrivals",
            generated_tokens(run, ordered),
            retrier=retrier,
            fleet=fleet_spec(run),
            **runs,
            **faults,
        )
        if setup.batching or not _cancelled_runs(
            run, setup, unsaid, ordered, sim, hold, reported, failed, rule, usual
        ):
            break
    unsaid.settled = {
        first: (hold[j], reported[j], failed[j], rule[j])
        for j, first in enumerate(ids)
        if rule[j] == "cancelled"
    }
    sim_first = sim["first_request_id"].to_numpy()
    sim["first_request_id"] = ordered["request_id"].to_numpy()[sim_first]
    base = ordered["calibrated_est_s"].to_numpy(float)[sim_first]
    sim["speed_factor_at_arrival"] = sim["est_service_s"].to_numpy(float) / base
    sim["replayed_with"] = rule[sim_first]
    # a request's rule is its run's: an attempt the simulator did not start held nothing
    if retrying:
        sim["replayed_with"] = sim["replayed_with"].where(
            np.isfinite(sim["start_s"].to_numpy(float)), "estimate"
        )
    ids = (
        run.set_index(KEYS)["request_id"]
        .reindex(pd.MultiIndex.from_arrays([sim["first_request_id"], sim["attempt"]]))
        .to_numpy(dtype=float, na_value=np.nan)
        .copy()
    )
    extra = np.isnan(ids)
    ids[extra] = run["request_id"].max() + 1 + np.arange(extra.sum())
    sim["request_id"] = ids.astype(np.int64)
    return sim.sort_values("request_id", ignore_index=True)


def _misplaced(
    run: pd.DataFrame, sim: pd.DataFrame, unsaid: Unsaid, guessed: np.ndarray, moved: set
) -> bool:
    """Move one thing the run does not say to where the run says it was, and say so (True); each
    once.

    An attempt whose client hung up that the replay refused at its guessed arrival came later (it
    had been admitted): just after the replay next made room (a waiting attempt left, an engine took
    the next), one such at a time, else just before the next known arrival, within the run's spread
    of trips. Else, at the first request (in gate order) whose queue at arrival differs between the
    gate and the replay, look within that spread for what explains it: the replay saw more waiting
    work, so an arrival of guessed time just before it came after it, or a hang-up just after it
    reached the gate before it; less, the other way round. Move the nearest such just across."""
    arrival = unsaid.arrival
    keys = pd.MultiIndex.from_arrays([run["first_request_id"], run["attempt"]])
    simmed = sim.set_index(KEYS).reindex(keys)
    sent = run["arrival_s"].to_numpy(float)
    spread = (
        float(np.nanmax(np.abs(arrival - sent)[~guessed], initial=0.0)) if (~guessed).any() else 0.0
    )
    # A client that hung up had been admitted (a refusal is answered at once): where the replay
    # refuses it at its guessed arrival, it came later, before the next arrival the run knows.
    refused = (
        guessed
        & run["outcome"].eq("abandoned").to_numpy()
        & simmed["outcome"].eq("rejected").to_numpy()
    )
    # Where room opened in the replay (a waiting attempt left, an engine took the next) it may have
    # come just after.
    waited_out = sim["outcome"].eq("abandoned").to_numpy() & np.isnan(
        sim["start_s"].to_numpy(float)
    )
    freed = np.sort(
        np.concatenate([sim.loc[waited_out, "finish_s"].to_numpy(float), sim["start_s"].dropna()])
    )
    for k in np.flatnonzero(refused)[np.argsort(arrival[refused])]:
        later = ~guessed & (arrival > arrival[k])
        nxt = arrival[later].min() if later.any() else math.inf
        for when in freed[(freed > arrival[k]) & (freed < nxt) & (freed - arrival[k] <= spread)]:
            if ("admitted", int(k), float(when)) not in moved:
                moved.add(("admitted", int(k), float(when)))
                arrival[k] = when + TOLERANCE_S
                return True
        if ("admitted", int(k)) in moved or not later.any():
            continue
        if nxt - arrival[k] <= spread:
            moved.add(("admitted", int(k)))
            arrival[k] = nxt - TOLERANCE_S
            return True
    # Who waited, not their work: an arrival or a departure on the wrong side changes the count,
    # while the work also moves with the speed factor, which a run answered or stopped around its
    # client's hang-up (the run cannot say which) may have left a little apart for the rest of the
    # run.
    count = simmed["queued_at_arrival"].astype("Float64").to_numpy(dtype=float, na_value=np.nan)
    mine = run["queued_at_arrival"].astype("Float64").to_numpy(dtype=float, na_value=np.nan)
    differ = np.isfinite(mine) & np.isfinite(count) & (mine != count)
    if not differ.any():
        return False
    at = np.flatnonzero(differ)[np.argmin(arrival[differ])]
    when, more = arrival[at], count[at] > mine[at]
    options = []  # (distance, kind, key)
    for k in np.flatnonzero(guessed):
        gap = arrival[k] - when
        if ("arrival", int(k)) not in moved and 0 < abs(gap) <= spread and (gap < 0) == more:
            options.append((abs(gap), "arrival", int(k)))
    waited_out = sim["outcome"].eq("abandoned").to_numpy() & np.isnan(
        sim["start_s"].to_numpy(float)
    )
    for first, end in zip(sim.loc[waited_out, "first_request_id"], sim.loc[waited_out, "finish_s"]):
        gap = end - when
        if ("left", int(first)) not in moved and 0 < abs(gap) <= spread and (gap > 0) == more:
            options.append((abs(gap), "left", int(first)))
    if not options:
        return False
    _, kind, key = min(options)
    moved.add((kind, key))
    if kind == "arrival":
        arrival[key] = when + (TOLERANCE_S if more else -TOLERANCE_S)
    else:  # that request's hang-up reached the gate just before (or after) this arrival
        notice = unsaid.late.get(key, unsaid.notice_s)
        unsaid.late[key] = (
            notice
            + (when - TOLERANCE_S if more else when + TOLERANCE_S)
            - float(
                sim.loc[waited_out & sim["first_request_id"].eq(key).to_numpy(), "finish_s"].iloc[0]
            )
        )
    return True


def _cancelled_runs(
    run: pd.DataFrame,
    setup: ServerConfig,
    unsaid: Unsaid,
    ordered: pd.DataFrame,
    sim: pd.DataFrame,
    hold: np.ndarray,
    reported: np.ndarray,
    failed: np.ndarray,
    rule: np.ndarray,
    usual: list,
) -> bool:
    """Where the simulator ran an attempt the live client hung up on, and that request ran nowhere
    else live: hold its engine until the live engine was free again, teaching nothing (the gate
    stops such a run). Updates the arrays in place; True when something changed.

    When the live engine was free again: where the request the replay starts next on that engine had
    waited for it and the run knows its start, at that start (as for a stalled run), unless an
    attempt whose client hung up later was waiting then (the engine may have run it in between,
    unseen); else (the next is another attempt whose client hung up, or nobody was waiting) at the
    hang-up plus the run's usual delay from a hang-up to the engine's next start (its median where
    the first pass that knows any saw them, kept in ``usual`` so that the passes settle; else the
    trip to the gate). An engine free before the hang-up ran the request to its end: the gate
    answered it, the client had left. A run stopped by its client's hang-up had been let go by then:
    where the replay hears of that hang-up later (``unsaid``), it hears of it just before.
    """
    arrival = unsaid.arrival
    ran = np.isfinite(sim["start_s"].to_numpy(float))
    if not ran.any() or not run["outcome"].eq("abandoned").any():
        return False
    firsts = ordered["request_id"].to_numpy()
    position = pd.Series(
        np.arange(len(run)),
        index=pd.MultiIndex.from_arrays([run["first_request_id"], run["attempt"]]),
    )
    started = gate_knew(run)["engine_started_s"].to_numpy(float)
    # its engine was busy (or others ahead of it) when it came
    waited = started > arrival + TOLERANCE_S
    abandoned = run["outcome"].eq("abandoned").to_numpy()
    hangup = run["finish_s"].to_numpy(float)  # when the client hung up
    # when it meant to
    intended = run["hangup_s"].to_numpy(float) if "hangup_s" in run.columns else hangup
    on = sim[ran].sort_values("start_s", kind="stable")
    found = []  # (j, row position in the run, sim start, the next start if known)
    for engine, runs in on.groupby("engine", sort=False):
        rows = runs[["first_request_id", "attempt", "start_s"]].to_numpy()
        for n, (j, attempt, start) in enumerate(rows):
            j = int(j)
            k = position.get((firsts[j], int(attempt)))
            if k is None or not abandoned[k] or rule[j] not in ("estimate", "cancelled"):
                continue
            after = (
                position.get((firsts[int(rows[n + 1][0])], int(rows[n + 1][1])))
                if n + 1 < len(rows)
                else None
            )
            known = after is not None and np.isfinite(started[after]) and started[after] > start
            found.append(
                (j, k, start, started[after] if known else np.nan, known and waited[after])
            )
    if not found:
        return False
    # Attempts the replay had leave while waiting (their clients hung up): if one was waiting when
    # the engine was free, the live engine may have taken it first, and its start is unknown.
    left = sim["outcome"].eq("abandoned").to_numpy() & ~ran
    came = sim["arrival_s"].to_numpy(float)[left]
    mine = [
        position.get((firsts[int(f)], int(a)))
        for f, a in zip(sim.loc[left, "first_request_id"], sim.loc[left, "attempt"])
    ]
    # when its client hung up
    went = np.where(
        [m is None for m in mine],
        sim.loc[left, "finish_s"].to_numpy(float),
        [hangup[m] if m is not None else np.nan for m in mine],
    )

    def unseen(free: float, nxt: float) -> bool:
        return bool(((came < free) & (went > free) & (went < nxt)).any())

    # The usual delay: measured where nothing else can have run in between, and no longer than a
    # trip can take (a first pass, before the others settle, pairs runs that were not one after the
    # other).
    spread = float(np.nanmax(np.abs(arrival - run["arrival_s"].to_numpy(float)), initial=0.0))
    delays = [
        d
        for _, k, _, nxt, exact in found
        if exact and not unseen(hangup[k], nxt)
        for d in [nxt - hangup[k]]
        if 0 <= d <= spread
    ]
    if not usual and delays:
        usual.append(float(np.median(delays)))
    delay = usual[0] if usual else trip_s(run)
    changed = False
    tracker = _TrackerEvidence(run, setup, unsaid, ordered, sim, position, reported, failed)
    for j, k, start, nxt, exact in found:
        free = hangup[k] + delay
        exact = exact and not unseen(free, nxt)
        end = nxt if exact else min(free, nxt) if np.isfinite(nxt) else free
        target = max(0.0, end - start)
        # Ended before the hang-up: the gate answered (and its tracker learned) an answer the client
        # did not wait for, still on its way back; otherwise the stopped run teaches nothing. Where
        # the live speed factor around its end says which (and what it learned), that.
        stopped, taught = bool(end >= hangup[k]), target
        said = tracker.learned(j, end)
        if said is not None:
            stopped, taught = said is False, target if said is False else said
        if (
            rule[j] != "cancelled"
            or abs(hold[j] - target) > 1e-9
            or failed[j] != stopped
            or abs(reported[j] - taught) > 1e-12
        ):
            hold[j], reported[j], failed[j], rule[j] = target, taught, stopped, "cancelled"
            changed = True
        first, heard = int(firsts[j]), intended[k] + unsaid.notice([firsts[j]])[0]
        if stopped and heard > end - TOLERANCE_S:
            unsaid.late[first] = max(0.0, end - TOLERANCE_S - intended[k])
            changed = True
        # the gate heard of the hang-up after the run had ended: just after
        elif not stopped and heard <= end:
            # (within the tolerance: the same end)
            unsaid.late[first] = end + TOLERANCE_S / 2 - intended[k]
            changed = True
    return changed


class _TrackerEvidence:
    """What the gate's speed tracker says of a run whose client hung up around its end: the
    tracker's factor at the live arrivals just before and after the run's end (the run records it
    per answered request). Where the replay's factor agrees at the first, the replay's other runs
    that taught the tracker between the two are folded in as the replay has them, and this one's
    teaching is what makes the second agree: none (the factor as without it: the run was stopped),
    or the engine time the tracker's step solves for (it ran to its end, and the gate answered
    it)."""

    def __init__(
        self,
        run: pd.DataFrame,
        setup: ServerConfig,
        unsaid: Unsaid,
        ordered: pd.DataFrame,
        sim: pd.DataFrame,
        position: pd.Series,
        reported: np.ndarray,
        failed: np.ndarray,
    ) -> None:
        live = (
            run["arrival_speed_factor"]
            if "arrival_speed_factor" in run.columns
            else pd.Series(np.nan, index=run.index)
        ).to_numpy(float)
        # A learning estimator, engines that share, or a fixed estimate: the factor's steps are not
        # the plain EWMA's.
        self.usable = (
            not setup.fixed_estimate
            and setup.policy.estimator == "limit"
            and isinstance(setup.engine, OneAtATime)
            and not setup.engine.concurrency
            and np.isfinite(live).any()
        )
        if not self.usable:
            return
        known = np.flatnonzero(np.isfinite(live))
        order = np.argsort(unsaid.arrival[known], kind="stable")
        self.rows, self.at = known[order], unsaid.arrival[known][order]
        self.live, self.weight = live, setup.tracker_weight
        self.base, self.reported, self.failed = (
            ordered["calibrated_est_s"].to_numpy(float),
            reported,
            failed,
        )
        ran = sim[np.isfinite(sim["start_s"].to_numpy(float))].sort_values(
            "finish_s", kind="stable"
        )
        self.finished = ran[["first_request_id", "finish_s"]].to_numpy()
        keys = pd.MultiIndex.from_arrays(
            [
                ordered["request_id"].to_numpy()[sim["first_request_id"].to_numpy()],
                sim["attempt"].to_numpy(),
            ]
        )
        mine = position.reindex(keys).to_numpy(dtype=float, na_value=np.nan)
        factor = (
            sim["est_service_s"].to_numpy(float) / self.base[sim["first_request_id"].to_numpy()]
        )
        self.sim = np.full(len(run), np.nan)
        self.sim[mine[np.isfinite(mine)].astype(int)] = factor[np.isfinite(mine)]

    def learned(self, j: int, end: float) -> float | bool | None:
        """False: the run taught nothing; a number: the engine time it taught; None: the run
        cannot tell."""
        if not self.usable:
            return None
        n = int(np.searchsorted(self.at, end))
        if n == 0 or n == len(self.at):
            return None
        before, after = self.rows[n - 1], self.rows[n]
        lo, hi = self.at[n - 1], self.at[n]
        if not abs(self.sim[before] - self.live[before]) <= 1e-9:
            return None  # apart already: an earlier difference, not this run's
        # The others that taught in between, in the order they finished, around this one's end.
        taught = [
            (f, int(other))
            for other, f in self.finished
            if lo < f < hi and int(other) != j and not self.failed[int(other)]
        ]
        first = [(self.base[o], self.reported[o]) for f, o in taught if f <= end]
        then = [(self.base[o], self.reported[o]) for f, o in taught if f > end]
        without = self._fold(self.live[before], first + then)
        if abs(without - self.live[after]) <= 1e-12:
            return False
        # The tracker's steps are affine below its bound: solve for the ratio that lands on the live
        # factor.
        at = self._fold(self.live[before], first)
        slope = (1 - self.weight) ** len(then)
        offset = self._fold(0.0, then, bounded=False)
        ratio = ((self.live[after] - offset) / slope - (1 - self.weight) * at) / self.weight
        engine_s = ratio * self.base[j]
        if (
            not engine_s > 0
            or abs(
                self._fold(self.live[before], first + [(self.base[j], engine_s)] + then)
                - self.live[after]
            )
            > 1e-9
        ):
            # a step met the tracker's bound, or the window holds what the replay does not
            return None
        return float(engine_s)

    def _fold(self, factor: float, steps: list, bounded: bool = True) -> float:
        """The tracker's factor from ``factor`` after these (predicted, engine time)
        observations."""
        if not bounded:  # the affine part alone (an offset, from 0)
            for predicted, engine_s in steps:
                factor += self.weight * (engine_s / predicted - factor)
            return factor
        tracker = SpeedTracker(self.weight, factor)
        for predicted, engine_s in steps:
            tracker.observe(predicted, engine_s)
        return tracker.factor
