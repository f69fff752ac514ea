"""A request as the queue core holds it, waiting or running: named fields, never positions."""

from __future__ import annotations

from typing import Any, NamedTuple


class Work(NamedTuple):
    """What a request asks of an engine: its limit, its prompt, and the tokens it will generate
    (None: unknown, as on a live gate). The estimators estimate from it and the batching engine runs
    it."""

    limit: int  # max_new_tokens
    prompt: int  # prompt tokens
    generated: int | None = None


class Entry(NamedTuple):
    """A waiting or running request. ``req`` is the driver's own handle (a request index in the
    simulator, a ticket in the gate), compared with ``==``; the queue never looks inside it."""

    req: Any
    arrived_at: float
    base_s: float  # the calibrated estimate (before the speed factor)
    deadline_s: float  # seconds after arrival
    priority: int = 0
    client: Any = None
    work: Work | None = None  # None where the driver gave none

    @property
    def due(self) -> float:
        """Its absolute deadline."""
        return self.arrived_at + self.deadline_s
