"""Figures fit for a paper: one colour per policy in every figure, a latency CDF with a sensible
axis and a title naming its load, panels wrapped into rows, readable outcome labels, legends over
nothing, objective lines."""

import itertools

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_hex

from analysis import plots
from analysis.objectives import Objective, parse_objectives
from analysis.styles import OTHER_COLORS, POLICY_COLORS, policy_color, policy_order, policy_styles
from experiments import config, sweep
from experiments.cli import main
from qsim.policy import PRESETS

SEVEN = [
    "none",
    "bounded",
    "bounded-deadline",
    "predictive",
    "predictive-sjf",
    "adaptive-lifo",
    "codel",
]
GRID = f"""
[sweep]
duration_s = 20
seeds = 2
[grid]
policy = {SEVEN!r}
load = [0.5, 1.5]
speed = [1.0, 2.25]
"""
CANCEL = """
[sweep]
duration_s = 20
seeds = 2
[grid]
policy = ["none", "predictive"]
load = [1.5]
cancel_at_deadline = [true, false]
"""


@pytest.fixture(scope="module")
def seven(tmp_path_factory):
    """A sweep of seven policies at two loads and two speeds (2 seeds of 20 s: a few seconds)."""
    out = tmp_path_factory.mktemp("figures") / "seven"
    path = out.parent / "seven.toml"
    path.write_text(GRID)
    summary = sweep.run(config.load(path), out, workers=1, quiet=True)
    by_class = pd.read_parquet(out / "summary_by_class.parquet")
    rows = sweep.load_rows(out, load=1.5, speed=1.0)
    yield out, summary, by_class, rows
    plt.close("all")


def line_colors(fig) -> dict[str, set[str]]:
    """Each labelled line's colours over every axes of ``fig``."""
    found = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            if not line.get_label().startswith("_"):
                found.setdefault(line.get_label(), set()).add(to_hex(line.get_color()))
    return found


def policy_figures(summary, by_class, rows) -> dict[str, plt.Figure]:
    return {
        "share_in_time": plots.share_in_time(summary),
        "goodput": plots.goodput(summary),
        "latency_cdf": plots.latency_cdf(rows, 2.0),
        "policy_comparison": plots.policy_comparison(summary, by_class),
    }


# ------------------------------------------------------------------ one colour per policy


def test_every_preset_has_a_colour_of_its_own():
    assert set(POLICY_COLORS) == set(PRESETS)
    colours = list(POLICY_COLORS.values()) + list(OTHER_COLORS)
    assert len(set(map(str.lower, colours))) == len(colours)
    # A policy of one's own has a colour that depends on its name alone: the same in every figure
    # and run.
    assert policy_color("mymodule:Margin") in OTHER_COLORS
    assert policy_color("mymodule:Margin") == policy_color("mymodule:Margin / two-tenant")


def test_a_policy_keeps_its_colour_in_every_figure_whatever_the_others(seven):
    _, summary, by_class, rows = seven
    subset = ["predictive", "codel"]
    seen = {}
    for policies in (SEVEN, subset):
        frames = [t[t["policy"].isin(policies)] for t in (summary, by_class, rows)]
        for name, fig in policy_figures(*frames).items():
            colours = line_colors(fig)
            for policy in policies:
                assert colours[policy] == {policy_color(policy)}, (name, policy, colours[policy])
                seen.setdefault(policy, set()).update(colours[policy])
            plt.close(fig)
    assert all(len(c) == 1 for c in seen.values())
    # The bars of the policy comparison too.
    fig = plots.policy_comparison(summary, by_class)
    bars = {to_hex(p.get_facecolor()) for p in fig.axes[2].patches}
    assert bars == {policy_color(p) for p in SEVEN}
    plt.close(fig)


