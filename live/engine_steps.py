"""A batching engine's steps as its own counters say them (vLLM's Prometheus ``/metrics``).

A gate in front of vLLM cannot see vLLM's steps: its own steps of an upstream end whenever a
streamed chunk arrives, and a loaded vLLM writes several steps' tokens into one chunk. vLLM counts
its steps itself: ``vllm:iteration_tokens_total`` is observed once an engine step (its count: the
steps; its sum: the tokens they computed, prompts less what the prefix cache held, and one a running
sequence), ``vllm:generation_tokens_total`` counts the tokens they made, and
``vllm:inter_token_latency_seconds`` each running request's gap between two tokens, on the engine's
own clock: a step's time, seen once by every sequence in it. Read around a phase of the calibration,
they give the phase's mean step, its prefill tokens and its sequences a step; and, from vLLM's
``request_inference_time_seconds``, how much of a request's time at the client was not in the
engine at all (the gate, vLLM's API process, the client: what a step model cannot hold).
The API process's own CPU (``process_cpu_seconds_total``, prometheus-client's, of the process
serving ``/metrics``) gives its front end (:class:`qsim.engines.FrontEnd`): its CPU seconds over
the phases fitted to their requests, engine steps and tokens (:func:`fit_front_end`).
The step model is fitted to the phases (:meth:`qsim.engines.StepModel.fit`, without a context term:
the counters do not say the context held). Each phase is measured in two halves, and the model
fitted to the first halves is judged on the second (its held-out r^2): a step model that only
explains the steps it was fitted to is no model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

import numpy as np


from qsim.engines import FrontEnd, StepFit, StepModel, r_squared

from .vllm_server import metrics

T = TypeVar("T")


@dataclass(frozen=True)
class Counters:
    """The engine's step counters at one moment (``at``: this process's perf_counter)."""

    at: float
    steps: float
    computed: float
    generated: float
    itl_s: float
    itl_n: float
    requests: float
    inference_s: float
    api_cpu_s: float = 0.0  # the API process's CPU (0: not shown)

    @classmethod
    def read(cls, url: str) -> Counters:
        return cls.of(metrics(url), time.perf_counter())

    @classmethod
    def of(cls, m: dict[str, float], at: float) -> Counters:
        """From :func:`live.vllm_server.metrics`' reading ``m``, taken at ``at``."""
        return cls(
            at,
            m["vllm:iteration_tokens_total_count"],
            m["vllm:iteration_tokens_total_sum"],
            m["vllm:generation_tokens_total"],
            m["vllm:inter_token_latency_seconds_sum"],
            m["vllm:inter_token_latency_seconds_count"],
            m["vllm:e2e_request_latency_seconds_count"],
            m["vllm:request_inference_time_seconds_sum"],
            m.get("process_cpu_seconds_total", 0.0),
        )


@dataclass(frozen=True)
class EnginePhase:
    """One half of a calibration phase (``level`` requests in flight) by the engine's counters."""

    level: int
    half: int
    seconds: float
    steps: int
    computed: int
    generated: int
    gaps: int  # the tokens' gaps on the engine's clock ...
    gaps_s: float  # ... and their seconds
    requests: int
    inference_s: float  # the requests' seconds in the engine (prefill and decode), summed
    api_cpu_s: float = 0.0  # the API process's CPU seconds (0: its counter not shown)

    @classmethod
    def between(cls, level: int, half: int, before: Counters, after: Counters) -> EnginePhase:
        def d(name: str) -> float:
            return getattr(after, name) - getattr(before, name)

        return cls(
            level,
            half,
            d("at"),
            round(d("steps")),
            round(d("computed")),
            round(d("generated")),
            round(d("itl_n")),
            d("itl_s"),
            round(d("requests")),
            d("inference_s"),
            d("api_cpu_s"),
        )

    @property
    def step_s(self) -> float:
        """The engine's mean step: its tokens' mean gap (each step counted once a sequence in it,
        as the sequences a step are; NaN: the engine made no second token in the phase)."""
        return self.gaps_s / self.gaps if self.gaps else math.nan

    @property
    def outside_s(self) -> float:
        """A request's mean seconds at the client not in vLLM's engine (``level`` clients, each
        always waiting on one; NaN: none finished)."""
        if not self.requests:
            return math.nan
        return (self.level * self.seconds - self.inference_s) / self.requests

    @property
    def prefill(self) -> float:
        """Prompt tokens computed a step (a step's computed tokens are its prefill and one a
        sequence that made a token; NaN: no step)."""
        return (self.computed - self.generated) / self.steps if self.steps else math.nan

    @property
    def seqs(self) -> float:
        return self.generated / self.steps if self.steps else math.nan

    def as_dict(self) -> dict:
        return {
            "level": self.level,
            "half": self.half,
            "seconds": self.seconds,
            "steps": self.steps,
            "step_ms": 1000 * self.step_s,
            "wall_ms_a_step": 1000 * self.seconds / self.steps,
            "outside_engine_ms_a_request": 1000 * self.outside_s,
            "prefill_a_step": self.prefill,
            "sequences_a_step": self.seqs,
            "api_cpu_s": self.api_cpu_s,
        }


