"""Admission policies and the one decision function shared by simulator and live gate.

A policy is data (:class:`Policy`); the rules live in :func:`decide` and
:func:`cannot_finish`, which are pure: the caller reads its clock and its queue
once and passes the numbers in, so the simulator and the gate cannot disagree
about a rule, only about the numbers they feed it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

from .disciplines import DISCIPLINES

#: Reasons a request can be refused at arrival, in the order they are checked.
REJECT_REASONS = ("queue_full", "work_limit", "deadline_unreachable")
#: Reason recorded for a request dropped unrun when it reached the front.
EXPIRE_REASON = "cannot_finish"
#: Times closer than this are equal. Sums of the same service times taken in another order
#: differ in the last bit, and a deadline met exactly must not read as missed by 1e-16 s.
TIME_TOLERANCE_S = 1e-9


@dataclass(frozen=True)
class Policy:
    """What a service agrees to run.

    max_queue: at most this many *waiting* (the ones in service do not count).
    max_queued_seconds: refuse when the estimated queued work would pass this.
    predictive: refuse at arrival when estimated wait + own service > deadline.
    deadline_s: the deadline a request gets when it does not bring its own.
    expire_at_front: drop a waiting request unrun when it reaches the front
        and could not finish by its deadline even if started now.
    discipline: the order waiting requests start in, a name in
        :data:`qsim.disciplines.DISCIPLINES` (the study's is fifo).
    """

    name: str = "custom"
    max_queue: int | None = None
    max_queued_seconds: float | None = None
    predictive: bool = False
    deadline_s: float = 2.0
    expire_at_front: bool = False
    discipline: str = "fifo"

    def __post_init__(self) -> None:
        if self.discipline not in DISCIPLINES:
            raise ValueError(f"unknown discipline {self.discipline!r}; choose one of {', '.join(DISCIPLINES)}")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_queued_seconds is not None and not self.max_queued_seconds > 0:
            raise ValueError(f"max_queued_seconds must be > 0, got {self.max_queued_seconds}")
        if not (self.deadline_s > 0 and math.isfinite(self.deadline_s)):
            raise ValueError(f"deadline_s must be a positive number of seconds, got {self.deadline_s}")

    def make_discipline(self):
        """A new, empty queue of this policy's discipline (one per queue: it holds the waiting)."""
        return DISCIPLINES[self.discipline]()

    def with_overrides(self, max_queue: int | None = None, deadline_s: float | None = None) -> "Policy":
        """The preset with a different bound or default deadline (CLI --max-queue, --deadline)."""
        changes: dict = {}
        if max_queue is not None:
            changes["max_queue"] = max_queue
        if deadline_s is not None:
            changes["deadline_s"] = deadline_s
        return replace(self, **changes) if changes else self


PRESETS: Mapping[str, Policy] = {
    "none": Policy("none"),
    "bounded": Policy("bounded", max_queue=8),
    "bounded-deadline": Policy("bounded-deadline", max_queue=8, deadline_s=2.0, expire_at_front=True),
    # Expiry at the front stays as a second line behind the arrival check.
    "predictive": Policy("predictive", predictive=True, deadline_s=2.0, expire_at_front=True),
    # Beyond the study: the same predictive admission, other orders of service.
    "predictive-edf": Policy("predictive-edf", predictive=True, expire_at_front=True, discipline="edf"),
    "predictive-sjf": Policy("predictive-sjf", predictive=True, expire_at_front=True, discipline="sjf"),
    # No bound at arrival; the order (and CoDel's drops) does the work under overload.
    "adaptive-lifo": Policy("adaptive-lifo", expire_at_front=True, discipline="adaptive-lifo"),
    "codel": Policy("codel", discipline="codel"),
}
#: The reference study's four policies (its sweeps and figures are over these).
STUDY = ("none", "bounded", "bounded-deadline", "predictive")


def preset(name: str) -> Policy:
    """The named preset, or a ValueError listing the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(PRESETS)}") from None


@dataclass(frozen=True)
class Rejection:
    """A refusal at arrival: why, the numbers behind it, and when to come back."""

    reason: str
    numbers: Mapping[str, float] = field(default_factory=dict)
    retry_after_s: int = 1


def retry_after(wait_s: float) -> int:
    """Retry-After in whole seconds: the estimated wait rounded up, at least 1."""
    if not math.isfinite(wait_s):
        raise ValueError(f"estimated wait must be finite, got {wait_s}")
    return max(1, math.ceil(wait_s))


def decide(
    policy: Policy,
    queued: int,
    queued_work_s: float,
    in_service_remaining_s: float,
    est_service_s: float,
    deadline_s: float | None,
    workers: int = 1,
    idle: int = 0,
) -> Rejection | None:
    """Admit (``None``) or refuse (:class:`Rejection`) one arriving request.

    queued / queued_work_s: requests waiting and their estimated work, not
    counting this one. in_service_remaining_s: estimated remaining work summed
    over busy engines. idle: engines free right now; with one free the request
    starts at once, so it waits for nobody and the queue bounds do not apply
    to it (this is what makes max_queue=0 the Erlang loss system).
    """
    wait = 0.0 if idle > 0 else (queued_work_s + in_service_remaining_s) / workers
    if idle <= 0:
        if policy.max_queue is not None and queued >= policy.max_queue:
            return Rejection(
                "queue_full",
                {"queued": queued, "max_queue": policy.max_queue, "wait_s": wait},
                retry_after(wait),
            )
        limit = policy.max_queued_seconds
        if limit is not None and queued_work_s + est_service_s > limit:
            return Rejection(
                "work_limit",
                {
                    "queued_work_s": queued_work_s,
                    "est_service_s": est_service_s,
                    "max_queued_seconds": limit,
                    "wait_s": wait,
                },
                retry_after(wait),
            )
    if policy.predictive and deadline_s is not None and wait + est_service_s > deadline_s + TIME_TOLERANCE_S:
        return Rejection(
            "deadline_unreachable",
            {"wait_s": wait, "est_service_s": est_service_s, "deadline_s": deadline_s},
            retry_after(wait),
        )
    return None


def cannot_finish(now: float, est_service_s: float, deadline_at: float) -> bool:
    """True when a request started ``now`` would still end after ``deadline_at``."""
    return now + est_service_s > deadline_at + TIME_TOLERANCE_S


def on_time(latency_s, deadline_s):
    """Whether an answer was good (True) or late; works on scalars and arrays."""
    return latency_s <= deadline_s + TIME_TOLERANCE_S
