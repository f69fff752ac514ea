"""What the model-only prediction (``qlab compare --predict``) reads of the server from the run file
alone: the engine's noise and speed settings (column engine_info, from /stats), a speed probe
(speed_before), and defaults, said so, for a run file that records none of them; and the replay's
effective load (total engine time over total calibrated time)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient

from analysis.prediction import (
    DEFAULT_NOISE_CV,
    predict,
    prediction_noise,
    prediction_speed,
)
from analysis.replay_inputs import engine_time_ratio, measured_speed
from live.engine import SyntheticEngine
from live.gate import Gate, gate_config
from live.http_api import create_app
from live.rows import server_info
from qsim import make_trace, preset
from qsim.runfile import ENGINE_INFO, engine_info
from test_compare import live_like_run


def _with_engine(
    run: pd.DataFrame, info: dict | None, schedule: dict | None = None
) -> pd.DataFrame:
    """The run as a run file of a server whose /stats described its engine as ``info``."""
    run = run.copy()
    run[ENGINE_INFO] = pd.array(
        [None if info is None else json.dumps(info)] * len(run), dtype="string"
    )
    if schedule is not None:
        run["speed_schedule"] = pd.array([json.dumps(schedule)] * len(run), dtype="string")
    return run


@pytest.fixture(scope="module")
def run():
    return live_like_run(
        make_trace("poisson", load=1.5, seconds=30, seed=2, noise_cv=0.3), "predictive"
    )


def test_the_run_file_records_the_engine_as_gate_describes_it():
    engine = SyntheticEngine(speed=1.3, noise_cv=0.3, seed=2)
    gate = Gate([engine], gate_config(preset("predictive")))
    with TestClient(create_app(gate)) as c:
        info = server_info(c.get("/stats").json())
    columns = pd.DataFrame(info.columns(3))
    recorded = engine_info(columns)
    assert (
        recorded["engine"] == "synthetic"
        and recorded["noise_cv"] == 0.3
        and recorded["speed"] == 1.3
    )
    assert json.loads(columns[ENGINE_INFO].iloc[0]) == recorded


def test_the_noise_is_the_servers_setting_where_the_run_file_says_it(run):
    # a run file that does not record its engine: the default, said so
    assert engine_info(run) is None
    cv, source = prediction_noise(run)
    assert cv == DEFAULT_NOISE_CV and "does not record its engine" in source
    cv, source = prediction_noise(_with_engine(run, {"engine": "synthetic", "noise_cv": 0.3}))
    assert cv == 0.3 and "noise setting" in source
    cv, source = prediction_noise(_with_engine(run, {"engine": "gpt2", "model": "tiny"}))
    assert cv == DEFAULT_NOISE_CV and "gpt2 engine does not say its noise" in source
    # The prediction draws its times with it, and a CV given by hand still wins.
    noisy = predict(_with_engine(run, {"engine": "synthetic", "noise_cv": 0.3}), seeds=2)
    assert (noisy.noise_cv, noisy.noise_source) == (
        0.3,
        "the synthetic engine's noise setting (engine_info)",
    )
    given = predict(
        _with_engine(run, {"engine": "synthetic", "noise_cv": 0.3}), seeds=2, noise_cv=0.0
    )
    assert (given.noise_cv, given.noise_source) == (0.0, "given (--noise-cv)")
    assert not noisy.per_seed.equals(given.per_seed)


def test_the_speed_is_the_synthetic_engines_setting_else_a_probe_else_the_trackers(run):
    speed, source = prediction_speed(run)
    assert speed == 1.0 and "no probe" in source
    probed = run.assign(speed_before=1.25)
    assert prediction_speed(probed) == (1.25, "probed before the run (speed_before)")
    # The synthetic engine's own setting is exact (a probe of a few requests measures it through
    # their noise).
    synthetic = _with_engine(
        probed, {"engine": "synthetic", "noise_cv": 0.3}, {"base": 1.5, "steps": []}
    )
    speed, source = prediction_speed(synthetic)
    assert speed == 1.5 and "speed setting" in source
    # Another engine's speed is the probe's.
    assert (
        prediction_speed(_with_engine(probed, {"engine": "gpt2"}, {"base": 1.5, "steps": []}))[0]
        == 1.25
    )


def test_the_effective_load_is_total_engine_time_over_total_calibrated_time(run):
    served = run["outcome"].isin(["good", "late"]) & run["engine_s"].gt(0)
    assert served.sum() > 10
    ratio = engine_time_ratio(run)
    assert ratio == pytest.approx(
        run.loc[served, "engine_s"].sum() / run.loc[served, "calibrated_est_s"].sum()
    )
    # Lognormal noise of CV 0.3 (mean 1): the total ratio is near 1, the median one's below it
    # (exp(-s^2/2)).
    assert measured_speed(run) < ratio
    # One long request twice as slow as calibrated weighs by its length in the total, as one in the
    # median.
    slow = run.copy()
    longest = slow.loc[served, "calibrated_est_s"].idxmax()
    slow.loc[longest, "engine_s"] = 10 * slow.loc[longest, "calibrated_est_s"]
    assert engine_time_ratio(slow) > ratio + 0.01 and measured_speed(slow) == pytest.approx(
        measured_speed(run), rel=0.05
    )
    nothing = run.assign(outcome="rejected")
    assert np.isnan(engine_time_ratio(nothing)) and np.isnan(measured_speed(nothing))


@pytest.mark.slow
def test_a_replayed_window_of_a_trace_file_is_predicted_with_nothing_passed_by_hand(
    tmp_path, capsys
):
    # Through a real `qlab serve --noise 0.3 --speed 1.2`: qlab replay takes 4 s of a trace file at
    # nominal load 1.5 and probes the speed; qlab compare --predict then reads the noise and the
    # speed from the run file.
    from experiments.cli import main
    from live.procs import serving
    from live.serve_options import ServeOptions

    trace = make_trace("poisson", load=0.6, seconds=20, seed=3)
    trace.save(tmp_path / "trace.csv")
    run_path = tmp_path / "run.parquet"
    with serving(
        [ServeOptions(policy="predictive", noise=0.3, speed=1.2)], tmp_path / "logs", 60
    ) as (server,):
        assert (
            main(
                [
                    "replay",
                    "--url",
                    server.url,
                    "--trace",
                    str(tmp_path / "trace.csv"),
                    "--start",
                    "5",
                    "--seconds",
                    "4",
                    "--nominal-load",
                    "1.5",
                    "--probe",
                    "3",
                    "--out",
                    str(run_path),
                ]
            )
            == 0
        )
    out = capsys.readouterr().out
    inside = int(((trace.arrival_s >= 5) & (trace.arrival_s < 9)).sum())
    assert (
        f"replaying {inside} requests" in out
        and ("nominal load 1.5 x engine time / calibrated time") in out
    )
    assert "speed probe (3 requests, one at a time)" in out
    run = pd.read_parquet(run_path)
    assert len(run) == inside and np.isfinite(run["speed_before"]).all()
    assert engine_info(run)["noise_cv"] == 0.3
    assert main(["compare", str(run_path), "--predict", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "at speed 1.200 (the synthetic engine's speed setting" in out
    assert "noise CV 0.3 (the synthetic engine's noise setting (engine_info))" in out
