"""``qlab capacity``: the highest load at which each policy meets an objective, with a 95 %
interval.

An *objective* is one or more clauses over a cell summary's metrics (``analysis.metrics.summary``
and the sweep's columns: share_good, goodput_rps, latency_p99_s, ...), joined with ``and``:
``share_good>=0.9 and latency_p99_s<=2``. A load *meets* it when the mean over the seeds of every
clause's metric is on its side. DistServe's goodput, "the highest request rate at which 90 % of
requests meet the latency objectives", is this search with ``share_good>=0.9`` (the share answered
within the deadline).

The search (:func:`next_loads`), per policy (and arrival process), over loads that all share the
seeds (common random numbers: the same seed sends the same requests at every load and to every
policy):

1. *Bracketing*: from ``start``, halve until a load meets the objective surely, double until one
   fails it surely (within ``min_load`` .. ``max_load``).
2. *Bisection* of three crossings at once: where the seeds' mean stops meeting the objective (the
   capacity), where the objective stops being met surely, and where it starts failing surely; each
   until its bracket is narrower than ``tolerance`` times its upper end.

*Surely* is judged from Student-t intervals across seeds, one per clause at 1 - 0.05 / (number of
clauses) (Bonferroni): met surely when every clause's interval lies on its side, failed surely when
some clause's lies wholly on the other. The 95 % interval of the capacity is the set of loads where
the seeds cannot reject that the metric equals its threshold (test inversion): from the last load
met surely to the first failed surely, the outer ends of their brackets, so it holds the capacity
with probability at least 95 % where the metric's mean falls with load. A metric that is undefined
in a seed's run (NaN: a p99 of no answers) fails its clause, surely, at that load.

The cells are a sweep's (``experiments.sweep``: the same cell runner, executors and layout), written
into OUT as a sweep dataset, so ``qlab summary`` and ``qlab plot`` read it; ``capacity.json`` holds
the results and every load tried. The folder's digest is of everything but the loads, so a search
interrupted, or re-run with another objective, reuses every cell it already has; any number of
workers, or a dask cluster, gives the same cells and so the same search.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import numpy as np
import pandas as pd

from analysis.metrics import mean_ci
from analysis.objectives import Objective, written
from inputs.atomic import atomic_write
from qsim.arrivals import arrivals_take_load

from . import config as sweep_config
from . import sweep
from .config import SweepConfig
from .jsonout import json_ready

#: An objective: its clauses, all of which a load must meet (analysis.objectives.parse_objectives).
Objectives = tuple[Objective, ...]
#: The load of the placeholder grid a search's config is checked with; the cells take the loads
#: searched.
_SOME_LOAD = 1.0


# ------------------------------------------------------------------ objectives


def metrics_of(objective: Objectives) -> list[str]:
    """The metrics an objective's clauses name, each once, in order."""
    return list(dict.fromkeys(c.metric for c in objective))


def check_metrics(objective: Objectives, available: list[str]) -> None:
    """ValueError naming a clause's metric that the cells' summaries do not have, and those they
    do."""
    for metric in metrics_of(objective):
        if metric not in available:
            raise ValueError(
                f"--objective: no metric {metric!r} in a cell's summary; it has "
                f"{', '.join(available)}"
            )


# ------------------------------------------------------------------ judging one load


@dataclass(frozen=True)
class Judgement:
    """What the seeds say of the objective at one load."""

    met: bool  # the seeds' mean of every clause's metric is on its side
    surely_met: bool  # every clause's interval lies on its side
    surely_failed: bool  # some clause's interval lies wholly on the other side
    # metric -> {mean, ci_low, ci_high} (at the clause's level)
    values: dict = field(default_factory=dict)


