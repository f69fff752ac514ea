"""Simulator versus service, request by request (analysis/compare.py and `qlab compare`).

The pure parts run on runs made by the simulator itself (which must agree with
itself exactly); the end-to-end ones replay traces against real `qlab serve`
subprocesses with the synthetic engine.
"""

import numpy as np
import pandas as pd
import pytest

from analysis.compare import compare, confusion, held_s, run_setup
from qsim import make_trace, preset, records, simulate


def as_live_run(trace, policy, engines=1):
    """A simulated run dressed as a live one: the columns `qlab replay` adds beside the schema."""
    from live.rows import ServerInfo

    run = simulate(trace, preset(policy), engines)
    answered = run["outcome"].isin(records.ANSWERED).to_numpy()
    run["calibrated_est_s"] = trace.est_service_s
    run["engine_s"] = np.where(answered, trace.true_service_s, np.nan)
    run["queue_s"] = run["start_s"] - run["arrival_s"]
    for name, values in ServerInfo(preset(policy), engines, False, 1.0, None).columns(len(run)).items():
        run[name] = values
    return run


@pytest.mark.parametrize("policy", ["none", "bounded", "bounded-deadline", "predictive"])
@pytest.mark.parametrize("arrivals", ["poisson", "burst:30"])
def test_the_simulator_agrees_with_itself_exactly(policy, arrivals):
    length = {"requests": 30} if arrivals.startswith("burst") else {"seconds": 60}
    trace = make_trace(arrivals, load=1.5, seed=3, noise_cv=0.3, **length)
    result = compare(as_live_run(trace, policy))
    s = result.summary
    assert s["disagreements"] == 0 and s["requests"] == len(trace)
    assert s["latency_abs_error_p99_s"] == pytest.approx(0.0, abs=1e-9)
    for outcome in ("good", "late", "rejected", "expired"):
        assert s[f"live_{outcome}"] == s[f"sim_{outcome}"]
    assert result.confusion.to_numpy().sum() == len(trace)


def test_two_engines_and_run_setup_round_trip():
    trace = make_trace("poisson", load=1.8, engines=2, seconds=30, seed=5)
    run = as_live_run(trace, "bounded-deadline", engines=2)
    setup = run_setup(run)
    assert setup.engines == 2 and setup.policy == preset("bounded-deadline")
    assert compare(run).summary["disagreements"] == 0


def test_disagreements_and_latency_error_are_counted():
    trace = make_trace("poisson", load=1.5, seconds=30, seed=7)
    run = as_live_run(trace, "bounded")
    # The service said no to two requests the simulator will run, and was 50 ms slower on a third.
    answered = np.flatnonzero(run["outcome"].eq("good"))
    flip, slow = answered[-2:], answered[0]
    run.loc[flip, ["outcome", "reason", "start_s", "engine_s"]] = ["rejected", "queue_full", np.nan, np.nan]
    run.loc[flip, "finish_s"] = run.loc[flip, "arrival_s"]
    run.loc[slow, "finish_s"] += 0.05
    run["latency_s"] = run["finish_s"] - run["arrival_s"]
    result = compare(run)
    assert result.summary["disagreements"] == 2
    assert result.summary["disagreement_rate"] == pytest.approx(2 / len(run))
    assert result.confusion.loc["rejected", "good"] == 2
    error = result.joined.set_index("request_id")["latency_error_s"]
    assert error[slow] == pytest.approx(-0.05)
    assert error.drop(index=slow).abs().max() < 1e-9


def test_confusion_shows_every_outcome():
    joined = pd.DataFrame({"live_outcome": ["good", "error"], "sim_outcome": ["good", "rejected"]})
    table = confusion(joined)
    assert list(table.index) == list(records.OUTCOMES) and list(table.columns) == ["good", "late", "rejected", "expired"]
    assert table.loc["good", "good"] == 1 and table.loc["error", "rejected"] == 1 and table.to_numpy().sum() == 2


def test_held_time_is_the_gap_between_starts_when_the_next_was_waiting():
    run = pd.DataFrame({"outcome": ["good", "good", "good", "rejected"], "engine_s": [0.10, 0.20, 0.10, np.nan],
                        "start_s": [0.0, 0.101, 0.5, np.nan], "queue_s": [0.0, 0.05, 0.0, np.nan],
                        "engine": pd.array([0, 0, 0, None], dtype="Int64")})
    held = held_s(run)
    # 0 handed back at 0.101 to 1, which waited; the others get engine_s + that 1 ms hand-back.
    np.testing.assert_allclose(held[:3], [0.101, 0.201, 0.101])
    assert np.isnan(held[3])


def test_a_frame_without_the_live_columns_is_refused():
    run = simulate(make_trace("poisson", load=1.0, seconds=5, seed=1), preset("none"))
    with pytest.raises(ValueError, match="not a live run file"):
        compare(run)


# ---------------------------------------------------------------- against the live service


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from live.procs import ServeOptions, serving

    with serving([ServeOptions(policy=p) for p in ("bounded", "bounded-deadline", "predictive")],
                 tmp_path_factory.mktemp("logs"), 60) as started:
        yield {s.options.policy: s.url for s in started}


def live_run(url, trace):
    from live.loadgen import ReplayConfig, replay

    return replay(trace, ReplayConfig(url))


@pytest.mark.parametrize("policy", ["bounded", "bounded-deadline", "predictive"])
def test_a_live_burst_gives_the_simulators_counts_exactly(servers, policy):
    run = live_run(servers[policy], make_trace("burst:30", requests=30, seed=1))
    s = compare(run).summary
    assert s["live_errors"] == 0
    counts = {o: (s[f"live_{o}"], s[f"sim_{o}"]) for o in ("good", "late", "rejected", "expired")}
    assert all(live == sim for live, sim in counts.values()), (
        f"{policy}: live vs sim counts {counts}; exact counts need the gate's arrival times "
        "(arrived_at in the answers, clock in /stats)")
    assert s["disagreement_rate"] <= 0.10


def test_a_live_poisson_run_mostly_agrees_with_the_simulator(servers, tmp_path, capsys):
    from experiments.cli import main

    run = live_run(servers["predictive"], make_trace("poisson", load=1.6, seconds=6, seed=11))
    path = tmp_path / "run.parquet"
    run.to_parquet(path, index=False)
    assert main(["compare", str(path), "--out", str(tmp_path / "cmp")]) == 0
    text = capsys.readouterr().out
    assert "outcomes, live (rows) x simulator (columns)" in text and "disagreements:" in text
    joined = pd.read_parquet(tmp_path / "cmp" / "compare.parquet")
    assert len(joined) == len(run) and joined["request_id"].is_unique
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000
    s = compare(run).summary
    assert s["live_errors"] == 0 and s["disagreement_rate"] <= 0.10
    assert s["latency_abs_error_p50_s"] < 0.02  # the simulator knows the service times it ran
    assert 0.9 < s["measured_speed"] < 1.2
