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
* a run the gate cut at its deadline (``Policy.cancel_at_deadline``, outcome
  ``cancelled``) would have run past it: it holds its engine for its deadline plus
  its estimate, longer than any start leaves it, so the simulator cuts it too (rule ``cut``);
* the policy's estimator learns from the tokens each answered run generated (column
  ``tokens``; the limit where the run does not say), scaled by the server's own
  calibration (column ``service_model``), as the gate's did. The synthetic engine's
  speed schedule (column ``speed_schedule``, on the run's clock) is not replayed: the
  held times already carry it; :func:`predict`, which draws its service times, applies it;
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
client hung up (the run's median trip back) is ``abandoned``, as live. Rows are joined on
(first_request_id, attempt); an attempt one side never sent is outcome ``not_sent`` on that side. :func:`per_request`
adds the end-to-end view, one row per request: its outcome (the last attempt's, judged from
the first send) and its number of attempts, live and simulated.

The two outcomes of each request (attempt) are then joined on (first_request_id, attempt)
(:func:`join`). A disagreement is **independent** when the simulator met the
same queue at that arrival as the gate did, and **cascade** otherwise (it
inherits an earlier divergence). The same queue means, precisely: equal
``queued_at_arrival``, ``queued_work_at_arrival_s`` within
:data:`TOLERANCE_S`, the same speed factor (within 1e-9), and no earlier
arrival still in the system on either side (until the later of its two ends)
whose trajectory diverged (outcome, engine start or end differ by more than
:data:`TOLERANCE_S`). The first divergence is the gate time of the first
arrival that diverged or met a different queue.

That split says how a disagreement spread, not why it began (a systematically wrong rule reads as
one independent disagreement and a long cascade). Each attempt apart (diverged, met another queue, or
disagrees) is also given a **cause** (:func:`_causes`, :data:`CAUSES`): the numbers each side
recorded as its admission decision's inputs (estimate, waiting count and work, work left in service,
idle engines, deadline, priority: qsim.policy.decide's arguments) are put into
:func:`qsim.policy.decide`; where its answer is not the decision that side recorded, the simulator,
given that queue state, would have decided otherwise: a **rule** difference (a bug). Where both
sides decided as decide does, the states they met differed, or they parted after admission:
**timing** (a run that ended a few ms apart, a hang-up heard earlier). **unknown** where no decision
can be checked and the two differ (a live client that hung up unanswered has no numbers). An
attempt one side never sent takes the cause of the attempt before it. :func:`first_divergence`
names the first one's cause and what told the two apart.

**Prediction** (:func:`predict`): would the simulator have predicted this run?
Only the arrivals are kept; service times come from the calibrated model at the
run's speed (:func:`prediction_speed`: the synthetic engine's setting, else the
probe before the run, ``speed_before`` from ``qlab live`` or ``qlab replay --probe``,
else the server's speed factor at the run's start), times lognormal noise
(:func:`prediction_noise`: the synthetic engine's ``--noise`` as the run file's
``engine_info`` records it, else the CV ``qlab calibrate`` measured under load, which the
server config's engines carry, else :data:`DEFAULT_NOISE_CV`), and each run slowed by the
engines busy at its start (their calibrated concurrency term), over many seeds. Share
in time, goodput and latency percentiles are compared with the live run's, with
95 % Student-t intervals of the mean across seeds and the 2.5-97.5 % range of
the seeds, as Vidur-like simulators report their error.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from qsim import from_arrays, simulate
from qsim.clients import Decision, Retrier
from qsim.config import ServerConfig
from qsim.engines import Batching, OneAtATime
from qsim.records import with_optional
from qsim.outcomes import ANSWERED, OUTCOMES, REJECT_REASONS, Reason
from qsim.policy import Policy, decide, on_time, reads_more
from qsim.runfile import batch_step_times, engine_info, server_config, speed_probe, speed_schedule
from qsim.service import LoadTerms, SpeedSchedule, SpeedTracker
from qsim.workload import lognormal_noise

from .metrics import end_to_end, mean_ci, run_duration, summary

#: Columns of a live run file besides the server's configuration (qsim.runfile).
RUN_COLUMNS = ("calibrated_est_s", "engine_s")
#: What the gate knew per request (live.rows); a run file from an older qlab replay lacks them (see _known).
REPLAY_COLUMNS = ("server_arrival_s", "arrival_speed_factor", "engine_started_s", "engine_returned_s",
                  "engine_reported_s", "failed", "stalled", "server_finish_s", "stall_factor", "stall_floor_s",
                  "tracker_weight")
SIM_OUTCOMES = tuple(o for o in OUTCOMES if o != "abandoned")
#: The outcome of an attempt one side never sent (the simulator's clients retried otherwise).
NOT_SENT = "not_sent"
#: Rows of a run with retries are attempts: (first_request_id, attempt) names one on both sides.
KEYS = ["first_request_id", "attempt"]
REFUSED = ("rejected", "expired")
#: Engine failures the simulator replays; any other live error (transport, 4xx) it cannot.
ENGINE_REASONS = ("engine_exception", "engine_stalled")
#: Two times (or queued works) closer than this are the same: far below any service time, far above rounding.
TOLERANCE_S = 1e-6
#: The rule each replayed request's engine time came from (column replayed_with).
RULES = {"held": "returned - started (what the gate counted busy)",
         "engine_s": "the engine's own time (an older run file: no hand-back known)",
         "stalled": "a stalled run: until its engine next took a request",
         "estimate": "never started: calibrated estimate x speed factor at its arrival",
         "cancelled": "its client hung up while it ran: until the hang-up reached the gate",
         "cut": "cut at its deadline live: its deadline plus its estimate, so that it passes it wherever it starts",
         "steps": "a batching engine: the run's steps in order, each as long as it ran live"}
#: Why a divergence began (column cause; :func:`_causes`).
CAUSES = {"rule": "the numbers one side decided on, put into qsim.policy.decide, give another answer than the one it "
                  "recorded: the gate and the simulator do not run the same rule (a bug)",
          "timing": "each side decided as decide does on the queue it met: the queue states differed, or the two "
                    "parted after admission (a start, an end, a hang-up at another time)",
          "unknown": "no decision can be checked (no numbers recorded: a client that hung up unanswered, or a rule "
                     "that reads more than the record holds) and the two sides' decisions differ"}
#: Refusals qsim.policy.decide gives (rate_limited comes from a client's bucket, before it).
DECIDE_REASONS = tuple(str(r) for r in REJECT_REASONS if r != Reason.RATE_LIMITED)
#: What the built-in rule reads, as record columns (besides deadline_s), per side in the joined frame.
DECIDED_ON = ("est_service_s", "queued_at_arrival", "queued_work_at_arrival_s", "in_service_work_at_arrival_s",
              "idle_at_arrival", "priority")


def run_setup(run: pd.DataFrame) -> ServerConfig:
    """The server the run ran against (:func:`qsim.runfile.server_config`), checked to be a live run file."""
    missing = [c for c in RUN_COLUMNS if c not in run.columns]
    if missing:
        raise ValueError(f"not a live run file (from qlab replay): it lacks columns {missing}")
    return server_config(run)


def measured_speed(run: pd.DataFrame) -> float:
    """Median of measured engine time over the calibrated estimate, among the served; NaN if none was.

    The run's typical speed after the fact (its effective load is :func:`engine_time_ratio`'s); the replay
    does not use it (it would hand a request information from the run's future)."""
    served = run["outcome"].isin(ANSWERED) & run["engine_s"].gt(0)
    ratio = run.loc[served, "engine_s"] / run.loc[served, "calibrated_est_s"]
    return float(ratio.median()) if len(ratio) else math.nan


def engine_time_ratio(run: pd.DataFrame) -> float:
    """Total measured engine time over the total calibrated estimate, among the served; NaN if none was.

    The run's effective load is its nominal load x this: the engines' busy time over what the calibration
    promised, so long runs weigh as much as they took (the median ratio, :func:`measured_speed`, can read
    1.04 on a run whose engines were busy 1.28x the calibrated total)."""
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


def replay_inputs(run: pd.DataFrame, setup: ServerConfig) -> pd.DataFrame:
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
    cut = run["outcome"].eq("cancelled").to_numpy()
    rule = np.where(np.isfinite(held), "held", np.where(ran_old, "engine_s", np.where(stalled, "stalled", "estimate")))
    rule = np.where(cut, "cut", rule)
    hold = np.select([rule == "held", rule == "engine_s", rule == "cut"],
                     [held, engine_s, run["deadline_s"].to_numpy(float) + estimate], estimate)
    if stalled.any():
        hold[stalled] = _stalled_hold(run, started, stalled)
    if setup.policy.cancel_at_deadline:
        # Answered, so handed back before its cut was due, though the gate read its clock a little later
        # (a busy loop): the replay's run ends just inside its deadline, which the live one beat.
        left = arrival_times(run) + run["deadline_s"].to_numpy(float) - started - TOLERANCE_S
        beat = (rule == "held") & run["outcome"].isin(ANSWERED).to_numpy() & (hold > left)
        hold[beat] = np.maximum(left[beat], 0.0)
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


def _in_arrival_order(run: pd.DataFrame, arrival: np.ndarray,
                      rows: np.ndarray | None = None) -> tuple[pd.DataFrame, np.ndarray]:
    """The run's rows (those ``rows`` marks, default all) in the order the gate took them, and their
    arrival times (``arrival``, one per row of the run; see :func:`arrival_times`)."""
    if rows is not None:
        run, arrival = run[rows], arrival[rows]
    order = np.lexsort((run["request_id"].to_numpy(), arrival))
    return run.iloc[order], arrival[order]


def _simulate(ordered: pd.DataFrame, arrival: np.ndarray, setup: ServerConfig, true_s: np.ndarray, name: str,
              generated: np.ndarray | None = None, schedule: SpeedSchedule | None = None,
              **faults) -> pd.DataFrame:
    """The run's arrivals through qsim as the server was set up, each request held for ``true_s`` (times the
    speed ``schedule``, where given), generating ``generated`` tokens (default: its limit)."""
    trace = from_arrays(arrival, ordered["max_new_tokens"].to_numpy(), true_service_s=true_s,
                        est_service_s=ordered["calibrated_est_s"].to_numpy(float),
                        deadline_s=ordered["deadline_s"].to_numpy(), priority=ordered["priority"].to_numpy(),
                        client_id=ordered["client_id"].astype(object).where(ordered["client_id"].notna(), None).to_numpy(),
                        name=name)
    if generated is not None:
        trace = dataclasses.replace(trace, tokens_generated=np.asarray(generated, dtype=np.int64))
    if "prompt_tokens" in ordered.columns:  # the prompts as sent: the estimator's work has their term too
        trace = dataclasses.replace(trace, prompt_tokens=ordered["prompt_tokens"].to_numpy(np.int64))
    return simulate(trace, setup, speed_schedule=schedule, **faults)


def generated_tokens(run: pd.DataFrame, ordered: pd.DataFrame) -> np.ndarray:
    """Per row of ``ordered``: the tokens its request's answered attempt generated live (column ``tokens``),
    else its limit (the synthetic engine always generates it; a run cut short teaches nothing anyway)."""
    limit = ordered["max_new_tokens"].to_numpy(np.int64)
    if "tokens" not in run.columns:
        return limit
    tokens = run["tokens"].astype("Float64")
    known = run[tokens.notna().to_numpy()]
    by_request = known.groupby("first_request_id")["tokens"].last()
    found = ordered["first_request_id"].map(by_request).astype("Float64").to_numpy(dtype=float, na_value=np.nan)
    return np.where(np.isfinite(found), found, limit).astype(np.int64)


def _retrying(run: pd.DataFrame):
    """The run's clients (:func:`qsim.runfile.client_settings`) and whether they retried."""
    from qsim.runfile import client_settings

    clients, _ = client_settings(run)
    return clients, clients.retry is not None and clients.retry.retries


def _client_faults(run: pd.DataFrame, ordered: pd.DataFrame, arrival: np.ndarray,
                   notice: np.ndarray | float = 0.0) -> dict:
    """simulate()'s arguments for the run's clients: each request's patience, running out when the live
    client's did (its first send + patience) and ``notice`` later (when the gate heard of it), and the
    retry policy with its jitter seed."""
    clients, retrying = _retrying(run)
    out = {}
    if "patience_s" in ordered.columns:
        patience = ordered["patience_s"].to_numpy(float)
        hangup = ordered["arrival_s"].to_numpy(float) + np.where(np.isnan(patience), np.inf, patience) + notice
        if np.isfinite(hangup).any():
            out.update(cancel_after_s=hangup - arrival, cancel_until=clients.patience_until)
    if retrying:
        out.update(retry=clients.retry, retry_seed=clients.retry_seed)
    return out


class _LiveRetrier(Retrier):
    """The run's clients as the simulator's, on the gate's clock: :class:`qsim.clients.Retrier` itself,
    told each attempt's end when the live client learnt it and answering when the retry reached the gate.

    The simulator's clients hear an attempt's end at the gate's end and send again straight into the
    gate; the live client heard it ``out`` later (the answer's trip back; its hang-up for an attempt
    it left) and its retry reached the gate ``back`` after the time the retrier gave (send lateness
    and the trip in). Both are the run's own, per attempt, where the run sent that attempt (else the
    run's medians), so a retry both sides send arrives when it did. Requests are the run's (the jitter
    is drawn per request id), the budget counts the run's first sends, and a patience runs out when
    the client's did (the simulator's ends ``notice`` later, when the gate heard of it).
    """

    def __init__(self, policy, ids: np.ndarray, first_sends, seed: int, out: dict, back: dict, usual: tuple,
                 notice: np.ndarray) -> None:
        super().__init__(policy, np.sort(first_sends), seed)
        self.ids, self.out, self.back, self.usual, self.notice = ids, out, back, usual, notice

    def after(self, request, attempt, first_sent_s, now, status, retry_after_s=None, patience_s=math.inf):
        first = int(self.ids[request])
        heard = now + self.out.get((first, attempt), self.usual[0])
        decision = super().after(first, attempt, first_sent_s, heard, status, retry_after_s,
                                 patience_s - self.notice[request])
        if decision.at_s is None:
            return decision
        return Decision(decision.at_s + self.back.get((first, attempt + 1), self.usual[1]), decision.why)


def _live_retrier(run: pd.DataFrame, arrival: np.ndarray, ids: np.ndarray, retrying, notice: np.ndarray):
    """The :class:`_LiveRetrier` of ``run`` that :func:`qsim.simulate` takes for its clients (None: no retries).

    retrying: the run's retry policy and seed, or None."""
    if not retrying:
        return None
    live_end = np.where(run["outcome"].eq("abandoned"), run["hangup_s"], _known(run)["server_finish_s"])
    out = (run["finish_s"] - live_end).to_numpy(float)
    back = arrival - run["scheduled_s"].to_numpy(float)
    keys = list(zip(run["first_request_id"].tolist(), run["attempt"].tolist()))
    known = np.isfinite(out)
    usual = (float(np.median(out[known])) if known.any() else 0.0,
             float(np.median(back[run["attempt"].gt(1).to_numpy()])) if run["attempt"].gt(1).any() else trip_s(run))
    firsts = run.loc[run["attempt"].eq(1), "scheduled_s"].to_numpy(float)
    policy, seed = retrying
    return _LiveRetrier(policy, ids, firsts, seed, {k: v for k, v in zip(keys, out) if math.isfinite(v)},
                        dict(zip(keys, back)), usual, notice)


def _per_request(run: pd.DataFrame, given: pd.DataFrame) -> pd.DataFrame:
    """replay_inputs per request (indexed by first_request_id): the attempt that ran live (the last, if
    several did), else the last attempt whose speed factor at arrival is known, else the last."""
    factor = (run["arrival_speed_factor"] if "arrival_speed_factor" in run.columns
              else pd.Series(np.nan, index=run.index))
    g = given.assign(first=run["first_request_id"].to_numpy(), attempt=run["attempt"].to_numpy(),
                     ran=given["replayed_with"].ne("estimate").to_numpy(), known=np.isfinite(factor.to_numpy(float)))
    pick = g.sort_values(["first", "ran", "known", "attempt"], kind="stable").groupby("first").tail(1)
    return pick.set_index("first")[["hold_s", "reported_s", "failed", "replayed_with"]]


def simulate_run(run: pd.DataFrame, origin: str = "server") -> pd.DataFrame:
    """qsim's rows for the run's arrivals, with the run's request ids (times on the run's clock).

    With retries the simulator gets the first attempts and its own clients send the rest; a
    simulated attempt takes the run's request_id of the same (first_request_id, attempt), and one
    the run lacks an id after the run's. Extra columns: speed_factor_at_arrival (est_service_s /
    calibrated) and replayed_with."""
    return _replay(run, origin)[0]


@dataclass
class _Unsaid:
    """What the run does not say, as the replay takes it: each row's gate arrival (estimated where no
    answer gave it), and how long after a client hung up the gate let its request go (``notice_s``;
    per request where the queue others saw says otherwise, in ``late``). ``settled``: the engine times the
    last replay settled on for the runs whose clients hung up (request_id -> hold, reported, failed, rule),
    and ``usual`` its delay from a hang-up to the next start, where the next replay starts from (it differs
    by one arrival or hang-up moved, so it settles in a few passes, not one per such run again)."""

    arrival: np.ndarray
    notice_s: float
    late: dict
    settled: dict = dataclasses.field(default_factory=dict)
    usual: list = dataclasses.field(default_factory=list)

    def notice(self, firsts) -> np.ndarray:
        return np.array([self.late.get(int(f), self.notice_s) for f in firsts], dtype=float)


def _replay(run: pd.DataFrame, origin: str) -> tuple[pd.DataFrame, _Unsaid]:
    """:func:`simulate_run`, and what it took for what the run does not say (:class:`_Unsaid`).

    An attempt the gate never answered (its client hung up) has no known gate arrival: it is placed
    at its send plus the run's median trip; a client's hang-up reaches the gate that median trip after
    it. Where either puts an arrival or a departure on the wrong side of a request that came within
    the run's spread of trips of it (that request's queue at arrival, as the gate reported it, says
    so), it is moved just across and the run replayed again."""
    setup = run_setup(run)
    unsaid = _Unsaid(arrival_times(run, origin).copy(), trip_s(run), {})
    guessed = _guessed(run, origin)
    moved: set = set()
    for _ in range(int(guessed.sum()) + int(run["outcome"].eq("abandoned").sum()) + 1):
        sim = _replay_once(run, setup, unsaid)
        if not _misplaced(run, sim, unsaid, guessed, moved):
            break
    return sim, unsaid


def _guessed(run: pd.DataFrame, origin: str) -> np.ndarray:
    """Rows whose gate arrival :func:`arrival_times` estimated (no answer said when the gate took them)."""
    if origin != "server" or "server_arrival_s" not in run.columns:
        return np.zeros(len(run), dtype=bool)
    known = np.isfinite(run["server_arrival_s"].to_numpy(float))
    return ~known if known.any() else np.zeros(len(run), dtype=bool)


def _replay_once(run: pd.DataFrame, setup: ServerConfig, unsaid: _Unsaid) -> pd.DataFrame:
    """One replay of the run with these gate arrivals and hang-ups (see :func:`simulate_run`)."""
    _, retrying = _retrying(run)
    arrival = unsaid.arrival
    ordered, first_arrival = _in_arrival_order(run, arrival, run["attempt"].eq(1).to_numpy() if retrying else None)
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
    usual = unsaid.usual  # the delay from a hang-up to its engine's next start, once a pass has seen it
    # Each pass settles at least the earliest run a live client hung up on that the last one had wrong
    # (a later one's start moves with it): at most one pass per such attempt, and one to confirm.
    for _ in range(int(run["outcome"].eq("abandoned").sum()) + 1):
        notice = unsaid.notice(ordered["first_request_id"])
        faults = _client_faults(run, ordered, first_arrival, notice)
        retrier = _live_retrier(run, arrival, ordered["request_id"].to_numpy(),
                                (faults["retry"], faults["retry_seed"]) if retrying else None, notice)
        # A batching engine's steps take the run's step times, in order (the core decides the rest, as live); its
        # requests have no run time of their own.
        # Engines one at a time held their engines for the times the run says, slowdown included (held).
        runs = ({"step_times": batch_step_times(run)} if setup.batching
                else {"failed": failed, "reported_s": reported, "held": True})
        sim = _simulate(ordered, first_arrival, setup, hold, "live-arrivals", generated_tokens(run, ordered),
                        retrier=retrier, **runs, **faults)
        if setup.batching or not _cancelled_runs(run, setup, unsaid, ordered, sim, hold, reported, failed, rule, usual):
            break
    unsaid.settled = {first: (hold[j], reported[j], failed[j], rule[j]) for j, first in enumerate(ids)
                      if rule[j] == "cancelled"}
    sim_first = sim["first_request_id"].to_numpy()
    sim["first_request_id"] = ordered["request_id"].to_numpy()[sim_first]
    base = ordered["calibrated_est_s"].to_numpy(float)[sim_first]
    sim["speed_factor_at_arrival"] = sim["est_service_s"].to_numpy(float) / base
    sim["replayed_with"] = rule[sim_first]
    if retrying:  # a request's rule is its run's: an attempt the simulator did not start held nothing
        sim["replayed_with"] = sim["replayed_with"].where(np.isfinite(sim["start_s"].to_numpy(float)), "estimate")
    ids = run.set_index(KEYS)["request_id"].reindex(pd.MultiIndex.from_arrays(
        [sim["first_request_id"], sim["attempt"]])).to_numpy(dtype=float, na_value=np.nan).copy()
    extra = np.isnan(ids)
    ids[extra] = run["request_id"].max() + 1 + np.arange(extra.sum())
    sim["request_id"] = ids.astype(np.int64)
    return sim.sort_values("request_id", ignore_index=True)


def _misplaced(run: pd.DataFrame, sim: pd.DataFrame, unsaid: _Unsaid, guessed: np.ndarray, moved: set) -> bool:
    """Move one thing the run does not say to where the run says it was, and say so (True); each once.

    An attempt whose client hung up that the replay refused at its guessed arrival came later (it had
    been admitted): just after the replay next made room (a waiting attempt left, an engine took the next), one
    such at a time, else just before the next known arrival, within the run's spread of trips. Else, at the
    first request (in gate order) whose queue at arrival differs between the gate and the replay, look
    within that spread for what explains it: the replay saw more waiting work, so an arrival of guessed
    time just before it came after it, or a hang-up just after it reached the gate before it; less, the
    other way round. Move the nearest such just across."""
    arrival = unsaid.arrival
    keys = pd.MultiIndex.from_arrays([run["first_request_id"], run["attempt"]])
    simmed = sim.set_index(KEYS).reindex(keys)
    sent = run["arrival_s"].to_numpy(float)
    spread = float(np.nanmax(np.abs(arrival - sent)[~guessed], initial=0.0)) if (~guessed).any() else 0.0
    # A client that hung up had been admitted (a refusal is answered at once): where the replay refuses
    # it at its guessed arrival, it came later, before the next arrival the run knows.
    refused = guessed & run["outcome"].eq("abandoned").to_numpy() & simmed["outcome"].eq("rejected").to_numpy()
    # Where room opened in the replay (a waiting attempt left, an engine took the next) it may have come just after.
    waited_out = sim["outcome"].eq("abandoned").to_numpy() & np.isnan(sim["start_s"].to_numpy(float))
    freed = np.sort(np.concatenate([sim.loc[waited_out, "finish_s"].to_numpy(float), sim["start_s"].dropna()]))
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
    # Who waited, not their work: an arrival or a departure on the wrong side changes the count, while the work
    # also moves with the speed factor, which a run answered or stopped around its client's hang-up (the run
    # cannot say which) may have left a little apart for the rest of the run.
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
    waited_out = sim["outcome"].eq("abandoned").to_numpy() & np.isnan(sim["start_s"].to_numpy(float))
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
        unsaid.late[key] = notice + (when - TOLERANCE_S if more else when + TOLERANCE_S) - \
            float(sim.loc[waited_out & sim["first_request_id"].eq(key).to_numpy(), "finish_s"].iloc[0])
    return True


def _cancelled_runs(run: pd.DataFrame, setup: ServerConfig, unsaid: _Unsaid, ordered: pd.DataFrame, sim: pd.DataFrame,
                    hold: np.ndarray, reported: np.ndarray, failed: np.ndarray, rule: np.ndarray,
                    usual: list) -> bool:
    """Where the simulator ran an attempt the live client hung up on, and that request ran nowhere
    else live: hold its engine until the live engine was free again, teaching nothing (the gate stops
    such a run). Updates the arrays in place; True when something changed.

    When the live engine was free again: where the request the replay starts next on that engine had
    waited for it and the run knows its start, at that start (as for a stalled run), unless an attempt
    whose client hung up later was waiting then (the engine may have run it in between, unseen); else
    (the next is another attempt whose client hung up, or nobody was waiting) at the hang-up plus the
    run's usual delay from a hang-up to the engine's next start (its median where the first pass that knows any
    saw them, kept in ``usual`` so that the passes settle; else the trip to the gate). An engine free
    before the hang-up ran the request to its end: the gate answered it, the client had left. A run
    stopped by its client's hang-up had been let go by then: where the replay hears of that hang-up
    later (``unsaid``), it hears of it just before.
    """
    arrival = unsaid.arrival
    ran = np.isfinite(sim["start_s"].to_numpy(float))
    if not ran.any() or not run["outcome"].eq("abandoned").any():
        return False
    firsts = ordered["request_id"].to_numpy()
    position = pd.Series(np.arange(len(run)),
                         index=pd.MultiIndex.from_arrays([run["first_request_id"], run["attempt"]]))
    started = _known(run)["engine_started_s"].to_numpy(float)
    waited = started > arrival + TOLERANCE_S  # its engine was busy (or others ahead of it) when it came
    abandoned = run["outcome"].eq("abandoned").to_numpy()
    hangup = run["finish_s"].to_numpy(float)  # when the client hung up
    intended = run["hangup_s"].to_numpy(float) if "hangup_s" in run.columns else hangup  # when it meant to
    on = sim[ran].sort_values("start_s", kind="stable")
    found = []  # (j, row position in the run, sim start, the next start if known)
    for engine, runs in on.groupby("engine", sort=False):
        rows = runs[["first_request_id", "attempt", "start_s"]].to_numpy()
        for n, (j, attempt, start) in enumerate(rows):
            j = int(j)
            k = position.get((firsts[j], int(attempt)))
            if k is None or not abandoned[k] or rule[j] not in ("estimate", "cancelled"):
                continue
            after = position.get((firsts[int(rows[n + 1][0])], int(rows[n + 1][1]))) if n + 1 < len(rows) else None
            known = after is not None and np.isfinite(started[after]) and started[after] > start
            found.append((j, k, start, started[after] if known else np.nan, known and waited[after]))
    if not found:
        return False
    # Attempts the replay had leave while waiting (their clients hung up): if one was waiting when the
    # engine was free, the live engine may have taken it first, and its start is unknown.
    left = sim["outcome"].eq("abandoned").to_numpy() & ~ran
    came = sim["arrival_s"].to_numpy(float)[left]
    mine = [position.get((firsts[int(f)], int(a)))
            for f, a in zip(sim.loc[left, "first_request_id"], sim.loc[left, "attempt"])]
    went = np.where([m is None for m in mine], sim.loc[left, "finish_s"].to_numpy(float),  # when its client hung up
                    [hangup[m] if m is not None else np.nan for m in mine])

    def unseen(free: float, nxt: float) -> bool:
        return bool(((came < free) & (went > free) & (went < nxt)).any())

    # The usual delay: measured where nothing else can have run in between, and no longer than a trip can
    # take (a first pass, before the others settle, pairs runs that were not one after the other).
    spread = float(np.nanmax(np.abs(arrival - run["arrival_s"].to_numpy(float)), initial=0.0))
    delays = [d for _, k, _, nxt, exact in found if exact and not unseen(hangup[k], nxt)
              for d in [nxt - hangup[k]] if 0 <= d <= spread]
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
        # Ended before the hang-up: the gate answered (and its tracker learned) an answer the client did not
        # wait for, still on its way back; otherwise the stopped run teaches nothing. Where the live speed
        # factor around its end says which (and what it learned), that.
        stopped, taught = bool(end >= hangup[k]), target
        said = tracker.learned(j, end)
        if said is not None:
            stopped, taught = said is False, target if said is False else said
        if (rule[j] != "cancelled" or abs(hold[j] - target) > 1e-9 or failed[j] != stopped
                or abs(reported[j] - taught) > 1e-12):
            hold[j], reported[j], failed[j], rule[j] = target, taught, stopped, "cancelled"
            changed = True
        first, heard = int(firsts[j]), intended[k] + unsaid.notice([firsts[j]])[0]
        if stopped and heard > end - TOLERANCE_S:
            unsaid.late[first] = max(0.0, end - TOLERANCE_S - intended[k])
            changed = True
        elif not stopped and heard <= end:  # the gate heard of the hang-up after the run had ended: just after
            unsaid.late[first] = end + TOLERANCE_S / 2 - intended[k]  # (within the tolerance: the same end)
            changed = True
    return changed


class _TrackerEvidence:
    """What the gate's speed tracker says of a run whose client hung up around its end: the tracker's factor
    at the live arrivals just before and after the run's end (the run records it per answered request).
    Where the replay's factor agrees at the first, the replay's other runs that taught the tracker between the
    two are folded in as the replay has them, and this one's teaching is what makes the second agree: none (the
    factor as without it: the run was stopped), or the engine time the tracker's step solves for (it ran to
    its end, and the gate answered it)."""

    def __init__(self, run: pd.DataFrame, setup: ServerConfig, unsaid: _Unsaid, ordered: pd.DataFrame,
                 sim: pd.DataFrame, position: pd.Series, reported: np.ndarray, failed: np.ndarray) -> None:
        live = (run["arrival_speed_factor"] if "arrival_speed_factor" in run.columns
                else pd.Series(np.nan, index=run.index)).to_numpy(float)
        # A learning estimator, engines that share, or a fixed estimate: the factor's steps are not the plain EWMA's.
        self.usable = (not setup.fixed_estimate and setup.policy.estimator == "limit"
                       and isinstance(setup.engine, OneAtATime) and not setup.engine.concurrency
                       and np.isfinite(live).any())
        if not self.usable:
            return
        known = np.flatnonzero(np.isfinite(live))
        order = np.argsort(unsaid.arrival[known], kind="stable")
        self.rows, self.at = known[order], unsaid.arrival[known][order]
        self.live, self.weight = live, setup.tracker_weight
        self.base, self.reported, self.failed = ordered["calibrated_est_s"].to_numpy(float), reported, failed
        ran = sim[np.isfinite(sim["start_s"].to_numpy(float))].sort_values("finish_s", kind="stable")
        self.finished = ran[["first_request_id", "finish_s"]].to_numpy()
        keys = pd.MultiIndex.from_arrays([ordered["request_id"].to_numpy()[sim["first_request_id"].to_numpy()],
                                          sim["attempt"].to_numpy()])
        mine = position.reindex(keys).to_numpy(dtype=float, na_value=np.nan)
        factor = sim["est_service_s"].to_numpy(float) / self.base[sim["first_request_id"].to_numpy()]
        self.sim = np.full(len(run), np.nan)
        self.sim[mine[np.isfinite(mine)].astype(int)] = factor[np.isfinite(mine)]

    def learned(self, j: int, end: float) -> float | bool | None:
        """False: the run taught nothing; a number: the engine time it taught; None: the run cannot tell."""
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
        taught = [(f, int(other)) for other, f in self.finished
                  if lo < f < hi and int(other) != j and not self.failed[int(other)]]
        first = [(self.base[o], self.reported[o]) for f, o in taught if f <= end]
        then = [(self.base[o], self.reported[o]) for f, o in taught if f > end]
        without = self._fold(self.live[before], first + then)
        if abs(without - self.live[after]) <= 1e-12:
            return False
        # The tracker's steps are affine below its bound: solve for the ratio that lands on the live factor.
        at = self._fold(self.live[before], first)
        slope = (1 - self.weight) ** len(then)
        offset = self._fold(0.0, then, bounded=False)
        ratio = ((self.live[after] - offset) / slope - (1 - self.weight) * at) / self.weight
        engine_s = ratio * self.base[j]
        if not engine_s > 0 or abs(self._fold(self.live[before], first + [(self.base[j], engine_s)] + then)
                                   - self.live[after]) > 1e-9:
            return None  # a step met the tracker's bound, or the window holds what the replay does not
        return float(engine_s)

    def _fold(self, factor: float, steps: list, bounded: bool = True) -> float:
        """The tracker's factor from ``factor`` after these (predicted, engine time) observations."""
        if not bounded:  # the affine part alone (an offset, from 0)
            for predicted, engine_s in steps:
                factor += self.weight * (engine_s / predicted - factor)
            return factor
        tracker = SpeedTracker(self.weight, factor)
        for predicted, engine_s in steps:
            tracker.observe(predicted, engine_s)
        return tracker.factor


def join(run: pd.DataFrame, sim: pd.DataFrame, unsaid: _Unsaid | None = None) -> pd.DataFrame:
    """One row per attempt (per request without retries): live and simulated outcome, reason, latency,
    queue at arrival, and agreement, matched on (first_request_id, attempt).

    Latencies are the client's: live_latency_s as measured; sim_latency_s is the simulator's own
    time in the gate (its finish, from its own start and hold, less the gate arrival) plus the trips
    the client measured (send to gate arrival, gate end to answer), so latency_error_s is the time
    in the gate the simulator got wrong. A simulated answer is good or late by that latency, as
    the live one is by the client's; sim_outcome_at_gate keeps the simulator's own verdict. An
    attempt one side never sent is ``not_sent`` there (its times NaN, its gate arrival the other's).
    unsaid: what the replay took for what the run does not say (default: arrivals from
    :func:`arrival_times`, hang-ups heard at once).
    """
    known = _known(run)
    arrival = arrival_times(run) if unsaid is None else unsaid.arrival
    live_end = known["server_finish_s"].to_numpy()
    if "hangup_s" in run.columns:  # the gate's end of an attempt whose client hung up: when it heard of it
        hung = run["outcome"].eq("abandoned").to_numpy()
        heard = 0.0 if unsaid is None else unsaid.notice(run["first_request_id"])
        live_end = np.where(hung, run["hangup_s"].to_numpy(float) + heard, live_end)
    live = with_optional(run)[["request_id", *KEYS, "size_class", "max_new_tokens", "deadline_s", "outcome", "reason", "arrival_s",
                "finish_s", *DECIDED_ON]].assign(
        gate_arrival_s=arrival, live_start_s=known["engine_started_s"].to_numpy(),
        live_end_s=live_end, live_speed_factor=known["arrival_speed_factor"].to_numpy())
    simmed = sim[["request_id", *KEYS, "outcome", "reason", "arrival_s", "start_s", "finish_s", "latency_s",
                  *DECIDED_ON, "speed_factor_at_arrival", "replayed_with",
                  "size_class", "max_new_tokens", "deadline_s"]].rename(
        columns={"start_s": "sim_start_s", "finish_s": "sim_end_s", "latency_s": "sim_gate_latency_s",
                 "speed_factor_at_arrival": "sim_speed_factor", "arrival_s": "sim_arrival_s",
                 "request_id": "sim_request_id", "size_class": "sim_size_class",
                 "max_new_tokens": "sim_max_new_tokens", "deadline_s": "sim_deadline_s"})
    both = live.merge(simmed, on=KEYS, how="outer", suffixes=("_live", "_sim"), validate="one_to_one")
    both = both.rename(columns={"outcome_live": "live_outcome", "outcome_sim": "sim_outcome_at_gate",
                                "reason_live": "live_reason", "reason_sim": "sim_reason"})
    only_sim = both["live_outcome"].isna()
    if only_sim.any():  # sent only by the simulator's clients: what the simulator knows of it
        both["request_id"] = both["request_id"].fillna(both["sim_request_id"])
        for name in ("size_class", "max_new_tokens", "deadline_s"):
            both[name] = both[name].fillna(both[f"sim_{name}"])
        both["gate_arrival_s"] = both["gate_arrival_s"].fillna(both["sim_arrival_s"])
        both["live_outcome"] = both["live_outcome"].fillna(NOT_SENT)
    both["request_id"] = both["request_id"].astype(np.int64)
    both["max_new_tokens"] = both["max_new_tokens"].astype(np.int64)
    both = both.drop(columns=["sim_request_id", "sim_size_class", "sim_max_new_tokens", "sim_deadline_s"])
    both["live_latency_s"] = both["finish_s"] - both["arrival_s"]
    live_gate = both["live_end_s"] - both["gate_arrival_s"]
    trips = (both["live_latency_s"] - live_gate).where(live_gate.notna(), both["gate_arrival_s"] - both["arrival_s"])
    both["sim_latency_s"] = both["sim_gate_latency_s"] + trips.fillna(0.0)
    in_time = np.where(on_time(both["sim_latency_s"], both["deadline_s"]), "good", "late")
    sim_answered = both["sim_outcome_at_gate"].isin(ANSWERED)
    both["sim_outcome"] = both["sim_outcome_at_gate"].where(~sim_answered, pd.Series(in_time, index=both.index))
    both["sim_outcome"] = both["sim_outcome"].fillna(NOT_SENT)
    if "hangup_s" in run.columns:  # an answer that would have reached the client after it hung up: it had left
        hangup = run.set_index(KEYS)["hangup_s"].reindex(pd.MultiIndex.from_frame(both[KEYS])).to_numpy(float)
        answered_live = run["outcome"].isin(ANSWERED).to_numpy()
        back = (run["finish_s"] - known["server_finish_s"]).to_numpy(float)[answered_live]
        back = float(np.nanmedian(back)) if np.isfinite(back).any() else 0.0
        gone = sim_answered.to_numpy() & (both["sim_end_s"].to_numpy(float) + back > hangup)
        both.loc[gone, "sim_outcome"] = "abandoned"
    both = both.drop(columns=["finish_s", "sim_arrival_s"])
    both["agree"] = both["live_outcome"].eq(both["sim_outcome"]).astype(bool)
    answered = both["live_outcome"].isin(ANSWERED) & both["sim_outcome"].isin(ANSWERED)
    both["latency_error_s"] = (both["sim_latency_s"] - both["live_latency_s"]).where(answered)
    both["modelled"] = (both["live_outcome"].ne("error") | both["live_reason"].isin(ENGINE_REASONS)).astype(bool)
    return _causes(_divergence(both), run_setup(run))


def per_request(run: pd.DataFrame, joined: pd.DataFrame) -> pd.DataFrame:
    """One row per request (first_request_id), end to end as its client saw it, live and simulated:
    the outcome of its last attempt (an answer judged good or late from the *first* send, as
    :func:`analysis.metrics.end_to_end`), that attempt's reason, and how many attempts were sent.

    The simulated latency from the first send is the simulated attempt's (:func:`join`) plus the time
    from the first send to that attempt's send (the live send where the run sent it, else the
    simulator's arrival). agree: same outcome and attempt count."""
    live = end_to_end(run).set_index("first_request_id")
    first_sent = live["arrival_s"]
    sent = joined[joined["sim_outcome"].ne(NOT_SENT)].sort_values(KEYS, kind="stable")
    last = sent.groupby("first_request_id", sort=True).tail(1).set_index("first_request_id")
    own_send = last["arrival_s"].fillna(last["gate_arrival_s"])
    latency = own_send - first_sent.reindex(last.index) + last["sim_latency_s"]
    answered = last["sim_outcome_at_gate"].isin(ANSWERED) & last["sim_outcome"].ne("abandoned")
    in_time = on_time(latency, live["deadline_s"].reindex(last.index))
    sim_outcome = last["sim_outcome"].astype(object).where(~answered, np.where(in_time, "good", "late"))
    out = pd.DataFrame({
        "live_outcome": live["outcome"].astype(str),
        "sim_outcome": sim_outcome.reindex(live.index).fillna(NOT_SENT).astype(str),
        "live_reason": live["reason"], "sim_reason": last["sim_reason"].reindex(live.index),
        "live_attempts": live["attempts"].astype(np.int64),
        "sim_attempts": sent.groupby("first_request_id").size().reindex(live.index, fill_value=0).astype(np.int64),
        "live_latency_s": live["latency_s"], "sim_latency_s": latency.where(answered).reindex(live.index),
    }, index=live.index)
    out["outcome_agree"] = out["live_outcome"].eq(out["sim_outcome"])
    out["attempts_agree"] = out["live_attempts"].eq(out["sim_attempts"])
    out["agree"] = out["outcome_agree"] & out["attempts_agree"]
    return out.reset_index()


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
    # A client that hung up got no answer: whether (and when) its request started, the run cannot say.
    unknown = b["live_outcome"].eq("abandoned").to_numpy() & b["live_start_s"].isna().to_numpy()
    b["diverged"] = ~(b["agree"].to_numpy() & (_close(b["live_start_s"], b["sim_start_s"], TOLERANCE_S) | unknown)
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


def _checkable(policy: Policy) -> bool:
    """Whether a record holds every number this policy's admission rule reads: the built-in rule over the
    brief's numbers (no plug-in rule, queued tokens, shedding draw, objectives or memory, reserved class, or a
    discipline that serves some arrivals ahead of others, as the queue core's own test for it)."""
    return (type(policy).decide is Policy.decide and not reads_more(policy) and policy.reserve_min_s is None
            and getattr(policy.make_discipline(), "ahead_s", None) is None)


def _decisions(b: pd.DataFrame, side: str, setup: ServerConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per row, one side's admission decision as recorded ("admit" or the refusal's reason) and what
    :func:`qsim.policy.decide` answers on the numbers that side recorded; None where unknown (not sent, no
    numbers, a refusal decide does not give, or a policy whose rule reads more than the record)."""
    outcome = b["live_outcome" if side == "live" else "sim_outcome_at_gate"].astype(object).to_numpy()
    reason = b[f"{side}_reason"].astype(object).to_numpy()
    numbers = {c: b[f"{c}_{side}"].astype("Float64").to_numpy(dtype=float, na_value=np.nan) for c in DECIDED_ON}
    deadline = b["deadline_s"].to_numpy(float)
    policy, engines = setup.policy, setup.engine.engines
    checkable = _checkable(policy)
    recorded, rule = np.full(len(b), None, dtype=object), np.full(len(b), None, dtype=object)
    for i in range(len(b)):
        values = [numbers[c][i] for c in DECIDED_ON]
        said = all(math.isfinite(v) for v in values)
        if (pd.isna(outcome[i]) or outcome[i] == NOT_SENT or (outcome[i] == "error" and not said)
                or (outcome[i] == "rejected" and reason[i] == Reason.RATE_LIMITED)):
            continue  # not sent, a transport failure, or refused before the rule
        # Any other outcome was admitted; one whose client hung up too (a refusal is answered at once).
        recorded[i] = reason[i] if outcome[i] == "rejected" else "admit"
        if not checkable or not said:
            continue
        est, queued, work, in_service, idle, priority = values
        due = deadline[i] if math.isfinite(deadline[i]) else policy.deadline_s
        refusal = decide(policy, int(queued), work, in_service, est, due, engines, int(idle), int(priority))
        rule[i] = "admit" if refusal is None else str(refusal.reason)
    return recorded, rule


def _agrees(recorded, rule) -> bool | None:
    """Whether decide's answer is the recorded decision (the reason too, where it is one decide gives; the
    gate's deadline_too_short is decide's refusal in its HTTP words); None where either is unknown."""
    if pd.isna(recorded) or pd.isna(rule):  # None, or NaN once in a frame
        return None
    if recorded == "admit" or rule == "admit" or recorded not in DECIDE_REASONS:
        return (recorded == "admit") == (rule == "admit")
    return recorded == rule


def _causes(b: pd.DataFrame, setup: ServerConfig) -> pd.DataFrame:
    """Name why each attempt that diverged, met another queue or disagrees did so (column cause, one of
    :data:`CAUSES`): ``rule`` where a side's recorded decision is not what :func:`qsim.policy.decide` gives on
    the numbers that side recorded (so the simulator, given the live queue state, would have decided
    otherwise), ``timing`` where both decided as decide does (the states they met differed, or they parted
    after admission), ``unknown`` where neither can be checked and the decisions differ. An attempt one side
    never sent follows from the request's earlier attempt, and takes its cause. Columns live_decision /
    sim_decision (as recorded) and live_rule / sim_rule (decide on that side's numbers): "admit" or a reason."""
    for side in ("live", "sim"):
        b[f"{side}_decision"], b[f"{side}_rule"] = _decisions(b, side, setup)
    checks = {side: [_agrees(d, r) for d, r in zip(b[f"{side}_decision"], b[f"{side}_rule"])] for side in ("live", "sim")}
    same = [pd.notna(d) and pd.notna(e) and (d == "admit") == (e == "admit")
            for d, e in zip(b["live_decision"], b["sim_decision"])]
    cause = np.where([a is False or c is False for a, c in zip(checks["live"], checks["sim"])], "rule",
                     np.where([a is True or s for a, s in zip(checks["live"], same)], "timing", "unknown")).astype(object)
    # A retry one side never sent: the cause of the request's attempt before it (attempts in order).
    position = {key: k for k, key in enumerate(zip(b["first_request_id"], b["attempt"]))}
    unsent = (b["live_outcome"].eq(NOT_SENT) | b["sim_outcome"].eq(NOT_SENT)).to_numpy()
    for k in sorted(np.flatnonzero(unsent), key=lambda k: b["attempt"].iat[k]):
        before = position.get((b["first_request_id"].iat[k], b["attempt"].iat[k] - 1))
        cause[k] = cause[before] if before is not None and cause[before] != "" else "unknown"
    apart = (b["diverged"] | ~b["same_queue"] | ~b["agree"]).to_numpy()
    b["cause"] = np.where(apart, cause, "")
    return b


def first_divergence(joined: pd.DataFrame) -> dict | None:
    """The first attempt (in gate order) that diverged or met another queue: its keys, outcomes, cause, and
    what told the two apart (the decision numbers that differ, or the start and end); None: no divergence."""
    apart = joined[joined["diverged"] | ~joined["same_queue"]]
    if apart.empty:
        return None
    row = apart.sort_values(["gate_arrival_s", "request_id"]).iloc[0]
    differ = []
    # A live attempt the gate never answered (its client hung up) has no numbers; its estimate is the calibrated one.
    said = pd.notna(row["queued_at_arrival_live"])
    for c in (*DECIDED_ON, "speed_factor") if said else ():
        live, sim = (row["live_speed_factor"], row["sim_speed_factor"]) if c == "speed_factor" else \
            (row[f"{c}_live"], row[f"{c}_sim"])
        if pd.notna(live) and pd.notna(sim) and abs(float(live) - float(sim)) > TOLERANCE_S:
            differ.append(f"{c} live {float(live):.6g}, sim {float(sim):.6g}")
    if not differ:
        for c in ("start_s", "end_s"):
            live, sim = row[f"live_{c}"], row[f"sim_{c}"]
            if pd.notna(live) and pd.notna(sim) and abs(float(live) - float(sim)) > TOLERANCE_S:
                differ.append(f"{c} sim - live {(float(sim) - float(live)) * 1e3:+.3f} ms")
    return {"request_id": int(row["request_id"]), "first_request_id": int(row["first_request_id"]),
            "attempt": int(row["attempt"]), "gate_arrival_s": float(row["gate_arrival_s"]),
            "live_outcome": str(row["live_outcome"]), "sim_outcome": str(row["sim_outcome"]),
            "cause": str(row["cause"]), "differ": differ,
            **{c: None if pd.isna(row[c]) else str(row[c]) for c in ("live_decision", "live_rule", "sim_decision",
                                                                    "sim_rule")}}


def describe_first_divergence(first: dict) -> str:
    """One line for :func:`first_divergence`'s answer: which attempt, its outcomes, its cause and why."""
    head = (f"request {first['first_request_id']} attempt {first['attempt']} at {first['gate_arrival_s']:.3f} s, live "
            f"{first['live_outcome']}, sim {first['sim_outcome']}: {first['cause']}")
    if first["cause"] == "rule":
        wrong = [f"{side} recorded {first[f'{side}_decision']}, decide on its numbers gives {first[f'{side}_rule']}"
                 for side in ("live", "sim") if _agrees(first[f"{side}_decision"], first[f"{side}_rule"]) is False]
        return f"{head} ({'; '.join(wrong)})"
    return f"{head} ({'; '.join(first['differ']) or 'the same numbers and times'})"


def confusion(joined: pd.DataFrame) -> pd.DataFrame:
    """Counts of (live outcome, simulated outcome), every outcome shown even when zero."""
    live, sim = joined["live_outcome"].astype(str), joined["sim_outcome"].astype(str)
    table = pd.crosstab(live, sim)
    # Where clients gave up or retried: abandoned on the simulator's side too, and attempts one side never sent.
    hung = ["abandoned"] if (live.eq("abandoned") | sim.eq("abandoned")).any() else []
    rows = list(OUTCOMES) + ([NOT_SENT] if live.eq(NOT_SENT).any() else [])
    columns = list(SIM_OUTCOMES) + hung + ([NOT_SENT] if sim.eq(NOT_SENT).any() else [])
    table = table.reindex(index=rows, columns=columns, fill_value=0)
    table.index.name, table.columns.name = "live", "sim"
    return table


def reasons(joined: pd.DataFrame) -> pd.DataFrame:
    """Counts of (live reason, simulated reason) among requests both refused or dropped."""
    refused = joined[joined["live_outcome"].isin(REFUSED) & joined["sim_outcome"].isin(REFUSED)]
    table = pd.crosstab(refused["live_reason"].astype(str), refused["sim_reason"].astype(str))
    table.index.name, table.columns.name = "live", "sim"
    return table


def summarize(joined: pd.DataFrame, speed: float = math.nan, requests: pd.DataFrame | None = None) -> dict[str, float]:
    """Disagreements among requests the service handled (live errors apart; engine failures are
    replayed and counted as failure_disagreements), independent and cascade, and by cause (rule, timing,
    unknown: :data:`CAUSES`; ``*_divergences`` count every attempt apart, agreeing or not), the first divergence,
    refusal reasons both ways, outcome counts both ways and the latency error of requests both answered.

    Rows are attempts where clients retried; with ``requests`` (:func:`per_request`) the end-to-end
    figures are added: requests_e2e, e2e_disagreements (outcome or attempt count differ, among
    requests not ending in a live error) and their rate, e2e_outcome_disagreements,
    attempt_count_disagreements, attempts and abandoned requests on each side, and live_not_sent /
    sim_not_sent (attempts only the other side sent)."""
    handled = joined[joined["live_outcome"] != "error"]
    wrong = ~handled["agree"]
    failures = joined[joined["live_outcome"].eq("error") & joined["modelled"]]
    error = joined["latency_error_s"].dropna()
    refused = joined["live_outcome"].isin(REFUSED) & joined["sim_outcome"].isin(REFUSED)
    same_reason = joined.loc[refused, "live_reason"].astype(str).eq(joined.loc[refused, "sim_reason"].astype(str))
    apart = joined["diverged"] | ~joined["same_queue"]
    first = first_divergence(joined)
    row: dict[str, float] = {
        "requests": len(joined),
        "live_errors": int((joined["live_outcome"] == "error").sum()),
        "engine_failures": len(failures),
        "disagreements": int(wrong.sum()),
        "disagreement_rate": wrong.sum() / len(handled) if len(handled) else math.nan,
        "independent_disagreements": int((handled["disagreement"] == "independent").sum()),
        "cascade_disagreements": int((handled["disagreement"] == "cascade").sum()),
        "failure_disagreements": int((~failures["agree"]).sum()),
        **{f"{cause}_disagreements" if cause != "unknown" else "unknown_cause_disagreements":
           int(handled.loc[wrong, "cause"].eq(cause).sum()) for cause in CAUSES},
        **{f"{cause}_divergences": int(joined["cause"].eq(cause).sum()) for cause in CAUSES},
        # 1: the first divergence is a rule difference, 0: timing, NaN: unknown or none (first_divergence says).
        "first_divergence_rule": math.nan if first is None or first["cause"] == "unknown" else
        float(first["cause"] == "rule"),
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
    for outcome in (*OUTCOMES, NOT_SENT):
        row[f"live_{outcome}"] = int((joined["live_outcome"] == outcome).sum())
        row[f"sim_{outcome}"] = int((joined["sim_outcome"] == outcome).sum())
    if requests is not None:
        judged = requests[requests["live_outcome"] != "error"]
        row.update({
            "requests_e2e": len(requests),
            "e2e_disagreements": int((~judged["agree"]).sum()),
            "e2e_disagreement_rate": float((~judged["agree"]).mean()) if len(judged) else math.nan,
            "e2e_outcome_disagreements": int((~judged["outcome_agree"]).sum()),
            "attempt_count_disagreements": int((~judged["attempts_agree"]).sum()),
            "live_attempts": int(requests["live_attempts"].sum()),
            "sim_attempts": int(requests["sim_attempts"].sum()),
            "live_abandoned_e2e": int(requests["live_outcome"].eq("abandoned").sum()),
            "sim_abandoned_e2e": int(requests["sim_outcome"].eq("abandoned").sum()),
        })
    return {k: float(v) for k, v in row.items()}


@dataclass(frozen=True)
class Comparison:
    joined: pd.DataFrame
    confusion: pd.DataFrame
    summary: dict[str, float]
    reasons: pd.DataFrame | None = None
    # Per request, end to end (:func:`per_request`): runs whose clients gave up or retried.
    requests: pd.DataFrame | None = None
    first_divergence: dict | None = None  # :func:`first_divergence`


def has_clients(run: pd.DataFrame) -> bool:
    """Whether the run's clients could give up or retry: a patience, or a retry policy that retries."""
    patient = "patience_s" not in run.columns or not np.isfinite(run["patience_s"].to_numpy(float)).any()
    return not patient or _retrying(run)[1]


def compare(run: pd.DataFrame, origin: str = "server") -> Comparison:
    """Replay the run in the simulator (arrivals the gate's by default, see :func:`arrival_times`) and join."""
    joined = join(run, *_replay(run, origin))
    requests = per_request(run, joined) if has_clients(run) else None
    return Comparison(joined, confusion(joined), summarize(joined, measured_speed(run), requests), reasons(joined),
                      requests, first_divergence(joined))


# ---------------------------------------------------------------- prediction

#: Metrics a prediction is judged on (analysis.metrics.summary's names).
PREDICTED = ("share_good", "goodput_rps", "latency_p50_s", "latency_p99_s")
#: Metrics predicted only where the run measured them: the time to the first token needs a streamed answer
#: (``qlab replay --api openai``); a run through ``/v1/generate`` has no live figure to compare with.
PREDICTED_WHERE_MEASURED = ("ttft_p99_s",)
#: What the model-only prediction should reach on a live run (issue 22; BLIS reports 9.2 % and 29 %, Vidur under
#: 9 %): the most relative error of the mean over seeds, per metric.
PREDICTION_TARGETS = {"share_good": 0.05, "goodput_rps": 0.05, "latency_p99_s": 0.10, "ttft_p99_s": 0.15}
#: What the per-request replay of a live run ("with what the gate knew") should reach: the most share of the
#: requests the service handled on whose outcome the simulator disagrees (issue 22).
REPLAY_DISAGREEMENT_TARGET = 0.005


@dataclass(frozen=True)
class Prediction:
    table: pd.DataFrame  # one row per metric: live, sim mean, intervals, error
    per_seed: pd.DataFrame  # one row per seed: the metrics
    speed: float
    speed_source: str
    noise_cv: float
    noise_source: str = "given"
    concurrency: float = math.nan  # the engines' slowdown per other busy one (NaN: not engines one at a time)

    def within_targets(self) -> dict[str, bool | None]:
        """Per metric of :data:`PREDICTION_TARGETS` that the prediction holds (the time to the first token only
        where the run measured it): whether its relative error is within the target (None: no error to judge,
        e.g. nothing answered live)."""
        errors = self.table["relative_error"]
        return {m: None if not math.isfinite(errors[m]) else bool(abs(errors[m]) <= target)
                for m, target in PREDICTION_TARGETS.items() if m in errors.index}

    def verdict(self) -> str:
        """PASS when every judged metric is within its target, MISS when one is not, n/a when one has no error to
        judge."""
        within = self.within_targets()
        return "n/a" if None in within.values() else "PASS" if all(within.values()) else "MISS"


#: The noise CV a prediction assumes where neither the caller nor the run file says (an older run file, a GPT-2
#: engine, a server that is not a qlab gate).
DEFAULT_NOISE_CV = 0.1


def prediction_speed(run: pd.DataFrame) -> tuple[float, str]:
    """The speed the prediction runs at, and where it came from: the synthetic engine's own speed setting where
    the run file recorded it (its times are the model's x that, exactly; a probe of a few requests would measure
    it through their noise); else a probe before the run where the run file has one; else the gate's speed
    factor at the run's start."""
    engine = engine_info(run) or {}
    schedule = speed_schedule(run)
    if engine.get("engine") == "synthetic" and schedule is not None:
        return schedule.base, "the synthetic engine's speed setting at the run's start (engine_info)"
    probed = speed_probe(run)
    if math.isfinite(probed):
        return probed, "probed before the run (speed_before)"
    return (run_setup(run).initial_speed_factor,
            "the server's speed factor at the run's start (the run file has no probe: "
            "qlab replay --probe N records one)")


def prediction_noise(run: pd.DataFrame, setup: ServerConfig | None = None) -> tuple[float, str]:
    """The CV of the lognormal noise on each modelled service time, and where it came from: the synthetic engine's
    noise setting (``qlab serve --noise``) where the run file recorded it; else the calibrated CV of the server's
    engines (``qlab calibrate`` under load, :attr:`qsim.engines.OneAtATime.cv` in the run's server config, or in
    ``setup`` where the caller gives the calibration); else :data:`DEFAULT_NOISE_CV`."""
    engine = engine_info(run)
    if engine is not None and engine.get("engine") == "synthetic" and engine.get("noise_cv") is not None:
        return float(engine["noise_cv"]), "the synthetic engine's noise setting (engine_info)"
    model = (setup or run_setup(run)).engine
    if isinstance(model, Batching):  # its requests' times are its steps': their spread is the step model's
        return model.step.cv, "the batching engine's step model CV (a gamma draw on each step; the server config's)"
    if isinstance(model, OneAtATime) and model.cv > 0:
        return model.cv, "the calibrated CV under load (qlab calibrate; the server config's engine)"
    if engine is None:
        return DEFAULT_NOISE_CV, (f"the default {DEFAULT_NOISE_CV:g}: the run file does not record its engine "
                                  "(an older qlab replay, or not a qlab gate); --noise-cv sets it")
    return DEFAULT_NOISE_CV, (f"the default {DEFAULT_NOISE_CV:g}: the {engine.get('engine', 'unnamed')} engine does "
                              "not say its noise and the server was not calibrated under load; --noise-cv or "
                              "--service-model sets it")


def step_speed(schedule: SpeedSchedule | None, speed: float) -> SpeedSchedule:
    """A batching engine's speed on the run's clock, as the simulator applies it to each step: its step model is
    the calibration's (fitted at speed 1), so a step takes the model's time x ``speed`` (the run's,
    :func:`prediction_speed`) x the schedule's later changes over its base. The simulator divides by the
    schedule's base (a one-at-a-time run's true times already carry it); here the base is the model's speed, 1."""
    base, later = (1.0, ()) if schedule is None else (schedule.base, schedule.steps)
    return SpeedSchedule(1.0, ((0.0, speed), *((t, speed * s / base) for t, s in later)))


def calibrated_setup(run: pd.DataFrame, terms: LoadTerms | None = None) -> ServerConfig:
    """The run's server, with the calibration's load terms in its engines (a run from a server that did not load
    them: an older calibration, or an older qlab serve), or a batching engine's fitted step model where the
    calibration has one; ``terms`` None: as the run file says (a batching gate's: the step model it planned with)."""
    setup = run_setup(run)
    if terms is not None and isinstance(setup.engine, Batching) and terms.step is not None:
        return setup.replace(engine=dataclasses.replace(setup.engine, step=terms.step))
    if terms is None or not isinstance(setup.engine, OneAtATime):
        return setup
    return setup.replace(engine=dataclasses.replace(setup.engine, concurrency=terms.concurrency,
                                                    cv=terms.noise_cv or 0.0))


def run_seconds(run: pd.DataFrame) -> float:
    """The run's arrival window (from the replay's metadata) else its makespan: goodput is per these seconds."""
    meta = run.attrs.get("qlab_run") if isinstance(run.attrs.get("qlab_run"), dict) else {}
    return run_duration(run, meta.get("duration_s"))


def predict(run: pd.DataFrame, seeds: int = 20, noise_cv: float | None = None, origin: str = "server",
            level: float = 0.95, terms: LoadTerms | None = None) -> Prediction:
    """Simulate the run's arrivals with modelled service times over ``seeds`` seeds; compare the metrics.
    ``noise_cv`` None: what the run file says (:func:`prediction_noise`); ``terms``: a calibration's load terms in
    place of the run file's (:func:`calibrated_setup`). The engines' slowdown (their concurrency term) is the
    simulator's own, applied to each run as it starts."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    setup = calibrated_setup(run, terms)
    speed, source = prediction_speed(run)
    noise_cv, noise_source = (prediction_noise(run, setup) if noise_cv is None
                              else (float(noise_cv), "given (--noise-cv)"))
    schedule = speed_schedule(run)
    if isinstance(setup.engine, Batching):  # a batching engine draws its noise on each step, not on a request
        setup = setup.replace(engine=dataclasses.replace(setup.engine, step=dataclasses.replace(setup.engine.step,
                                                                                                cv=noise_cv)))
        schedule = step_speed(schedule, speed)  # and its steps, not its requests' true times, carry the speed
    _, retrying = _retrying(run)  # with retries the simulator's own clients send all but the first attempts
    ordered, arrival = _in_arrival_order(run, arrival_times(run, origin),
                                         run["attempt"].eq(1).to_numpy() if retrying else None)
    faults = _client_faults(run, ordered, arrival)
    base = ordered["calibrated_est_s"].to_numpy(float)
    seconds = run_seconds(run)
    live = summary(run, seconds)
    metrics = PREDICTED + tuple(m for m in PREDICTED_WHERE_MEASURED if math.isfinite(live[m]))
    rows = []
    for seed in range(seeds):
        true = base * speed * lognormal_noise(np.random.default_rng(seed), len(base), noise_cv)
        # The server's own draws (a batching engine's step noise, a randomised rule's) from this seed too: with
        # the run's seed alone every seed drew the same steps, and the interval across seeds was too narrow.
        got = summary(_simulate(ordered, arrival, setup.replace(seed=setup.seed + seed), true, "predicted",
                                generated_tokens(run, ordered), schedule, **faults), seconds)
        rows.append({"seed": seed, **{m: got[m] for m in metrics}})
    per_seed = pd.DataFrame(rows)
    table = []
    for m in metrics:
        mean, low, high = mean_ci(per_seed[m], level)
        values = per_seed[m].dropna()
        lo_q, hi_q = (values.quantile(0.025), values.quantile(0.975)) if len(values) else (math.nan, math.nan)
        error = mean - live[m]
        table.append({"metric": m, "live": live[m], "sim_mean": mean, "ci_low": low, "ci_high": high,
                      "seeds_p2_5": lo_q, "seeds_p97_5": hi_q, "error": error,
                      "relative_error": error / live[m] if live[m] else math.nan,
                      "live_within_seeds": bool(lo_q <= live[m] <= hi_q)})
    concurrency = setup.engine.concurrency if isinstance(setup.engine, OneAtATime) else math.nan
    return Prediction(pd.DataFrame(table).set_index("metric"), per_seed, speed, source, noise_cv, noise_source,
                      concurrency)


def figure(result: Comparison, path: str | Path) -> None:
    """Three panels: the confusion heatmap (with refusal reasons agreeing), the distribution of latency
    errors (sim - live) of requests both answered, and disagreements over the run's time, independent
    and cascade, with the first divergence marked and its cause named."""
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
        cause = "" if result.first_divergence is None else f" ({result.first_divergence['cause']})"
        right.axvline(s["first_divergence_s"], color="tab:orange", linestyle="--",
                      label=f"first divergence {s['first_divergence_s']:.2f} s{cause}")
    right.set_xlabel("arrival at the gate (s)")
    right.set_ylabel("disagreements so far")
    right.legend(fontsize=8, loc="upper left")
    right.set_title(f"independent (same queue at arrival) vs cascade; by cause: rule {int(s['rule_disagreements'])}, "
                    f"timing {int(s['timing_disagreements'])}, unknown {int(s['unknown_cause_disagreements'])}",
                    fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