def judge(per_seed: dict[str, np.ndarray], objective: Objectives, level: float = 0.95) -> Judgement:
    """The objective at one load, from each metric's values over the seeds; each clause's interval
    at 1 - (1 - level) / (number of clauses), so that the capacity's interval holds at ``level``
    (Bonferroni)."""
    each = 1 - (1 - level) / len(objective)
    met = surely_met = True
    surely_failed = False
    values = {}
    for clause in objective:
        x = np.asarray(per_seed[clause.metric], dtype=float)
        mean, low, high = mean_ci(x, each)
        values[clause.metric] = {"mean": mean, "ci_low": low, "ci_high": high}
        if np.isnan(x).any():  # undefined in some seed's run (a p99 of no answers): not met, surely
            met, surely_met, surely_failed = False, False, True
            continue
        met &= clause.holds(mean)
        surely_met &= clause.holds(low) and clause.holds(high)
        surely_failed |= not clause.holds(low) and not clause.holds(high)
    return Judgement(met, surely_met, surely_failed, values)


# ------------------------------------------------------------------ the search


@dataclass(frozen=True)
class Bounds:
    """Where and how finely to search: from ``start``, within ``min_load`` .. ``max_load``, until
    each crossing's bracket is narrower than ``tolerance`` times its upper end."""

    start: float = 1.0
    min_load: float = 0.01
    max_load: float = 10.0
    tolerance: float = 0.02

    def __post_init__(self) -> None:
        if not 0 < self.min_load <= self.start <= self.max_load < math.inf:
            raise ValueError(
                "the search needs 0 < --min-load <= --start <= --max-load, got "
                f"{self.min_load:g}, "
                f"{self.start:g}, {self.max_load:g}"
            )
        if not 0 < self.tolerance < 1:
            raise ValueError(f"--tolerance must be in (0, 1), got {self.tolerance:g}")


#: The three crossings searched, each a property true at low loads and false from some load on.
CROSSINGS: dict[str, Callable[[Judgement], bool]] = {
    "surely_met": lambda j: j.surely_met,
    "met": lambda j: j.met,
    "not_surely_failed": lambda j: not j.surely_failed,
}


def crossing(
    judged: dict[float, Judgement], holds: Callable[[Judgement], bool]
) -> tuple[float | None, float | None]:
    """(lo, hi): the first load tried where ``holds`` is false, and the highest below it where it is
    true (None where there is none)."""
    hi = min((load for load, j in judged.items() if not holds(j)), default=None)
    lo = max(
        (load for load, j in judged.items() if holds(j) and (hi is None or load < hi)), default=None
    )
    return lo, hi


def next_loads(judged: dict[float, Judgement], bounds: Bounds) -> list[float]:
    """The loads to try next for one policy, given what is known; [] when its search is done."""
    if not judged:
        return [bounds.start]
    lowest, highest = min(judged), max(judged)
    wanted = set()
    if not any(j.surely_met for j in judged.values()) and lowest > bounds.min_load:
        wanted.add(max(lowest / 2, bounds.min_load))
    if not any(j.surely_failed for j in judged.values()) and highest < bounds.max_load:
        wanted.add(min(highest * 2, bounds.max_load))
    for holds in CROSSINGS.values():
        lo, hi = crossing(judged, holds)
        if lo is not None and hi is not None and hi - lo > bounds.tolerance * hi:
            wanted.add((lo + hi) / 2)
    return sorted(wanted - set(judged))


@dataclass(frozen=True)
class Capacity:
    """One policy's capacity: the highest load tried that met the objective below the first that did
    not, and the interval (None: beyond the loads searched; see the module's docstring)."""

    load: float | None
    fails_at: float | None
    ci_low: float | None
    ci_high: float | None
    loads_tried: int

    @classmethod
    def of(cls, judged: dict[float, Judgement]) -> "Capacity":
        load, fails_at = crossing(judged, CROSSINGS["met"])
        ci_low = crossing(judged, CROSSINGS["surely_met"])[0]
        ci_high = crossing(judged, CROSSINGS["not_surely_failed"])[1]
        return cls(load, fails_at, ci_low, ci_high, len(judged))


