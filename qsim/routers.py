"""Routers: which replica of a fleet (:mod:`qsim.fleet`) an arrival goes to.

A router is a small frozen dataclass with one method, ``choose(replicas, arrival, rng)``: the
index of the replica for the ``arrival``-th request routed (from 0), from the replicas' states
(:class:`ReplicaState`, read lazily: ``replicas[r]`` computes replica r's on demand, so a router
that samples d of them reads d) and ``rng``, the fleet's own random stream (a
:class:`numpy.random.Generator` seeded from the server's seed apart from every other draw, so that
a change of policy or router moves no arrival and no service time: common random numbers). A
user's router is such a class; :data:`ROUTERS` names the built-in ones for ``--router``.

:class:`Central` is the one router that does not choose at arrival: its fleet is one shared line
in front of every replica (the Gateway API inference extension's flow control), and a request
binds to a replica only when that replica can take it (late binding): for engines one at a time
when an engine there frees (the line is today's ``--engines K`` for N x K engines), for batching
replicas when one plans a step with a seat, the KV blocks and the token budget for it
(:mod:`qsim.batch_fleet`). Every other router binds at arrival (early binding), to that replica's
own line and admission.

Routers that read a batching engine's state (:class:`LeastKV`, :class:`PrefixAffinity`,
:class:`Weighted`: ``needs_batching``) route between batching replicas only: a replica run one at a
time has no KV memory and no prefix cache to read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Sequence

import numpy as np

__all__ = [
    "ROUTERS",
    "Arrival",
    "Central",
    "JoinShortestQueue",
    "LeastKV",
    "LeastTTFT",
    "LeastWork",
    "PowerOfD",
    "PrefixAffinity",
    "Random",
    "ReplicaState",
    "RoundRobin",
    "Router",
    "Weighted",
    "make_router",
    "parse_router",
    "parse_weights",
    "router_spec",
]


class ReplicaState(NamedTuple):
    """What a router sees of one replica at an arrival."""

    outstanding: int  # requests waiting or in service there
    # Their estimated work left (waiting + in service), speed factor in; a batching replica: the
    # wait it would give an arrival (its seat-steps over its seats), its one engine's work.
    work_s: float
    engines: int
    idle: int  # engines free (a batching replica: 1 while a seat and blocks are free, nobody waits)
    # A batching replica's only (0 for one run one at a time): its KV blocks in use over its
    # capacity, and the share of this arrival's full prompt blocks its prefix cache holds.
    kv_use: float = 0.0
    prefix_hit: float = 0.0
    # A batching replica's projection of this arrival's time to first token there, seconds from
    # now (its admission's projection; NaN: the router reads none, or one run one at a time).
    ttft_s: float = math.nan


class Arrival(NamedTuple):
    """The arrival a router that reads ``ttft_s`` is routing: what a replica projects it from."""

    base_est_s: float
    work: Any = None  # a qsim.entry.Work (limit, prompt tokens, tokens it will generate), or None


class Router:
    """The shape every router has (a frozen dataclass of its parameters; see the module docstring).
    ``shared``: the fleet is one line in front of every engine, and ``choose`` is not asked;
    ``needs_batching``: it reads a batching replica's memory or cache; ``reads_prefix``: it reads
    prefix_hit, a probe of each replica's prefix cache for the arrival's prompt (False spares the
    probe, and prefix_hit reads 0; a router of one's own is probed unless it says so)."""

    name: ClassVar[str] = "router"
    shared: ClassVar[bool] = False
    needs_batching: ClassVar[bool] = False  # it reads kv_use or prefix_hit
    reads_prefix: ClassVar[bool] = True
    reads_ttft: ClassVar[bool] = False  # it reads ttft_s: each replica projects the arrival

    def choose(
        self, replicas: Sequence[ReplicaState], arrival: int, rng: np.random.Generator
    ) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define choose()")


def _least(replicas: Sequence[ReplicaState], order, key) -> int:
    """The replica of ``order`` with the least ``key``; ties to the first in ``order``."""
    return min(order, key=lambda r: key(replicas[r]))


@dataclass(frozen=True)
class Random(Router):
    """Each arrival to a replica drawn uniformly: N independent queues, each fed lambda / N."""

    name: ClassVar[str] = "random"
    reads_prefix: ClassVar[bool] = False

    def choose(self, replicas, arrival, rng):
        return int(rng.integers(len(replicas)))


@dataclass(frozen=True)
class RoundRobin(Router):
    """Arrival n to replica n mod N (Kubernetes' Service): each replica sees every N-th arrival."""

    name: ClassVar[str] = "round_robin"
    reads_prefix: ClassVar[bool] = False

    def choose(self, replicas, arrival, rng):
        return arrival % len(replicas)


@dataclass(frozen=True)
class JoinShortestQueue(Router):
    """The replica with the fewest outstanding requests (waiting or running); ties to the
    lowest."""

    name: ClassVar[str] = "jsq"
    reads_prefix: ClassVar[bool] = False

    def choose(self, replicas, arrival, rng):
        return _least(replicas, range(len(replicas)), lambda s: s.outstanding)


@dataclass(frozen=True)
class LeastWork(Router):
    """The replica with the least estimated work left per engine (waiting and in service); ties
    to the lowest."""

    name: ClassVar[str] = "least_work"
    reads_prefix: ClassVar[bool] = False

    def choose(self, replicas, arrival, rng):
        return _least(replicas, range(len(replicas)), lambda s: s.work_s / s.engines)


@dataclass(frozen=True)
class PowerOfD(Router):
    """d replicas drawn without replacement, the one with the fewest outstanding of them
    (Mitzenmacher's power of d choices); ties to the first drawn, so at random."""

    d: int = 2
    name: ClassVar[str] = "power_of_d"
    reads_prefix: ClassVar[bool] = False

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
class LeastKV(Router):
    """The replica with the least of its KV memory in use; ties to fewer outstanding, then to the
    lowest (llm-d's kv-cache-utilization scorer alone)."""

    name: ClassVar[str] = "least_kv"
    reads_prefix: ClassVar[bool] = False
    needs_batching: ClassVar[bool] = True

    def choose(self, replicas, arrival, rng):
        return _least(replicas, range(len(replicas)), lambda s: (s.kv_use, s.outstanding))


@dataclass(frozen=True)
class PrefixAffinity(Router):
    """The replica whose prefix cache holds the most of this arrival's prompt blocks; ties to fewer
    outstanding, then to the lowest (a request with nothing cached anywhere goes as jsq sends it).
    """

    name: ClassVar[str] = "prefix"
    needs_batching: ClassVar[bool] = True

    def choose(self, replicas, arrival, rng):
        return _least(replicas, range(len(replicas)), lambda s: (-s.prefix_hit, s.outstanding))


@dataclass(frozen=True)
class LeastTTFT(Router):
    """The replica whose own projection gives this arrival the earliest first token (the step
    model's, as a predictive replica's admission projects it: the batch, the line before it, its
    prompt's steps at its tracked speed, its front end; ties to fewer outstanding, then to the
    lowest). ``d``: replicas drawn to compare (None: all of them). Each projection walks that
    replica's batch and line."""

    d: int | None = None
    name: ClassVar[str] = "least_ttft"
    needs_batching: ClassVar[bool] = True
    reads_prefix: ClassVar[bool] = False
    reads_ttft: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.d is not None and not (
            isinstance(self.d, int) and not isinstance(self.d, bool) and self.d >= 1
        ):
            raise ValueError(f"least_ttft needs d, a whole number >= 1 (or none), got {self.d!r}")

    def choose(self, replicas, arrival, rng):
        n = len(replicas)
        order = (
            range(n)
            if self.d is None or self.d >= n
            else rng.choice(n, self.d, replace=False).tolist()
        )
        return _least(replicas, order, lambda s: (s.ttft_s, s.outstanding))


#: The scorers of :class:`Weighted`, by the name ``--router-weights`` gives each weight.
WEIGHTS = ("prefix", "queue", "kv")


@dataclass(frozen=True)
class Weighted(Router):
    """llm-d's scheduler: each replica's weighted sum of three scores in [0, 1], the highest wins
    (ties to fewer outstanding, then to the lowest). As llm-d's scorers: prefix, the share of the
    prompt's blocks cached there; queue, (most - its outstanding) / (most - fewest) over the
    replicas (1 for all when equal); kv, 1 - its KV use."""

    prefix: float = 2.0
    queue: float = 1.0
    kv: float = 1.0
    name: ClassVar[str] = "weighted"
    needs_batching: ClassVar[bool] = True

    def __post_init__(self) -> None:
        weights = [getattr(self, w) for w in WEIGHTS]
        if not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights
        ) or not any(weights):
            raise ValueError(
                f"weighted needs weights >= 0, not all 0, got {dict(zip(WEIGHTS, weights))}"
            )

    def choose(self, replicas, arrival, rng):
        states = [replicas[r] for r in range(len(replicas))]  # the queue score reads them all
        most = max(s.outstanding for s in states)
        spread = most - min(s.outstanding for s in states)

        def score(s: ReplicaState) -> float:
            queue = 1.0 if spread == 0 else (most - s.outstanding) / spread
            return self.prefix * s.prefix_hit + self.queue * queue + self.kv * (1.0 - s.kv_use)

        return _least(states, range(len(states)), lambda s: (-score(s), s.outstanding))


