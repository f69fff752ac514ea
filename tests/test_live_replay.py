"""The load side of the live harness against real `qlab serve` subprocesses (synthetic engine,
loopback).

Synthetic service time is the reference line (1 ms + 8.5 ms/token) times --speed.
"""

import json
import re

import numpy as np
import pandas as pd
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from experiments.cli import main  # noqa: E402
from experiments import live_runner as runner  # noqa: E402
from live import live_config  # noqa: E402
from live.calibrate import CalibrationConfig, calibrate, probe  # noqa: E402
from live.loadgen import ReplayConfig, replay  # noqa: E402
from live.rows import Exchange, classify  # noqa: E402
from analysis.replay_inputs import run_setup  # noqa: E402
from live.procs import serving  # noqa: E402
from live.serve_options import ServeOptions  # noqa: E402
from qsim import ServiceModel, build_trace, from_arrays, make_trace, records  # noqa: E402


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    with serving([ServeOptions(policy="bounded")], tmp_path_factory.mktemp("logs"), 60) as (
        server,
    ):
        yield server


def poisson_and_burst(seconds=3.0, load=1.5, burst=10, burst_at=1.5, seed=2):
    """A short Poisson trace with a burst of ``burst`` requests at ``burst_at`` merged in."""
    base = make_trace("poisson", load=load, seconds=seconds, seed=seed)
    arrival = np.concatenate([base.arrival_s, np.full(burst, burst_at)])
    tokens = np.concatenate([base.max_new_tokens, np.resize([4, 16, 64], burst)])
    order = np.argsort(arrival, kind="stable")
    return from_arrays(arrival[order], tokens[order], name="poisson+burst")


def stats(url):
    return httpx.get(f"{url}/stats").json()


@pytest.mark.slow
def test_every_request_ends_in_exactly_one_row(bounded, tmp_path):
    trace = poisson_and_burst()
    before = stats(bounded.url)["counts"]
    out = tmp_path / "run.parquet"
    frame = replay(trace, ReplayConfig(bounded.url))
    frame.to_parquet(out, index=False)
    rows = records.validate(pd.read_parquet(out))
    after = stats(bounded.url)["counts"]
    assert len(rows) == len(trace) and list(rows["request_id"]) == list(range(len(trace)))
    assert set(rows["outcome"]) <= {"good", "late", "rejected"}, rows["error"].dropna().tolist()
    assert (rows["outcome"] == "rejected").any()  # the burst overflows a bound of 8
    # The server counted every request exactly once, as the rows do.
    for outcome in ("rejected", "error"):
        assert after[outcome] - before[outcome] == (rows["outcome"] == outcome).sum()
    assert (
        after["good"] + after["late"] - before["good"] - before["late"]
        == rows["outcome"].isin(["good", "late"]).sum()
    )
    refused = rows[rows["outcome"] == "rejected"]
    assert (refused["http_status"] == 503).all() and (refused["retry_after_s"] >= 1).all()
    assert set(refused["reason"]) == {"queue_full"} and refused["start_s"].isna().all()
    answered = rows[rows["outcome"].isin(["good", "late"])]
    assert (answered["http_status"] == 200).all() and (answered["true_service_s"] > 0).all()
    assert (answered["tokens"] == answered["max_new_tokens"]).all()
    # Open loop: each left at (or just after) its time; arrival_s is the actual send time.
    assert (rows["send_lateness_s"] >= 0).all() and (rows["arrival_s"] == rows["sent_s"]).all()
    assert rows["send_lateness_s"].median() < 0.005
    assert set(rows["policy"]) == {"bounded"} and run_setup(rows).policy.max_queue == 8


