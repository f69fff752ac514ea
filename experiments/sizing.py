"""``qlab capacity --rate R``: the fewest replicas that meet an objective at R requests per second.

The same machinery as the capacity search over load (:mod:`experiments.capacity`): cells of a
sweep config, the same seeds at every point (common random numbers, and the router's draws a
stream of their own), each point judged by :func:`experiments.capacity.judge` from the seeds'
Student-t intervals. The points are whole replica counts N, the rate fixed: each replica then
runs at load R / (N x one replica's capacity_rps), so more replicas meet the objective sooner.

The search (:func:`next_counts`), per policy and router: double N until some count meets the
objective surely, halve it until one fails it surely (within the fewest a router can route
between .. ``max_replicas``), then bisect each of three crossings, as the load search does,
until its bracket is two neighbours. The answer is the fewest count whose seeds' mean meets the
objective above the most that does not; its 95 % interval runs from the fewest not failed
surely to the fewest met surely (test inversion: the counts where the seeds cannot reject that
the metric is at its threshold, and past them).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pandas as pd

from analysis.objectives import written
from inputs.atomic import atomic_write
from qsim.routers import parse_router

from . import capacity, sweep
from .capacity import CROSSINGS, Judgement, Search
from .jsonout import json_ready

#: The most replicas a sizing search tries unless told (--max-replicas).
MAX_REPLICAS = 64


def count_crossing(judged: dict[int, Judgement], holds) -> tuple[int | None, int | None]:
    """(below, above): the most replicas tried where ``holds`` is false, and the fewest above it
    where it is true (None where there is none). The load search's :func:`capacity.crossing` on
    counts turned around: its properties hold at low loads, so at many replicas."""
    lo, hi = capacity.crossing({-n: j for n, j in judged.items()}, holds)
    return (None if hi is None else -hi), (None if lo is None else -lo)


def next_counts(judged: dict[int, Judgement], least: int, most: int, start: int) -> list[int]:
    """The replica counts to try next for one unit, given what is known; [] when done."""
    if not judged:
        return [start]
    fewest, most_tried = min(judged), max(judged)
    wanted = set()
    if not any(j.surely_met for j in judged.values()) and most_tried < most:
        wanted.add(min(most_tried * 2, most))
    if not any(j.surely_failed for j in judged.values()) and fewest > least:
        wanted.add(max(fewest // 2, least))
    for holds in CROSSINGS.values():
        below, above = count_crossing(judged, holds)
        if below is not None and above is not None and above - below > 1:
            wanted.add((below + above) // 2)
    return sorted(wanted - set(judged))


@dataclass(frozen=True)
class Fewest:
    """One unit's answer: the fewest replicas that met the objective (None: not up to the most
    searched), the most that did not, the 95 % interval (ci_high None: beyond the most searched)."""

    replicas: int | None
    fails_at: int | None
    ci_low: int | None
    ci_high: int | None
    counts_tried: int

    @classmethod
    def of(cls, judged: dict[int, Judgement]) -> "Fewest":
        fails_at, replicas = count_crossing(judged, CROSSINGS["met"])
        ci_low = count_crossing(judged, CROSSINGS["not_surely_failed"])[1]
        ci_high = count_crossing(judged, CROSSINGS["surely_met"])[1]
        return cls(replicas, fails_at, ci_low, ci_high, len(judged))


def fewest_possible(unit: sweep.Cell) -> int:
    """The fewest replicas the unit's router can route between: one server always, but power_of_d's
    d choices need d replicas (so its counts start at d where d > 2)."""
    d = getattr(parse_router(unit.router or "round_robin"), "d", 1)
    return 1 if d <= 2 else d


@dataclass(frozen=True)
class Sizing(Search):
    """A search over the replicas of each unit's fleet at ``rate_rps`` requests per second."""

    rate_rps: float = 1.0
    max_replicas: int = MAX_REPLICAS
    searched: ClassVar[tuple[str, ...]] = ("load", "replicas")

    def __post_init__(self) -> None:
        if not (self.rate_rps > 0 and math.isfinite(self.rate_rps)):
            raise ValueError(
                f"--rate must be a positive number of requests per second, got {self.rate_rps:g}"
            )
        # What a fleet cannot be yet (qsim.fleet.FleetSpec.check), before any cell runs: the
        # config's own check sees only the placeholder of one replica.
        if self.config.concurrency:
            raise ValueError(
                "--rate with --concurrency: engines that slow each other share one "
                "machine; a fleet's replicas take engines with concurrency 0"
            )

    def cells_at(self, cells: list[sweep.Cell], n: int) -> list[sweep.Cell]:
        fleet = [dataclasses.replace(c, replicas=n) for c in cells]
        return [dataclasses.replace(c, load=self.load(c)) for c in fleet]

    def load(self, cell: sweep.Cell) -> float:
        """Each replica's load at the rate: the rate over the fleet's capacity_rps (load 1)."""
        return self.rate_rps / sweep.capacity_rps(self.config, cell)

    def start(self, unit: sweep.Cell) -> int:
        """The fewest replicas not overloaded (each at load <= 1), within the bounds."""
        one = sweep.capacity_rps(self.config, dataclasses.replace(unit, replicas=1))
        n = math.ceil(round(self.rate_rps / one, 9))
        return min(max(n, fewest_possible(unit)), self.max_replicas)

    def propose(self, unit: sweep.Cell, judged: dict) -> list:
        return next_counts(judged, fewest_possible(unit), self.max_replicas, self.start(unit))

    def settings(self) -> dict:
        return {
            "objective": written(self.objective),
            "level": self.level,
            "rate_rps": self.rate_rps,
            "max_replicas": self.max_replicas,
        }


