"""The simulator against every closed form: the table behind ``qlab theory``.

Each scenario is simulated in R independent replications (seeds seed..seed+R-1),
the first ``warmup`` requests of each discarded so that the empty start does not
bias the means. A quantity passes when its closed form lies inside the
replications' Student-t interval. The intervals are simultaneous: with m
quantities each is drawn at level 1 - (1 - level) / m (Bonferroni), so the whole
table is a ``level`` confidence statement and a correct simulator fails it with
probability at most 1 - level, not once in every twenty rows.

An interval can only fail a closed form if it is narrow: a row whose half-width exceeds
``TOO_WIDE`` (25 %) of the closed-form value is *too wide to judge*, neither a pass nor a
failure (run longer or more replications). A scenario may name a control variate, a
statistic of known mean that moves with the checked ones (a run's mean output length):
its rows are then the regression estimate at the known mean
(:func:`analysis.metrics.controlled_mean_ci`), whose interval is narrower for the same runs.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import numpy as np
import pandas as pd

from qsim import theory
from qsim.config import ServerConfig
from qsim.engines import Batching, StepModel
from qsim.model import simulate
from qsim.policy import Policy
from qsim.routers import Central, PowerOfD, Random, RoundRobin, Router
from qsim.mixes import REFERENCE_MIX, Mix
from qsim.trace import from_arrays
from qsim.workload import make_trace
from qsim.service import ServiceModel

from .metrics import controlled_mean_ci, mean_ci

# The statistics a check reads (analysis.run_stats), also importable from here as before.
from .run_stats import (
    Stat,
    mean_wait,
    mean_sojourn,
    wait_share_over,
    wait_where,
    work_weighted_wait,
    mean_tokens,
    mean_gap,
    mean_service,
    load_deviation,
    mean_step_s,
    blocked_share,
    waited_share,
    abandoned_share,
    mean_wait_all,
)


#: A row whose interval's half-width exceeds this share of its closed-form value is too wide to
#: judge.
TOO_WIDE = 0.25


@dataclass(frozen=True)
class Control:
    """A control variate: a statistic of a replication's records whose true mean is known."""

    name: str
    mean: float
    stat: Stat


class Case(Protocol):
    """A simulated system and the closed forms it is checked against: ``checks`` are (quantity,
    closed-form value, statistic of a replication's records); ``control`` a control variate or None,
    or a tuple of one per check (:func:`controls_of`); ``run(seed)`` gives the statistics of one
    replication, then those of its controls (:func:`control_columns`)."""

    name: str
    checks: tuple[tuple[str, float, Stat], ...]
    control: Control | tuple[Control | None, ...] | None

    def run(self, seed: int) -> list[float]: ...


def controls_of(case: Case) -> tuple[Control | None, ...]:
    """Each check's control variate: the case's one for every check, or its own (a tuple)."""
    control = case.control
    return control if isinstance(control, tuple) else (control,) * len(case.checks)


def control_columns(case: Case) -> list[Control]:
    """The distinct controls of a case's checks, in the order :meth:`Case.run` returns them."""
    out: list[Control] = []
    for control in controls_of(case):
        if control is not None and control not in out:
            out.append(control)
    return out


def _statistics(case: Case, frame: pd.DataFrame) -> list[float]:
    """A replication's checked statistics, then its controls'."""
    stats = [stat(frame) for _, _, stat in case.checks]
    return stats + [c.stat(frame) for c in control_columns(case)]


