"""The live gate: qsim's queue core on an asyncio loop, in front of its engines, through a driver.

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

Drivers. :class:`Gate` owns what every engine shares: tickets, admission through the queue core,
outcomes and their counts, stats, health, draining and shutdown. What differs between engines run
one request at a time and an engine that batches lives in a :class:`Driver`, chosen from the
config's engine: :class:`~live.drive_one.OneAtATimeDriver` (a :class:`qsim.engines.OneAtATime`:
the core :class:`qsim.queue.AdmissionQueue`, a started request is one engine call, the cut timers
and the watchdog below) or :class:`~live.drive_batch.BatchDriver` (a
:class:`qsim.engines.Batching`: :class:`qsim.batch.BatchQueue`, a started request joins the
engine's steps, :mod:`live.batching`). The list above and the sections below are the
one-at-a-time driver's; the batching driver's module says its own.

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
that fail in a row by :class:`~live.fleet_gate.ReplicaWatch`, which the one-at-a-time driver holds.
Batching replicas (one batching engine each) are the batching driver's, :mod:`live.drive_batch`,
which holds a ReplicaWatch too (a step past its stall rule, :data:`live.drive_batch.STEP_STALL`).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, replace
from functools import partial
from typing import Callable, Protocol, Sequence

from qsim.config import ServerConfig, StallRule
from qsim.disciplines import CODEL_REASON
from qsim.engines import Batching
from qsim.entry import Work
from qsim.fleet import FleetSpec
from qsim.outcomes import OUTCOMES, REJECT_REASONS, Outcome
from qsim.policy import EXPIRE_REASON, RATE_LIMITED, Policy
from qsim.queue import CUT_REASON, STALL_REASON
from qsim.service import LoadTerms, ServiceModel, SpeedTracker

from .batching import STEP_PAGE, is_batch_engine
from .drive_batch import BatchDriver
from .drive_one import CUT_LEAD_S, CUT_SLACK_S, OneAtATimeDriver
from .engine import Engine
from .engine_workers import _Ticket
from .gate_errors import (
    NEVER_IN_TIME,
    SHUTDOWN_REASON,
    DeadlineExceeded,
    EngineFailed,
    EngineStalled,
    NeverInTime,
    Rejected,
    ShuttingDown,
    UpstreamFailed,
    UpstreamTimedOut,
    never_in_time,
)
from .jobs import END, Answer, Arrival, Job, StreamingJob
from .timings import Timings

__all__ = [
    "COUNTED",
    "CUT_LEAD_S",
    "CUT_SLACK_S",
    "GATE_STALL",
    "BatchGate",
    "Driver",
    "Gate",
    "check_live_policy",
    "gate_config",
]

#: Outcomes the gate counts: the record's (``cancelled``: cut at its deadline; ``abandoned``: its
#: client left first, also stats' top-level ``cancelled``, kept for older clients). At rest they
#: add up to ``submitted``.
COUNTED = tuple(map(str, OUTCOMES))  # plain strings: JSON and label values
#: The stall rule a gate runs with unless its ServerConfig says otherwise (see gate_config).
GATE_STALL = StallRule()


def check_live_policy(policy: Policy) -> Policy:
    """The policy, or ValueError where a live gate cannot run it (the oracle estimator)."""
    if policy.estimator == "oracle":
        raise ValueError(
            "oracle is simulator-only: a live gate cannot know how many tokens a "
            "request will generate"
        )
    return policy


def gate_config(policy: Policy, **settings) -> ServerConfig:
    """A gate's :class:`~qsim.config.ServerConfig`: ``policy`` and ``settings`` (ServerConfig's
    fields), with the gate's stall rule (:data:`GATE_STALL`) unless ``stall`` is given: a live
    engine can hang, a simulated one not. A batching engine (``engine=`` a
    :class:`qsim.engines.Batching`) gets none: its core has no stall rule."""
    batching = isinstance(settings.get("engine"), Batching)
    settings.setdefault("stall", None if batching else GATE_STALL)
    return ServerConfig(check_live_policy(policy), **settings)


class Driver(Protocol):
    """What a gate delegates to the driver of its kind of engine (:mod:`live.drive_one`,
    :mod:`live.drive_batch`): the queue core it runs, how a started request runs, its timers, and
    what its stats and health add. ``now`` reads the gate's clock for an event (first telling the
    core of the deadlines passed before it); ``arrived`` and ``left`` follow an arrival and a
    client leaving (``state``: the core's answer to its cancel); ``step_page``: a page of the
    step log (empty where the driver keeps none)."""

    waiting: int
    queued_work_s: float

    def fitted(self, config: ServerConfig) -> ServerConfig: ...

    def make_queue(self, config: ServerConfig): ...

    def start(self) -> None: ...

    def close(self, timeout_s: float) -> None: ...

    async def aclose(self) -> None: ...

    def now(self) -> float: ...

    def arrived(self) -> None: ...

    def left(self, ticket: _Ticket, state: str | None) -> None: ...

    def idle_estimate_s(self, job: Job, base: float) -> float: ...

    def use_calibration(self, model: ServiceModel, terms: LoadTerms) -> None: ...

    def health(self) -> dict: ...

    def stats(self) -> dict: ...

    def step_page(self, since: float | None, cursor: int | None, limit: int) -> dict: ...


class Gate:
    """The queue core on the event loop, in front of its engines; use inside one running event loop.

    The driver comes from ``config.engine``: engines run one at a time
    (:class:`~live.drive_one.OneAtATimeDriver`, K engines) or one batching engine
    (:class:`~live.drive_batch.BatchDriver`; :func:`BatchGate` makes this gate).

    worker: what runs engine k (``worker(k, engine, deliver)`` with start, give(work) and
    stop(timeout_s)); by default the driver's :class:`~live.engine_workers.Worker` (a thread, or a
    task on the loop for a coroutine engine). Tests pass one that runs on the loop's (virtual)
    clock, to check the gate against the simulator in simulated time.

    fleet: N replicas behind a router (:mod:`live.fleet_gate`): engines one at a time, where
    ``engines`` holds replica r's engine k at r * K + k, K = len(engines) / N each (``config``,
    one replica's, is fitted to K); or, ``config``'s engine a :class:`qsim.engines.Batching`, one
    batching engine per replica (``engines[r]``).
    """

    def __init__(
        self,
        engines: Sequence[Engine],
        config: ServerConfig,
        clock: Callable[[], float] = time.monotonic,
        worker: Callable | None = None,
        fleet: FleetSpec | None = None,
    ) -> None:
        if not engines:
            raise ValueError("the gate needs at least one engine")
        check_live_policy(config.policy)
        self.engines = list(engines)
        self.fleet = fleet
        kind = BatchDriver if isinstance(config.engine, Batching) else OneAtATimeDriver
        self.driver: Driver = kind(self, worker)
        self.config = config = self.driver.fitted(config)
        self.policy = config.policy
        self.clock = clock
        self.workers = len(self.engines)
        self.queue = self.driver.make_queue(config)
        self.counts = dict.fromkeys(COUNTED, 0)
        # The answered requests' tokens, the prompt's as the engine counted it (an upstream's own
        # count): what a vLLM upstream's prompt_tokens_total and generation_tokens_total count.
        self.answered_tokens = {"prompt": 0, "generated": 0}
        self.rejected_by_reason = dict.fromkeys(map(str, (*REJECT_REASONS, NEVER_IN_TIME)), 0)
        # Admitted requests that ended without an answer, by (outcome, reason); the reasons known up
        # front start at 0 so that /metrics shows every series from the first scrape.
        self.ended_by_reason = dict.fromkeys(
            [
                (str(o), str(r))
                for o, r in (
                    (Outcome.EXPIRED, EXPIRE_REASON),
                    (Outcome.EXPIRED, CODEL_REASON),
                    (Outcome.ERROR, EngineFailed.reason),
                    (Outcome.ERROR, STALL_REASON),
                    (Outcome.ERROR, UpstreamFailed.reason),
                    (Outcome.ERROR, UpstreamTimedOut.reason),
                    (Outcome.CANCELLED, CUT_REASON),
                    (Outcome.ERROR, SHUTDOWN_REASON),
                )
            ],
            0,
        )
        self.timings = Timings()  # per-request times for /metrics (live.prometheus_metrics)
        self.cancelled = 0  # clients that left before their answer
        self.submitted = 0  # every request decided on: at rest, counts plus cancelled add up to it
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self.draining = False  # the server is stopping: the waiting were answered, new ones refused

    def _fleet_fields(self) -> dict:
        """The fleet's FleetSpec fields, with the gate's clock when --replica-down's and
        --replica-drain's seconds began (its start): a run file puts the windows on its own clock
        with it (live.rows)."""
        fields = self.fleet.to_fields()
        if self.fleet.down or self.fleet.drain:
            fields["down_started_at"] = self.driver.replicas.zero
        return fields

    def replica_of(self, k: int) -> int | None:
        """The replica of engine k (None: no fleet)."""
        return None if self.fleet is None else self.queue.replica_of_engine(k)

    def _forget(self, ticket: _Ticket) -> None:
        if self.fleet is not None:
            self.queue.forget(ticket)

    def use_calibration(self, model: ServiceModel, terms: LoadTerms) -> None:
        """Plan with a new calibration from now on (``PUT /admin/calibration``): what the driver
        takes of it (its line, and its engines' slowdown and noise or its step model)."""
        self.driver.use_calibration(model, terms)

    @property
    def tracker(self) -> SpeedTracker:
        return self.queue.tracker

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
        """Bind to the running event loop and start the engines' workers."""
        if self.loop is not None:
            raise RuntimeError("gate already started")
        self.loop = asyncio.get_running_loop()
        self.driver.start()

    def close(self, timeout_s: float = 1.0) -> None:
        """Cancel what is still pending and stop the engines' workers (a run in progress is not
        waited for)."""
        self.closed = True
        self.driver.close(timeout_s)

    async def aclose(self, timeout_s: float = 1.0) -> None:
        """:meth:`close`, then let coroutine engines close what they hold on the loop (their
        connections)."""
        self.close(timeout_s)
        await self.driver.aclose()

    def drain(self) -> None:
        """The server is stopping: every request still waiting is answered now
        (:class:`ShuttingDown`, outcome error), and new ones are refused; the running go on (to the
        end of the server's graceful shutdown)."""
        if self.draining or self.loop is None or self.closed:
            return
        self.draining = True
        now = self.driver.now()
        for entry in list(self.queue.waiting):
            ticket = entry.req
            if self.queue.cancel(ticket, now) == "waiting":
                self.resolve(
                    ticket,
                    Outcome.ERROR,
                    exc=ShuttingDown(
                        "the server is shutting down and did not start this request; send it again"
                    ),
                )

    def drain_soon(self) -> None:
        """:meth:`drain` on the gate's loop, from any thread or a signal handler (where the server's
        SIGTERM handler runs)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.drain)

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
        cancelling it while the job waits takes the job out of the queue. Cancelling it while it
        runs sets the run's cancel event; the engine is busy until ``engine.run`` returns (at once
        for an engine that listens, at the end of the run for one that does not): only then is it
        free for the next.
        """
        return self._submit(job).future

    def _submit(self, job: Job) -> _Ticket:
        try:
            return self._admit(job)
        finally:  # refused or not, the driver's timers follow the core's state
            self.driver.arrived()

    def _admit(self, job: Job) -> _Ticket:
        if self.loop is None or self.closed:
            raise RuntimeError(
                "the gate is not running: start it inside the event loop (and not after close)"
            )
        if self.draining:
            raise ShuttingDown(
                "the server is shutting down and takes no new requests; send it again"
            )
        now = self.driver.now()
        self.submitted += 1
        # The calibrated estimate at the limit, prompt term included; the policy's estimator scales
        # it from the work (the tokens generated are unknown here: None, which refuses the oracle's
        # question).
        base = float(self.config.model.estimate(job.max_new_tokens, job.prompt_tokens))
        deadline = self.queue.deadline_of(job.deadline_s)
        ticket = _Ticket(job, None, None)  # type: ignore[arg-type]
        if job.stream:  # before arrive(): an idle engine may take it there
            ticket.pieces = asyncio.Queue()
            ticket.emit = partial(self._post_piece, ticket.pieces)
        refusal = self.queue.arrive(
            ticket,
            now,
            base,
            deadline,
            job.priority,
            job.client_id,
            Work(job.max_new_tokens, job.prompt_tokens),
        )
        # Set after arrive(): a ticket an idle engine took there comes back on a later loop turn,
        # and a refusal (most arrivals under overload) needs no future.
        ticket.arrival = Arrival(now, deadline, self.queue.seen, ticket.replica)
        if refusal is not None:
            self._forget(ticket)
            # The core refused it (and kept its state as the simulator's would); one no queue could
            # answer in time is told so, not told to come back.
            est_idle = self.driver.idle_estimate_s(job, base)
            never = refusal.reason != RATE_LIMITED and never_in_time(
                self.policy, est_idle, deadline
            )
            reason = NEVER_IN_TIME if never else refusal.reason
            self.counts[Outcome.REJECTED] += 1
            self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1
            if never:
                raise NeverInTime(
                    refusal,
                    ticket.arrival,
                    job,
                    est_idle,
                    self.fitting_tokens(deadline, job.prompt_tokens),
                )
            raise Rejected(refusal, ticket.arrival)
        ticket.future = self.loop.create_future()
        ticket.future.add_done_callback(partial(self._on_future_done, ticket))
        if ticket.pieces is not None:
            # A done callback runs after every piece the engine posted before its hand-back resolved
            # the future.
            ticket.future.add_done_callback(lambda _: ticket.pieces.put_nowait(END))
        return ticket

    def fitting_tokens(
        self, deadline_s: float | None, prompt_tokens: int = 0, speed: float = 1.0
    ) -> int:
        """The most new tokens whose calibrated estimate (prompt term included) x ``speed`` fits
        ``deadline_s`` (None: the policy's) on an idle engine; 0 when not even one does. At the
        calibrated speed (1): what a :class:`NeverInTime` says fits; at the tracked one
        (:attr:`tracker`'s factor, the one admission scales by): what an OpenAI request that names
        no ``max_tokens`` gets (at most the server's cap)."""
        deadline = self.queue.deadline_of(deadline_s) / speed
        m = self.config.model
        room = deadline - m.intercept_s - m.per_prompt_token_s * prompt_tokens
        n = max(0, math.floor(room / m.per_token_s + 1e-9))
        over = n > 0 and float(m.estimate(n, prompt_tokens)) > deadline + 1e-9  # a rounding edge
        return n - 1 if over else n

    def submit_streaming(self, job: Job) -> StreamingJob:
        """:meth:`submit` for a client that reads the answer as it is produced: the engine (one
        whose ``run`` takes ``emit``) hands each piece of text to the loop as it goes. Raises
        :class:`Rejected`."""
        ticket = self._submit(job if job.stream else replace(job, stream=True))
        return StreamingJob(ticket.future, ticket.pieces)

    # -- outcomes ------------------------------------------------------------------------

    def dropped(
        self,
        ticket: _Ticket,
        now: float,
        outcome: str,
        reason: str,
        est: float,
        retry_after_s: int | None,
    ) -> None:
        """The core's drop hook: a waiting request ended unrun (expired, or behind stalled
        engines)."""
        a = ticket.arrival
        waited = now - a.at
        if outcome == Outcome.EXPIRED:
            numbers = {
                **a.numbers(),
                "est_service_s": est,
                "waited_s": waited,
                "left_s": a.deadline_s - waited,
            }
            self.resolve(ticket, outcome, exc=DeadlineExceeded(numbers, retry_after_s, a, reason))
            return
        numbers = {**a.numbers(), "waited_s": waited, "stalled_engines": self.workers}
        message = (
            f"every engine is stalled; this request waited {waited:.3f} s, past its "
            f"deadline of {a.deadline_s:.3f} s, and no engine can take it"
        )
        self.resolve(ticket, outcome, exc=EngineStalled(message, None, numbers, a))

    def _post_piece(self, pieces: asyncio.Queue, text: str) -> None:
        """Engine thread -> event loop, for each piece of a streamed run: never blocks the
        engine."""
        try:
            self.loop.call_soon_threadsafe(pieces.put_nowait, text)
        except RuntimeError:  # the loop closed while the engine ran: nobody is reading any more
            pass

    def resolve(
        self,
        ticket: _Ticket,
        outcome: str,
        answer: Answer | None = None,
        exc: Exception | None = None,
        cause: BaseException | None = None,
    ) -> None:
        """End ``ticket`` with ``outcome``: its answer, or ``exc`` (raised from ``cause``), counted
        once (a client that left was counted then)."""
        if ticket.future.done():  # cancelled: the client left, and was counted then
            return
        self.counts[outcome] += 1
        if exc is None:
            # The engine's own count of the prompt where it has one (an upstream's tokenizer), else
            # the gate's: settled here once, for /stats, the clients' usage and /v1/generate's
            # answer.
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

    def _on_future_done(self, ticket: _Ticket, future: asyncio.Future) -> None:
        """A cancelled future is a client that left: the core takes it out of the line, or out of
        service (the driver stops its run)."""
        if not future.cancelled():
            self._forget(ticket)
            return
        self.cancelled += 1
        self.counts[Outcome.ABANDONED] += 1
        self.driver.left(ticket, self.queue.cancel(ticket, self.driver.now()))
        self._forget(ticket)

    # -- observation ------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self.driver.waiting

    @property
    def in_service(self) -> int:
        return self.queue.in_service

    @property
    def queued_work_s(self) -> float:
        return self.driver.queued_work_s

    def health(self) -> dict:
        """Status "ok", or "degraded" with each stalled engine: how long its request has run, and
        its threshold (one batching engine has no stall rule: always "ok"; a fleet's replica whose
        step has stalled is "degraded")."""
        return self.driver.health()

    def stats(self) -> dict:
        """The queue now; ``clock`` is the gate's clock (monotonic seconds) at this reading; a
        batching engine's adds ``batching`` (its step log comes a page at a time: step_page)."""
        return {
            "clock": self.clock(),
            **self.queue.snapshot(),
            "fixed_estimate": self.config.fixed_estimate,
            "policy": asdict(self.policy),
            "service_model": asdict(self.config.model),
            # A learning estimator's used share of the limit now, per size class (empty: none yet).
            "estimator_shares": {
                str(c): share
                for c, share in sorted(getattr(self.queue.estimator, "share_now", {}).items())
            },
            "stall_rule": None if self.config.stall is None else asdict(self.config.stall),
            "tracker_weight": self.config.tracker_weight,
            "counts": dict(self.counts),
            "answered_tokens": dict(self.answered_tokens),
            "server_config": self.config.to_fields(),
            **({} if self.fleet is None else {"fleet": self._fleet_fields()}),
            "rejected_by_reason": dict(self.rejected_by_reason),
            "cancelled": self.cancelled,
            "submitted": self.submitted,
            **self.driver.stats(),
        }

    def step_page(
        self, since: float | None = None, cursor: int | None = None, limit: int = STEP_PAGE
    ) -> dict:
        """A page of the step log (``GET /stats?steps_since=``; empty for engines run one at a
        time): :meth:`live.drive_batch.BatchDriver.step_page`."""
        return self.driver.step_page(since, cursor, limit)


def BatchGate(
    engine,
    config: ServerConfig,
    clock: Callable[[], float] = time.monotonic,
    worker: Callable | None = None,
) -> Gate:
    """The gate in front of one batching engine (:class:`live.batching.BatchEngine`): a
    :class:`Gate` whose driver is :class:`~live.drive_batch.BatchDriver`. config: a
    :class:`~qsim.config.ServerConfig` whose engine is a :class:`qsim.engines.Batching` (its step
    model is the gate's calibration; the engine has its own truth)."""
    if not is_batch_engine(engine):
        raise ValueError(
            "a batching gate needs an engine that runs steps "
            f"(live.batching.BatchEngine), not {type(engine).__name__}"
        )
    check_live_policy(config.policy)
    if not isinstance(config.engine, Batching):
        raise ValueError(
            "a batching gate runs a batching engine (qsim.engines.Batching), "
            f"not {config.engine.kind}"
        )
    return Gate([engine], config, clock, worker)
