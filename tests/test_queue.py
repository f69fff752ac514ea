"""The queue core on its own: random arrivals, finishes, failures, stalls, cancels and give-ups.

A hypothesis state machine drives :class:`qsim.queue.AdmissionQueue` through
any interleaving of its events and checks, after every step, the invariants
both drivers rely on.
"""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from qsim.policy import PRESETS, Policy, Rejection
from qsim.disciplines import AdaptiveLifo, CoDel, Edf, FairShare, Fifo, Lifo, Priority, ShortestFirst
from qsim.config import ServerConfig
from qsim.entry import Entry
from qsim.queue import AdmissionQueue, StallRule


DISCIPLINES = {"fifo": Fifo, "lifo": Lifo, "adaptive-lifo": lambda: AdaptiveLifo(3), "edf": Edf,
               "sjf": ShortestFirst, "priority": Priority, "priority-edf": lambda: Priority("edf"),
               "codel": lambda: CoDel(0.2, 0.5), "fair": FairShare}
# The key each discipline starts the smallest of (None: no such promise at every start).
FIRST = {"fifo": lambda e: e[1], "codel": lambda e: e[1], "lifo": lambda e: -e[1], "adaptive-lifo": None,
         "edf": lambda e: e[1] + e[3], "sjf": lambda e: e[2], "priority": lambda e: -e[4],
         "priority-edf": lambda e: (-e[4], e[1] + e[3]), "fair": None}


class QueueMachine(RuleBasedStateMachine):
    @initialize(engines=st.integers(1, 4), name=st.sampled_from(sorted(PRESETS)),
                bound=st.none() | st.integers(0, 5), stall=st.booleans(), discipline=st.sampled_from(sorted(DISCIPLINES)))
    def setup(self, engines, name, bound, stall, discipline):
        self.discipline = discipline
        self.policy = PRESETS[name] if bound is None else PRESETS[name].with_overrides(max_queue=bound)
        self.now = 0.0
        self.outcomes: dict[int, str] = {}
        self.started: list[int] = []
        self.admitted: list[int] = []
        self.base: dict[int, float] = {}
        self.next_id = 0
        # The discipline's own parameters as the list above has them (adaptive LIFO from 3, CoDel 0.2 s / 0.5 s).
        ordered = dataclasses.replace(self.policy, discipline=discipline, lifo_threshold=3, codel_target_s=0.2,
                                      codel_interval_s=0.5)
        self.q = AdmissionQueue(ServerConfig(ordered, engines,
                                             stall=StallRule(2.0, 0.5) if stall else None),
                                start=self._start, drop=self._drop)

    # -- hooks ----------------------------------------------------------------------------

    def _start(self, k, req, now, est):
        entry = self.q.running[k]
        assert entry[0] == req and now == self.now
        self.started.append(req)
        # What the discipline promises: nothing still waiting should have gone first.
        first = FIRST[self.discipline]
        if first is not None:
            assert all(first(entry) <= first(w) for w in self.q.waiting), f"{self.discipline} started {entry}"
        if self.discipline == "fair":  # the client served had been given the least (counters as charged now)
            given = self.q.waiting.counter
            assert all(given[entry[5]] - entry[2] <= given[w[5]] + 1e-9 for w in self.q.waiting), given

    def _drop(self, req, now, outcome, reason, est, retry_after_s):
        self._end(req, outcome)

    def _end(self, req, outcome):
        assert req not in self.outcomes, f"request {req} ended twice"
        self.outcomes[req] = outcome

    # -- events ---------------------------------------------------------------------------

    @rule(dt=st.floats(0, 1.0))
    def advance(self, dt):
        self.now += dt

    @rule(base=st.floats(0.01, 1.0), deadline=st.none() | st.floats(0.05, 3.0), priority=st.integers(-1, 2),
          client=st.sampled_from([None, "a", "b", "c"]))
    def arrive(self, base, deadline, priority, client):
        req = self.next_id
        self.next_id += 1
        self.base[req] = base
        refusal = self.q.arrive(req, self.now, base, deadline, priority, client)
        if isinstance(refusal, Rejection):
            self._end(req, "rejected")
        else:
            assert refusal is None
            self.admitted.append(req)

    @precondition(lambda self: any(e is not None for e in self.q.running))
    @rule(data=st.data(), ok=st.booleans(), engine_s=st.floats(0.0, 2.0))
    def finish(self, data, ok, engine_s):
        k = data.draw(st.sampled_from([k for k, e in enumerate(self.q.running) if e is not None]))
        req = self.q.running[k][0]
        factor = self.q.tracker.factor
        outcome = self.q.finished(k, self.now, engine_s, ok)
        if outcome is not None:
            assert outcome in (("good", "late") if ok else ("error",))
            self._end(req, outcome)
        if not ok:
            assert self.q.tracker.factor == factor  # a failure teaches nothing

    @precondition(lambda self: any(e is not None for e in self.q.running))
    @rule(data=st.data())
    def stall(self, data):
        k = data.draw(st.sampled_from([k for k, e in enumerate(self.q.running) if e is not None]))
        req = self.q.stall(k, self.now)
        if req is not None:
            self._end(req, "error")

    @precondition(lambda self: self.next_id > 0)
    @rule(data=st.data())
    def cancel(self, data):
        req = data.draw(st.integers(0, self.next_id - 1))
        where = self.q.cancel(req, self.now)
        if where is not None:
            self._end(req, "abandoned")

    @rule()
    def give_up(self):
        self.q.give_up(self.now)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def at_most_k_in_service(self):
        busy = sum(e is not None for e in self.q.running)
        assert busy == self.q.in_service <= self.q.engines
        assert sorted(self.q.idle) == [k for k, e in enumerate(self.q.running) if e is None]

    @invariant()
    def no_idle_engine_while_one_waits(self):
        assert not (self.q.idle and self.q.waiting)

    @invariant()
    def bound_held(self):
        if self.policy.max_queue is not None:
            assert len(self.q.waiting) <= self.policy.max_queue

    @invariant()
    def summed_estimate_is_the_sum_over_the_waiting(self):
        assert math.isclose(self.q.waiting_base_s, sum(e[2] for e in self.q.waiting), abs_tol=1e-9)

    @invariant()
    def fifo_among_the_started(self):
        if self.discipline in ("fifo", "codel"):
            assert self.started == sorted(self.started)

    @invariant()
    def one_outcome_each_and_everyone_accounted_for(self):
        waiting = {e[0] for e in self.q.waiting}
        running = {e[0] for k, e in enumerate(self.q.running) if e is not None and not self.q.ended[k]}
        assert not waiting & running
        assert not (waiting | running) & set(self.outcomes)
        assert waiting | running | set(self.outcomes) == set(range(self.next_id))

    def teardown(self):
        # At rest (every engine hands its request back, the queue drains) each request has one outcome.
        if not hasattr(self, "q"):
            return
        for _ in range(10 * (self.next_id + 1)):
            busy = [k for k, e in enumerate(self.q.running) if e is not None]
            if not busy:
                break
            self.now += 1.0
            req = self.q.running[busy[0]][0]
            outcome = self.q.finished(busy[0], self.now, 0.1)
            if outcome is not None:
                self._end(req, outcome)
        assert not self.q.waiting and set(self.outcomes) == set(range(self.next_id))


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_fifo_is_the_default_discipline():
    q = AdmissionQueue(Policy(), 1, start=lambda *a: None, drop=lambda *a: None)
    assert isinstance(q.waiting, Fifo)