@dataclass(frozen=True)
class Scenario:
    """One simulated system and the closed forms it is checked against."""

    name: str
    engines: int
    load: float  # offered utilisation lam * E[S] / c
    requests: int
    warmup_share: float  # leading share of each replication discarded
    service: str = "exponential"
    max_queue: int | None = None
    checks: tuple[tuple[str, float, Stat], ...] = field(default=())
    discipline: str = "fifo"
    high_share: float = 0.0  # share of requests in priority class 1 (the rest in class 0)
    mix: Mix = REFERENCE_MIX
    mean_service_s: float = 1.0  # exponential and deterministic service
    # Patience while waiting, ("exponential", mean) or ("deterministic", tau): each client leaves if
    # its request has not started that long after arrival (simulate's cancel_after_s with
    # cancel_until="start").
    patience: tuple[str, float] | None = None
    # Expiry at the front with a fixed estimate (the mean service time) and deadline tau + that
    # estimate: a request that reaches the front after waiting more than tau is dropped unrun
    # (M/M/c+D).
    expire_after_s: float | None = None
    # A fleet (qsim.fleet): ``replicas`` copies of the ``engines`` behind ``router``; ``load`` is
    # then each replica's, and the trace's rate replicas times that of one.
    replicas: int = 1
    router: Router | None = None
    # The M/M/c family's rows are plain means; a tuple: one per check (controls_of).
    control: Control | tuple[Control | None, ...] | None = None

    def run(self, seed: int) -> list[float]:
        mean = None if self.service == "mix" else self.mean_service_s
        trace = make_trace(
            "poisson",
            self.service,
            load=self.load,
            engines=self.engines * self.replicas,
            requests=self.requests,
            seed=seed,
            mean_service_s=mean,
            mix=self.mix,
        )
        # Classes from a stream of their own, so the arrivals and sizes are those of the seed.
        priority = (
            np.random.default_rng([seed, 1954]).random(len(trace)) < self.high_share
        ).astype(int)
        policy = Policy(
            "theory", max_queue=self.max_queue, deadline_s=1e12, discipline=self.discipline
        )
        extra: dict = {}
        fixed = False
        if self.patience is not None:  # patience from a stream of its own too
            kind, value = self.patience
            if kind not in ("exponential", "deterministic"):
                raise ValueError(f"patience must be exponential or deterministic, got {kind!r}")
            draws = (
                np.random.default_rng([seed, 1981]).standard_exponential(len(trace))
                if kind == "exponential"
                else np.ones(len(trace))
            )
            extra.update(cancel_after_s=value * draws, cancel_until="start")
        if self.expire_after_s is not None:
            policy = Policy(
                "theory",
                max_queue=self.max_queue,
                discipline=self.discipline,
                expire_at_front=True,
                deadline_s=self.expire_after_s + self.mean_service_s,
            )
            fixed = True
        # The server's seed is the router's stream (nothing else here draws from it).
        server = ServerConfig(policy, self.engines, fixed_estimate=fixed, seed=seed)
        frame = simulate(
            trace, server, priority=priority, replicas=self.replicas, router=self.router, **extra
        ).assign(priority=priority)
        frame = frame.iloc[int(self.requests * self.warmup_share) :]
        return _statistics(self, frame)


@dataclass(frozen=True)
class Lengths:
    """Output lengths in tokens of mean ``mean``: ``geometric`` (on 1, 2, ...: each token is the
    last with probability 1 / mean, as the chains of :func:`qsim.theory.continuous_batching` assume)
    or ``deterministic``."""

    kind: str
    mean: int

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "geometric":
            return rng.geometric(1 / self.mean, n)
        if self.kind == "deterministic":
            return np.full(n, self.mean)
        raise ValueError(f"output lengths are geometric or deterministic, got {self.kind!r}")


@dataclass(frozen=True)
class BatchScenario:
    """A batching engine (:class:`qsim.engines.Batching`) fed Poisson arrivals of prompt-less
    requests.

    Every request has no prompt (its first step gives its first token) and generates its drawn
    length (its ``max_new_tokens`` too), so a step with n sequences takes the step model's b0 + b2
    n; the batch holds at most ``max_num_seqs`` with a FIFO line behind, and memory is unlimited.
    """

    name: str
    rate: float  # arrivals per second
    lengths: Lengths
    step: StepModel
    requests: int
    warmup_share: float
    max_num_seqs: int = 100_000
    checks: tuple[tuple[str, float, Stat], ...] = field(default=())
    control: Control | None = None

    def records(self, seed: int) -> pd.DataFrame:
        """One replication's records, the warm-up included."""
        rng = np.random.default_rng([seed, 2007])
        arrival = np.cumsum(rng.exponential(1 / self.rate, self.requests))
        tokens = self.lengths.draw(rng, self.requests)
        trace = replace(
            from_arrays(arrival, tokens), prompt_tokens=np.zeros(self.requests, dtype=np.int64)
        )
        engine = Batching(
            self.step,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max(2048, self.max_num_seqs),
        )
        return simulate(trace, ServerConfig(Policy("theory", deadline_s=1e12), engine, seed=seed))

    def run(self, seed: int) -> list[float]:
        frame = self.records(seed).iloc[int(self.requests * self.warmup_share) :]
        return _statistics(self, frame)


