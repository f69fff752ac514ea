"""The live gate as a router: the simulator's own :class:`qsim.fleet.Fleet` as the gate's queue.

A gate given a :class:`~qsim.fleet.FleetSpec` (``Gate(engines, config, fleet=spec)``) drives
N replicas of ``config``'s K engines (its engines list holds replica r's engine k at r * K + k,
the fleet's own numbering): each replica has its own line and admission (its policy, estimator,
speed tracker) and the router (:mod:`qsim.routers`) picks a replica per arrival from each
replica's :class:`~qsim.routers.ReplicaState`, with the fleet's random stream
(:data:`qsim.fleet.ROUTER_STREAM`). The routing is the simulator's code, not a copy: the gate
and ``qsim.simulate(..., replicas=N, router=...)`` drive one :class:`~qsim.fleet.Fleet`. Under
``FleetSpec(admission="gate")`` (``qlab serve --admission-at gate``) that fleet admits once, on
the fleet's state before routing (:mod:`qsim.gate_view`), as ``simulate(..., admission_at="gate")``
does: the same code, so the gate needs nothing of its own for it.

:class:`LiveFleet` adds only what the gate reads of its queue beyond what the simulator reads
(engine lists across the fleet, sums for /stats), and a replica's health: a replica whose
engines are all stalled (the gate's stall rule, :class:`qsim.config.StallRule`) is down, so the
router sends nothing there, and up again once one of its engines hands its run back; so is one
whose engine says what it depends on is not there (:class:`live.engine.Checked`: an upstream that
went away), until its readiness says it is back, and one whose runs fail in a row
(:data:`FAILING_STREAK`), for a pause. :class:`ReplicaWatch`, held by the gate's one-at-a-time
driver (:mod:`live.drive_one`), tells the fleet which replicas are not ready and ends what a replica
held when it went down.

Batching replicas (:func:`batch_fleet_queue`, the batching driver's, :mod:`live.drive_batch`) are
the simulator's fleets of :class:`qsim.batch.BatchQueue` lines too: :class:`LiveBatchFleet` (a
:class:`~qsim.fleet.Fleet` that routes at arrival) or :class:`LiveCentralBatch` (a
:class:`~qsim.batch_fleet.CentralBatch`: one line, each request bound where a replica takes it
into its batch), each read by the gate as it reads one :class:`~qsim.batch.BatchQueue`. Their
replicas' health is watched by the same :class:`ReplicaWatch` (the batching driver's watchdog): a
replica whose step runs past the stall rule (:data:`live.drive_batch.STEP_STALL`), whose engine is
not ready, or whose requests fail in a row is taken out of routing (a central queue binds nothing
there), what it held (its batch, its line) ends once each, and it takes requests again when well.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, replace

from qsim.batch import BatchQueue
from qsim.batch_fleet import CentralBatch
from qsim.config import ServerConfig
from qsim.fleet import Fleet, FleetSpec, offset
from qsim.outcomes import Outcome
from qsim.queue import AdmissionQueue

from .engine import Checked
from .gate_errors import EngineFailed, EngineStalled, ReplicaDown, UpstreamFailed

__all__ = [
    "FAILING_PAUSE_S",
    "FAILING_STREAK",
    "LiveBatchFleet",
    "LiveCentralBatch",
    "LiveFleet",
    "ReplicaWatch",
    "batch_fleet_queue",
    "fleet_queue",
]


def fleet_queue(config: ServerConfig, spec: FleetSpec, *, start, drop, gone, routed) -> "LiveFleet":
    """The gate's queue core for ``spec``'s replicas of ``config`` (K engines each): the gate's
    hooks on each replica's line, its engine numbered across the fleet."""
    per = config.engines

    def line(r: int, cfg: ServerConfig) -> AdmissionQueue:
        return AdmissionQueue(cfg, start=offset(start, r * per), drop=drop, gone=gone)

    return LiveFleet(config, spec, line=line, routed=routed)


