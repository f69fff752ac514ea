"""The admission component both queue cores share (:mod:`qsim.admission`).

Its one fast path (``Admission.admit_plain``, which ``AdmissionQueue`` takes for a policy
that reads the basic numbers alone) is held to the general path (``Admission.admit``, as
``AdmissionQueue.arrive`` calls it) on random policies and histories: the same refusals, the
same starts and drops, the same queue, and the same numbers seen, but for the work in service
that a rule admitting all leaves unsaid.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsim import make_trace, simulate, testing
from qsim.admission import Admission, Seen
from qsim.batch import BatchQueue
from qsim.clients import uniform
from qsim.config import ServerConfig
from qsim.disciplines import DISCIPLINES
from qsim.engines import Batching, StepModel
from qsim.entry import Work
from qsim.mixes import Client, Prompts
from qsim.outcomes import Reason
from qsim.policy import PRESETS, SHEDDABLE, Policy, Rejection, View
from qsim.rules import Arrival, ClientRate, Predictive, ReserveShare, Rule, RuleState, StateRule
from qsim.queue import AdmissionQueue


def _plain(policy: Policy) -> bool:
    empty = Seen(math.nan, 0, 0.0, 1.0)
    return Admission(ServerConfig(policy), counts_refused=False, empty=empty).plain


#: Policies that take the fast path: the plain presets, and random bounds, deadlines and
#: disciplines with either estimator.
ESTIMATORS = st.sampled_from(["limit", "learned"])
PLAIN = st.sampled_from([p for p in PRESETS.values() if _plain(p)]) | st.builds(
    replace, testing.policies(sorted(DISCIPLINES)), estimator=ESTIMATORS
)
#: An arrival: its estimate, deadline (None: the policy's), priority, client and work (None: the
#: estimate as it is).
ARRIVAL = st.tuples(
    st.floats(0.01, 1.0),
    st.none() | st.floats(0.05, 3.0),
    st.integers(-1, 2),
    st.sampled_from([None, "a", "b"]),
    st.none() | st.tuples(st.integers(1, 64), st.integers(0, 100), st.integers(1, 64)),
)
#: Histories: arrivals close together (so that requests wait and a rule has a queue to read),
#: finishes good or failed, and clients that leave.
EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.floats(0, 0.1), ARRIVAL),
        st.tuples(
            st.just("finish"),
            st.floats(0, 1.0),
            st.tuples(st.integers(0, 3), st.booleans(), st.floats(0, 2.0), st.integers(1, 64)),
        ),
        st.tuples(st.just("cancel"), st.floats(0, 0.3), st.integers(0, 40)),
    ),
    max_size=60,
)


def _same(a: tuple, b: tuple) -> bool:
    """Equal field by field, NaN equal to NaN."""
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))


def _queue(policy: Policy, engines: int, log: list) -> AdmissionQueue:
    return AdmissionQueue(
        ServerConfig(policy, engines),
        start=lambda *a: log.append(("start", *a)),
        drop=lambda *a: log.append(("drop", *a)),
    )


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
@given(
    policy=PLAIN,
    engines=st.integers(1, 3),
    burst=st.lists(ARRIVAL, min_size=1, max_size=8),
    events=EVENTS,
)
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
    return BatchQueue(
        ServerConfig(policy, engine),
        step=lambda *a: None,
        end=lambda *a: None,
        drop=lambda *a: None,
    )


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


# -- rules that keep state (qsim.rules.Rule.state) -------------------------------------------


@dataclass(frozen=True)
class AdmissionsPerClient(StateRule):
    """A stateful rule of one's own: at most ``most`` admissions per client in a run."""

    most: int

    def state(self) -> RuleState:
        return _Admitted(self.most)


class _Admitted(RuleState):
    """Each client's admissions so far: refused once it has ``most``; counted when admitted."""

    def __init__(self, most: int) -> None:
        self.most, self.admitted = most, Counter()

    def check(self, view: View, arrival: Arrival) -> Rejection | None:
        if view.client is not None and self.admitted[view.client] >= self.most:
            return Rejection(Reason.RATE_LIMITED, {"admitted": self.most}, None)
        return None

    def decided(self, view: View, arrival: Arrival, refusal: Rejection | None) -> None:
        if refusal is None and view.client is not None:
            self.admitted[view.client] += 1


@dataclass(frozen=True)
class Quota(Policy):
    """predictive, and at most ``most`` admissions per client."""

    predictive: bool = True
    most: int = 15

    def make_rules(self):
        return (*super().make_rules(), AdmissionsPerClient(self.most))


