"""The benchmark scripts must keep running (their figures are printed, never asserted)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each runs a benchmark script in a process of its own


def _run(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=timeout,
    )


def _main_of(script: str):
    """A benchmark script's ``main(argv)``, imported in this process: a bad argument is checked
    where it is parsed, without starting a process for it."""
    import importlib.util

    name = f"benchmarks_{Path(script).stem}"
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.main


def _json_of(script: str, *args: str) -> dict:
    """What a benchmark script prints with --json, after it exited 0."""
    proc = _run(script, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_bench_qsim_quick_runs_and_reports_every_implementation():
    data = _json_of("bench_qsim.py", "--quick")
    text = json.dumps(data)
    for needle in ("qlab", "plain SimPy"):
        assert needle in text


def test_bench_batching_quick_reports_each_policy_against_the_target():
    data = _json_of("bench_batching.py", "--quick")
    assert {r["policy"] for r in data["rows"]} == {"none", "predictive", "predictive-kv"}
    assert all(r["verdict"] in ("PASS", "MISS") and r["requests"] == 2400 for r in data["rows"])


def test_bench_openai_quick_runs_and_reports_each_figure_with_its_target():
    """The gate's costs on the OpenAI-compatible API (issue 13, section 7): printed, never
    asserted."""
    data = _json_of("bench_openai.py", "--quick")
    assert set(data) == {
        "refusal",
        "refusal_8",
        "refusal_generate",
        "added",
        "added_ttft",
        "machine",
    }
    assert (
        data["machine"]["cpus"] == os.cpu_count()
        and data["machine"]["python"] == sys.version.split()[0]
    )
    for figure in (data[k] for k in ("refusal", "refusal_8", "added", "added_ttft")):
        assert {"n", "p50_ms", "p99_ms", "target", "verdict", "floor"} <= set(figure)
        assert figure["verdict"] in ("PASS", "MISS") and figure["target"]["p50_ms"] == 1.0
    assert (
        data["refusal"]["requests"] > 0 and data["added"]["n"] > 0 and data["added_ttft"]["n"] > 0
    )
    # Eight engines' trace: eight times the rate (same seed, same seconds).
    assert data["refusal_8"]["requests"] > 4 * data["refusal"]["requests"]
    # the bare refuser got the same arrivals and refused every one of them
    for key in ("refusal", "refusal_8"):
        floor = data[key]["floor"]
        assert floor["requests"] == data[key]["requests"] and floor["n"] > 0
        assert floor["outcomes"] == {"rejected": floor["requests"]}
    for key in ("added", "added_ttft"):  # every triple was answered, by all three sides
        assert not data[key]["not_answered"] and {"upstream_alone", "through_gate"} <= set(
            data[key]
        )
        floor = data[key]["floor"]
        assert (
            floor["bare_proxy_adds"]["n"]
            == floor["gate_adds_over_bare_proxy"]["n"]
            == data[key]["n"]
        )


def test_bench_memory_quick_reports_peaks_flatness_and_the_ratio():
    """Issue 21, section 5: peak memory of streamed runs against the target, printed, never
    asserted."""
    data = _json_of("bench_memory.py", "--quick")
    assert [(r["mode"], r["requests"]) for r in data["rows"]] == [
        ("stream", 20_000),
        ("stream", 100_000),
        ("memory", 100_000),
        ("cli", 100_000),
    ]
    assert all(
        r["peak_mb"] > r["imports_mb"] > 0 and r["rows"] == r["requests"] for r in data["rows"]
    )
    assert data["rows"][1]["row_groups"] == 2  # 100,000 rows in row groups of 65,536
    assert data["peak"]["verdict"] in ("PASS", "MISS") and data["flat"]["verdict"] in (
        "PASS",
        "MISS",
    )
    assert data["ratio"]["in_memory_over_stream"] > 0
    # Issue 32, item 8: qlab simulate --out, its summary included, against the same target.
    assert data["cli"]["verdict"] in ("PASS", "MISS") and data["cli"]["requests"] == 100_000
    assert data["rows"][3]["printed_lines"] > 10


def test_bench_gpt2_batch_quick_reports_each_batch_against_batch_one():
    """Issue 22, section 1: the batched GPT-2 engine's tokens/s per batch size as ratios,
    printed, never asserted."""
    pytest.importorskip("torch")
    data = _json_of(
        "bench_gpt2_batch.py", "--quick", "--device", "cpu", "--batches", "1,2", "--threads", "1"
    )
    assert (data["model"], data["device"]) == ("tiny", "cpu")
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    assert [r["tokens"] for r in data["rows"]] == [16, 32]
    assert data["rows"][0]["ratio"] == 1.0 and all(
        r["tokens_per_s"] > 0 and r["ratio"] > 0 for r in data["rows"]
    )
    assert all(r["matches_alone"] for r in data["rows"])  # on the CPU, batched decoding is exact
    assert data["one_at_a_time_tokens_per_s"] > 0


def test_bench_gpt2_batch_refuses_bad_batch_sizes_in_one_line(capsys):
    assert _main_of("bench_gpt2_batch.py")(["--batches", "0,x"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--batches" in err


def test_predict_live_quick_judges_each_run_against_the_targets():
    """Issue 22, section 3: each case served, calibrated, replayed and predicted; its errors finite
    numbers, each judged against its target (a PASS or a MISS: the figures are printed, never
    asserted)."""
    pytest.importorskip("torch")
    data = _json_of("predict_live.py", "--quick")
    assert data["targets"] == {
        "share_good": 0.05,
        "goodput_rps": 0.05,
        "latency_p99_s": 0.10,
        "ttft_p99_s": 0.15,
    }
    assert [c["case"] for c in data["cases"]] == ["synthetic-noise", "gpt2-1"]
    for case in data["cases"]:
        assert case["skipped"] is None and len(case["runs"]) == 1 and "model" in case["calibration"]
        run = case["runs"][0]
        assert (
            run["requests"] > 0
            and math.isfinite(run["effective_load"])
            and math.isfinite(run["speed_before"])
        )
        assert set(run["metrics"]) == set(data["targets"])  # streamed: TTFT measured too
        for metric, figure in run["metrics"].items():
            assert (
                math.isfinite(figure["relative_error"])
                and figure["target"] == data["targets"][metric]
            )
            assert figure["verdict"] in ("PASS", "MISS")
        assert run["prediction"] in ("PASS", "MISS") and run["replay"]["verdict"] in (
            "PASS",
            "MISS",
        )
        assert 0 <= run["replay"]["disagreement_rate"] <= 1


@pytest.mark.parametrize(
    "args, said",
    [
        (("--cases", "gpt2-1,nope"), "nope"),
        (("--loads", "0.5,x"), "--loads"),
        (("--loads", "0"), "--loads"),
    ],
)
def test_predict_live_refuses_bad_cases_and_loads_in_one_line(args, said, capsys):
    assert _main_of("predict_live.py")(list(args)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and said in err


def test_bench_endpoints_quick_reports_healthz_under_stats_reads_against_the_target():
    """Issue 32, section 3: /healthz's p99 while whole step logs are read page by page, printed,
    never asserted."""
    data = _json_of("bench_endpoints.py", "--quick")
    assert data["steps"] == 200_000 and data["page"] == 5_000 and data["readers"] == 2
    assert data["healthz"]["verdict"] in ("PASS", "MISS") and data["healthz"]["target_ms"] == 50.0
    assert data["healthz"]["n"] > 0 and data["healthz_alone"]["n"] > 0
    assert data["stats_page"]["n"] > 0
    # A page, not the whole log (17 MB).
    assert 100_000 < data["stats_page"]["mean_bytes"] < 1_000_000
    assert data["whole_log"]["pages"] == 40 and data["whole_log"]["steps_each"] in (None, 200_000)


def test_bench_fleet_quick_reports_the_hour_and_linearity_against_their_targets():
    """Issue 31, item 7: a batching fleet's hour and its cost per request at 16/64/256 replicas."""
    data = _json_of("bench_fleet.py", "--quick")
    assert (
        data["hour"]["replicas"] == 16
        and data["hour"]["requests"] > 10 * data["baseline"]["requests"]
    )
    assert data["hour"]["verdict"] in ("PASS", "MISS") and data["linear_verdict"] in (
        "PASS",
        "MISS",
    )
    assert [r["replicas"] for r in data["linear"]] == [16, 64, 256]
    assert data["linear"][0]["over_16"] == 1.0 and all(r["cpu_s"] > 0 for r in data["linear"])
