"""The exceptions a gate's request ends with when it gets no answer: refused at arrival
(:class:`Rejected`, :class:`NeverInTime`, :class:`ShuttingDown`), dropped at the front
(:class:`DeadlineExceeded`), cut at its deadline (:class:`DeadlineCut`), failed in its engine
(:class:`EngineFailed`) or given up behind a stalled one (:class:`EngineStalled`).

Upstream failures. An upstream engine (:mod:`live.upstream`) raises
:class:`~live.engine.UpstreamError` or :class:`~live.engine.UpstreamTimeout`; the request
then fails with :class:`UpstreamFailed` or :class:`UpstreamTimedOut` (both
:class:`EngineFailed`: outcome error, the tracker learns nothing), which the HTTP layer
answers 502 and 504, and each one counts in ``Timings.upstream_errors``.
"""

from __future__ import annotations

import math

from qsim.outcomes import Reason
from qsim.policy import EXPIRE_REASON, Policy, Rejection, decide
from qsim.queue import CUT_REASON, STALL_REASON

from .engine import UpstreamError, UpstreamTimeout
from .jobs import Arrival, Job

#: Why a request still waiting when the server stops, or arriving while it stops, is not run.
SHUTDOWN_REASON = Reason.SHUTTING_DOWN


class Rejected(Exception):
    """Refused at arrival; ``rejection`` is qsim's :class:`~qsim.policy.Rejection`."""

    def __init__(self, rejection: Rejection, arrival: Arrival) -> None:
        super().__init__(rejection.reason)
        self.rejection = rejection
        self.arrival = arrival


#: Why a request no queue could answer in time is refused (:class:`NeverInTime`).
NEVER_IN_TIME = Reason.DEADLINE_TOO_SHORT


def never_in_time(policy: Policy, est_idle_s: float, deadline_s: float) -> bool:
    """Whether the policy refuses a request whose estimate on an idle engine is ``est_idle_s`` even
    with every engine idle and nobody waiting: then no queue state could admit it, and it is not
    overload but a request that cannot be answered in time (:class:`NeverInTime`). The policy's own
    rule decides (:func:`qsim.policy.decide` at its best case), so only a policy that refuses for
    the deadline (predictive) refuses it."""
    refusal = decide(policy, 0, 0.0, 0.0, est_idle_s, deadline_s, workers=1, idle=1)
    return refusal is not None and refusal.reason == Reason.DEADLINE_UNREACHABLE


class NeverInTime(Rejected):
    """Refused at arrival, and no queue could have answered it in time (:func:`never_in_time`): its
    estimate on an idle engine exceeds its deadline. ``rejection`` is the core's refusal, as for any
    :class:`Rejected` (a driver that compares with the simulator reads it); the answer is not
    overload (no Retry-After: sending it again meets the same deadline). ``fit_new_tokens``: the
    most new tokens whose estimate fits the deadline (0: none)."""

    reason = NEVER_IN_TIME

    def __init__(
        self,
        rejection: Rejection,
        arrival: "Arrival",
        job: "Job",
        est_idle_s: float,
        fit_new_tokens: int,
    ) -> None:
        super().__init__(rejection, arrival)
        fit = (
            f"at most {fit_new_tokens} new tokens fit it"
            if fit_new_tokens > 0
            else "not even 1 new token fits it"
        )
        self.args = (
            f"its estimate on an idle engine, {est_idle_s:.3f} s for {job.max_new_tokens} "
            "new tokens, "
            f"exceeds its deadline of {arrival.deadline_s:.3f} s, so no queue could "
            "answer it in time: "
            f"{fit}, or {job.max_new_tokens} need a deadline of at least "
            f"{math.ceil(est_idle_s * 1000)} ms",
        )
        self.numbers = {**arrival.numbers(), "fit_new_tokens": fit_new_tokens}


class ShuttingDown(Exception):
    """The server is stopping (SIGTERM, :meth:`Gate.drain`): a request still waiting is answered at
    once (outcome error), and one arriving now is refused before the gate decides on it (not
    counted)."""

    reason = SHUTDOWN_REASON


class ReplicaDown(ShuttingDown):
    """Waiting at a fleet's replica when it went down (``qlab serve --replica-down``): outcome
    error, reason ``shutting_down`` as the simulator's replica_down ends a request that waited
    there (a server that stopped while it waited); 503, sent again it goes to a replica up.
    numbers: what the gate saw at its arrival (its replica), and how long it waited."""

    def __init__(self, message: str, numbers: dict, arrival: Arrival) -> None:
        super().__init__(message)
        self.numbers = numbers
        self.arrival = arrival


class DeadlineExceeded(Exception):
    """Dropped unrun at the front: it could not finish by its deadline even if started then
    (``cannot_finish``), or the discipline dropped it there (``codel``)."""

    def __init__(
        self,
        numbers: dict[str, float],
        retry_after_s: int,
        arrival: Arrival,
        reason: str = EXPIRE_REASON,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.numbers = numbers
        self.retry_after_s = retry_after_s
        self.arrival = arrival


class DeadlineCut(Exception):
    """Stopped in service when its deadline passed, under a policy that cancels at the deadline
    (``Policy.cancel_at_deadline``): outcome ``cancelled``. numbers: what the gate saw, with the
    engine, when it took the request (``started_at``) and when the gate cut it (``at``, gate
    clock)."""

    reason = CUT_REASON

    def __init__(self, numbers: dict[str, float], arrival: Arrival) -> None:
        super().__init__(
            f"stopped in service after {numbers['running_s']:.3f} s: its deadline of "
            f"{arrival.deadline_s:.3f} s passed (the policy cancels at the deadline)"
        )
        self.numbers = numbers
        self.arrival = arrival


class EngineFailed(Exception):
    """The engine raised while running the request; ``__cause__`` is what it raised.

    numbers: the engine, and (gate clock) when it took the request and handed the failure back.
    """

    reason = "engine_exception"

    def __init__(
        self, engine: int, error: BaseException, arrival: Arrival, numbers: dict | None = None
    ) -> None:
        super().__init__(f"engine {engine} failed: {type(error).__name__}: {error}")
        self.engine = engine
        self.arrival = arrival
        self.numbers = {"engine": engine, **(numbers or {})}


class UpstreamFailed(EngineFailed):
    """The upstream server of an upstream engine answered an error, could not be reached, or
    broke off."""

    reason = UpstreamError.reason


class UpstreamTimedOut(UpstreamFailed):
    """The upstream server sent nothing for longer than the upstream engine's timeout."""

    reason = UpstreamTimeout.reason


def _failure_type(error: BaseException) -> type[EngineFailed]:
    if isinstance(error, UpstreamTimeout):
        return UpstreamTimedOut
    return UpstreamFailed if isinstance(error, UpstreamError) else EngineFailed


class EngineStalled(Exception):
    """Given up behind a stalled engine: it ran past its engine's threshold, or it waited past its
    deadline while every engine was stalled.

    engine: the engine that ran it (None: it was still waiting). numbers: what the gate saw.
    """

    reason = STALL_REASON

    def __init__(
        self, message: str, engine: int | None, numbers: dict[str, float], arrival: Arrival
    ) -> None:
        super().__init__(message)
        self.engine = engine
        self.numbers = numbers
        self.arrival = arrival
