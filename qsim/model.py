"""The SimPy driver of :class:`qsim.queue.AdmissionQueue`: K engines on a simulated clock.

The queue core holds every piece of queue state and applies the rules; this
module only turns its answers into SimPy events. One arrival process walks
the trace and hands each request to the core; each engine runs what the core
starts (a timeout of the request's true service time) and hands it back. Beside the study's model it can simulate what the live gate meets:

* engine failures (``failed``): the run holds the engine for its time, ends
  as an error and teaches the speed tracker nothing;
* what the engine reports (``reported_s``): the tracker learns this, while the
  engine is held for ``true_service_s`` (the live gate counts the engine busy
  until the answer is handed back to it, a little after the engine's own time);
* clients that leave (``cancel_after_s``, by default the trace's ``patience_s``):
  a waiting request leaves the queue with its work; a running one leaves its
  engine busy until it finishes. The patience counts to the whole answer
  (``cancel_until="answer"``, the default) or only to its start
  (``cancel_until="start"``: a client whose request has started stays, the
  patience-while-waiting of Erlang A and M/M/c+D);
* clients that send again (``retry``, a :class:`qsim.clients.RetryPolicy`): an
  attempt refused (503, 429) is sent again when :class:`qsim.clients.Retrier`
  says, as a new row (``attempt`` 2, 3, ... with its ``first_request_id``) that
  arrives like any other. Patience counts from the first send;
* requests that stop early (the trace's ``tokens_generated``): the engine takes
  their true time, and the policy's estimator (:mod:`qsim.estimators`) learns
  from the tokens each completion generated, as the gate's does;
* a machine whose speed changes (``speed_schedule``): a run takes its true time
  times the schedule's speed at its start, over the trace's own speed;
* cancelling at the deadline (``Policy.cancel_at_deadline``): a run that would pass
  its request's deadline is cut there (outcome ``cancelled``), freeing its engine;
* stalled engines (``stall``): a request that runs past its threshold ends as
  an error at that moment, and while every engine is stalled a watchdog ends
  waiting requests past their deadline, every ``watch_interval_s`` as the gate's does.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import simpy
from simpy.events import Timeout

from . import records
from .clients import TIMEOUT_REASON, Retrier, RetryPolicy, status_of
from .config import ServerConfig, StallRule, as_config  # noqa: F401 (StallRule: re-exported)
from .entry import Work
from .outcomes import ABANDONED, ANSWERED, CANCELLED, ERROR, GOOD, LATE, REJECTED, Reason
from .policy import Policy, reads_basic
from .batch import BatchQueue
from .batch_fleet import CentralBatch
from .prefix import Tokens
from .queue import CUT_REASON, STALL_REASON, AdmissionQueue
from .fleet import Fleet, FleetSpec, offset
from .routers import RoundRobin, Router
from .service import SpeedSchedule
from .trace import Trace

_NAN = math.nan
#: Reason of a request whose client left (outcome ``abandoned``).
LEFT_REASON = Reason.CLIENT_LEFT
#: What a client's patience (``cancel_after_s``) waits for: its answer to start, or the whole answer.
CANCEL_UNTIL = ("answer", "start")
#: Reason of a request whose engine raised (outcome ``error``), as the live gate says it.
FAILED_REASON = Reason.ENGINE_EXCEPTION
#: Reason of a request that waited at a fleet's replica when it went down (outcome ``error``).
DOWN_REASON = Reason.SHUTTING_DOWN


class _Simulation:
    """One simulation: the records it writes, and the processes that drive the queue core."""

    def __init__(self, trace: Trace, config: ServerConfig, *, failed=None, reported_s=None,
                 cancel_after_s=None, cancel_until: str = "answer", priority=None, client=None,
                 retrier: Retrier | None = None, speed_schedule: SpeedSchedule | None = None,
                 held: bool = False) -> None:
        n = len(trace)
        self.env = simpy.Environment()
        self.queue = self._make_queue(config)
        engines = config.engines
        # Python lists: element access in the event loop is several times faster than numpy's.
        self.arrival = trace.arrival_s.tolist()
        self.base_est = trace.est_service_s.tolist()
        self.true = trace.true_service_s.tolist()
        self.reported = list(self.true) if reported_s is None else np.asarray(reported_s, dtype=float).tolist()
        self.failed = None if failed is None or not np.any(failed) else np.asarray(failed, dtype=bool).tolist()
        self.deadline = self.queue.deadlines_of(trace.deadline_s)
        self.patience = None
        if cancel_after_s is not None and np.isfinite(cancel_after_s).any():
            self.patience = np.asarray(cancel_after_s, dtype=float).tolist()
        self.wait_only = cancel_until == "start"  # a client whose request has started stays
        self.priority = np.asarray(trace.priority if priority is None else priority, dtype=np.int64).tolist()
        self.client = list(trace.client_id if client is None else client)
        self.watch_interval_s = config.watch_interval_s
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
        # The driver's hand-off to each engine process (what the gate's engine threads get in their inbox).
        self.job = [-1] * engines
        self.finishing = -1  # the engine whose finish is being handled
        self.next_arrival = 0
        self.n = n
        self.watching = False
        # Retries: each attempt after the first is a row appended to every list above, sent at its time.
        self.retrier = retrier
        self.first_of = list(range(n)) if retrier is not None else None
        self.attempt = [1] * n if retrier is not None else None
        self.timeout_s = math.inf if retrier is None or retrier.policy.timeout_s is None else retrier.policy.timeout_s
        if retrier is not None and self.patience is None:
            self.patience = [math.inf] * n
        if retrier is not None and self.failed is None:
            self.failed = [False] * n
        # Whether an admitted request's client can leave (a patience) or time out: most runs' clients wait for good.
        self.client_timers = self.patience is not None or math.isfinite(self.timeout_s)
        # What a run takes beyond its true time: the machine's speed at its start, a cut at its deadline.
        self.schedule = speed_schedule
        self.cuts = config.policy.cancel_at_deadline
        # Engines that slow each other (OneAtATime.concurrency): a run takes its time x the core's slowdown.
        # A live run's replay (held) gives each run the time it held its engine, the slowdown already in it.
        self.shared = not config.batching and config.engine.concurrency > 0 and not held
        self.plain = speed_schedule is None and not self.cuts and not self.shared
        self.ran = [_NAN] * n  # how long each run held its engine
        self.speed_at = [1.0] * n  # the schedule's speed over the trace's, at each start
        self.cut = [False] * n
        policy = config.policy
        self.objectives = policy.ttft_slo_s is not None or policy.tpot_slo_s is not None
        self.prompt_tokens, self.generated = trace.prompt_tokens, trace.tokens_generated
        # The estimator's inputs: each request's work (limit, prompt, tokens generated) and what it generated.
        self.work = None
        # A rule that reads more than the basic numbers may read the prompt (as the gate's does).
        if self.queue.estimator is not None or config.batching or not reads_basic(policy):
            self.work = list(map(Work, trace.max_new_tokens.tolist(), trace.prompt_tokens.tolist(),
                                 trace.tokens_generated.tolist()))

    def _make_queue(self, config: ServerConfig):
        return AdmissionQueue(config, start=self._start, drop=self._drop)

    # -- the core's hooks --------------------------------------------------------

    def _start(self, k: int, i: int, now: float, est: float) -> None:
        self.start[i] = now
        self.engine_of[i] = k
        self.job[k] = i
        run = self.true[i] if self.plain else self._run_time(k, i, now)
        self.ran[i] = run
        if run > self.queue.stall_after_s[k]:  # it will run past its threshold: the watchdog sees it then
            Timeout(self.env, self.queue.stall_after_s[k]).callbacks.append(lambda _, k=k, i=i: self._stall(k, i))
        if self.finishing == k:  # the engine goes straight on to its next request
            Timeout(self.env, run, k).callbacks.append(self._finished)
        else:  # an idle engine wakes first: a same-time arrival is looked at before its run is scheduled
            Timeout(self.env, 0, k).callbacks.append(self._run)

    def _drop(self, i: int, now: float, outcome: str, reason: str, est: float, retry_after_s: int | None) -> None:
        self._end(i, now, outcome, reason, -1 if retry_after_s is None else retry_after_s)

    def _end(self, i: int, now: float, outcome: str, reason: str | None, retry_after_s: int = -1) -> None:
        self.outcome[i], self.reason[i] = outcome, reason
        self.finish[i] = now
        self.retry_after[i] = retry_after_s
        # A client that left is gone; one that timed out had no answer and may send again.
        if self.retrier is not None and (outcome != ABANDONED or reason == TIMEOUT_REASON):
            self._maybe_retry(i, now, status_of(outcome, reason), retry_after_s)

    # -- retries ----------------------------------------------------------------------

    def _maybe_retry(self, i: int, now: float, status: int | None, retry_after_s: int) -> None:
        first = self.first_of[i]
        sent = self.arrival[first]
        decision = self.retrier.after(first, self.attempt[i], sent, now, status,
                                      retry_after_s if retry_after_s >= 0 else None, self.patience[first])
        if decision.at_s is None:
            return
        j = self._copy(i, decision.at_s)
        Timeout(self.env, decision.at_s - now).callbacks.append(lambda _, j=j: self._admit(j, self.arrival[j]))

    def _copy(self, i: int, at: float) -> int:
        """A new row: attempt i's request sent again at ``at``, with the patience it has left."""
        first = self.first_of[i]
        j = len(self.arrival)
        for values in (self.base_est, self.true, self.reported, self.failed, self.deadline, self.priority, self.client):
            values.append(values[i])
        if self.work is not None:
            self.work.append(self.work[i])
        self.arrival.append(at)
        self.patience.append(self.patience[first] - (at - self.arrival[first]))
        self.first_of.append(first)
        self.attempt.append(self.attempt[i] + 1)
        for values, missing in ((self.est, _NAN), (self.outcome, None), (self.reason, None), (self.start, _NAN),
                                (self.finish, _NAN), (self.queued_at_arrival, 0), (self.queued_work, _NAN),
                                (self.in_service_work, _NAN), (self.idle_at_arrival, -1),
                                (self.retry_after, -1), (self.engine_of, -1), (self.ran, _NAN),
                                (self.speed_at, 1.0), (self.cut, False), *self._per_attempt()):
            values.append(missing)
        return j

    def _per_attempt(self) -> tuple:
        """A driver's own per-attempt lists, with the value a new attempt starts with."""
        return ()

    def _rows(self) -> dict:
        """Every per-request (or per-attempt) sequence by name, what the run reads and what it writes (None: this run
        has none): a streamed run (:mod:`qsim.stream`) keeps them as a window of slots."""
        return {
            "arrival": self.arrival, "base_est": self.base_est, "true": self.true, "reported": self.reported,
            "failed": self.failed, "deadline": self.deadline, "patience": self.patience, "priority": self.priority,
            "client": self.client, "work": self.work, "first_of": self.first_of, "attempt": self.attempt,
            "prompt_tokens": self.prompt_tokens, "generated": self.generated, "est": self.est,
            "outcome": self.outcome, "reason": self.reason, "start": self.start, "finish": self.finish,
            "queued_at_arrival": self.queued_at_arrival, "queued_work": self.queued_work,
            "in_service_work": self.in_service_work, "idle_at_arrival": self.idle_at_arrival,
            "retry_after": self.retry_after, "engine_of": self.engine_of, "ran": self.ran, "speed_at": self.speed_at,
            "cut": self.cut,
        }

    # -- events: plain SimPy timeouts with callbacks (a generator process per engine costs a third more) --

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
                return
            # The trace's own time: SimPy's clock reaches it as now + (t - now), which can be off by
            # a rounding, and a request that starts at once should show exactly zero wait.
            self._admit(i, t)
            i += 1
        self.next_arrival = i

    def _admit(self, i: int, t: float) -> None:
        """Hand request (or attempt) i, sent at t, to the queue core and note what it decided on."""
        queue = self.queue
        refusal = queue.arrive(i, t, self.base_est[i], self.deadline[i], self.priority[i], self.client[i],
                               None if self.work is None else self.work[i])
        # What the decision was made on (queue.Seen's fields, in order), straight into the record's columns.
        (self.est[i], self.queued_at_arrival[i], self.queued_work[i], _, self.in_service_work[i],
         self.idle_at_arrival[i]) = queue.admission.seen_numbers
        if refusal is not None:
            self._end(i, t, REJECTED, refusal.reason,
                      -1 if refusal.retry_after_s is None else refusal.retry_after_s)
        elif self.client_timers:
            self._client_timers(i)

    def _client_timers(self, i: int) -> None:
        """Admitted request i's client leaves after its patience, or gives up on the attempt at the retry policy's
        timeout: a timer for each that can come."""
        patience = math.inf if self.patience is None else self.patience[i]
        if math.isfinite(patience) and not (self.wait_only and not math.isnan(self.start[i])):  # started at once: it stays
            Timeout(self.env, patience).callbacks.append(lambda _, i=i: self._cancel(i))
        if self.timeout_s < patience or (self.wait_only and math.isfinite(self.timeout_s)):
            Timeout(self.env, self.timeout_s).callbacks.append(lambda _, i=i: self._cancel(i, TIMEOUT_REASON))

    def _run_time(self, k: int, i: int, now: float) -> float:
        """How long request i holds engine k from ``now``: its true time at the machine's speed then (and slowed by
        the engines busy beside it), up to its deadline where the core cuts it there."""
        run = self.true[i]
        if self.schedule is not None:
            self.speed_at[i] *= self.schedule.at(now) / self.schedule.base
        if self.shared:  # the busy engines' slowdown at its start, which the core set as it started it
            self.speed_at[i] *= self.queue.slow[k]
        run *= self.speed_at[i]
        if self.cuts:
            cut = self.queue.cut_after(k, now, run)
            if cut is not None:
                self.cut[i] = True
                return cut
        return run

    def _run(self, event) -> None:
        k = event._value
        Timeout(self.env, self.ran[self.job[k]], k).callbacks.append(self._finished)

    def _finished(self, event) -> None:
        k = event._value
        now = self.env.now
        i = self.job[k]
        if self.cut[i]:  # its deadline passed in service: stopped there, its engine free at once
            if self.queue.cut(k, now) is not None:
                self._end(i, now, CANCELLED, CUT_REASON)
            ok, tokens = False, None
        else:
            ok = self.failed is None or not self.failed[i]
            tokens = None if self.work is None else self.work[i].generated
        first = self._first_token_at(i) if self.objectives else _NAN
        self.finishing = k
        outcome = self.queue.finished(k, now, self.reported[i] * self.speed_at[i], ok, tokens, first)  # may start k's next
        self.finishing = -1
        if outcome is not None:
            self._end(i, now, outcome, None if ok else FAILED_REASON)

    def _first_token_at(self, i: int) -> float:
        """When run i's first token came: its start plus the calibrated line's share of the first token (fixed and
        prompt terms and one token) of the time it ran (what frame() writes as ttft_s, by the same operations)."""
        model = self.queue.config.model
        first = self.first_of[i] if self.first_of is not None else i
        prompt, tokens = int(self.prompt_tokens[first]), int(self.generated[first])
        return self.start[i] + self.ran[i] * (float(model.estimate(1, prompt)) / float(model.estimate(tokens, prompt)))

    def _cancel(self, i: int, reason: str = LEFT_REASON) -> None:
        if reason == LEFT_REASON and self.wait_only and not math.isnan(self.start[i]):
            return  # started: its patience while waiting is over
        if self.queue.cancel(i, self.env.now) is not None:
            self._end(i, self.env.now, ABANDONED, reason)

    def _stall(self, k: int, i: int) -> None:
        now = self.env.now
        if self.queue.stall(k, now) == i:
            self._end(i, now, ERROR, STALL_REASON)
        if self.queue.all_stalled and not self.watching:
            self.watching = True
            self.env.process(self._watchdog())

    def _watchdog(self):
        """While every engine is stalled, end the hopeless waiting, as the gate's watchdog does."""
        while self.queue.all_stalled:
            yield self.env.timeout(self.watch_interval_s)
            self.queue.give_up(self.env.now)
        self.watching = False

    def frame(self, trace: Trace) -> pd.DataFrame:
        return records.from_arrays(self._columns(trace))

    def _columns(self, trace: Trace) -> dict:
        # Each list becomes an array once: a conversion costs a plain run of 200,000 requests ~15 ms a column.
        finish, arrival, start = (records.column(values, float) for values in (self.finish, self.arrival, self.start))
        first = trace.request_id if self.first_of is None else records.column(self.first_of, np.int64)
        columns = {
            "request_id": np.arange(len(arrival), dtype=np.int64),
            "first_request_id": first,
            "attempt": np.ones(len(arrival), dtype=np.int64) if self.attempt is None else self.attempt,
            "arrival_s": arrival,
            "size_class": trace.size_class[first],
            "max_new_tokens": trace.max_new_tokens[first],
            "est_service_s": self.est,
            "true_service_s": trace.true_service_s[first] * records.column(self.speed_at, float),
            "deadline_s": self.deadline,
            "priority": self.priority,
            "client_id": self.client,  # records.from_arrays names a client given as a number by its str
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
            "replica": self._replicas(len(arrival)),
        }
        columns.update(self._token_columns(trace, first, columns))
        return columns

    def _replicas(self, n: int) -> np.ndarray:
        """The replica each row went to: the one server's, 0."""
        return np.zeros(n, dtype=np.int64)

    def speed_factor(self) -> float:
        """The speed tracker's factor at the end of the run."""
        return self.queue.tracker.factor

    def _token_columns(self, trace: Trace, first: np.ndarray, columns: dict) -> dict:
        """ttft_s, tpot_s, output_tokens, preemptions and the objectives of answered runs, engines one at a time
        (from the record's other ``columns``, arrays): the first token comes after the calibrated line's share of
        the first token of the time the run took."""
        model = self.queue.config.model
        prompt, tokens = trace.prompt_tokens[first], trace.tokens_generated[first]
        outcome, arrival, finish = columns["outcome"], columns["arrival_s"], columns["finish_s"]
        answered = (outcome == GOOD) | (outcome == LATE)  # np.isin sorts: several times slower on objects
        share = np.asarray(model.estimate(np.ones_like(tokens), prompt), dtype=float) / \
            np.asarray(model.estimate(tokens, prompt), dtype=float)
        first_token = columns["start_s"] + records.column(self.ran, float) * share
        many = answered & (tokens > 1)
        policy = self.queue.policy
        return {
            "ttft_s": np.where(answered, first_token - arrival, np.nan),
            "tpot_s": np.where(many, (finish - first_token) / np.maximum(tokens - 1, 1), np.nan),
            "output_tokens": np.where(answered, tokens, -1),
            "preemptions": np.where(answered, 0, -1),
            "ttft_slo_s": np.full(len(first), np.nan if policy.ttft_slo_s is None else policy.ttft_slo_s),
            "tpot_slo_s": np.full(len(first), np.nan if policy.tpot_slo_s is None else policy.tpot_slo_s),
        }


