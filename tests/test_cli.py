import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from experiments.cli import main
from qsim import PRESETS, make_trace, records, simulate


ROOT = Path(__file__).resolve().parents[1]


def run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def exit_status(args, capsys):
    """main(args) as the console script `qlab` runs it (experiments.cli:main), in this process:
    the status it returns or exits with (argparse may exit itself), and what it printed.
    An exception that escapes main is not caught: it fails the test, as a traceback would."""
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_prints_outcomes_goodput_and_classes(capsys):
    code, out, err = run(
        ["simulate", "--policy", "predictive", "--load", "2", "--seconds", "120"], capsys
    )
    assert code == 0 and err == ""
    for needle in (
        "policy predictive",
        "rejected",
        "share in time (good)",
        "goodput:",
        "good tokens/s",
        "p50",
        "p99",
        "by size class",
        "\n64 ",
    ):
        assert needle in out


def test_simulate_json_and_parquet(tmp_path, capsys):
    out_file = tmp_path / "rows.parquet"
    code, out, _ = run(
        [
            "simulate",
            "--policy",
            "bounded",
            "--engines",
            "2",
            "--load",
            "1.5",
            "--requests",
            "500",
            "--json",
            "--out",
            str(out_file),
        ],
        capsys,
    )
    assert code == 0
    data = json.loads(out)
    summary = data["summary"]
    assert summary["requests"] == 500
    assert summary["good"] + summary["late"] + summary["rejected"] + summary["expired"] == 500
    assert set(data["by_class"]) == {"4", "16", "64"}
    rows = pd.read_parquet(out_file)
    records.validate(rows)
    assert len(rows) == 500 and set(rows["seed"]) == {1} and set(rows["policy"]) == {"bounded"}


def test_simulate_out_streams_simulates_rows_and_prints_the_same_summary(tmp_path, capsys):
    """--out streams each seed's records to the file as the run goes (qsim.stream): the rows are
    simulate's and the summary is the one printed without --out."""
    args = [
        "simulate",
        "--policy",
        "predictive",
        "--load",
        "1.4",
        "--seconds",
        "90",
        "--seeds",
        "2",
        "--json",
    ]
    plain = json.loads(run(args, capsys)[1])
    out_file = tmp_path / "rows.parquet"
    code, out, err = run(args + ["--out", str(out_file)], capsys)
    assert code == 0 and err == ""
    streamed = json.loads(out)
    assert (streamed["summary"], streamed["by_class"]) == (plain["summary"], plain["by_class"])
    want = pd.concat(
        [
            simulate(
                make_trace("poisson", load=1.4, seconds=90, seed=seed), PRESETS["predictive"]
            ).assign(seed=seed, policy="predictive")
            for seed in (1, 2)
        ],
        ignore_index=True,
    )
    pd.testing.assert_frame_equal(pd.read_parquet(out_file), want, check_exact=True)
    assert pq.ParquetFile(out_file).num_row_groups == 1  # the two seeds' 1,700 rows: one row group


@pytest.mark.parametrize("seeds", ["1", "2"])
def test_simulate_out_of_a_fleet_streams_and_says_what_a_run_in_memory_says(
    tmp_path, capsys, seeds
):
    """A fleet's run streams to --out (qsim.stream): the summary, the classes and the fleet's table
    (by replica for one seed, its balance across seeds) read from the file are the run's own."""
    args = [
        "simulate",
        "--policy",
        "predictive",
        "--batching",
        "--replicas",
        "3",
        "--router",
        "jsq",
        "--load",
        "1.3",
        "--seconds",
        "30",
        "--replica-speeds",
        "1,1,0.5",
        "--seeds",
        seeds,
        "--json",
    ]
    plain = json.loads(run(args, capsys)[1])
    out_file = tmp_path / "rows.parquet"
    code, out, err = run(args + ["--out", str(out_file)], capsys)
    assert code == 0 and err == ""
    streamed = json.loads(out)
    for key in ("summary", "by_class", "fleet"):
        assert streamed[key] == plain[key], key
    assert pd.read_parquet(out_file, columns=["replica"])["replica"].nunique() == 3


def test_simulate_out_of_a_burst_takes_its_rates_over_the_run(tmp_path, capsys):
    args = ["simulate", "--policy", "bounded", "--engines", "2", "--arrivals", "burst:40", "--json"]
    plain = json.loads(run(args, capsys)[1])
    streamed = json.loads(run(args + ["--out", str(tmp_path / "rows.parquet")], capsys)[1])
    assert streamed["summary"] == plain["summary"] and plain["summary"]["goodput_rps"] > 0


