"""The batching engine's queue core (qsim.batch) and its simulator driver: vLLM v1's rules, checked
by hand on small cases, its bookkeeping checked after every step on random ones, and a batch of one
against the engine run one at a time."""

import dataclasses

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsim import (
    Batching,
    ServerConfig,
    ServiceModel,
    StepModel,
    from_arrays,
    make_trace,
    records,
    simulate,
)
from qsim import testing
from qsim.policy import PRESETS, Policy, resolve
from qsim.testing import EngineSettings, SimRun
from qsim.mixes import UsedShare


def trace_of(arrival, prompt, out, limit=None):
    """Requests arriving at ``arrival`` with these prompts and output lengths (limit:
    max_new_tokens)."""
    limit = out if limit is None else limit
    trace = from_arrays(np.asarray(arrival, float), np.asarray(limit))
    return dataclasses.replace(
        trace,
        prompt_tokens=np.asarray(prompt, dtype=np.int64),
        tokens_generated=np.asarray(out, dtype=np.int64),
    )


def run(trace, policy=PRESETS["none"], **engine):
    return records.validate(simulate(trace, ServerConfig(policy, Batching(**engine))))


@pytest.fixture
def audited():
    """Every step planned is audited (BatchQueue.audit, through the test kit): the blocks, seats and
    aggregates add up."""
    with testing.audited_batches():
        yield


# ---------------------------------------------------------------- by hand


def test_one_request_takes_its_prompt_step_then_a_step_per_token(audited):
    step = StepModel(b0=0.01, b1=0.001, b2=0.002, b3=0.0)
    df = run(trace_of([0.0], [10], [3]), step=step)
    prefill = 0.01 + 0.001 * 10 + 0.002  # its prompt, and the first token
    decode = 0.01 + 0.002
    row = df.iloc[0]
    assert row["ttft_s"] == pytest.approx(prefill)
    assert row["finish_s"] == pytest.approx(prefill + 2 * decode)
    assert row["tpot_s"] == pytest.approx(decode)
    # 12 tokens: one block
    assert (row["output_tokens"], row["preemptions"], row["kv_blocks_peak"]) == (3, 0, 1)


def test_chunked_prefill_splits_a_long_prompt_over_the_token_budget(audited):
    step = StepModel(b0=0.01, b1=0.0, b2=0.0, b3=0.0)
    df = run(trace_of([0.0], [100], [2]), step=step, max_num_seqs=4, max_num_batched_tokens=32)
    # 32 + 32 + 32 + 4 tokens, then a decode step
    assert df["ttft_s"].iloc[0] == pytest.approx(4 * 0.01)
    assert df["finish_s"].iloc[0] == pytest.approx(5 * 0.01)
    whole = run(
        trace_of([0.0], [100], [2]),
        step=step,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        chunked_prefill=False,
    )
    # vLLM refuses it too
    assert whole["outcome"].iloc[0] == "rejected" and whole["reason"].iloc[0] == "too_large"


def test_decoding_requests_share_steps_and_a_new_one_joins_at_a_step_boundary(audited):
    step = StepModel(b0=0.01, b1=0.0, b2=0.001, b3=0.0)
    df = run(trace_of([0.0, 0.005], [0, 0], [3, 2]), step=step)
    # A alone: 0.011 per step. B arrives mid-step, joins at 0.011; the two then take 0.012 a step.
    a, b = df.iloc[0], df.iloc[1]
    # in the batch from its arrival (a free seat): computes next step
    assert b["start_s"] == pytest.approx(0.005)
    assert b["ttft_s"] == pytest.approx(0.011 + 0.012 - 0.005)
    assert a["finish_s"] == pytest.approx(0.011 + 0.012 + 0.012)
    assert b["finish_s"] == pytest.approx(0.011 + 0.012 + 0.012)


def test_at_most_max_num_seqs_run_and_the_rest_wait_in_order(audited):
    df = run(trace_of(np.zeros(5), [0] * 5, [4] * 5), step=StepModel(0.01, 0, 0, 0), max_num_seqs=2)
    assert df["start_s"].tolist() == pytest.approx([0, 0, 0.04, 0.04, 0.08])
    assert df["queued_at_arrival"].tolist() == [0, 0, 0, 1, 2]  # the first two take seats at once


def test_kv_blocks_run_out_and_the_newest_is_preempted_and_recomputed(audited):
    # Two requests of 30 tokens each in 2 blocks of 16 tokens: the second grows past its block and
    # is preempted (recompute: back to the head of the line), then finishes after the first.
    step = StepModel(0.01, 0, 0, 0)
    df = run(trace_of([0.0, 0.0], [14, 14], [16, 16]), step=step, kv_blocks=3, block_size=16)
    assert df["outcome"].tolist() == ["good", "good"]
    assert df["preemptions"].tolist() == [0, 1]
    assert df["output_tokens"].tolist() == [16, 16]
    assert df["finish_s"].iloc[1] > df["finish_s"].iloc[0]
    assert df["kv_blocks_peak"].max() <= 3