def standard_scenarios(scale: float = 1.0) -> list[Case]:
    """Every scenario of ``qlab theory``: engines one at a time (:func:`queue_scenarios`), engines
    that share (:func:`sharing_scenarios`), then fleets behind routers (:func:`fleet_scenarios`);
    ``scale`` multiplies every run's length."""
    return [*queue_scenarios(scale), *sharing_scenarios(scale), *fleet_scenarios(scale)]


def queue_scenarios(scale: float = 1.0) -> list[Scenario]:
    """K = 1, 2 and 8, loads up to 0.95, loss systems, the reference mix at rho 0.9, the
    disciplines, and clients that give up while waiting (Erlang A; M/M/c+D as clients that leave and
    as expiry at the front).

    Exponential service has mean 1 s, so rates are in units of the service rate.
    ``scale`` multiplies the run lengths (the high loads need long runs: at
    rho 0.95 a queue forgets its start only after thousands of services).
    """

    def n(requests: int) -> int:
        return max(2000, int(requests * scale))

    model = ServiceModel()
    mix_mean, mix_m2 = REFERENCE_MIX.mean_s(model), REFERENCE_MIX.second_moment_s(model)
    lam_mix = 0.9 / mix_mean
    pk_mix = theory.mg1(lam_mix, mix_mean, mix_m2).wq
    # Two priority classes on M/M/1 (lambda 0.3 and 0.5, mu 1): Cobham's 1.143 s and 5.714 s.
    cobham = theory.priority_mg1([0.3, 0.5], [1.0, 1.0], [2.0, 2.0])
    # Shortest first on two sizes (4 and 64 tokens, 70 % / 30 %) at rho 0.8: Cobham with classes by
    # size.
    two = Mix((4, 64), (0.7, 0.3))
    sizes_s = model.estimate(list(two.sizes))
    lam_two = 0.8 / two.mean_s(model)
    sjf = theory.priority_mg1(lam_two * np.asarray(two.probs), sizes_s, sizes_s**2)
    # Erlang A in minutes, simulated as seconds: lambda 100/30 per minute, mean service 3, mean
    # patience 5, c 14.
    erlang_a = theory.erlang_a(100 / 30, 1 / 3, 14, 1 / 5)
    # M/M/c+D at rho 0.9: patience tau while waiting, as clients that leave and as expiry at the
    # front.
    mmcd = [
        (c, tau, theory.mmc_deterministic_patience(0.9 * c, 1, c, tau))
        for c, tau in ((1, 2.0), (4, 1.0))
    ]
    return [
        Scenario(
            "M/M/1 rho=0.5",
            1,
            0.5,
            n(20_000),
            0.1,
            checks=(
                ("Wq", theory.mm1(0.5, 1).wq, mean_wait),
                ("P(wait>1s)", theory.mm1_wait_tail(0.5, 1, 1.0), wait_share_over(1.0)),
            ),
        ),
        Scenario(
            "M/M/1 rho=0.8",
            1,
            0.8,
            n(40_000),
            0.1,
            checks=(
                ("Wq", theory.mm1(0.8, 1).wq, mean_wait),
                ("W", theory.mm1(0.8, 1).w, mean_sojourn),
            ),
        ),
        Scenario(
            "M/M/1 rho=0.95",
            1,
            0.95,
            n(150_000),
            0.1,
            checks=(("Wq", theory.mm1(0.95, 1).wq, mean_wait),),
        ),
        Scenario(
            "M/M/2 rho=0.9 (Erlang C)",
            2,
            0.9,
            n(60_000),
            0.1,
            checks=(
                ("P(wait)", theory.mmc(1.8, 1, 2).p_wait, wait_share_over(0.0)),
                ("Wq", theory.mmc(1.8, 1, 2).wq, mean_wait),
            ),
        ),
        Scenario(
            "M/M/8 rho=0.95 (Erlang C)",
            8,
            0.95,
            n(100_000),
            0.1,
            checks=(
                ("P(wait)", theory.mmc(7.6, 1, 8).p_wait, wait_share_over(0.0)),
                ("Wq", theory.mmc(7.6, 1, 8).wq, mean_wait),
                ("P(wait>1s)", theory.mmc_wait_tail(7.6, 1, 8, 1.0), wait_share_over(1.0)),
            ),
        ),
        Scenario(
            "M/M/1/5 rho=0.9",
            1,
            0.9,
            n(30_000),
            0.0333333,
            max_queue=4,
            checks=(
                ("P(block)", theory.mm1k(0.9, 1, 5).p_block, blocked_share),
                ("Wq", theory.mm1k(0.9, 1, 5).wq, mean_wait),
            ),
        ),
        Scenario(
            "M/M/1/10 rho=1.5",
            1,
            1.5,
            n(30_000),
            0.0333333,
            max_queue=9,
            checks=(("P(block)", theory.mm1k(1.5, 1, 10).p_block, blocked_share),),
        ),
        Scenario(
            "M/M/8/8 a=6 (Erlang B)",
            8,
            0.75,
            n(30_000),
            0.0333333,
            max_queue=0,
            checks=(("P(block)", theory.erlang_b(8, 6.0), blocked_share),),
        ),
        Scenario(
            "M/M/2/6 rho=1.2",
            2,
            1.2,
            n(30_000),
            0.0333333,
            max_queue=4,
            checks=(
                ("P(block)", theory.mmck(2.4, 1, 2, 6).p_block, blocked_share),
                ("Wq", theory.mmck(2.4, 1, 2, 6).wq, mean_wait),
            ),
        ),
        Scenario(
            "M/D/1 rho=0.9",
            1,
            0.9,
            n(60_000),
            0.1,
            service="deterministic",
            checks=(("Wq", theory.md1(0.9, 1.0).wq, mean_wait),),
        ),
        Scenario(
            "M/G/1 reference mix rho=0.9 (P-K)",
            1,
            0.9,
            n(60_000),
            0.1,
            service="mix",
            checks=(("Wq", pk_mix, mean_wait),),
        ),
        Scenario(
            "M/M/1 two priority classes rho=0.8 (Cobham)",
            1,
            0.8,
            n(60_000),
            0.1,
            discipline="priority",
            high_share=0.375,
            checks=(
                ("Wq high", cobham[0], wait_where("priority", 1)),
                ("Wq low", cobham[1], wait_where("priority", 0)),
            ),
        ),
        Scenario(
            "M/G/1 two sizes rho=0.8, shortest first",
            1,
            0.8,
            n(60_000),
            0.1,
            service="mix",
            mix=two,
            discipline="sjf",
            checks=(
                ("Wq 4 tokens", sjf[0], wait_where("max_new_tokens", 4)),
                ("Wq 64 tokens", sjf[1], wait_where("max_new_tokens", 64)),
            ),
        ),
        # The conservation law: a work-conserving, non-preemptive order that does not look at the
        # remaining work moves waiting between requests but keeps sum(S W) / sum(S) at the P-K Wq.
        *(
            Scenario(
                f"M/G/1 reference mix rho=0.9, {d} (conservation)",
                1,
                0.9,
                n(60_000),
                0.1,
                service="mix",
                discipline=d,
                high_share=0.3 if d == "priority" else 0.0,
                checks=(("load-weighted Wq", pk_mix, work_weighted_wait),),
            )
            for d in ("sjf", "priority", "lifo")
        ),
        Scenario(
            "M/M/14+M (Erlang A), minutes as s",
            14,
            10 / 14,
            n(30_000),
            0.05,
            mean_service_s=3.0,
            patience=("exponential", 5.0),
            checks=(
                ("P(wait)", erlang_a.p_wait, waited_share),
                ("P(abandon)", erlang_a.p_abandon, abandoned_share),
                ("Wq", erlang_a.wq, mean_wait_all),
            ),
        ),
        *(
            Scenario(
                f"M/M/{c}+D tau={tau:g} rho=0.9, {how}",
                c,
                0.9,
                n(25_000),
                0.05,
                checks=(("P(abandon)", p_abandon, abandoned_share),),
                **setting,
            )
            for c, tau, p_abandon in mmcd
            for how, setting in (
                ("clients leave while waiting", dict(patience=("deterministic", tau))),
                ("expiry at the front", dict(expire_after_s=tau)),
            )
        ),
    ]


