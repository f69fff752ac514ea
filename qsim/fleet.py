"""A fleet: N replicas of one server, each its own line, engines and admission, and a router.

:class:`Fleet` answers its driver (:mod:`qsim.model`) as one
:class:`~qsim.queue.AdmissionQueue` does, engines numbered across the fleet (replica r's engine k
is ``r * K + k``), and routes each arrival: the router (:mod:`qsim.routers`) picks a replica from
the replicas' states, and that replica's own admission (its policy, estimator, tracker: vLLM's
caps per replica, the baseline) decides on its own state; or, ``FleetSpec(admission="gate")``,
one admission at the cluster gate decides on the fleet's state before routing
(:mod:`qsim.gate_view`) and the replica places what it admits. Under :class:`~qsim.routers.Central`
the fleet is one line in front of all N x K engines, which is the one-queue core itself: early and
late binding run on the same trace through the same code.

A replica is one-at-a-time engines (an :class:`~qsim.queue.AdmissionQueue`) or a batching engine
(a :class:`~qsim.batch.BatchQueue`, with its own KV memory and prefix cache); the fleet holds the
lines its driver builds and reads each through the one hook both have, ``replica_state(now, req)``
(a :class:`~qsim.routers.ReplicaState`), so the routing is the same code for both.

A central queue in front of batching replicas is :class:`qsim.batch_fleet.CentralBatch`, this
fleet with one line that each replica takes from when it plans a step. Engines that slow each other
(:attr:`qsim.engines.OneAtATime.concurrency`) share one machine: a fleet refuses them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import gate_view
from .config import ServerConfig
from .queue import AdmissionQueue
from .routers import ROUTERS, Arrival, ReplicaState, Router

__all__ = ["ADMISSION_AT", "Fleet", "FleetSpec", "ROUTER_STREAM"]

#: Where a fleet admits (:attr:`FleetSpec.admission`): each replica on its own state (the
#: default), or the cluster gate on the fleet's (:mod:`qsim.gate_view`).
ADMISSION_AT = ("replica", "gate")

#: The router's random stream is the server's seed with this: its draws are its own.
ROUTER_STREAM = 104729


@dataclass(frozen=True)
class FleetSpec:
    """N replicas of the server behind ``router``."""

    replicas: int
    router: Router
    # Each replica's speed over the server's (1: as calibrated, 0.5: half as fast); None: all 1.
    speeds: tuple | None = None
    # Failures: (replica, from_s, to_s) each, the replica down from from_s until to_s.
    down: tuple = ()
    # Where arrivals are admitted (ADMISSION_AT): "replica", each replica's own admission on its
    # own state after routing; "gate", one admission at the cluster gate on the fleet's state
    # before routing (qsim.gate_view), the replicas then placing what it admits.
    admission: str = "replica"
    # Draining: (replica, from_s, to_s) each, the router sending the replica nothing from from_s
    # until to_s (as while down), while what it holds then, running or waiting, runs to its end.
    drain: tuple = ()
    # Each replica's KV memory in blocks (a batching engine's kv_blocks: a smaller GPU's, or one
    # shared with more weights); None: every replica has its engine's.
    kv_blocks: tuple | None = None

    def __post_init__(self) -> None:
        if not (
            isinstance(self.replicas, int)
            and not isinstance(self.replicas, bool)
            and self.replicas >= 1
        ):
            raise ValueError(f"replicas must be a whole number >= 1, got {self.replicas!r}")
        if not isinstance(self.router, Router):
            raise ValueError(
                f"a fleet needs a router, a qsim.routers.Router (random, "
                f"round_robin, jsq, least_work, power_of_d, central, or a class "
                f"of one's own), "
                f"got {self.router!r}"
            )
        for what, values, kind, ok in (
            ("replica speeds", self.speeds, "number > 0", _positive_number),
            ("replica kv_blocks", self.kv_blocks, "whole number >= 1", _whole_number),
        ):
            if values is not None and not (len(values) == self.replicas and all(map(ok, values))):
                raise ValueError(
                    f"{what}: one {kind} for each of the {self.replicas} replicas, got {values!r}"
                )
        self._check_down()
        if self.admission not in ADMISSION_AT:
            raise ValueError(
                f"a fleet's admission is at one of {', '.join(ADMISSION_AT)}, got "
                f"{self.admission!r}"
            )

    def _check_down(self) -> None:
        for what, windows in (("down", self.down), ("draining", self.drain)):
            for window in windows:
                if not (
                    len(window) == 3
                    and isinstance(window[0], int)
                    and 0 <= window[0] < self.replicas
                    and 0 <= window[1] < window[2]
                ):
                    raise ValueError(
                        f"a replica {what} is (replica of 0..{self.replicas - 1}, from_s, "
                        f"to_s) with 0 <= from_s < to_s, got {window!r}"
                    )
        # All unavailable at once (down or draining) is no fleet: somewhere must take arrivals.
        off = (*self.down, *self.drain)
        for _, at, _ in off:
            if len({r for r, a, b in off if a <= at < b}) == self.replicas:
                what = "down" if not self.drain else "down or draining"
                raise ValueError(f"every replica is {what} at {at:g} s: keep one up")

    def speed(self, r: int) -> float:
        return 1.0 if self.speeds is None else float(self.speeds[r])

    def replica_config(self, config: ServerConfig, r: int) -> ServerConfig:
        """Replica r's server: ``config``, with its own KV blocks where the fleet gives them (its
        engine rebuilt, so Batching's own checks hold)."""
        if self.kv_blocks is None:
            return config
        return config.replace(
            engine=dataclasses.replace(config.engine, kv_blocks=self.kv_blocks[r])
        )

    def to_fields(self) -> dict:
        """The fleet as JSON-able fields (``/stats``' and a run file's ``fleet``): the router by
        name with its parameters."""
        router = self.router
        params = (
            {f.name: getattr(router, f.name) for f in dataclasses.fields(router)}
            if dataclasses.is_dataclass(router)
            else {}
        )
        return {
            "replicas": self.replicas,
            "router": router.name,
            "router_params": params,
            "speeds": None if self.speeds is None else list(self.speeds),
            "down": [list(w) for w in self.down],
            # Only where it is not the default: a fleet's fields as they were before it.
            **({} if self.admission == "replica" else {"admission": self.admission}),
            **({"drain": [list(w) for w in self.drain]} if self.drain else {}),
            **({} if self.kv_blocks is None else {"kv_blocks": list(self.kv_blocks)}),
        }

    @classmethod
    def from_fields(cls, raw: dict) -> "FleetSpec":
        """:meth:`to_fields`' fleet again; ValueError naming what is wrong (a router of one's own
        is named, not rebuilt: it is not built in)."""
        try:
            name = raw["router"]
            if name not in ROUTERS:
                raise ValueError(
                    f"router {name!r} is not one of qsim's ({', '.join(ROUTERS)}): "
                    "a fleet of a router of one's own cannot be rebuilt from its name"
                )
            router = ROUTERS[name](**raw.get("router_params", {}))
            speeds, kv_blocks = raw.get("speeds"), raw.get("kv_blocks")
            return cls(
                int(raw["replicas"]),
                router,
                speeds=None if speeds is None else tuple(speeds),
                down=_windows(raw.get("down", ())),
                admission=raw.get("admission", "replica"),
                drain=_windows(raw.get("drain", ())),
                kv_blocks=None if kv_blocks is None else tuple(kv_blocks),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a fleet's fields {raw!r}: {exc!r}") from None

    def check(self, config: ServerConfig) -> None:
        """ValueError where ``config``'s server cannot be a replica here. A central queue in
        front of engines one at a time is one line of N x K engines, with no replica of its own
        to run slower or go down (in front of batching replicas each is its own engine); engines
        one at a time hold no KV memory to size per replica."""
        if config.batching:
            # A request too large for a replica's blocks is refused as the one server refuses it
            # (TOO_LARGE, per request): nothing to check of the sizes here.
            return
        if self.kv_blocks is not None:
            raise ValueError(
                "replica kv_blocks: engines one at a time hold no KV memory (give --batching)"
            )
        if self.router.shared and (self.speeds is not None or self.down or self.drain):
            what = "a replica down" if self.down else "a replica draining"
            if self.speeds is not None:
                what = "replica speeds"
            raise ValueError(
                f"{what}: a central queue in front of engines one at a time is one "
                f"line of N x K engines (give --batching, or route at arrival)"
            )
        if self.router.needs_batching:
            raise ValueError(
                f"router {self.router.name} reads a batching engine's KV memory and "
                f"prefix cache: its replicas need --batching"
            )
        if config.engine.concurrency:
            raise ValueError(
                "engines that slow each other share one machine: "
                "a fleet's replicas take engines with concurrency 0"
            )


def _positive_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _whole_number(v) -> bool:
    """A count of KV blocks: an int >= 1, as :class:`~qsim.engines.Batching` takes (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _windows(raw) -> tuple:
    """A run file's windows, [replica, from_s, to_s] each, as FleetSpec's tuples."""
    return tuple((int(r), float(a), float(b)) for r, a, b in raw)


class _States:
    """The replicas' states at ``now`` for the arrival ``req``, each computed when a router reads
    it (the line's own ``replica_state``); ``ask``: the :class:`~qsim.routers.Arrival` to project,
    for a router that reads a replica's projection (None: none)."""

    __slots__ = ("lines", "now", "req", "ask")

    def __init__(self, lines: list, now: float, req, ask: Arrival | None = None) -> None:
        self.lines, self.now, self.req, self.ask = lines, now, req, ask

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, r: int) -> ReplicaState:
        if not 0 <= r < len(self.lines):
            raise IndexError(r)
        return self.lines[r].replica_state(self.now, self.req, self.ask)


class _ByEngine:
    """A per-engine list of the lines (``stall_after_s``), indexed by the fleet's engine."""

    __slots__ = ("fleet", "name")

    def __init__(self, fleet: "Fleet", name: str) -> None:
        self.fleet, self.name = fleet, name

    def __getitem__(self, g: int):
        line, k = self.fleet.line_of(g)
        return getattr(line, self.name)[k]


class Fleet:
    """N replicas and a router; see the module docstring. ``line(r, config)``: the driver's queue
    core for replica r (under a central queue: the one line, r 0, ``config`` of every engine);
    ``routed(req, r)``: request ``req`` was routed to replica r (not called under a central queue:
    there it binds where it starts)."""

    #: Whether this fleet's replicas take from a central line themselves (batching replicas:
    #: :class:`qsim.batch_fleet.CentralBatch`).
    binds_late = False

    def __init__(
        self, config: ServerConfig, spec: FleetSpec, *, line: Callable, routed: Callable
    ) -> None:
        spec.check(config)
        self.spec, self.router = spec, spec.router
        n, per = spec.replicas, config.engines
        self.engines_per_replica = per
        self.engines = n * per
        if self.router.shared and config.batching and not self.binds_late:
            raise ValueError(
                "a central queue in front of batching replicas is "
                "qsim.batch_fleet.CentralBatch, not a Fleet"
            )
        if self.router.shared and not config.batching:
            engine = dataclasses.replace(config.engine, engines=n * per)
            self.lines = [line(0, config.replace(engine=engine))]
            self.per_line = n * per
        else:
            # Each replica's own server (its KV blocks), here once for every kind of fleet.
            self.lines = [line(r, spec.replica_config(config, r)) for r in range(n)]
            self.per_line = per
        # Whether the router may send a replica anything: neither down nor draining (_settle).
        self.up = [True] * len(self.lines)
        self._down = [False] * len(self.lines)
        self._draining = [False] * len(self.lines)
        self.config, self.policy = config, config.policy
        self.rng = np.random.default_rng([config.seed, ROUTER_STREAM])
        self.routed_count = 0
        self.where: dict = {}  # req -> its replica's line
        self.last = self.lines[0]  # the line that decided the last arrival
        self._routed = routed
        self.stall_after_s = _ByEngine(self, "stall_after_s")
        # Admission at the cluster gate (qsim.gate_view): one for the fleet, every replica's (a
        # central queue's is the gate's already: its one line, or CentralBatch's own).
        self.gate = None
        if spec.admission == "gate" and not self.router.shared:
            self.gate = self.lines[0].admission
            for other in self.lines[1:]:
                other.admission = self.gate
            self._gate_view = gate_view.batching if config.batching else gate_view.one_at_a_time

    def line_of(self, g: int) -> tuple[AdmissionQueue, int]:
        """The line holding the fleet's engine g, and g's index there."""
        q, k = divmod(g, self.per_line)
        return self.lines[q], k

    def replica_of_engine(self, g: int) -> int:
        return g // self.engines_per_replica

    # -- what the driver reads of one queue -----------------------------------------------

    @property
    def admission(self):
        return self.last.admission if self.gate is None else self.gate

    @property
    def estimator(self):
        return self.lines[0].estimator

    def deadlines_of(self, deadline_s):
        return self.lines[0].deadlines_of(deadline_s)

    @property
    def speed_factor(self) -> float:
        """The replicas' speed factors, averaged."""
        return float(np.mean([line.tracker.factor for line in self.lines]))

    # -- events ------------------------------------------------------------------------

    def arrive(self, req, now: float, *args, **kwargs):
        """Route ``req`` (a replica's own line, or the shared one) and let that line admit it; at
        the gate (:mod:`qsim.gate_view`), admit it on the fleet's state first, then route it."""
        if self.router.shared:
            line = self.lines[0]
        elif self.gate is not None:
            up = self.lines if all(self.up) else [q for q, ok in zip(self.lines, self.up) if ok]
            refusal, admitted = self._gate_view(self.gate, up, req, now, *args, **kwargs)
            if refusal is not None:
                return refusal
            line = self._route(up, req, now, args, kwargs)
            self.last = line
            line._place(admitted, now)
            return None
        else:
            # The router sees the replicas up only (all, but while one is down), and chooses among
            # them by their index there.
            up = self.lines if all(self.up) else [q for q, ok in zip(self.lines, self.up) if ok]
            line = self._route(up, req, now, args, kwargs)
        self.last = line
        return line.arrive(req, now, *args, **kwargs)

    def _route(self, up: list, req, now: float, args: tuple, kwargs: dict):
        """The line of the replica up the router chooses for ``req`` (noted: ``routed``)."""
        # A router that reads no prefix_hit is not given the arrival to probe the caches for.
        probe = req if self.router.reads_prefix else None
        ask = _arrival(*args, **kwargs) if self.router.reads_ttft else None
        r = self.router.choose(_States(up, now, probe, ask), self.routed_count, self.rng)
        if not (isinstance(r, (int, np.integer)) and 0 <= r < len(up)):
            raise ValueError(
                f"router {type(self.router).__name__} chose {r!r}, not a replica "
                f"of 0..{len(up) - 1}"
            )
        self.routed_count += 1
        line = up[int(r)]
        self.where[req] = line
        self._routed(req, self.lines.index(line) if up is not self.lines else int(r))
        return line

    def finished(self, g: int, now: float, *args, **kwargs):
        line, k = self.line_of(g)
        return line.finished(k, now, *args, **kwargs)

    def cancel(self, req, now: float):
        line = self.lines[0] if self.router.shared else self.where.get(req)
        return None if line is None else line.cancel(req, now)

    def cut_after(self, g: int, now: float, run_s: float):
        line, k = self.line_of(g)
        return line.cut_after(k, now, run_s)

    def cut(self, g: int, now: float):
        line, k = self.line_of(g)
        return line.cut(k, now)

    def stall(self, g: int, now: float):
        line, k = self.line_of(g)
        return line.stall(k, now)

    @property
    def all_stalled(self) -> bool:
        """Some replica's engines are all stalled: its line cannot move (the watchdog's cue)."""
        return any(line.all_stalled for line in self.lines)

    def give_up(self, now: float) -> int:
        return sum(line.give_up(now) for line in self.lines)

    # -- a replica down and back ------------------------------------------------------

    def fail(self, r: int, now: float) -> list[tuple]:
        """Replica r goes down: no arrival is routed to it until :meth:`restore`, and each request
        it holds leaves it, as a client that left would: (request, "running" or "waiting") each.
        A run one at a time holds its engine to its own end (a run is not stopped); a batch's
        blocks are freed at once."""
        self._down[r] = True
        self._settle(r, None)
        line = self.lines[r]
        held = [req for req, where in self.where.items() if where is line]
        return [(req, state) for req in held if (state := line.cancel(req, now)) is not None]

    def restore(self, r: int, now: float | None = None) -> None:
        """Replica r is back (``now``: when, for a fleet that wakes it)."""
        self._down[r] = False
        self._settle(r, now)

    def drain(self, r: int) -> None:
        """Replica r drains: no arrival is routed to it until :meth:`end_drain`, while what it
        holds (running, and waiting in its own line) stays and runs to its end."""
        self._draining[r] = True
        self._settle(r, None)

    def end_drain(self, r: int, now: float | None = None) -> None:
        """Replica r takes arrivals again (``now``: when, for a fleet that wakes it)."""
        self._draining[r] = False
        self._settle(r, now)

    def _settle(self, r: int, now: float | None) -> None:
        """Replica r's routing flag from its states, the one place it is set: up where neither
        down nor draining holds it off (``now``: when a window ended, for a fleet that wakes a
        replica back up; None where one began)."""
        self.up[r] = not (self._down[r] or self._draining[r])

    # -- batching replicas: their caches (each line's timer is its driver's: qsim.model) ------

    def prefix_cache_stats(self) -> dict | None:
        """vLLM's prefix cache counters summed over the replicas (None: no prefix cache)."""
        stats = [line.prefix_cache_stats() for line in self.lines]
        if stats[0] is None:
            return None
        return {key: sum(s[key] for s in stats) for key in stats[0]}


def _arrival(base_est_s: float, deadline_s=None, priority=0, client=None, work=None) -> Arrival:
    """The arrival a replica projects, from a line's ``arrive`` arguments after the request."""
    return Arrival(base_est_s, work)


def offset(start: Callable, first: int) -> Callable:
    """A line's start hook with its engine numbered across the fleet."""
    return lambda k, req, now, est: start(first + k, req, now, est)
