"""The live gate: the asyncio driver of qsim's queue core, in front of K engine threads.

Every piece of queue state (the waiting, their summed estimate, each engine's
estimated end, the idle and the stalled, the speed tracker) lives in one
:class:`qsim.queue.AdmissionQueue`, the same one the simulator drives on
SimPy's clock; this module turns its answers into futures and engine-thread
calls, so the gate and the simulator cannot disagree about a rule or a number,
only about the times they feed the core:

* arrival (:meth:`Gate.submit`): the core admits (an idle engine takes the
  request inside ``submit``: it counts as in service at once) or refuses;
* an engine hands a request back (its thread posts the result to the loop):
  the core judges it good or late by the gate's clock, teaches the tracker the
  engine's own time (a failure teaches nothing), and gives the engine the next
  request, dropping those that cannot finish (``expire_at_front``);
* a client leaves: its future is cancelled and the core takes it out of the
  queue; a running one holds its engine until ``engine.run`` returns, which the
  gate hastens by setting the run's :class:`~live.engine.Cancel` (below).

A request is a :class:`~live.jobs.Job`; it comes back an :class:`~live.jobs.Answer`, or ends
with one of :mod:`live.gate_errors`'s exceptions. The engines run in threads or tasks
(:mod:`live.engine_workers`, which says why no lock is needed); every piece of state lives on the
event loop. The clock is read once per event and passed to the core.

Stalled engines. An engine thread cannot be interrupted, so a hung engine
would hold its request, and everyone behind it, forever. A watchdog on the
event loop (every ``watch_interval_s``, 50 ms) asks the core which engines ran
past their stall rule (:class:`qsim.queue.StallRule`: ``max(10 x the estimate
at start, 5 s)``). Such a request ends as an error (:class:`~live.gate_errors.EngineStalled`); the
engine stays busy until ``engine.run`` returns, and what it returns then
teaches the tracker nothing. Its remaining work counts as its overrun so far,
so predictive admission keeps refusing. While *every* engine is stalled, a
waiting request whose deadline has passed is ended (``expired`` under a policy
that expires at the front, else :class:`~live.gate_errors.EngineStalled`). ``/healthz`` says
"degraded" meanwhile. When nothing stalls the watchdog changes nothing. An engine that bounds its
own runs (:class:`~live.engine.SelfTimed`: the upstream engine, whose timeout ends a silent upstream
as 504 ``upstream_timeout``) is left to do so: the stall rule does not end its runs.

Cancelling a run. Each run gets a :class:`~live.engine.Cancel` (``engine.run(...,
cancel=)``, for an engine whose ``run`` takes it), set on the event loop when the core
says a cancelled request was running (``AdmissionQueue.cancel`` -> "running"), and by
:meth:`Gate.close`. The engine may stop early (the synthetic engine stops waiting, GPT-2
stops between decoding steps, the upstream engine closes its connection, so the upstream
server sees its client leave too) and hands back ``EngineResult(stopped=True)``. The core
is then told ``ok=False``: the request had already ended (counted as cancelled), so
there is no outcome, and a truncated time teaches the speed tracker nothing. The engine
is free as soon as the run returns (for the core, an earlier hand-back like any other).
A stalled run is not cancelled: the stall rule stops waiting for a run, not the run (a
wedged engine would not listen anyway); a slow upstream is ended by its own timeout.

Estimators and cutting at the deadline. The policy's estimator (``Policy.estimator``,
:mod:`qsim.estimators`) lives in the queue core: each arrival's estimate comes from its
work (``Job.max_new_tokens`` and ``Job.prompt_tokens``; the service model's prompt term
counts the prompt) and a learning estimator learns from the tokens each completed run
actually generated (``EngineResult.tokens``). The oracle is refused (:func:`check_live_policy`):
a live gate cannot know how many tokens a request will generate. Under
``Policy.cancel_at_deadline`` a run still going at its deadline (arrival + deadline, the
gate's clock) is cut there: the core ends it (``AdmissionQueue.cut``), the run's Cancel is
set so that the engine stops, and the client gets :class:`~live.gate_errors.DeadlineCut` (outcome
``cancelled``, reason ``deadline_passed``; HTTP 504) at once. For the core the engine is
free at the cut, as the simulator's is (a client that leaves holds it until ``engine.run``
returns): it takes the next request then, which its thread or task starts once the cut run
has returned, so the stopping time counts in that request's time, where a replay sees it.

Streaming. :meth:`Gate.submit_streaming` admits a job as ``submit`` does (the same core, the same
counts) and also returns the queue of its text pieces (:class:`~live.jobs.StreamingJob`): the
engine thread hands each piece to the loop with ``call_soon_threadsafe`` (an engine whose ``run``
takes ``emit``, see :mod:`live.engine`; a coroutine engine's task puts it in the queue itself), and
:data:`~live.jobs.END` follows once the future is done. Nothing else changes: the future is
answered, fails or is cut exactly as a job that does not stream.

Replicas. A fleet's replicas (:mod:`live.fleet_gate`) are watched for stalls, readiness and runs
that fail in a row by :class:`~live.fleet_gate.ReplicaWatch`, the gate's base.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, replace
from functools import partial
from typing import Callable, Sequence

from qsim.config import ServerConfig, StallRule
from qsim.disciplines import CODEL_REASON
from qsim.engines import Batching, OneAtATime
from qsim.entry import Work
from qsim.fleet import FleetSpec
from qsim.outcomes import OUTCOMES, REJECT_REASONS, Outcome
from qsim.policy import EXPIRE_REASON, RATE_LIMITED, Policy
from qsim.queue import CUT_REASON, STALL_REASON, AdmissionQueue
from qsim.service import LoadTerms, ServiceModel, SpeedTracker

from .engine import Cancel, Engine, EngineResult, SelfTimed, UpstreamError
from .engine_workers import _Failure, _Ticket, _worker_for
from .fleet_gate import ReplicaWatch, fleet_queue
from .gate_errors import (NEVER_IN_TIME, SHUTDOWN_REASON, DeadlineCut, DeadlineExceeded,
                          EngineFailed, EngineStalled, NeverInTime, Rejected, ShuttingDown,
                          UpstreamFailed, UpstreamTimedOut, _failure_type, never_in_time)
from .jobs import END, Answer, Arrival, Job, StreamingJob
from .timings import Timings

#: Outcomes the gate counts: the record's (``cancelled``: cut at its deadline; ``abandoned``: its client left
#: first, also stats' top-level ``cancelled``, kept for older clients). At rest they add up to ``submitted``.
COUNTED = tuple(map(str, OUTCOMES))  # plain strings: JSON and label values
#: The stall rule a gate runs with unless its ServerConfig says otherwise (see gate_config).
GATE_STALL = StallRule()


def check_live_policy(policy: Policy) -> Policy:
    """The policy, or ValueError where a live gate cannot run it (the oracle estimator)."""
    if policy.estimator == "oracle":
        raise ValueError("oracle is simulator-only: a live gate cannot know how many tokens a request will generate")
    return policy


def gate_config(policy: Policy, **settings) -> ServerConfig:
    """A gate's :class:`~qsim.config.ServerConfig`: ``policy`` and ``settings`` (ServerConfig's fields), with the
    gate's stall rule (:data:`GATE_STALL`) unless ``stall`` is given: a live engine can hang, a simulated one not.
    A batching engine (``engine=`` a :class:`qsim.engines.Batching`) gets none: its core has no stall rule."""
    settings.setdefault("stall", None if isinstance(settings.get("engine"), Batching) else GATE_STALL)
    return ServerConfig(check_live_policy(policy), **settings)


#: How long before a run's deadline its cut timer is set, on a real clock: a loop's timer can come up to a
#: millisecond late, and a cut that comes late shifts every later start on its engine (see Gate._cut).
CUT_LEAD_S = 0.002
#: A cut this close to its deadline is at it (the cut is placed at the deadline itself, see Gate._cut): below the
#: resolution of two clocks that are apart, waiting on would never end.
CUT_SLACK_S = 1e-6


class Gate(ReplicaWatch):
    """The queue core on the event loop, and K engine threads; use inside one running event loop.

    worker: what runs engine k (``worker(k, engine, deliver)`` with start, give(ticket) and
    stop(timeout_s)); by default an engine thread, or a task on the loop for a coroutine engine.
    Tests pass one that runs on the loop's (virtual) clock, to check the gate against the simulator
    in simulated time.

    fleet: N replicas behind a router (:mod:`live.fleet_gate`): ``engines`` holds replica r's
    engine k at r * K + k, K = len(engines) / N each (``config``, one replica's, is fitted to K).
    """

    def __init__(self, engines: Sequence[Engine], config: ServerConfig, clock: Callable[[], float] = time.monotonic,
                 worker: Callable = _worker_for, fleet: FleetSpec | None = None) -> None:
        if not engines:
            raise ValueError("the gate needs at least one engine")
        check_live_policy(config.policy)
        self.engines = list(engines)
        self.fleet = fleet
        self.config = config = self._fitted(config)
        self.policy = config.policy
        self.clock = clock
        self.workers = len(self.engines)
        self.queue = self._make_queue(config)
        self.counts = dict.fromkeys(COUNTED, 0)
        # The answered requests' tokens, the prompt's as the engine counted it (an upstream's own count):
        # what a vLLM upstream's prompt_tokens_total and generation_tokens_total count of them.
        self.answered_tokens = {"prompt": 0, "generated": 0}
        self.rejected_by_reason = dict.fromkeys(map(str, (*REJECT_REASONS, NEVER_IN_TIME)), 0)
        # Admitted requests that ended without an answer, by (outcome, reason); the reasons known up
        # front start at 0 so that /metrics shows every series from the first scrape.
        self.ended_by_reason = dict.fromkeys([(str(o), str(r)) for o, r in (
            (Outcome.EXPIRED, EXPIRE_REASON), (Outcome.EXPIRED, CODEL_REASON), (Outcome.ERROR, EngineFailed.reason),
            (Outcome.ERROR, STALL_REASON), (Outcome.ERROR, UpstreamFailed.reason),
            (Outcome.ERROR, UpstreamTimedOut.reason), (Outcome.CANCELLED, CUT_REASON),
            (Outcome.ERROR, SHUTDOWN_REASON))], 0)
        self.timings = Timings()  # per-request times for /metrics (live.prometheus_metrics)
        self._self_timed = [isinstance(e, SelfTimed) for e in self.engines]
        self.cancelled = 0  # clients that left before their answer
        self.submitted = 0  # every request decided on: at rest, the outcome counts plus cancelled add up to it
        self._worker = worker
        self._threads: list = []
        self._closing: list = []  # the workers close() stopped, for aclose()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: asyncio.TimerHandle | None = None
        self._closed = False
        self.draining = False  # the server is stopping: waiting requests were answered, new ones are refused
        # A fleet's replicas whose engine says it is not ready (and why); the question to each.
        self._unready: dict[int, str] = {}
        self._probes: dict[int, asyncio.Task] = {}
        # Per replica: its runs that failed in a row, and until when a streak of them keeps it
        # out of routing.
        self._failing = [0] * (fleet.replicas if fleet is not None else 0)
        self._paused: dict[int, float] = {}

    def _fitted(self, config: ServerConfig) -> ServerConfig:
        """The config this gate runs: engines one at a time, as many as it is given (a batching engine has its own
        driver, :class:`live.batching.BatchGate`)."""
        if not isinstance(config.engine, OneAtATime):
            raise ValueError(f"the gate runs {config.engine.kind} engines through its batching driver "
                             "(live.batching.BatchGate), not this one")
        per = len(self.engines)
        if self.fleet is not None:  # each replica runs its share of the engines
            per, left = divmod(len(self.engines), self.fleet.replicas)
            if left or not per:
                raise ValueError(f"{len(self.engines)} engines do not split into "
                                 f"{self.fleet.replicas} replicas of equal size")
            self.fleet.check(config)
        if config.engines != per:  # the gate runs as many engines as it is given
            config = config.replace(engine=replace(config.engine, engines=per))
        return config

    def _make_queue(self, config: ServerConfig):
        if self.fleet is not None:
            return fleet_queue(config, self.fleet, start=self._start, drop=self._drop, gone=_gone,
                               routed=self._routed)
        return AdmissionQueue(config, start=self._start, drop=self._drop, gone=_gone)

    def _routed(self, ticket: "_Ticket", r: int) -> None:
        ticket.replica = r

    def replica_of(self, k: int) -> int | None:
        """The replica of engine k (None: no fleet)."""
        return None if self.fleet is None else self.queue.replica_of_engine(k)

    def _forget(self, ticket: "_Ticket") -> None:
        if self.fleet is not None:
            self.queue.forget(ticket)

    def use_calibration(self, model: ServiceModel, terms: LoadTerms) -> None:
        """Plan with a new calibration from now on (``PUT /admin/calibration``): its line, and its engines'
        slowdown and noise (qsim.queue.AdmissionQueue.recalibrate says what starts again)."""
        engine = replace(self.config.engine, concurrency=terms.concurrency, cv=terms.noise_cv or 0.0)
        self.config = self.config.replace(model=model, engine=engine)
        self.queue.recalibrate(self.config)

    @property
    def tracker(self) -> SpeedTracker:
        return self.queue.tracker

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
        """Bind to the running event loop and start the engine threads."""
        if self._loop is not None:
            raise RuntimeError("gate already started")
        self._loop = asyncio.get_running_loop()
        self._threads = [self._worker(k, e, self._post) for k, e in enumerate(self.engines)]
        for t in self._threads:
            t.start()
        self._watch = self._loop.call_later(self.config.watch_interval_s, self._watchdog)

    def close(self, timeout_s: float = 1.0) -> None:
        """Cancel what is still pending and stop the engine threads (a run in progress is not waited for)."""
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        for probe in self._probes.values():
            probe.cancel()
        running = [entry.req for entry in self.queue.running if entry is not None]
        for ticket in running:
            if ticket.timer is not None:
                ticket.timer.cancel()
        for ticket in [*(entry.req for entry in self.queue.waiting), *running]:
            ticket.future.cancel()
        for t in self._threads:
            t.stop(timeout_s / max(1, len(self._threads)))
        self._closing, self._threads = self._threads, []

    async def aclose(self, timeout_s: float = 1.0) -> None:
        """:meth:`close`, then let coroutine engines close what they hold on the loop (connections)."""
        self.close(timeout_s)
        for t in self._closing:
            if hasattr(t, "aclose"):
                await t.aclose()
        self._closing = []

    def drain(self) -> None:
        """The server is stopping: every request still waiting is answered now (:class:`ShuttingDown`, outcome
        error), and new ones are refused; the running go on (to the end of the server's graceful shutdown)."""
        if self.draining or self._loop is None or self._closed:
            return
        self.draining = True
        now = self._now()
        for entry in list(self.queue.waiting):
            ticket = entry.req
            if self.queue.cancel(ticket, now) == "waiting":
                self._resolve(ticket, Outcome.ERROR, exc=ShuttingDown("the server is shutting down and did not start this "
                                                                "request; send it again"))

    def drain_soon(self) -> None:
        """:meth:`drain` on the gate's loop, from any thread or a signal handler (where the server's SIGTERM
        handler runs)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.drain)

    async def __aenter__(self) -> "Gate":
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # -- arrival ----------------------------------------------------------------

    def submit(self, job: Job) -> asyncio.Future:
        """Admit the job and return a future of its :class:`Answer`, or raise :class:`Rejected`.

        Never blocks. The future fails with :class:`DeadlineExceeded` (dropped at
        the front), :class:`DeadlineCut` (cut in service at its deadline), :class:`EngineFailed`
        (:class:`UpstreamFailed`, :class:`UpstreamTimedOut`) or :class:`EngineStalled`;
        cancelling it while the job waits takes the job out of the queue. Cancelling it while it runs sets the run's cancel event; the engine is
        busy until ``engine.run`` returns (at once for an engine that listens, at the end
        of the run for one that does not): only then is it free for the next.
        """
        return self._submit(job).future

    def _submit(self, job: Job) -> _Ticket:
        if self._loop is None or self._closed:
            raise RuntimeError("the gate is not running: start it inside the event loop (and not after close)")
        if self.draining:
            raise ShuttingDown("the server is shutting down and takes no new requests; send it again")
        now = self._now()
        self.submitted += 1
        # The calibrated estimate at the limit, prompt term included; the policy's estimator scales it from
        # the work (the tokens generated are unknown here: None, which refuses the oracle's question).
        base = float(self.config.model.estimate(job.max_new_tokens, job.prompt_tokens))
        deadline = self.queue.deadline_of(job.deadline_s)
        ticket = _Ticket(job, None, None)  # type: ignore[arg-type]
        if job.stream:  # before arrive(): an idle engine may take it there
            ticket.pieces = asyncio.Queue()
            ticket.emit = partial(self._post_piece, ticket.pieces)
        refusal = self.queue.arrive(ticket, now, base, deadline, job.priority, job.client_id,
                                    Work(job.max_new_tokens, job.prompt_tokens))
        # Set after arrive(): a ticket an idle engine took there comes back on a later loop turn, and a
        # refusal (most arrivals under overload) needs no future.
        ticket.arrival = Arrival(now, deadline, self.queue.seen, ticket.replica)
        if refusal is not None:
            self._forget(ticket)
            # The core refused it (and kept its state as the simulator's would); one no queue could answer in time
            # is told so, not told to come back.
            est_idle = self._idle_estimate_s(job, base)
            never = refusal.reason != RATE_LIMITED and never_in_time(self.policy, est_idle, deadline)
            reason = NEVER_IN_TIME if never else refusal.reason
            self.counts[Outcome.REJECTED] += 1
            self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1
            if never:
                raise NeverInTime(refusal, ticket.arrival, job, est_idle, self.fitting_tokens(deadline, job.prompt_tokens))
            raise Rejected(refusal, ticket.arrival)
        ticket.future = self._loop.create_future()
        ticket.future.add_done_callback(partial(self._on_future_done, ticket))
        if ticket.pieces is not None:
            # A done callback runs after every piece the engine posted before its hand-back resolved the future.
            ticket.future.add_done_callback(lambda _: ticket.pieces.put_nowait(END))
        return ticket

    def _idle_estimate_s(self, job: Job, base: float) -> float:
        """The job's estimate on an idle engine: the policy's estimator's, at the speed factor or the calibrated
        speed, whichever is faster (a slow spell is the queue's state, and passes)."""
        estimator = self.queue.estimator
        own = base if estimator is None else estimator.base_s(base, job.max_new_tokens, job.prompt_tokens, None)
        return own * min(1.0, self.tracker.factor)

    def fitting_tokens(self, deadline_s: float | None, prompt_tokens: int = 0, speed: float = 1.0) -> int:
        """The most new tokens whose calibrated estimate (prompt term included) x ``speed`` fits ``deadline_s``
        (None: the policy's) on an idle engine; 0 when not even one does. At the calibrated speed (1): what a
        :class:`NeverInTime` says fits; at the tracked one (:attr:`tracker`'s factor, the one admission scales
        by): what an OpenAI request that names no ``max_tokens`` gets (at most the server's cap)."""
        deadline = self.queue.deadline_of(deadline_s) / speed
        m = self.config.model
        room = deadline - m.intercept_s - m.per_prompt_token_s * prompt_tokens
        n = max(0, math.floor(room / m.per_token_s + 1e-9))
        return n - 1 if n > 0 and float(m.estimate(n, prompt_tokens)) > deadline + 1e-9 else n  # a rounding edge

    def submit_streaming(self, job: Job) -> StreamingJob:
        """:meth:`submit` for a client that reads the answer as it is produced: the engine (one whose
        ``run`` takes ``emit``) hands each piece of text to the loop as it goes. Raises :class:`Rejected`."""
        ticket = self._submit(job if job.stream else replace(job, stream=True))
        return StreamingJob(ticket.future, ticket.pieces)

    # -- the core's hooks -------------------------------------------------------------

    def _start(self, k: int, ticket: _Ticket, now: float, est: float) -> None:
        ticket.engine, ticket.start = k, now
        ticket.replica = self.replica_of(k)
        if ticket.arrival is not None and ticket.arrival.replica != ticket.replica:
            # A central queue's request binds where an engine frees: what it says from now on.
            ticket.arrival = replace(ticket.arrival, replica=ticket.replica)
        ticket.cancel = Cancel()
        if self._closed:  # shutting down: no engine thread will take it; close() cancels its future
            return
        # No arrival yet: an idle engine took it inside arrive(), at its arrival time.
        self.timings.queue.observe(0.0 if ticket.arrival is None else now - ticket.arrival.at)
        ticket.due = self.queue.cut_at(k)  # the core's rule: its deadline, where the policy cuts there
        if math.isfinite(ticket.due):
            # On the loop's clock; call_at, not call_later, so that the gate's and loop's clock being the same
            # one gives the deadline to the last bit. Otherwise (a real clock) the loop's timers come up to a
            # millisecond late (epoll's and uvloop's resolution): this one is set CUT_LEAD_S early, and _cut
            # waits on from there to the deadline itself. The clock is read again, not ``now``: a run started by
            # a cut placed in the past (_cut_overdue) starts at ``now`` for the core, but its timer counts from
            # the loop's present.
            if self.clock == self._loop.time:
                when = ticket.due
            else:
                when = self._loop.time() + (ticket.due - self.clock()) - CUT_LEAD_S
            ticket.timer = self._loop.call_at(when, self._deadline_passed, k, ticket)
        self._threads[k].give(ticket)

    def _now(self) -> float:
        """The clock, read once for an event the core is told of. Runs whose deadline passed before it are cut
        first (see _cut_overdue): the core hears of events in their order, as the simulator's does."""
        now = self.clock()
        if self.policy.cancel_at_deadline:
            self._cut_overdue(now)
        return now

    def _drop(self, ticket: _Ticket, now: float, outcome: str, reason: str, est: float,
              retry_after_s: int | None) -> None:
        a = ticket.arrival
        waited = now - a.at
        if outcome == Outcome.EXPIRED:
            numbers = {**a.numbers(), "est_service_s": est, "waited_s": waited, "left_s": a.deadline_s - waited}
            self._resolve(ticket, outcome, exc=DeadlineExceeded(numbers, retry_after_s, a, reason))
            return
        numbers = {**a.numbers(), "waited_s": waited, "stalled_engines": self.workers}
        message = (f"every engine is stalled; this request waited {waited:.3f} s, past its deadline of "
                   f"{a.deadline_s:.3f} s, and no engine can take it")
        self._resolve(ticket, outcome, exc=EngineStalled(message, None, numbers, a))

    # -- completion -------------------------------------------------------------------

    def _post_piece(self, pieces: asyncio.Queue, text: str) -> None:
        """Engine thread -> event loop, for each piece of a streamed run: never blocks the engine."""
        try:
            self._loop.call_soon_threadsafe(pieces.put_nowait, text)
        except RuntimeError:  # the loop closed while the engine ran: nobody is reading any more
            pass

    def _post(self, k: int, ticket: _Ticket, result) -> None:
        """Engine thread -> event loop."""
        try:
            self._loop.call_soon_threadsafe(self._finished, k, ticket, result)
        except RuntimeError:  # the loop closed while the engine ran: nobody is waiting any more
            pass

    def _finished(self, k: int, ticket: _Ticket, result: EngineResult | _Failure) -> None:
        now = self._now()
        if ticket.timer is not None:  # handed back before its deadline: no cut
            ticket.timer.cancel()
            ticket.timer = None
        failed = isinstance(result, _Failure)
        # Before the early return: a stalled (or cancelled) run's time and a failed upstream call count too.
        self.timings.engine.observe(result.engine_s)
        if failed and isinstance(result.error, UpstreamError):
            self.timings.upstream_errors += 1
        if ticket.released:
            return  # cut at its deadline: the core freed its engine then, and has moved on
        if not failed and result.stopped:  # cut short: its time is no service time
            result = _Failure(RuntimeError("the engine stopped the run unasked"), result.engine_s)
        ok = not isinstance(result, _Failure)
        if self.fleet is not None:
            self._count_failure(self.queue.replica_of_engine(k), ok, now)
        # The tokens it generated: what a learning estimator learns (a stop string ends a run early).
        outcome = self.queue.finished(k, now, result.engine_s, ok=ok, tokens=result.tokens if ok else None)
        if outcome is None:
            return  # it had ended already: stalled (a hang's time teaches nothing), or its client left
        held = {"started_at": ticket.start, "returned_at": now}
        if isinstance(result, _Failure):
            error = _failure_type(result.error)(k, result.error, ticket.arrival, {**held, "engine_s": result.engine_s})
            self._resolve(ticket, outcome, exc=error, cause=result.error)
            return
        latency = now - ticket.arrival.at
        self._resolve(ticket, outcome, Answer(result.text, result.tokens, outcome, ticket.start - ticket.arrival.at,
                                              result.engine_s, latency, k, ticket.arrival, ticket.start, now,
                                              result.first_token_s, result.prompt_tokens,
                                              ticket.replica))

    def _resolve(self, ticket: _Ticket, outcome: str, answer: Answer | None = None, exc: Exception | None = None,
                 cause: BaseException | None = None) -> None:
        if ticket.future.done():  # cancelled: the client left, and was counted then
            return
        self.counts[outcome] += 1
        if exc is None:
            # The engine's own count of the prompt where it has one (an upstream's tokenizer), else
            # the gate's: settled here once, for /stats, the clients' usage and /v1/generate's answer.
            if answer.prompt_tokens is None:
                answer = replace(answer, prompt_tokens=ticket.job.prompt_tokens)
            self.answered_tokens["prompt"] += answer.prompt_tokens
            self.answered_tokens["generated"] += answer.tokens
            ticket.future.set_result(answer)
        else:
            key = (outcome, exc.reason)
            self.ended_by_reason[key] = self.ended_by_reason.get(key, 0) + 1
            exc.__cause__ = cause
            ticket.future.set_exception(exc)

    # -- cutting a run at its deadline (Policy.cancel_at_deadline) -------------------

    def _deadline_passed(self, k: int, ticket: _Ticket) -> None:
        ticket.timer = None
        # One loop turn later: a hand-back due at this very instant (already among the ready callbacks) goes
        # first, and a run that ends at its deadline is answered, as the simulator's is.
        self._loop.call_soon(self._cut, k, ticket)

    def _cut(self, k: int, ticket: _Ticket) -> None:
        entry = self.queue.running[k]
        if self._closed or entry is None or entry.req is not ticket:
            return  # handed back in time
        now = self.clock()
        if ticket.due - now > CUT_SLACK_S:
            # Early (set so, see _start; or the loop's clock is coarser than the gate's): wait on to the deadline
            # itself, where the simulator cuts, aiming early again while more than half the lead is left, as a
            # timer can come late. uvloop rounds the last wait down to whole milliseconds, that is to the next
            # turn of the loop: the cut then comes within microseconds of the deadline.
            left = ticket.due - now
            wait = left - CUT_LEAD_S / 2 if left - CUT_LEAD_S / 2 > CUT_SLACK_S else left  # never a wait of nothing
            ticket.timer = self._loop.call_later(wait, self._deadline_passed, k, ticket)
            return
        # Placed at the deadline itself (or the start, for a run that started past it), as the simulator places
        # it: the microseconds the loop took to get here would otherwise shift every later start on this engine,
        # and a replay's decisions with them. Nothing the core was told of came in between: _now cuts first.
        self._cut_at(k, ticket, max(ticket.due, ticket.start))

    def _cut_overdue(self, now: float) -> None:
        """Cut, at their deadlines and in their order, the runs whose deadline passed before ``now`` and whose
        timer the loop has not come round to yet (a loop late by a fraction of a millisecond, an arrival read
        first): the event at ``now`` then meets the queue the simulator's would."""
        while True:
            late = [(max(e.req.due, e.req.start), k) for k, e in enumerate(self.queue.running)
                    if e is not None and not self.queue.ended[k] and e.req.due + CUT_SLACK_S < now]
            if not late:
                return
            at, k = min(late)
            ticket = self.queue.running[k].req
            if ticket.timer is not None:
                ticket.timer.cancel()
                ticket.timer = None
            self._cut_at(k, ticket, at)

    def _cut_at(self, k: int, ticket: _Ticket, now: float) -> None:
        if self.queue.cut(k, now) is None:
            return  # it had ended already: stalled, or its client left
        ticket.cut = True
        numbers = {**ticket.arrival.numbers(), "engine": k, "started_at": ticket.start, "at": now,
                   "running_s": now - ticket.start}
        self._resolve(ticket, Outcome.CANCELLED, exc=DeadlineCut(numbers, ticket.arrival))
        ticket.cancel.set()  # the engine stops (between decode steps, or its wait)
        # Its engine is free at the cut, as the simulator's is: the core gives it its next request now, which
        # the engine's thread (or task) starts as soon as the cut run has returned (at once, for an engine
        # that listens to its Cancel). The hand-back of the cut run then only ends it (``released``).
        ticket.released = True
        self.queue.finished(k, now, now - ticket.start, ok=False)

    # -- the watchdog: stalled engines and the queue behind them ----------------------

    def _watchdog(self) -> None:
        now = self._now()
        for k in self.queue.overdue(now):
            if self._self_timed[k]:
                continue  # the engine bounds its own runs (an upstream's timeout): it ends them, not the stall rule
            ticket = self.queue.stall(k, now)
            if ticket is not None:
                self._stalled(k, ticket, now)
        self.queue.give_up(now)
        if self.fleet is not None:
            self._watch_replicas(now)
        if not self._closed:
            self._watch = self._loop.call_later(self.config.watch_interval_s, self._watchdog)

    def _stalled(self, k: int, ticket: _Ticket, now: float) -> None:
        """Engine k ran past its threshold: its request ends now; the engine stays busy until it returns."""
        running = now - ticket.start
        est = self.queue.busy_until[k] - ticket.start
        after = self.queue.stall_after_s[k]
        numbers = {**ticket.arrival.numbers(), "engine": k, "running_s": running, "est_service_s": est,
                   "stall_after_s": after, "started_at": ticket.start, "at": now}
        message = (f"engine {k} has run this request for {running:.3f} s, past its stall threshold of "
                   f"{after:.3f} s (max of {self.config.stall.factor:g} x its {est:.3f} s estimate "
                   f"and {self.config.stall.floor_s:g} s); the gate stopped waiting for it")
        self._resolve(ticket, Outcome.ERROR, exc=EngineStalled(message, k, numbers, ticket.arrival))

    def _on_future_done(self, ticket: _Ticket, future: asyncio.Future) -> None:
        """A cancelled future is a client that left: a waiting one leaves the queue with its work, a
        running one's engine is asked to stop."""
        if not future.cancelled():
            self._forget(ticket)
            return
        self.cancelled += 1
        self.counts[Outcome.ABANDONED] += 1
        if self.queue.cancel(ticket, self._now()) == "running" and ticket.cancel is not None:
            ticket.cancel.set()
        self._forget(ticket)

    # -- observation ------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self.queue.waiting)

    @property
    def in_service(self) -> int:
        return self.queue.in_service

    @property
    def queued_work_s(self) -> float:
        return self.queue.queued_work_s

    def health(self) -> dict:
        """Status "ok", or "degraded" with each stalled engine: how long its request has run, and its threshold."""
        stalled = self.queue.stalled_engines(self.clock())
        return {"status": "degraded" if stalled else "ok", "stalled": stalled}

    def stats(self) -> dict:
        """The queue now; ``clock`` is the gate's clock (monotonic seconds) at this reading."""
        return {
            "clock": self.clock(),
            **self.queue.snapshot(),
            "fixed_estimate": self.config.fixed_estimate,
            "policy": asdict(self.policy),
            "service_model": asdict(self.config.model),
            # A learning estimator's used share of the limit now, per size class (empty: none learned yet).
            "estimator_shares": {str(c): share for c, share
                                 in sorted(getattr(self.queue.estimator, "share_now", {}).items())},
            "stall_rule": None if self.config.stall is None else asdict(self.config.stall),
            "tracker_weight": self.config.tracker_weight,
            "counts": dict(self.counts),
            "answered_tokens": dict(self.answered_tokens),
            "server_config": self.config.to_fields(),
            **({} if self.fleet is None else {"fleet": self.fleet.to_fields()}),
            "rejected_by_reason": dict(self.rejected_by_reason),
            "cancelled": self.cancelled,
            "submitted": self.submitted,
        }


def _gone(ticket: _Ticket) -> bool:
    """Its client left, and the done callback that tells the core has not run yet."""
    return ticket.future.done()