def test_classify_maps_every_answer_to_one_outcome():
    # An answer must be the contract's whole answer (live.contract.GenerateResponse): a partial one
    # is an error.
    timings = {
        "queue_s": 0,
        "engine_s": 0.03,
        "total_s": 0.04,
        "est_service_s": 0.035,
        "started_at": 1.0,
        "returned_at": 1.03,
    }
    ok = {
        "text": "",
        "tokens": 4,
        "outcome": "good",
        "engine": 0,
        "timings": timings,
        "admission": {},
    }
    over = {
        "error": {"type": "overloaded", "reason": "queue_full", "numbers": {}, "retry_after_s": 2}
    }
    gone = {"error": {"type": "deadline_exceeded", "reason": "cannot_finish", "numbers": {}}}
    bad = {
        "error": {
            "type": "invalid_request",
            "reason": "invalid_field",
            "message": "max_new_tokens: too big",
        }
    }
    assert classify(Exchange(0, 0, 1.5, 200, ok), 2.0) == ("good", None, None)
    assert classify(Exchange(0, 0, 2.5, 200, ok), 2.0) == ("late", None, None)
    assert classify(Exchange(0, 0, 0.1, 503, over), 2.0) == ("rejected", "queue_full", None)
    assert classify(Exchange(0, 0, 0.1, 503, gone), 2.0) == ("expired", "cannot_finish", None)
    outcome, _, error = classify(Exchange(0, 0, 0.1, 422, bad), 2.0)
    assert outcome == "error" and "422" in error and "too big" in error
    assert classify(Exchange(0, 0, 0.1, error="ConnectError: refused"), 2.0)[0] == "error"
    # a 200 without a JSON answer
    assert classify(Exchange(0, 0, 0.1, 200, None), 2.0)[0] == "error"
    partial = {
        "text": "",
        "tokens": 4,
        "timings": {"queue_s": 0, "engine_s": 0.03, "total_s": 0.04},
    }
    # not the contract's answer
    assert classify(Exchange(0, 0, 0.1, 200, partial), 2.0)[0] == "error"


@pytest.mark.slow
def test_calibrate_recovers_the_synthetic_service_model(tmp_path):
    with serving([ServeOptions(policy="none", speed=0.5)], tmp_path, 60) as (server,):
        result = calibrate(CalibrationConfig(server.url, rounds=1, per_size=2))
        speed = probe(server.url, ServiceModel(), requests=3, max_new_tokens=16)
    truth = ServiceModel(0.0005, 0.00425)  # the reference line at speed 0.5
    fitted = result.overall.model
    assert fitted.per_token_s == pytest.approx(truth.per_token_s, rel=0.03)
    sizes = np.array([4, 16, 64])
    np.testing.assert_allclose(fitted.estimate(sizes), truth.estimate(sizes), rtol=0.05)
    assert result.overall.median_rel_error < 0.05 and len(result.rounds) == 1
    assert speed == pytest.approx(0.5, rel=0.05)
    result.save(tmp_path / "model.json")
    assert ServiceModel.load(tmp_path / "model.json") == fitted
    saved = json.loads((tmp_path / "model.json").read_text())
    assert {"model", "median_rel_error", "worst_rel_error", "rounds"} <= set(saved)


