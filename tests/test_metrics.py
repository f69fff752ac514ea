import math

import numpy as np
import pandas as pd
import pytest

from analysis import metrics
from qsim import PRESETS, from_arrays, make_trace, simulate


def test_summary_counts_rates_and_percentiles():
    df = simulate(make_trace(load=2.0, seconds=300, seed=4), PRESETS["predictive"])
    s = metrics.summary(df, 300)
    counts = df["outcome"].value_counts()
    assert s["requests"] == len(df) and s["good"] == counts.get("good", 0)
    assert s["share_good"] == pytest.approx(counts["good"] / len(df))
    assert s["goodput_rps"] == pytest.approx(counts["good"] / 300)
    good = df[df["outcome"] == "good"]
    assert s["good_tokens_per_s"] == pytest.approx(good["max_new_tokens"].sum() / 300)
    answered = df.loc[df["outcome"].isin(["good", "late"]), "latency_s"]
    assert s["latency_p99_s"] == pytest.approx(answered.quantile(0.99))
    assert s["refusal_p50_s"] == 0.0  # the simulator refuses at once


def test_by_class_adds_up_and_is_ordered():
    df = simulate(make_trace(load=1.5, seconds=200, seed=1), PRESETS["bounded"])
    table = metrics.by_class(df, 200)
    assert list(table.index) == ["4", "16", "64"]
    assert table["requests"].sum() == len(df)
    assert table["goodput_rps"].sum() == pytest.approx(metrics.summary(df, 200)["goodput_rps"])


def test_burst_rates_fall_back_to_the_makespan():
    df = simulate(from_arrays(np.zeros(4), np.full(4, 64)), PRESETS["none"])
    s = metrics.summary(df)
    assert s["goodput_rps"] == pytest.approx(3 / df["finish_s"].max())


def test_mean_ci_matches_scipy_t_interval():
    from scipy import stats

    x = [1.0, 2.0, 4.0, 3.0]
    mean, low, high = metrics.mean_ci(x)
    assert mean == 2.5
    assert (low, high) == pytest.approx(stats.t.interval(0.95, 3, loc=2.5, scale=stats.sem(x)))
    assert metrics.mean_ci([5.0])[0] == 5.0 and math.isnan(metrics.mean_ci([5.0])[1])
    assert metrics.mean_ci([2.0, 2.0]) == (2.0, 2.0, 2.0)


def test_controlled_mean_ci_covers_the_mean_and_narrows():
    # Replications whose value moves with a control of known mean 0: y = 3 + 2 x + noise. Over many
    # such sets of 10 the interval covers 3 about 95 % of the time (500 sets: 0.92-0.98), and is
    # narrower than the plain interval.
    rng = np.random.default_rng(5)
    covered, ratio = 0, []
    for _ in range(500):
        x = rng.normal(0, 1, 10)
        y = 3 + 2 * x + rng.normal(0, 0.5, 10)
        mean, low, high = metrics.controlled_mean_ci(y, x, 0.0)
        covered += low <= 3 <= high
        plain = metrics.mean_ci(y)
        ratio.append((high - low) / (plain[2] - plain[1]))
    assert 0.92 <= covered / 500 <= 0.98
    # the control explains most of the spread: sqrt(1 - r^2) = 0.24 before the t's
    assert np.median(ratio) < 0.35
    # The estimate is the regression line at the known mean, not the plain mean.
    mean, _, _ = metrics.controlled_mean_ci([1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 2.0, 3.0], 1.0)
    assert mean == pytest.approx(2.0)
    # Fewer than 3 replications (or NaNs leaving fewer) give no interval.
    assert math.isnan(metrics.controlled_mean_ci([1.0, 2.0], [0.0, 1.0], 0.5)[1])
    assert math.isnan(metrics.controlled_mean_ci([1.0, 2.0, math.nan], [0.0, 1.0, 2.0], 0.5)[2])


def test_aggregate_groups_and_counts():
    table = pd.DataFrame({"policy": ["a", "a", "b", "b", "b"], "x": [1.0, 3.0, 2.0, 2.0, 2.0]})
    agg = metrics.aggregate(table, ["policy"], ["x"])
    assert agg["n"].tolist() == [2, 3] and agg["x"].tolist() == [2.0, 2.0]
    assert agg.loc[1, "x_low"] == agg.loc[1, "x_high"] == 2.0


def _frame(rows):
    """A hand-built frame: (client_id, priority, outcome, latency_s, max_new_tokens) per request."""
    client, priority, outcome, latency, tokens = zip(*rows)
    return pd.DataFrame(
        {
            "client_id": pd.array(client, dtype="string"),
            "priority": np.array(priority, dtype=np.int64),
            "size_class": pd.array(["16"] * len(rows), dtype="string"),
            "outcome": pd.array(outcome, dtype="string"),
            "latency_s": np.array(latency, dtype=float),
            "max_new_tokens": np.array(tokens, dtype=np.int64),
            "arrival_s": np.zeros(len(rows)),
            "finish_s": np.array(latency, dtype=float),
        }
    )


