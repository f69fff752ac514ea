"""Strategies for simulations (hypothesis ``SearchStrategy`` objects), and :func:`check_records`,
which checks one simulation's records against every invariant of
:mod:`qsim.testing.record_checks`:

* :func:`policies`: policies with random admission settings and disciplines;
* :func:`engine_settings`: engine counts, machine speed, service noise, tracked or fixed estimates,
  and (``batching=True``) batching engines, :func:`batching_engines`
  (:class:`qsim.engines.Batching`: seats, token budget, chunked prefill, KV blocks, a
  :func:`step_models` step model);
* :func:`workloads`: arrival process, service distribution, load, length, seed and prompt lengths;
* :func:`runs`: all three together, a :class:`SimRun` that builds its trace and simulates it;
* :func:`traces`: the traces of such runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable

import pandas as pd
from hypothesis import strategies as st

from ..arrivals import arrivals_take_load
from ..config import ServerConfig
from ..engines import Batching, EngineModel, OneAtATime, StepModel
from ..mixes import REFERENCE_MIX, Prompts, blended_means
from ..model import simulate
from ..policy import Policy
from ..service import ServiceModel
from ..trace import Trace
from ..workload import make_trace
from .queue_core import DISCIPLINES
from .record_checks import (
    audited_batches,
    check_at_most_k_in_service,
    check_at_most_seats_in_batch,
    check_conservation,
    check_kv_blocks,
    check_one_outcome_each,
    check_order,
    check_queue_bound,
    check_work_conserving,
    records_order,
)


#: Arrival processes :func:`workloads` draws from (a burst of 1 and of 25; periodic bursts of 10,
#: and of the load's size). A burst of its own size takes no load: its :class:`Workload`'s load is
#: then unused.
ARRIVALS = (
    "poisson",
    "constant",
    "gamma:0.5",
    "gamma:3",
    "burst:1",
    "burst:25",
    "periodic:10:1.5",
    "periodic:1.5",
)


def policies(
    disciplines: Iterable[str] = ("fifo",), name: str = "random"
) -> st.SearchStrategy[Policy]:
    """Policies with random admission settings: a queue bound or none, a limit on queued work or
    none, predictive or not, expiry at the front or not, a default deadline, a discipline from
    ``disciplines`` (names of :data:`qsim.disciplines.DISCIPLINES`)."""
    return st.builds(
        Policy,
        name=st.just(name),
        max_queue=st.none() | st.integers(0, 12),
        max_queued_seconds=st.none() | st.floats(0.05, 5.0),
        predictive=st.booleans(),
        deadline_s=st.floats(0.1, 5.0),
        expire_at_front=st.booleans(),
        discipline=st.sampled_from(tuple(disciplines)),
    )


#: Prompt lengths :func:`workloads` draws from (:class:`qsim.mixes.Prompts` specs): a batching
#: engine computes them before the first token; an engine run one at a time does not see them (its
#: calibration has no prompt term).
PROMPTS = ("none", "fixed:64", "uniform:0:300", "lognormal:64:0.8")


@dataclass(frozen=True)
class EngineSettings:
    """The engines and the machine: how many, how much slower than calibrated, how noisy, and
    whether the policy tracks the machine's speed or keeps the calibrated estimate; or one batching
    engine (``batching``, :class:`qsim.engines.Batching`: its speed and spread are its step model's,
    and ``count``, ``speed`` and ``noise_cv`` stay 1, 1 and 0)."""

    count: int = 1
    speed: float = 1.0
    noise_cv: float = 0.0  # lognormal noise on the mix's service times (the mix only)
    fixed_estimate: bool = False
    batching: Batching | None = None

    def __post_init__(self) -> None:
        if self.batching is not None and (self.count, self.speed, self.noise_cv) != (1, 1.0, 0.0):
            raise ValueError(
                "a batching engine is one engine; its speed and spread are its step "
                "model's: "
                f"count 1, speed 1, noise_cv 0, got {self.count}, {self.speed}, "
                f"{self.noise_cv}"
            )

    @property
    def engine(self) -> EngineModel:
        """The engine model a :class:`~qsim.config.ServerConfig` is built with."""
        return OneAtATime(self.count) if self.batching is None else self.batching


@dataclass(frozen=True)
class Workload:
    """A seeded synthetic workload, as :func:`qsim.make_trace` takes it (``prompts``: a
    :class:`qsim.mixes.Prompts` spec)."""

    arrivals: str = "poisson"
    service: str = "mix"
    load: float = 1.0
    requests: int = 100
    seed: int = 0
    prompts: str = "none"


@dataclass(frozen=True)
class SimRun:
    """A policy, engine settings and a workload: one simulation to check."""

    policy: Policy
    engines: EngineSettings = field(default_factory=EngineSettings)
    workload: Workload = field(default_factory=Workload)

    def trace(self, **options) -> Trace:
        """The workload's trace at these engine settings; ``options`` are more of make_trace's
        (patience=...). A batching engine's load is of its saturated throughput
        (:meth:`qsim.engines.Batching.capacity_rps`)."""
        w, e = self.workload, self.engines
        noise = {"noise_cv": e.noise_cv} if w.service == "mix" else {}
        prompts = Prompts.parse(w.prompts)
        if e.batching is not None:
            _, mean_tokens = blended_means(REFERENCE_MIX, (), ServiceModel())
            options = {
                "capacity_rps": e.batching.capacity_rps(prompts.mean(), mean_tokens),
                **options,
            }
        # a burst's own size sets its rate
        load = w.load if arrivals_take_load(w.arrivals) else None
        return make_trace(
            w.arrivals,
            w.service,
            load=load,
            engines=e.count,
            speed=e.speed,
            requests=w.requests,
            seed=w.seed,
            prompts=prompts,
            **noise,
            **options,
        )

    def config(self) -> ServerConfig:
        """The server this run simulates."""
        return ServerConfig(
            self.policy, self.engines.engine, fixed_estimate=self.engines.fixed_estimate
        )

    def simulate(self, trace: Trace | None = None, **options) -> pd.DataFrame:
        """simulate() of ``trace`` (default: :meth:`trace`) under this run's policy and engines;
        ``options`` are more of simulate's (retry=..., cancel_after_s=...). A batching engine's
        bookkeeping is audited at every step (:func:`audited_batches`)."""
        with audited_batches() if self.engines.batching is not None else contextlib.nullcontext():
            return simulate(self.trace() if trace is None else trace, self.config(), **options)


def step_models() -> st.SearchStrategy[StepModel]:
    """A batching engine's step times: 1 to 20 ms a step, and per prefill token, per sequence and
    per context token terms or none; steps exactly the model's or spread around it (CV 0.5)."""
    return st.builds(
        StepModel,
        b0=st.floats(0.001, 0.02),
        b1=st.sampled_from([0.0, 2e-5]),
        b2=st.sampled_from([0.0, 3e-4]),
        b3=st.sampled_from([0.0, 1e-6]),
        cv=st.sampled_from([0.0, 0.5]),
    )


