import numpy as np
import pandas as pd
import pytest

from qsim import PRESETS, Policy, from_arrays, make_trace, preset, records, simulate
from qsim.config import ServerConfig


def burst(n, tokens=16, **kw):
    return from_arrays(np.zeros(n), np.full(n, tokens), **kw)


def test_starter_burst_six_accepted_four_rejected():
    # The counting trap: two start at once, four wait, four are refused.
    df = simulate(burst(10), Policy(max_queue=4), engines=2)
    assert (df["outcome"] != "rejected").sum() == 6
    assert (df["outcome"] == "rejected").sum() == 4
    assert df.loc[df["outcome"] == "rejected", "request_id"].tolist() == [6, 7, 8, 9]
    assert df["start_s"].iloc[:2].tolist() == [0.0, 0.0]
    assert sorted(df["engine"].iloc[:2].tolist()) == [0, 1]
    assert df["queued_at_arrival"].tolist() == [0, 0, 0, 1, 2, 3, 4, 4, 4, 4]


def test_burst_of_30_with_bound_8_admits_9():
    df = simulate(burst(30), PRESETS["bounded"])
    assert (df["outcome"] != "rejected").sum() == 9
    refused = df[df["outcome"] == "rejected"]
    assert set(refused["reason"]) == {"queue_full"}
    # Retry-After from the estimated wait: 1 in service + 8 waiting of 0.137 s = 1.233 s -> 2 s.
    assert set(refused["retry_after_s"]) == {2}
    assert df.loc[df["outcome"] != "rejected", "retry_after_s"].isna().all()


def test_expiry_at_the_front():
    # 64 tokens = 0.545 s each: three finish by 2 s, the fourth could not, and nor can the rest.
    df = simulate(burst(30, tokens=64), PRESETS["bounded-deadline"])
    counts = df["outcome"].value_counts()
    assert (counts["good"], counts["expired"], counts["rejected"]) == (3, 6, 21)
    expired = df[df["outcome"] == "expired"]
    assert set(expired["reason"]) == {"cannot_finish"}
    assert expired["start_s"].isna().all() and expired["engine"].isna().all()
    assert np.allclose(expired["finish_s"], 3 * 0.545)  # dropped when they reached the front
    # Plain bounded runs them all, and most are late.
    late = simulate(burst(30, tokens=64), PRESETS["bounded"])["outcome"].value_counts()
    assert (late["good"], late["late"]) == (3, 6)


def test_predictive_refuses_at_arrival_with_numbers():
    df = simulate(burst(20, tokens=64), PRESETS["predictive"])
    counts = df["outcome"].value_counts()
    assert counts["good"] == 3 and "late" not in counts and "expired" not in counts
    refused = df[df["outcome"] == "rejected"]
    assert set(refused["reason"]) == {"deadline_unreachable"}
    assert refused["queued_at_arrival"].eq(2).all()
    assert refused["queued_work_at_arrival_s"].iloc[0] == pytest.approx(2 * 0.545)
    assert refused["retry_after_s"].eq(2).all()  # wait 1.635 s


def test_request_deadlines_override_the_policy():
    t = from_arrays([0.0, 0.0], [64, 64], deadline_s=[np.nan, 0.5])
    df = simulate(t, PRESETS["predictive"])
    assert df["outcome"].tolist() == ["good", "rejected"]
    assert df["deadline_s"].tolist() == [2.0, 0.5]


def test_records_follow_the_schema():
    t = make_trace(load=1.5, seconds=60, seed=3)
    df = simulate(t, PRESETS["bounded-deadline"], engines=2)
    records.validate(df)
    assert list(df.columns) == list(records.COLUMNS)
    assert df.attrs["duration_s"] == 60 and df.attrs["engines"] == 2
    answered = df[df["outcome"].isin(["good", "late"])]
    assert np.allclose(answered["finish_s"] - answered["start_s"], answered["true_service_s"])
    assert np.allclose(df["latency_s"], df["finish_s"] - df["arrival_s"])


def test_parquet_round_trip_keeps_dtypes(tmp_path):
    df = simulate(make_trace(load=2, seconds=30, seed=1), PRESETS["predictive"])
    df.to_parquet(tmp_path / "r.parquet")
    back = pd.read_parquet(tmp_path / "r.parquet")
    records.validate(back)
    pd.testing.assert_frame_equal(back, df, check_like=False)