def test_cancellation_draws_policies_in_their_colours(tmp_path):
    path = tmp_path / "cancel.toml"
    path.write_text(CANCEL)
    summary = sweep.run(config.load(path), tmp_path / "out", workers=1, quiet=True)
    fig = plots.cancellation(summary)
    lines = line_colors(fig)
    for policy in ("none", "predictive"):
        assert set().union(
            *(c for label, c in lines.items() if label.startswith(policy + ","))
        ) == {policy_color(policy)}
    bars = {to_hex(p.get_facecolor()) for ax in fig.axes[1:3] for p in ax.patches}
    assert bars == {policy_color("none"), policy_color("predictive")}
    plt.close(fig)


def test_variants_keep_their_policys_colour_and_differ_in_line_style():
    styles = policy_styles(
        ["predictive / none", "predictive / two-tenant", "bounded / none", "bounded / two-tenant"]
    )
    assert (
        styles["predictive / none"].color
        == styles["predictive / two-tenant"].color
        == POLICY_COLORS["predictive"]
    )
    assert styles["predictive / none"].linestyle != styles["predictive / two-tenant"].linestyle
    assert styles["predictive / none"].linestyle == styles["bounded / none"].linestyle
    assert styles["predictive / none"].hatch != styles["predictive / two-tenant"].hatch
    assert policy_styles(["predictive"])["predictive"].linestyle == "-"


def test_figures_list_policies_in_one_order_with_a_policys_variants_together():
    labels = [
        "predictive / none",
        "mine:Margin / none",
        "codel / two-tenant",
        "none / none",
        "predictive / two-tenant",
        "codel / none",
        "none / two-tenant",
    ]
    assert policy_order(labels) == [
        "none / none",
        "none / two-tenant",
        "predictive / none",
        "predictive / two-tenant",
        "codel / none",
        "codel / two-tenant",
        "mine:Margin / none",
    ]
    assert policy_order(["codel", "predictive", "none"]) == ["none", "predictive", "codel"]


# ------------------------------------------------------------------ the latency CDF


def test_latency_cdf_has_a_log_axis_of_positive_ticks_and_a_title_naming_its_load(seven):
    *_, rows = seven
    fig = plots.latency_cdf(rows, 2.0)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"  # latencies from a few ms to tens of s
    fig.canvas.draw()
    lo, hi = ax.get_xlim()
    shown = [
        (v, t.get_text()) for v, t in zip(ax.get_xticks(), ax.get_xticklabels()) if lo <= v <= hi
    ]
    assert len(shown) >= 2 and all(
        v > 0 and float(text) == pytest.approx(v) for v, text in shown
    ), shown
    assert ax.get_title() == "latency of the answered at load 1.5, service times x1"
    plt.close(fig)


def test_latency_cdf_is_linear_from_zero_where_latencies_span_little():
    rows = pd.DataFrame(
        {
            "policy": "bounded",
            "outcome": "good",
            "latency_s": np.linspace(1.0, 1.9, 50),
            "load": 0.9,
        }
    )
    fig = plots.latency_cdf(rows)
    ax = fig.axes[0]
    assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0
    assert ax.get_title() == "latency of the answered at load 0.9"
    plt.close(fig)