def test_a_stalled_engine_counts_its_overrun_and_a_failure_frees_it():
    started = []
    q = AdmissionQueue(ServerConfig(PRESETS["predictive"], stall=StallRule(2.0, 0.5)),
                       start=lambda k, r, now, est: started.append(r), drop=lambda *a: None)
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
@given(rate=st.floats(0.1, 50), burst=st.integers(1, 10),
       gaps=st.lists(st.floats(0, 2.0), min_size=1, max_size=80), clients=st.data())
def test_a_token_bucket_never_admits_more_than_its_rate_and_burst(rate, burst, gaps, clients):
    policy = Policy(client_rate=rate, client_burst=burst)
    q = AdmissionQueue(policy, 1000, start=lambda *a: None, drop=lambda *a: None)  # engines never the limit
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
@given(steps=st.lists(st.tuples(st.sampled_from(["push", "pop"]), st.sampled_from([None, "a", "b", "c"]),
                                st.sampled_from([0.25, 0.5, 1.0, 0.1, 0.3]), st.integers(-1, 2),
                                st.sampled_from([0.5, 1.0, 2.0])), max_size=40),
       client=st.sampled_from([None, "a", "b", "c", "d"]), base=st.sampled_from([0.25, 0.1]),
       priority=st.integers(-1, 2), deadline=st.sampled_from([0.5, 1.0, 2.0]),
       make=st.sampled_from([FairShare, Priority, lambda: Priority("edf")]))
def test_ahead_s_is_exactly_the_work_that_starts_before_an_arrival(steps, client, base, priority, deadline, make):
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
    assert math.isclose(ahead, served, rel_tol=1e-12, abs_tol=1e-12)  # the same requests, summed in another order


def test_fair_share_serves_a_light_client_first_and_splits_a_backlog_evenly():
    started = []
    q = AdmissionQueue(Policy(discipline="fair"), 1, start=lambda k, r, now, est: started.append(r),
                       drop=lambda *a: None)
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
    assert all(q.arrive(("heavy", i), 0.0, 0.3, client="heavy") is None for i in range(6))  # 1.8 s of work
    assert q.arrive(("heavy", 6), 0.0, 0.3, client="heavy") is not None  # heavy's next would wait too long
    assert q.arrive(("light", 0), 0.0, 0.3, client="light") is None  # light waits only for the running one
    fifo = AdmissionQueue(PRESETS["predictive"], 1, start=lambda *a: None, drop=lambda *a: None)
    for i in range(6):
        fifo.arrive(("heavy", i), 0.0, 0.3, client="heavy")
    assert fifo.arrive(("light", 0), 0.0, 0.3, client="light") is not None  # FIFO: behind all of heavy's
