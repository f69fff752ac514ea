"""Clients that give up and retry (qsim.clients): the settings, the state machine, and the
simulator's rows."""

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis import metrics
from qsim import PRESETS, from_arrays, records, simulate
from qsim.clients import Patience, Retrier, RetryPolicy, status_of, uniform
from qsim.testing import runs

# -- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, kind, mean, cv",
    [
        ("none", "none", math.inf, 0.0),
        ("exponential:30", "exponential", 30.0, 0.0),
        ("deterministic:2.5", "deterministic", 2.5, 0.0),
        ("lognormal:10:0.5", "lognormal", 10.0, 0.5),
        ("column", "column", math.inf, 0.0),
    ],
)
def test_patience_specs_parse_and_print_back(spec, kind, mean, cv):
    p = Patience.parse(spec)
    assert (p.kind, p.mean_s, p.cv) == (kind, mean, cv)
    assert Patience.parse(p.spec) == p


@pytest.mark.parametrize(
    "spec",
    [
        "weibull:3",
        "exponential",
        "exponential:-1",
        "deterministic:0",
        "lognormal:3",
        "lognormal:3:0",
        "exponential:inf",
        "column:3",
        "none:1",
    ],
)
def test_bad_patience_is_one_clear_error(spec):
    with pytest.raises(ValueError, match="patience"):
        Patience.parse(spec)


def test_patience_draws_follow_their_distribution():
    rng = np.random.default_rng(1)
    n = 40_000
    for spec, mean, sd in (("exponential:3", 3.0, 3.0), ("lognormal:3:0.5", 3.0, 1.5)):
        x = Patience.parse(spec).draw(rng, n)
        half = 4 * sd / math.sqrt(n)  # far outside a 4-sigma band only if the draw is wrong
        assert abs(x.mean() - mean) < half
    assert (Patience.parse("deterministic:2").draw(rng, 5) == 2).all()
    assert np.isinf(Patience().draw(rng, 3)).all()
    assert Patience.parse("column").draw(rng, 3, [1.0, np.nan, 2.0]).tolist() == [
        1.0,
        math.inf,
        2.0,
    ]
    with pytest.raises(ValueError, match="patience_s column"):
        Patience.parse("column").draw(rng, 3)


@pytest.mark.parametrize(
    "table, message",
    [
        ({"mode": "sometimes"}, "mode"),
        ({"mode": "fixed", "delay_s": -1.0}, "delay_s"),
        ({"budget": 1.5}, "budget"),
        ({"jitter": 2.0}, "jitter"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"retry_after": "obey"}, "retry_after"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"tries": 3}, "unknown"),
    ],
)
def test_bad_retry_settings_are_one_clear_error(table, message):
    with pytest.raises(ValueError, match=message):
        RetryPolicy.from_table(table)


def test_status_follows_the_gate():
    assert status_of("good", None) == status_of("late", None) == 200
    assert status_of("rejected", "queue_full") == status_of("expired", "cannot_finish") == 503
    assert status_of("rejected", "rate_limited") == 429
    assert status_of("error", "engine_exception") == 500
    assert status_of("abandoned", "client_left") is None


# -- the state machine ---------------------------------------------------------------------


def test_what_is_retried_and_when():
    r = Retrier(RetryPolicy("fixed", delay_s=0.5, max_attempts=3, retry_after="ignore"), [0.0])
    assert r.after(0, 1, 0.0, 1.0, 200).why == "answered"
    assert r.after(0, 1, 0.0, 1.0, 400).why == "not_retryable"
    assert r.after(0, 1, 0.0, 1.0, 500).why == "not_retryable"
    assert r.after(0, 1, 0.0, 1.0, 503).at_s == 1.5
    assert r.after(0, 1, 0.0, 1.0, 429).at_s == 1.5
    assert r.after(0, 1, 0.0, 1.0, None).at_s == 1.5  # no answer: a connection error
    assert r.after(0, 3, 0.0, 1.0, 503).why == "exhausted"
    assert r.after(0, 1, 0.0, 1.0, 503, patience_s=1.4).why == "patience"
    no_conn = Retrier(RetryPolicy("fixed", on_connection_errors=False), [0.0])
    assert no_conn.after(0, 1, 0.0, 1.0, None).why == "not_retryable"
    assert Retrier(RetryPolicy(), [0.0]).after(0, 1, 0.0, 1.0, 503).why == "not_retryable"