def batching_engines(
    max_num_seqs: int = 32, prefix_caching: bool = False
) -> st.SearchStrategy[Batching]:
    """Batching engines (:class:`qsim.engines.Batching`): 1 to ``max_num_seqs`` seats, a token
    budget of at least that, chunked prefill or not, a KV cache unlimited or of 48 to 4,000 tokens
    (a few requests' to plenty, so that some preempt and some are too large for it), in blocks of 1
    or 16 tokens; ``prefix_caching``: each with a prefix cache (:mod:`qsim.prefix`)."""

    def engine(step, seqs, extra, chunked, kv_tokens, block_size):
        blocks = None if kv_tokens is None else max(1, kv_tokens // block_size)
        return Batching(step, seqs, seqs + extra, chunked, blocks, block_size, prefix_caching)

    return st.builds(
        engine,
        step_models(),
        st.integers(1, max_num_seqs),
        st.sampled_from([0, 31, 256]),
        st.booleans(),
        st.none() | st.integers(48, 4000),
        st.sampled_from([1, 16]),
    )


def engine_settings(
    exact: bool = False, max_engines: int = 4, batching: bool = False
) -> st.SearchStrategy[EngineSettings]:
    """1 to ``max_engines`` engines, a machine 0.5 to 3 times slower than calibrated, noise CV 0 or
    0.3, tracked or fixed estimates; ``exact``: the calibrated machine, no noise, tracked (estimates
    are exact). ``batching``: one :func:`batching_engines` engine half the time (not with ``exact``:
    a batch's estimates are projections)."""
    if exact:
        return st.builds(EngineSettings, count=st.integers(1, max_engines))
    one_at_a_time = st.builds(
        EngineSettings,
        count=st.integers(1, max_engines),
        speed=st.floats(0.5, 3.0),
        noise_cv=st.sampled_from([0.0, 0.3]),
        fixed_estimate=st.booleans(),
    )
    if not batching:
        return one_at_a_time
    return one_at_a_time | st.builds(
        EngineSettings, fixed_estimate=st.booleans(), batching=batching_engines()
    )


def workloads(exact: bool = False, max_requests: int = 250) -> st.SearchStrategy[Workload]:
    """An arrival process of :data:`ARRIVALS`, the mix or exponential or deterministic service
    (``exact``: the mix), load 0.2 to 3, 1 to ``max_requests`` requests, any seed, prompt lengths of
    :data:`PROMPTS`."""
    return st.builds(
        Workload,
        arrivals=st.sampled_from(ARRIVALS),
        service=st.just("mix")
        if exact
        else st.sampled_from(["mix", "exponential", "deterministic"]),
        load=st.floats(0.2, 3.0),
        requests=st.integers(1, max_requests),
        seed=st.integers(0, 2**32 - 1),
        prompts=st.sampled_from(PROMPTS),
    )


def runs(
    exact: bool = False,
    policy: st.SearchStrategy[Policy] | None = None,
    engines: st.SearchStrategy[EngineSettings] | None = None,
) -> st.SearchStrategy[SimRun]:
    """Simulations to check: a policy drawn from ``policy`` (default :func:`policies` over every
    discipline of qsim's), engines from ``engines`` (default :func:`engine_settings`;
    ``engine_settings(batching=True)``: a batching engine half the time) and :func:`workloads`
    (``exact``: estimates equal true service times)."""
    if policy is None:
        policy = policies(tuple(c.name for c in DISCIPLINES))
    return st.builds(
        SimRun,
        policy=policy,
        engines=engine_settings(exact) if engines is None else engines,
        workload=workloads(exact),
    )


def traces(exact: bool = False) -> st.SearchStrategy[Trace]:
    """Traces of :func:`workloads` at :func:`engine_settings`."""
    return st.builds(
        lambda e, w: SimRun(Policy(), e, w).trace(), engine_settings(exact), workloads(exact)
    )


def check_records(frame: pd.DataFrame, run: SimRun, trace: Trace | None = None) -> None:
    """Every records invariant of ``run`` (its trace ``trace``, default the run's own): one outcome
    per request, conservation, at most K in service (a batching engine: at most its seats, and its
    KV blocks), no idle engine while work waits (every discipline is work-conserving in qsim's
    core), the queue bound, and the order of service where the records can say it
    (:func:`records_order`)."""
    requests = len(trace if trace is not None else run.trace())
    k, batch = run.engines.count, run.engines.batching
    check_one_outcome_each(frame, requests)
    check_conservation(frame, k)
    if batch is None:
        check_at_most_k_in_service(frame, k)
    else:
        check_at_most_seats_in_batch(frame, batch.max_num_seqs)
        check_kv_blocks(frame, batch.kv_blocks)
    check_work_conserving(frame, k, batching=batch is not None)
    if run.policy.max_queue is not None:
        check_queue_bound(frame, run.policy.max_queue)
    discipline = run.policy.make_discipline()
    key = records_order(discipline, run.engines.fixed_estimate, batching=batch is not None)
    if key is not None:
        check_order(frame, key, type(discipline).__name__)