class _BatchSimulation(_Simulation):
    """A batching engine on SimPy's clock: one event per step (its time the step model's, times a gamma draw of
    mean 1 and the model's ``cv`` where set, times the machine's speed), and one per deadline the core cuts at."""

    def _make_queue(self, config: ServerConfig):
        self.noise, self.slow = [], []  # each engine's step noise (None: none) and slowness
        self.timer_at = []  # each engine's timer armed (inf: none)
        queue = self._batch_line(0, config)
        self.lines = [queue]  # the engines, by the index their steps' events carry
        return queue

    def _batch_line(self, r: int, config: ServerConfig, slow: float = 1.0,
                    make=BatchQueue) -> BatchQueue:
        """Engine r's queue core (``make``'s: a BatchQueue, or a central queue's replica), its
        hooks carrying r; its steps take ``slow`` x the model's."""
        caching = config.engine.prefix_caching
        queue = make(config, step=lambda plan, now: self._step(plan, now, r), end=self._ended,
                     drop=self._drop, joined=lambda i, now: self._joined(i, now, r),
                     wake=lambda now: self._wake(now, r), tokens=self._tokens if caching else None)
        cv = config.engine.step.cv
        noise = None
        if cv > 0:  # a stream of its own, from the server's seed: the same draws under every policy
            # Engine 0's is the one server's stream: a fleet of one runs as the server.
            key = [config.seed, 7919] + ([r] if r else [])
            rng, shape = np.random.default_rng(key), 1.0 / cv**2
            noise = lambda: rng.gamma(shape, 1.0 / shape)  # noqa: E731
        self.noise.append(noise)
        self.slow.append(slow)
        self.timer_at.append(math.inf)
        return queue

    def __init__(self, trace: Trace, config: ServerConfig, step_times=None, **inputs) -> None:
        # The requests' token identities (prefix caching), by trace request: a retry's are its
        # first's.
        self.token_ids = trace.tokens
        super().__init__(trace, config, **inputs)
        self.step_times = step_times  # (seconds it ran, seconds the tracker learns) of each step, in order
        self.steps_run = 0
        self.step_reported = None
        self.step_model_after = None
        n = self.n
        self.first_token, self.tokens = [_NAN] * n, [-1] * n
        self.preempted, self.kv_peak, self.cached = [-1] * n, [-1] * n, [-1] * n

    def _per_attempt(self) -> tuple:
        return ((self.first_token, _NAN), (self.tokens, -1), (self.preempted, -1),
                (self.kv_peak, -1), (self.cached, -1))

    def _rows(self) -> dict:
        return {**super()._rows(), "first_token": self.first_token, "tokens": self.tokens, "preempted": self.preempted,
                "kv_peak": self.kv_peak, "cached": self.cached}

    def _tokens(self, i: int) -> Tokens:
        """Request (or attempt) i's tokens: the trace's, else its own prompt shared with nobody."""
        first = i if self.first_of is None else self.first_of[i]
        if self.token_ids is not None:
            return self.token_ids[first]
        return Tokens.unique(first, int(self.prompt_tokens[first]))

    def arrivals(self, _event=None) -> None:
        super().arrivals(_event)
        self._arm()

    def _admit(self, i: int, t: float) -> None:
        super()._admit(i, t)
        if (r := self._engine_at(i)) >= 0:
            self._arm(r)

    def _cancel(self, i: int, reason: str = LEFT_REASON) -> None:
        super()._cancel(i, reason)
        if (r := self._engine_at(i)) >= 0:
            self._arm(r)

    def _engine_at(self, i: int) -> int:
        """The engine whose line request (or attempt) i was handed to (-1: none, a central
        queue's that has not started)."""
        return 0

    # -- the core's hooks --------------------------------------------------------------

    def _joined(self, i: int, now: float, r: int = 0) -> None:
        self.start[i], self.engine_of[i] = now, r

    def _wake(self, now: float, r: int = 0) -> None:
        # An idle engine wakes on a zero timeout: arrivals at this same instant join its first step. A live run's
        # step began as long after its wake as the gate took (a replay): arrivals in between join it too.
        k = self.steps_run
        wait = self.step_times[k][0] if self.step_times is not None and k < len(self.step_times) else 0
        Timeout(self.env, wait, r).callbacks.append(self._begin)

    def _begin(self, event) -> None:
        self.lines[event._value].begin(self.env.now)
        self._arm(event._value)

    def _step(self, plan, now: float, r: int = 0) -> None:
        k = self.steps_run
        self.steps_run += 1
        if self.step_times is not None and k < len(self.step_times):  # a live run's step, as it ran (a replay)
            _, run, self.step_reported, *after = self.step_times[k]
            self.step_model_after = after[0] if after else None
        else:
            run = plan.model_s
            if self.noise[r] is not None:
                run *= self.noise[r]()
            if self.schedule is not None:
                run *= self.schedule.at(now) / self.schedule.base
            if self.slow[r] != 1.0:  # a slower replica (FleetSpec.speeds): its tracker learns it
                run *= self.slow[r]
        Timeout(self.env, run, r).callbacks.append(self._step_done)

    def _step_done(self, event) -> None:
        reported, self.step_reported = self.step_reported, None  # step_done plans (and sets) the next step's
        line = self.lines[event._value]
        if self.step_model_after is not None:  # the live gate took a new step model here (a replay)
            line.model, self.step_model_after = self.step_model_after, None
        line.step_done(self.env.now, reported)
        self._arm(event._value)

    def _ended(self, i: int, now: float, outcome: str, reason: str | None, stats) -> None:
        self.first_token[i], self.tokens[i] = stats.first_token_s, stats.tokens
        self.preempted[i], self.kv_peak[i] = stats.preemptions, stats.kv_blocks_peak
        self.cached[i] = stats.cached_tokens
        self.ran[i] = now - stats.start_s
        self._end(i, now, outcome, reason)

    # -- the core's timers (cutting at the deadline) ----------------------------------------

    # Each engine's line has a timer of its own, armed where that line changed: a fleet's event
    # costs the same whatever its number of replicas (a timer over all of them would read every
    # line at every event).
    def _arm(self, r: int = 0) -> None:
        due = self.lines[r].next_timer()
        if due < self.timer_at[r]:
            self.timer_at[r] = due
            Timeout(self.env, max(0.0, due - self.env.now)).callbacks.append(
                lambda _, due=due: self._timer(r, due))

    def _timer(self, r: int, due: float) -> None:
        if due != self.timer_at[r]:
            return  # an earlier one was set since, and has run
        self.timer_at[r] = math.inf
        self.lines[r].timer(self.env.now)
        self._arm(r)

    def _columns(self, trace: Trace) -> dict:
        columns = super()._columns(trace)
        arrival, finish = columns["arrival_s"], columns["finish_s"]
        first_token, tokens = np.asarray(self.first_token), np.asarray(self.tokens)
        answered = np.isin(columns["outcome"], ANSWERED)
        many = answered & (tokens > 1)
        columns.update({
            "true_service_s": np.asarray(self.ran),  # how long it was in the batch
            "ttft_s": first_token - arrival,
            "tpot_s": np.where(many, (finish - first_token) / np.maximum(tokens - 1, 1), np.nan),
            "output_tokens": tokens,
            "preemptions": np.asarray(self.preempted),
            "kv_blocks_peak": np.asarray(self.kv_peak),
            "cached_prompt_tokens": np.asarray(self.cached),  # -1 (NA) without a prefix cache
        })
        return columns


