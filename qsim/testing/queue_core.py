"""The queue core itself, through any interleaving of arrivals, finishes, failures, stalls,
cancels and give-ups: :func:`check_queue_core` (a hypothesis state machine,
:func:`queue_machine`), for the disciplines and policies it is given. A discipline comes with the
order it promises (:class:`DisciplineCase`), by default its own declared key, and every time the
queue pops from it the request popped must have the least claimed key among those waiting.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from hypothesis.stateful import run_state_machine_as_test

from ..config import ServerConfig, StallRule
from ..disciplines import (
    AdaptiveLifo,
    CoDel,
    Edf,
    FairShare,
    Fifo,
    Keyed,
    Lifo,
    Priority,
    ShortestFirst,
)
from ..entry import Entry
from ..policy import PRESETS, Policy, Rejection
from ..queue import AdmissionQueue
from ..records import OUTCOMES
from .record_checks import InvariantBroken


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
            raise ValueError(
                f"discipline {self.name!r} declares no key (it is not a "
                "qsim.disciplines.Keyed): "
                "give the order it promises, order=..., or order=None to promise none"
            )


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
    """``policy`` (its class, its fields, its own rule) with its queue in ``case``'s discipline,
    watched."""
    return _watched_class(type(policy), case)(
        **{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    )


@functools.cache
def _watched_class(kind: type, case: DisciplineCase) -> type:
    """A subclass of a policy class whose queue is ``case``'s discipline, watched: a policy class
    that overrides make_discipline, as one of one's own does (docs/policies.md)."""

    class Watched(kind):
        def make_discipline(self):
            return _Watched(case)

    Watched.__name__ = Watched.__qualname__ = f"{kind.__name__}[{case.name}]"
    return Watched


class _Watched:
    """The discipline under test, checked at every pop against the order it promises; otherwise
    itself."""

    def __init__(self, case: DisciplineCase) -> None:
        self.inner, self.case = case.make(), case
        # it broke its promise: the queue popped an entry and lost it to the raise
        self.broken = False

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
                raise InvariantBroken(
                    f"discipline {self.case.name}",
                    f"popped request {entry.req!r}, which was not waiting",
                )
            ahead = [(k, e) for k, e in keyed if k < mine]
            if ahead:
                key, other = min(ahead, key=lambda item: item[0])
                self.broken = True
                raise InvariantBroken(
                    f"discipline {self.case.name}'s order",
                    f"popped request {entry.req!r} (key {mine!r}) while request "
                    f"{other.req!r} "
                    f"(key {key!r}) waited at t={now}",
                )
        return entry

    def remove(self, entry) -> None:
        self.inner.remove(entry)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        return iter(self.inner)

    def __getattr__(self, name: str):
        # What the queue may ask of a discipline beyond the five (drop_reason, started, ahead_s) is
        # the inner one's, present or absent alike.
        if name == "inner":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


# ---------------------------------------------------------------- the queue core as a state machine


def preset_policies() -> st.SearchStrategy[Policy]:
    """Every preset, sometimes with a queue bound of 0 to 5 of its own."""

    def preset(name: str, bound: int | None) -> Policy:
        return PRESETS[name] if bound is None else PRESETS[name].with_overrides(max_queue=bound)

    return st.builds(preset, st.sampled_from(sorted(PRESETS)), st.none() | st.integers(0, 5))


#: What an arrival brings: its calibrated estimate, its deadline (None: the policy's), priority and
#: client.
_ARRIVAL = st.tuples(
    st.floats(0.01, 1.0),
    st.none() | st.floats(0.05, 3.0),
    st.integers(-1, 2),
    st.sampled_from([None, "a", "b", "c"]),
)


