"""A property-testing kit for qsim and what you build on it: hypothesis strategies and invariant checkers.

Needs hypothesis, which qsim itself never imports: ``pip install 'qlab[testing]'``. docs/testing.md
shows a new discipline and a new policy tested with it in ten lines.

Strategies (hypothesis ``SearchStrategy`` objects):

* :func:`policies`: policies with random admission settings and disciplines;
* :func:`engine_settings`: engine counts, machine speed, service noise, tracked or fixed estimates, and
  (``batching=True``) batching engines, :func:`batching_engines` (:class:`qsim.engines.Batching`: seats,
  token budget, chunked prefill, KV blocks, a :func:`step_models` step model);
* :func:`workloads`: arrival process, service distribution, load, length, seed and prompt lengths;
* :func:`runs`: all three together, a :class:`SimRun` that builds its trace and simulates it;
* :func:`traces`: the traces of such runs.

Checkers raise :class:`InvariantBroken` (an AssertionError) whose message names the invariant and
the request that breaks it:

* on the simulator's records (:func:`check_records` runs them all): :func:`check_one_outcome_each`,
  :func:`check_conservation`, :func:`check_at_most_k_in_service` (a batching engine:
  :func:`check_at_most_seats_in_batch`, :func:`check_kv_blocks`), :func:`check_work_conserving`,
  :func:`check_queue_bound`, :func:`check_order`; a batching engine's books are audited at every step
  while it runs (:func:`audited_batches`);
* on the queue core itself, through any interleaving of arrivals, finishes, failures, stalls,
  cancels and give-ups: :func:`check_queue_core` (a hypothesis state machine, :func:`queue_machine`),
  for the disciplines and policies it is given. A discipline comes with the order it promises
  (:class:`DisciplineCase`), by default its own declared key, and every time the queue pops from
  it the request popped must have the least claimed key among those waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

try:
    from hypothesis import Phase, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
    from hypothesis.stateful import run_state_machine_as_test
except ImportError as exc:  # qsim runs without hypothesis; only this kit needs it
    raise ImportError("qsim.testing needs hypothesis: pip install 'qlab[testing]' (or hypothesis itself)") from exc

import numpy as np
import pandas as pd

from .batch import BatchQueue
from .config import ServerConfig, StallRule
from .disciplines import AdaptiveLifo, CoDel, Edf, FairShare, Fifo, Keyed, Lifo, Priority, ShortestFirst
from .engines import Batching, EngineModel, OneAtATime, StepModel
from .entry import Entry
from .model import simulate
from .outcomes import Outcome, Reason
from .policy import PRESETS, Policy, Rejection
from .queue import AdmissionQueue
from .records import OUTCOMES
from .service import ServiceModel
from .arrivals import arrivals_take_load
from .mixes import REFERENCE_MIX, Prompts, blended_means
from .trace import Trace
from .workload import make_trace

__all__ = [
    "ARRIVALS", "DECLARED", "DISCIPLINES", "PROMPTS", "DisciplineCase", "EngineSettings", "InvariantBroken",
    "SimRun", "Workload", "adaptive", "audited_batches", "batching_engines", "by_arrival",
    "check_at_most_k_in_service", "check_at_most_seats_in_batch", "check_conservation", "check_kv_blocks",
    "check_one_outcome_each", "check_order", "check_queue_bound", "check_queue_core", "check_records",
    "check_work_conserving", "engine_settings", "least_served", "newest_first", "policies", "preset_policies",
    "queue_machine", "records_order", "runs", "step_models", "traces", "workloads",
]


class InvariantBroken(AssertionError):
    """An invariant does not hold: the message names it and the request (or engine) that breaks it."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant


#: Times that differ by less than this are the same instant (float sums of service times).
TIME_TOL = 1e-9


# ---------------------------------------------------------------- the order a discipline promises


def by_arrival(discipline, entry: Entry) -> float:
    """FIFO's promise: the earliest arrival first."""
    return entry.arrived_at


def newest_first(discipline, entry: Entry) -> float:
    """LIFO's promise: the latest arrival first."""
    return -entry.arrived_at


def adaptive(discipline, entry: Entry) -> float:
    """Adaptive LIFO's promise: FIFO while fewer than its threshold wait, LIFO from then on."""
    return -entry.arrived_at if len(discipline) >= discipline.threshold else entry.arrived_at


def least_served(discipline, entry: Entry) -> float:
    """Fair share's promise: the client given the least service so far (its counter) first."""
    return discipline.counter[entry.client]


def declared_key(discipline, entry):
    """The key a :class:`~qsim.disciplines.Keyed` discipline declares it orders by."""
    return discipline.key(entry)


#: A :class:`DisciplineCase`'s ``order`` when not given: the discipline's own declared key.
DECLARED = declared_key


