"""Sweep axes of the arrival process and of a policy's parameters; arrivals that take no load;
old configs unchanged."""

import json

import numpy as np
import pandas as pd
import pytest

from experiments import commands, config, sweep
from qsim import make_trace

# before these axes existed
TINY_DIGEST = "552621a266adb9a7fe15a2ca31c3edee4348bc67837defa45399395dc0f38c9b"

AXES = """
[sweep]
duration_s = 30
seeds = 2
[grid]
policy = ["predictive", "adaptive-lifo"]
load = [0.5, 2.0]
arrivals = ["poisson", "periodic:10"]
[policy_args.adaptive-lifo]
lifo_threshold = [2, 16]
expire_at_front = false
"""


def load_text(tmp_path, text, name="s.toml"):
    path = tmp_path / name
    path.write_text(text)
    return config.load(path)


@pytest.fixture(scope="module")
def axes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("axes")
    cfg = load_text(tmp, AXES)
    summary = sweep.run(cfg, tmp / "out", workers=1, quiet=True)
    return cfg, tmp / "out", summary


def test_a_config_without_the_new_axes_keeps_its_digest_and_cells():
    cfg = config.load("docs/examples/tiny.toml")
    assert cfg.digest == TINY_DIGEST
    assert [c.id for c in sweep.cells(cfg)][:1] == ["57010b41f132e792"]
    assert all(c.arrivals is None and c.policy_args is None for c in sweep.cells(cfg))
    assert "arrivals" not in cfg.canonical()["grid"] and "service_dist" not in cfg.canonical()


def test_the_arrival_and_parameter_axes_make_their_cells(axes):
    cfg, out, summary = axes
    # predictive once, adaptive-lifo once per threshold; x 2 loads x 2 processes x 2 seeds
    assert len(summary) == 3 * 2 * 2 * 2 and summary["cell_id"].is_unique
    variants = summary.groupby("policy")["policy_args"].unique()
    assert summary.loc[summary["policy"] == "predictive", "policy_args"].isna().all()
    assert sorted(variants["adaptive-lifo"]) == ["lifo_threshold=16", "lifo_threshold=2"]
    assert set(summary["arrivals"]) == {"poisson", "periodic:10"}
    # The threshold reached the policy: its cells differ, and each is its policy at that value.
    two, sixteen = (cfg.policy("adaptive-lifo", f"lifo_threshold={v}") for v in (2, 16))
    assert (two.lifo_threshold, sixteen.lifo_threshold, two.expire_at_front) == (2, 16, False)
    lifo = summary[(summary["policy"] == "adaptive-lifo") & (summary["load"] == 2.0)]
    assert lifo.groupby("policy_args")["latency_p50_s"].mean().nunique() == 2


def test_a_cell_is_make_trace_of_its_arrival_process_at_its_load(axes):
    cfg, out, summary = axes
    for arrivals in ("poisson", "periodic:10"):
        for load in (0.5, 2.0):
            rows = sweep.load_rows(out, arrivals=arrivals, load=load, policy="predictive", seed=1)
            trace = make_trace(arrivals, load=load, seconds=30, seed=1)
            np.testing.assert_array_equal(
                rows.sort_values("request_id")["arrival_s"], trace.arrival_s
            )
    # The bug: periodic bursts at loads 0.5 and 2 were the same cells. Now they are the
    # load's.
    periodic = summary[(summary["arrivals"] == "periodic:10") & (summary["policy"] == "predictive")]
    requests = periodic.groupby("load")["requests"].mean()
    assert requests[2.0] == pytest.approx(4 * requests[0.5], rel=0.05)


def test_the_summary_table_and_figures_tell_the_variants_apart(axes, tmp_path):
    _, out, summary = axes
    table = commands.summary_table(summary)
    assert {"arrivals", "policy_args"} <= set(table.columns) and len(table) == 3 * 2 * 2
    assert set(table["policy_args"]) == {"none", "lifo_threshold=2", "lifo_threshold=16"}
    from analysis import plots

    labels = set(plots.per_variant(summary)["policy"])
    assert (
        "adaptive-lifo / poisson / lifo_threshold=2" in labels
        and ("predictive / periodic:10 / preset") in labels
    )


def test_a_burst_of_its_own_size_has_no_load_axis(tmp_path):
    cfg = load_text(
        tmp_path,
        '[sweep]\narrivals = "burst:12"\nduration_s = 1\nseeds = 2\n[grid]\npolicy = ["bounded"]\n',
    )
    summary = sweep.run(cfg, tmp_path / "out", workers=1, quiet=True)
    assert (
        summary["load"].isna().all()
        and (summary["requests"] == 12).all()
        and (summary["rejected"] == 3).all()
    )