class _Readings:
    """What the gate reads of any fleet as of one queue core: the line that decided the last
    arrival (what it saw, its speed tracker), the deadline rule all lines share, and the
    requests in service summed over the replicas."""

    lines: list

    @property
    def seen(self):
        return self.last.seen

    @property
    def tracker(self):
        return self.last.tracker

    def deadline_of(self, deadline_s):
        return self.lines[0].deadline_of(deadline_s)

    @property
    def in_service(self) -> int:
        return sum(line.in_service for line in self.lines)


class _Watched:
    """A fleet whose replicas' health the gate watches (:class:`ReplicaWatch`): one-at-a-time
    replicas' (:class:`LiveFleet`) and batching replicas' (:class:`LiveBatchFleet`,
    :class:`LiveCentralBatch`) alike."""

    def watch(self, now: float, unready=frozenset(), stalled=None) -> list[tuple]:
        """Mark down each replica that is ``stalled`` (None: those whose engines are all stalled,
        the line's own stall rule) or ``unready``, while another is up (the router then sends it
        nothing; a central queue binds nothing there), and up again each that came back. The
        requests a replica held when it went down, (request, "waiting" or "running", replica) each,
        are the gate's to end."""
        if self.router.shared and not self.binds_late:
            return []  # one line in front of every engine: no replica to route around
        if stalled is None:
            stalled = {r for r, line in enumerate(self.lines) if line.all_stalled}
        left = []
        for r in range(len(self.lines)):
            down = r in stalled or r in unready
            # Down or not is the replica's own state (_down): a draining replica is not up (the
            # router skips it) but is not down either, and goes down when it is unwell.
            if self._down[r] and not down:
                self.restore(r, now)
            elif not self._down[r] and down and self._another_up(r):
                left += [(req, state, r) for req, state in self.fail(r, now)]
        return left

    def _another_up(self, r: int) -> bool:
        """Some replica but r is up (the router has somewhere to send)."""
        return any(up for q, up in enumerate(self.up) if q != r)


class LiveFleet(_Readings, _Watched, Fleet):
    """A :class:`~qsim.fleet.Fleet` read as the gate reads one
    :class:`~qsim.queue.AdmissionQueue`."""

    # -- per engine, across the fleet (the gate indexes them by its engine) ---------------

    def _across(self, name: str) -> list:
        return [x for line in self.lines for x in getattr(line, name)]

    @property
    def running(self) -> list:
        return self._across("running")

    @property
    def ended(self) -> list:
        return self._across("ended")

    @property
    def busy_until(self) -> list:
        return self._across("busy_until")

    @property
    def waiting(self) -> list:
        return self._across("waiting")

    def cut_at(self, g: int) -> float:
        line, k = self.line_of(g)
        return line.cut_at(k)

    def overdue(self, now: float) -> list[int]:
        return [
            q * self.per_line + k for q, line in enumerate(self.lines) for k in line.overdue(now)
        ]

    def stalled_engines(self, now: float) -> list[dict]:
        return [
            {**s, "engine": q * self.per_line + s["engine"]}
            for q, line in enumerate(self.lines)
            for s in line.stalled_engines(now)
        ]

    # -- sums -------------------------------------------------------------------------------

    @property
    def queued_work_s(self) -> float:
        return sum(line.queued_work_s for line in self.lines)

    @property
    def all_stalled(self) -> bool:
        """Every replica's engines are all stalled: nothing can move (the gate is not ready). One
        replica stalled is that replica down, not the gate's (see :meth:`watch`)."""
        return all(line.all_stalled for line in self.lines)

    def snapshot(self) -> dict:
        """The fleet's queue summed (the keys of one line's), and each replica's own with
        whether the router sends there."""
        each = [{**line.snapshot(), "up": up} for line, up in zip(self.lines, self.up)]
        total = {
            key: sum(s[key] for s in each)
            for key in ("waiting", "in_service", "stalled", "queued_work_s", "engines")
        }
        return {
            **total,
            "speed_factor": self.speed_factor,
            "router": self.router.name,
            "admission_at": self.spec.admission,
            "replicas": each,
        }

    def recalibrate(self, config: ServerConfig) -> None:
        for line in self.lines:
            engine = replace(config.engine, engines=line.engines)
            line.recalibrate(config.replace(engine=engine))

    # -- a replica's health ---------------------------------------------------------------

    def forget(self, req) -> None:
        """``req`` has ended for the gate: its replica need not be kept (a server runs for days)."""
        self.where.pop(req, None)


