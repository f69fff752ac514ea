"""Capacity (exercise 8): the highest load at which each policy answers 90 % in time, Poisson
and in bursts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from analysis.objectives import parse_objectives, written

from .blocks import Figure, Table, Text, not_run, png
from .scale import POLICIES, Scale
from .section import Context, Section, read_json


#: Exercise 8: the highest load at which each policy answers 90 % of requests in time, under Poisson
#: arrivals and under a burst every 10 s at the same load (the requests a constant rate sends in 10
#: s, at once).
CAPACITY_OBJECTIVE = "share_good>=0.9"
CAPACITY_ARRIVALS = {"poisson": "Poisson", "periodic:10": "a burst every 10 s"}
#: The search's seeds and seconds at the reference sizes; a reduced scale's cut them, as they cut
#: every sweep.
CAPACITY_SEEDS, CAPACITY_SECONDS = 10, 600.0


def search(scale: Scale):
    from .. import capacity

    seeds = CAPACITY_SEEDS if scale.seeds is None else min(CAPACITY_SEEDS, scale.seeds)
    seconds = (
        CAPACITY_SECONDS if scale.duration_s is None else min(CAPACITY_SECONDS, scale.duration_s)
    )
    cfg = capacity.search_config(
        list(POLICIES),
        list(CAPACITY_ARRIVALS),
        seconds=seconds,
        seeds=seeds,
        where="<study capacity>",
    )
    return capacity.Search(
        cfg,
        parse_objectives(CAPACITY_OBJECTIVE),
        capacity.Bounds(tolerance=scale.capacity_tolerance),
    )


def _inputs(ctx: Context) -> dict:
    spec = search(ctx.scale)
    return {
        "config": spec.config.canonical(),
        "objective": written(spec.objective),
        "level": spec.level,
        "bounds": dataclasses.asdict(spec.bounds),
    }


def _run(ctx: Context, folder: Path) -> None:
    from .. import capacity

    capacity.run(search(ctx.scale), folder / "sweep", workers=ctx.workers)


def capacity_table(results: list[dict], bounds: dict) -> pd.DataFrame:
    """A row per policy: its capacity [95 % interval] and the rate it is, under each arrival
    process."""
    from ..capacity import Bounds, shown

    rows: dict[str, dict] = {}
    for r in results:
        what = CAPACITY_ARRIVALS.get(r["arrivals"], r["arrivals"])
        text = shown(r, Bounds(**bounds))
        row = rows.setdefault(r["policy"], {"policy": r["policy"]})
        row[f"{what}: capacity [95 % interval]"] = f"{text['capacity']} {text['95 % interval']}"
        row[f"{what}: requests/s"] = text["requests/s"]
    return pd.DataFrame(list(rows.values()))


def _report(ctx: Context, folder: Path) -> list:
    from ..commands import _capacity_figure

    data = read_json(folder / "sweep" / "capacity.json")
    if data is None:
        return not_run(folder)
    summary = pd.read_parquet(folder / "sweep" / "summary.parquet")
    bounds = data["bounds"]
    return [
        Text(
            "Exercise 8: the highest load at which each policy answers 90 % of requests within "
            "the deadline "
            f"({data['objective']}, the mean over {data['seeds']} seeds of {data['duration_s']:g} "
            "simulated s), under "
            "Poisson arrivals and under a burst every 10 s at the same load (each burst is the "
            "requests a constant "
            "rate would send in its 10 s, sent at once; the same seeds, so the same requests, at "
            "every load and for "
            "every policy). This is DistServe's goodput: the highest rate at which 90 % of "
            "requests meet their "
            "objective. qlab capacity searches it by bracketing and bisection on the seeds' mean "
            "until each bracket "
            f"is narrower than {bounds['tolerance']:.0%} of its load. The 95 % interval runs from "
            "the last load at "
            "which the seeds' t-interval of the share in time lay wholly above 0.9 to the first "
            "at which it lay "
            "wholly below (test inversion). Requests/s is the capacity times the requests/s one "
            "engine serves at "
            "the calibrated speed."
        ),
        Table(
            capacity_table(data["results"], bounds),
            "capacity: the highest load answering 90 % in time",
        ),
        Figure(
            "capacity",
            png(_capacity_figure(folder / "sweep", summary)["capacity"]),
            "share in time at every load the search tried (mean and 95 % band over the seeds), "
            "each policy's "
            "capacity (diamond) and its 95 % interval (bar) on the 0.9 line, per arrival "
            "process",
        ),
    ]


SECTION = Section(
    "capacity",
    "Capacity under Poisson arrivals and bursts every 10 s (exercise 8)",
    _inputs,
    _run,
    _report,
)
