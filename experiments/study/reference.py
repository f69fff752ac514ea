"""The reference sweep (experiments/reference.toml) and hypotheses H1, H2 and H3."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.metrics import Est, _class_key, estimate, paired_difference, per_seed

from .blocks import Figure, Table, Text, Verdict, not_run, png
from .section import Context
from .sweeps import summaries, sweep_section, sweep_table

#: H1: an unbounded queue has collapsed when, at the highest load, its share in time is below this.
COLLAPSED_SHARE = 0.2


def _split_loads(summary: pd.DataFrame, speed: float) -> tuple[list[float], list[float]]:
    loads = sorted(summary.loc[summary["speed"] == speed, "load"].dropna().unique())
    return [v for v in loads if v <= 1], [v for v in loads if v > 1]


def hypothesis_1(summary: pd.DataFrame) -> tuple[Verdict, pd.DataFrame]:
    """H1: the unbounded queue collapses past capacity (goodput falls below its value at
    capacity)."""
    claim = "the unbounded queue (none) collapses beyond capacity"
    rows, evidence, ok = [], [], True
    for speed in sorted(summary["speed"].unique()):
        under, over = _split_loads(summary, speed)
        if not under or not over:
            why = f"speed x{speed:g} lacks a load at or below 1 or one above"
            return Verdict("H1", claim, None, why), pd.DataFrame()
        # Its best at or below capacity (at load 1 itself an unbounded queue is already unstable).
        best = max(
            under,
            key=lambda v: estimate(summary, "goodput_rps", policy="none", speed=speed, load=v).mean,
        )
        ref = {"policy": "none", "speed": speed, "load": best}
        for load in over:
            here = {"policy": "none", "speed": speed, "load": load}
            drop = paired_difference(summary, "goodput_rps", here, ref)
            ok &= drop.high < 0
            rows.append(
                {
                    "speed": speed,
                    "load": load,
                    "share in time": str(estimate(summary, "share_good", **here)),
                    "goodput (requests/s)": str(estimate(summary, "goodput_rps", **here)),
                    f"goodput minus at load {best:g}": str(drop),
                }
            )
        top = {"policy": "none", "speed": speed, "load": over[-1]}
        share = estimate(summary, "share_good", **top)
        ok &= share.high < COLLAPSED_SHARE
        at_top, at_best = (estimate(summary, "goodput_rps", **where) for where in (top, ref))
        collapse = paired_difference(summary, "goodput_rps", top, ref)
        evidence.append(
            f"service x{speed:g}: at load {over[-1]:g} none answers {share} of "
            "requests "
            f"in time (collapsed: below {COLLAPSED_SHARE:g}); goodput {at_top} "
            f"requests/s against its best at or below capacity, {at_best} "
            f"at load {best:g}, difference {collapse}"
        )
    return Verdict("H1", claim, ok, "; ".join(evidence)), pd.DataFrame(rows)


def hypothesis_2(summary: pd.DataFrame) -> tuple[Verdict, pd.DataFrame]:
    """H2: a bound on the count of waiting requests does not bound their wait when the machine is
    slower."""
    claim = "a count bound (bounded, 8 waiting) does not bound the wait across speeds"
    speeds = sorted(summary["speed"].unique())
    if len(speeds) < 2:
        return Verdict("H2", claim, None, "the sweep has one speed"), pd.DataFrame()
    fast, slow = speeds[0], speeds[-1]
    over = sorted(set(_split_loads(summary, fast)[1]) & set(_split_loads(summary, slow)[1]))
    if not over:
        return Verdict("H2", claim, None, "no load beyond capacity at both speeds"), pd.DataFrame()
    deadline = float(summary.loc[summary["policy"] == "bounded", "deadline_s"].iloc[0])
    rows, ok = [], True
    for load in over:
        a, b = (
            {"policy": "bounded", "speed": slow, "load": load},
            {"policy": "bounded", "speed": fast, "load": load},
        )
        p99 = paired_difference(summary, "latency_p99_s", a, b)
        late = paired_difference(summary, "share_late", a, b)
        ok &= p99.low > 0 and late.low > 0
        rows.append(
            {
                "load": load,
                f"p99 latency (s) x{fast:g}": str(estimate(summary, "latency_p99_s", **b)),
                f"p99 latency (s) x{slow:g}": str(estimate(summary, "latency_p99_s", **a)),
                "p99 difference": str(p99),
                f"share late x{fast:g}": str(estimate(summary, "share_late", **b)),
                f"share late x{slow:g}": str(estimate(summary, "share_late", **a)),
                "share late difference": str(late),
            }
        )
    top = rows[-1]
    evidence = (
        f"at load {over[-1]:g} bounded's p99 latency of the answered is "
        f"{top[f'p99 latency (s) x{fast:g}']} s "
        f"at service x{fast:g} and {top[f'p99 latency (s) x{slow:g}']} s at x{slow:g} "
        "(difference "
        f"{top['p99 difference']} s; the deadline is {deadline:g} s), and its share late "
        "goes from "
        f"{top[f'share late x{fast:g}']} to {top[f'share late x{slow:g}']}; the p99 and "
        "the share late "
        f"rise at every load beyond capacity: {'yes' if ok else 'no'}"
    )
    return Verdict("H2", claim, ok, evidence), pd.DataFrame(rows)


def hypothesis_3(
    summary: pd.DataFrame, by_class: pd.DataFrame
) -> tuple[Verdict, list[pd.DataFrame]]:
    """H3: predictive beats deadline expiry beyond capacity, and does so by serving the short
    requests."""
    claim = (
        "predictive beats deadline expiry (bounded-deadline) in goodput and share in time "
        "beyond capacity, "
        "by preferring short requests"
    )
    pred, bd = {"policy": "predictive"}, {"policy": "bounded-deadline"}
    rows, classes, evidence, ok = [], [], [], True
    for speed in sorted(summary["speed"].unique()):
        over = _split_loads(summary, speed)[1]
        if not over:
            return Verdict("H3", claim, None, f"no load beyond capacity at speed x{speed:g}"), [
                pd.DataFrame()
            ] * 2
        for load in over:
            at = {"speed": speed, "load": load}
            diffs = {
                m: paired_difference(summary, m, {**pred, **at}, {**bd, **at})
                for m in ("goodput_rps", "share_good", "good_tokens_per_s")
            }
            ok &= diffs["goodput_rps"].low > 0 and diffs["share_good"].low > 0
            rows.append(
                {
                    "speed": speed,
                    "load": load,
                    **{f"{m} predictive minus bounded-deadline": str(d) for m, d in diffs.items()},
                }
            )
        at = {"speed": speed, "load": over[-1]}
        labels = sorted(
            by_class.loc[by_class["speed"] == speed, "size_class"].unique(), key=_class_key
        )
        gain = {
            c: per_seed(by_class, "share_good", **pred, **at, size_class=c)
            - per_seed(by_class, "share_good", **bd, **at, size_class=c)
            for c in labels
        }
        short_first = Est.of((gain[labels[0]] - gain[labels[-1]]).dropna())
        ok &= short_first.low > 0
        for c in labels:
            classes.append(
                {
                    "speed": speed,
                    "load": over[-1],
                    "size class": c,
                    "predictive share in time": str(
                        estimate(by_class, "share_good", **pred, **at, size_class=c)
                    ),
                    "bounded-deadline share in time": str(
                        estimate(by_class, "share_good", **bd, **at, size_class=c)
                    ),
                    "difference": str(Est.of(gain[c].dropna())),
                }
            )
        last = rows[-1]
        evidence.append(
            f"service x{speed:g}, load {over[-1]:g}, predictive minus "
            "bounded-deadline: goodput "
            f"{last['goodput_rps predictive minus bounded-deadline']} requests/s, "
            "share in time "
            f"{last['share_good predictive minus bounded-deadline']}, good tokens/s "
            f"{last['good_tokens_per_s predictive minus bounded-deadline']}; its gain "
            "in share in time for "
            f"size {labels[0]} exceeds that for size {labels[-1]} by {short_first}"
        )
    return Verdict("H3", claim, ok, "; ".join(evidence)), [
        pd.DataFrame(rows),
        pd.DataFrame(classes),
    ]


def _report(ctx: Context, folder: Path) -> list:
    from analysis import plots
    from .. import sweep
    from ..commands import _cdf_load

    tables = summaries(folder)
    if tables is None:
        return not_run(folder)
    summary, by_class = tables
    seeds, seconds = summary["seed"].nunique(), summary["duration_s"].max()
    v1, t1 = hypothesis_1(summary)
    v2, t2 = hypothesis_2(summary)
    v3, (t3, t3c) = hypothesis_3(summary, by_class)
    load = _cdf_load(summary)
    speed = sorted(summary["speed"].unique())[0]
    rows = sweep.load_rows(folder / "sweep", load=load, speed=speed)
    deadline = float(summary["deadline_s"].mode().iloc[0])
    return [
        Text(
            "Every policy at loads "
            f"{', '.join(f'{v:g}' for v in sorted(summary['load'].unique()))} (utilisation at "
            f"the simulated speed), at the calibrated speed and with service times x"
            f"{', x'.join(f'{v:g}' for v in sorted(summary['speed'].unique()))}; {seeds} seeds of "
            f"{seconds:g} "
            "simulated seconds. Differences are paired by seed (common random numbers). A policy "
            "can raise "
            "request goodput by serving cheap requests, so good tokens/s is shown beside it."
        ),
        v1,
        Table(t1, "H1: the unbounded queue beyond capacity"),
        v2,
        Table(t2, "H2: bounded at the two speeds"),
        v3,
        Table(t3, "H3: predictive minus bounded-deadline beyond capacity"),
        Table(t3c, "H3: share in time by size class at the highest load"),
        *(
            Figure(
                f"reference_policies_x{v:g}",
                png(plots.policy_comparison(summary, by_class, speed=v)),
                f"service times x{v:g}: good tokens/s and share in time against load, and by size "
                "class at the "
                "highest load",
            )
            for v in sorted(summary["speed"].unique())
        ),
        Figure(
            "reference_share_in_time",
            png(plots.share_in_time(summary)),
            "share in time against load",
        ),
        Figure("reference_goodput", png(plots.goodput(summary)), "goodput against load"),
        Figure(
            "reference_share_by_class",
            png(plots.share_by_class(by_class)),
            "share in time by size class",
        ),
        Figure(
            "reference_outcomes", png(plots.outcome_bars(summary)), "outcomes by policy and load"
        ),
        Figure(
            "reference_latency_cdf",
            png(plots.latency_cdf(rows, deadline)),
            f"latency of the answered at load {load:g}, service x{speed:g}",
        ),
        sweep_table(summary, "the sweep: mean over seeds ± 95 % CI half-width"),
    ]


SECTION = sweep_section(
    "reference", "The reference sweep: H1, H2, H3", "reference.toml", _report, loads=True
)
