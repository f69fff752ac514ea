"""The analysis.estimation experiments: estimation, a stale estimator (H4) and cancellation.

Each is a sweep of its experiment file, reported by its table in :mod:`analysis.estimation` and
its figure in :mod:`analysis.plots`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

import pandas as pd

from analysis.metrics import paired_difference, with_ci

from .blocks import Figure, Table, Text, Verdict, not_run, png
from .section import Context
from .sweeps import summaries, sweep_section, sweep_table


def _analysis(name: str):
    """analysis.estimation.NAME and analysis.plots.NAME-like callables, or the reason they are
    missing."""
    try:
        module = importlib.import_module("analysis.estimation")
    except ModuleNotFoundError as exc:
        if exc.name != "analysis.estimation":
            raise
        return None, "analysis.estimation is not in this qlab"
    fn = getattr(module, name, None)
    return (fn, None) if fn is not None else (None, f"analysis.estimation has no {name}")


def _figure_of(name: str, summary: pd.DataFrame, caption: str) -> list:
    from analysis import plots

    draw = getattr(plots, name, None)
    if draw is None:
        return [Text(f"figure not available: analysis.plots has no {name}")]
    return [Figure(name, png(draw(summary)), caption)]


def _experiment_report(name: str, table_fn: str, what: str) -> Callable[[Context, Path], list]:
    def report(ctx: Context, folder: Path) -> list:
        tables = summaries(folder)
        if tables is None:
            return not_run(folder)
        summary = tables[0]
        fn, why = _analysis(table_fn)
        blocks = [
            Text(
                f"{what} {summary['seed'].nunique()} seeds of "
                f"{summary['duration_s'].max():g} simulated s."
            )
        ]
        blocks.append(
            Table(with_ci(fn(summary)), f"{name}: mean [95 % CI] over seeds")
            if fn is not None
            else Text(f"table not available ({why}); the sweep's summary follows")
        )
        blocks += _figure_of(name, summary, name)
        blocks.append(
            sweep_table(summary, f"the {name} sweep: mean over seeds ± 95 % CI half-width")
        )
        return blocks

    return report


def hypothesis_4(
    stale: pd.DataFrame | None, estimation: pd.DataFrame | None
) -> tuple[Verdict, pd.DataFrame]:
    """H4: not knowing costs: a stale estimate lets late work in, an estimate from the limit
    turns fitting work away."""
    claim = (
        "the estimator's knowledge costs: after a slowdown a fixed estimate lets "
        "deadline-aware policies start "
        "work they cannot finish, and an estimate from the limit refuses work that would "
        "have fit"
    )
    need = {
        "stale": (stale, ("fixed_estimate", "late_share_of_completed")),
        "estimation": (estimation, ("estimator", "goodput_rps")),
    }
    for what, (table, columns) in need.items():
        if table is None or not set(columns) <= set(table.columns):
            return Verdict(
                "H4",
                claim,
                None,
                f"the {what} sweep's results (columns {', '.join(columns)}) are not available",
            ), pd.DataFrame()
    rows, ok, evidence = [], True, []
    for policy in sorted(stale["policy"].unique()):
        d = paired_difference(
            stale,
            "late_share_of_completed",
            {"policy": policy, "fixed_estimate": True},
            {"policy": policy, "fixed_estimate": False},
        )
        ok &= d.low > 0
        rows.append(
            {
                "experiment": "stale",
                "policy": policy,
                "comparison": "fixed minus tracking estimate",
                "metric": "late share of completed",
                "difference": str(d),
            }
        )
        evidence.append(f"{policy}: late share of completed, fixed minus tracking {d}")
    for load in [v for v in sorted(estimation["load"].unique()) if v > 1]:
        at = {"load": load}
        d = paired_difference(
            estimation, "goodput_rps", {**at, "estimator": "learned"}, {**at, "estimator": "limit"}
        )
        ok &= d.low > 0
        rows.append(
            {
                "experiment": "estimation",
                "policy": "predictive",
                "comparison": f"learned minus limit, load {load:g}",
                "metric": "goodput (requests/s)",
                "difference": str(d),
            }
        )
        evidence.append(f"load {load:g}: goodput learned minus limit {d} requests/s")
    return Verdict("H4", claim, ok, "; ".join(evidence)), pd.DataFrame(rows)


def _stale_report(ctx: Context, folder: Path) -> list:
    blocks = _experiment_report(
        "stale",
        "stale_table",
        "The machine slows during the run; "
        "tracking versus a fixed "
        "estimate for the deadline-aware policies,",
    )(ctx, folder)
    stale, estimation = summaries(folder), summaries(folder.parent / "estimation")
    verdict, table = hypothesis_4(
        None if stale is None else stale[0], None if estimation is None else estimation[0]
    )
    return [verdict, Table(table, "H4: paired differences by seed")] + blocks


_ESTIMATION_WHAT = (
    "Predictive at loads of the work actually done, with the estimate from the "
    "limit, learned online, or exact (an oracle);"
)
ESTIMATION = sweep_section(
    "estimation",
    "Estimation: the estimate from the limit, learned, or exact",
    "estimation.toml",
    _experiment_report("estimation", "estimation_table", _ESTIMATION_WHAT),
)
STALE = sweep_section("stale", "A stale estimator: H4", "stale.toml", _stale_report)
CANCELLATION = sweep_section(
    "cancellation",
    "Cancelling at the deadline",
    "cancellation.toml",
    _experiment_report(
        "cancellation", "cancellation_table", "Runs cut at their deadline or left to finish;"
    ),
)