#: Runs in a row that fail on one replica of a fleet before the gate takes it out of routing for
#: :data:`FAILING_PAUSE_S` (a replica that fails at once looks idle: load-aware routers would send
#: it everything); then it is sent to again, and one more failure takes it out again.
FAILING_STREAK = 5
FAILING_PAUSE_S = 5.0


class ReplicaWatch:
    """The one-at-a-time driver's watch over a fleet's replicas (:mod:`live.drive_one`): which
    replicas are not ready (their engine's readiness, a streak of failed runs), and ending what a
    replica held when it went down. The driver calls :meth:`watch` from its watchdog and
    :meth:`count_failure` at each hand-back; ``gate`` is the :class:`live.gate.Gate` it reads.

    The batching driver (:mod:`live.drive_batch`) holds one too: its ``stalled(now)`` says which
    replicas' step has run past the stall rule, and why ({replica: why}; None: a line's own rule,
    its engines all stalled), and ``left(ticket, state)`` takes a request out of what its engine
    runs (a batch's: the engine hears of it with its next step) before the watch ends it."""

    def __init__(self, gate, stalled=None, left=None) -> None:
        self.gate = gate
        self._stalled, self._left = stalled, left
        # The replicas whose engine says it is not ready (and why); the question to each.
        self._unready: dict[int, str] = {}
        self._probes: dict[int, asyncio.Task] = {}
        # Per replica: its runs that failed in a row, and until when a streak of them keeps it
        # out of routing.
        self._failing = [0] * gate.fleet.replicas
        self._paused: dict[int, float] = {}
        # --replica-down's and --replica-drain's windows (FleetSpec.down, .drain), in seconds
        # since the gate started (start()).
        self._zero = 0.0
        self._timers: list[asyncio.TimerHandle] = []

    def start(self, now, after=lambda: None) -> None:
        """Count --replica-down's and --replica-drain's windows from now (the gate's start, as the
        simulator's from its time 0), and at each window's ends (``at``, gate clock) turn it at
        that very time (``now``: the driver's clock read for an event; a loop timer early by its
        clock's resolution is placed at ``at``): a down window's :meth:`watch`, a drain's the
        fleet's ``drain(r)`` and ``end_drain(r, at)`` (the simulator's own; a central line's
        replica back takes from it), then ``after()`` (the driver's own, e.g. its timers), so that
        a replica goes down or drains and comes back at those very times. Down windows first, as
        the simulator's timers (qsim.driver)."""
        fleet, self._zero = self.gate.fleet, self.gate.clock()
        for _, down_s, up_s in fleet.down:
            for seconds in (down_s, up_s):
                self._at(seconds, self._turn, now, after)
        for r, from_s, to_s in fleet.drain:
            self._at(from_s, self._drain, r, True, now, after)
            self._at(to_s, self._drain, r, False, now, after)

    def _at(self, seconds: float, turn, *args) -> None:
        """``turn(at, *args)`` on a loop timer at ``seconds`` after the gate's start (``at``: that
        time on the gate's clock)."""
        gate = self.gate
        loop, at = gate.loop, self._zero + seconds
        # call_at where the gate's clock is the loop's (to the last bit, as the drivers' cut
        # timers); a loop timer comes up to its clock's resolution early, and the driver then
        # places the event at ``at`` itself, as the simulator's.
        when = at if gate.clock == loop.time else loop.time() + (at - gate.clock())
        self._timers.append(loop.call_at(when, turn, at, *args))

    def _turn(self, at: float, now, after) -> None:
        """A --replica-down window begins or ends (see :meth:`start`)."""
        if not self.gate.closed:
            self.watch(max(now(), at))
            after()

    def _drain(self, at: float, r: int, begins: bool, now, after) -> None:
        """Replica r's --replica-drain window begins or ends (see :meth:`start`): what it holds
        stays and runs out either way."""
        if not self.gate.closed:
            if begins:
                self.gate.queue.drain(r)
            else:
                self.gate.queue.end_drain(r, max(now(), at))
            after()

    @property
    def zero(self) -> float:
        """The gate's clock when --replica-down's and --replica-drain's seconds began."""
        return self._zero

    def _scheduled(self, now: float) -> dict[int, str]:
        """The replicas --replica-down keeps down now, and why."""
        since = now - self._zero
        return {
            r: f"down from {a:g} s to {b:g} s after the gate started (--replica-down)"
            for r, a, b in self.gate.fleet.down
            if a <= since < b
        }

    def close(self) -> None:
        """Stop asking the replicas' engines whether they are ready."""
        for probe in self._probes.values():
            probe.cancel()
        for timer in self._timers:
            timer.cancel()

    def watch(self, now: float) -> None:
        """A replica whose engines are all stalled, or whose engine is not ready, goes down (the
        router sends it nothing) and comes back when it is well (LiveFleet.watch); what it held
        ends now: an error of the stall or of the upstream."""
        gate = self.gate
        self._probe_replicas()
        scheduled = self._scheduled(now)
        unready = {**self._failing_now(now), **self._unready, **scheduled}
        stalled = None if self._stalled is None else self._stalled(now)
        for ticket, state, r in gate.queue.watch(now, unready, stalled):
            if self._left is not None:
                self._left(ticket, state)
            elif state == "running" and ticket.cancel is not None and r not in scheduled:
                ticket.cancel.set()  # nobody waits for it now: the engine may stop
            waited = now - ticket.arrival.at
            numbers = {**ticket.arrival.numbers(), "waited_s": waited}
            problem = unready.get(r)
            if r in scheduled:
                exc = _down(ticket, state, r, scheduled[r], now, numbers)
            elif problem is None:
                why = "every engine is stalled" if stalled is None else stalled[r]
                message = (
                    f"replica {r}'s {why}; the gate took it out of "
                    f"routing and ended this request after {waited:.3f} s; send it again"
                )
                exc = EngineStalled(message, None, numbers, ticket.arrival)
            else:
                k = r * gate.queue.engines_per_replica
                exc = UpstreamFailed(
                    k, RuntimeError(f"replica {r} is not ready: {problem}"), ticket.arrival, numbers
                )
            gate.resolve(ticket, Outcome.ERROR, exc=exc)

    def count_failure(self, r: int, ok: bool, now: float) -> None:
        """Replica r's run ended ``ok`` or failed: :data:`FAILING_STREAK` failures in a row pause it
        for :data:`FAILING_PAUSE_S` (an answer ends the streak)."""
        if ok:
            self._failing[r] = 0
            self._paused.pop(r, None)
            return
        self._failing[r] += 1
        if self._failing[r] >= FAILING_STREAK and r not in self._paused:
            self._paused[r] = now + FAILING_PAUSE_S

    def _failing_now(self, now: float) -> dict[int, str]:
        """The replicas a streak of failures keeps out of routing now, and why."""
        for r in [r for r, until in self._paused.items() if until <= now]:
            del self._paused[r]  # sent to again; its next failure pauses it once more
            self._failing[r] = FAILING_STREAK - 1
        return {
            r: f"its last {self._failing[r]} runs failed; sent to again in {until - now:.1f} s"
            for r, until in self._paused.items()
        }

    def _probe_replicas(self) -> None:
        """Ask each replica's engine that can tell (live.engine.Checked: an upstream's, which
        answers from what its last run or probe learned, probing at most every few seconds)
        whether it is ready; one question per replica at a time."""
        gate = self.gate
        per = gate.queue.engines_per_replica
        for r in range(gate.fleet.replicas):
            engine, probe = gate.engines[r * per], self._probes.get(r)
            if isinstance(engine, Checked) and (probe is None or probe.done()):
                self._probes[r] = gate.loop.create_task(self._probe(r, engine))

    async def _probe(self, r: int, engine: Checked) -> None:
        problem = await engine.readiness()
        if problem is None:
            self._unready.pop(r, None)
        else:
            self._unready[r] = problem