@dataclass(frozen=True)
class Answer:
    unit: sweep.Cell
    arrivals: str
    fewest: Fewest
    load: float | None  # each replica's load at the fewest replicas
    judged: dict  # replicas -> Judgement

    def record(self, rate_rps: float) -> dict:
        f = self.fewest
        return {
            "policy": self.unit.policy,
            **({"policy_args": self.unit.policy_args} if self.unit.policy_args else {}),
            "router": self.unit.router or "round_robin",
            "arrivals": self.arrivals,
            "rate_rps": rate_rps,
            "replicas": f.replicas,
            "ci_low": f.ci_low,
            "ci_high": f.ci_high,
            "fails_at": f.fails_at,
            "load": self.load,
            "counts_tried": f.counts_tried,
        }


@dataclass(frozen=True)
class Outcome:
    answers: list[Answer]
    ran: int
    reused: int


def run(spec: Sizing, out: str | Path, **options) -> Outcome:
    """Size every unit's fleet (``options``: capacity.run_cells'), writing the sweep dataset and
    ``sizing.json``."""
    found = capacity.run_cells(spec, out, **options)
    answers = []
    for unit in found.units:
        fewest = Fewest.of(found.judged[unit])
        load = None if fewest.replicas is None else spec.cells_at([unit], fewest.replicas)[0].load
        answers.append(
            Answer(unit, sweep.arrivals_of(spec.config, unit), fewest, load, found.judged[unit])
        )
    report = {
        **spec.settings(),
        "seeds": spec.config.seeds,
        "duration_s": spec.config.duration_s,
        "results": [a.record(spec.rate_rps) for a in answers],
        "tried": [
            {
                "policy": a.unit.policy,
                "router": a.unit.router,
                "replicas": n,
                **{k: getattr(j, k) for k in ("met", "surely_met", "surely_failed")},
                "values": j.values,
            }
            for a in answers
            for n, j in sorted(a.judged.items())
        ],
    }
    text = json.dumps(json_ready(report), indent=2) + "\n"
    atomic_write(Path(out) / "sizing.json", text.encode())
    return Outcome(answers, found.ran, len(found.used) - found.ran)


def _count(value: int | None, missing: str) -> str:
    return missing if value is None else str(value)


def table(answers: list[Answer], spec: Sizing) -> pd.DataFrame:
    """The answers as printed: a row per policy and router (and arrival process, where several)."""
    most = f"> {spec.max_replicas}"
    rows = [
        {
            "policy": a.unit.policy + (f" ({a.unit.policy_args})" if a.unit.policy_args else ""),
            "router": a.unit.router or "round_robin",
            "arrivals": a.arrivals,
            "replicas": _count(a.fewest.replicas, most),
            "95 % interval": f"[{_count(a.fewest.ci_low, most)}, {_count(a.fewest.ci_high, most)}]",
            "fails at": _count(a.fewest.fails_at, "-"),
            "load each": "-" if a.load is None else f"{a.load:.3g}",
            "counts tried": a.fewest.counts_tried,
        }
        for a in answers
    ]
    frame = pd.DataFrame(rows)
    return frame if frame["arrivals"].nunique() > 1 else frame.drop(columns="arrivals")