class _InFleet:
    """What a fleet's driver adds to one server's (:mod:`qsim.fleet`): the fleet answers as one
    queue, each row notes its replica. Mixed in before :class:`_Simulation` or :class:`_BatchSimulation`."""

    def __init__(self, trace: Trace, config: ServerConfig, fleet: FleetSpec, **inputs) -> None:
        self.spec = fleet
        self.replica_of = [-1] * len(trace)
        super().__init__(trace, config, **inputs)
        for r, down_s, up_s in fleet.down:
            Timeout(self.env, down_s).callbacks.append(lambda _, r=r: self._replica_down(r))
            Timeout(self.env, up_s).callbacks.append(
                lambda _, r=r: self.queue.restore(r, self.env.now))

    def _routed(self, i: int, r: int) -> None:
        self.replica_of[i] = r

    def _replica_down(self, r: int) -> None:
        """Replica r fails: what ran there ends an engine's error, what waited there the error of a
        server that stopped while it waited (qsim.outcomes); a client may send either again."""
        now = self.env.now
        for i, state in self.queue.fail(r, now):
            self._end(i, now, ERROR, FAILED_REASON if state == "running" else DOWN_REASON)
        self._after_down(r)

    def _after_down(self, r: int) -> None:
        """A driver's own bookkeeping after a replica went down."""

    def _per_attempt(self) -> tuple:
        return (*super()._per_attempt(), (self.replica_of, -1))

    def _rows(self) -> dict:
        return {**super()._rows(), "replica_of": self.replica_of}

    def _replicas(self, n: int) -> np.ndarray:
        return records.column(self.replica_of, np.int64)

    def speed_factor(self) -> float:
        return self.queue.speed_factor