@dataclass(frozen=True)
class DisciplineCase:
    """A discipline under test: how to make an empty one, and the order it promises.

    order(discipline, entry): the key of a waiting entry just before the queue pops; the entry
    popped must have the least key of all those waiting (ties allowed). By default the
    discipline's own key (a :class:`~qsim.disciplines.Keyed` one declares it); a discipline that
    declares none must say its order, or ``order=None`` to promise none (the other invariants
    are still checked). Every discipline is work-conserving in this core (``pop_next`` gives an
    entry whenever one waits), and the state machine checks that it is.
    """

    name: str
    make: Callable[[], Any]
    order: Callable[[Any, Entry], Any] | None = DECLARED

    def __post_init__(self) -> None:
        if self.order is DECLARED and not isinstance(self.make(), Keyed):
            raise ValueError(f"discipline {self.name!r} declares no key (it is not a qsim.disciplines.Keyed): "
                             "give the order it promises, order=..., or order=None to promise none")


#: Every discipline qsim ships, with the order it promises (tests/test_queue.py checks each; a
#: discipline added to qsim.disciplines.DISCIPLINES must be added here, which a test checks too).
DISCIPLINES: tuple[DisciplineCase, ...] = (
    DisciplineCase("fifo", Fifo, by_arrival),
    DisciplineCase("lifo", Lifo, newest_first),
    DisciplineCase("adaptive-lifo", lambda: AdaptiveLifo(3), adaptive),
    DisciplineCase("edf", Edf),
    DisciplineCase("sjf", ShortestFirst),
    # Stronger than the declared key: FIFO within a class.
    DisciplineCase("priority", Priority, lambda d, e: (-e.priority, e.arrived_at)),
    DisciplineCase("priority-edf", lambda: Priority("edf")),
    DisciplineCase("codel", lambda: CoDel(0.2, 0.5), by_arrival),
    DisciplineCase("fair", FairShare, least_served),
)


def _queued_in(policy: Policy, case: DisciplineCase) -> Policy:
    """``policy`` (its class, its fields, its own rule) with its queue in ``case``'s discipline, watched."""
    return _watched_class(type(policy), case)(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})


@functools.cache
def _watched_class(kind: type, case: DisciplineCase) -> type:
    """A subclass of a policy class whose queue is ``case``'s discipline, watched: a policy class that overrides
    make_discipline, as one of one's own does (docs/policies.md)."""
    class Watched(kind):
        def make_discipline(self):
            return _Watched(case)

    Watched.__name__ = Watched.__qualname__ = f"{kind.__name__}[{case.name}]"
    return Watched


class _Watched:
    """The discipline under test, checked at every pop against the order it promises; otherwise itself."""

    def __init__(self, case: DisciplineCase) -> None:
        self.inner, self.case = case.make(), case
        self.broken = False  # it broke its promise: the queue popped an entry and lost it to the raise

    def push(self, entry) -> None:
        self.inner.push(entry)

    def pop_next(self, now: float):
        order, inner = self.case.order, self.inner
        keyed = [(order(inner, e), e) for e in inner] if order is not None else []
        entry = inner.pop_next(now)
        if order is not None:
            mine = next((k for k, e in keyed if e is entry), None)
            if mine is None:
                self.broken = True
                raise InvariantBroken(f"discipline {self.case.name}",
                                      f"popped request {entry.req!r}, which was not waiting")
            ahead = [(k, e) for k, e in keyed if k < mine]
            if ahead:
                key, other = min(ahead, key=lambda item: item[0])
                self.broken = True
                raise InvariantBroken(f"discipline {self.case.name}'s order",
                                      f"popped request {entry.req!r} (key {mine!r}) while request {other.req!r} "
                                      f"(key {key!r}) waited at t={now}")
        return entry

    def remove(self, entry) -> None:
        self.inner.remove(entry)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        return iter(self.inner)

    def __getattr__(self, name: str):
        # What the queue may ask of a discipline beyond the five (drop_reason, started, ahead_s) is the
        # inner one's, present or absent alike.
        if name == "inner":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


# ---------------------------------------------------------------- the queue core as a state machine


def preset_policies() -> st.SearchStrategy[Policy]:
    """Every preset, sometimes with a queue bound of 0 to 5 of its own."""
    def preset(name: str, bound: int | None) -> Policy:
        return PRESETS[name] if bound is None else PRESETS[name].with_overrides(max_queue=bound)

    return st.builds(preset, st.sampled_from(sorted(PRESETS)), st.none() | st.integers(0, 5))


#: What an arrival brings: its calibrated estimate, its deadline (None: the policy's), priority and client.
_ARRIVAL = st.tuples(st.floats(0.01, 1.0), st.none() | st.floats(0.05, 3.0), st.integers(-1, 2),
                     st.sampled_from([None, "a", "b", "c"]))