def search(
    evaluate: Callable[[list[tuple]], dict[tuple, Judgement]],
    units: list,
    bounds: Bounds | None,
    log: Callable[[str], None] = lambda line: None,
    propose: Callable | None = None,
) -> dict:
    """Search every unit (a policy, say) at once: each round asks ``evaluate`` for the judgements of
    every unit's next loads, as (unit, load) pairs, until none has a load left to try. Returns
    {unit: {load: Judgement}}. ``propose(unit, judged)``: the points to try next (default
    :func:`next_loads` within ``bounds``)."""
    propose = propose or (lambda unit, judged: next_loads(judged, bounds))
    judged: dict = {unit: {} for unit in units}
    for round_ in range(1, 1000):
        asks = [(unit, load) for unit in units for load in propose(unit, judged[unit])]
        if not asks:
            return judged
        log(
            f"round {round_}: {len(asks)} load(s): "
            + ", ".join(sorted({f"{load:.4g}" for _, load in asks}))
        )
        for (unit, load), judgement in evaluate(asks).items():
            judged[unit][load] = judgement
    # cannot happen: brackets halve, bounds are finite
    raise RuntimeError("the capacity search did not end")


# ------------------------------------------------------------------ on sweep cells


@dataclass(frozen=True)
class Search:
    """A capacity search: the cells of ``config`` (its grid's load is a placeholder) at every
    load searched."""

    config: SweepConfig
    objective: Objectives
    bounds: Bounds = Bounds()
    level: float = 0.95
    #: The grid's axes the search moves along (the digest leaves them out).
    searched: ClassVar[tuple[str, ...]] = ("load",)

    def cells_at(self, cells: list[sweep.Cell], load: float) -> list[sweep.Cell]:
        """A unit's cells (one per seed) at a point of the search."""
        return [dataclasses.replace(c, load=load) for c in cells]

    def propose(self, unit: sweep.Cell, judged: dict) -> list:
        return next_loads(judged, self.bounds)

    def settings(self) -> dict:
        """The search's settings, as the manifest records them."""
        return {"objective": written(self.objective), "level": self.level, **asdict(self.bounds)}

    @property
    def digest(self) -> str:
        """Of everything that decides the cells' rows but their loads (the folder holds any of
        them)."""
        canonical = self.config.canonical()
        canonical["grid"] = {k: v for k, v in canonical["grid"].items() if k not in self.searched}
        text = json.dumps({"capacity_search": canonical}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def units(self) -> dict[sweep.Cell, list[sweep.Cell]]:
        """Each searched unit (a cell of the placeholder load and seed 0: its policy, arrivals,
        ...) and its cells."""
        out: dict = {}
        for cell in sweep.cells(self.config):
            out.setdefault(dataclasses.replace(cell, seed=0), []).append(cell)
        return out

    def check(self) -> None:
        """ValueError before anything runs: the objective's metrics must be in a cell's summary (one
        short cell of the first unit tells which there are)."""
        cell = sweep.cells(self.config)[0]
        probe = sweep.run_cell(
            dataclasses.replace(self.config, duration_s=min(self.config.duration_s, 1.0)), cell
        )
        check_metrics(self.objective, sweep.metric_names(probe.summary))


@dataclass(frozen=True)
class Result:
    unit: sweep.Cell
    arrivals: str
    capacity: Capacity
    # requests per second at load 1 (the cells' capacity_rps), so load x it is a rate
    capacity_rps: float
    judged: dict  # load -> Judgement

    def record(self) -> dict:
        c = self.capacity
        rate = None if c.load is None else c.load * self.capacity_rps
        return {
            "policy": self.unit.policy,
            **({"policy_args": self.unit.policy_args} if self.unit.policy_args else {}),
            **(
                {"replicas": self.unit.replicas, "router": self.unit.router}
                if self.unit.replicas
                else {}
            ),
            **({"admission_at": self.unit.admission_at} if self.unit.admission_at else {}),
            "arrivals": self.arrivals,
            "load": c.load,
            "ci_low": c.ci_low,
            "ci_high": c.ci_high,
            "fails_at": c.fails_at,
            "rate_rps": rate,
            "loads_tried": c.loads_tried,
        }


@dataclass(frozen=True)
class Outcome:
    results: list[Result]
    ran: int  # cells run by this call
    reused: int  # cells the search used that OUT already held


@dataclass(frozen=True)
class Searched:
    """What a search on cells found: each unit's judgements by point, and the cells it used."""

    units: list
    judged: dict  # unit -> {point: Judgement}
    rate: dict  # unit -> its cells' capacity_rps at the last point asked (requests/s at load 1)
    used: list[str]  # the ids of every cell used, in the order asked
    ran: int  # cells run by this call


def run(
    spec: Search,
    out: str | Path,
    *,
    workers: int | None = None,
    scheduler: str | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> Outcome:
    """Search every policy's capacity, running the cells it needs into OUT (resuming the ones
    there); write the sweep dataset and ``capacity.json``."""
    found = run_cells(spec, out, workers=workers, scheduler=scheduler, log=log)
    results = [
        Result(
            unit,
            sweep.arrivals_of(spec.config, unit),
            Capacity.of(found.judged[unit]),
            found.rate[unit],
            found.judged[unit],
        )
        for unit in found.units
    ]
    atomic_write(
        Path(out) / "capacity.json",
        (json.dumps(json_ready(_report(spec, results)), indent=2) + "\n").encode(),
    )
    return Outcome(results, found.ran, len(found.used) - found.ran)


def run_cells(
    spec: Search,
    out: str | Path,
    *,
    workers: int | None = None,
    scheduler: str | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> Searched:
    """Run ``spec``'s search on its cells into OUT (resuming the ones there) and write the sweep
    dataset."""
    out = Path(out)
    spec.check()
    units = spec.units()
    sweep.claim(out, _manifest(spec))
    used: dict[str, dict] = {}  # every cell the search used (its summary), in the order asked
    rate: dict = {}  # unit -> its cells' capacity_rps (requests/s at load 1)
    ran = 0

    def cells_at(unit, point):
        return spec.cells_at(units[unit], point)

    with sweep.executor(spec.config, workers=workers, scheduler=scheduler) as runner:

        def evaluate(asks):
            nonlocal ran
            wanted = [c for unit, load in asks for c in cells_at(unit, load)]
            done = sweep.finished(out)
            todo = [c for c in wanted if c.id not in done]
            sweep.store(out, runner, todo)
            ran += len(todo)
            used.update(
                (c.id, sweep.read_cell_meta(out / "cells" / f"{c.id}.parquet")["summary"])
                for c in wanted
            )
            judged = {}
            for unit, load in asks:
                summaries = [used[c.id] for c in cells_at(unit, load)]
                rate[unit] = summaries[0]["capacity_rps"]
                per_seed = {
                    m: np.array([s[m] for s in summaries], dtype=float)
                    for m in metrics_of(spec.objective)
                }
                judged[unit, load] = judge(per_seed, spec.objective, spec.level)
            return judged

        judged = search(evaluate, list(units), spec.bounds, log, propose=spec.propose)
    summary = sweep.write_summaries(out, list(used))
    manifest = json.dumps(_manifest(spec, summary), indent=2) + "\n"
    atomic_write(out / "manifest.json", manifest.encode())
    return Searched(list(units), judged, rate, list(used), ran)


def _manifest(spec: Search, summary: pd.DataFrame | None = None) -> dict:
    """A sweep manifest (``qlab summary`` and ``qlab plot`` read it) whose digest leaves the
    searched axes out, and whose grid holds their values tried (the summary's)."""
    tried = (
        {}
        if summary is None
        else {k: [_plain(v) for v in sorted(set(summary[k]))] for k in spec.searched}
    )
    grid = {**spec.config.grid, **{k: tuple(v) for k, v in tried.items()}}
    cfg = dataclasses.replace(spec.config, grid=grid)
    manifest = sweep.manifest(cfg, 0 if summary is None else len(summary))
    manifest.update(config_sha256=spec.digest, source="qlab capacity", capacity=spec.settings())
    manifest["config"]["grid"].update(tried)
    return manifest


def _plain(value):
    """A summary's number as JSON writes it (numpy's integers are not)."""
    return value.item() if hasattr(value, "item") else value


def _report(spec: Search, results: list[Result]) -> dict:
    tried = [
        {
            **r.record(),
            "load": load,
            **{k: getattr(j, k) for k in ("met", "surely_met", "surely_failed")},
            "values": j.values,
        }
        for r in results
        for load, j in sorted(r.judged.items())
    ]
    return {
        "objective": written(spec.objective),
        "level": spec.level,
        "bounds": asdict(spec.bounds),
        "seeds": spec.config.seeds,
        "duration_s": spec.config.duration_s,
        "results": [r.record() for r in results],
        "tried": json_ready(tried),
    }


# ------------------------------------------------------------------ from the command line


def search_config(
    policies: list[str],
    arrivals: list[str],
    *,
    seconds: float,
    seeds: int,
    first_seed: int = 1,
    sweep_settings: dict | None = None,
    grid: dict | None = None,
    policy_args: dict | None = None,
    service: dict | None = None,
    retry: dict | None = None,
    batching: dict | None = None,
    where: str = "qlab capacity",
) -> SweepConfig:
    """The sweep config a search runs the cells of: ``policies`` x ``arrivals`` (an axis when there
    are several) at a placeholder load; ``batching``: a [batching] table (one batching engine, whose
    saturated throughput is load 1). ValueError when an arrival process takes no load (a search is
    over load)."""
    for spec in arrivals:
        if not arrivals_take_load(spec):
            raise ValueError(
                f"--arrivals {spec}: takes no load (its burst size sets its rate), "
                "and the search is "
                "over load; give periodic:PERIOD_S (bursts whose size follows the "
                "load)"
            )
    data = {
        "sweep": {
            "name": "capacity",
            "duration_s": seconds,
            "seeds": seeds,
            "first_seed": first_seed,
            **({"arrivals": arrivals[0]} if len(arrivals) == 1 else {}),
            **(sweep_settings or {}),
        },
        "grid": {
            "policy": list(policies),
            "load": [_SOME_LOAD],
            **({"arrivals": list(arrivals)} if len(arrivals) > 1 else {}),
            **(grid or {}),
        },
    }
    if policy_args:
        data["policy_args"] = policy_args
    if service:
        data["service"] = service
    if retry:
        data["retry"] = {"flags": retry}
        data["grid"]["retry"] = ["flags"]
    if batching:
        data["batching"] = batching
    return sweep_config.parse(data, where)


# ------------------------------------------------------------------ the table printed


def _number(value: float | None, missing: str) -> str:
    return missing if value is None else f"{value:.3g}"


def shown(record: dict, bounds: Bounds) -> dict[str, str]:
    """A result's :meth:`Result.record` as printed: its capacity, interval, the load it fails at and
    the rate; a bound the search ran into reads ``< MIN`` or ``> MAX`` (and an interval's low end
    never met surely, 0)."""
    load = (
        f"< {bounds.min_load:g}"
        if record["load"] is None
        else f">= {record['load']:.3g}"
        if record["fails_at"] is None
        else f"{record['load']:.3g}"
    )
    return {
        "capacity": load,
        "95 % interval": f"[{_number(record['ci_low'], '0')}, "
        f"{_number(record['ci_high'], f'> {bounds.max_load:g}')}]",
        "fails at": _number(record["fails_at"], "-"),
        "requests/s": _number(record["rate_rps"], "-"),
    }


def table(results: list[Result], bounds: Bounds) -> pd.DataFrame:
    """The results as printed: a row per policy (and arrival process, where there are several)."""
    rows = [
        {
            "policy": r.unit.policy + (f" ({r.unit.policy_args})" if r.unit.policy_args else ""),
            **({"router": r.unit.router} if r.unit.router else {}),
            "arrivals": r.arrivals,
            **shown(r.record(), bounds),
            "loads tried": r.capacity.loads_tried,
        }
        for r in results
    ]
    frame = pd.DataFrame(rows)
    return frame if frame["arrivals"].nunique() > 1 else frame.drop(columns="arrivals")