def test_speed_tracking_is_what_keeps_deadline_policies_on_time():
    # The machine runs 2.25x slower than calibrated, at nominal load 1.
    t = make_trace(load=2.25, speed=2.25, seconds=600, seed=0)
    for name in ("predictive", "bounded-deadline"):
        stale = simulate(t, ServerConfig(preset(name), fixed_estimate=True))
        tracked = simulate(t, preset(name))
        late_share = lambda d: (d.outcome == "late").sum() / d.outcome.isin(["good", "late"]).sum()  # noqa: E731
        assert late_share(stale) > 0.10
        assert late_share(tracked) < 0.005
        assert tracked.attrs["speed_factor"] == pytest.approx(2.25)
        assert stale.attrs["speed_factor"] == 1.0


def test_common_random_numbers_across_policies():
    t = make_trace(load=1.3, seconds=120, seed=5)
    frames = [simulate(t, preset(p)) for p in PRESETS]
    for f in frames[1:]:
        assert np.array_equal(f["arrival_s"], frames[0]["arrival_s"])
        assert np.array_equal(f["true_service_s"], frames[0]["true_service_s"])


def test_more_engines_wait_less():
    t = make_trace(load=0.9, engines=4, seconds=300, seed=2)
    df = simulate(t, PRESETS["none"], engines=4)
    assert set(df["engine"].dropna()) == {0, 1, 2, 3}


def test_empty_and_invalid():
    empty = from_arrays([], [])
    assert len(simulate(empty)) == 0
    with pytest.raises(ValueError):
        simulate(burst(3), engines=0)
    with pytest.raises(ValueError, match="sorted"):
        simulate(from_arrays([1.0, 0.0], [4, 4]))


def test_a_hung_engine_is_stalled_at_its_threshold_and_the_waiting_give_up():
    from qsim.queue import StallRule

    # 16 tokens = 0.137 s; the first request hangs for 60 s on the only engine.
    trace = from_arrays(np.zeros(4), np.full(4, 16), true_service_s=[60.0, 0.137, 0.137, 0.137])
    df = simulate(trace, ServerConfig(PRESETS["bounded-deadline"], stall=StallRule(10.0, 5.0)))
    assert df["outcome"].tolist() == ["error", "expired", "expired", "expired"]
    assert df.loc[0, "reason"] == "engine_stalled" and df.loc[0, "finish_s"] == pytest.approx(5.0)
    # The waiting are given up once their 2 s deadline has passed, at the watchdog's next look after
    # 5 s.
    assert (df.loc[1:, "finish_s"] >= 5.0).all() and (df.loc[1:, "finish_s"] <= 5.1).all()
    assert set(df.loc[1:, "reason"]) == {"cannot_finish"}
    # Without a stall rule (the study's model) the hang is just a long request.
    assert simulate(trace, PRESETS["bounded-deadline"])["outcome"].tolist()[0] == "late"


def test_failures_and_clients_that_leave_end_in_one_outcome_each():
    trace = make_trace("poisson", "mix", load=1.5, seconds=60, seed=3, noise_cv=0.3)
    n = len(trace)
    failed = np.arange(n) % 5 == 0
    patience = np.where(np.arange(n) % 4 == 1, 0.2, np.nan)
    df = records.validate(simulate(trace, PRESETS["none"], failed=failed, cancel_after_s=patience))
    assert set(df.loc[failed & df["outcome"].ne("abandoned").to_numpy(), "outcome"]) == {"error"}
    assert df["outcome"].eq("abandoned").sum() > 10
    # A failure teaches the tracker nothing; what the engine reports (not what held it) is what it
    # learns.
    clean = simulate(trace, PRESETS["none"])
    slower = simulate(trace, PRESETS["none"], reported_s=trace.true_service_s * 2)
    assert slower.attrs["speed_factor"] > 1.5 * clean.attrs["speed_factor"]
    np.testing.assert_array_equal(slower["start_s"].notna(), clean["start_s"].notna())


def test_disciplines_change_who_is_served_not_how_many_are_decided():
    trace = make_trace("poisson", "mix", load=2.0, seconds=300, seed=4, noise_cv=0.2)
    fifo = records.validate(simulate(trace, PRESETS["predictive"]))
    sjf = records.validate(simulate(trace, PRESETS["predictive-sjf"]))
    short = trace.max_new_tokens == 4
    # Shortest first starts the 4-token requests ahead of the waiting 64-token ones.
    assert (
        sjf.loc[short, "outcome"].eq("good").mean() > fifo.loc[short, "outcome"].eq("good").mean()
    )
    nearer = make_trace("poisson", "mix", load=1.3, seconds=300, seed=4, noise_cv=0.2)
    codel = records.validate(simulate(nearer, PRESETS["codel"]))
    assert set(codel.loc[codel["outcome"].eq("expired"), "reason"]) == {"codel"}
    assert (
        codel["outcome"].eq("good").mean()
        > 0.5
        > simulate(nearer, PRESETS["none"])["outcome"].eq("good").mean()
    )


