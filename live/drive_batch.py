"""The gate's driver for an engine that batches: :class:`BatchDriver`.

It drives :class:`qsim.batch.BatchQueue`, the core the simulator's batching run drives on SimPy's
clock (so admission, batch membership, KV blocks, preemption and cuts at the deadline follow one
set of rules in both), and runs each step the core plans on the engine's
:class:`~live.engine_workers.Worker` (``astep`` as a task for a coroutine engine, else ``step`` on
a thread of its own):

* the core plans a step (its ``step`` hook): the driver hands the engine a
  :class:`~live.batching.StepWork` and the engine hands back a :class:`~live.batching.StepDone`;
  the driver tells the core (``step_done``, with the engine's own time for the speed tracker),
  which ends the requests the step finished and plans the next;
* an idle engine woken by an arrival begins its first step one loop turn later, so that a burst
  arriving at one instant starts in one step (the core's ``wake``, as the simulator's zero
  timeout);
* a client leaves: its request leaves the line or the batch (its blocks free for the next step);
* the core's timer (a joined request's deadline, where the policy cuts there) is a loop timer.

Steps never overlap: the core plans the next only when the last is done. The driver keeps the
last :data:`STEP_LOG` steps for ``GET /stats?steps_since=`` (:meth:`BatchDriver.step_page`).

A fleet (``Gate(engines, config, fleet=spec)``, one batching engine per replica): the core is the
simulator's fleet of batching lines (:func:`live.fleet_gate.batch_fleet_queue`: a
:class:`qsim.fleet.Fleet` whose router, :mod:`qsim.routers`, picks a replica per arrival, or a
:class:`qsim.batch_fleet.CentralBatch`), each replica with its own engine, worker, steps and
timer, as the simulator's batching run (qsim.run_batching) has them. Replica r is engine r. The
step log holds every replica's steps in the order the cores planned them, as a replay
(``simulate(step_times=)``) takes them: a step is logged once those planned before it have ended.
A fleet's replicas are watched as the one-at-a-time driver's are
(:class:`live.fleet_gate.ReplicaWatch`, every ``watch_interval_s``): a step past
:data:`STEP_STALL`, an engine not ready, or a streak of failed requests takes a replica out of
routing until it is well; what it held ends then.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
from collections import deque
from dataclasses import astuple, replace
from functools import partial

from qsim.batch import BatchQueue, RunStats, Step
from qsim.config import ServerConfig, StallRule
from qsim.engines import Batching, StepModel
from qsim.outcomes import Outcome
from qsim.runfile import LoggedStep
from qsim.service import LoadTerms, ServiceModel

from .batching import (
    STEP_LOG,
    STEP_PAGE,
    Chunk,
    HasTokenIds,
    Releases,
    StepDone,
    StepWork,
    is_batch_engine,
)
from .drive_one import CUT_SLACK_S
from .engine import SelfTimed, abilities_of
from .engine_workers import Worker, _Failure, _gone, _Ticket, closed
from .fleet_gate import ReplicaWatch, batch_fleet_queue
from .gate_errors import DeadlineCut, _failure_type
from .jobs import Answer, Job


#: A fleet's replica whose step has run past ``STEP_STALL.after_s(its model's seconds)`` is stalled
#: (the one-at-a-time gate's rule, live.gate.GATE_STALL, on a step): taken out of routing until the
#: step comes back. One batching engine has no stall rule (a hang ends: see live.batching).
STEP_STALL = StallRule()


def step_worker(k: int, engine, deliver) -> Worker:
    """The batching engine's worker: each :class:`StepWork` given becomes one ``astep`` task (a
    coroutine engine) or one ``step`` on a thread of its own, delivered as ``deliver(work,
    result)``."""
    coroutine = abilities_of(engine).coroutine
    return Worker(
        "qlab-batch-engine",
        engine.astep if coroutine else engine.step,
        deliver,
        coroutine=coroutine,
        engine=engine,
    )


class BatchDriver:
    """One batching engine (:class:`live.batching.BatchEngine`) behind
    :class:`qsim.batch.BatchQueue`, or a fleet's, one per replica; see the module. The config's
    engine is a :class:`qsim.engines.Batching` (its step model is the gate's calibration; the
    engine has its own truth), each replica's. ``worker(k, engine, deliver)``: engine k's worker
    (default :func:`step_worker`)."""

    def __init__(self, gate, worker=None) -> None:
        engines = gate.engines
        for engine in engines:
            if not is_batch_engine(engine):
                raise ValueError(
                    "a batching gate needs an engine that runs steps "
                    f"(live.batching.BatchEngine), not {type(engine).__name__}"
                )
        n = 1 if gate.fleet is None else gate.fleet.replicas
        if len(engines) != n:
            raise ValueError(
                "a batching engine is one engine"
                if gate.fleet is None
                else f"a fleet of {n} batching replicas runs one engine each, not {len(engines)}"
            )
        self.gate = gate
        self._make_worker = step_worker if worker is None else worker
        self._workers: list = []
        self._closing: list = []
        self.lines: list = []  # each replica's core (one: the gate's queue itself)
        # Per replica (engine): its core's timer and when it is set.
        self._timer: list[asyncio.TimerHandle | None] = [None] * n
        self._timer_at = [math.inf] * n
        # Per replica: out of the batch for good since its last step (StepWork.ended).
        self._ended: list[list] = [[] for _ in range(n)]
        self.steps = 0
        # The last STEP_LOG steps (qsim.runfile.LoggedStep's fields, as plain tuples: see
        # log_step): for a replay and a calibration (step_page).
        self.step_log: deque[tuple] = deque(maxlen=STEP_LOG)
        self.logged = 0  # steps ever logged: the cursor of the step after the newest (step_page)
        # A fleet's: each replica's step in flight by its number in plan order, and the steps
        # ended before one planned earlier (the log is in plan order, as a replay takes it).
        self._in_flight = [-1] * n
        self._ended_early: dict[int, LoggedStep] = {}
        # (the step's cursor, the model from it on)
        self.step_models: list[tuple[int, StepModel]] = []
        # Per replica: its idle engine was woken then, and not begun yet (None: not so); its step
        # in flight's wake and start, for the step log.
        self._woken_at: list[float | None] = [None] * n
        self._began = [(math.nan, math.nan)] * n
        # A fleet's replicas' health (live.fleet_gate.ReplicaWatch, the one-at-a-time driver's):
        # a replica whose step stalls, whose engine is not ready, or whose runs fail in a row is
        # taken out of routing, what it held ends, and it is routed to again once it is well.
        self._watch: asyncio.TimerHandle | None = None
        self._self_timed = [isinstance(e, SelfTimed) for e in engines]
        self.replicas = (
            None
            if gate.fleet is None
            else ReplicaWatch(gate, stalled=self._stalled_steps, left=self._held_left)
        )

    # -- what the gate runs ------------------------------------------------------------

    def fitted(self, config: ServerConfig) -> ServerConfig:
        if not isinstance(config.engine, Batching):
            raise ValueError(
                "a batching gate runs a batching engine (qsim.engines.Batching), "
                f"not {config.engine.kind}"
            )
        if config.engine.prefix_caching:
            lacking = [e for e in self.gate.engines if not isinstance(e, HasTokenIds)]
            if lacking:
                raise ValueError(
                    "prefix caching needs an engine that says its requests' token ids and "
                    "computes only what is not cached (live.batching.HasTokenIds: the synthetic "
                    f"batching engine), not {type(lacking[0]).__name__}"
                )
        fleet = self.gate.fleet
        if fleet is not None:
            fleet.check(config)
        return config

    def make_queue(self, config: ServerConfig):
        """The batching core (a fleet's: each replica's, behind the router), naming the decoding
        requests in each step (the engine needs them)."""
        gate = self.gate

        def line(r: int, cfg: ServerConfig, make=BatchQueue) -> BatchQueue:
            return make(
                cfg,
                step=lambda plan, now: self._step(plan, now, r),
                end=lambda ticket, now, outcome, reason, stats: self._ended_run(
                    ticket, now, outcome, reason, stats, r
                ),
                drop=gate.dropped,
                joined=lambda ticket, now: self._joined(ticket, now, r),
                wake=lambda now: self._wake(now, r),
                gone=_gone,
                members=True,
                tokens=self._tokens if cfg.engine.prefix_caching else None,
            )

        if gate.fleet is None:
            queue = line(0, config)
            self.lines = [queue]
            return queue
        queue = batch_fleet_queue(config, gate.fleet, line=line, routed=self._routed)
        self.lines = queue.lines
        return queue

    def _routed(self, ticket: _Ticket, r: int) -> None:
        ticket.replica = r

    def _tokens(self, ticket: _Ticket):
        """With a prefix cache, the core's ``tokens`` hook: the request's token ids, as its engine
        says them (:class:`~live.batching.HasTokenIds`; one rule for every replica's, so the
        first engine's), asked once."""
        if ticket.tokens is None:
            ticket.tokens = self.gate.engines[0].token_ids(ticket.job)
        return ticket.tokens

    # -- life cycle -----------------------------------------------------------------

    def start(self) -> None:
        """Start each engine's worker, and a fleet's watchdog (one engine has no stall rule)."""
        gate = self.gate
        self._workers = [
            self._make_worker(r, engine, partial(self._post_step, r))
            for r, engine in enumerate(gate.engines)
        ]
        for w in self._workers:
            w.start()
        if self.replicas is not None:
            self._watch = gate.loop.call_later(gate.config.watch_interval_s, self._watchdog)
            # after a window's turn, the timers again: the deadlines cut on a replica gone down
            # are gone, as the simulator's after_down
            self.replicas.start(self.now, self._arm_all)

    def close(self, timeout_s: float) -> None:
        """Stop the cores' timers, cancel every pending future and stop the workers."""
        for timer in self._timer:
            if timer is not None:
                timer.cancel()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self.replicas is not None:
            self.replicas.close()
        queue = self.gate.queue
        tickets = []
        if getattr(queue, "binds_late", False):  # a central queue's own line
            tickets += [*(e.req for e in queue.waiting), *(s.entry.req for s in queue.front)]
        for q in self.lines:
            tickets += [
                *(e.req for e in q.waiting),
                *(s.entry.req for s in q.front),
                *(s.entry.req for s in q.running.values()),
            ]
        for ticket in tickets:
            if ticket.future is not None:
                ticket.future.cancel()
        for w in self._workers:
            w.stop(timeout_s / len(self._workers))
        self._closing, self._workers = self._workers, []

    async def aclose(self) -> None:
        await closed(self._closing)
        self._closing = []

    # -- events -------------------------------------------------------------------------

    def now(self) -> float:
        """The clock, read once for an event the core is told of; deadlines passed before it are cut
        first (placed at their deadlines by the core), so that the core hears of events in their
        order, as the simulator's."""
        now = self.gate.clock()
        lines = self.lines
        while True:  # each replica's, earliest first
            due, r = min((line.next_timer(), r) for r, line in enumerate(lines))
            if not due < now:
                return now
            lines[r].timer(due)  # at its own time: an idle engine it frees is woken then

    def arrived(self) -> None:
        """After an arrival: the cores' timers, where they moved earlier."""
        gate = self.gate
        if not gate.closed and gate.loop is not None:
            self._arm_all()

    def left(self, ticket: _Ticket, state: str | None) -> None:
        """Its client left: it leaves the line, or the batch (its blocks free)."""
        if state == "running":
            self._ended[ticket.engine].append(ticket)
            self._release(ticket)
        self._arm_all()

    def idle_estimate_s(self, job: Job, base: float) -> float:
        """No "never in time" here: the gate's service line is not what a batching engine's steps
        take, so a refusal keeps the core's reason (deadline_unreachable), as the simulator's."""
        return 0.0

    def use_calibration(self, model: ServiceModel, terms: LoadTerms) -> None:
        """A new calibration: its line, and its step model where it has one (an upstream's learner
        replaces that at its next refit, unless it has settled)."""
        gate = self.gate
        gate.config = gate.config.replace(model=model)
        if terms.step is not None:
            self.use_step_model(terms.step)

    def use_step_model(
        self, step: StepModel, replica: int | None = None, after: int | None = None
    ) -> None:
        """Plan with ``step`` from now on: the next admission and the next step read it. A new
        calibration, or one server's learner (live.upstream_batch), moves every line and /stats's
        server_config; a fleet's replica's learner (``replica``: each upstream learns its own
        server's steps) moves that replica's line alone, as the simulator's replay moves the line
        whose step took the model (qsim.run_batching). ``after``: the number of the step it
        follows in plan order (default: the steps logged so far)."""
        gate = self.gate
        if replica is None:
            for line in self.lines:
                line.model = step
            gate.config = replace(gate.config, engine=replace(gate.config.engine, step=step))
        else:
            self.lines[replica].model = step
        # Planned with from the step numbered ``after`` on: the step log's pages say it.
        self.step_models.append((self.logged if after is None else after, step))

    # -- the core's hooks -------------------------------------------------------------

    def _joined(self, ticket: _Ticket, now: float, r: int) -> None:
        ticket.engine, ticket.start = r, now
        if self.gate.fleet is not None:
            ticket.replica = r
            if ticket.arrival is not None and ticket.arrival.replica != r:
                # A central queue's request binds where a replica takes it: what it says from now.
                ticket.arrival = replace(ticket.arrival, replica=r)
        # No arrival yet: it joined inside arrive(), at its arrival time.
        self.gate.timings.queue.observe(0.0 if ticket.arrival is None else now - ticket.arrival.at)

    def _wake(self, now: float, r: int) -> None:
        # One loop turn later, as the simulator's zero timeout: arrivals at this same instant join
        # the first step. For the core the step begins then; the engine was busy from ``now`` (the
        # step log's start, see _step).
        self._woken_at[r] = now
        self.gate.loop.call_soon(self._begin, r)

    def _begin(self, r: int) -> None:
        if self.gate.closed:
            return
        self.lines[r].begin(self.now())
        self._arm(r)

    def _step(self, plan: Step, now: float, r: int) -> None:
        if self.gate.closed:
            return
        self._in_flight[r] = self.steps
        self.steps += 1
        # The step log's: when an idle engine was woken for it (else now), and when the core began
        # it (the loop turn in between decides which arrivals join the first step: a replay waits
        # it too).
        woken = self._woken_at[r]
        self._began[r], self._woken_at[r] = (now if woken is None else woken, now), None
        prefill = tuple(
            Chunk(t, t.job, start, n) for (t, n), start in zip(plan.chunks, plan.starts)
        )
        work = StepWork(
            prefill,
            plan.decoding,
            plan.prefill_tokens,
            plan.sampling,
            plan.context,
            plan.model_s,
            tuple(self._ended[r]),
            plan.completing,
        )
        self._ended[r] = []
        self._workers[r].give(work)

    def _post_step(self, r: int, work: StepWork, result) -> None:
        """Worker -> event loop."""
        try:
            self.gate.loop.call_soon_threadsafe(self._step_finished, r, work, result)
        except RuntimeError:  # the loop closed while the engine ran: nobody is waiting any more
            pass

    def _step_finished(self, r: int, work: StepWork, result: StepDone | _Failure) -> None:
        gate = self.gate
        if gate.closed:
            return
        now = self.now()
        line = self.lines[r]
        if isinstance(result, _Failure):  # the whole step raised: every request in it fails
            failed = dict.fromkeys(
                (*(chunk.key for chunk in work.prefill), *work.decode), result.error
            )
            finished = {}
        else:
            failed, finished = result.failed, result.finished
            for ticket, tokens in result.prompt_tokens.items():
                ticket.prompt_tokens = tokens
            for ticket, piece in result.pieces.items():  # before the step's ends: a last piece, END
                if ticket.pieces is not None and not ticket.future.done():
                    ticket.pieces.put_nowait(piece)
        if self.replicas is not None:  # a streak of failed requests pauses the replica
            for ticket in failed:
                self.replicas.count_failure(r, False, now)
            if finished:
                self.replicas.count_failure(r, True, now)
        for ticket, error in failed.items():
            if line.cancel(ticket, now) == "running":  # out of the batch, its blocks free
                self._ended[r].append(ticket)
                numbers = {"started_at": ticket.start, "returned_at": now}
                # An upstream's failure is the one-at-a-time gate's (502 upstream_error, 504
                # upstream_timeout).
                failure = _failure_type(error)(r, error, ticket.arrival, numbers)
                gate.resolve(ticket, Outcome.ERROR, exc=failure, cause=error)
        for ticket, tokens in finished.items():
            line.finish(ticket, now, tokens)
        self._log_in_order(
            self._in_flight[r],
            LoggedStep(
                *self._began[r],
                now,
                result.engine_s,
                work.model_s,
                work.prefill_tokens,
                work.sampling,
                work.context,
            ),
        )
        if not isinstance(result, _Failure) and result.step_model is not None:
            fleet = self.gate.fleet is not None
            self.use_step_model(result.step_model, r if fleet else None, self._in_flight[r] + 1)
        line.step_done(now, result.engine_s)
        self._arm(r)

    def _ended_run(
        self, ticket: _Ticket, now: float, outcome: str, reason: str | None, stats: RunStats, r: int
    ) -> None:
        """A request that joined the batch ended: answered (good or late), or cut at its
        deadline."""
        gate = self.gate
        self._ended[r].append(ticket)
        held = now - stats.start_s
        gate.timings.engine.observe(held)
        arrival = ticket.arrival
        if outcome == Outcome.CANCELLED:
            ticket.cut = True
            self._release(ticket)
            numbers = {
                **arrival.numbers(),
                "engine": r,
                "started_at": stats.start_s,
                "at": now,
                "running_s": held,
            }
            gate.resolve(ticket, outcome, exc=DeadlineCut(numbers, arrival))
            return
        text = gate.engines[r].text(ticket, ticket.job, stats.tokens)
        first = None if math.isnan(stats.first_token_s) else stats.first_token_s - stats.start_s
        gate.resolve(
            ticket,
            outcome,
            Answer(
                text,
                stats.tokens,
                outcome,
                stats.start_s - arrival.at,
                held,
                now - arrival.at,
                r,
                arrival,
                stats.start_s,
                now,
                first,
                ticket.prompt_tokens,
                ticket.replica,
                None if stats.cached_tokens < 0 else stats.cached_tokens,
            ),
        )

    def _release(self, ticket: _Ticket) -> None:
        """Out of the batch before its end (cut, or its client left): an engine that holds something
        for it lets it go now (:class:`~live.batching.Releases`); every engine hears of it with the
        next step (StepWork.ended)."""
        engine = self.gate.engines[ticket.engine]
        if isinstance(engine, Releases):
            engine.release(ticket)

    # -- the core's timer (cutting at the deadline) ----------------------------------------

    def _arm_all(self) -> None:
        for r in range(len(self.lines)):
            self._arm(r)

    def _arm(self, r: int) -> None:
        """A loop timer at replica r's core's next timer, where that is earlier than the one set
        (as the simulator's)."""
        gate = self.gate
        if gate.closed:
            return
        due = self.lines[r].next_timer()
        if due < self._timer_at[r]:
            if self._timer[r] is not None:
                self._timer[r].cancel()
            self._timer_at[r] = due
            # On the loop's clock: call_at, so that the gate's and the loop's clock being one gives
            # the deadline to the last bit (a test's virtual clock); a real clock's timer comes up
            # to a millisecond late.
            loop = gate.loop
            when = due if gate.clock == loop.time else loop.time() + (due - gate.clock())
            self._timer[r] = loop.call_at(when, self._on_timer, due, r)

    def _on_timer(self, due: float, r: int) -> None:
        gate = self.gate
        self._timer[r], self._timer_at[r] = None, math.inf
        if gate.closed:
            return
        if due - gate.clock() > CUT_SLACK_S:
            # Early: a loop whose clock is coarser than the gate's (uvloop's is libuv's, cached a
            # loop turn, in milliseconds) fires a timer up to its staleness before the gate's clock
            # gets there. Wait on: a cut before its deadline would free blocks the simulator's core
            # still counts.
            self._arm(r)
            return
        # At the deadline itself, though the loop came round to it later: the core cuts there, and
        # an idle engine it frees is woken there (the step log's wake), as the simulator's; nothing
        # else came in between (now()).
        self.lines[r].timer(due)
        self._arm(r)

    # -- a fleet's watchdog: its replicas' health ------------------------------------------

    def _watchdog(self) -> None:
        gate = self.gate
        self._watch = None
        if gate.closed:
            return
        self.replicas.watch(self.now())
        self._arm_all()  # deadlines cut on a replica gone down are gone
        if not gate.closed:
            self._watch = gate.loop.call_later(gate.config.watch_interval_s, self._watchdog)

    def _step_stalls(self, now: float) -> list[dict]:
        """A fleet's replicas whose step in flight has run past its stall rule
        (:data:`STEP_STALL`): how long, its threshold and its model's seconds; an engine that
        bounds its own steps (an upstream's timeout) is left to do so. One engine: none."""
        if self.replicas is None:
            return []
        stalls = []
        for r, line in enumerate(self.lines):
            plan = line.plan
            if plan is None or self._self_timed[r]:
                continue
            running, after = now - line.plan_started, STEP_STALL.after_s(plan.model_s)
            if running > after:
                stalls.append(
                    {
                        "engine": r,
                        "running_s": running,
                        "stall_after_s": after,
                        "est_service_s": plan.model_s,
                    }
                )
        return stalls

    def _stalled_steps(self, now: float) -> dict[int, str]:
        """The replicas whose step has stalled (:meth:`_step_stalls`), and why."""
        return {
            s["engine"]: (
                f"step has run {s['running_s']:.3f} s, past its stall threshold of "
                f"{s['stall_after_s']:.3f} s (max of {STEP_STALL.factor:g} x its "
                f"{s['est_service_s']:.3f} s estimate and {STEP_STALL.floor_s:g} s)"
            )
            for s in self._step_stalls(now)
        }

    def _held_left(self, ticket: _Ticket, state: str) -> None:
        """A request of a replica gone down left it (live.fleet_gate.ReplicaWatch ends it): out of
        its engine's batch, as a client's that left."""
        if state == "running":
            self._ended[ticket.engine].append(ticket)
            self._release(ticket)

    # -- observation ------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self.gate.queue.queued  # a fleet's: everywhere (live.fleet_gate)

    @property
    def queued_work_s(self) -> float:
        return math.nan

    def health(self) -> dict:
        """ "ok", or for a fleet "degraded" with each replica whose step has stalled (its engine r:
        how long the step has run, its threshold, its model's seconds); one batching engine is
        always "ok": it has no stall rule (a hang ends, see live.batching)."""
        stalled = self._step_stalls(self.gate.clock())
        return {"status": "degraded" if stalled else "ok", "stalled": stalled}

    def stats(self) -> dict:
        """``batching``: the batch and its KV blocks now, the steps so far (their log comes a page
        at a time: :meth:`step_page`)."""
        queue, engine = self.gate.queue, self.gate.config.engine
        # A fleet's: summed over its replicas, each replica's batch and blocks its own.
        return {
            "batching": {
                "running": queue.in_service,
                "max_num_seqs": engine.max_num_seqs,
                "kv_blocks_used": queue.kv_used,
                "kv_blocks": engine.kv_blocks,
                "block_size": engine.block_size,
                "kv_use": queue.kv_use,
                "steps": self.steps,
            }
        }

    def step_page(
        self, since: float | None = None, cursor: int | None = None, limit: int = STEP_PAGE
    ) -> dict:
        """At most ``limit`` steps of the log, oldest first, each as [woken, began, ended, the
        engine's seconds, the step model's seconds, prefill tokens, sequences sampling, context
        tokens] (:class:`qsim.runfile.LoggedStep`) on the gate's clock: when an arrival woke the
        idle engine for it (its start where it followed a step), when the core began it, when the
        gate had it back (what ``qlab compare`` replays with), and what it computed (what ``qlab
        calibrate`` fits a step model to). The steps are those woken for at ``since`` or later
        (gate clock), or from ``cursor`` on (a number a page before answered); ``step_log_next``:
        the cursor of the next page (None: this page ends the log). A cursor is a step's number
        since the gate started, so a page never repeats or skips a step, even among steps woken
        at the same time; one older than the log holds starts at its oldest. ``step_models``: the
        step models the gate took while these steps ran (a learner's refit, a new calibration),
        each as [the steps of this page before it, b0, b1, b2, b3, cv]: it planned every step
        after those with it (:func:`qsim.runfile.batch_step_times`)."""
        oldest = self.logged - len(self.step_log)
        if cursor is not None:
            start = max(cursor - oldest, 0)
        else:  # woken times never go back (woken at or after the last one ended): bisect, no scan
            start = bisect.bisect_left(self.step_log, since, key=lambda step: step[0])  # woken
        page = self._steps(start, min(start + limit, len(self.step_log)))
        first = oldest + start
        after = first + len(page)
        models = [
            [at - first, *astuple(step)] for at, step in self.step_models if first < at <= after
        ]
        return {
            "step_log": page,
            "step_log_next": after if after < self.logged else None,
            "step_models": models,
        }

    def _steps(self, start: int, end: int) -> list[tuple]:
        """The log's steps ``start`` to ``end``, walked from its nearer end (islice walks a deque
        from its left: a page near the newest would first pass 200,000 steps)."""
        if start > len(self.step_log) // 2:
            n = len(self.step_log)
            return list(itertools.islice(reversed(self.step_log), n - end, n - start))[::-1]
        return list(itertools.islice(self.step_log, start, end))

    def _log_in_order(self, k: int, step: LoggedStep) -> None:
        """Log step ``k`` (its number in plan order) once every step planned before it is logged:
        a fleet's replicas end their steps in another order than they planned them, and a replay
        (``simulate(step_times=)``) gives the k-th step planned the k-th time logged."""
        if k != self.logged:
            self._ended_early[k] = step
            return
        self.log_step(step)
        while self.logged in self._ended_early:
            self.log_step(self._ended_early.pop(self.logged))

    def log_step(self, step: LoggedStep) -> None:
        """Keep ``step`` in the log, as a plain tuple: pydantic writes a NamedTuple's JSON about
        four times slower than a tuple's, and copying a page out of its steps cost as much again
        (the JSON is the same)."""
        self.step_log.append(tuple(step))
        self.logged += 1