def _down(ticket, state: str, r: int, why: str, now: float, numbers: dict) -> Exception:
    """What a request held by replica r ends with when --replica-down takes it down, as the
    simulator's replica_down ends it: a run, the engine's error (engine_exception; one at a time
    its engine runs it out, as the simulator's, so no hand-back is said), a request waiting, the
    error of a server that stopped while it waited (shutting_down)."""
    if state == "running":
        ticket.downed = True  # its engine's hand-back teaches nothing, as the simulator's
        ran = {"started_at": ticket.start, "at": now, "running_s": now - ticket.start}
        error = RuntimeError(f"replica {r} is {why}")
        return EngineFailed(ticket.engine, error, ticket.arrival, ran)
    message = f"replica {r} is {why}; this request waited there {numbers['waited_s']:.3f} s"
    return ReplicaDown(message + "; send it again", numbers, ticket.arrival)


def batch_fleet_queue(config: ServerConfig, spec: FleetSpec, *, line, routed) -> Fleet:
    """The gate's queue core for ``spec``'s batching replicas of ``config``: ``line(r, config,
    make)`` builds replica r's core (``make``: :class:`~qsim.batch.BatchQueue`, or a central
    queue's :class:`~qsim.batch_fleet.Replica`) with the driver's hooks for r, as the simulator's
    batching run builds its own (qsim.run_batching)."""
    if spec.router.shared:
        return LiveCentralBatch(config, spec, line=line, routed=routed)
    return LiveBatchFleet(config, spec, line=lambda r, cfg: line(r, cfg, BatchQueue), routed=routed)


