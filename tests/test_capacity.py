"""qlab capacity: objectives, the search (on a synthetic metric and on M/M/1), its dataset,
resuming, determinism."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from analysis.objectives import Objective, parse_objectives, written
from experiments import capacity, capacity_cli, sweep
from experiments.cli import main

# A small search: few seeds, short runs, a coarse tolerance (a test need not locate the crossing
# finely).
SMALL = [
    "--policy",
    "bounded",
    "--policy",
    "predictive",
    "--objective",
    "share_good>=0.9",
    "--seconds",
    "60",
    "--seeds",
    "3",
    "--tolerance",
    "0.05",
]


# ------------------------------------------------------------------ objectives


def test_objectives_parse():
    objective = parse_objectives(
        "share_good>=0.9 and latency_p99_s <= 2.5 and goodput_rps>1e1 and ttft_p99_s=1"
    )
    assert written(objective) == (
        "share_good>=0.9 and latency_p99_s<=2.5 and goodput_rps>10 and ttft_p99_s<=1"
    )
    assert capacity.metrics_of(objective * 2) == [
        "share_good",
        "latency_p99_s",
        "goodput_rps",
        "ttft_p99_s",
    ]
    # any name: checked on the cells
    assert written(parse_objectives("  ttft_p99_s<0.5 ")) == "ttft_p99_s<0.5"
    strict = parse_objectives("share_good>0.9")[0]
    assert not strict.holds(0.9) and strict.holds(0.91) and not strict.holds(float("nan"))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "share_good",
        "share_good=>0.9",
        "share_good==0.9",
        "share_good>=high",
        "share_good>=0.9 or latency_p99_s<=2",
        "share_good>=nan",
        "share_good>=inf",
        "share_good>=0.9 and",
        "9>=share_good",
        "share_good>=2",
        "jain_share>1",
        "latency_p99_s<0",
        "share_good>=0.9 and ttft_p99_s<-1",
    ],
)
def test_a_bad_objective_is_one_line_and_exit_2(text, tmp_path, capsys):
    with pytest.raises(ValueError, match="objective '.*'"):
        parse_objectives(text)
    assert (
        main(["capacity", "--policy", "none", "--objective", text, "--out", str(tmp_path / "o")])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and not (tmp_path / "o").exists()


def test_an_objective_no_load_can_meet_says_so_and_one_at_its_edge_is_taken():
    with pytest.raises(
        ValueError, match="share_good is a fraction, between 0 and 1: no load can meet it"
    ):
        parse_objectives("share_good>=2")
    assert written(parse_objectives("share_good>=1 and latency_p99_s<=0")) == (
        "share_good>=1 and latency_p99_s<=0"
    )


def test_an_unknown_metric_names_those_there_are_and_runs_nothing(tmp_path, capsys):
    assert (
        main(
            [
                "capacity",
                "--policy",
                "none",
                "--objective",
                "share_goood>=0.9",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no metric 'share_goood'" in err and "share_good, " in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--arrivals", "burst:30"], "--arrivals burst:30: takes no load"),
        (["--arrivals", "periodic:20:10"], "takes no load"),
        (["--seeds", "1"], "--seeds must be at least 2"),
        (["--start", "20"], "0 < --min-load <= --start <= --max-load"),
        (["--tolerance", "1.5"], "--tolerance must be in (0, 1)"),
        (
            ["--mean-service", "1"],
            "--mean-service applies to exponential and deterministic service",
        ),
        (["--policy-arg", "aging=0.1"], "has no parameter 'aging'"),
        (["--concurrency", "0.1", "--batching"], "drop --engines and --concurrency"),
        (["--kv-blocks", "100"], "--kv-blocks is a batching engine's: add --batching"),
        (
            ["--batching", "--service", "exponential"],
            "service_dist: a [batching] engine's work is its requests' tokens",
        ),
    ],
)
def test_bad_search_settings_are_one_line_and_exit_2(extra, message, tmp_path, capsys):
    argv = [
        "capacity",
        "--policy",
        "none",
        "--objective",
        "share_good>=0.9",
        "--out",
        str(tmp_path / "o"),
        *extra,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not (tmp_path / "o").exists()


# ------------------------------------------------------------------ the search, on a synthetic
# metric


def synthetic(offsets: np.ndarray, objective: tuple[Objective, ...]):
    """An evaluate function for :func:`capacity.search`: seed s's metric at load L is 1 - L / 4 +
    offsets[s]."""

    def evaluate(asks):
        return {
            (unit, load): capacity.judge({"m": 1 - load / 4 + offsets}, objective)
            for unit, load in asks
        }

    return evaluate


def test_the_search_finds_the_crossing_of_the_seeds_mean_and_an_interval_around_it():
    rng = np.random.default_rng(7)
    offsets = rng.normal(0, 0.05, 10)
    objective = parse_objectives("m>=0.5")
    bounds = capacity.Bounds(tolerance=0.01)
    judged = capacity.search(synthetic(offsets, objective), ["a"], bounds)["a"]
    cap = capacity.Capacity.of(judged)
    crossing = 4 * (0.5 + offsets.mean())  # where the seeds' mean is 0.5
    assert cap.load <= crossing < cap.fails_at and cap.fails_at - cap.load <= 0.01 * cap.fails_at
    # The interval by test inversion: where the t-interval of the mean holds 0.5.
    half = 4 * (offsets.std(ddof=1) / math.sqrt(10)) * 2.262  # t(0.975, 9)
    assert cap.ci_low <= crossing - half * 0.98 and cap.ci_high >= crossing + half * 0.98
    # located to the tolerance, not wider
    assert cap.ci_high - cap.ci_low <= 2 * half + 0.05 * cap.ci_high
    assert cap.loads_tried == len(judged) < 30


def test_the_search_says_where_it_ran_out_of_loads():
    flat = np.zeros(5)
    never = capacity.Capacity.of(
        capacity.search(synthetic(flat, parse_objectives("m>=2")), ["a"], capacity.Bounds())["a"]
    )
    assert (
        never.load is None
        and never.ci_low is None
        and never.fails_at == 0.01
        and never.ci_high == 0.01
    )
    always = capacity.Capacity.of(
        capacity.search(
            synthetic(flat, parse_objectives("m>=-5")), ["a"], capacity.Bounds(max_load=8)
        )["a"]
    )
    assert always.load == 8 and always.fails_at is None and always.ci_high is None


def test_several_clauses_each_at_a_bonferroni_level():
    values = {"a": np.array([0.91, 0.93, 0.95]), "b": np.array([1.0, 1.2, 1.1])}
    one = capacity.judge(values, parse_objectives("a>=0.9"))
    two = capacity.judge(values, parse_objectives("a>=0.9 and b<=2"))
    assert one.values["a"]["ci_low"] > two.values["a"]["ci_low"]  # the 97.5 % interval is wider
    assert two.met and not capacity.judge(values, parse_objectives("a>=0.9 and b<1")).met
    undefined = capacity.judge({"a": np.array([0.95, np.nan, 0.96])}, parse_objectives("a>=0.9"))
    assert not undefined.met and undefined.surely_failed


# ------------------------------------------------------------------ on the simulator


@pytest.mark.slow  # two worker processes, and 10 seeds of 1000 s at every load the search tries
def test_the_capacity_of_an_mm1_queue_is_its_closed_form(tmp_path):
    # FIFO M/M/1 with service rate 1: the sojourn is exponential of rate 1 - rho, so the share
    # within a deadline d is 1 - exp(-(1 - rho) d), and it is 0.9 at rho = 1 - ln(10) / d. (A
    # deadline of 5 puts it at 0.54, where runs of 1000 s are long enough for the start from empty
    # not to matter.)
    deadline = 5.0
    truth = 1 - math.log(10) / deadline
    cfg = capacity.search_config(
        ["none"],
        ["poisson"],
        seconds=1000,
        seeds=10,
        sweep_settings={"service_dist": "exponential", "mean_service_s": 1.0},
        grid={"deadline_s": [deadline]},
    )
    spec = capacity.Search(cfg, parse_objectives("share_good>=0.9"))
    (result,) = capacity.run(spec, tmp_path / "mm1", workers=2).results
    cap = result.capacity
    assert cap.ci_low <= truth <= cap.ci_high and cap.ci_high - cap.ci_low < 0.15
    assert abs(cap.load - truth) < 0.03 and result.capacity_rps == 1.0


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("capacity") / "out"
    assert main(["capacity", *SMALL, "--out", str(out), "--workers", "1", "--json"]) == 0
    return out


def test_json_and_the_folder_is_a_sweep_dataset(small, capsys):
    records = json.loads((small / "capacity.json").read_text())["results"]
    assert [r["policy"] for r in records] == ["bounded", "predictive"]
    for r in records:
        assert {"policy", "load", "ci_low", "ci_high"} <= set(r) and r["arrivals"] == "poisson"
        assert r["ci_low"] <= r["load"] < r["fails_at"] <= r["ci_high"]
        assert r["rate_rps"] == pytest.approx(r["load"] * 6.793478, rel=1e-6)
    assert records[1]["load"] > records[0]["load"]  # predictive takes more than a bounded queue
    summary = pd.read_parquet(small / "summary.parquet")
    tried = json.loads((small / "capacity.json").read_text())["tried"]
    assert len(summary) == 3 * len(tried) and set(summary["seed"]) == {1, 2, 3}
    manifest = json.loads((small / "manifest.json").read_text())
    assert manifest["capacity"]["objective"] == "share_good>=0.9" and manifest["cells"] == len(
        summary
    )
    assert sorted(manifest["config"]["grid"]["load"]) == sorted(set(summary["load"]))
    assert main(["summary", str(small)]) == 0
    assert f"{small}: {len(summary)} cells" in capsys.readouterr().out


def test_the_printed_table(small, capsys):
    assert main(["capacity", *SMALL, "--out", str(small)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(
        "capacity: the highest load at which share_good>=0.9 holds for the mean of 3 seeds"
    )
    assert out[1].split() == [
        "policy",
        "capacity",
        "95",
        "%",
        "interval",
        "fails",
        "at",
        "requests/s",
        "loads",
        "tried",
    ]
    assert out[2].split()[0] == "bounded" and out[3].split()[0] == "predictive"
    assert out[-1].startswith("0 cells run (") and "already done" in out[-1]


@pytest.mark.slow  # every figure of the search drawn: 8 s of CPU
def test_plot_draws_the_searchs_figure_beside_the_sweeps(small, tmp_path, capsys):
    assert main(["plot", str(small), "--out", str(tmp_path / "figs")]) == 0
    assert {"capacity.png", "capacity.svg", "share_in_time.png"} <= {
        p.name for p in (tmp_path / "figs").iterdir()
    }


def test_the_capacity_figure_keeps_each_policys_colour(small):
    from matplotlib import colors

    from analysis import plots, styles

    data = json.loads((small / "capacity.json").read_text())
    fig = plots.capacity(
        pd.read_parquet(small / "summary.parquet"),
        data["results"],
        parse_objectives(data["objective"])[0],
    )
    (ax,) = [a for a in fig.axes if a.lines]
    curves = {
        line.get_label(): colors.to_hex(line.get_color())
        for line in ax.lines
        if not line.get_label().startswith("_")
    }
    assert curves["bounded"] == styles.policy_color("bounded") and curves[
        "predictive"
    ] == styles.policy_color("predictive")
    assert "objective share_good ≥ 0.9" in curves


def test_a_batching_engines_capacity_with_a_ttft_objective(tmp_path, capsys):
    # simulate's engine options: one batching engine, whose saturated throughput is load 1, and an
    # objective on the first token that makes a request good only when it meets it too.
    from qsim.engines import Batching
    from qsim.mixes import REFERENCE_MIX

    argv = [
        "capacity",
        "--policy",
        "predictive",
        "--objective",
        "share_good>=0.9",
        "--batching",
        "--max-num-seqs",
        "8",
        "--ttft-slo",
        "0.5",
        "--seconds",
        "30",
        "--seeds",
        "2",
        "--tolerance",
        "0.1",
        "--workers",
        "1",
        "--out",
        str(tmp_path / "b"),
        "--json",
    ]
    assert main(argv) == 0
    (record,) = json.loads(capsys.readouterr().out)
    mean_tokens = sum(s * p for s, p in zip(REFERENCE_MIX.sizes, REFERENCE_MIX.probs))
    assert record["rate_rps"] == pytest.approx(
        record["load"] * Batching(max_num_seqs=8).capacity_rps(0.0, mean_tokens)
    )
    summary = pd.read_parquet(tmp_path / "b" / "summary.parquet")
    assert set(summary["ttft_slo_s"]) == {0.5} and summary["kv_blocks_peak_p99"].notna().all()
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["config"]["batching"]["max_num_seqs"] == 8
    assert main([*argv[:-1]]) == 0  # the table names the engine
    assert "a batching engine (8 seqs" in capsys.readouterr().out.splitlines()[0]


def test_an_objective_over_ttft(tmp_path, capsys):
    # The p99 time to first token: any summary metric can be searched on, in either direction.
    argv = [
        "capacity",
        "--policy",
        "predictive",
        "--objective",
        "ttft_p99_s<=1",
        "--seconds",
        "60",
        "--seeds",
        "3",
        "--tolerance",
        "0.1",
        "--workers",
        "1",
        "--out",
        str(tmp_path / "ttft"),
        "--json",
    ]
    assert main(argv) == 0
    (record,) = json.loads(capsys.readouterr().out)
    summary = (
        pd.read_parquet(tmp_path / "ttft" / "summary.parquet").groupby("load")["ttft_p99_s"].mean()
    )
    assert summary[record["load"]] <= 1 < summary[record["fails_at"]]
    assert record["ci_low"] <= record["load"] < record["fails_at"] <= record["ci_high"]


@pytest.mark.slow  # a process pool
def test_same_search_with_any_number_of_workers(small, tmp_path):
    again = tmp_path / "two"
    assert main(["capacity", *SMALL, "--out", str(again), "--workers", "2", "--json"]) == 0
    assert json.loads((again / "capacity.json").read_text()) == json.loads(
        (small / "capacity.json").read_text()
    )
    a, b = (
        pd.read_parquet(d / "summary.parquet").sort_values("cell_id").reset_index(drop=True)
        for d in (small, again)
    )
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.slow  # a Dask cluster of worker processes
def test_same_search_on_a_dask_cluster(small, tmp_path):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as cluster:
        assert (
            main(
                [
                    "capacity",
                    *SMALL,
                    "--out",
                    str(tmp_path / "dask"),
                    "--scheduler",
                    cluster.scheduler_address,
                    "--json",
                ]
            )
            == 0
        )
    assert json.loads((tmp_path / "dask" / "capacity.json").read_text()) == json.loads(
        (small / "capacity.json").read_text()
    )


@pytest.mark.slow  # a search run twice: 7 s of CPU
def test_an_interrupted_search_resumes(small, tmp_path):
    cfg = capacity_cli.config_from_args(_args(SMALL))
    spec = capacity.Search(
        cfg, parse_objectives("share_good>=0.9"), capacity.Bounds(tolerance=0.05)
    )
    out = tmp_path / "resumed"

    def stop_at_round_3(line):
        if line.startswith("round 3:"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        capacity.run(spec, out, workers=1, log=stop_at_round_3)
    kept = len(sweep.finished(out))
    assert kept > 0 and not (out / "capacity.json").exists()
    outcome = capacity.run(spec, out, workers=1)
    assert outcome.reused == kept and outcome.ran > 0
    assert json.loads((out / "capacity.json").read_text()) == json.loads(
        (small / "capacity.json").read_text()
    )
    # Another objective on the same cells reuses every one it asks for again (the folder's digest
    # leaves loads out).
    other = capacity.Search(
        cfg, parse_objectives("share_good>=0.8"), capacity.Bounds(tolerance=0.05)
    )
    assert capacity.run(other, out, workers=1).reused > 0


def test_a_folder_of_another_search_is_refused(small, tmp_path, capsys):
    argv = ["capacity", *SMALL, "--engines", "2", "--out", str(small)]
    assert main(argv) == 2
    assert "holds cells of another sweep config" in capsys.readouterr().err


def _args(argv):
    from experiments.cli import build_parser

    return build_parser().parse_args(["capacity", *argv, "--out", "unused"])