def test_backoff_doubles_to_its_cap_and_jitter_stays_below_it():
    p = RetryPolicy("exponential", delay_s=0.5, cap_s=3.0, max_attempts=10)
    assert [p.delay(k, 0.0) for k in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    full = RetryPolicy("exponential", delay_s=0.5, cap_s=3.0, jitter=1.0)
    assert [full.delay(3, u) for u in (0.0, 0.5)] == [2.0, 1.0]
    assert RetryPolicy("immediate").delay(4, 0.3) == 0.0


def test_retry_after_is_honoured_never_sooner_or_ignored():
    honour = Retrier(
        RetryPolicy("immediate", retry_after_jitter=0.5, max_attempts=5), [0.0], seed=3
    )
    for attempt in range(1, 5):
        at = honour.after(7, attempt, 0.0, 10.0, 503, retry_after_s=2).at_s
        assert 12.0 <= at <= 13.0
        # the same draw in every executor
        assert at == 10.0 + 2 * (1 + 0.5 * uniform(3, 7, attempt))
    ignore = Retrier(RetryPolicy("immediate", retry_after="ignore"), [0.0])
    assert ignore.after(0, 1, 0.0, 10.0, 503, retry_after_s=2).at_s == 10.0


def test_budget_caps_retries_at_a_share_of_recent_first_tries():
    firsts = np.arange(100) * 0.1  # 10 first tries per second
    r = Retrier(RetryPolicy("immediate", max_attempts=9, budget=0.2, budget_window_s=5.0), firsts)
    granted = [r.after(i, 1, firsts[i], 9.95, 503).at_s is not None for i in range(100)]
    assert sum(granted) == 10  # 20 % of the 50 first tries in (4.95, 9.95]
    assert r.denied_by_budget == 90
    later = r.after(0, 1, 0.0, 20.0, 503)  # the window moved past every first try
    assert later.why == "budget"
    reserve = Retrier(
        RetryPolicy("immediate", budget=0.0, budget_min_per_s=1.0, budget_window_s=2.0), [0.0]
    )
    assert [reserve.after(0, 1, 0.0, 50.0, 503).why for _ in range(3)] == [
        "retry",
        "retry",
        "budget",
    ]


# -- the simulator ---------------------------------------------------------------------------


def test_patience_counts_from_the_first_send_and_timeouts_are_retried():
    # One engine, 1 s each: request 1 waits behind request 0.
    trace = from_arrays(
        [0.0, 0.0, 0.1], [64, 64, 64], true_service_s=[1.0, 1.0, 1.0], deadline_s=[5.0] * 3
    )
    left = simulate(trace, PRESETS["none"], cancel_after_s=[np.inf, 0.5, np.inf])
    assert left["outcome"].tolist() == ["good", "abandoned", "good"]
    timed = records.validate(
        simulate(
            trace,
            PRESETS["none"],
            retry=RetryPolicy("fixed", delay_s=0.25, timeout_s=0.4, max_attempts=2),
        )
    )
    # Request 1 times out at 0.4 and is sent again at 0.65, behind request 2; request 2 times out
    # too.
    first = timed.set_index(["first_request_id", "attempt"])
    assert first.loc[(1, 1), "reason"] == "client_timeout"
    assert first.loc[(1, 2), "arrival_s"] == pytest.approx(0.65)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_retries_off_and_infinite_patience_give_the_same_rows(run):
    """A policy that never retries, or one whose every request is answered, changes nothing."""
    trace = run.trace()
    before = run.simulate(trace)
    for retry in (RetryPolicy(), RetryPolicy("immediate", max_attempts=1)):
        after = run.simulate(trace, retry=retry, cancel_after_s=np.full(len(trace), np.inf))
        pd.testing.assert_frame_equal(before, after)
    assert before["attempt"].eq(1).all() and before["first_request_id"].equals(before["request_id"])


retries = st.builds(
    RetryPolicy,
    mode=st.sampled_from(["immediate", "fixed", "exponential"]),
    delay_s=st.floats(0.0, 1.0),
    cap_s=st.floats(0.1, 3.0),
    jitter=st.floats(0.0, 1.0),
    retry_after=st.sampled_from(["honour", "ignore"]),
    retry_after_jitter=st.floats(0.0, 0.5),
    max_attempts=st.integers(1, 5),
    budget=st.none() | st.floats(0.0, 1.0),
    timeout_s=st.none() | st.floats(0.2, 5.0),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs(), retries, st.sampled_from(["none", "exponential:1", "deterministic:2"]))
def test_retry_invariants(run, retry, patience):
    trace = run.trace(patience=Patience.parse(patience))
    df = records.validate(run.simulate(trace, retry=retry))
    firsts = df[df["attempt"].eq(1)]
    # every request was sent once, in order
    assert firsts["request_id"].tolist() == list(range(len(trace)))
    rows = df.sort_values(["first_request_id", "attempt"])
    prev = rows.groupby("first_request_id").shift(1)
    again = rows["attempt"] > 1
    # Attempts are numbered 1..k with no gap, at most max_attempts, each sent after the previous one
    # ended, and only after an answer that may be retried: never after an answer, a 500 or a client
    # that left.
    assert (
        rows.groupby("first_request_id")["attempt"].max() == rows.groupby("first_request_id").size()
    ).all()
    assert rows["attempt"].max() <= retry.max_attempts
    assert (rows.loc[again, "arrival_s"] >= prev.loc[again, "finish_s"] - 1e-12).all()
    retried = prev.loc[again]
    assert (
        retried["outcome"].isin(["rejected", "expired"]) | retried["reason"].eq("client_timeout")
    ).all()
    if retry.retry_after == "honour":  # never sooner than told
        told = retried["retry_after_s"].notna()
        waited = rows.loc[again, "arrival_s"][told] - retried.loc[told, "finish_s"]
        assert (waited >= retried.loc[told, "retry_after_s"].astype(float) - 1e-9).all()
    # Patience counts from the first send: nobody is sent again after their client would have left.
    first_arrival = rows["first_request_id"].map(firsts.set_index("request_id")["arrival_s"])
    patience = rows["first_request_id"].map(dict(enumerate(trace.patience_s)))
    assert (rows.loc[again, "arrival_s"] < first_arrival[again] + patience[again]).all()
    # One end-to-end outcome per request; an answered one is good exactly when in time from its
    # first send.
    e2e = metrics.end_to_end(df)
    assert len(e2e) == len(trace) and e2e["attempts"].sum() == len(df)
