"""The live gate and the simulator are two drivers of one queue core: request by request, they agree
exactly.

The gate runs on a virtual clock (tests/virtual_time.py): real futures, hooks,
watchdog and counts, engines that take each request's true service time on that
clock. Outcomes, reasons, engines and queue counts must be equal; times agree to 1e-12 s
(asyncio runs timers within its clock resolution of each other together, so a
finish can be read one float step before the simulator's).
"""

import numpy as np
import pytest

from qsim import PRESETS, ServiceModel, from_arrays, make_trace, records, simulate
from qsim.clients import Patience, RetryPolicy
from qsim.config import ServerConfig
from virtual_time import run_gate

MODEL = ServiceModel(intercept_s=0.002, per_token_s=0.004)  # 12 tokens -> 0.05 s


def _agree(trace, policy, engines, *, model=ServiceModel(), engine_ties=False, **kw):
    # run_gate: the gate's own stall rule
    gate, stats = run_gate(trace, policy, engines, model=model, **kw)
    server = {k: kw.pop(k) for k in ("fixed_estimate",) if k in kw}
    sim = simulate(trace, ServerConfig(policy, engines, **server), **kw)
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    # a client that left does not hear when its run began
    known = gate["outcome"].ne("abandoned").to_numpy()
    assert gate["reason"].fillna("-").tolist() == sim["reason"].fillna("-").tolist()
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        gate.loc[known, "start_s"], sim.loc[known, "start_s"], rtol=0, atol=1e-12
    )
    # equal service times can end at the same instant, and then either engine goes first
    if not engine_ties:
        np.testing.assert_array_equal(
            gate.loc[known, "engine"], sim.loc[known, "engine"].fillna(-1)
        )
    # abandoned requests carry no admission view on the client side
    seen = gate["queued"].ge(0).to_numpy()
    np.testing.assert_array_equal(
        gate.loc[seen, "queued"], sim.loc[seen, "queued_at_arrival"].astype(int)
    )
    np.testing.assert_allclose(
        gate.loc[seen, "queued_work_s"],
        sim.loc[seen, "queued_work_at_arrival_s"],
        rtol=0,
        atol=1e-12,
    )
    np.testing.assert_allclose(
        gate.loc[seen, "est_service_s"], sim.loc[seen, "est_service_s"], rtol=0, atol=1e-12
    )
    counts = sim["outcome"].value_counts()
    assert {k: v for k, v in stats["counts"].items() if v} == {k: int(v) for k, v in counts.items()}
    # the top-level count of clients that left, as before
    assert stats["cancelled"] == counts.get("abandoned", 0)
    assert stats["waiting"] == 0 and stats["in_service"] == 0
    return sim


BURSTS = {
    # The counting trap: two start at once, four wait, four are refused.
    "bounded 10/limit 4/2 engines": (PRESETS["bounded"].with_overrides(max_queue=4), 2, [12] * 10),
    "none": (PRESETS["none"], 2, [4, 12, 8, 12, 4, 4, 8, 12]),
    "bounded": (PRESETS["bounded"].with_overrides(max_queue=3), 1, [12] * 6),
    # No expiry: the third and fourth run and end after their 0.125 s deadline.
    "bounded late": (PRESETS["bounded"].with_overrides(max_queue=3, deadline_s=0.125), 1, [12] * 6),
    # Deadline 0.125 s, 0.05 s each: the second finishes at 0.10, the third would end at 0.15 ->
    # expired.
    "bounded-deadline expiry": (
        PRESETS["bounded-deadline"].with_overrides(deadline_s=0.125),
        1,
        [12] * 10,
    ),
    "predictive": (PRESETS["predictive"].with_overrides(deadline_s=0.125), 1, [12] * 10),
    "predictive 2 engines": (PRESETS["predictive"].with_overrides(deadline_s=0.125), 2, [12] * 10),
    "burst of 30, reference mix, 3 engines": (PRESETS["predictive"], 3, [4, 16, 64] * 10),
}


@pytest.mark.parametrize("name", list(BURSTS))
def test_burst_matches_the_simulator_exactly(name):
    policy, engines, tokens = BURSTS[name]
    trace = from_arrays(np.zeros(len(tokens)), tokens, model=MODEL)
    _agree(trace, policy, engines, model=MODEL, engine_ties=True)


def test_the_counting_trap_in_numbers():
    policy, engines, tokens = BURSTS["bounded 10/limit 4/2 engines"]
    sim = _agree(
        from_arrays(np.zeros(10), tokens, model=MODEL),
        policy,
        engines,
        model=MODEL,
        engine_ties=True,
    )
    assert sim["outcome"].tolist() == ["good"] * 6 + ["rejected"] * 4


@pytest.mark.parametrize("policy", list(PRESETS))
@pytest.mark.parametrize("engines", [1, 3])
def test_poisson_overload_with_noise_matches_the_simulator_exactly(policy, engines):
    trace = make_trace(
        "poisson", "mix", load=2.0, engines=engines, seconds=15, seed=engines, noise_cv=0.3
    )
    sim = _agree(trace, PRESETS[policy], engines)
    assert len(sim) > 100


