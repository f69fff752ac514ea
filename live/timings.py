"""Per-request times the gate observes for ``GET /metrics``: plain counters, no dependencies.

The gate observes on its event loop, where every piece of its state lives, so
nothing here takes a lock; an observation is one bisect and two additions.
:mod:`live.prometheus_metrics` reads these at scrape time. Kept apart from it so
that the gate (and the simulator-agreement tests that drive it) need no
``prometheus-client``.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field

#: Engine and queue times: a few milliseconds (a refusal-sized run) to minutes (a long generation).
SERVICE_BUCKETS_S = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
#: Time to a refusal: the target is p50 < 1 ms, p99 < 3 ms; a burst of 1,000 reaches a few hundred
#: ms.
REFUSAL_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)


class Histogram:
    """Counts per bucket (upper bounds, inclusive, then +Inf) and the sum, as Prometheus
    histograms keep them."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)) or not all(math.isfinite(b) for b in bounds):
            raise ValueError(f"bucket bounds must be finite and strictly increasing, got {bounds}")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (Prometheus' "le").
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) for each bucket, +Inf last."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclass
class Timings:
    """What the gate observes per request, and the upstream-error hook.

    engine: the engine's own time for every run it handed back (answered or raised; a stalled run
    once it returns); queue: arrival to an engine taking it, for every request an engine took;
    refusal: the route receiving a request to its refusal at arrival (``rejected``, 503 or 429).
    upstream_errors: failed calls of an upstream engine (:mod:`live.upstream`) to its server: an
    error status, no connection, an answer broken off, or a timeout; the gate adds 1 per failed run
    (a run its client cancelled is not a failure).
    """

    engine: Histogram = field(default_factory=lambda: Histogram(SERVICE_BUCKETS_S))
    queue: Histogram = field(default_factory=lambda: Histogram(SERVICE_BUCKETS_S))
    refusal: Histogram = field(default_factory=lambda: Histogram(REFUSAL_BUCKETS_S))
    upstream_errors: int = 0