class _BatchReadings(_Readings):
    """What the gate reads of a fleet of batching replicas beyond what the simulator reads: as of
    one :class:`~qsim.batch.BatchQueue`, summed over the replicas."""

    lines: list
    up: list

    def forget(self, req) -> None:
        """``req`` has ended for the gate: its replica need not be kept."""
        self.where.pop(req, None)

    @property
    def queued(self) -> int:
        """Requests waiting anywhere in the fleet (a central line's too)."""
        return sum(line.queued for line in self.lines)

    @property
    def kv_used(self) -> int:
        return sum(line.kv_used for line in self.lines)

    @property
    def kv_use(self) -> float:
        """The replicas' KV use, averaged (each its own memory)."""
        return sum(line.kv_use for line in self.lines) / len(self.lines)

    def snapshot(self) -> dict:
        """One batching core's keys, summed over the replicas (the KV use averaged; a prefix
        cache's counters summed), and each replica's own with whether the router sends there and
        its step model (a fleet of upstreams learns one per server)."""
        each = [
            {**line.snapshot(), "up": up, "step": asdict(line.model)}
            for line, up in zip(self.lines, self.up)
        ]
        total = {
            key: sum(s[key] for s in each)
            for key in ("in_service", "stalled", "queued_work_s", "engines", "kv_blocks_used")
        }
        return {
            **total,
            "waiting": self.queued,
            "kv_use": self.kv_use,
            "speed_factor": self.speed_factor,
            "router": self.router.name,
            "admission_at": self.spec.admission,
            "replicas": each,
            **(self.prefix_cache_stats() or {}),
        }


class LiveBatchFleet(_Watched, _BatchReadings, Fleet):
    """A :class:`~qsim.fleet.Fleet` of batching replicas read as the gate reads one
    :class:`~qsim.batch.BatchQueue`."""

    @property
    def waiting(self) -> list:
        """Every replica's line, in replica order (what the gate drains)."""
        return [entry for line in self.lines for entry in line.waiting]


class LiveCentralBatch(_Watched, _BatchReadings, CentralBatch):
    """A :class:`~qsim.batch_fleet.CentralBatch` read as the gate reads one
    :class:`~qsim.batch.BatchQueue` (its ``waiting``: the fleet's one line)."""

    @property
    def queued(self) -> int:
        return CentralBatch.queued.fget(self)