def queue_machine(policy: st.SearchStrategy[Policy] | None = None,
                  disciplines: Iterable[DisciplineCase] = DISCIPLINES) -> type[RuleBasedStateMachine]:
    """A hypothesis state machine that drives :class:`~qsim.queue.AdmissionQueue` under a policy drawn from
    ``policy`` (default: :func:`preset_policies`) and a discipline drawn from ``disciplines`` (each is checked against
    its promised order at every pop), through any interleaving of arrivals, the passing of time, finishes
    (good or failed), stalls, cancels and give-ups, and checks after every step: one outcome per request and
    every request accounted for (waiting, running or ended, never two of these), at most K in service, no idle
    engine while one waits, the queue bound, the summed estimate. At the end
    every engine hands its request back and every request must have exactly one outcome.

    Built when called, from the cases given then."""
    cases = tuple(disciplines)
    if not cases:
        raise ValueError("queue_machine needs at least one discipline")
    policy = preset_policies() if policy is None else policy

    class QueueMachine(RuleBasedStateMachine):
        @initialize(engines=st.integers(1, 4), policy=policy, stall=st.booleans(), case=st.sampled_from(cases))
        def setup(self, engines, policy, stall, case):
            self.case, self.policy = case, policy
            self.now = 0.0
            self.outcomes: dict[int, str] = {}
            self.next_id = 0
            config = ServerConfig(_queued_in(policy, case), engines, stall=StallRule(2.0, 0.5) if stall else None)
            self.q = AdmissionQueue(config, start=self._start, drop=self._drop)

        # -- hooks ----------------------------------------------------------------------------

        def _start(self, k, req, now, est):
            entry = self.q.running[k]
            if entry is None or entry.req != req or now != self.now:
                raise InvariantBroken("start", f"request {req} started on engine {k} at t={now}, which holds "
                                               f"{entry and entry.req!r} at t={self.now}")

        def _drop(self, req, now, outcome, reason, est, retry_after_s):
            self._end(req, outcome)

        def _end(self, req, outcome):
            if req in self.outcomes:
                raise InvariantBroken("one outcome per request", f"request {req} ended twice: {self.outcomes[req]}, "
                                                                 f"then {outcome}")
            if outcome not in OUTCOMES:
                raise InvariantBroken("one outcome per request",
                                      f"request {req} ended {outcome!r}, not one of {OUTCOMES}")
            self.outcomes[req] = outcome

        def _busy(self) -> list[int]:
            return [k for k, e in enumerate(self.q.running) if e is not None]

        # -- events ---------------------------------------------------------------------------

        @rule(dt=st.floats(0, 1.0))
        def advance(self, dt):
            self.now += dt

        @rule(args=_ARRIVAL)
        def arrive_one(self, args):
            self.arrive(*args)

        def arrive(self, base, deadline, priority, client):
            req = self.next_id
            self.next_id += 1
            refusal = self.q.arrive(req, self.now, base, deadline, priority, client)
            if isinstance(refusal, Rejection):
                self._end(req, "rejected")
            elif refusal is not None:
                raise InvariantBroken("arrival", f"request {req}: arrive() returned {refusal!r}, "
                                                 "neither None nor a Rejection")

        @rule(arrivals=st.lists(st.tuples(st.floats(0, 0.2), _ARRIVAL), min_size=2, max_size=8))
        def several(self, arrivals):
            # Arrivals close together fill the queue, so that a pop has a choice to make (and a wrong
            # promise is found in a few dozen examples).
            for dt, args in arrivals:
                self.now += dt
                self.arrive(*args)

        @precondition(lambda self: any(e is not None for e in self.q.running))
        @rule(data=st.data(), ok=st.booleans(), engine_s=st.floats(0.0, 2.0))
        def finish(self, data, ok, engine_s):
            k = data.draw(st.sampled_from(self._busy()), label="engine")
            req = self.q.running[k].req
            factor = self.q.tracker.factor
            outcome = self.q.finished(k, self.now, engine_s, ok)
            if outcome is not None:
                if outcome not in (("good", "late") if ok else ("error",)):
                    raise InvariantBroken("outcome", f"request {req} finished {'ok' if ok else 'failed'} "
                                                     f"and was judged {outcome}")
                self._end(req, outcome)
            if not ok and self.q.tracker.factor != factor:
                raise InvariantBroken("a failure teaches nothing", f"request {req} failed and the speed factor "
                                                                   f"moved from {factor} to {self.q.tracker.factor}")

        @precondition(lambda self: any(e is not None for e in self.q.running))
        @rule(data=st.data())
        def stall(self, data):
            k = data.draw(st.sampled_from(self._busy()), label="engine")
            req = self.q.stall(k, self.now)
            if req is not None:
                self._end(req, "error")

        @precondition(lambda self: self.next_id > 0)
        @rule(data=st.data())
        def cancel(self, data):
            req = data.draw(st.integers(0, self.next_id - 1), label="request")
            if self.q.cancel(req, self.now) is not None:
                self._end(req, "abandoned")

        @rule()
        def give_up(self):
            self.q.give_up(self.now)

        # -- invariants -------------------------------------------------------------------------

        @invariant()
        def at_most_k_in_service(self):
            busy = self._busy()
            if not len(busy) == self.q.in_service <= self.q.engines:
                raise InvariantBroken("at most K in service", f"engines {busy} hold a request, in_service says "
                                                              f"{self.q.in_service}, K = {self.q.engines}")
            idle = [k for k, e in enumerate(self.q.running) if e is None]
            if sorted(self.q.idle) != idle:
                raise InvariantBroken("at most K in service", f"idle list {sorted(self.q.idle)}, engines holding "
                                                              f"nothing {idle}")

        @invariant()
        def no_idle_engine_while_one_waits(self):
            waiting = [e.req for e in self.q.waiting]  # its entries, not its len(): a discipline may miscount
            if self.q.idle and waiting:
                raise InvariantBroken("no idle engine while work waits", f"engines {sorted(self.q.idle)} idle while "
                                                                         f"requests {waiting} wait")

        @invariant()
        def bound_held(self):
            bound = self.policy.max_queue
            if bound is not None and len(self.q.waiting) > bound:
                raise InvariantBroken("queue bound", f"{len(self.q.waiting)} wait under a bound of {bound}: "
                                                     f"{[e.req for e in self.q.waiting]}")

        @invariant()
        def summed_estimate_is_the_sum_over_the_waiting(self):
            total = sum(e.base_s for e in self.q.waiting)
            if not math.isclose(self.q.waiting_base_s, total, abs_tol=1e-9):
                raise InvariantBroken("summed estimate", f"waiting_base_s {self.q.waiting_base_s} but the waiting "
                                                         f"sum to {total}")

        @invariant()
        def every_request_accounted_for(self):
            waiting = {e.req for e in self.q.waiting}
            running = {e.req for k, e in enumerate(self.q.running) if e is not None and not self.q.ended[k]}
            _partition(waiting, running, self.outcomes, self.next_id)

        def teardown(self):
            # At rest (every engine hands its request back, the queue drains) each request has one outcome.
            # Not after a broken promise: the queue lost the entry it popped, and the drain would report that
            # instead of the promise.
            if not hasattr(self, "q") or self.q.waiting.broken:
                return
            for _ in range(10 * (self.next_id + 1)):
                busy = self._busy()
                if not busy:
                    break
                self.now += 1.0
                req = self.q.running[busy[0]].req
                outcome = self.q.finished(busy[0], self.now, 0.1)
                if outcome is not None:
                    self._end(req, outcome)
            _partition({e.req for e in self.q.waiting}, set(), self.outcomes, self.next_id)

    QueueMachine.__name__ = QueueMachine.__qualname__ = f"QueueMachine[{', '.join(c.name for c in cases)}]"
    return QueueMachine