def sharing_scenarios(scale: float = 1.0) -> list[BatchScenario]:
    """A batching engine against the closed forms of engines that share: processor sharing for two
    length distributions (insensitivity), continuous batching as state-dependent processor sharing
    (a step of a + b n seconds, geometric lengths) without and with a cap K on the batch, and bulk
    service M/M^[K]/1.

    Steps are discrete and a request joins at a step's end, so the engine is close to, not equal to,
    these continuous-time forms; the parameters keep the gap (docs/simulate.md, "Engines that
    share") well inside the intervals. At ``scale`` 1 with 10 replications every half-width is under
    2 % of its value (0.7-1.6 % with seed 1, 0.6-1.1 % with seed 2; the lengths aim at about 1.2 %:
    the half-width of 10 replications varies by a third from seed to seed).
    """

    def n(requests: int) -> int:
        return max(2000, int(requests * scale))

    a, b, tokens = 0.010, 0.0002, 200
    batching = StepModel(b0=a, b1=0.0, b2=b, b3=0.0)
    # Processor sharing: no step overhead, so a step of n sequences takes b n and each gets b of
    # service; mean size 1 s in both, so rho = lam. Deterministic lengths need many tokens (see the
    # docs); geometric ones do not.
    ps = theory.mg1_ps(0.3, 1.0).w
    capped = theory.continuous_batching_capped(5.0, a, b, tokens, 16).w
    bulk = theory.bulk_service(3.0, 1.0, 4).w
    return [
        BatchScenario(
            "M/M/1-PS rho=0.3, batching: geometric lengths",
            0.3,
            Lengths("geometric", 10),
            StepModel(b0=0.0, b1=0.0, b2=0.1, b3=0.0),
            n(20_000),
            0.05,
            checks=(("W", ps, mean_sojourn),),
            control=Control("mean tokens", 10, mean_tokens),
        ),
        BatchScenario(
            "M/G/1-PS rho=0.3, batching: 50 tokens each",
            0.3,
            Lengths("deterministic", 50),
            StepModel(b0=0.0, b1=0.0, b2=0.02, b3=0.0),
            n(16_000),
            0.05,
            checks=(("W", ps, mean_sojourn),),
            control=Control("mean gap", 1 / 0.3, mean_gap),
        ),
        # No control here: the steps add a / (2 (1 - c)) = 0.25 % to W, which a much narrower
        # interval would see.
        *(
            BatchScenario(
                f"batching a=10ms b=0.2ms E[L]=200 lambda={lam:g}",
                lam,
                Lengths("geometric", tokens),
                batching,
                n(requests),
                0.05,
                checks=(("W", theory.continuous_batching(lam, a, b, tokens).w, mean_sojourn),),
            )
            for lam, requests in ((5.0, 35_000), (12.5, 80_000))
        ),
        BatchScenario(
            "batching a=10ms b=0.2ms E[L]=200 K=16 lambda=5",
            5.0,
            Lengths("geometric", tokens),
            batching,
            n(70_000),
            0.05,
            max_num_seqs=16,
            checks=(("W", capped, mean_sojourn),),
            control=Control("mean tokens", tokens, mean_tokens),
        ),
        # Every request one token and no prompt: a step is a batch's service, exponential whatever
        # its size.
        BatchScenario(
            "M/M^[4]/1 bulk service lambda=3 mu=1 (Bailey)",
            3.0,
            Lengths("deterministic", 1),
            StepModel(b0=1.0, b1=0.0, b2=0.0, b3=0.0, cv=1.0),
            n(300_000),
            0.02,
            max_num_seqs=4,
            checks=(("W", bulk, mean_sojourn),),
            control=Control("mean step time", 1.0, mean_step_s),
        ),
    ]