def queue_machine(
    policy: st.SearchStrategy[Policy] | None = None,
    disciplines: Iterable[DisciplineCase] = DISCIPLINES,
) -> type[RuleBasedStateMachine]:
    """A hypothesis state machine that drives :class:`~qsim.queue.AdmissionQueue` under a policy
    drawn from ``policy`` (default: :func:`preset_policies`) and a discipline drawn from
    ``disciplines`` (each is checked against its promised order at every pop), through any
    interleaving of arrivals, the passing of time, finishes (good or failed), stalls, cancels and
    give-ups, and checks after every step: one outcome per request and every request accounted for
    (waiting, running or ended, never two of these), at most K in service, no idle engine while one
    waits, the queue bound, the summed estimate. At the end every engine hands its request back and
    every request must have exactly one outcome.

    Built when called, from the cases given then."""
    cases = tuple(disciplines)
    if not cases:
        raise ValueError("queue_machine needs at least one discipline")
    policy = preset_policies() if policy is None else policy

    class QueueMachine(RuleBasedStateMachine):
        @initialize(
            engines=st.integers(1, 4),
            policy=policy,
            stall=st.booleans(),
            case=st.sampled_from(cases),
        )
        def setup(self, engines, policy, stall, case):
            self.case, self.policy = case, policy
            self.now = 0.0
            self.outcomes: dict[int, str] = {}
            self.next_id = 0
            config = ServerConfig(
                _queued_in(policy, case), engines, stall=StallRule(2.0, 0.5) if stall else None
            )
            self.q = AdmissionQueue(config, start=self._start, drop=self._drop)

        # -- hooks ----------------------------------------------------------------------------

        def _start(self, k, req, now, est):
            entry = self.q.running[k]
            if entry is None or entry.req != req or now != self.now:
                raise InvariantBroken(
                    "start",
                    f"request {req} started on engine {k} at t={now}, "
                    "which holds "
                    f"{entry and entry.req!r} at t={self.now}",
                )

        def _drop(self, req, now, outcome, reason, est, retry_after_s):
            self._end(req, outcome)

        def _end(self, req, outcome):
            if req in self.outcomes:
                raise InvariantBroken(
                    "one outcome per request",
                    f"request {req} ended twice: {self.outcomes[req]}, then {outcome}",
                )
            if outcome not in OUTCOMES:
                raise InvariantBroken(
                    "one outcome per request",
                    f"request {req} ended {outcome!r}, not one of {OUTCOMES}",
                )
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
                raise InvariantBroken(
                    "arrival",
                    f"request {req}: arrive() returned {refusal!r}, neither None nor a Rejection",
                )

        @rule(arrivals=st.lists(st.tuples(st.floats(0, 0.2), _ARRIVAL), min_size=2, max_size=8))
        def several(self, arrivals):
            # Arrivals close together fill the queue, so that a pop has a choice to make (and a
            # wrong promise is found in a few dozen examples).
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
                    raise InvariantBroken(
                        "outcome",
                        f"request {req} finished "
                        f"{'ok' if ok else 'failed'} "
                        f"and was judged {outcome}",
                    )
                self._end(req, outcome)
            if not ok and self.q.tracker.factor != factor:
                raise InvariantBroken(
                    "a failure teaches nothing",
                    f"request {req} failed and the "
                    "speed factor "
                    f"moved from {factor} to "
                    f"{self.q.tracker.factor}",
                )

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
                raise InvariantBroken(
                    "at most K in service",
                    f"engines {busy} hold a request, "
                    "in_service says "
                    f"{self.q.in_service}, K = "
                    f"{self.q.engines}",
                )
            idle = [k for k, e in enumerate(self.q.running) if e is None]
            if sorted(self.q.idle) != idle:
                raise InvariantBroken(
                    "at most K in service",
                    f"idle list {sorted(self.q.idle)}, engines holding nothing {idle}",
                )

        @invariant()
        def no_idle_engine_while_one_waits(self):
            # its entries, not its len(): a discipline may miscount
            waiting = [e.req for e in self.q.waiting]
            if self.q.idle and waiting:
                raise InvariantBroken(
                    "no idle engine while work waits",
                    f"engines {sorted(self.q.idle)} idle while requests {waiting} wait",
                )

        @invariant()
        def bound_held(self):
            bound = self.policy.max_queue
            if bound is not None and len(self.q.waiting) > bound:
                raise InvariantBroken(
                    "queue bound",
                    f"{len(self.q.waiting)} wait under a bound of "
                    f"{bound}: "
                    f"{[e.req for e in self.q.waiting]}",
                )

        @invariant()
        def summed_estimate_is_the_sum_over_the_waiting(self):
            total = sum(e.base_s for e in self.q.waiting)
            if not math.isclose(self.q.waiting_base_s, total, abs_tol=1e-9):
                raise InvariantBroken(
                    "summed estimate",
                    f"waiting_base_s {self.q.waiting_base_s} but the waiting sum to {total}",
                )

        @invariant()
        def every_request_accounted_for(self):
            waiting = {e.req for e in self.q.waiting}
            running = {
                e.req for k, e in enumerate(self.q.running) if e is not None and not self.q.ended[k]
            }
            _partition(waiting, running, self.outcomes, self.next_id)

        def teardown(self):
            # At rest (every engine hands its request back, the queue drains) each request has one
            # outcome. Not after a broken promise: the queue lost the entry it popped, and the drain
            # would report that instead of the promise.
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

    QueueMachine.__name__ = QueueMachine.__qualname__ = (
        f"QueueMachine[{', '.join(c.name for c in cases)}]"
    )
    return QueueMachine


def _partition(waiting: set, running: set, outcomes: Mapping, n: int) -> None:
    """Conservation: every request so far is waiting, running or ended, exactly one of them."""
    for name, group in (("waiting", waiting), ("running", running)):
        both = group & set(outcomes)
        if both:
            req = min(both)
            raise InvariantBroken(
                "one outcome per request",
                f"request {req} is {name} but already ended {outcomes[req]}",
            )
    if waiting & running:
        raise InvariantBroken(
            "conservation", f"request {min(waiting & running)} is both waiting and running"
        )
    lost = set(range(n)) - waiting - running - set(outcomes)
    if lost:
        raise InvariantBroken(
            "one outcome per request",
            f"request {min(lost)} has no outcome and is neither waiting nor running (lost)",
        )


def check_queue_core(
    policy: st.SearchStrategy[Policy] | None = None,
    disciplines: Iterable[DisciplineCase] = DISCIPLINES,
    *,
    max_examples: int = 100,
    steps: int = 40,
    shrink: bool = True,
) -> None:
    """Run :func:`queue_machine` now, for ``max_examples`` sequences of up to ``steps`` events;
    raises the first broken invariant with the events that led to it, shrunk by hypothesis to a few
    (``shrink``; shrinking a long sequence takes seconds, which a test that only needs the failure
    can save)."""
    machine = queue_machine(policy, disciplines)
    phases = [p for p in Phase if shrink or p not in (Phase.shrink, Phase.explain)]
    # One failure, the first found: a wrong promise breaks many steps, one explanation is enough.
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=steps,
            deadline=None,
            report_multiple_bugs=False,
            phases=phases,
        ),
    )