HAND = _frame(
    [
        ("a", 0, "good", 1.0, 10),
        ("a", 0, "good", 3.0, 30),
        ("a", 0, "late", 5.0, 10),
        ("a", 0, "rejected", 0.0, 10),
        ("b", 1, "good", 2.0, 20),
        ("b", 1, "expired", 4.0, 20),
        (None, -1, "good", 1.0, 40),
        (None, -1, "rejected", 0.0, 40),
    ]
)


def test_by_client_known_answers():
    table = metrics.by_client(HAND, duration_s=10)
    # no client named: kept, last
    assert list(table.index[:2]) == ["a", "b"] and pd.isna(table.index[2])
    a, b, none = (table.iloc[i] for i in range(3))
    assert (a["requests"], a["good"], a["late"], a["rejected"], a["refused"]) == (4, 2, 1, 1, 1)
    assert a["share_good"] == 0.5 and a["share_refused"] == 0.25 and a["share_of_requests"] == 0.5
    assert a["goodput_rps"] == pytest.approx(0.2) and a["good_tokens_per_s"] == pytest.approx(4.0)
    assert a["latency_p50_s"] == 3.0  # over the answered: 1, 3, 5
    assert a["latency_p99_s"] == pytest.approx(np.quantile([1.0, 3.0, 5.0], 0.99))
    assert (b["refused"], b["expired"], b["share_refused"], b["good_tokens_per_s"]) == (
        1,
        1,
        0.5,
        2.0,
    )
    assert (none["requests"], none["good_tokens_per_s"], none["refused"]) == (2, 4.0, 1)
    # The groups add up to the whole run.
    whole = metrics.summary(HAND, 10)
    for col in ("requests", "good", "refused", "goodput_rps", "good_tokens_per_s"):
        assert table[col].sum() == pytest.approx(whole[col])
    assert whole["refused"] == 3 and whole["share_refused"] == pytest.approx(3 / 8)


def test_by_priority_and_by_class_are_the_same_grouped_summary():
    table = metrics.by_priority(HAND, duration_s=10)
    assert list(table.index) == [-1, 0, 1] and table.index.name == "priority"
    assert table["requests"].tolist() == [2, 4, 2] and table["good"].tolist() == [1, 2, 1]
    assert table.loc[1, "share_refused"] == 0.5
    by_client = metrics.by_client(HAND, 10)
    assert table.loc[0].equals(by_client.loc["a"]) and table.loc[1].equals(by_client.loc["b"])
    grouped = metrics.by_group(HAND, "size_class", 10)
    assert grouped.loc["16"].drop("share_of_requests").to_dict() == pytest.approx(
        metrics.summary(HAND, 10), nan_ok=True
    )


def test_jain_index():
    assert metrics.jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert metrics.jain_index([5.0, 0.0, 0.0, 0.0]) == pytest.approx(1 / 4)
    assert metrics.jain_index([1.0, 3.0]) == pytest.approx(16 / (2 * 10))
    assert metrics.jain_index([2.0, np.nan, 2.0]) == pytest.approx(1.0)  # NaNs dropped
    assert math.isnan(metrics.jain_index([])) and math.isnan(metrics.jain_index([0.0, 0.0]))


def test_client_fairness_leaves_out_requests_naming_no_client():
    fair = metrics.client_fairness(metrics.by_client(HAND, 10))
    assert fair["jain_goodput"] == pytest.approx(metrics.jain_index([4.0, 2.0]))  # a and b only
    assert fair["jain_share"] == pytest.approx(metrics.jain_index([0.5, 0.5])) == 1.0


def _attempts(rows):
    """A hand-made frame of attempts: (first_request_id, attempt, arrival_s, finish_s, outcome),
    deadline 2 s."""
    frame = pd.DataFrame(
        rows, columns=["first_request_id", "attempt", "arrival_s", "finish_s", "outcome"]
    )
    return frame.assign(
        request_id=range(len(frame)),
        latency_s=frame["finish_s"] - frame["arrival_s"],
        deadline_s=2.0,
        reason=None,
        max_new_tokens=16,
    )


TINY = _attempts(
    [
        (0, 1, 0.2, 1.1, "good"),
        (1, 1, 0.5, 0.5, "rejected"),
        (1, 2, 1.5, 2.2, "good"),  # 1.7 s from the first send: good end to end, counted at 0.5
        (2, 1, 1.0, 3.0, "abandoned"),  # the client's timeout
        # good as an attempt, late end to end (2.5 s from the first send)
        (2, 2, 3.0, 3.5, "good"),
        (3, 1, 2.9, 5.5, "late"),
    ]
)


