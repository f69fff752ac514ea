"""Routers: which replica of a fleet (:mod:`qsim.fleet`) an arrival goes to.

A router is a small frozen dataclass with one method, ``choose(replicas, arrival, rng)``: the
index of the replica for the ``arrival``-th request routed (from 0), from the replicas' states
(:class:`ReplicaState`, read lazily: ``replicas[r]`` computes replica r's on demand, so a router
that samples d of them reads d) and ``rng``, the fleet's own random stream (a
:class:`numpy.random.Generator` seeded from the server's seed apart from every other draw, so that
a change of policy or router moves no arrival and no service time: common random numbers). A
user's router is such a class; :data:`ROUTERS` names the built-in ones for ``--router``.

:class:`Central` is the one router that does not choose at arrival: its fleet is one shared line
in front of every replica's engines (today's ``--engines K`` for N x K engines, the Gateway API
inference extension's flow control), and a request binds to a replica only when an engine there
frees (late binding). Every other router binds at arrival (early binding), to that replica's own
line and admission.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Sequence

import numpy as np

__all__ = ["ROUTERS", "Central", "JoinShortestQueue", "LeastWork", "PowerOfD", "Random",
           "ReplicaState", "RoundRobin", "Router", "make_router", "parse_router", "router_spec"]


class ReplicaState(NamedTuple):
    """What a router sees of one replica at an arrival."""

    outstanding: int  # requests waiting or in service there
    work_s: float  # their estimated work left (waiting + in service), speed factor in
    engines: int
    idle: int  # engines free


class Router:
    """The shape every router has (a frozen dataclass of its parameters; see the module docstring).
    ``shared``: the fleet is one line in front of every engine, and ``choose`` is not asked."""

    name: ClassVar[str] = "router"
    shared: ClassVar[bool] = False

    def choose(self, replicas: Sequence[ReplicaState], arrival: int,
               rng: np.random.Generator) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define choose()")


def _least(replicas: Sequence[ReplicaState], order, key) -> int:
    """The replica of ``order`` with the least ``key``; ties to the first in ``order``."""
    return min(order, key=lambda r: key(replicas[r]))


@dataclass(frozen=True)
class Random(Router):
    """Each arrival to a replica drawn uniformly: N independent queues, each fed lambda / N."""

    name: ClassVar[str] = "random"

    def choose(self, replicas, arrival, rng):
        return int(rng.integers(len(replicas)))


@dataclass(frozen=True)
class RoundRobin(Router):
    """Arrival n to replica n mod N (Kubernetes' Service): each replica sees every N-th arrival."""

    name: ClassVar[str] = "round_robin"

    def choose(self, replicas, arrival, rng):
        return arrival % len(replicas)


@dataclass(frozen=True)
class JoinShortestQueue(Router):
    """The replica with the fewest outstanding requests (waiting or running); ties to the
    lowest."""

    name: ClassVar[str] = "jsq"

    def choose(self, replicas, arrival, rng):
        return _least(replicas, range(len(replicas)), lambda s: s.outstanding)


@dataclass(frozen=True)
class LeastWork(Router):
    """The replica with the least estimated work left per engine (waiting and in service); ties
    to the lowest."""

    name: ClassVar[str] = "least_work"

    def choose(self, replicas, arrival, rng):
        return _least(replicas, range(len(replicas)), lambda s: s.work_s / s.engines)


@dataclass(frozen=True)
class PowerOfD(Router):
    """d replicas drawn without replacement, the one with the fewest outstanding of them
    (Mitzenmacher's power of d choices); ties to the first drawn, so at random."""

    d: int = 2
    name: ClassVar[str] = "power_of_d"

    def __post_init__(self) -> None:
        if not (isinstance(self.d, int) and not isinstance(self.d, bool) and self.d >= 1):
            raise ValueError(f"power_of_d needs d, a whole number >= 1, got {self.d!r}")

    def choose(self, replicas, arrival, rng):
        n = len(replicas)
        if self.d > n:
            raise ValueError(f"power_of_d: d = {self.d} choices among {n} replicas")
        drawn = rng.choice(n, self.d, replace=False).tolist()
        return _least(replicas, drawn, lambda s: s.outstanding)


@dataclass(frozen=True)
class Central(Router):
    """One shared FIFO in front of every replica's engines: a request binds to a replica when an
    engine there frees (the lowest free engine), never at arrival. ``choose`` is not asked."""

    name: ClassVar[str] = "central"
    shared: ClassVar[bool] = True

    def choose(self, replicas, arrival, rng):
        raise RuntimeError("a central queue binds at dispatch: its fleet asks no router")


#: The built-in routers by name (``qlab simulate --router``).
ROUTERS: dict[str, type[Router]] = {r.name: r for r in (
    Random, RoundRobin, JoinShortestQueue, LeastWork, PowerOfD, Central)}


def make_router(name: str, d: int | None = None) -> Router:
    """The built-in router ``name``; ``d`` is power_of_d's choices (default 2), refused
    elsewhere."""
    try:
        kind = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}") from None
    if d is None:
        return kind()
    if kind is not PowerOfD:
        raise ValueError(f"router {name!r} takes no d (only power_of_d does)")
    return PowerOfD(d)


def router_spec(name: str, d: int | None = None) -> str:
    """The text a sweep names a router by: NAME, or power_of_d:D where D is given."""
    return name if d is None else f"{name}:{d}"


def parse_router(spec: str) -> Router:
    """A router from its sweep text, NAME or power_of_d:D (:func:`router_spec`); ValueError naming
    what is wrong."""
    name, _, d = spec.strip().partition(":")
    if not d:
        return make_router(name)
    if not d.isdigit():
        raise ValueError(f"router {spec!r}: expected NAME or power_of_d:D, D a whole number")
    return make_router(name, int(d))
