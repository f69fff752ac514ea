"""A burst of 30 requests at once: the counting trap of counting those that start at once as
waiting."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from analysis.metrics import aggregate, with_ci

from .blocks import Table, Text, Verdict, not_run
from .scale import POLICIES, Scale
from .section import Context, Section
from .sweeps import scaled, summaries


BURST = {
    "sweep": {"name": "burst30", "arrivals": "burst:30", "duration_s": 1.0, "seeds": 20},
    "grid": {"policy": list(POLICIES), "engines": [1, 3]},
}  # a burst of its own size: no load


def _config(scale: Scale):
    from .. import config

    return scaled(config.parse(BURST, "<study burst>"), dataclasses.replace(scale, duration_s=None))


def _inputs(ctx: Context) -> dict:
    return {"config": _config(ctx.scale).canonical()}


def _run(ctx: Context, folder: Path) -> None:
    from .. import sweep

    sweep.run(_config(ctx.scale), folder / "sweep", workers=ctx.workers, quiet=True)


def _report(ctx: Context, folder: Path) -> list:
    tables = summaries(folder)
    if tables is None:
        return not_run(folder)
    summary = tables[0].assign(accepted=lambda t: t["requests"] - t["rejected"])
    columns = ["accepted", "rejected", "expired", "good", "late"]
    agg = aggregate(summary, ["engines", "policy"], columns)
    spread = summary.groupby(["engines", "policy"])["accepted"].agg(["min", "max"]).reset_index()
    shown = with_ci(agg.drop(columns="n")).merge(
        spread.rename(columns={"min": "accepted min", "max": "accepted max"})
    )
    bounded = summary[summary["policy"] == "bounded"]
    expected = (bounded["engines"] + bounded["max_queue"]).astype(int)
    right = bool((bounded["accepted"] == expected).all())
    seen = ", ".join(
        f"{k} engine(s): {sorted(set(part['accepted'].astype(int)))}"
        for k, part in bounded.groupby("engines")
    )
    return [
        Text(
            f"30 requests arrive at once ({summary['seed'].nunique()} seeds of sizes). A request "
            "admitted to an idle "
            "engine is in service from that instant: with K engines and at most 8 waiting, "
            "bounded accepts K + 8 "
            "(the counting trap: counting those that start at once as waiting admits too few, "
            "or too many)."
        ),
        Verdict(
            "check",
            "bounded accepts exactly K + 8 of a burst of 30",
            right,
            f"accepted by bounded, per seed: {seen} (expected "
            f"{', '.join(map(str, sorted(set(expected))))})",
        ),
        Table(shown, "a burst of 30 per policy and number of engines: mean [95 % CI] over seeds"),
    ]


SECTION = Section("burst", "A burst of 30", _inputs, _run, _report)