def test_exponential_service_in_a_sweep(tmp_path):
    cfg = load_text(
        tmp_path,
        '[sweep]\nservice_dist = "exponential"\nmean_service_s = '
        "0.5\nduration_s = 400\nseeds = 1\n"
        '[grid]\npolicy = ["none"]\nload = [0.5]\n',
    )
    assert cfg.canonical()["service_dist"] == "exponential"
    summary = sweep.run(cfg, tmp_path / "out", workers=1, quiet=True)
    rows = sweep.load_rows(tmp_path / "out")
    assert (
        rows["true_service_s"].mean() == pytest.approx(0.5, rel=0.1)
        and summary["capacity_rps"].iloc[0] == 2.0
    )
    assert summary["offered_load"].iloc[0] == pytest.approx(0.5, rel=0.1)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '[sweep]\narrivals = "burst:30"\n[grid]\npolicy = ["none"]\nload = [1.0]\n',
            "sweep.arrivals 'burst:30' takes no load",
        ),
        (
            '[grid]\npolicy = ["none"]\nload = [1.0]\narrivals = ["poisson", "periodic:20:10"]\n',
            "grid.arrivals 'periodic:20:10' takes no load",
        ),
        ('[grid]\npolicy = ["none"]\narrivals = ["periodic:10"]\n', "the grid needs load"),
        (
            '[sweep]\narrivals = "poisson"\n[grid]\npolicy = ["none"]\nload = [1.0]\narrivals = '
            '["constant"]\n',
            "sweep.arrivals and grid.arrivals exclude each other",
        ),
        (
            '[grid]\npolicy = ["none"]\nload = [1.0]\narrivals = ["pareto"]\n',
            "grid.arrivals[0]: bad arrival process",
        ),
        (
            '[grid]\npolicy = ["none"]\nload = [1.0]\narrivals = ["poisson", "poisson"]\n',
            "grid.arrivals: a value appears twice",
        ),
        (
            '[grid]\npolicy = ["codel"]\nload = [1.0]\n[policy_args.codel]\ncodel_target_s = []\n',
            "policy_args.codel.codel_target_s: empty list",
        ),
        (
            '[grid]\npolicy = ["codel"]\nload = [1.0]\n[policy_args.codel]\ncodel_target_s = '
            "[0.1, 0.1]\n",
            "policy_args.codel.codel_target_s: a value appears twice",
        ),
        (
            '[grid]\npolicy = ["codel"]\nload = [1.0]\n[policy_args.codel]\ncodel_target_s = '
            '[0.1, "x"]\n',
            "policy_args.codel: policy parameter codel_target_s: expected float, got 'x'",
        ),
        (
            '[grid]\npolicy = ["codel"]\nload = [1.0]\n[policy_args.codel]\naging = [0.01, 0.05]\n',
            "policy 'codel' has no parameter 'aging'",
        ),
        (
            '[grid]\npolicy = ["bounded"]\nload = [1.0]\nmax_queue = '
            "[4]\n[policy_args.bounded]\nmax_queue = [4, 8]\n",
            "policy_args.bounded.max_queue: the grid's max_queue axis sets it",
        ),
        (
            '[sweep]\nservice_dist = "pareto"\n[grid]\npolicy = ["none"]\nload = [1.0]\n',
            "sweep.service_dist: expected one of",
        ),
        (
            '[sweep]\nmean_service_s = 1\n[grid]\npolicy = ["none"]\nload = [1.0]\n',
            "sweep.mean_service_s applies to",
        ),
    ],
)
def test_bad_axes_are_one_clear_error(tmp_path, text, message):
    with pytest.raises(config.ConfigError) as err:
        load_text(tmp_path, text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_parameter_axis_changes_the_digest_and_keeps_the_other_policies_cells(tmp_path):
    plain = load_text(
        tmp_path, '[grid]\npolicy = ["predictive", "codel"]\nload = [1.0]\n', "a.toml"
    )
    axis = load_text(
        tmp_path,
        '[grid]\npolicy = ["predictive", "codel"]\nload = [1.0]\n'
        "[policy_args.codel]\ncodel_target_s = [0.05, 0.2]\n",
        "b.toml",
    )
    assert plain.digest != axis.digest
    same = {c.id for c in sweep.cells(plain) if c.policy == "predictive"}
    assert same == {c.id for c in sweep.cells(axis) if c.policy == "predictive"}
    assert json.dumps(axis.canonical()["policy_args"]) == (
        '{"codel": {"codel_target_s": [0.05, 0.2]}}'
    )
    assert (
        pd.Series([c.policy_args for c in sweep.cells(axis) if c.policy == "codel"]).nunique() == 2
    )