def test_over_time_bins_a_hand_made_frame():
    series = metrics.over_time(TINY)
    # to the bin of the last event (a finish at 5.5)
    assert list(series["t_s"]) == [0, 1, 2, 3, 4, 5]
    assert list(series["attempts_per_s"]) == [2, 2, 1, 1, 0, 0]
    assert list(series["first_sends_per_s"]) == [2, 1, 1, 0, 0, 0]
    # by the time the good answers came back
    assert list(series["goodput_rps"]) == [0, 1, 1, 1, 0, 0]
    assert list(series["goodput_e2e_rps"]) == [2, 0, 0, 0, 0, 0]  # by first send
    # Wider bins give rates per second; until_s ends the bins, and what happens at or after it is
    # left out.
    two = metrics.over_time(TINY, bin_s=2.0)
    assert list(two["t_s"]) == [0, 2, 4] and list(two["attempts_per_s"]) == [2.0, 1.0, 0.0]
    cut = metrics.over_time(TINY, until_s=3.0)
    assert list(cut["t_s"]) == [0, 1, 2] and list(cut["attempts_per_s"]) == [2, 2, 1]
    assert list(cut["goodput_rps"]) == [0, 1, 1]
    # The counts add up to the frame's.
    assert series["attempts_per_s"].sum() == len(TINY) and series["goodput_rps"].sum() == 3
    with pytest.raises(ValueError, match="bin_s"):
        metrics.over_time(TINY, bin_s=0)


def test_over_time_of_a_run_adds_up_to_its_summary():
    trace = make_trace("surge:20:10:2.5", load=0.8, seconds=60, seed=3)
    from qsim.clients import RetryPolicy

    frame = simulate(trace, PRESETS["bounded"], retry=RetryPolicy("immediate", max_attempts=3))
    series = metrics.over_time(frame)
    s = metrics.summary(frame, 60)
    assert (
        series["attempts_per_s"].sum()
        == len(frame)
        > s["requests_e2e"]
        == series["first_sends_per_s"].sum()
    )
    assert series["goodput_rps"].sum() == s["good"]
    assert series["goodput_e2e_rps"].sum() == pytest.approx(s["goodput_e2e_rps"] * 60)


def _series(values):
    return pd.DataFrame(
        {"t_s": np.arange(len(values), dtype=float), "goodput_e2e_rps": np.asarray(values, float)}
    )


def test_recovery_on_a_constructed_series():
    # Steady at 10 before the surge (20 to 30 s), nothing until 50 s, then 9.5: within 10 % of 10.
    values = [10.0] * 20 + [15.0] * 10 + [0.0] * 20 + [9.5] * 50
    r = metrics.recovery(_series(values), 20, 30)
    assert r == {"recovery_s": 20.0, "recovered": 1.0, "steady_rps": 10.0}
    # The forward 5 s window: a ramp is back at the first bin whose next 5 s average reach 9.
    ramp = [10.0] * 20 + [0.0] * 20 + [6.0, 8.0, 9.0, 10.0, 12.0] + [10.0] * 20
    assert metrics.recovery(_series(ramp), 20, 30)["recovery_s"] == 10.0
    # Back above the steady state counts (a backlog served); at 8 it never is, unless within 25 %.
    assert metrics.recovery(_series([10.0] * 20 + [30.0] * 30), 10, 20)["recovery_s"] == 0.0
    low = [10.0] * 20 + [0.0] * 10 + [8.0] * 30
    assert math.isnan(metrics.recovery(_series(low), 20, 30)["recovery_s"])
    assert metrics.recovery(_series(low), 20, 30)["recovered"] == 0.0
    assert metrics.recovery(_series(low), 20, 30, within=0.25)["recovery_s"] == 0.0
    # Only whole windows: back for the run's last 3 s is "never".
    late = [10.0] * 20 + [0.0] * 37 + [10.0] * 3
    assert metrics.recovery(_series(late), 20, 30)["recovered"] == 0.0
    # No steady state to return to: unknown.
    r = metrics.recovery(_series([0.0] * 40), 20, 30)
    assert math.isnan(r["recovery_s"]) and math.isnan(r["recovered"])


def test_with_ci_shows_a_share_inside_0_1_and_a_rate_above_0():
    from analysis.metrics import with_ci

    frame = pd.DataFrame(
        {
            "share_good": [0.98],
            "share_good_low": [0.93],
            "share_good_high": [1.03],
            "goodput_rps": [0.2],
            "goodput_rps_low": [-0.1],
            "goodput_rps_high": [0.5],
        }
    )
    shown = with_ci(frame).iloc[0]
    assert "1.03" not in shown["share_good"] and "-0.1" not in shown["goodput_rps"]
