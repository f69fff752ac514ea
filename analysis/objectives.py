"""Objectives over a sweep's summary metrics ("share_good>=0.9"), as the figures draw them.

An objective is a metric, a direction and a value: ``share_good>=0.9`` (at least 90 % in time),
``latency_p99_s<=2`` (p99 latency of the answered at most 2 s). ``METRIC=VALUE`` means the
metric's good direction: at least VALUE for a share or goodput, at most VALUE for a latency.
Several are joined with ``and``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_TERM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|=)\s*([^\s=<>]+)\s*$")
_LATENCY = re.compile(r"^latency_p(\d+(?:\.\d+)?)_s$")


@dataclass(frozen=True)
class Objective:
    """``metric op value``: what a summary metric should meet."""

    metric: str
    op: str  # ">=" or "<="
    value: float

    def __str__(self) -> str:
        return f"{self.metric} {'≥' if self.op == '>=' else '≤'} {self.value:g}"

    @property
    def quantile(self) -> float | None:
        """For a latency percentile (latency_p99_s) its quantile (0.99), else None."""
        found = _LATENCY.match(self.metric)
        return float(found.group(1)) / 100 if found else None


def parse_objectives(text: str) -> tuple[Objective, ...]:
    """``"share_good>=0.9 and latency_p99_s<=2"`` as Objectives; ValueError saying what is wrong."""
    found = []
    for term in re.split(r"\s+and\s+", text.strip()):
        match = _TERM.match(term)
        if not match:
            raise ValueError(f"objective {term!r}: expected METRIC>=VALUE, METRIC<=VALUE or METRIC=VALUE "
                             "(e.g. share_good>=0.9), several joined with 'and'")
        metric, op, number = match.groups()
        try:
            value = float(number)
        except ValueError:
            raise ValueError(f"objective {term!r}: {number!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"objective {term!r}: the value must be finite")
        if op == "=":  # the good direction: latencies should be low, shares and rates high
            op = "<=" if metric.startswith("latency") else ">="
        found.append(Objective(metric, op, value))
    return tuple(found)
