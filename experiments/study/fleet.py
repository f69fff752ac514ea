"""A fleet behind routers (qlab capacity --replicas 4 --router ...) and hypothesis H6."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.objectives import parse_objectives, written

from .blocks import Figure, Table, Text, Verdict, not_run, png
from .capacity import CAPACITY_OBJECTIVE, capacity_table
from .scale import Scale
from .section import Context, Section, read_json

#: Four replicas of one engine each: enough for routing to matter, few enough to stay cheap.
FLEET_REPLICAS = 4
#: Early binding blind (random) and load-aware (jsq), and late binding (central: one queue).
FLEET_ROUTERS = ("random", "jsq", "central")
#: A count bound per replica, and the predictive gate (its projection of the wait).
FLEET_POLICIES = ("bounded", "predictive")
#: Half the capacity section's seconds: six units of four replicas each cost about as much.
FLEET_SEEDS, FLEET_SECONDS = 10, 300.0


@dataclass(frozen=True)
class Unit:
    """A (policy, router) pair of the search, as capacity.json records it."""

    policy: str
    router: str


#: H6's pairs: the claimed better one first.
AWARE, BLIND = Unit("predictive", "jsq"), Unit("bounded", "random")
LATE, EARLY = Unit("predictive", "central"), Unit("predictive", "jsq")


def search(scale: Scale):
    from .. import capacity

    seeds = FLEET_SEEDS if scale.seeds is None else min(FLEET_SEEDS, scale.seeds)
    seconds = FLEET_SECONDS if scale.duration_s is None else min(FLEET_SECONDS, scale.duration_s)
    grid = {"replicas": [FLEET_REPLICAS], "router": list(FLEET_ROUTERS)}
    cfg = capacity.search_config(
        list(FLEET_POLICIES),
        ["poisson"],
        seconds=seconds,
        seeds=seeds,
        grid=grid,
        where="<study fleet>",
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


def _find(results: list[dict], unit: Unit) -> dict | None:
    key = (unit.policy, unit.router)
    return next((r for r in results if (r["policy"], r.get("router")) == key), None)


def _text(r: dict) -> str:
    return f"{r['load']:.3g} [{r['ci_low']:.3g}, {r['ci_high']:.3g}]"


def above(results: list[dict], better: Unit, worse: Unit) -> tuple[bool | None, str]:
    """Whether ``better`` meets the objective surely at a load where ``worse`` surely fails (its
    capacity interval's low end at or past the other's high end), and the two capacities; None
    where either is missing or its search hit a bound (an open interval)."""
    a, b = _find(results, better), _find(results, worse)
    name = f"{better.policy} behind {better.router} against {worse.policy} behind {worse.router}"
    if a is None or b is None:
        return None, f"{name}: the search lacks one of them"
    if None in (a["load"], a["ci_low"], b["ci_high"]) or b["load"] is None:
        return None, f"{name}: a capacity or an interval's end lies outside the loads searched"
    ok = a["ci_low"] >= b["ci_high"]
    return ok, f"{name}: capacity {_text(a)} against {_text(b)} (per replica)"


def hypothesis_6(results: list[dict]) -> Verdict:
    """H6: a load-aware router with predictive admission keeps 90 % in time to a higher load per
    replica than random routing with per-replica count bounds, and late binding (one central
    queue) to a higher one than early binding (jsq), both with predictive admission."""
    claim = (
        "in a fleet of 4, a load-aware router (jsq) with predictive admission answers 90 % "
        "in time at a higher load per replica than random routing with a count bound "
        "(bounded), and late binding (central) at a higher one than early binding (jsq)"
    )
    parts = [above(results, AWARE, BLIND), above(results, LATE, EARLY)]
    words = [ok for ok, _ in parts]
    supported = None if None in words else all(words)
    # Which half of the first pair carries it: the gate alone, behind the blind router.
    gate = _find(results, Unit(AWARE.policy, BLIND.router))
    alone = (
        []
        if gate is None or gate["load"] is None
        else [f"{gate['policy']} behind {gate['router']} alone reaches {_text(gate)}"]
    )
    evidence = "; ".join([*(text for _, text in parts), *alone])
    rule = "; a pair holds where the first one's interval starts at or past the second one's end"
    return Verdict("H6", claim, supported, evidence + rule)


def _labelled(frame: pd.DataFrame) -> pd.DataFrame:
    """Policy as "policy / router": the figures' colour is the policy's, the line the router's."""
    return frame.assign(policy=frame["policy"] + " / " + frame["router"].astype(str))


def _report(ctx: Context, folder: Path) -> list:
    from analysis import plots

    data = read_json(folder / "sweep" / "capacity.json")
    if data is None:
        return not_run(folder)
    summary = _labelled(pd.read_parquet(folder / "sweep" / "summary.parquet"))
    results = [{**r, "policy": f"{r['policy']} / {r['router']}"} for r in data["results"]]
    figure = plots.capacity(summary, results, parse_objectives(data["objective"])[0])
    # One panel: the search's own title is wider than it.
    figure.suptitle("share in time against load per replica", fontsize=10)
    return [
        Text(
            f"{FLEET_REPLICAS} replicas of one engine each behind a router "
            f"({', '.join(FLEET_ROUTERS)}), each replica gated by {' or '.join(FLEET_POLICIES)}: "
            f"the highest load per replica answering 90 % in time ({data['objective']}, the mean "
            f"over {data['seeds']} seeds of {data['duration_s']:g} simulated s of Poisson "
            "arrivals), searched by qlab capacity --replicas as in the capacity section. random "
            "and jsq bind a request to a replica on arrival (early), central holds one queue and "
            "hands each request to the first replica free (late), so the gate sees one queue: "
            "bounded's 8 waiting are then the fleet's, not each replica's."
        ),
        hypothesis_6(data["results"]),
        Table(
            capacity_table(results, data["bounds"]).rename(columns={"policy": "policy / router"}),
            "the fleet: each policy and router's capacity per replica, and the fleet's "
            "requests/s at it",
        ),
        Figure(
            "fleet_capacity",
            png(figure),
            "share in time at every load per replica the search "
            "tried, each policy / router's capacity (diamond) and its 95 % interval (bar)",
        ),
    ]


SECTION = Section(
    "fleet", f"A fleet of {FLEET_REPLICAS} behind routers: H6", _inputs, _run, _report
)
