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