#: The fleet size of the power-of-d row: its mean-field limit is N -> infinity, and the finite
#: fleet's excess (O(1 / N)) must sit well inside the interval. Measured over 8 seeds of 300,000
#: requests at rho 0.9, d 2: +0.34 s (13 %) at N 10, +0.07 s (2.8 %) at 30, +0.028 +- 0.014 s
#: (1.1 %) at 100, +0.007 +- 0.013 s (0.3 %) at 400, against a half-width of about 1.5 %.
POWER_OF_D_REPLICAS = 400


def fleet_scenarios(scale: float = 1.0) -> list[Scenario]:
    """Replicas of one engine each (exponential service of mean 1 s, Poisson arrivals), behind a
    router, against their closed forms: random routing to 4 (each an M/M/1 at lambda / 4), round
    robin to 4 (each an E_4/M/1), the power of 2 choices at rho 0.9 against its mean-field limit
    (:data:`POWER_OF_D_REPLICAS` replicas), and a central queue in front of 4 (M/M/4, Erlang C).
    Each has the mean service time as a control variate: a run's realised load moves its waits;
    round robin's Wq has the realised load itself (:func:`load_deviation`), arrivals and sizes:
    at 30,000 requests it cut that row's half-width from 5.4 % to 3.5 % where the mean service
    alone did not narrow random routing's (2.0 % against 2.1 % at 150,000: there the wait's own
    slow swings, not the load, spread the runs), so random routing runs 1,000,000 requests.
    At ``scale`` 1 every half-width is meant under 2 % of its value. Two rows keep a floor at any
    scale: the mean-field row 100,000 requests (a fleet of 400 started empty at 360 arrivals a
    second fills over tens of seconds, which its warm-up must hold), random routing 150,000 (at
    10,000 per replica an M/M/1 at rho 0.8 has a wait skewed to the right, most runs' below the
    mean, and the control variate's narrow interval missed 4 s at 40,000 requests)."""

    def n(requests: int, least: int = 2000) -> int:
        return max(least, int(requests * scale))

    service = Control("mean service", 1.0, mean_service)
    load = Control("realised load", 0.0, load_deviation(3.2, 1.0))
    rr = theory.round_robin(3.2, 1, 4)
    central = theory.mmc(3.2, 1, 4)
    pod = theory.power_of_d(0.9, 1, 2)
    return [
        Scenario(
            "4 replicas, random routing, rho=0.8 (4 x M/M/1)",
            1,
            0.8,
            n(1_000_000, 150_000),
            0.1,
            replicas=4,
            router=Random(),
            control=service,
            checks=(("Wq", theory.random_routing(3.2, 1, 4).wq, mean_wait),),
        ),
        Scenario(
            "4 replicas, round robin, rho=0.8 (E_4/M/1)",
            1,
            0.8,
            n(300_000),
            0.1,
            replicas=4,
            router=RoundRobin(),
            control=(service, load),
            checks=(
                ("P(wait)", rr.p_wait, wait_share_over(0.0)),
                ("Wq", rr.wq, mean_wait),
            ),
        ),
        Scenario(
            f"{POWER_OF_D_REPLICAS} replicas, power of 2 choices, rho=0.9 (mean field)",
            1,
            0.9,
            n(300_000, 100_000),
            0.1,
            replicas=POWER_OF_D_REPLICAS,
            router=PowerOfD(2),
            control=service,
            checks=(("W", pod.w, mean_sojourn),),
        ),
        Scenario(
            "4 replicas, central queue, rho=0.8 (Erlang C)",
            1,
            0.8,
            n(300_000),
            0.1,
            replicas=4,
            router=Central(),
            control=service,
            checks=(
                ("P(wait)", central.p_wait, wait_share_over(0.0)),
                ("W", central.w, mean_sojourn),
            ),
        ),
    ]