def test_simulate_out_to_a_path_that_cannot_be_written_is_one_line(tmp_path, capsys):
    code, out, err = run(
        ["simulate", "--requests", "50", "--out", str(tmp_path / "missing" / "rows.parquet")],
        capsys,
    )
    assert (
        code == 2
        and out == ""
        and len(err.strip().splitlines()) == 1
        and ("cannot write records") in err
    )


def test_simulate_seeds_gives_intervals(capsys):
    code, out, _ = run(
        [
            "simulate",
            "--policy",
            "bounded-deadline",
            "--load",
            "1.3",
            "--seconds",
            "60",
            "--seeds",
            "4",
            "--seed",
            "10",
            "--json",
        ],
        capsys,
    )
    data = json.loads(out)
    assert data["seeds"] == [10, 11, 12, 13]
    share = data["summary"]["share_good"]
    assert share["ci_low"] <= share["mean"] <= share["ci_high"]
    assert "mean" in data["by_class"]["64"]["goodput_rps"]
    code, text, _ = run(["simulate", "--load", "1.3", "--seconds", "60", "--seeds", "3"], capsys)
    assert "95 % confidence interval over 3 seeds" in text and "ci_low" in text


def test_simulate_same_seed_same_output(capsys):
    args = ["simulate", "--policy", "predictive", "--load", "1.7", "--seconds", "60", "--json"]
    assert run(args, capsys)[1] == run(args, capsys)[1]


def test_simulate_overrides_and_bursts(capsys):
    code, out, _ = run(
        [
            "simulate",
            "--policy",
            "bounded",
            "--max-queue",
            "4",
            "--engines",
            "2",
            "--arrivals",
            "burst:10",
            "--json",
        ],
        capsys,
    )
    summary = json.loads(out)["summary"]
    assert summary["rejected"] == 4 and summary["good"] + summary["late"] == 6


