"""``qlab calibrate`` under load: the concurrency term and the noise, fitted back from engines whose
times are known.

The fits run on drawn points and on a stubbed server (httpx's MockTransport) whose clock is virtual:
the requests in flight together start at one virtual instant and take the model's time x (1 + c
(busy - 1)) x a lognormal draw, so nothing depends on how fast this machine is. The calibration JSON
carries the terms, an older one without them still reads, and ``serve``, ``simulate`` and ``compare
--predict`` take them up.
"""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pandas as pd
import pytest

from experiments.cli import main
from live import calibrate as cal
from live.calibrate import CalibrationConfig, calibrate
from live.calibration_fit import busy_at_start, fit_load
from qsim import ServiceModel, make_trace
from qsim.engines import OneAtATime
from qsim.service import LoadTerms
from qsim.workload import lognormal_noise

MODEL = ServiceModel(intercept_s=0.002, per_token_s=0.01)


def test_busy_at_start_counts_those_holding_an_engine_itself_included():
    started = np.array([0.0, 0.0, 0.5, 2.0, 2.0])
    returned = np.array([1.0, 2.0, 1.5, 3.0, 2.5])
    # At 0 both first ones start; at 0.5 both still run; at 2.0 the second has just returned (not
    # holding).
    assert busy_at_start(started, returned).tolist() == [2, 2, 3, 2, 2]


def _drawn(concurrency: float, cv: float, n: int = 4000, seed: int = 3):
    rng = np.random.default_rng(seed)
    tokens = rng.choice([1, 2, 4, 8, 16, 32, 64], n)
    busy = rng.integers(1, 5, n)
    seconds = MODEL.estimate(tokens) * (1 + concurrency * (busy - 1)) * lognormal_noise(rng, n, cv)
    return tokens, np.zeros(n, dtype=int), seconds, busy


def test_the_fit_recovers_a_known_concurrency_term_and_noise():
    got = fit_load(MODEL, *_drawn(0.3, 0.2))
    assert got.concurrency == pytest.approx(0.3, abs=0.02)
    assert got.speed == pytest.approx(1.0, abs=0.02)
    assert got.noise_cv_one == pytest.approx(0.2, abs=0.02) and got.noise_cv_load == pytest.approx(
        0.2, abs=0.02
    )
    assert got.noise_cv == got.noise_cv_load and sum(got.busy_counts.values()) == got.n == 4000
    # Engines that do not slow each other: no term, and none below 0 (bounded least squares).
    assert fit_load(MODEL, *_drawn(0.0, 0.2)).concurrency == pytest.approx(0.0, abs=0.01)
    exact = fit_load(MODEL, *_drawn(0.5, 0.0))
    assert exact.concurrency == pytest.approx(
        0.5, rel=1e-9
    ) and exact.noise_cv_load == pytest.approx(0.0, abs=1e-9)


def test_one_at_a_time_alone_fits_no_concurrency_term():
    tokens, prompts, seconds, _ = _drawn(0.0, 0.1)
    got = fit_load(MODEL, tokens, prompts, seconds, np.ones(len(tokens), dtype=int))
    assert got.concurrency is None and np.isnan(got.noise_cv_load)
    assert got.noise_cv == got.noise_cv_one == pytest.approx(0.1, abs=0.01)
    with pytest.raises(ValueError, match="at least 2 points"):
        fit_load(MODEL, [4], [0], [0.05], [1])


class VirtualServer:
    """A qlab gate's answers to calibration, from engines whose times are known, on a virtual clock.

    One at a time a request starts when the last one ended; under load the workers go in lockstep (a
    barrier of the level's size), each step's requests starting together when the previous step has
    ended."""

    def __init__(self, engines: int, concurrency: float, cv: float, seed: int = 5) -> None:
        self.engines, self.concurrency, self.cv = engines, concurrency, cv
        self.rng = np.random.default_rng(seed)
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(engines)
        self.clock = 0.0
        self.step_end = 0.0

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/stats":
            return httpx.Response(200, json={"engines": self.engines, "policy": "none"})
        if request.url.path != "/v1/generate":
            return httpx.Response(404, json={})
        tokens = json.loads(request.content)["max_new_tokens"]
        under_load = threading.current_thread().name.startswith("qlab-calibrate")
        busy = self.engines if under_load else 1
        if under_load:
            # every worker's k-th request is in flight with the others'
            self.barrier.wait(timeout=30)
        with self.lock:
            start = self.clock
            seconds = float(
                MODEL.estimate(tokens)
                * (1 + self.concurrency * (busy - 1))
                * lognormal_noise(self.rng, 1, self.cv)[0]
            )
            self.step_end = max(self.step_end, start + seconds)
        if under_load:
            self.barrier.wait(timeout=30)
        with self.lock:
            self.clock = self.step_end
        timings = {
            "queue_s": 0.0,
            "engine_s": seconds,
            "total_s": seconds,
            "est_service_s": seconds,
            "started_at": start,
            "returned_at": start + seconds,
        }
        return httpx.Response(
            200,
            json={
                "text": "x" * tokens,
                "tokens": tokens,
                "outcome": "good",
                "engine": 0,
                "timings": timings,
                "admission": {},
            },
        )