def _partition(waiting: set, running: set, outcomes: Mapping, n: int) -> None:
    """Conservation: every request so far is waiting, running or ended, exactly one of them."""
    for name, group in (("waiting", waiting), ("running", running)):
        both = group & set(outcomes)
        if both:
            req = min(both)
            raise InvariantBroken("one outcome per request", f"request {req} is {name} but already ended "
                                                             f"{outcomes[req]}")
    if waiting & running:
        raise InvariantBroken("conservation", f"request {min(waiting & running)} is both waiting and running")
    lost = set(range(n)) - waiting - running - set(outcomes)
    if lost:
        raise InvariantBroken("one outcome per request", f"request {min(lost)} has no outcome and is neither "
                                                         f"waiting nor running (lost)")


def check_queue_core(policy: st.SearchStrategy[Policy] | None = None,
                     disciplines: Iterable[DisciplineCase] = DISCIPLINES, *, max_examples: int = 100,
                     steps: int = 40, shrink: bool = True) -> None:
    """Run :func:`queue_machine` now, for ``max_examples`` sequences of up to ``steps`` events; raises the first
    broken invariant with the events that led to it, shrunk by hypothesis to a few (``shrink``; shrinking a
    long sequence takes seconds, which a test that only needs the failure can save)."""
    machine = queue_machine(policy, disciplines)
    phases = [p for p in Phase if shrink or p not in (Phase.shrink, Phase.explain)]
    # One failure, the first found: a wrong promise breaks many steps, one explanation is enough.
    run_state_machine_as_test(machine, settings=settings(max_examples=max_examples, stateful_step_count=steps,
                                                         deadline=None, report_multiple_bugs=False, phases=phases))


# ---------------------------------------------------------------- strategies for simulations

#: Arrival processes :func:`workloads` draws from (a burst of 1 and of 25; periodic bursts of 10, and of the load's
#: size). A burst of its own size takes no load: its :class:`Workload`'s load is then unused.
ARRIVALS = ("poisson", "constant", "gamma:0.5", "gamma:3", "burst:1", "burst:25", "periodic:10:1.5", "periodic:1.5")


def policies(disciplines: Iterable[str] = ("fifo",), name: str = "random") -> st.SearchStrategy[Policy]:
    """Policies with random admission settings: a queue bound or none, a limit on queued work or none,
    predictive or not, expiry at the front or not, a default deadline, a discipline from ``disciplines``
    (names of :data:`qsim.disciplines.DISCIPLINES`)."""
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


#: Prompt lengths :func:`workloads` draws from (:class:`qsim.mixes.Prompts` specs): a batching engine computes
#: them before the first token; an engine run one at a time does not see them (its calibration has no prompt term).
PROMPTS = ("none", "fixed:64", "uniform:0:300", "lognormal:64:0.8")


