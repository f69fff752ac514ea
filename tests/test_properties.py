"""Invariants of the simulator over random policies, disciplines, engine counts, loads, bursts and
seeds.

The strategies and the checkers are the public kit's (qsim.testing, docs/testing.md)."""

import numpy as np
import pandas as pd
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qsim import Policy, records
from qsim.policy import PRESETS
from qsim.testing import (
    EngineSettings,
    SimRun,
    Workload,
    batching_engines,
    check_records,
    policies,
    preset_policies,
    runs,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(runs())
def test_queue_invariants(run):
    trace = run.trace()
    df = records.validate(run.simulate(trace))
    # One outcome per request, conservation, at most K in service, no idle engine while one waits,
    # the queue bound, and the discipline's order where the records say it (FIFO: a later arrival
    # never starts earlier).
    check_records(df, run, trace)
    # The simulator never reports transport errors, and rows are in trace order.
    assert df["request_id"].tolist() == list(range(len(trace)))
    assert df["outcome"].isin(["good", "late", "rejected", "expired"]).all()
    # a later arrival never starts earlier, same instants too
    if run.policy.discipline in ("fifo", "codel"):
        assert df.loc[df["start_s"].notna(), "start_s"].is_monotonic_increasing
    # Expiry only under deadline policies (or CoDel's drops at the front); refusals only under a
    # rule that can refuse.
    policy = run.policy
    if not policy.expire_at_front and policy.discipline != "codel":
        assert not df["outcome"].eq("expired").any()
    if policy.max_queue is None and policy.max_queued_seconds is None and not policy.predictive:
        assert not df["outcome"].eq("rejected").any()


@settings(max_examples=40, deadline=None)
@given(runs())
def test_same_seed_same_rows(run):
    trace = run.trace()
    pd.testing.assert_frame_equal(run.simulate(trace), run.simulate(trace))


# Found in CI: bursts whose deadline is met to the last bit of a float sum.
BURSTS = SimRun(
    Policy("random", deadline_s=1.0),
    EngineSettings(1),
    Workload("periodic:10:1.5", "mix", load=1.0, requests=28, seed=2),
)


@SETTINGS
@given(runs(exact=True), st.floats(0.1, 5.0), st.booleans())
@example(BURSTS, 1.3, False)
@example(BURSTS, 1.3, True)
def test_predictive_with_exact_estimates_is_never_late(run, deadline, expire):
    policy = Policy("predictive", predictive=True, deadline_s=deadline, expire_at_front=expire)
    trace = run.trace()
    df = SimRun(policy, run.engines, run.workload).simulate(trace)
    assert np.array_equal(trace.true_service_s, trace.est_service_s)
    assert not df["outcome"].eq("late").any()
    # With exact estimates nothing admitted ever has to expire either.
    assert not df["outcome"].eq("expired").any()


BATCHING = st.builds(EngineSettings, fixed_estimate=st.booleans(), batching=batching_engines())
#: Presets that read a batching engine's projections or memory, besides random FIFO policies.
BATCH_POLICIES = (
    policies(("fifo", "edf", "priority"))
    | preset_policies()
    | st.sampled_from([PRESETS[n] for n in ("predictive-kv", "vllm-caps", "llm-d-shed")])
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs(policy=BATCH_POLICIES, engines=BATCHING))
def test_batching_engine_invariants(run):
    """A batching engine (qsim.engines.Batching) under random seats, budgets, caches and step
    models: one outcome each, conservation, at most max_num_seqs in the batch and the cache never
    overrun (also audited at every step), never idle while one waits, the queue bound, FIFO's order
    of first joins."""
    trace = run.trace()
    df = records.validate(run.simulate(trace))
    check_records(df, run, trace)
    assert df["outcome"].isin(["good", "late", "rejected", "expired"]).all()
    # What no state of the engine could serve is refused at once, whatever the rule; nothing else is
    # refused under a rule that cannot refuse.
    policy = run.policy
    if (
        policy.name == "random"
        and policy.max_queue is None
        and policy.max_queued_seconds is None
        and not policy.predictive
    ):  # a policies() draw that cannot refuse
        assert df.loc[df["outcome"].eq("rejected"), "reason"].eq("too_large").all()
