"""benchmarks/vllm_front_end.py's fit and its /proc readers, without vLLM (nothing started)."""

import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import vllm_front_end as fe


def _phase(requests: int, tokens: int, steps: int, api_cpu_s: float, wall_s: float = 1.0):
    return fe.Phase(
        in_flight=1,
        max_tokens=tokens // requests,
        stream=True,
        requests=requests,
        tokens=tokens,
        steps=steps,
        chunks=tokens,
        api_cpu_s=api_cpu_s,
        wall_s=wall_s,
        latency_s=0.1,
        vllm_e2e_s=0.1,
        client_cpu_s=0.1,
        client_wait_s=0.0,
        engine_cpu_s=None,
        api_wait_s=None,
        engine_wait_s=None,
        load_1min=0.0,
    )


def test_the_fit_recovers_known_costs_and_the_idle_rate_is_taken_off():
    request_s, token_s, step_s, idle = 2e-3, 3e-5, 1.5e-4, 2e-3
    rng = np.random.default_rng(0)
    phases = []
    for requests, tokens in ((64, 1024), (64, 4096), (96, 1536), (96, 6144), (64, 2048)):
        steps, wall = int(rng.integers(tokens // 30, tokens)), float(rng.uniform(1, 10))
        cpu = request_s * requests + token_s * tokens + step_s * steps + idle * wall
        phases.append(_phase(requests, tokens, steps, cpu, wall))
    fit = fe.fit_phases(phases, idle, per_step=True)
    assert fit.names == ("request_s", "token_s", "step_s")
    assert np.allclose(fit.coef, (request_s, token_s, step_s), rtol=1e-6)
    assert fit.r2 > 0.999999 and max(map(abs, fit.residuals)) < 1e-9
    # Without the step term the same phases fit worse: the residuals say so.
    assert fe.fit_phases(phases, idle).r2 < fit.r2


def test_least_squares_reports_standard_errors_and_none_without_degrees_of_freedom():
    noisy = fe.least_squares({"a": [1, 2, 3, 4], "b": [1, 0, 1, 3]}, [1.1, 1.9, 3.2, 4.9])
    assert all(s > 0 for s in noisy.stderr) and all(0 <= p <= 1 for p in noisy.p_value)
    exact = fe.least_squares({"a": [1, 2], "b": [1, 0]}, [3.0, 4.0])
    assert np.allclose(exact.coef, (2.0, 1.0)) and all(math.isnan(s) for s in exact.stderr)


def test_the_plan_streams_every_level_and_length_then_the_ends_not_streamed():
    plan = fe.plan([1, 4, 32], [16, 64], 64)
    streamed = [(s.in_flight, s.max_tokens) for s in plan if s.stream]
    assert streamed == [(n, m) for n in (1, 4, 32) for m in (16, 64)]
    assert [(s.in_flight, s.max_tokens) for s in plan if not s.stream] == [
        (1, 16),
        (1, 64),
        (32, 16),
        (32, 64),
    ]
    # A phase is at least three rounds of its level.
    assert all(s.requests >= max(64, 3 * s.in_flight) for s in plan)


def test_the_proc_readers_read_this_process():
    before = fe.proc_cpu_s(os.getpid())
    sum(i * i for i in range(200_000))
    assert fe.proc_cpu_s(os.getpid()) >= before > 0
    assert fe.run_queue_wait_s(os.getpid()) >= 0
    assert fe.comm(os.getpid()) and isinstance(fe.children(os.getpid()), list)
