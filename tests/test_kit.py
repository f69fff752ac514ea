"""The public test kit (qsim.testing) itself: a wrong promise fails, a broken invariant names its
request, the docs' example runs, and qsim works without hypothesis."""

import dataclasses
import heapq
import importlib
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsim import PRESETS, Batching, Policy, StepModel, from_arrays, records
from qsim import testing
from qsim.batch import BatchQueue
from qsim.disciplines import Edf, Fifo, Keyed, Lifo, Priority
from qsim.testing import DisciplineCase, EngineSettings, InvariantBroken, SimRun

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the state machine


class FifoThatClaimsShortestFirst(Keyed):
    """Declares SJF's key but pops in arrival order: what it does is not what it says."""

    def key(self, entry) -> tuple:
        return (entry.base_s,)

    def pop_next(self, now: float):
        item = min(self._heap, key=lambda item: item[-2])  # the earliest pushed
        self._heap.remove(item)
        heapq.heapify(self._heap)
        return item[-1]


WRONG = [
    DisciplineCase("lifo claimed as fifo", Lifo, testing.by_arrival),
    DisciplineCase("fifo claimed as lifo", Fifo, testing.newest_first),
    DisciplineCase("edf claimed as sjf", Edf, lambda d, e: e.base_s),
    DisciplineCase("priority claimed as fifo", Priority, testing.by_arrival),
    DisciplineCase("its own key, not kept", FifoThatClaimsShortestFirst),
]


@pytest.mark.parametrize("case", WRONG, ids=lambda case: case.name)
def test_a_wrong_ordering_claim_fails(case):
    with pytest.raises(
        InvariantBroken,
        match=rf"discipline {re.escape(case.name)}'s order: popped "
        r"request \d+ "
        rf"\(key .*\) while request \d+ \(key .*\) waited",
    ):
        testing.check_queue_core(disciplines=[case], max_examples=60, shrink=False)


def test_a_discipline_must_say_its_order_or_that_it_promises_none():
    with pytest.raises(ValueError, match="declares no key"):
        DisciplineCase("mine", Fifo)
    # promises none: the rest is still checked
    assert DisciplineCase("mine", Fifo, order=None).order is None
    assert DisciplineCase("mine", Edf).order is testing.DECLARED


class Leaky(Fifo):
    """FIFO that loses the request behind the one it pops."""

    def pop_next(self, now: float):
        entry = self.popleft()
        if self:
            self.popleft()
        return entry


def test_a_lost_request_is_named():
    with pytest.raises(
        InvariantBroken,
        match=r"one outcome per request: request \d+ has no "
        r"outcome and is neither "
        r"waiting nor running \(lost\)",
    ):
        testing.check_queue_core(
            disciplines=[DisciplineCase("leaky", Leaky, testing.by_arrival)],
            max_examples=60,
            shrink=False,
        )


class Idler(Fifo):
    """Says it is empty while one request waits, so the queue leaves an engine idle beside it."""

    def __len__(self) -> int:
        n = super().__len__()
        return 0 if n == 1 else n


def test_an_engine_idle_while_one_waits_is_named():
    # Its lie breaks three promises: an engine idle beside a waiting request, (the core resets its
    # sum of the waiting's estimates when the line says it is empty) that sum, and a queue bound (a
    # policy that counts the waiting sees none where one waits); whichever a run's events reach
    # first is named.
    with pytest.raises(
        InvariantBroken,
        match=r"no idle engine while work waits: engines \[.*\] "
        r"idle while requests "
        r"\[\d+\] wait|summed estimate: waiting_base_s 0.0 "
        r"but the waiting sum"
        r"|queue bound: \d+ wait under a bound of \d+",
    ):
        testing.check_queue_core(
            disciplines=[DisciplineCase("idler", Idler, testing.by_arrival)],
            max_examples=60,
            shrink=False,
        )


def test_the_machine_is_built_from_the_cases_given_when_it_runs():
    first = testing.queue_machine(disciplines=[DisciplineCase("fifo", Fifo, testing.by_arrival)])
    second = testing.queue_machine(disciplines=WRONG[:1])
    assert first is not second and "lifo claimed as fifo" in second.__name__
    with pytest.raises(ValueError, match="at least one"):
        testing.queue_machine(disciplines=[])