def parse_weights(text: str) -> dict[str, float]:
    """``prefix=2,queue=1,kv=1`` (any of them; the rest at their defaults) as a mapping."""
    weights = {}
    for part in str(text).split(","):
        key, eq, value = part.strip().partition("=")
        if not eq or key not in WEIGHTS:
            raise ValueError(
                f"bad router weights {text!r}: expected NAME=WEIGHT,... with names "
                f"of {', '.join(WEIGHTS)}"
            )
        try:
            weights[key] = float(value)
        except ValueError:
            raise ValueError(f"bad router weight {part.strip()!r}: not a number") from None
    return weights


@dataclass(frozen=True)
class Central(Router):
    """One shared line (the policy's discipline) in front of every replica: a request binds to a
    replica when an engine there frees (the lowest free engine), or, batching replicas
    (:mod:`qsim.batch_fleet`), when one takes it into its batch; never at arrival. ``choose`` is
    not asked."""

    name: ClassVar[str] = "central"
    reads_prefix: ClassVar[bool] = False
    shared: ClassVar[bool] = True

    def choose(self, replicas, arrival, rng):
        raise RuntimeError("a central queue binds at dispatch: its fleet asks no router")


#: The built-in routers by name (``qlab simulate --router``).
ROUTERS: dict[str, type[Router]] = {
    r.name: r
    for r in (
        Random,
        RoundRobin,
        JoinShortestQueue,
        LeastWork,
        PowerOfD,
        Central,
        LeastKV,
        PrefixAffinity,
        Weighted,
        LeastTTFT,
    )
}


def make_router(name: str, d: int | None = None, weights: dict | None = None) -> Router:
    """The built-in router ``name``; ``d`` is power_of_d's choices (default 2) or least_ttft's
    (default all), ``weights`` weighted's (:func:`parse_weights`), each refused elsewhere."""
    try:
        kind = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}") from None
    if d is not None and kind not in (PowerOfD, LeastTTFT):
        raise ValueError(f"router {name!r} takes no d (only power_of_d and least_ttft do)")
    if weights is not None and kind is not Weighted:
        raise ValueError(f"router {name!r} takes no weights (only weighted does)")
    if d is not None:
        return kind(d)
    return kind(**(weights or {}))


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