def test_a_request_that_can_never_fit_the_cache_is_refused_at_once():
    df = run(trace_of([0.0], [100], [100]), kv_blocks=4, block_size=16)
    assert df["outcome"].iloc[0] == "rejected" and df["reason"].iloc[0] == "too_large"
    assert pd.isna(df["retry_after_s"].iloc[0])  # not overload: coming back cannot help


def test_a_run_past_its_deadline_is_cut_there(audited):
    policy = resolve("none", {"cancel_at_deadline": True, "deadline_s": 0.05})
    df = run(trace_of([0.0, 0.0], [0, 0], [2, 10]), policy, step=StepModel(0.01, 0, 0, 0))
    assert df["outcome"].tolist() == ["good", "cancelled"]
    assert (
        df["finish_s"].iloc[1] == pytest.approx(0.05) and df["reason"].iloc[1] == "deadline_passed"
    )


def test_one_that_joins_after_its_deadline_is_cut_as_it_joins(audited):
    # Found by the test kit (conservation: finished before it started): one seat, 60 ms steps, 50 ms
    # deadlines. The first is cut at 0.05 s in its step, which runs on to 0.06 s; the second joins
    # then, past its deadline, and was recorded cut "at 0.05 s".
    policy = resolve("none", {"cancel_at_deadline": True, "deadline_s": 0.05})
    df = run(
        trace_of([0.0, 0.0], [0, 0], [1, 1]), policy, step=StepModel(0.06, 0, 0, 0), max_num_seqs=1
    )
    assert df["outcome"].tolist() == ["cancelled", "cancelled"] and df["finish_s"].iloc[
        0
    ] == pytest.approx(0.05)
    assert df["start_s"].iloc[1] == df["finish_s"].iloc[1] == pytest.approx(0.06)


def test_ttft_and_tpot_objectives_make_an_answer_late(audited):
    trace = trace_of([0.0, 0.0, 0.0], [0, 0, 0], [5, 5, 5])
    step = StepModel(0.01, 0, 0.001, 0)
    plain = run(trace, step=step, max_num_seqs=1)
    assert plain["outcome"].eq("good").all()
    ttft = run(trace, Policy(ttft_slo_s=0.02), step=step, max_num_seqs=1)
    # the queued waited past 20 ms for a first token
    assert ttft["outcome"].tolist() == ["good", "late", "late"]
    assert (ttft["ttft_slo_s"] == 0.02).all()
    tpot = run(trace, Policy(tpot_slo_s=0.005), step=step, max_num_seqs=1)
    assert tpot["outcome"].eq("late").all()


# ---------------------------------------------------------------- a batch of one is an engine one
# at a time


@pytest.mark.parametrize(
    "name", ["none", "bounded", "bounded-deadline", "predictive", "predictive-edf", "codel"]
)
def test_a_batch_of_one_with_no_step_overhead_is_the_engine_run_one_at_a_time(name):
    model = ServiceModel(0.0, 0.0085)
    trace = make_trace(load=2.0, seconds=60, seed=3, model=model)
    one = simulate(trace, ServerConfig(PRESETS[name], 1, model))
    batch = records.validate(
        simulate(
            trace,
            ServerConfig(
                PRESETS[name], Batching(StepModel(0, 0, 0.0085, 0), max_num_seqs=1), model
            ),
        )
    )
    for column in ("outcome", "reason", "queued_at_arrival", "retry_after_s"):
        assert (
            one[column].astype(object).fillna("-").tolist()
            == batch[column].astype(object).fillna("-").tolist()
        ), column
    # Times are sums of the same steps taken one at a time: equal to the last few bits.
    for column in ("start_s", "finish_s", "est_service_s", "ttft_s"):
        np.testing.assert_allclose(one[column], batch[column], rtol=0, atol=1e-9, err_msg=column)


# ---------------------------------------------------------------- random cases


# 15 examples: each is now checked by the test kit and audited at every step as well.
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 10_000),
    load=st.sampled_from([0.5, 3.0, 15.0]),
    seqs=st.sampled_from([1, 4, 32]),
    budget=st.sampled_from([32, 256]),
    chunked=st.booleans(),
    blocks=st.sampled_from([None, 8, 40, 400]),
    name=st.sampled_from(
        [
            "none",
            "bounded",
            "predictive",
            "bounded-deadline",
            "codel",
            "predictive-kv",
            "vllm-caps",
            "llm-d-shed",
        ]
    ),
    cut=st.booleans(),
    cv=st.sampled_from([0.0, 0.5]),
    patient=st.booleans(),
)
def test_every_request_ends_once_and_the_books_balance(
    audited, seed, load, seqs, budget, chunked, blocks, name, cut, cv, patient
):
    budget = max(budget, seqs)
    trace = make_trace(load=load, seconds=8, seed=seed, used=UsedShare(), clients=())
    rng = np.random.default_rng(seed)
    trace = dataclasses.replace(
        trace,
        prompt_tokens=rng.integers(0, 120, len(trace)),
        priority=rng.integers(-1, 1, len(trace)),
    )
    patience = None if patient else np.where(rng.random(len(trace)) < 0.3, 0.2, np.inf)
    policy = resolve(name, {"cancel_at_deadline": cut})
    engine = Batching(
        StepModel(0.005, 2e-5, 3e-4, 1e-6, cv=cv),
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        kv_blocks=blocks,
    )
    df = records.validate(
        simulate(trace, ServerConfig(policy, engine, seed=seed), cancel_after_s=patience)
    )
    # One outcome each, conservation, seats, the cache, never idle while one waits, the bound,
    # FIFO's order.
    testing.check_records(df, SimRun(policy, EngineSettings(batching=engine)), trace)
    ran = df["start_s"].notna()
    assert (
        df.loc[df["outcome"].isin(["good", "late"]), "output_tokens"]
        == trace.tokens_generated[df.loc[df["outcome"].isin(["good", "late"]), "request_id"]]
    ).all()
    assert (df.loc[ran, "ttft_s"].dropna() >= 0).all()
    if blocks is not None:
        assert (df["kv_blocks_peak"].dropna() <= blocks).all()