@dataclass(frozen=True)
class EngineSettings:
    """The engines and the machine: how many, how much slower than calibrated, how noisy, and whether the
    policy tracks the machine's speed or keeps the calibrated estimate; or one batching engine
    (``batching``, :class:`qsim.engines.Batching`: its speed and spread are its step model's, and ``count``,
    ``speed`` and ``noise_cv`` stay 1, 1 and 0)."""

    count: int = 1
    speed: float = 1.0
    noise_cv: float = 0.0  # lognormal noise on the mix's service times (the mix only)
    fixed_estimate: bool = False
    batching: Batching | None = None

    def __post_init__(self) -> None:
        if self.batching is not None and (self.count, self.speed, self.noise_cv) != (1, 1.0, 0.0):
            raise ValueError("a batching engine is one engine; its speed and spread are its step model's: "
                             f"count 1, speed 1, noise_cv 0, got {self.count}, {self.speed}, {self.noise_cv}")

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
        """The workload's trace at these engine settings; ``options`` are more of make_trace's (patience=...).
        A batching engine's load is of its saturated throughput (:meth:`qsim.engines.Batching.capacity_rps`)."""
        w, e = self.workload, self.engines
        noise = {"noise_cv": e.noise_cv} if w.service == "mix" else {}
        prompts = Prompts.parse(w.prompts)
        if e.batching is not None:
            _, mean_tokens = blended_means(REFERENCE_MIX, (), ServiceModel())
            options = {"capacity_rps": e.batching.capacity_rps(prompts.mean(), mean_tokens), **options}
        load = w.load if arrivals_take_load(w.arrivals) else None  # a burst's own size sets its rate
        return make_trace(w.arrivals, w.service, load=load, engines=e.count, speed=e.speed, requests=w.requests,
                          seed=w.seed, prompts=prompts, **noise, **options)

    def config(self) -> ServerConfig:
        """The server this run simulates."""
        return ServerConfig(self.policy, self.engines.engine, fixed_estimate=self.engines.fixed_estimate)

    def simulate(self, trace: Trace | None = None, **options) -> pd.DataFrame:
        """simulate() of ``trace`` (default: :meth:`trace`) under this run's policy and engines; ``options`` are
        more of simulate's (retry=..., cancel_after_s=...). A batching engine's bookkeeping is audited at every
        step (:func:`audited_batches`)."""
        with audited_batches() if self.engines.batching is not None else contextlib.nullcontext():
            return simulate(self.trace() if trace is None else trace, self.config(), **options)


def step_models() -> st.SearchStrategy[StepModel]:
    """A batching engine's step times: 1 to 20 ms a step, and per prefill token, per sequence and per context
    token terms or none; steps exactly the model's or spread around it (CV 0.5)."""
    return st.builds(StepModel, b0=st.floats(0.001, 0.02), b1=st.sampled_from([0.0, 2e-5]),
                     b2=st.sampled_from([0.0, 3e-4]), b3=st.sampled_from([0.0, 1e-6]), cv=st.sampled_from([0.0, 0.5]))