class _FleetSimulation(_InFleet, _Simulation):
    """N replicas of one-at-a-time engines behind a router, engines numbered across the fleet."""

    def __init__(self, trace: Trace, config: ServerConfig, fleet: FleetSpec, **inputs) -> None:
        super().__init__(trace, config, fleet, **inputs)
        self.job = [-1] * self.queue.engines
        if fleet.speeds is not None:
            self.plain = False  # each run's time goes through _run_time, its replica's speed in

    def _make_queue(self, config: ServerConfig) -> Fleet:
        per = config.engines
        return Fleet(config, self.spec, routed=self._routed, line=lambda r, cfg: AdmissionQueue(
            cfg, start=offset(self._start, r * per), drop=self._drop))

    def _start(self, k: int, i: int, now: float, est: float) -> None:
        self.replica_of[i] = self.queue.replica_of_engine(k)  # a central queue binds here
        super()._start(k, i, now, est)

    def _run_time(self, k: int, i: int, now: float) -> float:
        # Its replica's speed, as a speed schedule's: the run and what the tracker learns take it.
        self.speed_at[i] = 1.0 / self.spec.speed(self.queue.replica_of_engine(k))
        return super()._run_time(k, i, now)


class _BatchFleetSimulation(_InFleet, _BatchSimulation):
    """N replicas, each a batching engine (its line, KV memory, prefix cache), behind a router or
    a central queue (qsim.batch_fleet): replica r is engine r, its steps' events carry r."""

    def _after_down(self, r: int) -> None:
        self._arm(r)  # the deadlines cut there are gone

    def _engine_at(self, i: int) -> int:
        return self.replica_of[i]

    def _joined(self, i: int, now: float, r: int = 0) -> None:
        self.replica_of[i] = r  # a central queue binds here (routed: where it was routed)
        super()._joined(i, now, r)

    def _make_queue(self, config: ServerConfig) -> Fleet:
        self.noise, self.slow, self.timer_at = [], [], []
        kind = CentralBatch if self.spec.router.shared else Fleet
        fleet = kind(config, self.spec, routed=self._routed,
                     line=lambda r, cfg, make=BatchQueue: self._batch_line(
                         r, cfg, 1.0 / self.spec.speed(r), make))
        self.lines = fleet.lines
        return fleet


