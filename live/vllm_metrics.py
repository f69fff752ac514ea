"""vLLM's Prometheus counters: which ones qlab reads, and how they are read from ``GET /metrics``.

Two readers share one parse (:func:`sums`: prometheus-client's own parser, each sample summed
over its labels, since vLLM labels its counters by model and engine, and a finished request by
why it finished): :func:`live.vllm_server.metrics` and the checks of benchmarks/vllm_check.py
read :data:`COUNTERS` straight from vLLM, and the upstream engine reads
:data:`UPSTREAM_COUNTERS` for the gate's ``/stats`` (``upstream_counters``: what vLLM counted
itself, preemptions included, which the gate cannot see; :class:`live.upstream.UpstreamCounters`).
"""

from __future__ import annotations

import math
from typing import Iterable

from prometheus_client.parser import text_string_to_metric_families

#: What the vLLM checks read of vLLM's /metrics (each summed over its labels).
COUNTERS = (
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    # Engine steps (the histogram's count) and the tokens they computed (its sum).
    "vllm:iteration_tokens_total_count",
    "vllm:iteration_tokens_total_sum",
    # Each request's time as vLLM's engine side saw it: end to end, queued, in the engine.
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_inference_time_seconds_sum",
    # The engine's own gap between a request's tokens (its step, seen by each running request).
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    # Gauges: what the engine holds now.
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    # prometheus-client's own: the CPU of the process serving /metrics, vLLM's API server
    # (benchmarks/vllm_front_end.py checked it against /proc): its front end's cost.
    "process_cpu_seconds_total",
)

#: ``/stats`` ``upstream_counters``: each field's vLLM counter. ``finished_requests``: whatever the
#: reason they finished (stop, length, abort), vLLM's ``request_success`` counts them all.
UPSTREAM_COUNTERS = {
    "finished_requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
}


def sums(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each of ``names`` that ``text`` (Prometheus' text format) has samples of: their sum over
    the labels; a name without a sample is left out. ValueError where a line of those samples is
    not in that format."""
    wanted, found = tuple(names), {}
    # Only the lines of the samples asked for go to the parser: a vLLM's /metrics is hundreds of
    # lines (histograms' buckets), which take milliseconds to parse whole, and the gate's /stats
    # parses it on the event loop. A line names its sample first; the names are matched in full
    # below, so a longer name that starts alike is parsed and left out.
    asked = "\n".join(line for line in text.splitlines() if line.startswith(wanted))
    for family in text_string_to_metric_families(asked):
        for sample in family.samples:
            if sample.name in wanted:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def upstream_counters(text: str) -> dict[str, int] | None:
    """``/stats`` ``upstream_counters`` (but ``read_at``) from an upstream's /metrics text; None
    where it is not vLLM's: not Prometheus' format, one of the counters missing (another server,
    a qlab gate among them, counts under other names), or one not a count."""
    try:
        found = sums(text, UPSTREAM_COUNTERS.values())
    except ValueError:
        return None
    values = [found.get(name, math.nan) for name in UPSTREAM_COUNTERS.values()]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        return None
    return {field: round(v) for field, v in zip(UPSTREAM_COUNTERS, values)}