def counted(url: str, level: int, half: int, run: Callable[[], T]) -> tuple[T, EnginePhase]:
    """``run()``, and what the engine at ``url`` did meanwhile."""
    before = Counters.read(url)
    result = run()
    return result, EnginePhase.between(level, half, before, Counters.read(url))


def _fit(phases: Sequence[EnginePhase]) -> StepFit:
    return StepModel.fit(
        [p.prefill for p in phases], [p.seqs for p in phases], None, [p.step_s for p in phases]
    )


@dataclass(frozen=True)
class EngineStepFit:
    """The step model fitted to every phase's halves, and the model of the first halves judged on
    the second: its r^2 and median error there."""

    fit: StepFit
    held_out_r2: float
    held_out_median_rel_error: float
    phases: tuple[EnginePhase, ...]
    front_end: FrontEndFit | None = None

    def as_dict(self) -> dict:
        return {
            "held_out_r2": self.held_out_r2,
            "held_out_median_rel_error": self.held_out_median_rel_error,
            "r2": self.fit.r2,
            "median_rel_error": self.fit.median_rel_error,
            "seconds": "engine: its tokens' mean gap in a phase, on the engine's own clock",
            "outside_engine_ms_a_request": 1000
            * float(np.median([p.outside_s for p in self.phases])),
            "front_end": None if self.front_end is None else self.front_end.as_dict(),
            "phases": [p.as_dict() for p in self.phases],
        }


def fit_phases(phases: Sequence[EnginePhase]) -> EngineStepFit:
    """ValueError where the engine ran no steps in a phase, or too few phases to fit and judge."""
    empty = [p.level for p in phases if p.gaps < 1 or p.requests < 1]
    if empty:
        raise ValueError(
            f"the engine's counters saw no step in the phases at {empty} in flight: "
            "is --engine-metrics the engine the gate forwards to?"
        )
    first = [p for p in phases if p.half == 0]
    second = [p for p in phases if p.half == 1]
    if len(first) < 3 or len(second) < 2:
        raise ValueError(
            "judging a step model on held-out phases needs 3 first and 2 second "
            "halves, "
            f"got {len(first)} and {len(second)}: calibrate with more levels"
        )
    model = _fit(first).model
    y = np.array([p.step_s for p in second])
    fitted = np.array([model.time(p.prefill, p.seqs, 0.0) for p in second])
    return EngineStepFit(
        _fit(phases),
        r_squared(y, fitted),
        float(np.median(np.abs(fitted - y) / y)),
        tuple(phases),
        fit_front_end(phases),
    )


@dataclass(frozen=True)
class FrontEndFit:
    """The API process's CPU over the phases, fitted: the front end, the CPU a second it takes
    idle, and the fit's r^2."""

    model: FrontEnd
    idle_cpu_a_second: float
    r2: float
    n: int

    def as_dict(self) -> dict:
        return {
            **asdict(self.model),
            "idle_cpu_a_second": self.idle_cpu_a_second,
            "r2": self.r2,
            "n": self.n,
            "seconds": "the API process's CPU (process_cpu_seconds_total), not wall time",
        }


def fit_front_end(phases: Sequence[EnginePhase]) -> FrontEndFit | None:
    """The front end from the API process's CPU seconds in each phase, fitted non-negative to its
    requests, engine steps, tokens and seconds (the process's idle rate): vLLM's API process
    handles each step's outputs together, at a cost a step beside one a token
    (``benchmarks/vllm_front_end.py``: requests and tokens alone fit at r^2 0.5-0.6). None where
    the counter is not shown, or fewer than five phases."""
    used = [p for p in phases if p.api_cpu_s > 0]
    if len(used) < 5:
        return None
    x = np.array([[p.requests, p.steps, p.generated, p.seconds] for p in used], float)
    y = np.array([p.api_cpu_s for p in used])
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    from scipy import optimize  # at first use, not import: it costs each qlab process ~1 s

    coef, _ = optimize.nnls(x / scale, y)
    coef = coef / scale
    r2 = r_squared(y, x @ coef)
    return FrontEndFit(
        FrontEnd(request_s=float(coef[0]), token_s=float(coef[2]), step_s=float(coef[1])),
        float(coef[3]),
        float(r2),
        len(used),
    )
