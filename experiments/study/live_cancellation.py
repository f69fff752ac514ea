"""Live: cutting at the deadline. Each policy and load with ``--policy-arg
cancel_at_deadline=true`` and without, on the synthetic engine with early stops, beside the
simulated cancellation sweep."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.metrics import paired_difference

from .blocks import Table, Text, not_run
from .live_checks import disagreement, prediction, prediction_verdict
from .live_runs import cell_rows, cells_of, cells_run, sim_summary
from .section import Context, Section, skippable


def _cells(ctx: Context) -> dict:
    # Early stops (as experiments/cancellation.toml): the estimate from the limit is right only on
    # average, so the runs that go to their limit pass their deadline and there is something to cut;
    # the seed is the engine's.
    cells = [
        {
            "name": f"{policy}__load{load:g}__{'cut' if cut else 'nocut'}",
            "seconds": ctx.scale.live_cut_seconds,
            "load": load,
            "seed": 1,
            "early_stops": True,
            "lead_s": 0.0,
            "options": {
                "policy": policy,
                "early_stops": True,
                "seed": 1,
                "policy_arg": "cancel_at_deadline=true" if cut else "",
            },
        }
        for policy in ctx.scale.live_cut_policies
        for load in ctx.scale.live_cut_loads
        for cut in (False, True)
    ]
    return {"cells": cells}


def _report(ctx: Context, folder: Path) -> list:
    done = cell_rows(folder, cells_of(folder))
    if not done:
        return not_run(folder)
    sim = sim_summary(folder, "cancellation")
    if sim is not None:
        sim = sim.assign(engine_s_total_per_s=sim["engine_s_total"] / sim["duration_s"])
    runs = pd.DataFrame(
        [
            {
                "policy": c["options"]["policy"],
                "load": c["load"],
                "cut at the deadline": bool(c["options"]["policy_arg"]),
                **r,
                **prediction(run, ctx.scale.predict_seeds),
            }
            for c, run, r in done
        ]
    )
    pairs = []
    for (policy, load), part in runs.groupby(["policy", "load"], sort=False):
        on, off = part[part["cut at the deadline"]], part[~part["cut at the deadline"]]
        if on.empty or off.empty:
            continue
        on, off = on.iloc[0], off.iloc[0]
        pair = {
            "policy": policy,
            "load": load,
            "runs cut": int(on["cancelled"]),
            "engine s/s saved (not cut minus cut)": off["engine_s_per_s"] - on["engine_s_per_s"],
            "goodput gained (cut minus not cut)": on["goodput_rps"] - off["goodput_rps"],
        }
        if sim is not None and load in set(sim["load"]) and policy in set(sim["policy"]):
            at = {"policy": policy, "load": load}
            # The live runs' measure (total engine time, not cut minus cut, paired by seed), not the
            # sweep's engine_s_saved: a cut frees an engine for requests that would otherwise have
            # been refused.
            cut, kept = {**at, "cancel_at_deadline": True}, {**at, "cancel_at_deadline": False}
            saved = paired_difference(sim, "engine_s_total_per_s", kept, cut)
            pair["simulated engine s/s saved"] = str(saved)
            gained = paired_difference(sim, "goodput_rps", cut, kept)
            pair["simulated goodput gained"] = str(gained)
        pairs.append(pair)
    cell = done[0][0]
    return [
        Text(
            f"Live: each policy and load with `--policy-arg cancel_at_deadline=true` and without, "
            f"{cell['seconds']:g} s of Poisson arrivals each on the synthetic engine with early "
            "stops "
            "(`--early-stops`, seeded: the study's used share, as experiments/cancellation.toml), "
            "a server per run. "
            "Engine seconds are the engine time the service reported (a cut run's from its start "
            "to its cut), per "
            "second of arrivals; saved and gained are "
            "the difference of the two live runs (one live seed, same arrivals: no interval). "
            "Saved is the whole "
            "engine time of the run without cutting minus that with it, so it can be negative: a "
            "cut frees the "
            "engine for requests that would otherwise have been refused (the cancellation "
            "section's "
            "engine_s_saved counts only the cut runs' unrun time). The simulated columns are the "
            "same differences "
            "in the cancellation section, means [95 % CI] paired by seed."
        ),
        *disagreement(runs.to_dict("records")),
        prediction_verdict(runs.to_dict("records"), ctx.scale.predict_seeds),
        Table(
            pd.DataFrame(pairs),
            "live cutting at the deadline: what it saved and gained, beside "
            "the simulated sweep"
            + (
                ""
                if sim is not None
                else " (not available: the cancellation section has no results)"
            ),
        ),
        Table(
            runs.drop(columns="judged"),
            "the live runs: their per-request disagreement with the "
            "simulator, and the "
            "model-only prediction's relative errors",
        ),
    ]


SECTION = Section(
    "live_cancellation",
    "Live: cutting at the deadline",
    skippable("live_cancellation", _cells),
    cells_run(_cells),
    _report,
)
