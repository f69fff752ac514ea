"""The estimation, stale-estimator and cancellation experiments (issue 12): their sweep axes,
per-cell columns, tables and figures. Every comparison is between cells of the same seeds (common
random numbers) and is deterministic: no wall clock, no margin that a slow machine could break."""

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import estimation, plots
from experiments import cli, config, config_grid, sweep
from qsim import PRESETS, make_trace, simulate
from qsim.config import ServerConfig
from qsim.mixes import UsedShare

ROOT = Path(__file__).resolve().parents[1]

# A config without the new axes: its digest and cell ids were taken before those axes existed, so a
# folder it wrote is still resumed (sweep.OPTIONAL_AXES).
OLD = """
[sweep]
name = "old"
duration_s = 30
seeds = 2
arrivals = "surge:5:5:2.5"
fixed_estimate = true

[retry.naive]
mode = "immediate"
max_attempts = 3

[grid]
policy = ["none", "predictive"]
load = [0.8, 2.0]
speed = [1.0, 2.25]
retry = ["none", "naive"]
patience = ["none", "exponential:30"]
"""
OLD_DIGEST = "bd2d593218dd98fe0e1f72b4779cdac49856c4aa5445001eb63645bf956ba707"
OLD_IDS = "87c9980741b8274d1c178877701b77260795bb76bdd9a67cdf1581f63e82ba28"

NEW = """
[sweep]
duration_s = 30
seeds = 2
[grid]
policy = ["predictive"]
load = [2.0]
estimator = ["limit", "learned", "oracle"]
used = ["none", "study", "0.1:0.2:0.5"]
speed_schedule = ["none", "10:2.2"]
fixed_estimate = [false, true]
cancel_at_deadline = [false, true]
"""