def _run_one(args: tuple[Case, int]) -> list[float]:
    scenario, seed = args
    return scenario.run(seed)


def check(
    scenarios: list[Case] | None = None,
    *,
    replications: int = 10,
    seed: int = 1,
    level: float = 0.95,
    workers: int | None = None,
    on_each: Callable[[], object] = lambda: None,
) -> pd.DataFrame:
    """Simulate every scenario and return one row per checked quantity; ``on_each()`` after each
    replication (a progress bar's tick; in the order they were asked for).

    Columns: case, quantity, theory, sim_mean, ci_low, ci_high, rel_half_width (the interval's
    half-width over the closed-form value), control (the control variate's name; "" for a plain
    mean), inside (the closed form lies in the interval) and verdict: "pass", "fail", or "too wide"
    where rel_half_width exceeds TOO_WIDE (or there is no interval), which is neither. Results do
    not depend on ``workers``: each replication has its own seed.
    """
    if replications < 2:
        raise ValueError("need at least 2 replications for a confidence interval")
    scenarios = standard_scenarios() if scenarios is None else scenarios
    jobs = [(s, seed + r) for s in scenarios for r in range(replications)]
    workers = workers or os.cpu_count() or 1
    if workers > 1:
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
            results = [_ticked(r, on_each) for r in pool.map(_run_one, jobs, chunksize=1)]
    else:
        results = [_ticked(_run_one(job), on_each) for job in jobs]
    m = sum(len(s.checks) for s in scenarios)
    each = 1 - (1 - level) / m
    rows = []
    for i, scenario in enumerate(scenarios):
        reps = np.array(results[i * replications : (i + 1) * replications])
        columns, k = control_columns(scenario), len(scenario.checks)
        pairs = zip(scenario.checks, controls_of(scenario))
        for j, ((quantity, value, _), control) in enumerate(pairs):
            if control is None:
                mean, low, high = mean_ci(reps[:, j], each)
            else:
                x = reps[:, k + columns.index(control)]
                mean, low, high = controlled_mean_ci(reps[:, j], x, control.mean, each)
            rows.append(
                dict(
                    case=scenario.name,
                    quantity=quantity,
                    theory=value,
                    sim_mean=mean,
                    ci_low=low,
                    ci_high=high,
                    control="" if control is None else control.name,
                    **judge_interval(value, low, high),
                )
            )
    table = pd.DataFrame(rows)
    table.attrs.update(
        level=level, level_each=each, replications=replications, seed=seed, too_wide=TOO_WIDE
    )
    return table