def test_a_policy_names_a_known_discipline():
    with pytest.raises(ValueError, match="unknown discipline 'random'; choose one of fifo, lifo"):
        Policy(discipline="random")
    p = PRESETS["predictive-edf"]
    assert p.make_discipline() is not p.make_discipline()  # one per queue


def test_a_heavy_client_is_rate_limited_and_the_light_one_is_not():
    trace = make_trace("poisson", "mix", load=1.5, seconds=120, seed=6)
    client = np.where(np.arange(len(trace)) % 10 == 0, "light", "heavy")  # heavy sends 90 %
    policy = Policy(
        "limited", client_rate=4.0, client_burst=5, predictive=True, expire_at_front=True
    )
    df = records.validate(simulate(trace, policy, client=client))
    limited = df["reason"].eq("rate_limited").fillna(False).to_numpy(bool)
    assert limited[client == "heavy"].mean() > 0.3 and not limited[client == "light"].any()
    heavy_admitted = (~limited & (client == "heavy")).sum()
    assert heavy_admitted <= 5 + 4.0 * trace.arrival_s[-1]  # burst + rate x time
    # Without a client the bucket is not consulted: the same rows as the policy without a limit.
    same = simulate(trace, policy)
    assert same["outcome"].tolist() == simulate(trace, PRESETS["predictive"])["outcome"].tolist()


@pytest.mark.parametrize("load", [2.0, 3.0])
def test_a_reserved_share_serves_the_long_class_that_predictive_starves(load):
    trace = make_trace("poisson", "mix", load=load, seconds=600, seed=1)
    long = trace.max_new_tokens == 64
    plain = simulate(trace, PRESETS["predictive"])["outcome"].eq("good").to_numpy()
    kept = (
        records.validate(simulate(trace, PRESETS["predictive-reserved"]))["outcome"]
        .eq("good")
        .to_numpy()
    )
    assert plain[long].mean() < 0.2 and kept[long].mean() >= 0.25
    # What it costs the others: fewer requests in time, the same good tokens per second (within 1
    # %).
    assert kept.mean() < plain.mean()
    tokens = trace.max_new_tokens
    assert tokens[kept].sum() >= 0.99 * tokens[plain].sum()


def test_patience_until_start_lets_a_started_request_finish():
    # Three at once on one engine, 1 s each; every client's patience is 1.5 s.
    trace = from_arrays(
        np.zeros(3), np.full(3, 16), true_service_s=np.ones(3), est_service_s=np.ones(3)
    )
    patience = np.full(3, 1.5)
    answer = simulate(trace, PRESETS["none"], cancel_after_s=patience)
    start = records.validate(
        simulate(trace, PRESETS["none"], cancel_after_s=patience, cancel_until="start")
    )
    # The first ends at 1 s. Patience for the whole answer: the second runs from 1 s and its client
    # leaves at 1.5 s, the third leaves the queue then. Patience to the start: the second has
    # started, so it stays.
    assert answer["outcome"].tolist() == ["good", "abandoned", "abandoned"]
    assert start["outcome"].tolist() == ["good", "good", "abandoned"]
    assert start.loc[2, "reason"] == "client_left" and start.loc[2, "finish_s"] == pytest.approx(
        1.5
    )
    assert start.loc[1, "finish_s"] == pytest.approx(2.0)
    # The default is the whole answer, row for row.
    pd.testing.assert_frame_equal(
        answer, simulate(trace, PRESETS["none"], cancel_after_s=patience, cancel_until="answer")
    )
    with pytest.raises(ValueError, match="cancel_until must be one of answer, start"):
        simulate(trace, PRESETS["none"], cancel_until="finish")


@pytest.mark.parametrize("engines", [1, 4])
def test_deterministic_patience_while_waiting_is_expiry_at_the_front(engines):
    # M/M/c+D two ways: clients that leave after tau unstarted, and expiry at the front with a fixed
    # estimate E[S] and deadline tau + E[S]. FIFO: the same requests are served, at the same times.
    tau = 1.0
    trace = make_trace(
        "poisson",
        "exponential",
        load=0.95,
        engines=engines,
        requests=3000,
        seed=7,
        mean_service_s=1.0,
    )
    leave = simulate(
        trace,
        Policy(deadline_s=1e12),
        engines,
        cancel_after_s=np.full(len(trace), tau),
        cancel_until="start",
    )
    front = simulate(
        trace,
        ServerConfig(
            Policy(deadline_s=tau + 1.0, expire_at_front=True), engines, fixed_estimate=True
        ),
    )
    gone = leave["outcome"].eq("abandoned")
    assert gone.mean() > 0.05
    np.testing.assert_array_equal(gone, front["outcome"].eq("expired"))
    np.testing.assert_array_equal(leave["start_s"], front["start_s"])
