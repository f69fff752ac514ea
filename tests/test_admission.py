"""The admission component both queue cores share (:mod:`qsim.admission`).

Its one fast path (``Admission.admit_plain``, which ``AdmissionQueue`` takes for a policy
that reads the basic numbers alone) is held to the general path (``Admission.admit``, as
``AdmissionQueue.arrive`` calls it) on random policies and histories: the same refusals, the
same starts and drops, the same queue, and the same numbers seen, but for the work in service
that a rule admitting all leaves unsaid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsim import testing
from qsim.admission import Admission, Seen
from qsim.batch import BatchQueue
from qsim.clients import uniform
from qsim.config import ServerConfig
from qsim.disciplines import DISCIPLINES
from qsim.engines import Batching, StepModel
from qsim.entry import Work
from qsim.policy import PRESETS, Policy, Rejection, View
from qsim.rules import Rule
from qsim.queue import AdmissionQueue


def _plain(policy: Policy) -> bool:
    empty = Seen(math.nan, 0, 0.0, 1.0)
    return Admission(ServerConfig(policy), counts_refused=False, empty=empty).plain


#: Policies that take the fast path: the plain presets, and random bounds, deadlines and
#: disciplines with either estimator.
ESTIMATORS = st.sampled_from(["limit", "learned"])
PLAIN = st.sampled_from([p for p in PRESETS.values() if _plain(p)]) | st.builds(
    replace, testing.policies(sorted(DISCIPLINES)), estimator=ESTIMATORS)
#: An arrival: its estimate, deadline (None: the policy's), priority, client and work (None: the
#: estimate as it is).
ARRIVAL = st.tuples(st.floats(0.01, 1.0), st.none() | st.floats(0.05, 3.0), st.integers(-1, 2),
                    st.sampled_from([None, "a", "b"]),
                    st.none() | st.tuples(st.integers(1, 64), st.integers(0, 100),
                                          st.integers(1, 64)))
#: Histories: arrivals close together (so that requests wait and a rule has a queue to read),
#: finishes good or failed, and clients that leave.
EVENTS = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.floats(0, 0.1), ARRIVAL),
    st.tuples(st.just("finish"), st.floats(0, 1.0),
              st.tuples(st.integers(0, 3), st.booleans(), st.floats(0, 2.0), st.integers(1, 64))),
    st.tuples(st.just("cancel"), st.floats(0, 0.3), st.integers(0, 40)),
), max_size=60)


def _same(a: tuple, b: tuple) -> bool:
    """Equal field by field, NaN equal to NaN."""
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))


def _queue(policy: Policy, engines: int, log: list) -> AdmissionQueue:
    return AdmissionQueue(ServerConfig(policy, engines),
                          start=lambda *a: log.append(("start", *a)),
                          drop=lambda *a: log.append(("drop", *a)))


class _Pair:
    """The same queue twice: one arriving on the fast path, one on the general path."""

    def __init__(self, policy: Policy, engines: int) -> None:
        self.logs: tuple[list, list] = ([], [])
        self.fast, self.general = (_queue(policy, engines, log) for log in self.logs)
        assert self.fast.arrive.__func__ is AdmissionQueue._arrive_plain

    def arrive(self, req, now: float, args: tuple) -> None:
        base, deadline, priority, client, work = args
        got = self.fast.arrive(req, now, base, deadline, priority, client, work)
        general = AdmissionQueue.arrive  # the class's: the general path
        want = general(self.general, req, now, base, deadline, priority, client, work)
        assert got == want
        seen, wanted = self.fast.seen, self.general.seen
        if math.isnan(seen.in_service_s):  # left unsaid only where the rule cannot read it
            assert self.fast.admission.admits_all and wanted.idle == 0 and priority >= 0
            seen = seen._replace(in_service_s=wanted.in_service_s)
        assert _same(seen, wanted)

    def finish(self, now: float, args: tuple) -> None:
        busy = [k for k, e in enumerate(self.fast.running) if e is not None]
        if busy:
            pick, ok, engine_s, tokens = args
            k = busy[pick % len(busy)]
            fast = self.fast.finished(k, now, engine_s, ok, tokens)
            assert fast == self.general.finished(k, now, engine_s, ok, tokens)

    def check(self) -> None:
        fast, general = self.fast, self.general
        assert self.logs[0] == self.logs[1]
        assert list(fast.waiting) == list(general.waiting)
        assert fast.snapshot() == general.snapshot()
        assert fast.waiting_tokens == general.waiting_tokens


@settings(max_examples=300, deadline=None)
@given(policy=PLAIN, engines=st.integers(1, 3), burst=st.lists(ARRIVAL, min_size=1, max_size=8),
       events=EVENTS)
def test_the_fast_path_decides_as_the_general_path(policy, engines, burst, events):
    pair = _Pair(policy, engines)
    now, sent = 0.0, 0
    for kind, dt, args in [("arrive", 0.0, args) for args in burst] + events:  # a queue forms
        now += dt
        if kind == "arrive":
            pair.arrive(sent, now, args)
            sent += 1
        elif kind == "finish":
            pair.finish(now, args)
        elif sent:
            assert pair.fast.cancel(args % sent, now) == pair.general.cancel(args % sent, now)
        pair.check()


#: The draw each arrival that reached :class:`_Drawn`'s rule was given.
DRAWS: list[float] = []


@dataclass(frozen=True)
class _Drawn(Policy):
    """The built-in rule, noting each arrival's draw."""

    def decide(self, view: View) -> Rejection | None:
        DRAWS.append(view.u)
        return super().decide(view)