def test_simulate_azure_trace(capsys, azure_csv):
    code, out, _ = run(
        [
            "simulate",
            "--trace",
            str(azure_csv),
            "--time-scale",
            "0.5",
            "--policy",
            "predictive",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    assert json.loads(out)["summary"]["requests"] == 8819


@pytest.mark.slow  # the whole theory table: 15 s of CPU
def test_theory_json_shape(capsys, monkeypatch):
    from analysis import validation

    # The fleet rows keep a floor of 250,000 requests at any scale (most of this command's time);
    # tests/test_validation.py judges them, and the README's example prints them.
    monkeypatch.setattr(
        validation,
        "standard_scenarios",
        lambda scale: [*validation.queue_scenarios(scale), *validation.sharing_scenarios(scale)],
    )
    code, out, _ = run(
        ["theory", "--json", "--scale", "0.05", "--replications", "3", "--workers", "1"], capsys
    )
    rows = json.loads(out)
    assert {r["case"] for r in rows} >= {
        "M/M/1 rho=0.5",
        "M/D/1 rho=0.9",
        "M/M^[4]/1 bulk service lambda=3 mu=1 (Bailey)",
    }
    assert set(rows[0]) == {
        "case",
        "quantity",
        "theory",
        "sim_mean",
        "ci_low",
        "ci_high",
        "control",
        "rel_half_width",
        "inside",
        "verdict",
    }
    assert {r["verdict"] for r in rows} <= {"pass", "fail", "too wide"}
    # Three replications of a case with a control leave one degree of freedom: wide, but an
    # interval.
    assert all(r["rel_half_width"] is not None for r in rows)
    assert code == (1 if any(r["verdict"] == "fail" for r in rows) else 0)


def _theory_cases(monkeypatch, wrong: bool):
    """qlab theory on one short case: M/M/1 at rho 0.95 (too wide to judge in 2 replications of 2000
    requests), or M/M/1/5 against a wrong blocking probability (0.5, not 0.126)."""
    from analysis import validation
    from qsim import theory

    case = (
        validation.Scenario(
            "M/M/1/5 wrong",
            1,
            0.9,
            2000,
            0.05,
            max_queue=4,
            checks=(("P(block)", 0.5, validation.blocked_share),),
        )
        if wrong
        else validation.Scenario(
            "M/M/1 short",
            1,
            0.95,
            2000,
            0.1,
            checks=(("Wq", theory.mm1(0.95, 1).wq, validation.mean_wait),),
        )
    )
    monkeypatch.setattr(validation, "standard_scenarios", lambda scale: [case])


def test_theory_too_wide_rows_do_not_fail_unless_strict(capsys, monkeypatch):
    _theory_cases(monkeypatch, wrong=False)
    code, out, _ = run(["theory", "--replications", "2", "--workers", "1"], capsys)
    assert code == 0 and "too wide" in out
    assert out.rstrip().endswith(
        "0 of 0 judged rows inside their interval; 1 too wide to judge "
        "(half-width over "
        "25% of the value: run longer with --scale or more "
        "--replications)"
    )
    code, _, _ = run(["theory", "--replications", "2", "--workers", "1", "--strict"], capsys)
    assert code == 1


def test_theory_exit_status_on_a_judged_failure(capsys, monkeypatch):
    _theory_cases(monkeypatch, wrong=True)
    code, out, _ = run(["theory", "--replications", "5", "--workers", "1"], capsys)
    assert code == 1 and " FAIL" in out and "0 of 1 judged rows inside their interval" in out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["simulate", "--load", "-1"], "--load"),
        (["simulate", "--load", "nan"], "--load"),
        (["simulate", "--policy", "fifo"], "unknown policy 'fifo'; choose one of none, bounded"),
        (
            ["simulate", "--policy", "nosuchmodule:Policy"],
            "cannot load policy 'nosuchmodule:Policy'",
        ),
        (
            ["simulate", "--policy", "predictive", "--policy-arg", "quantum=2"],
            "has no parameter 'quantum'",
        ),
        (
            ["simulate", "--policy", "predictive", "--policy-arg", "deadline_s=soon"],
            "deadline_s: expected float",
        ),
        (["simulate", "--policy-arg", "deadline_s"], "expected KEY=VALUE"),
        (["simulate", "--engines", "0"], "--engines"),
        (["simulate", "--arrivals", "pareto"], "arrival process"),
        (["simulate", "--arrivals", "gamma:x"], "arrival process"),
        (["simulate", "--seconds", "5", "--requests", "5"], "not allowed with"),
        (["simulate", "--trace", "missing.csv"], "no such trace file"),
        (["simulate", "--trace", "missing.csv", "--arrivals", "gamma:2"], "--trace replaces"),
        # a trace file takes a load
        (["simulate", "--trace", "missing.csv", "--load", "2"], "no such trace file"),
        (["simulate", "--time-scale", "2"], "--time-scale applies only"),
        (["simulate", "--mean-service", "0.2"], "mean-service"),
        # A process of its own size ignores a load: giving one is refused, not run as if it
        # mattered.
        (["simulate", "--arrivals", "burst:30", "--load", "2"], "arrivals 'burst:30' take no load"),
        (
            ["simulate", "--arrivals", "periodic:20:10", "--load", "0.5"],
            "arrivals 'periodic:20:10' take no load",
        ),
        (
            [
                "replay",
                "--url",
                "http://127.0.0.1:9",
                "--arrivals",
                "burst:30",
                "--nominal-load",
                "2",
                "--engines",
                "1",
                "--out",
                "x.parquet",
            ],
            "arrivals 'burst:30' take no load",
        ),
        (
            [
                "capacity",
                "--policy",
                "none",
                "--arrivals",
                "periodic:20:10",
                "--objective",
                "share_good>=0.9",
                "--out",
                "x",
            ],
            "takes no load",
        ),
        (["simulate", "--service-model", "nope.json"], "nope.json"),
        (["theory", "--replications", "1"], "replications"),
        # The engine model: batching options need --batching, and a batching engine counts tokens.
        (["simulate", "--kv-blocks", "100"], "--kv-blocks is a batching engine's: add --batching"),
        (["simulate", "--batching", "--engines", "2"], "runs one batching engine"),
        (["simulate", "--batching", "--service", "exponential"], "--batching needs --service mix"),
        (["simulate", "--batching", "--step", "1,2"], "bad step model '1,2'"),
        (["simulate", "--batching", "--step", "0,0,0,0"], "needs a positive coefficient"),
        (
            ["simulate", "--batching", "--max-num-seqs", "4096"],
            "max_num_batched_tokens (2048) must be >= max_num_seqs",
        ),
        (["simulate", "--prompts", "gaussian:5"], "bad prompt lengths"),
        (["simulate", "--ttft-slo", "0"], "--ttft-slo"),
        # Clients: a setting that makes no sense is refused before anything runs.
        (
            ["simulate", "--retry", "fixed", "--retry-delay", "-1"],
            "delay_s must be a finite number >= 0",
        ),
        (["simulate", "--retry", "exponential", "--retry-budget", "1.5"], "budget must be a share"),
        (["simulate", "--retry-budget", "0.1"], "--retry-budget needs a retry mode"),
        (["simulate", "--retry", "often"], "invalid choice"),
        (["simulate", "--patience", "weibull:2"], "bad patience"),
        (["simulate", "--patience", "column"], "needs a trace file with a patience_s column"),
        (["simulate", "--patience-until", "start"], "--patience-until needs --patience"),
        # Renamed: a replay's rate is nominal (of the calibrated capacity); `load` is utilisation at
        # the simulated speed. The old flag names its replacement, with or without a value.
        (
            ["replay", "--url", "http://127.0.0.1:9", "--load", "1.5", "--out", "x.parquet"],
            "argument --load: renamed --nominal-load",
        ),
        (
            ["replay", "--url", "http://127.0.0.1:9", "--out", "x.parquet", "--load"],
            "renamed --nominal-load",
        ),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_arguments_one_line_exit_2(args, needle, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # "missing.csv" is missing, and a stray x.parquet lands nowhere
    code, out, err = exit_status(args, capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert needle in lines[0] and "Traceback" not in err


def test_bad_trace_file_names_the_line(tmp_path, capsys):
    code, out, err = exit_status(["simulate", "--trace", str(_bad_trace(tmp_path))], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "line 3" in err and "Traceback" not in err


@pytest.mark.slow  # a process: the one case that sees what the interpreter adds on its way out
def test_a_bad_argument_is_one_line_and_exit_2_at_process_level(tmp_path):
    """The in-process cases above see what main prints; only a process of its own shows that
    nothing else reaches stderr (an import's warning, an exit hook, a traceback at exit)."""
    proc = subprocess.run(
        [sys.executable, "-m", "experiments", "simulate", "--trace", str(_bad_trace(tmp_path))],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "line 3" in proc.stderr, proc.stderr


def _bad_trace(folder):
    bad = folder / "bad.csv"
    bad.write_text("arrival_s,max_new_tokens\n0.0,4\n0.5,lots\n")
    return bad


def test_simulate_with_impatient_retrying_clients(capsys, tmp_path):
    out_file = tmp_path / "rows.parquet"
    code, out, err = run(
        [
            "simulate",
            "--policy",
            "predictive",
            "--arrivals",
            "surge:10:10:2.5",
            "--load",
            "0.8",
            "--seconds",
            "60",
            "--retry",
            "exponential",
            "--retry-jitter",
            "1",
            "--patience",
            "exponential:20",
            "--out",
            str(out_file),
        ],
        capsys,
    )
    assert code == 0 and err == ""
    assert "attempts per request" in out and "abandoned" in out
    rows = records.validate(pd.read_parquet(out_file))
    assert rows["attempt"].max() > 1 and rows["attempt"].max() <= 3


def test_a_trace_files_patience_column(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,max_new_tokens,patience_s\n0,64,\n0,64,0.1\n0,64,0.2\n")
    code, out, _ = run(["simulate", "--trace", str(trace), "--policy", "none", "--json"], capsys)
    # the first waits forever, is served
    assert code == 0 and json.loads(out)["summary"]["abandoned"] == 2
    code, out, _ = run(
        ["simulate", "--trace", str(trace), "--policy", "none", "--patience", "none", "--json"],
        capsys,
    )
    assert json.loads(out)["summary"]["abandoned"] == 0


def test_simulate_a_batching_engine(capsys, tmp_path):
    args = [
        "simulate",
        "--policy",
        "predictive",
        "--batching",
        "--kv-blocks",
        "400",
        "--step",
        "0.008,5e-5,1e-4,1e-7",
        "--prompts",
        "lognormal:256:0.5",
        "--ttft-slo",
        "0.5",
        "--load",
        "2",
        "--seconds",
        "20",
        "--seed",
        "3",
    ]
    assert main([*args, "--out", str(tmp_path / "rows.parquet")]) == 0
    out = capsys.readouterr().out
    assert "a batching engine (256 seqs, 2048 tokens a step, 400 KV blocks of 16)" in out
    assert "time to first token: p50" in out
    rows = records.validate(pd.read_parquet(tmp_path / "rows.parquet"))
    answered = rows[rows["outcome"].isin(["good", "late"])]
    assert len(answered) and answered["kv_blocks_peak"].between(1, 400).all()
    assert (rows["ttft_slo_s"] == 0.5).all()
    # A good answer met its first-token objective too; the seed decides everything.
    assert (rows.loc[rows["outcome"] == "good", "ttft_s"] <= 0.5).all()
    assert main(args) == 0 and capsys.readouterr().out == out.replace(
        f"\nwrote {len(rows)} rows to {tmp_path / 'rows.parquet'}\n", ""
    )


def test_simulate_engines_that_slow_each_other(capsys):
    assert main(["simulate", "--engines", "2", "--load", "1", "--seconds", "60", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)["summary"]
    assert (
        main(
            [
                "simulate",
                "--engines",
                "2",
                "--concurrency",
                "0.5",
                "--load",
                "1",
                "--seconds",
                "60",
                "--json",
            ]
        )
        == 0
    )
    slowed = json.loads(capsys.readouterr().out)["summary"]
    assert (
        slowed["latency_p50_s"] > alone["latency_p50_s"]
        and slowed["share_good"] < alone["share_good"]
    )