@pytest.mark.slow  # qlab plot end to end, every figure drawn: 5 s of CPU
def test_a_cdf_load_not_in_the_grid_is_one_clear_error(tiny_sweep, tmp_path, capsys):
    out = tiny_sweep
    code = main(["plot", str(out), "--out", str(tmp_path / "figs"), "--cdf-load", "1.25"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == "qlab: error: --cdf-load 1.25 is not a load of this sweep; its loads: 0.5, 2\n"
    assert not (tmp_path / "figs").exists()
    code = main(["plot", str(out), "--out", str(tmp_path / "figs"), "--cdf-load", "0.5"])
    assert code == 0 and "latency CDF at load 0.5" in capsys.readouterr().out
    assert (tmp_path / "figs" / "latency_cdf.png").exists()


# ------------------------------------------------------------------ layout: wrapped panels, labels,
# legends


def visible_axes(fig):
    return [ax for ax in fig.axes if ax.axison]


def legends(fig):
    return list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]


def drawn_ticks(axis):
    """The tick labels an axis draws: those of ticks inside its view (it keeps a few beyond it,
    undrawn)."""
    lo, hi = sorted(axis.get_view_interval())
    return [
        label
        for value, label in zip(axis.get_ticklocs(), axis.get_ticklabels())
        if lo <= value <= hi
    ]


def overlapping_texts(fig) -> list[tuple[str, str]]:
    """Pairs of visible texts (titles, tick and axis labels, legend entries) whose boxes overlap
    on the canvas."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [fig._suptitle] if fig._suptitle is not None else []
    for ax in visible_axes(fig):
        texts += [
            ax.title,
            ax.xaxis.label,
            ax.yaxis.label,
            *drawn_ticks(ax.xaxis),
            *drawn_ticks(ax.yaxis),
        ]
    for legend in legends(fig):
        texts += [*legend.get_texts(), legend.get_title()]
    boxes = [
        (t.get_text(), t.get_window_extent(renderer))
        for t in texts
        if t.get_visible() and t.get_text()
    ]
    return [
        (a, b)
        for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
        if box_a.overlaps(box_b)
    ]


def assert_legends_cover_nothing(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    found = legends(fig)
    assert found, "a figure of several curves has a legend"
    for legend in found:
        box = legend.get_window_extent(renderer)
        for ax in visible_axes(fig):
            assert not box.overlaps(ax.get_window_extent(renderer)), (
                legend.get_texts()[0].get_text(),
                ax.get_title(),
            )


def test_share_by_class_wraps_seven_panels_into_rows(seven):
    _, _, by_class, _ = seven
    fig = plots.share_by_class(by_class)
    panels = visible_axes(fig)
    assert [ax.get_title() for ax in panels] == SEVEN
    rows = {round(ax.get_position().y0, 3) for ax in panels}
    assert len(rows) == 2  # 4 + 3, not 7 in one row
    width, height = fig.get_size_inches()
    assert width / height < 3
    # The legend is in the eighth, empty slot.
    spare = [ax for ax in fig.axes if not ax.axison]
    assert len(spare) == 1 and spare[0].get_legend() is not None
    assert_legends_cover_nothing(fig)
    assert overlapping_texts(fig) == []
    plt.close(fig)


def test_outcome_panels_are_named_in_full_and_no_label_overlaps(seven):
    _, summary, _, _ = seven
    fig = plots.outcome_bars(summary)
    titles = [ax.get_title() for ax in visible_axes(fig)]
    assert titles == [f"{p}, service times x{s:g}" for s in (1, 2.25) for p in SEVEN]
    for ax in visible_axes(fig):
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0.5", "1.5"]
    assert overlapping_texts(fig) == []
    assert_legends_cover_nothing(fig)
    plt.close(fig)


def test_no_legend_covers_a_panel_and_no_text_overlaps_in_any_figure(seven):
    _, summary, by_class, rows = seven
    for name, fig in policy_figures(summary, by_class, rows).items():
        assert_legends_cover_nothing(fig)
        assert overlapping_texts(fig) == [], name
        plt.close(fig)


# ------------------------------------------------------------------ objectives


def test_objectives_parse():
    assert parse_objectives("share_good>=0.9") == (Objective("share_good", ">=", 0.9),)
    assert parse_objectives("share_good=0.9 and latency_p99_s=2") == (
        Objective("share_good", ">=", 0.9),
        Objective("latency_p99_s", "<=", 2.0),
    )
    assert parse_objectives("latency_p99_s <= 2")[0].quantile == 0.99
    assert Objective("share_good", ">=", 0.9).quantile is None
    assert parse_objectives("share_good>0.9") == (Objective("share_good", ">", 0.9),)
    assert parse_objectives("ttft_p99_s=0.5")[0].op == "<="  # a time's good direction is down
    for bad in (
        "share_good",
        "share_good=>0.9",
        "share_good>=x",
        "share_good>=nan",
        ">=0.9",
        "share_good>=0.9 and",
    ):
        with pytest.raises(ValueError, match="objective"):
            parse_objectives(bad)


def objective_lines(fig, text):
    return [
        (ax.get_title(), line.get_ydata()[0])
        for ax in fig.axes
        for line in ax.get_lines()
        if line.get_label() == f"objective {text}"
    ]


def test_an_objective_is_a_line_on_every_panel_of_its_metric(seven):
    _, summary, by_class, rows = seven
    share = parse_objectives("share_good>=0.9")
    fig = plots.share_in_time(summary, share)
    assert objective_lines(fig, "share_good ≥ 0.9") == [
        ("service times x1", 0.9),
        ("service times x2.25", 0.9),
    ]
    plt.close(fig)
    fig = plots.goodput(summary, parse_objectives("goodput_rps>=3"))
    assert [t for t, _ in objective_lines(fig, "goodput_rps ≥ 3")] == [
        "good requests/s, service times x1 (capacity 6.79)",
        "good requests/s, service times x2.25 (capacity 3.02)",
    ]
    plt.close(fig)
    fig = plots.share_by_class(by_class, share)
    assert len(objective_lines(fig, "share_good ≥ 0.9")) == len(SEVEN)
    assert_legends_cover_nothing(fig)
    plt.close(fig)
    fig = plots.latency_cdf(rows, 2.0, parse_objectives("latency_p99_s<=1.5"))
    ax = fig.axes[0]
    assert [
        line.get_xdata()[0]
        for line in ax.get_lines()
        if line.get_label() == "objective latency_p99_s ≤ 1.5"
    ] == [1.5]
    assert any(line.get_ydata()[0] == 0.99 for line in ax.get_lines())
    plt.close(fig)


@pytest.mark.slow  # qlab plot end to end, every figure drawn: 5 s of CPU
def test_plot_draws_the_objective_and_refuses_one_no_figure_draws(tiny_sweep, tmp_path, capsys):
    out = tiny_sweep
    assert (
        main(["plot", str(out), "--out", str(tmp_path / "a"), "--objective", "share_good>=0.9"])
        == 0
    )
    svg = (tmp_path / "a" / "share_in_time.svg").read_text()
    assert "objective share_good ≥ 0.9" in svg
    for bad, message in (
        ("requests>=10", "objective requests: no figure draws it"),
        ("share_good=>0.9", "expected METRIC>=VALUE"),
    ):
        capsys.readouterr()
        assert main(["plot", str(out), "--out", str(tmp_path / "b"), "--objective", bad]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert not (tmp_path / "b").exists()


def test_with_too_few_panels_for_a_spare_one_the_legend_goes_outside_clear_of_the_title(tiny_sweep):
    summary = pd.read_parquet(tiny_sweep / "summary.parquet")
    by_class = pd.read_parquet(tiny_sweep / "summary_by_class.parquet")
    for fig in (plots.share_by_class(by_class), plots.outcome_bars(summary)):
        assert fig.get_suptitle() and len(fig.legends) == 1  # no spare panel: a figure legend
        assert_legends_cover_nothing(fig)
        assert overlapping_texts(fig) == []
        plt.close(fig)


# ------------------------------------------------------------------ issue 32: palette, labels,
# bounds


def test_the_headline_policies_have_colour_blind_safe_colours_far_apart():
    import colorsys

    from matplotlib.colors import to_rgb

    from analysis.styles import OKABE_ITO

    safe = {c.lower() for c in OKABE_ITO.values()}
    bounded, predictive = (to_rgb(policy_color(p)) for p in ("bounded", "predictive"))
    assert {to_hex(bounded), to_hex(predictive)} <= safe
    # Orange and red were one hue apart (and alike to a red-green colour-blind reader); these are
    # not.
    hue = [colorsys.rgb_to_hsv(*c)[0] * 360 for c in (bounded, predictive)]
    assert min(abs(hue[0] - hue[1]), 360 - abs(hue[0] - hue[1])) > 90
    assert all(
        to_hex(policy_color(p)) in safe | {"#999999"}
        for p in ("none", "bounded", "bounded-deadline", "predictive")
    )


def test_share_by_class_says_the_speed_once_not_in_every_entry(seven, tmp_path):
    _, _, by_class, _ = seven
    for table, said in (
        (by_class[by_class["speed"] == 1.0], "service times x1"),
        (by_class, "service times x1 solid, x2.25 dashed"),
    ):
        fig = plots.share_by_class(table)
        labels = [
            t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()
        ]
        assert labels == ["<= 4 tokens", "<= 16 tokens", "<= 64 tokens"]
        assert said in fig.get_suptitle()
        plt.close(fig)


def test_interval_bounds_are_cut_to_what_the_metric_can_be():
    from analysis.metrics import aggregate, clip_bounds

    # Two seeds far apart: a t-interval reaching below 0 (and past 1 for the share).
    table = pd.DataFrame(
        {
            "seed": [1, 2],
            "share_good": [0.02, 0.98],
            "goodput_rps": [0.1, 5.0],
            "latency_error_mean_s": [-0.5, 0.5],
        }
    )
    agg = aggregate(
        table.assign(policy="p"), ["policy"], ["share_good", "goodput_rps", "latency_error_mean_s"]
    )
    assert agg["share_good_low"].iloc[0] < 0 < 1 < agg["share_good_high"].iloc[0]
    shown = clip_bounds(agg)
    assert shown["share_good_low"].iloc[0] == 0 and shown["share_good_high"].iloc[0] == 1
    assert (
        shown["goodput_rps_low"].iloc[0] == 0
        and shown["goodput_rps"].iloc[0] == agg["goodput_rps"].iloc[0]
    )
    # A signed error can be negative: left as it is.
    assert shown["latency_error_mean_s_low"].iloc[0] == agg["latency_error_mean_s_low"].iloc[0] < 0


CLIENTS = """
[sweep]
duration_s = 20
seeds = 2
[clients.two-tenant]
heavy = { share = 0.85 }
light = { share = 0.15 }
[grid]
policy = ["none", "predictive"]
load = [1.5]
clients = ["none", "two-tenant"]
"""


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    out = tmp_path_factory.mktemp("tenants") / "out"
    (out.parent / "t.toml").write_text(CLIENTS)
    summary = sweep.run(config.load(out.parent / "t.toml"), out, workers=1, quiet=True)
    return summary, pd.read_parquet(out / "summary_by_client.parquet")


def test_jains_index_takes_no_clients_colour(tenants):
    summary, by_client = tenants
    fig = plots.by_client(by_client, summary)
    colours = line_colors(fig)
    jain = set().union(*(c for label, c in colours.items() if label.startswith("Jain")))
    clients = set().union(*(c for label, c in colours.items() if "client" in label))
    assert jain and clients and not jain & clients, (jain, clients)
    plt.close(fig)


def test_a_cell_without_clients_is_named_so_not_none_none(tenants):
    summary, _ = tenants
    labels = set(plots.per_variant(summary)["policy"])
    assert labels == {
        "none / no clients",
        "none / two-tenant",
        "predictive / no clients",
        "predictive / two-tenant",
    }
    assert labels == set(plots.per_client_set(summary)["policy"])


def test_a_figure_title_longer_than_the_figure_is_wrapped_not_cut():
    import matplotlib.pyplot as plt

    from analysis.plot_panels import _suptitle

    fig = plt.figure(figsize=(4, 3))
    _suptitle(fig, "share answered in time by size class (max_new_tokens up to), service times x1")
    lines = fig.get_suptitle().splitlines()
    plt.close(fig)
    assert len(lines) > 1 and all(len(line) <= 4 * 72 / 6 for line in lines)
