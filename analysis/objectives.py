"""Objectives over a sweep's summary metrics ("share_good>=0.9"): what the figures draw and what
``qlab capacity`` searches for.

An objective is a metric, a comparison and a value: ``share_good>=0.9`` (at least 90 % in time),
``latency_p99_s<=2`` (p99 latency of the answered at most 2 s), ``ttft_p99_s<0.5``; ``>`` and ``<``
are strict. ``METRIC=VALUE`` means the metric's good direction: at most VALUE for a time (a metric
in seconds, ``..._s``: latencies, TTFT, TPOT), at least VALUE for anything else (a share, a
goodput). Several are joined with ``and``.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Iterable

#: Each comparison an objective may make, and how the figures write it.
COMPARISONS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_SYMBOLS = {">=": "≥", "<=": "≤", ">": ">", "<": "<"}
_TERM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|>|<|=)\s*([^\s=<>]+)\s*$")
_LATENCY = re.compile(r"^latency_p(\d+(?:\.\d+)?)_s$")
#: Metrics that are a fraction (shares, hit rates, Jain's index): between 0 and 1.
_FRACTION = re.compile(r"^(share_.*|.*_share|.*_hit_rate|jain_.*)$")
#: Times and rates that cannot be negative.
_NONNEGATIVE = re.compile(r"^(latency_|ttft_|tpot_|goodput).*$")


@dataclass(frozen=True)
class Objective:
    """``metric op value``: what a summary metric should meet."""

    metric: str
    op: str  # one of COMPARISONS
    value: float

    def __str__(self) -> str:
        return f"{self.metric} {_SYMBOLS[self.op]} {self.value:g}"

    @property
    def text(self) -> str:
        """As it is written on a command line: ``share_good>=0.9``."""
        return f"{self.metric}{self.op}{self.value:g}"

    def holds(self, measured: float) -> bool:
        """Whether ``measured`` meets it (NaN never does)."""
        return bool(COMPARISONS[self.op](measured, self.value))

    @property
    def quantile(self) -> float | None:
        """For a latency percentile (latency_p99_s) its quantile (0.99), else None."""
        found = _LATENCY.match(self.metric)
        return float(found.group(1)) / 100 if found else None


def parse_objectives(text: str) -> tuple[Objective, ...]:
    """``"share_good>=0.9 and latency_p99_s<=2"`` as Objectives; ValueError saying what is wrong."""
    found = []
    for term in re.split(r"\s+and\s+", str(text).strip()):
        match = _TERM.match(term)
        if not match:
            raise ValueError(
                f"objective {term!r}: expected METRIC>=VALUE or METRIC<=VALUE (or >, "
                "<, or = for the "
                "metric's good direction), e.g. share_good>=0.9, several joined with "
                "'and'"
            )
        metric, op, number = match.groups()
        try:
            value = float(number)
        except ValueError:
            raise ValueError(f"objective {term!r}: {number!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"objective {term!r}: the value must be finite")
        if op == "=":  # the good direction: times should be short, shares and rates high
            op = "<=" if metric.endswith("_s") else ">="
        found.append(Objective(metric, op, value))
        never = unmeetable(found[-1])
        if never:
            raise ValueError(f"objective {term!r}: {never}: no load can meet it")
    return tuple(found)


def unmeetable(o: Objective) -> str | None:
    """Why no run could meet ``o`` (a share above 1, a time below 0), else None: a search for
    the load that meets it would only report the lowest load it tried."""
    if _FRACTION.match(o.metric):
        low, high, what = 0.0, 1.0, "a fraction, between 0 and 1"
    elif _NONNEGATIVE.match(o.metric):
        low, high, what = 0.0, math.inf, "never below 0"
    else:
        return None
    reachable = {
        ">=": o.value <= high,
        ">": o.value < high,
        "<=": o.value >= low,
        "<": o.value > low,
    }
    return None if reachable[o.op] else f"{o.metric} is {what}"


def written(objectives: Iterable[Objective]) -> str:
    """Objectives as one command-line text, joined with 'and' (:func:`parse_objectives` reads it
    back)."""
    return " and ".join(o.text for o in objectives)
