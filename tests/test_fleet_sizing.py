"""Fleets everywhere a run is described: sweep axes (replicas, router), qlab capacity for a fleet,
sizing (the fewest replicas at a rate) and --rate."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis.objectives import parse_objectives
from experiments import capacity, commands, config, sizing, sweep
from experiments.cli import main

FLEET = """
[sweep]
duration_s = 20
seeds = 2
service_dist = "exponential"
mean_service_s = 1.0
[grid]
policy = ["none"]
load = [0.8]
replicas = [2, 4]
router = ["random", "power_of_d", "central"]
"""


def load_text(tmp_path, text):
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return config.load(path)


def rows(out):
    frame = pd.read_parquet(out / "cells")
    return frame.sort_values(["cell_id", "request_id"]).reset_index(drop=True)


@pytest.mark.slow
def test_a_fleet_sweep_gives_the_same_rows_with_any_number_of_workers(tmp_path):
    cfg = load_text(tmp_path, FLEET)
    sweep.run(cfg, tmp_path / "one", workers=1, quiet=True)
    sweep.run(cfg, tmp_path / "two", workers=2, quiet=True)
    pd.testing.assert_frame_equal(rows(tmp_path / "one"), rows(tmp_path / "two"))


def test_a_sweep_over_replicas_and_routers_writes_the_replica_column(tmp_path):
    cfg = load_text(tmp_path, FLEET)
    one = sweep.run(cfg, tmp_path / "one", workers=1, quiet=True)
    assert len(one) == 2 * 3 * 2 and one["cell_id"].is_unique
    frame = rows(tmp_path / "one")
    early = frame[frame["router"] != "central"]
    assert early["replica"].between(0, early["replicas"] - 1).all()
    assert set(frame["replica"].dropna()) == {0, 1, 2, 3}
    # Common random numbers: each seed's requests are the same whatever the router.
    for _, part in frame.groupby(["replicas", "seed"]):
        arrivals = part.groupby("router")["arrival_s"].apply(lambda s: tuple(s.round(9)))
        assert arrivals.nunique() == 1
    # The load is each replica's: 4 replicas take twice the rate of 2.
    rate = one.groupby("replicas")["capacity_rps"].first()
    assert rate[4] == 2 * rate[2] == 4.0
    assert one["jain_replicas"].between(0, 1).all() and (one["load_imbalance"] >= 1).all()


def test_a_sweep_at_a_rate_spreads_it_over_the_replicas(tmp_path):
    text = FLEET.replace("load = [0.8]", "rate = [3.0]")
    text = text.replace("duration_s = 20", "duration_s = 200")
    summary = sweep.run(load_text(tmp_path, text), tmp_path / "out", workers=1, quiet=True)
    assert summary["load"].isna().all() and set(summary["rate"]) == {3.0}
    # 3 requests/s of mean 1 s: load 0.75 on 4 replicas, 1.5 on 2.
    offered = summary.groupby("replicas")["offered_load"].mean()
    assert offered[2] == pytest.approx(1.5, rel=0.1) and offered[4] == pytest.approx(0.75, rel=0.1)
    assert (summary["requests"] / summary["duration_s"]).mean() == pytest.approx(3.0, rel=0.1)
    table = commands.summary_numbers(summary)
    assert {"replicas", "router", "rate"} <= set(table.axes) and len(table.table) == 6
    assert "jain_replicas" in table.metrics


def test_a_sweep_over_where_a_fleet_admits(tmp_path):
    text = FLEET.replace(
        'router = ["random", "power_of_d", "central"]',
        'router = ["jsq"]\nadmission_at = ["replica", "gate"]',
    )
    text = text.replace('policy = ["none"]', 'policy = ["bounded"]').replace("[0.8]", "[1.5]")
    summary = sweep.run(load_text(tmp_path, text), tmp_path / "out", workers=1, quiet=True)
    assert set(summary["admission_at"]) == {"replica", "gate"} and len(summary) == 2 * 2 * 2
    frame = rows(tmp_path / "out")
    # The gate's bound (bounded's max_queue) is the fleet's: it refuses more, routed nowhere.
    refused = frame[frame["outcome"] == "rejected"].groupby("admission_at").size()
    assert refused.get("gate", 0) > refused.get("replica", 0)
    gate = frame[frame["admission_at"] == "gate"]
    assert gate.loc[gate["outcome"] == "rejected", "replica"].isna().all()
    # A sweep without the axis keeps its cells' ids (an axis at its default is the cell's own).
    plain = load_text(tmp_path, FLEET)
    assert all(c.admission_at is None for c in sweep.cells(plain))


def test_a_config_without_fleet_axes_keeps_its_cells():
    cfg = config.load("docs/examples/tiny.toml")
    assert all(c.replicas is None and c.router is None for c in sweep.cells(cfg))
    assert [c.id for c in sweep.cells(cfg)][:1] == ["57010b41f132e792"]


@pytest.mark.parametrize(
    "grid, says",
    [
        ('router = ["random"]', "add grid.replicas"),
        ('replicas = [2]\nrouter = ["fastest"]', "unknown router"),
        ('replicas = [2]\nrouter = ["power_of_d:3"]', "3 choices among 2 replicas"),
        ("replicas = [0]", "replicas"),
        ("rate = [2.0]", "grid.load and grid.rate exclude each other"),
        ('admission_at = ["gate"]', "grid.admission_at is where a fleet admits: add grid.replicas"),
        ('replicas = [2]\nadmission_at = ["router"]', "a fleet admits at one of replica, gate"),
    ],
)
def test_bad_fleet_axes_are_refused_before_anything_runs(tmp_path, grid, says):
    text = f'[sweep]\nduration_s = 5\n[grid]\npolicy = ["none"]\nload = [0.5]\n{grid}\n'
    with pytest.raises(config.ConfigError, match=says):
        load_text(tmp_path, text)


BATCH_FLEET = """
[sweep]
duration_s = 10
seeds = 2
prompts = "uniform:16:256"
[grid]
policy = ["none"]
load = [0.7]
replicas = [1, 2]
router = ["round_robin", "least_kv"]
[batching]
b0 = 0.01
b1 = 0.0001
max_num_seqs = 8
kv_blocks = 400
"""


@pytest.mark.slow
def test_a_sweep_of_batching_replicas_gives_the_same_rows_on_two_workers(tmp_path):
    cfg = load_text(tmp_path, BATCH_FLEET)
    sweep.run(cfg, tmp_path / "one", workers=1, quiet=True)
    sweep.run(cfg, tmp_path / "two", workers=2, quiet=True)
    pd.testing.assert_frame_equal(rows(tmp_path / "one"), rows(tmp_path / "two"))


def test_a_sweep_of_batching_replicas_writes_each_replica_at_the_load_of_each(tmp_path):
    one = sweep.run(load_text(tmp_path, BATCH_FLEET), tmp_path / "one", workers=1, quiet=True)
    frame = rows(tmp_path / "one")
    assert set(frame.loc[frame["replicas"] == 2, "replica"]) == {0, 1}
    assert set(frame.loc[frame["replicas"] == 1, "replica"]) == {0}
    # The load is each replica's: two batching replicas take twice one's saturated throughput.
    rate = one.groupby("replicas")["capacity_rps"].first()
    assert rate[2] == pytest.approx(2 * rate[1])
    per_replica = one.groupby("replicas")["offered_load"].mean()
    assert per_replica[2] == pytest.approx(per_replica[1], rel=0.2)


def test_a_sweep_of_batching_replicas_behind_a_central_queue(tmp_path):
    # Late binding is one more router: each row says the replica it started on (none: <NA>).
    text = BATCH_FLEET.replace('["round_robin", "least_kv"]', '["central", "jsq"]')
    summary = sweep.run(load_text(tmp_path, text), tmp_path / "out", workers=1, quiet=True)
    assert set(summary["router"]) == {"central", "jsq"} and len(summary) == 2 * 2 * 2
    frame = rows(tmp_path / "out")
    central = frame[(frame["router"] == "central") & (frame["replicas"] == 2)]
    assert set(central["replica"].dropna()) == {0, 1}
    assert central["replica"].isna().eq(central["start_s"].isna()).all()


def test_a_batch_aware_router_needs_batching_replicas(tmp_path):
    text = '[grid]\npolicy = ["none"]\nload = [0.5]\nreplicas = [2]\nrouter = ["least_kv"]\n'
    with pytest.raises(config.ConfigError, match="add a \\[batching\\] table"):
        load_text(tmp_path, text)


# ------------------------------------------------------------------ sizing, on a synthetic metric


def synthetic(offsets, objective):
    """capacity.search's evaluate: seed s's metric at N replicas is 1 - 4 / N + offsets[s]."""

    def evaluate(asks):
        return {
            (unit, n): capacity.judge({"m": 1 - 4 / n + offsets}, objective) for unit, n in asks
        }

    return evaluate


def size(offsets, text, most=64, least=1, start=1):
    propose = lambda unit, judged: sizing.next_counts(judged, least, most, start)  # noqa: E731
    judged = capacity.search(
        synthetic(offsets, parse_objectives(text)), ["a"], None, propose=propose
    )["a"]
    return sizing.Fewest.of(judged)


def test_the_count_search_finds_the_fewest_that_meets_and_its_neighbour_that_fails():
    offsets = np.random.default_rng(3).normal(0, 0.02, 8)
    fewest = size(offsets, "m>=0.8")  # 1 - 4/N >= 0.8 from N = 20 on (the seeds' mean: near it)
    assert fewest.replicas == math.ceil(4 / (0.2 + offsets.mean()))
    assert fewest.fails_at == fewest.replicas - 1
    assert fewest.ci_low <= fewest.replicas <= fewest.ci_high
    assert fewest.counts_tried < 15
    answers = [size(offsets, f"m>={t}").replicas for t in (0.5, 0.8, 0.9)]
    assert answers == [math.ceil(4 / (1 - t + offsets.mean())) for t in (0.5, 0.8, 0.9)]
    assert answers == sorted(answers) and answers[0] < answers[-1]


def test_the_count_search_says_where_it_ran_out_of_replicas():
    flat = np.zeros(4)
    never = size(flat, "m>=0.99", most=16)  # needs 400
    assert never.replicas is None and never.ci_high is None and never.fails_at == 16
    always = size(flat, "m>=-5")
    assert always.replicas == 1 and always.fails_at is None and always.ci_low == 1


# ------------------------------------------------------------------ sizing, on the simulator


def mm1_fewest(rate, deadline, target):
    """The fewest N for which random routing of Poisson arrivals at ``rate`` to N M/M/1 replicas
    (mu 1) answers ``target`` within ``deadline``: each replica's sojourn is exponential of rate
    mu - rate / N."""
    return next(
        n
        for n in range(1, 1000)
        if rate / n < 1 and stats.expon(scale=1 / (1 - rate / n)).cdf(deadline) >= target
    )


MM1 = [
    "capacity",
    "--policy",
    "none",
    "--deadline",
    "5",
    "--service",
    "exponential",
    "--mean-service",
    "1",
    "--objective",
    "share_good>=0.9",
    "--router",
    "random",
    "--seconds",
    "1000",
    "--seeds",
    "5",
    "--workers",
    "1",
]


def test_sizing_random_routing_to_mm1_replicas_matches_the_closed_form(tmp_path, capsys):
    assert mm1_fewest(2, 5, 0.9) == 4  # N = 3: P(W <= 5) = 0.81; 4: 0.92
    assert main([*MM1, "--rate", "2", "--json", "--out", str(tmp_path / "two")]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["replicas"] == 4 and record["fails_at"] == 3 and record["router"] == "random"
    assert record["ci_low"] <= 4 <= record["ci_high"] and record["load"] == pytest.approx(0.5)
    report = json.loads((tmp_path / "two" / "sizing.json").read_text())
    shares = {t["replicas"]: t["values"]["share_good"]["mean"] for t in report["tried"]}
    assert shares[3] == pytest.approx(1 - math.exp(-5 / 3), abs=0.03)
    assert list(shares.values()) == sorted(shares.values())  # more replicas, more in time


@pytest.mark.slow  # two searches of 5 seeds of 1000 s
def test_sizing_grows_with_the_rate_as_the_closed_form_does(tmp_path, capsys):
    for rate in (3, 5):
        assert main([*MM1, "--rate", str(rate), "--json", "--out", str(tmp_path / str(rate))]) == 0
        (record,) = json.loads(capsys.readouterr().out)
        assert record["replicas"] == mm1_fewest(rate, 5, 0.9)  # 6 and 10


# Batching replicas of 4 sequences, steps of 10 ms + 0.2 ms a sequence: about 21 requests/s each.
BATCH_SIZING = [
    "capacity",
    "--policy",
    "none",
    "--objective",
    "share_good>=0.9",
    "--batching",
    "--max-num-seqs",
    "4",
    "--step",
    "0.01,0,0.0002,0",
    "--seconds",
    "30",
    "--seeds",
    "2",
    "--workers",
    "1",
    "--json",
]


def batch_sizing(tmp_path, capsys, rate: float) -> tuple[dict, dict]:
    out = tmp_path / str(rate)
    assert main([*BATCH_SIZING, "--rate", str(rate), "--out", str(out)]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    report = json.loads((out / "sizing.json").read_text())
    return record, {t["replicas"]: t["values"]["share_good"]["mean"] for t in report["tried"]}


def test_sizing_batching_replicas_finds_the_fewest_that_keep_up(tmp_path, capsys):
    record, shares = batch_sizing(tmp_path, capsys, 30)
    n = record["replicas"]
    assert n >= 2 and record["fails_at"] == n - 1 and record["load"] <= 1  # 30 over ~21 each
    assert list(shares.values()) == sorted(shares.values())  # more replicas, more in time
    assert shares[n] >= 0.9 > shares[n - 1]


@pytest.mark.slow  # two searches
def test_sizing_batching_replicas_grows_with_the_rate(tmp_path, capsys):
    low, _ = batch_sizing(tmp_path, capsys, 30)
    high, shares = batch_sizing(tmp_path, capsys, 90)
    each = 30 / (low["replicas"] * low["load"])  # one replica's saturated requests/s
    assert high["replicas"] > low["replicas"] and high["replicas"] >= math.ceil(90 / each)
    assert list(shares.values()) == sorted(shares.values())


def test_sizing_prints_a_row_per_router(tmp_path, capsys):
    args = [
        "capacity",
        "--policy",
        "none",
        "--service",
        "exponential",
        "--mean-service",
        "1",
        "--objective",
        "share_good>=0.5",
        "--seconds",
        "60",
        "--seeds",
        "2",
        "--workers",
        "1",
        "--rate",
        "1.5",
        "--router",
        "random",
        "--router",
        "central",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "the fewest replicas at which share_good>=0.5" in out and "1.5 requests/s" in out
    lines = out.splitlines()
    assert [line.split()[1] for line in lines[2:4]] == ["random", "central"]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["capacity"]["rate_rps"] == 1.5 and manifest["config"]["grid"]["replicas"]


def test_capacity_of_a_fleet(tmp_path, capsys):
    args = [
        "capacity",
        "--policy",
        "none",
        "--service",
        "exponential",
        "--mean-service",
        "1",
        "--objective",
        "share_good>=0.5",
        "--seconds",
        "200",
        "--seeds",
        "3",
        "--workers",
        "1",
        "--tolerance",
        "0.2",
        "--replicas",
        "2",
        "--router",
        "power_of_d",
        "--json",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["replicas"] == 2 and record["router"] == "power_of_d"
    # The rate counts both replicas: load x 2 requests/s.
    assert record["rate_rps"] == pytest.approx(2 * record["load"])
    rows = pd.read_parquet(tmp_path / "cells", columns=["replica"])
    assert set(rows["replica"]) == {0, 1}
    assert "admission_at" not in record


def test_capacity_of_a_fleet_admitting_at_the_gate(tmp_path, capsys):
    args = [
        "capacity",
        "--policy",
        "bounded",
        "--service",
        "exponential",
        "--mean-service",
        "1",
        "--objective",
        "share_good>=0.5",
        "--seconds",
        "100",
        "--seeds",
        "2",
        "--workers",
        "1",
        "--tolerance",
        "0.3",
        "--replicas",
        "2",
        "--router",
        "jsq",
        "--admission-at",
        "gate",
        "--json",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["admission_at"] == "gate" and record["replicas"] == 2
    cells = pd.read_parquet(tmp_path / "cells", columns=["admission_at"])
    assert set(cells["admission_at"]) == {"gate"}


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--rate", "0"], "--rate"),
        (["--rate", "-1"], "--rate"),
        (["--rate", "2", "--replicas", "4"], "not both"),
        (["--rate", "2", "--start", "0.5"], "--start bounds a search over load"),
        (["--max-replicas", "8"], "give --rate"),
        (["--router", "random"], "--router routes between"),
        (["--replicas", "2", "--router-d", "3"], "give --router power_of_d"),
        (["--replicas", "2", "--router", "fastest"], "unknown router"),
        (["--admission-at", "gate"], "--admission-at is where a fleet admits"),
        (["--replicas", "2", "--admission-at", "pod"], "a fleet admits at one of replica, gate"),
        (["--rate", "2", "--concurrency", "0.1"], "concurrency 0"),
    ],
)
def test_bad_fleet_and_sizing_input_is_one_line_and_exit_2(tmp_path, capsys, extra, says):
    args = [
        "capacity",
        "--policy",
        "none",
        "--objective",
        "share_good>=0.9",
        *extra,
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ --rate on qlab simulate


def simulate_json(capsys, *extra):
    args = [
        "simulate",
        "--service",
        "exponential",
        "--mean-service",
        "0.5",
        "--engines",
        "2",
        "--requests",
        "2000",
        "--json",
        *extra,
    ]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_a_rate_is_the_load_of_all_engines_at_the_mean_service(capsys):
    # 4 replicas of 2 engines of mean 0.5 s take 16 requests/s at load 1: 12 requests/s is load
    # 0.75.
    fleet = ["--replicas", "4", "--router", "random"]
    by_rate = simulate_json(capsys, "--rate", "12", *fleet)
    by_load = simulate_json(capsys, "--load", "0.75", *fleet)
    assert by_rate["config"]["load"] == pytest.approx(0.75)
    assert by_rate["summary"] == by_load["summary"]
    assert (
        main(
            [
                "simulate",
                "--rate",
                "12",
                "--replicas",
                "4",
                "--router",
                "random",
                "--requests",
                "200",
            ]
        )
        == 0
    )
    # The reference mix: 6.79 requests/s per engine at load 1, so 12 over 4 replicas is load 0.442.
    assert "poisson arrivals at 12 requests/s, load 0.44" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--rate", "0"], "--rate: value must be > 0"),
        (["--rate", "2", "--load", "0.5"], "give --rate or --load"),
        (["--rate", "2", "--arrivals", "burst:10"], "bring their own rate"),
    ],
)
def test_bad_rates_are_one_line_and_exit_2(capsys, extra, says):
    assert main(["simulate", "--requests", "10", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
