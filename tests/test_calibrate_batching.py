"""``qlab calibrate`` against a batching server: the step model, fitted back from the steps an
engine of known coefficients ran.

On the virtual clock (tests/virtual_time.py) the real :func:`live.gate.BatchGate` drives the real
:class:`live.batching.SyntheticBatchEngine`, whose steps take its step model's time (x a gamma draw
of its CV), under calibration's load: the schedule of :func:`live.calibrate.schedule` one at a time
and with 2, 4 and 8 in flight. Its step log (what each step computed, when it began and ended) is
fitted by :func:`live.calibration_fit.fit_steps`, the function the HTTP calibration fits with:
without noise the coefficients come back exactly; with noise each is within a few of its standard
errors, the tolerance the statistics set. Then the calibration JSON's step model is read by
``serve``, ``simulate`` and ``compare --predict``, a broken one is one line and exit 2, and a real
server is calibrated end to end.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from experiments.cli import main
from live.batching import SyntheticBatchEngine
from live.calibrate import CalibrationConfig, schedule
from live.calibration_fit import fit_steps, step_seconds
from live.gate import BatchGate, gate_config
from live.jobs import Job
from qsim import PRESETS, make_trace
from qsim.engines import Batching, StepModel
from qsim.runfile import LoggedStep
from qsim.service import LoadTerms
from virtual_time import on_virtual_clock

#: The engine's truth: 6 ms a step, 40 us a prefill token, 0.5 ms a sequence, 2 us a context token
#: held.
TRUE = StepModel(0.006, 0.00004, 0.0005, 0.000002)
PROMPTS = (16, 256, 768)


def _calibration_steps(
    truth: StepModel, levels=(1, 2, 4, 8), per_size: int = 6, seed: int = 1
) -> list[LoggedStep]:
    """The step log of a batching gate (its own step model the default one: not the engine's) under
    calibration's load: at each level that many workers, each sending its next request as its last
    is answered."""
    engine_model = Batching(max_num_seqs=8, max_num_batched_tokens=512)
    points = schedule(CalibrationConfig("virtual", per_size=per_size), PROMPTS)

    async def go():
        loop = asyncio.get_running_loop()
        engine = SyntheticBatchEngine(truth, seed=seed, clock=loop.time)
        async with BatchGate(
            engine, gate_config(PRESETS["none"], engine=engine_model), clock=loop.time
        ) as gate:

            async def worker(share):
                for tokens, prompt in share:
                    await gate.submit(
                        Job("x" * prompt, tokens, deadline_s=1e6, prompt_tokens=prompt)
                    )

            for level in levels:
                await asyncio.gather(*(worker(points[w::level]) for w in range(level)))
            return list(gate.driver.step_log)

    return [LoggedStep(*row) for row in on_virtual_clock(go)]


def test_the_step_log_says_what_each_step_computed():
    steps = _calibration_steps(TRUE, levels=(1, 4))
    gate = StepModel()  # the gate's own plan: its model's seconds for what each step computed
    assert all(
        s.model_s == pytest.approx(gate.time(s.prefill_tokens, s.sampling, s.context), rel=1e-12)
        for s in steps
    )
    assert all(
        step_seconds(s)
        == pytest.approx(TRUE.time(s.prefill_tokens, s.sampling, s.context), rel=1e-9)
        for s in steps
    )
    # A 768-token prompt in chunks of the step's budget (512 tokens).
    assert max(s.sampling for s in steps) == 4 and max(s.prefill_tokens for s in steps) == 512
    assert {s.sampling for s in steps if s.prefill_tokens == 0} >= {1, 2, 3, 4}


def test_calibrating_a_noiseless_engine_recovers_its_step_model_exactly():
    got = fit_steps(_calibration_steps(TRUE))
    for name in ("b0", "b1", "b2", "b3"):
        assert getattr(got.model, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert got.cv == pytest.approx(0.0, abs=1e-9) and got.r2 == pytest.approx(1.0, abs=1e-12)
    assert got.worst_rel_error < 1e-9 and got.n > 500


def test_calibrating_a_noisy_engine_recovers_its_step_model_within_its_standard_errors():
    cv = 0.25
    got = fit_steps(_calibration_steps(replace(TRUE, cv=cv), seed=4))
    for name, se in zip(("b0", "b1", "b2", "b3"), got.se):
        true = getattr(TRUE, name)
        # Each coefficient within 4 of its standard errors (about 1 in 16,000 by chance), and those
        # errors small beside the coefficient: the calibration's steps tell every term apart.
        assert abs(getattr(got.model, name) - true) < 4 * se, (name, getattr(got.model, name), se)
        assert se < 0.25 * true, (name, se)
    # The CV of a step around the fit: the engine's, within 5 of its standard errors (about cv /
    # sqrt(2 n)).
    assert got.cv == pytest.approx(cv, abs=5 * cv / math.sqrt(2 * got.n))
    assert got.calibrated == replace(got.model, cv=got.cv) and 0.5 < got.r2 < 1


def test_the_calibration_json_carries_the_step_model_and_its_fit(tmp_path):
    from live.calibration_fit import BatchLevel, Calibration, StepCalibration
    from live.calibration_report import describe_terms
    from qsim.service import fit

    steps = _calibration_steps(replace(TRUE, cv=0.1), levels=(1, 4))
    calibrated = StepCalibration(fit_steps(steps), (BatchLevel(1, 42, tuple(steps)),))
    result = Calibration(fit([1, 2, 4], [0.01, 0.02, 0.04]), (), "bytes", steps=calibrated)
    result.save(tmp_path / "cal.json")
    saved = json.loads((tmp_path / "cal.json").read_text())
    assert (
        saved["load"] is None
        and saved["step_fit"]["n"] == len(steps) == saved["step_fit"]["levels"][0]["steps"]
    )
    assert (
        LoadTerms.load(tmp_path / "cal.json").step == calibrated.model == StepModel(**saved["step"])
    )
    assert set(saved["step_fit"]["standard_errors"]) == {"b0", "b1", "b2", "b3"}
    assert describe_terms(result).startswith(
        "step model: "
    ) and f"{len(steps)} steps" in describe_terms(result)
    assert "front_end" not in saved and LoadTerms.load(tmp_path / "cal.json").front_end is None
    # With the engine's own counters and its API process's CPU: the front end, where LoadTerms
    # (so simulate --service-model and the prediction) reads it.
    from live.engine_steps import EnginePhase, EngineStepFit, FrontEndFit
    from qsim.engines import FrontEnd

    front = FrontEndFit(FrontEnd(0.0025, 3e-5, 2.3e-4), 0.002, 0.93, 12)
    phase = EnginePhase(1, 0, 1.0, 100, 200, 100, 100, 0.5, 2, 0.5, 0.05)
    engine = EngineStepFit(calibrated.fit, 0.9, 0.05, (phase,), front)
    replace(result, steps=replace(calibrated, engine=engine)).save(tmp_path / "cal2.json")
    assert LoadTerms.load(tmp_path / "cal2.json").front_end == front.model


def test_a_batching_servers_levels_go_up_to_its_seats():
    assert CalibrationConfig("http://x").load_levels(8, "seats in the batch") == (2, 4, 8)
    with pytest.raises(ValueError, match="exceed the server's 8 seats in the batch"):
        CalibrationConfig("http://x", levels=(16,)).load_levels(8, "seats in the batch")


def test_a_step_log_without_compositions_is_refused():
    # a gate from before compositions were logged
    old = [LoggedStep(0.0, 0.0, 0.01, 0.01, 0.01)] * 10
    with pytest.raises(ValueError, match="at least 4 logged steps"):
        fit_steps(old)


# ---------------------------------------------------------------- the calibration JSON, read by
# serve/simulate/compare

FITTED = StepModel(0.004, 0.00003, 0.0007, 0.000001, cv=0.2)


def _calibration(tmp_path, step) -> str:
    path = tmp_path / "cal.json"
    path.write_text(
        json.dumps(
            {
                "model": {"intercept_s": 0.001, "per_token_s": 0.0085},
                "load": None,
                "step": step,
                "step_fit": {"r2": 0.9, "n": 100},
            }
        )
    )
    return str(path)


def test_serve_and_simulate_take_the_calibrated_step_model_unless_told(tmp_path, capsys):
    from live.serve_options import ServeOptions

    path = _calibration(
        tmp_path, {"b0": 0.004, "b1": 0.00003, "b2": 0.0007, "b3": 0.000001, "cv": 0.2}
    )
    assert LoadTerms.load(path).step == FITTED
    assert ServeOptions(batching=True, service_model=path).engine_model().step == FITTED
    assert ServeOptions(
        batching=True, service_model=path, noise=0.1
    ).engine_model().step == replace(FITTED, cv=0.1)
    told = ServeOptions(batching=True, service_model=path, step="0.01,0,0.001,0").engine_model()
    assert told.step == StepModel(0.01, 0.0, 0.001, 0.0)  # --step given wins
    # engines one at a time take no step model
    assert ServeOptions(service_model=path).engine_model() is None
    common = [
        "simulate",
        "--batching",
        "--service",
        "mix",
        "--seconds",
        "30",
        "--load",
        "0.8",
        "--json",
    ]
    assert main([*common, "--service-model", path]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["step"] == {**FITTED.__dict__}
    assert main([*common, "--service-model", path, "--step", "0.01,0,0.001,0"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["step"]["b0"] == 0.01


@pytest.mark.parametrize(
    "step, says",
    [
        ({"b0": -1.0}, "b0 must be a finite number >= 0"),
        ({"b0": 0.01, "b9": 1}, "a step model is a table of b0, b1, b2, b3, cv"),
        ("fast", "a step model is a table"),
        ({"b0": "x"}, "bad step model"),
    ],
)
@pytest.mark.parametrize(
    "command",
    [
        ["simulate", "--batching", "--service", "mix", "--seconds", "5"],
        ["serve", "--batching", "--port", "0"],
    ],
)
def test_a_broken_step_section_is_one_line_and_exit_2(tmp_path, capsys, step, says, command):
    path = _calibration(tmp_path, step)
    assert main([*command, "--service-model", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "bad calibrated step model" in err[0], err


def _batching_run(step: StepModel):
    """A live-like run file whose server was a batching gate planning with ``step``."""
    from test_compare import live_like_run

    run = live_like_run(make_trace("poisson", load=0.8, seconds=30, seed=2), "none")
    config = json.loads(run["server_config"].iloc[0])
    config["engine"] = {
        "kind": "batching",
        "step": step.__dict__,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
    }
    config["stall"] = None  # a batching gate has no stall rule
    return run.assign(server_config=pd.array([json.dumps(config)] * len(run), dtype="string"))


def test_the_prediction_of_a_batching_run_draws_other_steps_for_each_seed(tmp_path):
    from analysis.prediction import calibrated_setup, predict

    noisy = StepModel(0.01, 0.0001, 0.0002, 0.000001, cv=0.5)
    run = _batching_run(noisy)
    got = predict(run, seeds=4)
    assert got.noise_cv == 0.5 and "step model" in got.noise_source
    # Each seed its own step draws (before, every seed drew the server's seed's: one run four times
    # over).
    assert got.per_seed["latency_p99_s"].nunique() == 4
    # the same seeds, the same prediction
    assert predict(run, seeds=4).per_seed.equals(got.per_seed)
    exact = predict(run, seeds=3, noise_cv=0.0)
    assert exact.per_seed["latency_p99_s"].nunique() == 1  # no step noise: nothing to draw
    # The calibration's step model in place of the one the gate planned with (--service-model).
    terms = LoadTerms.load(_calibration(tmp_path, {**FITTED.__dict__}))
    assert calibrated_setup(run, terms).engine.step == FITTED
    assert calibrated_setup(run).engine.step == noisy


def test_the_prediction_of_a_batching_run_runs_its_steps_at_the_probed_speed():
    from analysis.prediction import predict

    run = _batching_run(TRUE)
    twice = StepModel(*(2 * b for b in (TRUE.b0, TRUE.b1, TRUE.b2, TRUE.b3)))
    got = predict(run.assign(speed_before=2.0), seeds=2, noise_cv=0.0)  # a probe said: half speed
    assert got.speed == 2.0 and "probed" in got.speed_source
    # Each step the model's time x 2: the prediction of a server whose steps take twice the model's.
    assert got.per_seed.equals(predict(_batching_run(twice), seeds=2, noise_cv=0.0).per_seed)
    at_one = predict(run, seeds=2, noise_cv=0.0).table
    assert (
        got.table.loc["latency_p50_s", "sim_mean"] > 1.5 * at_one.loc["latency_p50_s", "sim_mean"]
    )


# ---------------------------------------------------------------- end to end, over HTTP


@pytest.mark.slow  # two server processes and a calibration: several seconds
def test_qlab_calibrate_fits_a_batching_servers_step_model_and_serve_plans_with_it(
    tmp_path, capsys
):
    import httpx

    from live.procs import serving
    from live.serve_options import ServeOptions

    truth = "0.004,0.00002,0.0005,0.000001"
    options = ServeOptions(
        policy="none", batching=True, step=truth, max_num_seqs=4, max_num_batched_tokens=512, port=0
    )
    out = tmp_path / "cal.json"
    with serving([options], tmp_path, 60) as (server,):
        assert (
            main(
                [
                    "calibrate",
                    "--url",
                    server.url,
                    "--rounds",
                    "1",
                    "--per-size",
                    "2",
                    "--prompt-tokens",
                    "16,200",
                    "--load-per-size",
                    "2",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    printed = capsys.readouterr().out
    assert "4 in flight:" in printed and "step model:" in printed and "r^2" in printed
    saved = json.loads(out.read_text())
    fit = saved["step_fit"]
    assert saved["load"] is None and set(saved["step"]) == {"b0", "b1", "b2", "b3", "cv"}
    assert [lv["level"] for lv in fit["levels"]] == [1, 2, 4] and fit["levels"][2][
        "sampling_max"
    ] == 4
    assert fit["n"] == sum(lv["steps"] for lv in fit["levels"]) > 50 and np.isfinite(fit["r2"])
    # The calibrated server plans with the fitted model (its server config: what a run file
    # records).
    with serving([replace(options, step=None, service_model=str(out))], tmp_path, 60) as (server,):
        stats = httpx.get(f"{server.url}/stats").json()
    assert stats["server_config"]["engine"]["step"] == saved["step"]


def test_the_engine_phases_alternate_short_and_long_outputs():
    # With every size in every phase prompt tokens a step stay proportional to sequences a step:
    # the phases take the shorter and the longer half of the sizes by turns.
    from live.calibrate import SIZES, output_mixes

    short, long = output_mixes(SIZES)
    assert short == (1, 2, 4) and long == (8, 16, 32, 64)
    assert output_mixes((64, 1, 16)) == ((1, 16, 64), (1, 16, 64))  # too few to split
    assert all(CalibrationConfig("http://x", sizes=m) for m in output_mixes(SIZES))
