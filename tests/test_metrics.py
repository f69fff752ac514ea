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


def test_aggregate_groups_and_counts():
    table = pd.DataFrame({"policy": ["a", "a", "b", "b", "b"], "x": [1.0, 3.0, 2.0, 2.0, 2.0]})
    agg = metrics.aggregate(table, ["policy"], ["x"])
    assert agg["n"].tolist() == [2, 3] and agg["x"].tolist() == [2.0, 2.0]
    assert agg.loc[1, "x_low"] == agg.loc[1, "x_high"] == 2.0


def _frame(rows):
    """A hand-built frame: (client_id, priority, outcome, latency_s, max_new_tokens) per request."""
    client, priority, outcome, latency, tokens = zip(*rows)
    return pd.DataFrame({
        "client_id": pd.array(client, dtype="string"), "priority": np.array(priority, dtype=np.int64),
        "size_class": pd.array(["16"] * len(rows), dtype="string"), "outcome": pd.array(outcome, dtype="string"),
        "latency_s": np.array(latency, dtype=float), "max_new_tokens": np.array(tokens, dtype=np.int64),
        "arrival_s": np.zeros(len(rows)), "finish_s": np.array(latency, dtype=float),
    })


HAND = _frame([
    ("a", 0, "good", 1.0, 10), ("a", 0, "good", 3.0, 30), ("a", 0, "late", 5.0, 10), ("a", 0, "rejected", 0.0, 10),
    ("b", 1, "good", 2.0, 20), ("b", 1, "expired", 4.0, 20),
    (None, -1, "good", 1.0, 40), (None, -1, "rejected", 0.0, 40),
])


def test_by_client_known_answers():
    table = metrics.by_client(HAND, duration_s=10)
    assert list(table.index[:2]) == ["a", "b"] and pd.isna(table.index[2])  # no client named: kept, last
    a, b, none = (table.iloc[i] for i in range(3))
    assert (a["requests"], a["good"], a["late"], a["rejected"], a["refused"]) == (4, 2, 1, 1, 1)
    assert a["share_good"] == 0.5 and a["share_refused"] == 0.25 and a["share_of_requests"] == 0.5
    assert a["goodput_rps"] == pytest.approx(0.2) and a["good_tokens_per_s"] == pytest.approx(4.0)
    assert a["latency_p50_s"] == 3.0  # over the answered: 1, 3, 5
    assert a["latency_p99_s"] == pytest.approx(np.quantile([1.0, 3.0, 5.0], 0.99))
    assert (b["refused"], b["expired"], b["share_refused"], b["good_tokens_per_s"]) == (1, 1, 0.5, 2.0)
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
    assert grouped.loc["16"].drop("share_of_requests").to_dict() == metrics.summary(HAND, 10)


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
