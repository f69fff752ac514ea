"""The one SimPy driver of a run: what every simulation shares, whatever its engines.

:class:`Simulation` owns the per-request lists (what a run reads and what it writes), the
arrival process that hands each request to the queue core, what the core decided on at
admission, the clients' timers (patience, a retry policy's timeout), the retries (a row each)
and the records. What differs between engine models is an *engine part* chosen from the
config (:func:`qsim.model.engine_part`): engines one at a time (:mod:`qsim.run_one_at_a_time`) or a
batching engine's steps (:mod:`qsim.run_batching`). The part builds the queue core, runs what
it starts and writes its own columns; its protocol:

* ``queue``: the queue core the driver hands arrivals and cancellations to (one server's, or a
  :class:`qsim.fleet.Fleet`, which answers as one queue);
* ``attach()``: the driver's lists are made (the part may keep references to them);
* ``arms``: whether the part wants :meth:`arrived` after each arrival walk and
  :meth:`touched` after an admission or a cancellation (a batching engine's timers);
* ``per_attempt()``, ``rows()``: its own per-attempt lists, as the driver's;
* ``after_down(r, ran)``: replica r of a fleet went down, ending the rows ``ran`` that ran there;
* ``columns(trace, first, columns)``: its columns of the records, into ``columns``;

A fleet (:mod:`qsim.fleet`) is the queue core's concern: the driver notes each row's replica
(routed, or bound where it starts) and takes replicas down and up at their times.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import simpy
from simpy.events import Timeout

from . import records
from .clients import TIMEOUT_REASON, Retrier, status_of
from .config import ServerConfig
from .entry import Work
from .fleet import FleetSpec
from .outcomes import ABANDONED, ERROR, GOOD, LATE, REJECTED, Reason
from .policy import reads_basic
from .service import SpeedSchedule
from .trace import Trace

_NAN = math.nan
#: Reason of a request whose client left (outcome ``abandoned``).
LEFT_REASON = Reason.CLIENT_LEFT
#: Reason of a request whose engine raised (outcome ``error``), as the live gate says it.
FAILED_REASON = Reason.ENGINE_EXCEPTION
#: Reason of a request that waited at a fleet's replica when it went down (outcome ``error``).
DOWN_REASON = Reason.SHUTTING_DOWN


class Simulation:
    """One simulation: the records it writes, the arrivals and clients that drive the queue
    core, and the engine part that runs what the core starts."""

    def __init__(
        self,
        trace: Trace,
        config: ServerConfig,
        part: type,
        *,
        failed=None,
        reported_s=None,
        cancel_after_s=None,
        cancel_until: str = "answer",
        priority=None,
        client=None,
        retrier: Retrier | None = None,
        speed_schedule: SpeedSchedule | None = None,
        held: bool = False,
        step_times=None,
        fleet: FleetSpec | None = None,
    ) -> None:
        n = len(trace)
        self.env = simpy.Environment()
        self.spec = fleet
        self.replica_of = None if fleet is None else [-1] * n
        self.n = n
        # What a run takes beyond its true time: the machine's speed at its start, a cut at its
        # deadline.
        self.schedule = speed_schedule
        self.cuts = config.policy.cancel_at_deadline
        # The requests' token identities (prefix caching), by trace request: a retry's are its
        # first's.
        self.token_ids = trace.tokens
        self.engine = part(self, config, fleet, held=held, step_times=step_times)
        self.queue = queue = self.engine.queue
        # Python lists: element access in the event loop is several times faster than numpy's.
        self.arrival = trace.arrival_s.tolist()
        self.base_est = trace.est_service_s.tolist()
        self.true = trace.true_service_s.tolist()
        self.reported = (
            list(self.true) if reported_s is None else np.asarray(reported_s, dtype=float).tolist()
        )
        self.failed = (
            None
            if failed is None or not np.any(failed)
            else np.asarray(failed, dtype=bool).tolist()
        )
        self.deadline = queue.deadlines_of(trace.deadline_s)
        self.patience = None
        if cancel_after_s is not None and np.isfinite(cancel_after_s).any():
            self.patience = np.asarray(cancel_after_s, dtype=float).tolist()
        self.wait_only = cancel_until == "start"  # a client whose request has started stays
        self.priority = np.asarray(
            trace.priority if priority is None else priority, dtype=np.int64
        ).tolist()
        self.client = list(trace.client_id if client is None else client)
        self.est = [_NAN] * n
        self.outcome: list = [None] * n
        self.reason: list = [None] * n
        self.start = [_NAN] * n
        self.finish = [_NAN] * n
        self.queued_at_arrival = [0] * n
        self.queued_work = [_NAN] * n
        self.in_service_work = [_NAN] * n
        self.idle_at_arrival = [-1] * n
        self.retry_after = [-1] * n
        self.engine_of = [-1] * n
        self.next_arrival = 0
        # Retries: each attempt after the first is a row appended to every list above, sent at
        # its time.
        self.retrier = retrier
        self.first_of = list(range(n)) if retrier is not None else None
        self.attempt = [1] * n if retrier is not None else None
        self.timeout_s = (
            math.inf
            if retrier is None or retrier.policy.timeout_s is None
            else retrier.policy.timeout_s
        )
        if retrier is not None and self.patience is None:
            self.patience = [math.inf] * n
        if retrier is not None and self.failed is None:
            self.failed = [False] * n
        # Whether an admitted request's client can leave (a patience) or time out: most runs'
        # clients wait for good.
        self.client_timers = self.patience is not None or math.isfinite(self.timeout_s)
        self.ran = [_NAN] * n  # how long each run held its engine
        self.speed_at = [1.0] * n  # the schedule's speed over the trace's, at each start
        self.cut = [False] * n
        policy = config.policy
        self.objectives = policy.ttft_slo_s is not None or policy.tpot_slo_s is not None
        self.prompt_tokens, self.generated = trace.prompt_tokens, trace.tokens_generated
        # The estimator's inputs: each request's work (limit, prompt, tokens generated).
        self.work = None
        # A rule that reads more than the basic numbers may read the prompt (as the gate's does).
        if queue.estimator is not None or config.batching or not reads_basic(policy):
            self.work = list(
                map(
                    Work,
                    trace.max_new_tokens.tolist(),
                    trace.prompt_tokens.tolist(),
                    trace.tokens_generated.tolist(),
                )
            )
        self.arms = self.engine.arms
        self.engine.attach()
        if fleet is not None:
            # Each window's two ends, down windows first (the live gate's order too): a replica
            # down ends what it holds; draining ends nothing, the router only skips it.
            turns = (
                (fleet.down, self._replica_down, self.queue.restore),
                (fleet.drain, self.queue.drain, self.queue.end_drain),
            )
            for windows, begin, end in turns:
                for r, from_s, to_s in windows:
                    Timeout(self.env, from_s).callbacks.append(lambda _, r=r, f=begin: f(r))
                    Timeout(self.env, to_s).callbacks.append(
                        lambda _, r=r, f=end: f(r, self.env.now)
                    )

    # -- the core's hooks --------------------------------------------------------

    def _drop(
        self, i: int, now: float, outcome: str, reason: str, est: float, retry_after_s: int | None
    ) -> None:
        self._end(i, now, outcome, reason, -1 if retry_after_s is None else retry_after_s)

    def _routed(self, i: int, r: int) -> None:
        self.replica_of[i] = r

    def _end(
        self, i: int, now: float, outcome: str, reason: str | None, retry_after_s: int = -1
    ) -> None:
        self.outcome[i], self.reason[i] = outcome, reason
        self.finish[i] = now
        self.retry_after[i] = retry_after_s
        # A client that left is gone; one that timed out had no answer and may send again.
        if self.retrier is not None and (outcome != ABANDONED or reason == TIMEOUT_REASON):
            self._maybe_retry(i, now, status_of(outcome, reason), retry_after_s)

    def _replica_down(self, r: int) -> None:
        """Replica r fails: what ran there ends an engine's error, what waited there the error of
        a server that stopped while it waited (qsim.outcomes); a client may send either again."""
        now = self.env.now
        ran = []
        for i, state in self.queue.fail(r, now):
            self._end(i, now, ERROR, FAILED_REASON if state == "running" else DOWN_REASON)
            if state == "running":
                ran.append(i)
        self.engine.after_down(r, ran)

    # -- retries ----------------------------------------------------------------------

    def _maybe_retry(self, i: int, now: float, status: int | None, retry_after_s: int) -> None:
        first = self.first_of[i]
        sent = self.arrival[first]
        decision = self.retrier.after(
            first,
            self.attempt[i],
            sent,
            now,
            status,
            retry_after_s if retry_after_s >= 0 else None,
            self.patience[first],
        )
        if decision.at_s is None:
            return
        j = self._copy(i, decision.at_s)
        Timeout(self.env, decision.at_s - now).callbacks.append(
            lambda _, j=j: self._admit(j, self.arrival[j])
        )

    def _copy(self, i: int, at: float) -> int:
        """A new row: attempt i's request sent again at ``at``, with the patience it has left."""
        first = self.first_of[i]
        j = len(self.arrival)
        for values in (
            self.base_est,
            self.true,
            self.reported,
            self.failed,
            self.deadline,
            self.priority,
            self.client,
        ):
            values.append(values[i])
        if self.work is not None:
            self.work.append(self.work[i])
        self.arrival.append(at)
        self.patience.append(self.patience[first] - (at - self.arrival[first]))
        self.first_of.append(first)
        self.attempt.append(self.attempt[i] + 1)
        fleet = () if self.replica_of is None else ((self.replica_of, -1),)
        for values, missing in (
            (self.est, _NAN),
            (self.outcome, None),
            (self.reason, None),
            (self.start, _NAN),
            (self.finish, _NAN),
            (self.queued_at_arrival, 0),
            (self.queued_work, _NAN),
            (self.in_service_work, _NAN),
            (self.idle_at_arrival, -1),
            (self.retry_after, -1),
            (self.engine_of, -1),
            (self.ran, _NAN),
            (self.speed_at, 1.0),
            (self.cut, False),
            *self.engine.per_attempt(),
            *fleet,
        ):
            values.append(missing)
        return j

    def _rows(self) -> dict:
        """Every per-request (or per-attempt) sequence by name, what the run reads and what it
        writes (None: this run has none): a streamed run (:mod:`qsim.stream`) keeps them as a
        window of slots."""
        rows = {
            "arrival": self.arrival,
            "base_est": self.base_est,
            "true": self.true,
            "reported": self.reported,
            "failed": self.failed,
            "deadline": self.deadline,
            "patience": self.patience,
            "priority": self.priority,
            "client": self.client,
            "work": self.work,
            "first_of": self.first_of,
            "attempt": self.attempt,
            "prompt_tokens": self.prompt_tokens,
            "generated": self.generated,
            "est": self.est,
            "outcome": self.outcome,
            "reason": self.reason,
            "start": self.start,
            "finish": self.finish,
            "queued_at_arrival": self.queued_at_arrival,
            "queued_work": self.queued_work,
            "in_service_work": self.in_service_work,
            "idle_at_arrival": self.idle_at_arrival,
            "retry_after": self.retry_after,
            "engine_of": self.engine_of,
            "ran": self.ran,
            "speed_at": self.speed_at,
            "cut": self.cut,
            **self.engine.rows(),
        }
        if self.replica_of is not None:
            rows["replica_of"] = self.replica_of
        return rows

    # -- events: plain SimPy timeouts with callbacks (a generator process per engine costs a
    # third more) --

    def arrivals(self, _event=None) -> None:
        """Hand every request due by now to the queue core, then wait for the next one."""
        env = self.env
        arrival = self.arrival
        i = self.next_arrival
        now = env.now
        while i < self.n:
            t = arrival[i]
            if t > now:
                self.next_arrival = i
                Timeout(env, t - now).callbacks.append(self.arrivals)
                break
            # The trace's own time: SimPy's clock reaches it as now + (t - now), which can be
            # off by a rounding, and a request that starts at once should show exactly zero wait.
            self._admit(i, t)
            i += 1
        else:
            self.next_arrival = i
        if self.arms:
            self.engine.arrived()

    def _admit(self, i: int, t: float) -> None:
        """Hand request (or attempt) i, sent at t, to the queue core and note what it decided
        on."""
        queue = self.queue
        refusal = queue.arrive(
            i,
            t,
            self.base_est[i],
            self.deadline[i],
            self.priority[i],
            self.client[i],
            None if self.work is None else self.work[i],
        )
        # What the decision was made on (queue.Seen's fields, in order), straight into the
        # record's columns.
        (
            self.est[i],
            self.queued_at_arrival[i],
            self.queued_work[i],
            _,
            self.in_service_work[i],
            self.idle_at_arrival[i],
        ) = queue.admission.seen_numbers
        if refusal is not None:
            self._end(
                i,
                t,
                REJECTED,
                refusal.reason,
                -1 if refusal.retry_after_s is None else refusal.retry_after_s,
            )
        elif self.client_timers:
            self._client_timers(i)
        if self.arms:
            self.engine.touched(i)

    def _client_timers(self, i: int) -> None:
        """Admitted request i's client leaves after its patience, or gives up on the attempt at
        the retry policy's timeout: a timer for each that can come."""
        patience = math.inf if self.patience is None else self.patience[i]
        # Started at once: a client whose patience is for waiting stays.
        if math.isfinite(patience) and not (self.wait_only and not math.isnan(self.start[i])):
            Timeout(self.env, patience).callbacks.append(lambda _, i=i: self._cancel(i))
        if self.timeout_s < patience or (self.wait_only and math.isfinite(self.timeout_s)):
            Timeout(self.env, self.timeout_s).callbacks.append(
                lambda _, i=i: self._cancel(i, TIMEOUT_REASON)
            )

    def _cancel(self, i: int, reason: str = LEFT_REASON) -> None:
        # Started: a patience while waiting is over.
        if not (reason == LEFT_REASON and self.wait_only and not math.isnan(self.start[i])):
            if self.queue.cancel(i, self.env.now) is not None:
                self._end(i, self.env.now, ABANDONED, reason)
        if self.arms:
            self.engine.touched(i)

    # -- the records ------------------------------------------------------------------

    def frame(self, trace: Trace) -> pd.DataFrame:
        return records.from_arrays(self._columns(trace))

    def _columns(self, trace: Trace) -> dict:
        # Each list becomes an array once: a conversion costs a plain run of 200,000 requests
        # ~15 ms a column.
        finish, arrival, start = (
            records.column(values, float) for values in (self.finish, self.arrival, self.start)
        )
        first = (
            trace.request_id if self.first_of is None else records.column(self.first_of, np.int64)
        )
        n = len(arrival)
        columns = {
            "request_id": np.arange(n, dtype=np.int64),
            "first_request_id": first,
            "attempt": np.ones(n, dtype=np.int64) if self.attempt is None else self.attempt,
            "arrival_s": arrival,
            "size_class": trace.size_class[first],
            "max_new_tokens": trace.max_new_tokens[first],
            "est_service_s": self.est,
            "true_service_s": trace.true_service_s[first] * records.column(self.speed_at, float),
            "deadline_s": self.deadline,
            "priority": self.priority,
            "client_id": self.client,  # records.from_arrays names a number client by its str
            "outcome": records.column(self.outcome, object),
            "reason": self.reason,
            "start_s": start,
            "finish_s": finish,
            "latency_s": finish - arrival,
            "queued_at_arrival": self.queued_at_arrival,
            "queued_work_at_arrival_s": self.queued_work,
            "in_service_work_at_arrival_s": self.in_service_work,
            "idle_at_arrival": self.idle_at_arrival,
            "retry_after_s": self.retry_after,
            "engine": self.engine_of,
            "replica": np.zeros(n, dtype=np.int64)
            if self.replica_of is None
            else records.column(self.replica_of, np.int64),
        }
        self.engine.columns(trace, first, columns)
        policy = self.queue.policy
        columns["ttft_slo_s"] = np.full(
            len(first), np.nan if policy.ttft_slo_s is None else policy.ttft_slo_s
        )
        columns["tpot_slo_s"] = np.full(
            len(first), np.nan if policy.tpot_slo_s is None else policy.tpot_slo_s
        )
        return columns

    def speed_factor(self) -> float:
        """The speed tracker's factor at the end of the run."""
        return self.queue.speed_factor if self.spec is not None else self.queue.tracker.factor


def answered(outcome: np.ndarray) -> np.ndarray:
    """Which records were answered (good or late; np.isin sorts: several times slower on
    objects)."""
    return (outcome == GOOD) | (outcome == LATE)