def _ticked(result, on_each: Callable[[], object]):
    on_each()
    return result


def judge_interval(value: float, low: float, high: float) -> dict:
    """rel_half_width, inside and verdict of a closed-form ``value`` against the interval [low,
    high]."""
    width = (high - low) / 2 / abs(value) if value != 0 else np.inf
    inside = bool(low <= value <= high)
    if not width <= TOO_WIDE:  # NaN (no interval) included
        verdict = "too wide"
    else:
        verdict = "pass" if inside else "fail"
    return dict(rel_half_width=float(width), inside=inside, verdict=verdict)


def tally(table: pd.DataFrame) -> dict[str, int]:
    """How many rows of a :func:`check` table pass, fail and are too wide to judge."""
    counts = table["verdict"].value_counts()
    return {verdict: int(counts.get(verdict, 0)) for verdict in ("pass", "fail", "too wide")}


def shown(table: pd.DataFrame) -> pd.DataFrame:
    """A :func:`check` table as printed: the half-width in per cent of the value, FAIL in
    capitals."""
    return (
        table.drop(columns="inside")
        .assign(
            rel_half_width=[f"{w:.1%}" if np.isfinite(w) else "-" for w in table["rel_half_width"]],
            verdict=table["verdict"].replace({"fail": "FAIL"}),
        )
        .rename(columns={"rel_half_width": "half-width"})
    )
