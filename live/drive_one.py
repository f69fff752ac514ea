"""The gate's driver for engines run one request at a time: :class:`OneAtATimeDriver`.

It drives :class:`qsim.queue.AdmissionQueue` (or a fleet of them, :mod:`live.fleet_gate`), the
core the simulator drives on SimPy's clock, and runs each request it starts as one engine call on
that engine's :class:`~live.engine_workers.Worker` (a thread, or a task for a coroutine engine):

* the core starts a request on engine k (its ``start`` hook): the worker runs ``engine.run`` (or
  ``arun``) with the run's :class:`~live.engine.Cancel` and what the engine declares it takes
  (:class:`live.engine.Abilities`);
* the run's result comes back to the loop: the core judges it good or late by the gate's clock,
  teaches the tracker the engine's own time (a failure teaches nothing), and gives the engine the
  next request;
* a run still going at its deadline, where the policy cuts there, is cut by a loop timer
  (:meth:`OneAtATimeDriver._cut`); the engine is free for the core at the cut;
* a watchdog every ``watch_interval_s`` ends runs past their stall rule
  (:class:`qsim.config.StallRule`) and watches a fleet's replicas.

:mod:`live.gate` says what each of these means for a client; this module holds how.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

from qsim.config import ServerConfig
from qsim.engines import OneAtATime
from qsim.outcomes import Outcome
from qsim.queue import AdmissionQueue
from qsim.service import LoadTerms, ServiceModel

from .engine import Asked, Cancel, EngineResult, SelfTimed, UpstreamError, abilities_of, cancellable
from .engine_workers import Worker, _Failure, _gone, _Ticket, closed
from .fleet_gate import ReplicaWatch, fleet_queue
from .gate_errors import DeadlineCut, EngineStalled, _failure_type
from .jobs import Answer, Job

#: How long before a run's deadline its cut timer is set, on a real clock: a loop's timer can come
#: up to a millisecond late, and a cut that comes late shifts every later start on its engine (see
#: OneAtATimeDriver._cut).
CUT_LEAD_S = 0.002
#: A cut this close to its deadline is at it (the cut is placed at the deadline itself, see
#: OneAtATimeDriver._cut): below the resolution of two clocks that are apart, waiting on would
#: never end.
CUT_SLACK_S = 1e-6


def engine_worker(k: int, engine, deliver) -> Worker:
    """Engine k's worker: each ticket given becomes one run of ``engine`` (``arun`` as a task for a
    coroutine engine, else ``run`` on a thread of its own), delivered as ``deliver(k, ticket,
    result)``."""
    abilities = abilities_of(engine)

    def extras(ticket: _Ticket, emit) -> dict:
        given = {}
        if emit is not None and abilities.emit:
            given["emit"] = emit
        if abilities.asked and ticket.job.asked != Asked():
            given["asked"] = ticket.job.asked
        return given

    def run(ticket: _Ticket) -> EngineResult:
        job = ticket.job
        given = extras(ticket, ticket.emit)
        if abilities.cancel:
            given["cancel"] = ticket.cancel
        return _checked(engine.run(job.prompt, job.max_new_tokens, job.stop or None, **given))

    async def arun(ticket: _Ticket) -> EngineResult:
        # A task's pieces go straight into the ticket's queue: no hand-over between threads.
        job, pieces = ticket.job, ticket.pieces
        given = extras(ticket, None if pieces is None else pieces.put_nowait)
        call = engine.arun(job.prompt, job.max_new_tokens, job.stop or None, **given)
        return _checked(await cancellable(call, ticket.cancel))

    def delivered(ticket: _Ticket, result) -> None:
        deliver(k, ticket, result)

    coroutine = abilities.coroutine
    return Worker(
        f"qlab-engine-{k}",
        arun if coroutine else run,
        delivered,
        coroutine=coroutine,
        engine=engine,
    )


def _checked(result) -> EngineResult:
    if not isinstance(result, EngineResult):
        raise TypeError(f"engine returned {type(result).__name__}, not EngineResult")
    return result


class OneAtATimeDriver:
    """K engines, each running one request at a time, behind :class:`qsim.queue.AdmissionQueue`
    (or :class:`~live.fleet_gate.LiveFleet`); see the module. ``worker(k, engine, deliver)`` makes
    engine k's worker (default :func:`engine_worker`; a test's runs on a virtual clock)."""

    def __init__(self, gate, worker=None) -> None:
        self.gate = gate
        self._make_worker = engine_worker if worker is None else worker
        self._workers: list = []
        self._closing: list = []  # the workers close() stopped, for aclose()
        self._watch: asyncio.TimerHandle | None = None
        self._self_timed = [isinstance(e, SelfTimed) for e in gate.engines]
        self.replicas = None if gate.fleet is None else ReplicaWatch(gate)

    # -- what the gate runs ------------------------------------------------------------

    def fitted(self, config: ServerConfig) -> ServerConfig:
        """The config the gate runs: engines one at a time, as many as it is given (split evenly
        among a fleet's replicas)."""
        gate = self.gate
        if not isinstance(config.engine, OneAtATime):
            raise ValueError(f"the one-at-a-time driver runs no {config.engine.kind} engine")
        per = len(gate.engines)
        if gate.fleet is not None:  # each replica runs its share of the engines
            per, left = divmod(len(gate.engines), gate.fleet.replicas)
            if left or not per:
                raise ValueError(
                    f"{len(gate.engines)} engines do not split into "
                    f"{gate.fleet.replicas} replicas of equal size"
                )
            gate.fleet.check(config)
        if config.engines != per:  # the gate runs as many engines as it is given
            config = config.replace(engine=replace(config.engine, engines=per))
        return config

    def make_queue(self, config: ServerConfig):
        gate = self.gate
        if gate.fleet is not None:
            return fleet_queue(
                config,
                gate.fleet,
                start=self._start,
                drop=gate.dropped,
                gone=_gone,
                routed=self._routed,
            )
        return AdmissionQueue(config, start=self._start, drop=gate.dropped, gone=_gone)

    def _routed(self, ticket: _Ticket, r: int) -> None:
        ticket.replica = r

    # -- life cycle -----------------------------------------------------------------

    def start(self) -> None:
        """Start each engine's worker, and the watchdog."""
        gate = self.gate
        self._workers = [self._make_worker(k, e, self._post) for k, e in enumerate(gate.engines)]
        for w in self._workers:
            w.start()
        self._watch = gate.loop.call_later(gate.config.watch_interval_s, self._watchdog)
        if self.replicas is not None:
            self.replicas.start(self.now)

    def close(self, timeout_s: float) -> None:
        """Stop the watchdog, cancel every pending future and stop the workers (a run in progress
        is not waited for)."""
        queue = self.gate.queue
        if self._watch is not None:
            self._watch.cancel()
        if self.replicas is not None:
            self.replicas.close()
        running = [entry.req for entry in queue.running if entry is not None]
        for ticket in running:
            if ticket.timer is not None:
                ticket.timer.cancel()
        for ticket in [*(entry.req for entry in queue.waiting), *running]:
            ticket.future.cancel()
        for w in self._workers:
            w.stop(timeout_s / max(1, len(self._workers)))
        self._closing, self._workers = self._workers, []

    async def aclose(self) -> None:
        await closed(self._closing)
        self._closing = []

    # -- events -------------------------------------------------------------------------

    def now(self) -> float:
        """The clock, read once for an event the core is told of. Runs whose deadline passed before
        it are cut first (see _cut_overdue): the core hears of events in their order, as the
        simulator's does."""
        gate = self.gate
        now = gate.clock()
        if gate.policy.cancel_at_deadline:
            self._cut_overdue(now)
        return now

    def arrived(self) -> None:
        """Nothing to set after an arrival: a run's cut timer is set where it starts."""

    def left(self, ticket: _Ticket, state: str | None) -> None:
        """Its client left (``state``: what the core says it was): a running one's engine is asked
        to stop."""
        if state == "running" and ticket.cancel is not None:
            ticket.cancel.set()

    def idle_estimate_s(self, job: Job, base: float) -> float:
        """The job's estimate on an idle engine: the policy's estimator's, at the speed factor or
        the calibrated speed, whichever is faster (a slow spell is the queue's state, and
        passes)."""
        queue = self.gate.queue
        estimator = queue.estimator
        own = (
            base
            if estimator is None
            else estimator.base_s(base, job.max_new_tokens, job.prompt_tokens, None)
        )
        return own * min(1.0, queue.tracker.factor)

    def use_calibration(self, model: ServiceModel, terms: LoadTerms) -> None:
        """Plan with a new calibration: its line, and its engines' slowdown and noise
        (qsim.queue.AdmissionQueue.recalibrate says what starts again)."""
        gate = self.gate
        engine = replace(
            gate.config.engine, concurrency=terms.concurrency, cv=terms.noise_cv or 0.0
        )
        gate.config = gate.config.replace(model=model, engine=engine)
        gate.queue.recalibrate(gate.config)

    # -- the core's start hook, and a run's hand-back --------------------------------------

    def _start(self, k: int, ticket: _Ticket, now: float, est: float) -> None:
        gate = self.gate
        ticket.engine, ticket.start = k, now
        ticket.replica = gate.replica_of(k)
        if ticket.arrival is not None and ticket.arrival.replica != ticket.replica:
            # A central queue's request binds where an engine frees: what it says from now on.
            ticket.arrival = replace(ticket.arrival, replica=ticket.replica)
        ticket.cancel = Cancel()
        if gate.closed:  # shutting down: no worker will take it; close() cancels its future
            return
        # No arrival yet: an idle engine took it inside arrive(), at its arrival time.
        gate.timings.queue.observe(0.0 if ticket.arrival is None else now - ticket.arrival.at)
        ticket.due = gate.queue.cut_at(k)  # the core's rule: its deadline, where the policy cuts
        if math.isfinite(ticket.due):
            # On the loop's clock; call_at, not call_later, so that the gate's and loop's clock
            # being the same one gives the deadline to the last bit. Otherwise (a real clock) the
            # loop's timers come up to a millisecond late (epoll's and uvloop's resolution): this
            # one is set CUT_LEAD_S early, and _cut waits on from there to the deadline itself. The
            # clock is read again, not ``now``: a run started by a cut placed in the past
            # (_cut_overdue) starts at ``now`` for the core, but its timer counts from the loop's
            # present.
            loop = gate.loop
            if gate.clock == loop.time:
                when = ticket.due
            else:
                when = loop.time() + (ticket.due - gate.clock()) - CUT_LEAD_S
            ticket.timer = loop.call_at(when, self._deadline_passed, k, ticket)
        self._workers[k].give(ticket)

    def _post(self, k: int, ticket: _Ticket, result) -> None:
        """Worker -> event loop."""
        try:
            self.gate.loop.call_soon_threadsafe(self._finished, k, ticket, result)
        except RuntimeError:  # the loop closed while the engine ran: nobody is waiting any more
            pass

    def _finished(self, k: int, ticket: _Ticket, result: EngineResult | _Failure) -> None:
        gate = self.gate
        now = self.now()
        if ticket.timer is not None:  # handed back before its deadline: no cut
            ticket.timer.cancel()
            ticket.timer = None
        failed = isinstance(result, _Failure)
        # Before the early return: a stalled (or cancelled) run's time and a failed upstream call
        # count.
        gate.timings.engine.observe(result.engine_s)
        if failed and isinstance(result.error, UpstreamError):
            gate.timings.upstream_errors += 1
        if ticket.released:
            return  # cut at its deadline: the core freed its engine then, and has moved on
        if not failed and result.stopped:  # cut short: its time is no service time
            result = _Failure(RuntimeError("the engine stopped the run unasked"), result.engine_s)
        ok = not isinstance(result, _Failure)
        if self.replicas is not None:
            self.replicas.count_failure(gate.queue.replica_of_engine(k), ok, now)
        # The tokens it generated: what a learning estimator learns (a stop string ends a run
        # early).
        # A run its replica's going down ended (--replica-down) teaches nothing, as the
        # simulator's: it ended as an engine's error.
        taught = ok and not ticket.downed
        outcome = gate.queue.finished(
            k, now, result.engine_s, ok=taught, tokens=result.tokens if taught else None
        )
        if outcome is None:
            return  # ended already: stalled (a hang's time teaches nothing), or its client left
        held = {"started_at": ticket.start, "returned_at": now}
        if isinstance(result, _Failure):
            error = _failure_type(result.error)(
                k, result.error, ticket.arrival, {**held, "engine_s": result.engine_s}
            )
            gate.resolve(ticket, outcome, exc=error, cause=result.error)
            return
        arrival = ticket.arrival
        gate.resolve(
            ticket,
            outcome,
            Answer(
                result.text,
                result.tokens,
                outcome,
                ticket.start - arrival.at,
                result.engine_s,
                now - arrival.at,
                k,
                arrival,
                ticket.start,
                now,
                result.first_token_s,
                result.prompt_tokens,
                ticket.replica,
            ),
        )

    # -- cutting a run at its deadline (Policy.cancel_at_deadline) -------------------

    def _deadline_passed(self, k: int, ticket: _Ticket) -> None:
        ticket.timer = None
        # One loop turn later: a hand-back due at this very instant (already among the ready
        # callbacks) goes first, and a run that ends at its deadline is answered, as the
        # simulator's is.
        self.gate.loop.call_soon(self._cut, k, ticket)

    def _cut(self, k: int, ticket: _Ticket) -> None:
        gate = self.gate
        entry = gate.queue.running[k]
        if gate.closed or entry is None or entry.req is not ticket:
            return  # handed back in time
        now = gate.clock()
        if ticket.due - now > CUT_SLACK_S:
            # Early (set so, see _start; or the loop's clock is coarser than the gate's): wait on
            # to the deadline itself, where the simulator cuts, aiming early again while more than
            # half the lead is left, as a timer can come late. uvloop rounds the last wait down to
            # whole milliseconds, that is to the next turn of the loop: the cut then comes within
            # microseconds of it.
            left = ticket.due - now
            half = left - CUT_LEAD_S / 2
            wait = half if half > CUT_SLACK_S else left  # never a wait of nothing
            ticket.timer = gate.loop.call_later(wait, self._deadline_passed, k, ticket)
            return
        # Placed at the deadline itself (or the start, for a run that started past it), as the
        # simulator places it: the microseconds the loop took to get here would otherwise shift
        # every later start on this engine, and a replay's decisions with them. Nothing the core
        # was told of came in between: now() cuts first.
        self._cut_at(k, ticket, max(ticket.due, ticket.start))

    def _cut_overdue(self, now: float) -> None:
        """Cut, at their deadlines and in their order, the runs whose deadline passed before ``now``
        and whose timer the loop has not come round to yet (a loop late by a fraction of a
        millisecond, an arrival read first): the event at ``now`` then meets the queue the
        simulator's would."""
        queue = self.gate.queue
        while True:
            late = [
                (max(e.req.due, e.req.start), k)
                for k, e in enumerate(queue.running)
                if e is not None and not queue.ended[k] and e.req.due + CUT_SLACK_S < now
            ]
            if not late:
                return
            at, k = min(late)
            ticket = queue.running[k].req
            if ticket.timer is not None:
                ticket.timer.cancel()
                ticket.timer = None
            self._cut_at(k, ticket, at)

    def _cut_at(self, k: int, ticket: _Ticket, now: float) -> None:
        gate = self.gate
        if gate.queue.cut(k, now) is None:
            return  # it had ended already: stalled, or its client left
        ticket.cut = True
        numbers = {
            **ticket.arrival.numbers(),
            "engine": k,
            "started_at": ticket.start,
            "at": now,
            "running_s": now - ticket.start,
        }
        gate.resolve(ticket, Outcome.CANCELLED, exc=DeadlineCut(numbers, ticket.arrival))
        ticket.cancel.set()  # the engine stops (between decode steps, or its wait)
        # Its engine is free at the cut, as the simulator's is: the core gives it its next request
        # now, which the engine's worker starts as soon as the cut run has returned (at once, for
        # an engine that listens to its Cancel). The hand-back of the cut run then only ends it
        # (``released``).
        ticket.released = True
        gate.queue.finished(k, now, now - ticket.start, ok=False)

    # -- the watchdog: stalled engines and the queue behind them ----------------------

    def _watchdog(self) -> None:
        gate = self.gate
        now = self.now()
        for k in gate.queue.overdue(now):
            if self._self_timed[k]:
                continue  # the engine bounds its own runs (an upstream's timeout), not the rule
            ticket = gate.queue.stall(k, now)
            if ticket is not None:
                self._stalled(k, ticket, now)
        gate.queue.give_up(now)
        if self.replicas is not None:
            self.replicas.watch(now)
        if not gate.closed:
            self._watch = gate.loop.call_later(gate.config.watch_interval_s, self._watchdog)

    def _stalled(self, k: int, ticket: _Ticket, now: float) -> None:
        """Engine k ran past its threshold: its request ends now; the engine stays busy until it
        returns."""
        gate = self.gate
        running = now - ticket.start
        est = gate.queue.busy_until[k] - ticket.start
        after = gate.queue.stall_after_s[k]
        stall = gate.config.stall
        numbers = {
            **ticket.arrival.numbers(),
            "engine": k,
            "running_s": running,
            "est_service_s": est,
            "stall_after_s": after,
            "started_at": ticket.start,
            "at": now,
        }
        message = (
            f"engine {k} has run this request for {running:.3f} s, past its stall threshold "
            f"of {after:.3f} s (max of {stall.factor:g} x its {est:.3f} s estimate "
            f"and {stall.floor_s:g} s); the gate stopped waiting for it"
        )
        gate.resolve(ticket, Outcome.ERROR, exc=EngineStalled(message, k, numbers, ticket.arrival))

    # -- observation ------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self.gate.queue.waiting)

    @property
    def queued_work_s(self) -> float:
        return self.gate.queue.queued_work_s

    def health(self) -> dict:
        """Status "ok", or "degraded" with each stalled engine: how long its request has run, and
        its threshold."""
        gate = self.gate
        stalled = gate.queue.stalled_engines(gate.clock())
        return {"status": "degraded" if stalled else "ok", "stalled": stalled}

    def stats(self) -> dict:
        """Nothing beyond the gate's own."""
        return {}

    def step_page(
        self, since: float | None = None, cursor: int | None = None, limit: int = 0
    ) -> dict:
        """No steps: an engine run one request at a time keeps no step log."""
        return {}