def test_the_same_seed_gives_the_same_rows_step_noise_included():
    trace = make_trace(load=3.0, seconds=20, seed=5)
    config = ServerConfig(
        PRESETS["predictive"],
        Batching(StepModel(0.01, 0, 2e-4, 0, cv=0.4), max_num_seqs=8),
        seed=11,
    )
    pd.testing.assert_frame_equal(simulate(trace, config), simulate(trace, config))
    other = simulate(trace, config.replace(seed=12))
    assert not other["finish_s"].equals(simulate(trace, config)["finish_s"])


# ---------------------------------------------------------------- admission that knows the batch
# and the memory


def test_predictive_refuses_what_the_batch_cannot_finish_in_time():
    # Ten 100-token requests at once on two seats of 10 ms steps: each takes a second; the 5th
    # cannot make 2 s.
    trace = trace_of(np.zeros(10), [0] * 10, [100] * 10)
    df = run(trace, PRESETS["predictive"], step=StepModel(0.01, 0, 0, 0), max_num_seqs=2)
    assert df["outcome"].tolist() == ["good"] * 4 + ["rejected"] * 6
    assert df["reason"].iloc[4] == "deadline_unreachable"


def test_admission_by_memory_refuses_kv_full_where_memory_is_what_makes_it_late():
    # Plenty of seats, little memory: one request's prompt and limit (7 blocks of 16) at a time,
    # 0.96 s each. Seats alone would run all six at once and finish in time; memory lets two finish
    # by the 2 s deadline.
    trace = trace_of(np.zeros(6), [16] * 6, [96] * 6)
    step = StepModel(0.01, 0, 0, 0)
    seats = run(trace, PRESETS["predictive"], step=step, max_num_seqs=8, kv_blocks=8, block_size=16)
    memory = run(
        trace, PRESETS["predictive-kv"], step=step, max_num_seqs=8, kv_blocks=8, block_size=16
    )
    # it does not know the memory: admits, and preempts
    assert seats["outcome"].eq("rejected").sum() == 0
    assert seats["preemptions"].sum() > 0
    assert memory["reason"].fillna("-").tolist() == [
        "-",
        "-",
        "kv_full",
        "kv_full",
        "kv_full",
        "kv_full",
    ]
    # the second joins at once and is preempted once, as in vLLM
    assert memory["outcome"].eq("good").sum() == 2
    # admitted and thrashing: not all of them in time
    assert seats["outcome"].eq("good").sum() < 2 + 4


def test_vllm_caps_refuse_by_count_and_by_queued_prompt_tokens():
    trace = trace_of(np.zeros(6), [100] * 6, [10] * 6)
    policy = resolve("vllm-caps", {"max_queue": 10, "max_queued_tokens": 250})
    df = run(trace, policy, step=StepModel(0.01, 0, 0, 0), max_num_seqs=2)
    assert (
        df["reason"].tolist()[:4] == [None, None, None, None] or df["reason"].iloc[:4].isna().all()
    )
    # 2 waiting: 200 + 100 > 250
    assert df["reason"].iloc[4:].tolist() == ["tokens_queued", "tokens_queued"]


def test_llm_d_sheds_only_sheddable_requests_with_its_probability():
    trace = make_trace(load=8.0, seconds=30, seed=2)
    trace = dataclasses.replace(trace, priority=np.where(np.arange(len(trace)) % 2 == 0, -1, 0))
    engine = Batching(StepModel(0.01, 0, 2e-4, 0), max_num_seqs=8)
    df = records.validate(simulate(trace, ServerConfig(PRESETS["llm-d-shed"], engine)))
    shed = df["reason"].eq("shed")
    assert shed.any() and (df.loc[shed, "priority"] < 0).all()
    # None shed among the protected; the queue-based "shed" rule of every policy also looks only at
    # priority < 0.
    assert not df.loc[df["priority"] >= 0, "reason"].eq("shed").any()
