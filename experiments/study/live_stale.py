"""Live: a stale estimator. The synthetic engine slows a third of the way into each run, and the
deadline-aware policies track its speed or keep the calibrated estimate (``--fixed-estimate``)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from analysis.metrics import estimate

from .blocks import Table, Text, not_run
from .live_checks import CAUSE_COLUMNS, disagreement, prediction, prediction_verdict
from .live_runs import cell_rows, cells_of, cells_run, sim_summary
from .section import Context, Section, skippable


#: A live section's servers start together (seconds each, in parallel) and its runs go one after
#: another. The run of cell i begins LIVE_LEAD_S + i x (its seconds + LIVE_DRAIN_S) after its
#: server's start (the engine's clock), and its speed schedule steps a third of the way into that: a
#: speed schedule counts from the server's start. A run that begins late (the one before it drained
#: slowly) slows earlier in its run; the report reads the step on each run's clock back from its run
#: file, so it says where it fell.
LIVE_LEAD_S = 5.0
# a run outlasts its arrivals by its drain and the replay's own start and end: 1.5-2.5 s seen
LIVE_DRAIN_S = 4.0
SLOWDOWN = 2.2  # as experiments/stale.toml


def _cells(ctx: Context) -> dict:
    seconds = ctx.scale.live_stale_seconds
    pairs = [
        (policy, fixed) for policy in ("bounded-deadline", "predictive") for fixed in (False, True)
    ]
    cells = []
    for i, (policy, fixed) in enumerate(pairs):
        lead = LIVE_LEAD_S + i * (seconds + LIVE_DRAIN_S)
        cells.append(
            {
                "name": f"{policy}__{'fixed' if fixed else 'tracking'}",
                "seconds": seconds,
                "load": 0.9,
                "seed": 1,
                "early_stops": False,
                "lead_s": lead,
                "options": {
                    "policy": policy,
                    "speed_schedule": f"{lead + seconds / 3:g}:{SLOWDOWN:g}",
                    "fixed_estimate": fixed,
                },
            }
        )
    return {"cells": cells}


def _report(ctx: Context, folder: Path) -> list:
    from qsim.runfile import speed_schedule
    from analysis.estimation import late_share

    done = cell_rows(folder, cells_of(folder))
    if not done:
        return not_run(folder)
    sim = sim_summary(folder, "stale")
    rows = []
    for cell, run, row in done:
        schedule = speed_schedule(run)
        # No step left on the run's clock: it came before the run began, which then ran slow from
        # its start.
        change = math.nan if schedule is None else schedule.steps[0][0] if schedule.steps else 0.0
        after = run["arrival_s"] >= change
        policy, fixed = cell["options"]["policy"], cell["options"]["fixed_estimate"]
        shown = {
            "policy": policy,
            "estimate": "fixed" if fixed else "tracking",
            "slows at (s of the run)": change,
            "late share of completed, from the change": late_share(run.loc[after, "outcome"]),
            "late share of completed, before": late_share(run.loc[~after, "outcome"]),
            **{
                k: row[k]
                for k in (
                    "requests",
                    "good",
                    "late",
                    "refused",
                    "error",
                    "goodput_rps",
                    "sim_disagreements",
                    "sim_disagreement_rate",
                    *CAUSE_COLUMNS,
                )
            },
            **prediction(run, ctx.scale.predict_seeds),
        }
        if sim is not None:
            at = {"policy": policy, "fixed_estimate": fixed}
            late = estimate(sim, "late_share_after_change", **at)
            shown["simulated late share from the change"] = str(late)
            shown["simulated goodput_rps"] = str(estimate(sim, "goodput_rps", **at))
        rows.append(shown)
    cell = done[0][0]
    return [
        Text(
            "Live: bounded-deadline and predictive at load 0.9 on the synthetic engine, which "
            "becomes "
            f"{SLOWDOWN:g}x slower a third of the way into each {cell['seconds']:g} s run "
            "(`--speed-schedule`; a "
            "fresh server per run, the step on the run's clock read back from the run file), "
            "tracking the speed "
            "or keeping the calibrated estimate (`--fixed-estimate`). Each run is replayed in the "
            "simulator "
            "request by request (`qlab compare`). One live seed: no interval; the simulated "
            "columns are the stale "
            "section's means [95 % CI] over its seeds (its runs are longer and slow at 20 s, so "
            "its goodput is "
            "over a larger share of slow time)."
        ),
        *disagreement([r for *_, r in done]),
        prediction_verdict(rows, ctx.scale.predict_seeds),
        Table(
            pd.DataFrame(rows),
            "live stale estimator, beside the simulated stale sweep, with "
            "the model-only "
            "prediction's relative errors"
            + ("" if sim is not None else " (not available: the stale section has no results)"),
        ),
    ]


SECTION = Section(
    "live_stale",
    "Live: a stale estimator",
    skippable("live_stale", _cells),
    cells_run(_cells),
    _report,
)