@pytest.mark.slow
def test_replay_command_writes_rows_and_says_so(bounded, tmp_path, capsys):
    out = tmp_path / "burst.parquet"
    assert main(["replay", "--url", bounded.url, "--arrivals", "burst:12", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "send lateness" in text and "wrote 12 rows" in text
    rows = records.validate(pd.read_parquet(out))
    assert (rows["outcome"] == "rejected").sum() == 12 - 9  # 1 in service + 8 waiting


def test_replay_command_refuses_bad_input(tmp_path, capsys):
    assert (
        main(["replay", "--url", "ftp://x", "--out", str(tmp_path / "x.parquet"), "--engines", "1"])
        == 2
    )
    assert "url must start with http" in capsys.readouterr().err
    # Checked as the command line is read, before any server is asked anything (nothing listens on
    # port 9).
    for flags, message in [
        (["--nominal-load", "-1"], "argument --nominal-load: value must be > 0, got '-1'"),
        # renamed: `load` is utilisation at the simulated speed; a replay's rate
        # is nominal
        (["--load", "1.5"], "argument --load: renamed --nominal-load"),
        (["--load"], "argument --load: renamed --nominal-load"),
        (["--requests", "0"], "argument --requests: value must be > 0, got '0'"),
        (["--seconds", "nan"], "argument --seconds: value must be finite"),
        (["--prompt-words", "-5"], "argument --prompt-words: value must be > 0"),
    ]:
        assert main(["replay", "--url", "http://127.0.0.1:9", *flags, "--out", "x.parquet"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert (
        main(
            ["calibrate", "--url", "http://127.0.0.1:9", "--prompt-words", "-5", "--out", "m.json"]
        )
        == 2
    )
    assert "argument --prompt-words: value must be > 0" in capsys.readouterr().err


LIVE_TOML = """
[server]
policies = ["bounded", "predictive"]
startup_timeout_s = 60
[probe]
requests = 2
[[trace]]
name = "poisson"
nominal_load = 1.2
seconds = 1.5
[[trace]]
name = "burst"
arrivals = "burst:12"
"""


@pytest.mark.slow
def test_qlab_live_runs_every_trace_under_every_policy(tmp_path):
    path = tmp_path / "live.toml"
    path.write_text(LIVE_TOML)
    summary = runner.run(live_config.load(path), tmp_path / "out", log=lambda line: None)
    assert len(summary) == 4 and set(summary["policy"]) == {"bounded", "predictive"}
    # The order rotates: trace 0 starts with bounded, trace 1 with predictive.
    assert list(summary["policy"]) == ["bounded", "predictive", "predictive", "bounded"]
    assert (
        summary["speed_before"].between(0.9, 1.2).all()
        and summary["speed_after"].between(0.9, 1.2).all()
    )
    poisson = summary[summary["trace"] == "poisson"]
    assert (poisson["nominal_load"] == 1.2).all()
    np.testing.assert_allclose(poisson["effective_load"], 1.2 * poisson["speed_in_run"])
    assert summary.loc[summary["trace"] == "burst", "effective_load"].isna().all()
    assert (summary["error"] == 0).all()
    for _, row in summary.iterrows():
        rows = records.validate(
            pd.read_parquet(tmp_path / "out" / "runs" / f"{row.trace}__{row.policy}.parquet")
        )
        assert len(rows) == row.requests
    assert (tmp_path / "out" / "summary.parquet").is_file()
    assert (tmp_path / "out" / "logs" / "serve-bounded.log").is_file()


@pytest.mark.parametrize(
    "text, message",
    [
        ("[server]\nengnie = 'gpt2'\n[[trace]]\nname='a'\nseconds=1", "unknown key 'engnie'"),
        ("[servers]\n", "unknown section 'servers'"),
        ("[server]\npolicies = ['fifo']\n[[trace]]\nname='a'\nseconds=1", "server.policies"),
        ("[[trace]]\nname='a'\nnominal_load=[1, -2]\nseconds=1", "nominal_load: must be > 0"),
        ("[[trace]]\nname='a'\nload=[1, 2]\nseconds=1", "trace[0].load: renamed nominal_load"),
        (
            "[[trace]]\nname='a'\narrivals='burst:30'\nnominal_load=2",
            "trace[0].nominal_load: arrivals 'burst:30' take no load",
        ),
        ("[[trace]]\nname='a'\narrivals='poisson'", "exactly one of seconds and requests"),
        ("[[trace]]\nname='a'\nseconds='40'", "expected float"),
        ("[server]\nengine='gpt2'\n", "at least one [[trace]]"),
        # [server]: the serve options' choices and bounds (live/serve_options.py), as on the command
        # line
        # ..., got 'tpu'
        ("[server]\nengine = 'tpu'\n[[trace]]\nname='a'\nseconds=1", "server.engine: must be gpt2"),
        (
            "[server]\ndevice = 'gpu'\n[[trace]]\nname='a'\nseconds=1",
            "server.device: must be auto, cuda or cpu, got 'gpu'",
        ),
        (
            "[server]\nengines = 0\n[[trace]]\nname='a'\nseconds=1",
            "server.engines: must be > 0, got 0",
        ),
        (
            "[server]\nspeed = -1\n[[trace]]\nname='a'\nseconds=1",
            "server.speed: must be > 0, got -1.0",
        ),
        (
            "[server]\nstall_factor = 0.5\n[[trace]]\nname='a'\nseconds=1",
            "server.stall_factor: must be >= 1, got 0.5",
        ),
        (
            "[server]\nspeed_schedule = '1-2'\n[[trace]]\nname='a'\nseconds=1",
            "server.speed_schedule: speed schedule entries",
        ),
        (
            "[server]\nhang_for = 2\n[[trace]]\nname='a'\nseconds=1",
            "server.hang_for: only with hang_after (which run hangs)",
        ),
        ("[server]\nport = 1\n[[trace]]\nname='a'\nseconds=1", "unknown key 'port'"),
        (
            "[server]\nstartup_timeout_s = 0\n[[trace]]\nname='a'\nseconds=1",
            "server.startup_timeout_s: must be > 0",
        ),
        # [replay] context_tokens: as qlab replay's --context-tokens (> 0, and room for a prompt
        # token and a new one)
        (
            "[replay]\ncontext_tokens = 0\n[[trace]]\nname='a'\nseconds=1",
            "replay.context_tokens: must be > 0, got 0",
        ),
        (
            "[replay]\ncontext_tokens = 1\n[[trace]]\nname='a'\nseconds=1",
            "replay.context_tokens: must be >= 2 (a prompt token and a new one), got 1",
        ),
        (
            "[replay]\ncontext_tokens = 512.0\n[[trace]]\nname='a'\nseconds=1",
            "replay.context_tokens: expected int",
        ),
        (
            "[replay]\ncontext_tokens = true\n[[trace]]\nname='a'\nseconds=1",
            "replay.context_tokens: expected int",
        ),
        (
            "[replay]\napi = 'grpc'\n[[trace]]\nname='a'\nseconds=1",
            "replay.api: must be one of qlab, openai, got 'grpc'",
        ),
    ],
)
def test_live_config_errors_name_the_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        live_config.load(path)


def test_a_live_trace_with_the_old_load_key_is_refused_naming_file_and_key(tmp_path, capsys):
    path = tmp_path / "old.toml"
    path.write_text("[[trace]]\nname = 'p'\nload = 1.5\nseconds = 2\n")
    with pytest.raises(live_config.ConfigError) as err:
        live_config.load(path)
    message = str(err.value)
    assert (
        str(path) in message
        and "trace[0].load: renamed nominal_load" in message
        and "\n" not in message
    )
    # Through the command line: one line on stderr, exit 2, nothing run.
    assert main(["live", str(path), "--out", str(tmp_path / "never")]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "renamed nominal_load" in said and "Traceback" not in said
    assert not (tmp_path / "never").exists()


def test_a_bad_live_context_is_one_line_and_nothing_starts(tmp_path, capsys):
    path = tmp_path / "small.toml"
    path.write_text("[replay]\ncontext_tokens = 1\n[[trace]]\nname = 'p'\nseconds = 2\n")
    assert main(["live", str(path), "--out", str(tmp_path / "never")]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "Traceback" not in said, said
    assert (
        f"{path}: replay.context_tokens: must be >= 2 (a prompt token and a new one), got 1" in said
    )
    assert not (tmp_path / "never").exists()


@pytest.mark.slow
def test_qlab_live_caps_prompts_at_the_files_context_as_qlab_replay_does(tmp_path):
    # The synthetic engine's /healthz names no context: only the file's context_tokens can cap or
    # hold back.
    pd.DataFrame(
        {
            "arrival_s": np.arange(4) * 0.1,
            "max_new_tokens": [10, 20, 40, 4],
            "prompt_tokens": [25, 35, 10, 2],
        }
    ).to_csv(tmp_path / "trace.csv", index=False)
    path = tmp_path / "live.toml"
    path.write_text(
        "[server]\npolicies = ['none']\nstartup_timeout_s = 60\n[probe]\nrequests = 1\n"
        "[replay]\ncontext_tokens = 40\n[[trace]]\nname = 'capped'\nfile = "
        "'trace.csv'\n"
    )
    cfg = live_config.load(path)
    assert cfg.replay.context_tokens == 40
    runner.run(cfg, tmp_path / "out", log=lambda line: None)
    frame = pd.read_parquet(tmp_path / "out" / "runs" / "capped__none.parquet")
    meta = frame.attrs["qlab_run"]
    assert (meta["context_tokens"], meta["prompts_capped"], meta["prompts_cannot_fit"]) == (
        40,
        1,
        1,
    )
    rows = records.validate(frame)
    # 40 - 20 = 20; 40 new tokens leave no room
    assert rows["prompt_tokens"].tolist() == [25, 20, 0, 2]
    assert rows["prompt_capped"].tolist() == [False, True, False, False]
    assert rows.loc[2, "reason"] == "prompt_cannot_fit" and rows.loc[2, "outcome"] == "error"
    # Without the key the replay takes the server's context, as qlab replay without
    # --context-tokens.
    path.write_text(path.read_text().replace("context_tokens = 40\n", ""))
    assert live_config.load(path).replay.context_tokens is None


def test_shipped_live_toml_parses_into_the_reference_passes():
    cfg = live_config.load(runner.Path(__file__).resolve().parents[1] / "experiments" / "live.toml")
    assert cfg.server.engine == "synthetic" and len(cfg.policies) == 4
    loads = sorted(t.nominal_load for t in cfg.traces if t.arrivals == "poisson")
    assert loads == [0.5, 1.0, 1.5, 2.0] and all(
        t.seconds == 40 for t in cfg.traces if t.arrivals == "poisson"
    )
    assert any(t.arrivals == "burst:30" for t in cfg.traces)
    assert runner.rotated(cfg.policies, 1)[0] == cfg.policies[1]


def _file_trace(tmp_path, keys: str) -> live_config.LiveConfig:
    """A [[trace]] of a 100-request file (one a second) with ``keys`` beside its file."""
    pd.DataFrame({"arrival_s": np.arange(100.0), "max_new_tokens": 64}).to_csv(
        tmp_path / "t.csv", index=False
    )
    path = tmp_path / "live.toml"
    path.write_text(f"[[trace]]\nname = 'f'\nfile = 't.csv'\n{keys}")
    return live_config.load(path)


def test_a_live_trace_file_takes_its_window_and_load_as_qlab_replay_does(tmp_path):
    from qsim.tracefiles import TraceWindow

    model = ServiceModel()
    whole = runner.trace_for(_file_trace(tmp_path, "").traces[0], model, 2, tmp_path)
    assert len(whole) == 100 and "window" not in whole.meta  # nothing asked: the file as it is
    spec = _file_trace(tmp_path, "start = 10\nseconds = 20\nnominal_load = 1.5\n").traces[0]
    trace = runner.trace_for(spec, model, 2, tmp_path)
    # The one rule qlab replay --trace --start --seconds --nominal-load applies (the same window,
    # the same rows).
    expected = build_trace(
        tmp_path / "t.csv", engines=2, model=model, window=TraceWindow(10.0, 20.0, 1.5)
    )
    assert len(trace) == 20 and np.array_equal(trace.arrival_s, expected.arrival_s)
    assert trace.meta["window"]["load"] == 1.5 and trace.meta["window"]["time_factor"] != 1.0
    assert spec.load == 1.5  # the summary's nominal load: the window's
    unscaled = runner.trace_for(
        _file_trace(tmp_path, "seconds = 20\n").traces[0], model, 2, tmp_path
    )
    assert len(unscaled) == 20 and unscaled.meta["window"]["time_factor"] == 1.0
    # the file's own rate: no load
    assert _file_trace(tmp_path, "seconds = 20\n").traces[0].load is None


@pytest.mark.parametrize(
    "keys, message",
    [
        (
            "requests = 5\n",
            "trace[0]: requests applies to synthetic arrivals; with file take a window "
            "with start and "
            "seconds",
        ),
        (
            "nominal_load = 2\ntime_scale = 0.5\n",
            "trace[0]: nominal_load and time_scale both set the trace's rate",
        ),
        ("start = -1\n", "trace[0].start: must be >= 0"),
    ],
)
def test_what_a_live_trace_file_cannot_take_is_refused_in_one_line(tmp_path, capsys, keys, message):
    with pytest.raises(live_config.ConfigError, match=re.escape(message)):
        _file_trace(tmp_path, keys)
    assert main(["live", str(tmp_path / "live.toml"), "--out", str(tmp_path / "never")]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and message in said and "Traceback" not in said
    assert not (tmp_path / "never").exists()


def test_a_start_without_a_trace_file_is_refused(tmp_path):
    path = tmp_path / "live.toml"
    path.write_text("[[trace]]\nname = 'p'\nseconds = 2\nstart = 1\n")
    with pytest.raises(
        live_config.ConfigError,
        match=re.escape("trace[0].start: a window's start applies to a trace file"),
    ):
        live_config.load(path)


def test_a_live_trace_takes_a_rate_in_requests_per_second(tmp_path):
    from qsim import workload

    path = tmp_path / "live.toml"
    path.write_text("[[trace]]\nname = 'p'\nrate = [3.0, 6.0]\nseconds = 200\n")
    specs = live_config.load(path).traces
    assert [(s.name, s.rate) for s in specs] == [("p-rate3", 3.0), ("p-rate6", 6.0)]
    model = ServiceModel(intercept_s=0.05, per_token_s=0.02)
    for spec in specs:
        resolved = runner.resolved_rate(spec, model, 2)
        trace = runner.trace_for(resolved, model, 2, tmp_path)
        # The nominal load that sends it, over the calibrated capacity of the two engines: qlab
        # replay --rate's rule, so the arrivals come at that rate.
        assert resolved.load == pytest.approx(
            workload.load_at_rate(spec.rate, engines=2, seconds=200, seed=spec.seed, model=model)
        )
        assert len(trace) / trace.duration_s == pytest.approx(spec.rate, rel=0.15)
    file_spec = _file_trace(tmp_path, "").traces[0]
    assert runner.resolved_rate(file_spec, model, 2) is file_spec


@pytest.mark.parametrize(
    "keys, message",
    [
        (
            "rate = 2\nnominal_load = 1\nseconds = 5\n",
            "trace[0].rate: a rate sets synthetic arrivals",
        ),
        ("rate = -2\nseconds = 5\n", "trace[0].rate: must be > 0"),
        ("rate = []\nseconds = 5\n", "trace[0].rate: empty list"),
    ],
)
def test_a_bad_live_rate_is_named(tmp_path, keys, message):
    path = tmp_path / "live.toml"
    path.write_text(f"[[trace]]\nname = 'p'\n{keys}")
    with pytest.raises(live_config.ConfigError, match=re.escape(message)):
        live_config.load(path)
