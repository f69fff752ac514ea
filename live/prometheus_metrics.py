"""``GET /metrics``: the gate's counts, its queue and its per-request times in Prometheus' text
format.

One collector reads the gate when it is scraped: the counts the gate keeps for
``/stats``, the queue core's snapshot and the histograms of :mod:`live.timings`.
So a request costs nothing here beyond the gate's own counting, and every number
is read on the event loop (the route is async), where the gate changes them:
one scrape is one consistent moment. Each app gets its own registry, never
prometheus-client's global one, because one process may run many apps (tests do).
docs/http.md lists every metric.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from qsim.records import ANSWERED

from .gate import Gate
from .timings import Histogram

__all__ = ["CONTENT_TYPE_LATEST", "GateCollector", "exposition", "metrics_registry"]

#: queue snapshot key -> (gauge name, help).
GAUGES = {
    "waiting": ("qlab_requests_waiting", "Requests admitted and waiting for an engine."),
    "in_service": (
        "qlab_requests_in_service",
        "Requests an engine is running (a stalled engine's included).",
    ),
    "engines": ("qlab_engines", "Engines behind the gate."),
    "stalled": (
        "qlab_engines_stalled",
        "Engines past their stall threshold, still running their request.",
    ),
    "queued_work_s": (
        "qlab_queued_work_seconds",
        "Estimated service time of the waiting requests, at the current speed factor.",
    ),
    "speed_factor": (
        "qlab_speed_factor",
        "The speed tracker's factor: measured engine time over "
        "the calibrated "
        "estimate (1 = as calibrated, 2 = twice as slow).",
    ),
}

#: Only a batching engine's core has these (live.batching): queue snapshot key -> (gauge name,
#: help).
BATCH_GAUGES = {
    "kv_blocks_used": (
        "qlab_kv_blocks_used",
        "KV blocks the batching engine's running requests hold.",
    ),
    "kv_use": (
        "qlab_kv_cache_usage",
        "Share of the batching engine's KV blocks in use (0 with no limit).",
    ),
}

#: name -> (help, the Timings field).
HISTOGRAMS = {
    "qlab_engine_time_seconds": (
        "The engine's own time for each run it handed back, answered or raised.",
        "engine",
    ),
    "qlab_queue_time_seconds": (
        "From arrival to an engine taking the request, for each request an engine took.",
        "queue",
    ),
    "qlab_time_to_refusal_seconds": (
        "From the route receiving a request to its refusal at arrival "
        "(503 overloaded or 429 rate_limited).",
        "refusal",
    ),
}


class GateCollector:
    """Reads a :class:`~live.gate.Gate` at scrape time (register it with a registry)."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def collect(self) -> Iterator[Metric]:
        gate = self.gate
        yield _requests(gate)
        yield CounterMetricFamily(
            "qlab_requests_submitted_total",
            "Requests the gate decided on "
            "(admitted or "
            "refused); at rest, the sum of qlab_requests_total.",
            value=gate.submitted,
        )
        snapshot = gate.queue.snapshot()
        for key, (name, text) in GAUGES.items():
            yield GaugeMetricFamily(name, text, value=snapshot[key])
        for key, (name, text) in BATCH_GAUGES.items():
            if key in snapshot:
                yield GaugeMetricFamily(name, text, value=snapshot[key])
        for name, (text, field) in HISTOGRAMS.items():
            yield _histogram(name, text, getattr(gate.timings, field))
        yield CounterMetricFamily(
            "qlab_upstream_errors_total",
            "Failed calls of an upstream "
            "engine to its "
            "OpenAI-compatible server (error statuses, no connection, "
            "answers broken off, "
            "timeouts); always 0 for the other engines.",
            value=gate.timings.upstream_errors,
        )


def _requests(gate: Gate) -> CounterMetricFamily:
    """Every request once, by outcome and reason; reason is empty where the outcome has none."""
    family = CounterMetricFamily(
        "qlab_requests_total",
        "Requests by how they ended: good or late "
        "(answered, by "
        "the deadline or after it), rejected (refused at arrival), "
        "expired (dropped unrun), "
        "error, or cancelled (the client left first, reason empty; or cut "
        "in service at "
        "its deadline, reason deadline_passed).",
        labels=("outcome", "reason"),
    )
    for outcome in ANSWERED:
        family.add_metric((outcome, ""), gate.counts[outcome])
    for reason, n in gate.rejected_by_reason.items():
        family.add_metric(("rejected", reason), n)
    for (outcome, reason), n in gate.ended_by_reason.items():
        family.add_metric((outcome, reason), n)
    family.add_metric(("cancelled", ""), gate.cancelled)
    return family


def _histogram(name: str, text: str, histogram: Histogram) -> HistogramMetricFamily:
    buckets = [(floatToGoString(bound), n) for bound, n in histogram.cumulative()]
    return HistogramMetricFamily(name, text, buckets=buckets, sum_value=histogram.sum)


def metrics_registry(gate: Gate) -> CollectorRegistry:
    """A registry of its own holding the gate's collector."""
    registry = CollectorRegistry()
    registry.register(GateCollector(gate))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The text format (serve it as CONTENT_TYPE_LATEST)."""
    return generate_latest(registry)