def batching_engines(max_num_seqs: int = 32, prefix_caching: bool = False) -> st.SearchStrategy[Batching]:
    """Batching engines (:class:`qsim.engines.Batching`): 1 to ``max_num_seqs`` seats, a token budget of at least
    that, chunked prefill or not, a KV cache unlimited or of 48 to 4,000 tokens (a few requests' to plenty, so
    that some preempt and some are too large for it), in blocks of 1 or 16 tokens; ``prefix_caching``: each
    with a prefix cache (:mod:`qsim.prefix`)."""
    def engine(step, seqs, extra, chunked, kv_tokens, block_size):
        blocks = None if kv_tokens is None else max(1, kv_tokens // block_size)
        return Batching(step, seqs, seqs + extra, chunked, blocks, block_size, prefix_caching)

    return st.builds(engine, step_models(), st.integers(1, max_num_seqs), st.sampled_from([0, 31, 256]),
                     st.booleans(), st.none() | st.integers(48, 4000), st.sampled_from([1, 16]))


def engine_settings(exact: bool = False, max_engines: int = 4,
                    batching: bool = False) -> st.SearchStrategy[EngineSettings]:
    """1 to ``max_engines`` engines, a machine 0.5 to 3 times slower than calibrated, noise CV 0 or 0.3,
    tracked or fixed estimates; ``exact``: the calibrated machine, no noise, tracked (estimates are exact).
    ``batching``: one :func:`batching_engines` engine half the time (not with ``exact``: a batch's estimates
    are projections)."""
    if exact:
        return st.builds(EngineSettings, count=st.integers(1, max_engines))
    one_at_a_time = st.builds(EngineSettings, count=st.integers(1, max_engines), speed=st.floats(0.5, 3.0),
                              noise_cv=st.sampled_from([0.0, 0.3]), fixed_estimate=st.booleans())
    if not batching:
        return one_at_a_time
    return one_at_a_time | st.builds(EngineSettings, fixed_estimate=st.booleans(), batching=batching_engines())


def workloads(exact: bool = False, max_requests: int = 250) -> st.SearchStrategy[Workload]:
    """An arrival process of :data:`ARRIVALS`, the mix or exponential or deterministic service (``exact``: the
    mix), load 0.2 to 3, 1 to ``max_requests`` requests, any seed, prompt lengths of :data:`PROMPTS`."""
    return st.builds(Workload, arrivals=st.sampled_from(ARRIVALS),
                     service=st.just("mix") if exact else st.sampled_from(["mix", "exponential", "deterministic"]),
                     load=st.floats(0.2, 3.0), requests=st.integers(1, max_requests), seed=st.integers(0, 2**32 - 1),
                     prompts=st.sampled_from(PROMPTS))


def runs(exact: bool = False, policy: st.SearchStrategy[Policy] | None = None,
         engines: st.SearchStrategy[EngineSettings] | None = None) -> st.SearchStrategy[SimRun]:
    """Simulations to check: a policy drawn from ``policy`` (default :func:`policies` over every discipline of
    qsim's), engines from ``engines`` (default :func:`engine_settings`; ``engine_settings(batching=True)``: a
    batching engine half the time) and :func:`workloads` (``exact``: estimates equal true service times)."""
    if policy is None:
        policy = policies(tuple(c.name for c in DISCIPLINES))
    return st.builds(SimRun, policy=policy, engines=engine_settings(exact) if engines is None else engines,
                     workload=workloads(exact))


def traces(exact: bool = False) -> st.SearchStrategy[Trace]:
    """Traces of :func:`workloads` at :func:`engine_settings`."""
    return st.builds(lambda e, w: SimRun(Policy(), e, w).trace(), engine_settings(exact), workloads(exact))


@contextlib.contextmanager
def audited_batches() -> Iterator[None]:
    """While in this block, every step a batching engine's core (:class:`qsim.batch.BatchQueue`) plans is audited
    before and after (:meth:`~qsim.batch.BatchQueue.audit`: the KV blocks held add up and never exceed the cache,
    at most ``max_num_seqs`` run, the aggregates match the batch, a step keeps to the token budget); a slip is an
    :class:`InvariantBroken` naming what is off. Patches the class: not for threads running other batches."""
    plan = BatchQueue._next_step

    def checked(self, now):
        _audit(self, now)
        plan(self, now)
        _audit(self, now)

    BatchQueue._next_step = checked
    try:
        yield
    finally:
        BatchQueue._next_step = plan


def _audit(queue: BatchQueue, now: float) -> None:
    try:
        queue.audit()
    except AssertionError as exc:
        raise InvariantBroken("the batch's books", f"at t={now}: {exc}") from None


# ---------------------------------------------------------------- checkers on the simulator's records


def check_one_outcome_each(frame: pd.DataFrame, requests: int) -> None:
    """Every request of a trace of ``requests`` has exactly one first attempt, each row (attempt) exactly one
    outcome of :data:`qsim.records.OUTCOMES`, and request_ids are unique."""
    invariant = "one outcome per request"
    ids = frame["request_id"]
    twice = ids[ids.duplicated()]
    if len(twice):
        raise InvariantBroken(invariant, f"request_id {twice.iloc[0]} has {int((ids == twice.iloc[0]).sum())} rows")
    first = frame.loc[frame["attempt"] == 1, "first_request_id"] if "attempt" in frame else ids
    missing = sorted(set(range(requests)) - set(first.tolist()))
    if missing:
        raise InvariantBroken(invariant, f"request_id {missing[0]} has no row: lost ({len(missing)} of the "
                                         f"trace's {requests} requests have none)")
    extra = sorted(set(first.tolist()) - set(range(requests)))
    if extra:
        raise InvariantBroken(invariant, f"request_id {extra[0]} is not in the trace of {requests} requests")
    outcome = frame["outcome"]
    none = outcome.isna()
    if none.any():
        raise InvariantBroken(invariant, f"request_id {ids[none].iloc[0]} has no outcome ({int(none.sum())} rows "
                                         f"have none)")
    unknown = ~outcome.isin(OUTCOMES)
    if unknown.any():
        raise InvariantBroken(invariant, f"request_id {ids[unknown].iloc[0]} has outcome "
                                         f"{outcome[unknown].iloc[0]!r}, not one of {OUTCOMES}")


def _name(frame: pd.DataFrame, mask) -> str:
    return f"request_id {frame.loc[mask, 'request_id'].iloc[0]}"


def check_conservation(frame: pd.DataFrame, engines: int) -> None:
    """Each request goes arrival -> (queue) -> (engine) -> end, in that order and nowhere else: start and finish
    never before arrival, finish never before start, a refusal ends at its arrival, a request that ran has an
    engine of 0..K-1 and one that never ran has none, and latency is finish minus arrival."""
    invariant = "conservation"
    arrival, start, finish = frame["arrival_s"], frame["start_s"], frame["finish_s"]
    ran = start.notna()
    engine = frame["engine"]
    rules = [
        (finish.isna(), "has no finish time"),
        (ran & (start < arrival - TIME_TOL), "started before it arrived"),
        (ran & (finish < start - TIME_TOL), "finished before it started"),
        (finish < arrival - TIME_TOL, "ended before it arrived"),
        (frame["outcome"].eq(Outcome.REJECTED) & ((finish - arrival).abs() > TIME_TOL),
         "was refused after its arrival"),
        (ran & (engine.isna() | (engine < 0) | (engine >= engines)).fillna(True),
         f"ran on no engine of 0..{engines - 1}"),
        (~ran & engine.notna(), "never ran but names an engine"),
        ((frame["latency_s"] - (finish - arrival)).abs() > TIME_TOL, "has latency_s other than finish - arrival"),
    ]
    for bad, what in rules:
        bad = bad.fillna(False).to_numpy(dtype=bool)
        if bad.any():
            raise InvariantBroken(invariant, f"{_name(frame, bad)} {what}")


def _occupancy(frame: pd.DataFrame, batching: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row positions, start, end) of each request's spell in service: from start to finish, or, on an engine run
    one at a time, where the request ended while its run went on (its client left, or its engine stalled), to
    start + its true service time. In a batch (``batching``) a request leaves the batch when it ends."""
    ran = frame["start_s"].notna().to_numpy()
    start = frame["start_s"].to_numpy(dtype=float)
    end = frame["finish_s"].to_numpy(dtype=float)
    if not batching:
        runs_on = (frame["outcome"].eq(Outcome.ABANDONED) | frame["reason"].eq(Reason.ENGINE_STALLED)).fillna(False)
        runs_on = runs_on.to_numpy(bool)
        end = np.where(runs_on, np.maximum(end, start + frame["true_service_s"].to_numpy(dtype=float)), end)
    rows = np.flatnonzero(ran)
    return rows, start[rows], end[rows]


def check_at_most_k_in_service(frame: pd.DataFrame, engines: int) -> None:
    """No engine runs two requests at once, so never more than K are in service."""
    rows, start, end = _occupancy(frame)
    engine = frame["engine"].to_numpy(dtype=float, na_value=np.nan)[rows]
    order = np.lexsort((start, engine))
    for a, b in zip(order[:-1], order[1:]):
        if engine[a] == engine[b] and start[b] < end[a] - TIME_TOL:
            raise InvariantBroken("at most K in service",
                                  f"request_id {frame['request_id'].iloc[rows[b]]} started on engine {int(engine[b])} "
                                  f"at t={start[b]} while request_id {frame['request_id'].iloc[rows[a]]} ran there "
                                  f"until t={end[a]}")


def check_at_most_seats_in_batch(frame: pd.DataFrame, max_num_seqs: int) -> None:
    """A batching engine never holds more than ``max_num_seqs`` requests at once. Records give each request one
    spell, from its first joining the batch to its end; a request preempted meanwhile was out of the batch for
    part of it, so only the spells of requests never preempted are counted (a necessary condition; the
    :func:`audited_batches` audit counts seats exactly at every step)."""
    rows, start, end = _occupancy(frame, batching=True)
    kept = (frame["preemptions"].to_numpy(dtype=float, na_value=np.nan)[rows] == 0)
    rows, start, end = rows[kept], start[kept], end[kept]
    held = _busy_at(start, start, end)
    over = np.flatnonzero(held > max_num_seqs)
    if len(over):
        i = over[0]
        raise InvariantBroken("at most K in service",
                              f"request_id {frame['request_id'].iloc[rows[i]]} joined the batch at t={start[i]} with "
                              f"{held[i] - 1} others in it, over max_num_seqs {max_num_seqs}")


def check_kv_blocks(frame: pd.DataFrame, kv_blocks: int | None) -> None:
    """No request of a batching engine held more KV blocks than the cache has."""
    if kv_blocks is None:
        return
    peak = frame["kv_blocks_peak"].to_numpy(dtype=float, na_value=np.nan)
    over = peak > kv_blocks
    if over.any():
        raise InvariantBroken("KV blocks", f"{_name(frame, over)} held {int(peak[over][0])} blocks of a cache of "
                                           f"{kv_blocks}")


def _busy_at(t: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """How many engines are busy at each time in ``t`` (a spell covers [start, end))."""
    return ((start[None, :] <= t[:, None] + TIME_TOL) & (t[:, None] < end[None, :] - TIME_TOL)).sum(axis=1)


def _waited(frame: pd.DataFrame) -> np.ndarray:
    """When each admitted request left the queue: its start, or its end if it never started."""
    return frame["start_s"].fillna(frame["finish_s"]).to_numpy(dtype=float)


def _steps_in_flight(frame: pd.DataFrame, rows: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Spell ends of a batch, where a request left it mid-step (its client left, or it was cut at its deadline)
    carried on to the next join: the step it was in runs to its end, and records do not say when that was."""
    left = frame["outcome"].isin([Outcome.ABANDONED, Outcome.CANCELLED]).to_numpy(bool)[rows]
    joins = np.sort(start)
    after = np.searchsorted(joins, end, side="right")
    nxt = np.where(after < len(joins), joins[np.minimum(after, len(joins) - 1)], end)
    return np.where(left, np.maximum(end, nxt), end)


def check_work_conserving(frame: pd.DataFrame, engines: int, batching: bool = False) -> None:
    """While a request waits, every engine is busy: at each event time between a request's arrival and its
    leaving the queue (its start, or its end unrun), K engines hold a request. A batching engine (``batching``,
    ``engines`` 1) may keep a request waiting beside free seats (the step in flight, the token budget, the KV
    blocks), but never idles while one waits: a request is in the batch, or a step is in flight."""
    rows, start, end = _occupancy(frame, batching)
    if batching:
        end = _steps_in_flight(frame, rows, start, end)
    arrival, left = frame["arrival_s"].to_numpy(dtype=float), _waited(frame)
    admitted = frame["outcome"].ne(Outcome.REJECTED).to_numpy(bool)
    events = np.unique(np.concatenate([start, end, arrival]))
    busy = _busy_at(events, start, end)
    for i in np.flatnonzero(admitted & (left > arrival + TIME_TOL)):
        during = (events >= arrival[i] - TIME_TOL) & (events < left[i] - TIME_TOL)
        idle = during & (busy < engines)
        if idle.any():
            t = events[idle][0]
            raise InvariantBroken("no idle engine while work waits",
                                  f"request_id {frame['request_id'].iloc[i]} waited from t={arrival[i]} to "
                                  f"t={left[i]}, and at t={t} only {busy[idle][0]} of {engines} engines were busy")


def check_queue_bound(frame: pd.DataFrame, max_queue: int) -> None:
    """Never more than ``max_queue`` wait (not counting those in service): none admitted saw more at its
    arrival, and none made more by joining. (A batching engine puts the requests it preempts back in line
    whatever the bound: one that arrives then may see more, and is refused.)"""
    seen = frame["queued_at_arrival"].astype("Float64")
    admitted = frame["outcome"].ne(Outcome.REJECTED).to_numpy(bool)
    over = (seen > max_queue).fillna(False).to_numpy(bool) & admitted
    if over.any():
        raise InvariantBroken("queue bound", f"{_name(frame, over)} arrived with {seen[over].iloc[0]} waiting, "
                                             f"over the bound of {max_queue}")
    admitted = frame["outcome"].ne(Outcome.REJECTED).to_numpy(bool)
    arrival, left = frame["arrival_s"].to_numpy(dtype=float)[admitted], _waited(frame)[admitted]
    times = np.concatenate([arrival, left])
    steps = np.concatenate([np.ones(len(arrival)), -np.ones(len(left))])
    # At equal times, leaving the queue (to an engine) comes before the next arrival joins it.
    order = np.lexsort((steps, times))
    depth = np.cumsum(steps[order])
    if len(depth) and depth.max() > max_queue:
        at = times[order][int(np.argmax(depth))]
        raise InvariantBroken("queue bound", f"{int(depth.max())} waited at t={at}, over the bound of {max_queue}")


def records_order(discipline, fixed_estimate: bool = False,
                  batching: bool = False) -> Callable[[pd.DataFrame], list] | None:
    """What a discipline of qsim's promises about starts, as a key over records' columns (see
    :func:`check_order`); None where records cannot say (adaptive LIFO, fair share, a discipline of
    one's own: :func:`check_queue_core` checks those). SJF only with fixed estimates (records hold the
    estimate times the speed factor of each arrival, which tracking changes). On a batching engine
    (``batching``) FIFO's alone: the head of the line that does not fit the batch yet keeps its place
    there, and a request that arrives meanwhile with a smaller key waits behind it."""
    kind = type(discipline)
    if kind in (Fifo, CoDel):
        return lambda f: list(f["arrival_s"])
    if batching:
        return None
    if kind is Lifo:
        return lambda f: list(-f["arrival_s"])
    if kind is Edf:
        return lambda f: list(f["arrival_s"] + f["deadline_s"])
    if kind is Priority:
        edf = discipline.within == "edf"
        return lambda f: list(zip(-f["priority"].astype("int64"), f["arrival_s"] + (f["deadline_s"] if edf else 0.0)))
    if kind is ShortestFirst and fixed_estimate:
        return lambda f: list(f["est_service_s"])
    return None


def check_order(frame: pd.DataFrame, key: Callable[[pd.DataFrame], list], name: str = "the discipline") -> None:
    """At every start, no request then waiting (admitted before it and still queued after it) has a smaller
    ``key(frame)`` (one comparable per row, in row order) than the request started."""
    keys = key(frame)
    ranks = {k: r for r, k in enumerate(sorted(set(keys)))}
    rank = np.asarray([ranks[k] for k in keys])
    admitted = frame["outcome"].ne(Outcome.REJECTED).to_numpy(bool)
    arrival, left = frame["arrival_s"].to_numpy(dtype=float), _waited(frame)
    start = frame["start_s"].to_numpy(dtype=float)
    for i in np.argsort(start, kind="stable"):
        if np.isnan(start[i]):
            break
        # Waiting then: arrived strictly before (a same-instant arrival may come after the start's event) and
        # leaving the queue strictly after (those leaving at the same instant went first, or were dropped).
        waiting = admitted & (arrival < start[i] - TIME_TOL) & (left > start[i] + TIME_TOL)
        ahead = waiting & (rank < rank[i])
        if ahead.any():
            j = np.flatnonzero(ahead)[np.argmin(rank[ahead])]
            raise InvariantBroken(f"{name}'s order",
                                  f"request_id {frame['request_id'].iloc[i]} (key {keys[i]!r}) started at t={start[i]} "
                                  f"while request_id {frame['request_id'].iloc[j]} (key {keys[j]!r}) waited")


def check_records(frame: pd.DataFrame, run: SimRun, trace: Trace | None = None) -> None:
    """Every records invariant of ``run`` (its trace ``trace``, default the run's own): one outcome per
    request, conservation, at most K in service (a batching engine: at most its seats, and its KV blocks),
    no idle engine while work waits (every discipline is work-conserving in qsim's core), the queue bound,
    and the order of service where the records can say it (:func:`records_order`)."""
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