@pytest.fixture
def virtual(monkeypatch):
    def serve(server: VirtualServer) -> None:
        real = httpx.Client
        monkeypatch.setattr(
            cal.httpx,
            "Client",
            lambda **kw: real(transport=httpx.MockTransport(server.handler), **kw),
        )

    return serve


def test_calibrate_measures_under_load_and_writes_the_terms(virtual, tmp_path):
    virtual(VirtualServer(engines=2, concurrency=0.4, cv=0.15))
    result = calibrate(
        CalibrationConfig(
            "http://virtual", rounds=1, per_size=40, prompt_tokens=(16,), load_per_size=40
        )
    )
    assert result.overall.model.per_token_s == pytest.approx(MODEL.per_token_s, rel=0.1)
    (level,) = result.levels
    assert level.level == 2 and set(level.busy) == {2} and len(level.busy) == 40 * 7
    assert result.load.concurrency == pytest.approx(0.4, abs=0.06)
    assert result.load.noise_cv_load == pytest.approx(0.15, abs=0.03)
    path = tmp_path / "cal.json"
    result.save(path)
    saved = json.loads(path.read_text())
    assert saved["load"]["levels"][0]["busy"] == list(level.busy)
    assert LoadTerms.load(path) == LoadTerms(result.load.concurrency, result.load.noise_cv)
    assert ServiceModel.load(path) == result.overall.model


def test_one_engine_has_no_load_phase(virtual):
    virtual(VirtualServer(engines=1, concurrency=0.4, cv=0.1))
    result = calibrate(
        CalibrationConfig("http://virtual", rounds=1, per_size=4, prompt_tokens=(16,))
    )
    assert result.levels == () and result.load.concurrency is None
    assert result.load.noise_cv == result.load.noise_cv_one


def test_calibrate_json_is_one_document_agreeing_with_the_file(virtual, tmp_path, capsys):
    virtual(VirtualServer(engines=2, concurrency=0.4, cv=0.1))
    out = tmp_path / "cal.json"
    assert (
        main(
            [
                "calibrate",
                "--url",
                "http://virtual",
                "--rounds",
                "1",
                "--per-size",
                "4",
                "--prompt-tokens",
                "16",
                "--load-per-size",
                "4",
                "--out",
                str(out),
                "--json",
            ]
        )
        == 0
    )
    said = capsys.readouterr()
    doc = json.loads(said.out)  # the whole of stdout; each step's line went to stderr
    assert "round 1" in said.err and "2 in flight" in said.err
    saved = json.loads(out.read_text())
    assert doc["out"] == str(out) and doc["applied"] is None and doc["url"] == "http://virtual"
    for key in ("model", "median_rel_error", "worst_rel_error", "n"):
        assert doc[key] == saved[key]
    assert doc["prompt_lengths"] == [16] and len(doc["rounds"]) == len(saved["rounds"]) == 1
    assert (
        doc["rounds"][0]["model"] == saved["rounds"][0]["model"]
        and "engine_s" not in doc["rounds"][0]
    )
    assert doc["load"]["concurrency"] == saved["load"]["concurrency"]
    assert doc["load"]["levels"][0]["n"] == saved["load"]["levels"][0]["n"]
    assert "busy" not in doc["load"]["levels"][0]
    assert (
        main(
            [
                "calibrate",
                "--url",
                "http://virtual",
                "--rounds",
                "1",
                "--per-size",
                "4",
                "--prompt-tokens",
                "16",
                "--in-flight",
                "none",
                "--out",
                str(out),
                "--json",
                "--quiet",
            ]
        )
        == 0
    )
    said = capsys.readouterr()
    assert said.err == "" and json.loads(said.out)["load"]["levels"] == []


def test_levels_default_to_doublings_up_to_the_engines_and_refuse_more():
    cfg = CalibrationConfig("http://x")
    assert [cfg.load_levels(k) for k in (1, 2, 3, 4, 6)] == [(), (2,), (2, 3), (2, 4), (2, 4, 6)]
    assert CalibrationConfig("http://x", levels=(4, 2)).load_levels(4) == (2, 4)
    with pytest.raises(ValueError, match="exceed the server's 2 engine"):
        CalibrationConfig("http://x", levels=(4,)).load_levels(2)
    with pytest.raises(ValueError, match="must be >= 2"):
        CalibrationConfig("http://x", levels=(1,))