def _batch(policy: Policy) -> BatchQueue:
    engine = Batching(StepModel(0.01, 0.0, 0.001, 0.0), max_num_seqs=4, kv_blocks=100)
    return BatchQueue(ServerConfig(policy, engine), step=lambda *a: None, end=lambda *a: None,
                      drop=lambda *a: None)


def test_each_core_indexes_the_shedding_draw_as_it_always_has():
    # One at a time: an arrival its client's bucket refused takes no index. Batching: every one.
    policy = _Drawn(name="drawn", shed_queue_threshold=5.0, client_rate=0.001)
    one = AdmissionQueue(ServerConfig(policy, 4), start=lambda *a: None, drop=lambda *a: None)
    for queue, third in ((one, 2), (_batch(policy), 3)):
        DRAWS.clear()
        work = Work(4, 0, 4)
        assert queue.arrive(0, 0.0, 0.1, client="a", work=work) is None
        assert queue.arrive(1, 0.0, 0.1, client="a", work=work).reason == "rate_limited"
        assert queue.arrive(2, 0.0, 0.1, client="b", work=work) is None
        assert DRAWS == [uniform(0, 1, 0), uniform(0, third, 0)]


def test_a_plug_in_rule_sees_the_view_by_name():
    views: list[View] = []

    @dataclass(frozen=True)
    class Watching(Policy):
        def decide(self, view: View) -> Rejection | None:
            views.append(view)
            return None

    config = ServerConfig(Watching(name="watching", deadline_s=3.0), 1)
    queue = AdmissionQueue(config, start=lambda *a: None, drop=lambda *a: None)
    queue.arrive("a", 0.0, 0.5, work=Work(8, 30, 8))
    queue.arrive("b", 0.1, 0.25, priority=2, client="c", work=Work(8, 20, 8))
    view = views[-1]
    assert (view.queued, view.queued_work_s, view.est_service_s, view.idle) == (0, 0.0, 0.25, 0)
    assert view.deadline_s == 3.0 and view.remaining_s == pytest.approx(0.4)
    assert (view.priority, view.client, view.prompt_tokens, view.queued_tokens) == (2, "c", 20, 0)
    assert view.wait_s is None and view.kv_wait_s is None and math.isnan(view.u)


def test_a_rule_of_its_own_gets_the_batching_cores_projection():
    # A rule part (not an override of decide) reads the projected wait and first token by name.
    views: list[View] = []

    @dataclass(frozen=True)
    class Noting(Rule):
        def check(self, view: View) -> Rejection | None:
            views.append(view)
            return None

    @dataclass(frozen=True)
    class Noted(Policy):
        def make_rules(self):
            return (*super().make_rules(), Noting())

    queue = _batch(Noted(name="noted"))
    assert queue._projects and not _batch(PRESETS["vllm-caps"])._projects  # the walk is for it
    for i in range(3):
        assert queue.arrive(i, 0.0, 0.1, work=Work(4, 10, 4)) is None
    assert len(views) == 3 and all(v.wait_s is not None and v.ttft_s > 0 for v in views)
    assert [v.prompt_tokens for v in views] == [10, 10, 10]