# ---------------------------------------------------------------- checkers on records


def _one_engine():
    """Five requests, one engine, FIFO, nobody refused: 0 runs at once, 1 to 4 wait their turns."""
    trace = from_arrays([0.0, 0.01, 0.02, 0.03, 0.5], [16] * 5)
    run = SimRun(PRESETS["none"])
    return trace, run, records.validate(run.simulate(trace))


def test_the_checkers_pass_a_true_run():
    trace, run, df = _one_engine()
    testing.check_records(df, run, trace)


def test_a_lost_request_names_its_request_id():
    trace, run, df = _one_engine()
    with pytest.raises(
        InvariantBroken,
        match=r"one outcome per request: request_id 3 has no row: "
        r"lost \(1 of "
        r"the trace's 5 requests",
    ):
        testing.check_records(df.drop(index=3), run, trace)
    no_outcome = df.copy()
    no_outcome.loc[3, "outcome"] = pd.NA
    with pytest.raises(InvariantBroken, match="request_id 3 has no outcome"):
        testing.check_one_outcome_each(no_outcome, len(trace))
    with pytest.raises(
        ValueError, match="request_id 3 has no outcome: every request ends in exactly one of"
    ):
        records.validate(no_outcome)
    with pytest.raises(InvariantBroken, match="request_id 2 has 2 rows"):
        testing.check_one_outcome_each(pd.concat([df, df.iloc[[2]]]), len(trace))


def test_each_broken_invariant_is_named_with_its_request():
    trace, run, df = _one_engine()
    early = df.copy()
    early.loc[2, "start_s"] = early.loc[2, "arrival_s"] - 0.005
    with pytest.raises(
        InvariantBroken, match="conservation: request_id 2 started before it arrived"
    ):
        testing.check_conservation(early, 1)
    overlap = df.copy()
    overlap.loc[2, ["start_s", "finish_s"]] = (
        overlap.loc[1, ["start_s", "finish_s"]].to_numpy() + 0.01
    )
    with pytest.raises(
        InvariantBroken,
        match=r"at most K in service: request_id 2 started on "
        r"engine 0 at t=.* while "
        r"request_id 1 ran there",
    ):
        testing.check_at_most_k_in_service(overlap, 1)
    idle = df.copy()
    idle.loc[4, ["start_s", "finish_s"]] += 0.3  # waits although the engine is free from 0.5 s
    idle.loc[4, "arrival_s"] = idle.loc[3, "finish_s"]
    with pytest.raises(
        InvariantBroken, match="no idle engine while work waits: request_id 4 waited"
    ):
        testing.check_work_conserving(idle, 1)
    swapped = df.copy()
    swapped.loc[[1, 2], ["start_s", "finish_s"]] = df.loc[
        [2, 1], ["start_s", "finish_s"]
    ].to_numpy()
    with pytest.raises(
        InvariantBroken,
        match=r"Fifo's order: request_id 2 \(key 0.02\) started at "
        r"t=.* while "
        r"request_id 1 \(key 0.01\) waited",
    ):
        testing.check_order(swapped, testing.records_order(Fifo()), "Fifo")
    with pytest.raises(
        InvariantBroken,
        match=r"queue bound: 3 waited at t=0.03, over the bound "
        r"of 2",
    ):
        testing.check_queue_bound(df, 2)


def _batch(max_num_seqs=4, **engine):
    """Eight requests at once, 16 prompt tokens and 10 out each, on a batching engine of 10 ms
    steps."""
    trace = from_arrays(np.zeros(8), np.full(8, 10))
    trace = dataclasses.replace(
        trace, prompt_tokens=np.full(8, 16), tokens_generated=np.full(8, 10)
    )
    run = SimRun(
        PRESETS["none"],
        EngineSettings(batching=Batching(StepModel(0.01, 0, 0, 0), max_num_seqs, **engine)),
    )
    return trace, run, records.validate(run.simulate(trace))