def write(tmp_path, text, name="s.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------ config


def test_old_config_keeps_digest_and_cell_ids(tmp_path):
    cfg = config.load(write(tmp_path, OLD, "old.toml"))
    cells = sweep.cells(cfg)
    assert cfg.digest == OLD_DIGEST
    assert hashlib.sha256("".join(c.id for c in cells).encode()).hexdigest() == OLD_IDS
    # Its rows and summary carry none of the new axes' columns, nor the estimation columns.
    result = sweep.run_cell(cfg, cells[0])
    assert not {*sweep.ESTIMATION_AXES, "refused_would_fit", "engine_s_saved"} & set(result.summary)


def test_new_axes_parse_into_cells(tmp_path):
    cfg = config.load(write(tmp_path, NEW))
    assert cfg.grid["estimator"] == ("limit", "learned", "oracle")
    assert cfg.grid["fixed_estimate"] == (False, True) and cfg.grid["cancel_at_deadline"] == (
        False,
        True,
    )
    cells = sweep.cells(cfg)
    assert len(cells) == 3 * 3 * 2 * 2 * 2 * 2 and len({c.id for c in cells}) == len(cells)
    # "none" is the cell without (None), as for clients, retry and patience.
    assert {c.used for c in cells} == {None, "study", "0.1:0.2:0.5"}
    assert {c.speed_schedule for c in cells} == {None, "10:2.2"}
    cell = next(c for c in cells if c.estimator == "learned" and c.cancel_at_deadline)
    policy = sweep._policy(cfg, cell)
    assert (policy.estimator, policy.cancel_at_deadline, policy.name) == (
        "learned",
        True,
        "predictive",
    )
    assert config_grid.parse_used("study") == UsedShare() and config_grid.parse_used("none") is None
    assert config_grid.parse_used("0.1:0.2:0.5") == UsedShare(0.1, 0.2, 0.5)


@pytest.mark.parametrize(
    "grid, needle",
    [
        ('estimator = ["guess"]', "grid.estimator[0]: unknown estimator 'guess'"),
        ('used = ["x"]', "grid.used[0]: expected none, study or AT_LIMIT:MEDIAN:SIGMA"),
        ('used = ["0.1:2:1"]', "grid.used[0]: median used share must be in (0, 1]"),
        (
            'speed_schedule = ["20"]',
            "grid.speed_schedule[0]: speed schedule entries are SECONDS:FACTOR",
        ),
        (
            'speed_schedule = ["20:2,10:1"]',
            "grid.speed_schedule[0]: speed schedule times must be >= 0 and increasing",
        ),
        ('speed_schedule = ["20:0"]', "grid.speed_schedule[0]: speed factors must be > 0"),
        (
            'cancel_at_deadline = ["yes"]',
            "grid.cancel_at_deadline[0]: expected bool, got str 'yes'",
        ),
        ("fixed_estimate = [1]", "grid.fixed_estimate[0]: expected bool, got int 1"),
        ('estimator = ["limit", "limit"]', "grid.estimator: a value appears twice"),
    ],
)
def test_bad_axis_values_are_one_line_naming_the_key(tmp_path, grid, needle):
    path = write(tmp_path, f'[grid]\npolicy = ["predictive"]\nload = [1.0]\n{grid}\n')
    with pytest.raises(config.ConfigError) as err:
        config.load(path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_fixed_estimate_in_sweep_and_grid_is_refused(tmp_path):
    path = write(
        tmp_path,
        '[sweep]\nfixed_estimate = true\n[grid]\npolicy = ["none"]\nload = '
        "[1.0]\n"
        "fixed_estimate = [false, true]\n",
    )
    with pytest.raises(
        config.ConfigError, match="sweep.fixed_estimate and grid.fixed_estimate exclude each other"
    ):
        config.load(path)


def test_the_fixed_estimate_axis_overrides_the_sweeps(tmp_path):
    """A cell's fixed_estimate is the one simulate gets: with a speed change, the fixed cell
    keeps factor 1."""
    cfg = config.load(
        write(
            tmp_path,
            "[sweep]\nduration_s = 30\nseeds = 1\n[grid]\npolicy = "
            '["predictive"]\n'
            'load = [0.9]\nspeed_schedule = ["5:2.2"]\nfixed_estimate '
            "= [false, true]\n",
        )
    )
    tracking, fixed = (sweep.run_cell(cfg, c).summary for c in sweep.cells(cfg))
    assert fixed["late_share_after_change"] > tracking["late_share_after_change"]


# ------------------------------------------------------------------ the three experiment files,
# tiny


def _tiny(name: str, tmp_path_factory) -> pd.DataFrame:
    cfg = dataclasses.replace(
        config.load(ROOT / "experiments" / f"{name}.toml"), duration_s=30.0, seeds=2
    )
    return sweep.run(cfg, tmp_path_factory.mktemp(name) / "out", workers=1, quiet=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {name: _tiny(name, tmp_path_factory) for name in ("estimation", "stale", "cancellation")}


def _finite_intervals(table: pd.DataFrame, columns) -> None:
    for col in columns:
        for part in (col, f"{col}_low", f"{col}_high"):
            assert np.isfinite(table[part].astype(float)).all(), part


def test_estimation_table(tiny):
    table = estimation.estimation_table(tiny["estimation"])
    assert len(table) == 9 and set(table["estimator"]) == {"limit", "learned", "oracle"}
    assert sorted(set(table["load"])) == [0.8, 1.5, 3.0] and (table["n"] == 2).all()
    _finite_intervals(
        table,
        ["goodput_rps", "share_refused", "share_late", "refused_would_fit", "admitted_missed"],
    )


def test_stale_table(tiny):
    table = estimation.stale_table(tiny["stale"])
    assert len(table) == 4 and set(table["policy"]) == {"bounded-deadline", "predictive"}
    assert set(table["fixed_estimate"]) == {False, True}
    _finite_intervals(table, ["late_share_of_completed", "late_share_after_change", "goodput_rps"])
    # The machine is 2.2x slower from 20 s: a fixed estimate admits what then cannot make it.
    after = table.set_index(["policy", "fixed_estimate"])["late_share_after_change"]
    for policy in ("bounded-deadline", "predictive"):
        assert after[(policy, True)] > after[(policy, False)]


def test_cancellation_table(tiny):
    table = estimation.cancellation_table(tiny["cancellation"])
    assert len(table) == 3 * 3 * 2
    _finite_intervals(table, ["goodput_rps", "engine_s_saved", "engine_s_total"])
    cut = table["cancel_at_deadline"] == True  # noqa: E712 (numpy bools)
    _finite_intervals(table[cut], ["goodput_gained_rps"])
    assert table.loc[~cut, "goodput_gained_rps"].isna().all()
    # The paired difference is the difference of the means (same seeds on both sides).
    wide = table.set_index(["policy", "load", "cancel_at_deadline"])["goodput_rps"]
    for _, row in table[cut].iterrows():
        key = (row["policy"], row["load"])
        assert row["goodput_gained_rps"] == pytest.approx(wide[(*key, True)] - wide[(*key, False)])


def test_the_oracle_refuses_nothing_that_would_fit(tiny):
    """By construction: at the calibrated speed without noise its estimate is the true time, and the
    wait rebuilt from the rows is the one the queue decided on, so a refusal means it did not
    fit."""
    summary = tiny["estimation"]
    oracle = summary[summary["estimator"] == "oracle"]
    assert (oracle["refused_would_fit"] == 0).all() and (oracle["admitted_missed"] == 0).all()
    assert (oracle["est_rel_error_median"] < 1e-9).all()
    # it did refuse: not vacuous
    assert (oracle.loc[oracle["load"] == 3.0, "share_refused"] > 0).all()
    # The column sees the limit's errors: it refuses requests that would have fit.
    limit = summary[(summary["estimator"] == "limit") & (summary["load"] >= 1.5)]
    assert (limit["refused_would_fit"] > 0).all()


def test_learned_refuses_fewer_than_the_limit_at_overload(tiny):
    """Paired by seed (the same arrivals and early stops): at load 3 the learned estimate refuses
    fewer requests than the estimate from the limit, and answers more in time."""
    summary = tiny["estimation"]
    at3 = summary[summary["load"] == 3.0].set_index(["estimator", "seed"])
    for seed in sorted(set(summary["seed"])):
        learned, limit = at3.loc[("learned", seed)], at3.loc[("limit", seed)]
        assert learned["share_refused"] < limit["share_refused"]
        assert learned["goodput_rps"] > limit["goodput_rps"]


def test_cancellation_saves_engine_seconds_and_keeps_the_arrivals(tiny):
    summary = tiny["cancellation"]
    cut = summary[summary["cancel_at_deadline"] == True]  # noqa: E712
    assert (cut["cancelled"] > 0).any()
    assert (cut.loc[cut["cancelled"] > 0, "engine_s_saved"] > 0).all()
    assert (summary.loc[summary["cancelled"] == 0, "engine_s_saved"] == 0).all()
    pairs = summary.pivot_table(
        index=["policy", "load", "seed"], columns="cancel_at_deadline", values="requests"
    )
    assert (pairs[True] == pairs[False]).all()


def test_cutting_on_one_trace():
    """The same trace with and without cutting: the same requests; cut runs end at their deadline,
    and the engine seconds are those the rows show."""
    trace = make_trace(load=2.0, seconds=60, seed=4, used=UsedShare())
    off = simulate(trace, PRESETS["none"])
    on = simulate(trace, dataclasses.replace(PRESETS["none"], cancel_at_deadline=True))
    assert len(on) == len(off) and np.array_equal(on["arrival_s"], off["arrival_s"])
    cut = on[on["outcome"] == "cancelled"]
    assert len(cut) and np.allclose(cut["finish_s"], cut["arrival_s"] + cut["deadline_s"])
    seconds = estimation.engine_seconds(on)
    held = (cut["finish_s"] - cut["start_s"]).sum()
    assert seconds["engine_s_cancelled"] == pytest.approx(held)
    assert seconds["engine_s_saved"] == pytest.approx((cut["true_service_s"]).sum() - held)
    assert estimation.engine_seconds(off)["engine_s_saved"] == 0


@pytest.mark.parametrize("engines", [1, 3])
def test_the_rebuilt_wait_is_the_one_decided_on(engines):
    """With a fixed estimate (the speed factor never moves) the wait rebuilt from the rows
    reproduces every predictive decision: a request refused as unreachable had wait + estimate past
    its deadline, and one admitted had not."""
    trace = make_trace(load=1.8, seconds=60, seed=5, engines=engines, used=UsedShare())
    frame = simulate(trace, ServerConfig(PRESETS["predictive"], engines, fixed_estimate=True))
    wait = estimation.predicted_wait(frame, engines)
    over = wait + frame["est_service_s"].to_numpy() > frame["deadline_s"].to_numpy() + 1e-9
    refused = frame["reason"].eq("deadline_unreachable").fillna(False).to_numpy(dtype=bool)
    assert refused.sum() > 10 and (~refused).sum() > 10
    assert np.array_equal(over, refused)


# ------------------------------------------------------------------ figures and the command line


def test_figures(tiny, tmp_path):
    for draw, name in (
        (plots.estimation, "estimation"),
        (plots.stale, "stale"),
        (plots.cancellation, "cancellation"),
    ):
        fig = draw(tiny[name])
        assert len(fig.axes) >= 3
        plots.plt.close(fig)


@pytest.mark.slow  # qlab plot end to end, every figure drawn: 6 s of CPU
def test_plot_draws_the_stale_figure_only_for_a_stale_sweep(tiny, tmp_path):
    summary = tiny["stale"]
    by_class = pd.DataFrame(
        summary[["policy", "speed", "load", "seed"]].assign(size_class="4", share_good=1.0)
    )
    paths = plots.save_all(summary, by_class, None, tmp_path)
    names = {p.stem for p in paths}
    assert "stale" in names and not {"estimation", "cancellation"} & names


def test_simulate_flags(capsys):
    assert (
        cli.main(
            [
                "simulate",
                "--policy",
                "predictive",
                "--load",
                "2",
                "--seconds",
                "30",
                "--used",
                "study",
                "--policy-arg",
                "estimator=oracle",
                "--speed-schedule",
                "10:2.2",
                "--json",
            ]
        )
        == 0
    )
    assert '"estimator": "oracle"' in capsys.readouterr().out
    for bad, needle in (
        (["--used", "0.5"], "argument --used"),
        (["--speed-schedule", "x"], "argument --speed-schedule"),
        (["--policy-arg", "estimator=guess"], "unknown estimator 'guess'"),
    ):
        assert cli.main(["simulate", "--seconds", "5", *bad]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1