def _check_tokens(trace: Trace) -> None:
    """A trace's token identities (Trace.tokens) must be as long as its prompts: a prefix cache hashes
    the one and the engine computes the other."""
    if len(trace.tokens) != len(trace):
        raise ValueError(f"trace tokens: {len(trace.tokens)} for {len(trace)} requests")
    for i, (tokens, prompt) in enumerate(zip(trace.tokens, trace.prompt_tokens.tolist())):
        if sum(length for _, length in tokens.prompt) != prompt:
            raise ValueError(f"request {i}: its tokens' segments do not add up to its {prompt} prompt "
                             "tokens")


def simulate(
    trace: Trace,
    config: ServerConfig | Policy = ServerConfig(),
    engines: int | None = None,
    *,
    failed=None,
    reported_s=None,
    cancel_after_s=None,
    cancel_until: str | None = None,
    priority=None,
    client=None,
    retry: RetryPolicy | None = None,
    retry_seed: int | None = None,
    retrier: Retrier | None = None,
    speed_schedule: SpeedSchedule | None = None,
    step_times=None,
    held: bool = False,
    replicas: int = 1,
    router: Router | None = None,
    replica_speeds=None,
    replica_down=(),
) -> pd.DataFrame:
    """Run ``trace`` through a server and return one record per request (see :mod:`qsim.records`).

    config: the server (:class:`qsim.config.ServerConfig`: policy, engine model, calibration, speed
    tracking, stall rule), or a bare Policy on ``engines`` engines (default 1) with the rest at its defaults.
    The rest are the run's inputs, per request in trace order: failed (bools), reported_s (the engine's
    own seconds, which the tracker learns; default the true service time), cancel_after_s (seconds after
    arrival at which the client leaves; NaN or inf: never; default the trace's patience_s), priority
    (ints, higher first under a priority discipline) and client (any hashable; the policy's per-client
    token bucket and fair share count by it); priority and client default to the trace's own.
    cancel_until: what the patience cancel_after_s waits for, "answer" (the client leaves at that time
    whether its request waits or runs) or "start" (it leaves only if its request has not started by then:
    patience while waiting); default what the trace's patience was drawn for (its meta's
    patience_until), else "answer". Either way a client that leaves ends its request ``abandoned``
    (reason client_left). retry: how clients send refused requests again (None or mode "none": never);
    each attempt is a row, with ``attempt`` and ``first_request_id``. retry_seed: the jitter's seed
    (default the trace's seed). retrier: the clients' state machine itself, in place of one built from
    ``retry`` (``qlab compare`` passes one that hears each answer when the live client did).
    speed_schedule: the machine's speed over time (:class:`qsim.service.SpeedSchedule`, base = the trace's
    speed): each run takes its true time x the speed at its start / base.
    step_times: a batching engine's steps as a live run's took them, in order (``qlab compare``'s replay): (seconds
    from an idle engine's wake to the step's start, seconds the step ran, seconds the speed tracker learns, and
    optionally the step model the live gate planned with from the next step on, or None) each; the steps after the
    last take the step model's.
    held: the true times are what each run held its engine live, the engines' slowdown
    (:attr:`qsim.engines.OneAtATime.concurrency`) already in them: the core still slows its
    estimates as the gate's did, the runs are not slowed again.
    replicas: N copies of the server (a fleet, :mod:`qsim.fleet`), each its own line, engines
    and admission, behind ``router`` (:mod:`qsim.routers`; required where N > 1); 1 (the default):
    the one server, whatever the router. Each row's ``replica`` says where it went. Replicas
    are one-at-a-time engines or batching engines, as ``config``'s engine is; behind router
    ``central`` they share one line, each request bound where it starts (:mod:`qsim.batch_fleet`
    for batching replicas; engines one at a time are one line of N x K engines, which takes no
    replica speeds and no replica down).
    replica_speeds: each replica's speed over the server's (0.5: its runs, or its steps, take
    twice as long; its speed tracker learns so); None: all as calibrated.
    replica_down: failures, (replica, from_s, to_s) each: at from_s what runs there ends
    ``error`` (engine_exception) and what waits there ``error`` (shutting_down); the router sends
    nothing there until to_s.
    The frame's ``attrs`` carry the run's duration_s, policy, engines and final speed factor
    (a batching engine's: its steps run too, all replicas' in a fleet);
    with a prefix cache (:attr:`qsim.engines.Batching.prefix_caching`), its counters too:
    prefix_cache_queries, prefix_cache_hits (in tokens, as vLLM's) and prefix_cache_evictions.
    """
    if isinstance(config, Policy):
        config = ServerConfig(config, 1 if engines is None else engines)
    elif engines is not None:
        raise ValueError("engines come from the ServerConfig; pass them there")
    config = as_config(config)
    if cancel_until is None:
        cancel_until = trace.meta.get("patience_until", "answer")
    if cancel_after_s is None:
        cancel_after_s = trace.patience_s
    if cancel_until not in CANCEL_UNTIL:
        raise ValueError(f"cancel_until must be one of {', '.join(CANCEL_UNTIL)}, got {cancel_until!r}")
    if len(trace) and np.any(np.diff(trace.arrival_s) < 0):
        raise ValueError("trace arrivals must be sorted by time")
    for name, values in (("failed", failed), ("reported_s", reported_s), ("cancel_after_s", cancel_after_s),
                         ("priority", priority), ("client", client)):
        if values is not None and np.shape(values) != (len(trace),):
            raise ValueError(f"{name} must have one value per request ({len(trace)}), got shape {np.shape(values)}")
    if retrier is None and retry is not None and retry.retries:
        seed = trace.meta.get("seed", 0) if retry_seed is None else retry_seed
        retrier = Retrier(retry, trace.arrival_s, seed)
    if config.batching and (failed is not None or reported_s is not None):
        raise ValueError("failures and reported times are per run: a batching engine's steps have neither here")
    if trace.tokens is not None:
        _check_tokens(trace)
    if step_times is not None and not config.batching:
        raise ValueError("step_times are a batching engine's steps: this server runs engines one at a time")
    batch = {"step_times": step_times} if config.batching else {}
    kind = _BatchSimulation if config.batching else _Simulation
    fleet = _fleet(replicas, router, config, replica_speeds, replica_down)
    if fleet is not None:
        if step_times is not None:
            raise ValueError("step_times replay one live engine's steps: not a fleet's")
        kind, batch = (_BatchFleetSimulation if config.batching else _FleetSimulation), {"fleet": fleet}
    run = kind(trace, config, **batch, failed=failed, reported_s=reported_s,
               cancel_after_s=cancel_after_s,
               cancel_until=cancel_until, priority=priority, client=client, retrier=retrier,
               speed_schedule=speed_schedule, held=held)
    run.arrivals()
    run.env.run()
    frame = run.frame(trace)
    frame.attrs.update(duration_s=trace.duration_s, policy=config.policy.name, engines=config.engines,
                       speed_factor=run.speed_factor())
    if fleet is not None:
        frame.attrs.update(replicas=fleet.replicas, router=fleet.router.name)
    if config.batching:  # the simulator's unit of work (benchmarks/bench_fleet.py counts by it)
        frame.attrs["steps"] = run.steps_run
    if config.batching and config.engine.prefix_caching:  # vLLM's counters, for a run's summary
        frame.attrs.update(run.queue.prefix_cache_stats())
    return frame


def _fleet(replicas: int, router: Router | None, config: ServerConfig,
           speeds=None, down=()) -> FleetSpec | None:
    """The fleet of a run (None: one server, today's path), checked against its server."""
    if replicas == 1 and not isinstance(replicas, bool) and speeds is None and not down:
        return None
    if replicas == 1 and router is None:
        router = RoundRobin()  # one replica of its own speed: nothing to route
    fleet = FleetSpec(replicas, router, None if speeds is None else tuple(speeds),
                      tuple(tuple(w) for w in down))
    fleet.check(config)
    return fleet
