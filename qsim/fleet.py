"""A fleet: N replicas of one server, each its own line, engines and admission, and a router.

:class:`Fleet` answers its driver (:mod:`qsim.model`) as one
:class:`~qsim.queue.AdmissionQueue` does, engines numbered across the fleet (replica r's engine k
is ``r * K + k``), and routes each arrival: the router (:mod:`qsim.routers`) picks a replica from
the replicas' states, and that replica's own admission (its policy, estimator, tracker: vLLM's
caps per replica, the baseline) decides on its own state. Under :class:`~qsim.routers.Central`
the fleet is one line in front of all N x K engines, which is the one-queue core itself: early and
late binding run on the same trace through the same code.

Engines that slow each other (:attr:`qsim.engines.OneAtATime.concurrency`) share one machine,
and batching replicas are not simulated as a fleet yet: both are refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .config import ServerConfig
from .queue import AdmissionQueue
from .routers import ReplicaState, Router

__all__ = ["Fleet", "FleetSpec", "ROUTER_STREAM"]

#: The router's random stream is the server's seed with this: its draws are its own.
ROUTER_STREAM = 104729


@dataclass(frozen=True)
class FleetSpec:
    """N replicas of the server behind ``router``."""

    replicas: int
    router: Router

    def __post_init__(self) -> None:
        if not (isinstance(self.replicas, int) and not isinstance(self.replicas, bool)
                and self.replicas >= 1):
            raise ValueError(f"replicas must be a whole number >= 1, got {self.replicas!r}")
        if not isinstance(self.router, Router):
            raise ValueError(f"a fleet needs a router, a qsim.routers.Router (random, "
                             f"round_robin, jsq, least_work, power_of_d, central, or a class "
                             f"of one's own), "
                             f"got {self.router!r}")

    def check(self, config: ServerConfig) -> None:
        """ValueError where ``config``'s server cannot be a replica here."""
        if config.batching:
            raise ValueError("batching replicas are not simulated as a fleet yet: "
                             "a fleet's replicas run engines one at a time")
        if config.engine.concurrency:
            raise ValueError("engines that slow each other share one machine: "
                             "a fleet's replicas take engines with concurrency 0")


class _States:
    """The replicas' states at ``now``, each computed when a router reads it."""

    __slots__ = ("lines", "now")

    def __init__(self, lines: list[AdmissionQueue], now: float) -> None:
        self.lines, self.now = lines, now

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, r: int) -> ReplicaState:
        line = self.lines[r]
        busy = line.in_service
        work = line.queued_work_s + (line.remaining_s(self.now) if busy else 0.0)
        return ReplicaState(len(line.waiting) + busy, work, line.engines, len(line.idle))


class _ByEngine:
    """A per-engine list of the lines (``stall_after_s``), indexed by the fleet's engine."""

    __slots__ = ("fleet", "name")

    def __init__(self, fleet: "Fleet", name: str) -> None:
        self.fleet, self.name = fleet, name

    def __getitem__(self, g: int):
        line, k = self.fleet.line_of(g)
        return getattr(line, self.name)[k]


class Fleet:
    """N replicas and a router; see the module docstring. ``routed(req, r)``: request ``req`` was
    routed to replica r (not called under a central queue: there it binds where it starts)."""

    def __init__(self, config: ServerConfig, spec: FleetSpec, *, start: Callable, drop: Callable,
                 routed: Callable) -> None:
        spec.check(config)
        self.spec, self.router = spec, spec.router
        n, per = spec.replicas, config.engines
        self.engines_per_replica = per
        self.engines = n * per
        if self.router.shared:
            engine = dataclasses.replace(config.engine, engines=n * per)
            self.lines = [AdmissionQueue(config.replace(engine=engine), start=start, drop=drop)]
            self.per_line = n * per
        else:
            self.lines = [AdmissionQueue(config, start=_offset(start, r * per), drop=drop)
                          for r in range(n)]
            self.per_line = per
        self.config, self.policy = config, config.policy
        self.rng = np.random.default_rng([config.seed, ROUTER_STREAM])
        self.routed_count = 0
        self.where: dict = {}  # req -> its replica's line
        self.last = self.lines[0]  # the line that decided the last arrival
        self._routed = routed
        self.stall_after_s = _ByEngine(self, "stall_after_s")

    def line_of(self, g: int) -> tuple[AdmissionQueue, int]:
        """The line holding the fleet's engine g, and g's index there."""
        q, k = divmod(g, self.per_line)
        return self.lines[q], k

    def replica_of_engine(self, g: int) -> int:
        return g // self.engines_per_replica

    # -- what the driver reads of one queue -----------------------------------------------

    @property
    def admission(self):
        return self.last.admission

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
        """Route ``req`` (a replica's own line, or the shared one) and let that line admit it."""
        if self.router.shared:
            line = self.lines[0]
        else:
            r = self.router.choose(_States(self.lines, now), self.routed_count, self.rng)
            if not (isinstance(r, (int, np.integer)) and 0 <= r < len(self.lines)):
                raise ValueError(f"router {type(self.router).__name__} chose {r!r}, not a replica "
                                 f"of 0..{len(self.lines) - 1}")
            self.routed_count += 1
            line = self.lines[int(r)]
            self.where[req] = line
            self._routed(req, int(r))
        self.last = line
        return line.arrive(req, now, *args, **kwargs)

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


def _offset(start: Callable, first: int) -> Callable:
    """A line's start hook with its engine numbered across the fleet."""
    return lambda k, req, now, est: start(first + k, req, now, est)