@pytest.mark.parametrize("policy", ["bounded-deadline", "predictive"])
def test_engine_failures_match_the_simulator_exactly(policy):
    trace = make_trace("poisson", "mix", load=1.3, engines=2, seconds=15, seed=7, noise_cv=0.3)
    failed = np.arange(len(trace)) % 7 == 6
    sim = _agree(trace, PRESETS[policy], 2, failed=failed)
    assert sim["outcome"].eq("error").sum() > 5
    assert set(sim.loc[sim["outcome"].eq("error"), "reason"]) == {"engine_exception"}


def test_clients_that_leave_match_the_simulator_exactly():
    trace = make_trace("poisson", "mix", load=1.5, engines=1, seconds=15, seed=4, noise_cv=0.3)
    # every third leaves after 0.3 s
    patience = np.where(np.arange(len(trace)) % 3 == 0, 0.3, np.inf)
    sim = _agree(trace, PRESETS["none"], 1, cancel_after_s=patience)
    left = sim[sim["outcome"].eq("abandoned")]
    assert len(left) > 5 and left["reason"].eq("client_left").all()
    # some left while served, some waiting
    assert left["start_s"].notna().any() and left["start_s"].isna().any()


def test_fixed_estimate_matches_the_simulator_exactly():
    trace = make_trace(
        "poisson", "mix", load=1.5, engines=1, speed=2.0, seconds=15, seed=9, noise_cv=0.2
    )
    _agree(trace, PRESETS["predictive"], 1, fixed_estimate=True)


def test_priority_classes_and_client_limits_match_the_simulator_exactly():
    from qsim import Policy

    trace = make_trace("poisson", "mix", load=1.5, engines=2, seconds=15, seed=8, noise_cv=0.3)
    n = len(trace)
    priority = np.arange(n) % 3 == 0  # every third request in the higher class
    client = np.where(np.arange(n) % 4 == 0, "light", "heavy")
    policy = Policy(
        "classes",
        predictive=True,
        expire_at_front=True,
        discipline="priority",
        client_rate=6.0,
        client_burst=3,
    )
    sim = _agree(trace, policy, 2, priority=priority.astype(int), client=client)
    assert sim["reason"].eq("rate_limited").sum() > 10


def test_a_two_client_workload_under_fair_share_matches_the_simulator_exactly():
    from qsim import Client, Mix

    clients = (
        Client("heavy", 0.85),
        Client("light", 0.15, priority=1, mix=Mix((4, 16), (0.6, 0.4))),
    )
    trace = make_trace(
        "poisson", "mix", load=2.0, engines=2, seconds=15, seed=5, noise_cv=0.3, clients=clients
    )
    for name in ("predictive-fair", "predictive"):
        sim = _agree(trace, PRESETS[name], 2)
        assert set(sim["client_id"].dropna()) == {"heavy", "light"}
    light = sim["client_id"].eq("light")
    fair = simulate(trace, PRESETS["predictive-fair"], 2)
    assert (
        fair.loc[light, "outcome"].eq("good").mean() > sim.loc[light, "outcome"].eq("good").mean()
    )


@pytest.mark.parametrize("policy", ["predictive", "bounded-deadline", "none"])
def test_retrying_impatient_clients_match_the_simulator_exactly(policy):
    """One Retrier for both drivers: each attempt, its time, outcome and Retry-After agree, by
    (request, attempt)."""
    retry = RetryPolicy(
        "exponential", delay_s=0.2, cap_s=2.0, jitter=1.0, max_attempts=4, timeout_s=1.5
    )
    trace = make_trace(
        "surge:2:3:2.5",
        "mix",
        load=0.8,
        engines=2,
        seconds=12,
        seed=5,
        noise_cv=0.2,
        patience=Patience.parse("exponential:2.5"),
    )
    gate, stats = run_gate(trace, PRESETS[policy], 2, retry=retry)
    sim = records.validate(simulate(trace, PRESETS[policy], 2, retry=retry))
    key = ["first_request_id", "attempt"]
    gate = gate.sort_values(key, ignore_index=True)
    sim = sim.sort_values(key, ignore_index=True)
    assert gate[key].values.tolist() == sim[key].values.tolist()
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    assert gate["reason"].fillna("-").tolist() == sim["reason"].fillna("-").tolist()
    np.testing.assert_allclose(gate["arrival_s"], sim["arrival_s"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-9)
    told = sim["retry_after_s"].fillna(-1).astype(int).tolist()
    assert gate["retry_after_s"].tolist() == told
    assert (sim["attempt"] > 1).sum() >= 5
    # nothing is refused: the retries are of attempts the clients stopped waiting for
    if policy == "none":
        assert sim["reason"].eq("client_timeout").any()
    counts = sim["outcome"].value_counts()
    assert stats["cancelled"] == counts.get("abandoned", 0)
