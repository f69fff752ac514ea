"""The queue core on its own: random arrivals, finishes, failures, stalls, cancels and give-ups.

A hypothesis state machine (the public kit's, :func:`qsim.testing.check_queue_core`) drives
:class:`qsim.queue.AdmissionQueue` through any interleaving of its events under every preset and
every discipline, and checks, after every step, the invariants both drivers rely on, and at every
pop the order the discipline promises. It is built when each test runs, from the kit's list of
disciplines (tests/test_kit.py shows that a wrong promise fails).
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsim import testing
from qsim.policy import PRESETS, Policy
from qsim.disciplines import DISCIPLINES, FairShare, Fifo, Priority
from qsim.config import ServerConfig
from qsim.entry import Entry
from qsim.queue import AdmissionQueue, StallRule


@pytest.mark.parametrize("case", testing.DISCIPLINES, ids=lambda case: case.name)
def test_the_queue_core_keeps_its_invariants_and_each_discipline_its_order(case):
    testing.check_queue_core(disciplines=[case], max_examples=40)


def test_every_discipline_of_qsim_is_in_the_kit():
    assert sorted(c.name for c in testing.DISCIPLINES) == sorted(DISCIPLINES)


def test_fifo_is_the_default_discipline():
    q = AdmissionQueue(Policy(), 1, start=lambda *a: None, drop=lambda *a: None)
    assert isinstance(q.waiting, Fifo)


def test_a_stalled_engine_counts_its_overrun_and_a_failure_frees_it():
    started = []
    q = AdmissionQueue(
        ServerConfig(PRESETS["predictive"], stall=StallRule(2.0, 0.5)),
        start=lambda k, r, now, est: started.append(r),
        drop=lambda *a: None,
    )
    assert q.arrive("a", 0.0, 0.4) is None and started == ["a"]
    assert q.overdue(0.8) == [] and q.overdue(0.81) == [0]  # max(2 x 0.4, 0.5) = 0.8 s
    assert q.stall(0, 0.81) == "a" and q.all_stalled
    assert q.remaining_s(1.0) == pytest.approx(0.6)  # ran 1.0 s of a 0.4 s estimate: 0.6 s over
    assert q.finished(0, 3.0, 3.0) is None  # it had ended as an error when it stalled
    assert q.tracker.factor == 1.0 and not q.all_stalled and q.idle == [0]


def test_stall_rule_refuses_nonsense():
    with pytest.raises(ValueError, match="stall factor"):
        StallRule(0.5, 1.0)
    with pytest.raises(ValueError, match="stall floor"):
        StallRule(2.0, math.inf)


@settings(max_examples=300, deadline=None)
@given(
    rate=st.floats(0.1, 50),
    burst=st.integers(1, 10),
    gaps=st.lists(st.floats(0, 2.0), min_size=1, max_size=80),
    clients=st.data(),
)
def test_a_token_bucket_never_admits_more_than_its_rate_and_burst(rate, burst, gaps, clients):
    policy = Policy(client_rate=rate, client_burst=burst)
    # engines never the limit
    q = AdmissionQueue(policy, 1000, start=lambda *a: None, drop=lambda *a: None)
    now, admitted = 0.0, {}
    for i, gap in enumerate(gaps):
        now += gap
        client = clients.draw(st.sampled_from("ab"))
        refusal = q.arrive(i, now, 0.01, client=client)
        if refusal is None:
            admitted.setdefault(client, []).append(now)
        else:
            assert refusal.reason == "rate_limited" and refusal.retry_after_s >= 1
    for times in admitted.values():  # in every window [t0, t1]: at most burst + rate x (t1 - t0)
        for i in range(len(times)):
            for j in range(i, len(times)):
                assert j - i + 1 <= burst + rate * (times[j] - times[i]) + 1e-6


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["push", "pop"]),
            st.sampled_from([None, "a", "b", "c"]),
            st.sampled_from([0.25, 0.5, 1.0, 0.1, 0.3]),
            st.integers(-1, 2),
            st.sampled_from([0.5, 1.0, 2.0]),
        ),
        max_size=40,
    ),
    client=st.sampled_from([None, "a", "b", "c", "d"]),
    base=st.sampled_from([0.25, 0.1]),
    priority=st.integers(-1, 2),
    deadline=st.sampled_from([0.5, 1.0, 2.0]),
    make=st.sampled_from([FairShare, Priority, lambda: Priority("edf")]),
)
def test_ahead_s_is_exactly_the_work_that_starts_before_an_arrival(
    steps, client, base, priority, deadline, make
):
    queue, n = make(), 0
    for op, who, size, level, due in steps:  # any history of joins, starts and returns
        if op == "push":
            queue.push(Entry(n, 0.0, size, due, level, who))
            n += 1
        elif len(queue):
            entry = queue.pop_next(0.0)
            getattr(queue, "started", lambda e: None)(entry)
    mine = Entry(n, 0.0, base, deadline, priority, client)
    ahead = queue.ahead_s(mine)
    queue.push(mine)
    served = 0.0
    while (entry := queue.pop_next(0.0)) is not mine:
        getattr(queue, "started", lambda e: None)(entry)
        served += entry[2]
    # the same requests, summed in another order
    assert math.isclose(ahead, served, rel_tol=1e-12, abs_tol=1e-12)


def test_fair_share_serves_a_light_client_first_and_splits_a_backlog_evenly():
    started = []
    q = AdmissionQueue(
        Policy(discipline="fair"),
        1,
        start=lambda k, r, now, est: started.append(r),
        drop=lambda *a: None,
    )
    for i in range(20):  # the heavy client queues 20 requests of 0.1 s; then the light one sends 5
        q.arrive(("heavy", i), 0.0, 0.1, 100.0, client="heavy")
    for i in range(5):
        q.arrive(("light", i), 0.01, 0.1, 100.0, client="light")
    now = 0.0
    while any(e is not None for e in q.running):
        now += 0.1
        q.finished(0, now, 0.1)
    order = [who for who, _ in started]
    # heavy's first request was already running; then the two alternate until light has nothing left
    assert order[:11] == ["heavy"] + ["heavy", "light"] * 5
    assert order[11:] == ["heavy"] * 14


def test_fair_share_admission_does_not_count_a_heavy_clients_queue_against_a_light_one():
    q = AdmissionQueue(PRESETS["predictive-fair"], 1, start=lambda *a: None, drop=lambda *a: None)
    # 1.8 s of work
    assert all(q.arrive(("heavy", i), 0.0, 0.3, client="heavy") is None for i in range(6))
    # heavy's next would wait too long
    assert q.arrive(("heavy", 6), 0.0, 0.3, client="heavy") is not None
    # light waits only for the running one
    assert q.arrive(("light", 0), 0.0, 0.3, client="light") is None
    fifo = AdmissionQueue(PRESETS["predictive"], 1, start=lambda *a: None, drop=lambda *a: None)
    for i in range(6):
        fifo.arrive(("heavy", i), 0.0, 0.3, client="heavy")
    # FIFO: behind all of heavy's
    assert fifo.arrive(("light", 0), 0.0, 0.3, client="light") is not None