@pytest.mark.parametrize("engine", ["one-at-a-time", "batching"])
def test_a_stateful_rule_of_its_own_is_one_more_part(engine):
    policy = Quota(name="quota", most=15)
    assert policy.rules == (SHEDDABLE, Predictive(), AdmissionsPerClient(15))
    model = (
        2
        if engine == "one-at-a-time"
        else Batching(StepModel(0.004, 2e-5, 3e-4, 1e-6), max_num_seqs=8, kv_blocks=400)
    )
    config = ServerConfig(policy, model, seed=3)
    clients = (Client("a", 0.6, 0), Client("b", 0.3, 0), Client("c", 0.1, 0))
    trace = make_trace(
        load=1.0,
        engines=2,
        requests=200,
        seed=3,
        clients=clients,
        **(
            {
                "prompts": Prompts.parse("uniform:0:100"),
                "capacity_rps": model.capacity_rps(50.0, 20.0),
            }
            if engine == "batching"
            else {}
        ),
    )
    frame = simulate(trace, config)
    clients = frame["client_id"].astype(object).to_numpy()
    admitted = frame["outcome"].astype(object).to_numpy() != "rejected"
    reasons = frame["reason"].astype(object).to_numpy()
    for name in "abc":
        mine = clients == name
        # Fifteen admitted (each client sent more than it could have), and every arrival after
        # its fifteenth admission refused by the quota: the sixteenth never comes.
        assert admitted[mine].sum() == 15
        after = np.cumsum(admitted[mine]) == 15
        after[np.argmax(after)] = False  # the fifteenth itself
        assert after.any() and (reasons[mine][after] == "rate_limited").all()
    # The state is the run's: a second run of the same configuration starts from nothing.
    pd.testing.assert_frame_equal(simulate(trace, config), frame)


class _Noting(RuleState):
    """Notes what it is asked; refuses the arrivals of client ``refuses``."""

    def __init__(self, log: list, name: str, refuses=None) -> None:
        self.log, self.name, self.refuses = log, name, refuses

    def check(self, view, arrival):
        self.log.append((self.name, "check", view.client, view.deadline_s))
        if view.client == self.refuses:
            return Rejection(Reason.RATE_LIMITED, {}, 1)
        return None

    def adjust(self, view, arrival):
        return view._replace(deadline_s=view.deadline_s - 1.0)

    def decided(self, view, arrival, refusal):
        self.log.append((self.name, "decided", view.client, refusal is None))


@dataclass(frozen=True)
class _Stateful(Rule):
    name: str
    refuses: str | None = None
    check = AdmissionsPerClient.check

    def state(self) -> RuleState:
        return _Noting(LOG, self.name, self.refuses)


LOG: list = []


@dataclass(frozen=True)
class _TwoStates(Policy):
    def make_rules(self):
        return (_Stateful("first", refuses="x"), *super().make_rules(), _Stateful("second"))

    def decide(self, view: View) -> Rejection | None:
        LOG.append(("decide", view.client, view.deadline_s))
        return super().decide(view)


def test_the_states_are_asked_in_order_before_the_decision_and_told_it():
    queue = AdmissionQueue(
        ServerConfig(_TwoStates(name="two", deadline_s=5.0), 1),
        start=lambda *a: None,
        drop=lambda *a: None,
    )
    LOG.clear()
    assert queue.arrive(0, 0.0, 0.1, client="y") is None
    # Each state sees the view the one before it adjusted, the decision the last; both are told.
    assert LOG == [
        ("first", "check", "y", 5.0),
        ("second", "check", "y", 4.0),
        ("decide", "y", 3.0),
        ("first", "decided", "y", True),
        ("second", "decided", "y", True),
    ]
    LOG.clear()
    assert queue.arrive(1, 0.1, 0.1, client="x").reason == "rate_limited"
    assert LOG == [("first", "check", "x", 5.0)]  # a state's refusal ends it: nobody is told
    # One state per rule and per core: another queue starts its own.
    other = AdmissionQueue(
        ServerConfig(_TwoStates(name="two"), 1), start=lambda *a: None, drop=lambda *a: None
    )
    assert all(a is not b for a, b in zip(queue.admission.states, other.admission.states))


def test_the_bucket_and_the_reserve_are_parts_with_state():
    policy = replace(PRESETS["predictive-reserved"], client_rate=2.0, client_burst=3.0)
    assert policy.rules == (ClientRate(2.0, 3.0), ReserveShare(0.5, 0.3), SHEDDABLE, Predictive())
    admission = Admission(
        ServerConfig(policy), counts_refused=False, empty=Seen(math.nan, 0, 0.0, 1.0)
    )
    assert len(admission.states) == 2 and not admission.plain
    assert _plain(PRESETS["predictive"]) and not _plain(PRESETS["predictive-reserved"])