def test_the_batch_checkers_pass_a_true_run_and_name_what_breaks():
    trace, run, df = _batch()
    testing.check_records(df, run, trace)
    with pytest.raises(
        InvariantBroken,
        match=r"at most K in service: request_id \d joined the "
        r"batch at t=0.0 with 3 "
        r"others in it, over max_num_seqs 2",
    ):
        testing.check_at_most_seats_in_batch(df, 2)
    with pytest.raises(
        InvariantBroken,
        match=r"KV blocks: request_id 0 held 2 blocks of a cache "
        r"of 1",
    ):
        testing.check_kv_blocks(df, 1)
    trace, run, df = _batch(max_num_seqs=1)  # one at a time: each waits for the one before
    idle = df.copy()
    # the engine rests half a second while request 1 waits
    idle.loc[1, ["start_s", "finish_s"]] += 0.5
    with pytest.raises(
        InvariantBroken,
        match=r"no idle engine while work waits: request_id 1 "
        r"waited from t=0.0 "
        r"to t=.*, and at t=.* only 0 of 1 engines were "
        r"busy",
    ):
        testing.check_work_conserving(idle, 1, batching=True)


def test_the_audit_names_books_that_do_not_balance(monkeypatch):
    hold = BatchQueue._hold

    def forgets_a_block(self, seq, blocks):
        hold(self, seq, blocks)
        self.kv_used -= blocks > 0

    trace, run, _ = _batch()
    monkeypatch.setattr(BatchQueue, "_hold", forgets_a_block)
    with pytest.raises(
        InvariantBroken,
        match=r"the batch's books: at t=.*: KV blocks: \d+ "
        r"counted, \d+ held by the "
        r"running",
    ):
        run.simulate(trace)
    assert BatchQueue._next_step.__name__ == "_next_step"  # the audit is undone on the way out


def test_records_orders_of_the_disciplines_records_can_say():
    assert testing.records_order(Fifo()) is not None and testing.records_order(Edf()) is not None
    # fair share: the machine checks it
    assert testing.records_order(testing.DISCIPLINES[-1].make()) is None
    sjf = Policy(discipline="sjf").make_discipline()
    assert (
        testing.records_order(sjf) is None
        and testing.records_order(sjf, fixed_estimate=True) is not None
    )
    # a batch's head that does not fit keeps its place
    assert testing.records_order(Edf(), batching=True) is None
    assert testing.records_order(Fifo(), batching=True) is not None


# ---------------------------------------------------------------- strategies, docs, packaging


@settings(max_examples=10, deadline=None)
@given(
    run=testing.runs(exact=True),
    trace=testing.traces(),
    policy=testing.policies(["edf", "lifo"]),
    custom=testing.runs(policy=st.just(PRESETS["predictive"])),
    batch=testing.runs(engines=testing.engine_settings(batching=True)),
)
def test_the_strategies_draw_what_they_say(run, trace, policy, custom, batch):
    exact = run.trace()
    assert np.array_equal(exact.true_service_s, exact.est_service_s) and run.engines.speed == 1.0
    assert len(trace) >= 1
    assert isinstance(policy, Policy) and policy.discipline in ("edf", "lifo")
    assert custom.policy is PRESETS["predictive"]
    engine = batch.config().engine
    assert isinstance(engine, Batching) == (batch.engines.batching is not None)
    if isinstance(engine, Batching):
        assert engine.max_num_batched_tokens >= engine.max_num_seqs and batch.engines.count == 1


def test_a_batching_engine_is_one_engine_at_its_own_speed():
    with pytest.raises(ValueError, match="a batching engine is one engine"):
        EngineSettings(count=2, batching=Batching())


def _docs_example() -> str:
    text = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "docs/testing.md has no python example"
    return blocks[0]


def test_the_docs_example_runs_and_is_ten_lines(monkeypatch):
    code = _docs_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 12
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples"))
    space: dict = {}
    exec(compile(code, "docs/testing.md", "exec"), space)
    tests = [f for name, f in space.items() if name.startswith("test_")]
    assert len(tests) >= 2
    for test in tests:
        test()


def test_without_hypothesis_the_kit_says_which_extra_to_install(monkeypatch):
    # what an absent package looks like to import
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    monkeypatch.delitem(sys.modules, "qsim.testing")
    with pytest.raises(ImportError, match=re.escape("pip install 'qlab[testing]'")):
        importlib.import_module("qsim.testing")