def test_an_older_calibration_without_the_terms_still_reads(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"model": {"intercept_s": 0.001, "per_token_s": 0.02}, "n": 3}))
    assert ServiceModel.load(old) == ServiceModel(0.001, 0.02)
    assert LoadTerms.load(old) == LoadTerms() and LoadTerms.load(None) == LoadTerms()
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {"model": {"intercept_s": 0.001, "per_token_s": 0.02}, "load": {"concurrency": -1}}
        )
    )
    with pytest.raises(ValueError, match="concurrency must be a finite number >= 0"):
        LoadTerms.load(bad)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--in-flight", "1"], "must be >= 2"),
        (["--in-flight", "2,x"], "whole numbers separated by commas"),
        (["--load-per-size", "0"], "load-per-size"),
    ],
)
def test_bad_calibrate_options_are_one_line_and_exit_2(flags, message, capsys):
    assert main(["calibrate", "--url", "http://127.0.0.1:9", *flags, "--out", "m.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)


def _calibration(tmp_path, concurrency: float, cv: float):
    path = tmp_path / "cal.json"
    path.write_text(
        json.dumps(
            {
                "model": {"intercept_s": 0.001, "per_token_s": 0.0085},
                "load": {"concurrency": concurrency, "noise_cv": cv},
            }
        )
    )
    return path


def test_simulate_takes_the_calibrated_terms_unless_told(tmp_path, capsys):
    path = _calibration(tmp_path, 0.25, 0.3)
    assert (
        main(
            [
                "simulate",
                "--policy",
                "none",
                "--engines",
                "2",
                "--seconds",
                "20",
                "--service-model",
                str(path),
            ]
        )
        == 0
    )
    assert "(concurrency 0.25)" in capsys.readouterr().out
    assert (
        main(
            [
                "simulate",
                "--policy",
                "none",
                "--engines",
                "2",
                "--seconds",
                "20",
                "--service-model",
                str(path),
                "--concurrency",
                "0",
            ]
        )
        == 0
    )
    assert "concurrency" not in capsys.readouterr().out.splitlines()[0]


def test_the_prediction_takes_the_calibrated_noise_and_concurrency(tmp_path):
    from analysis.prediction import DEFAULT_NOISE_CV, predict, prediction_noise
    from qsim.runfile import ENGINE_INFO
    from test_compare import live_like_run

    run = live_like_run(
        make_trace("poisson", load=1.5, seconds=30, seed=2, noise_cv=0.3), "predictive"
    )
    run[ENGINE_INFO] = pd.array(
        [json.dumps({"engine": "gpt2", "model": "tiny"})] * len(run), dtype="string"
    )
    assert prediction_noise(run)[0] == DEFAULT_NOISE_CV
    terms = LoadTerms.load(_calibration(tmp_path, 0.5, 0.3))
    given = predict(run, seeds=2, terms=terms)
    assert (given.noise_cv, given.concurrency) == (
        0.3,
        0.5,
    ) and "calibrated CV" in given.noise_source
    # A run file whose server loaded the terms says them itself (its server config's engines).
    config = json.loads(run["server_config"].iloc[0])
    config["engine"] = {"kind": "one-at-a-time", "engines": 1, "concurrency": 0.0, "cv": 0.3}
    said = run.assign(server_config=pd.array([json.dumps(config)] * len(run), dtype="string"))
    assert prediction_noise(said)[0] == 0.3
    # Engines that slow each other serve less in time than the same engines that do not.
    config["engine"] = {"kind": "one-at-a-time", "engines": 2, "concurrency": 0.0, "cv": 0.0}
    two = run.assign(server_config=pd.array([json.dumps(config)] * len(run), dtype="string"))
    apart = predict(two, seeds=2, noise_cv=0.0)
    shared = predict(two, seeds=2, noise_cv=0.0, terms=LoadTerms(1.0, 0.0))
    assert (
        shared.table.loc["latency_p99_s", "sim_mean"] > apart.table.loc["latency_p99_s", "sim_mean"]
    )
    assert OneAtATime(2, 1.0).slowdown(2) == 2.0


def test_the_per_request_replay_of_engines_that_slow_each_other_does_not_slow_them_twice():
    """A gate with a concurrency term slows its estimates by the engines busy; a run's held time
    already has the slowdown in it, so the replay takes it as it is and agrees request by
    request."""
    from analysis.compare import compare
    from test_compare import assert_no_disagreement, live_like_run

    trace = make_trace("poisson", load=1.2, seconds=30, seed=4, engines=2, noise_cv=0.2)
    run = live_like_run(trace, "predictive", OneAtATime(2, 0.5))
    assert json.loads(run["server_config"].iloc[0])["engine"]["concurrency"] == 0.5
    # A live engine reports the time it ran, slowdown included (the simulator's engines report that
    # too).
    ran = run["engine_returned_s"] - run["engine_started_s"]
    assert (ran.dropna() > run.loc[ran.notna(), "engine_s"] + 1e-9).any()
    run["engine_s"] = run["engine_reported_s"] = ran.where(ran.notna(), run["engine_s"])
    assert_no_disagreement(compare(run))


@pytest.mark.slow
def test_a_real_synthetic_server_calibrates_to_its_noise_and_serves_the_terms(tmp_path):
    """Two synthetic engines (sleeping threads, which do not slow each other) at --noise 0.3: the CV
    comes back near 0.3 and the concurrency term near 0; a server given the file runs its engines
    with them."""
    from live.procs import serving
    from live.serve_options import ServeOptions

    with serving([ServeOptions(policy="none", engines=2, noise=0.3, seed=3)], tmp_path, 60) as (
        server,
    ):
        result = calibrate(
            CalibrationConfig(
                server.url,
                rounds=1,
                per_size=6,
                sizes=(8, 16, 32, 64),
                prompt_tokens=(16,),
                load_per_size=12,
            )
        )
    assert [lv.level for lv in result.levels] == [2] and max(result.levels[0].busy) == 2
    # Sleeps overrun on a busy machine, a little more with two at once: a bound, not an equality.
    assert 0 <= result.load.concurrency < 0.15
    assert result.load.noise_cv == pytest.approx(0.3, abs=0.12)
    path = tmp_path / "cal.json"
    result.save(path)
    with serving(
        [ServeOptions(policy="predictive", engines=2, service_model=str(path))], tmp_path, 60
    ) as (server,):
        engine = httpx.get(f"{server.url}/stats", timeout=10).json()["server_config"]["engine"]
    assert engine == {
        "kind": "one-at-a-time",
        "engines": 2,
        "concurrency": result.load.concurrency,
        "cv": result.load.noise_cv,
    }


def test_compare_takes_a_calibration_for_the_prediction_only(tmp_path, capsys):
    from inputs.atomic import write_parquet
    from test_compare import live_like_run

    run = tmp_path / "run.parquet"
    write_parquet(
        live_like_run(make_trace("poisson", load=1.2, seconds=10, seed=2), "predictive"), run
    )
    path = _calibration(tmp_path, 0.5, 0.25)
    assert main(["compare", str(run), "--service-model", str(path)]) == 2
    assert "--service-model is --predict's" in capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        main(["compare", str(run), "--predict", "--seeds", "2", "--service-model", str(path)]) == 0
    )
    out = capsys.readouterr().out
    assert (
        "noise CV 0.25 (the calibrated CV under load" in out
        and ("x (1 + 0.5 x (busy engines - 1))") in out
    )


def test_a_request_on_a_connection_the_server_closed_idle_goes_again_once():
    """A pooled connection the server closed for sitting idle (keep-alive) as a request went out on
    it: nothing ran there, so calibrate sends it again; a second such failure is not hidden."""
    answer = {
        "text": "x",
        "tokens": 1,
        "outcome": "good",
        "engine": 0,
        "timings": {
            "queue_s": 0.0,
            "engine_s": 0.01,
            "total_s": 0.01,
            "est_service_s": 0.01,
            "started_at": 0.0,
            "returned_at": 0.01,
        },
        "admission": {},
    }
    for drops, raises in ((1, False), (2, True)):
        calls = []

        def handler(request: httpx.Request, drops=drops, calls=calls) -> httpx.Response:
            calls.append(request)
            if len(calls) <= drops:
                raise httpx.RemoteProtocolError(
                    "Server disconnected without sending a response.", request=request
                )
            return httpx.Response(200, json=answer)

        with httpx.Client(base_url="http://gate", transport=httpx.MockTransport(handler)) as http:
            if raises:
                with pytest.raises(httpx.RemoteProtocolError):
                    cal._timings(http, {"prompt": "hi", "max_new_tokens": 1})
            else:
                assert cal._timings(http, {"prompt": "hi", "max_new_tokens": 1}).engine_s == 0.01
        assert len(calls) == 2


def test_calibrate_counts_its_steps_on_a_terminal_only(virtual, tmp_path, capsys, monkeypatch):
    import sys

    virtual(VirtualServer(engines=2, concurrency=0.4, cv=0.1))
    argv = [
        "calibrate",
        "--url",
        "http://virtual",
        "--rounds",
        "1",
        "--per-size",
        "4",
        "--prompt-tokens",
        "16",
        "--load-per-size",
        "4",
        "--out",
        str(tmp_path / "cal.json"),
    ]
    assert main(argv) == 0
    assert capsys.readouterr().err == ""  # stderr no terminal: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(argv) == 0
    said = capsys.readouterr()
    assert "calibrate" in said.err and "step" in said.err and "round 1" in said.out
    for flag in ("--quiet", "--json"):
        assert main([*argv, flag]) == 0
        assert "step/s" not in capsys.readouterr().err
