"""Admission rules as parts: small frozen objects, each ``check(view) -> Rejection | None``.

A policy's admission decision is the first of its rules that refuses
(:meth:`qsim.policy.Policy.decide`). Each rule answers one concern (a bound on what waits, the
deadline, memory, shedding) and reads the :class:`View` by attribute name only, so that a rule of
one's own is one more part, written against the same names (docs/policies.md, "A rule of your own").

``basic`` says whether a rule reads only the view's first nine fields (the basic numbers): a
queue core builds the whole view (a projection, a draw) only for a policy with a rule that is
not basic, and :meth:`qsim.admission.Admission.admit_plain` is its fast path for the rest.

A rule that keeps state over a run (a client's token bucket, :class:`ClientRate`; the reserve's
EWMA, :class:`ReserveShare`; a count of one's own) stays a frozen part: its one hook,
:meth:`Rule.state`, makes a fresh :class:`RuleState` for each queue core (the mutable part:
``check``, ``adjust``, ``decided``), which the core's admission asks at every arrival before
the policy's decision. The component knows the hook, never a rule's type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, NamedTuple

from .outcomes import Reason

#: Times closer than this are equal. Sums of the same service times taken in another order
#: differ in the last bit, and a deadline met exactly must not read as missed by 1e-16 s.
TIME_TOLERANCE_S = 1e-9
# The reasons given most, as module names (an enum member read through its class is slow).
_SHED, _QUEUE_FULL, _WORK_LIMIT = Reason.SHED, Reason.QUEUE_FULL, Reason.WORK_LIMIT
_UNREACHABLE = Reason.DEADLINE_UNREACHABLE
#: Weight of one arrival of the reserved class in the EWMA of its admissions (about the last 20).
RESERVE_WEIGHT = 0.05

__all__ = [
    "RESERVE_WEIGHT",
    "TIME_TOLERANCE_S",
    "Arrival",
    "ClientRate",
    "KvAdmission",
    "Predictive",
    "QueueBound",
    "Rejection",
    "ReserveShare",
    "Rule",
    "RuleState",
    "Sheddable",
    "StateRule",
    "Shedding",
    "TokenBound",
    "TpotObjective",
    "TtftObjective",
    "View",
    "WorkBound",
    "retry_after",
    "take_token",
]


@dataclass(frozen=True)
class Rejection:
    """A refusal at arrival: why, the numbers behind it, and when to come back (None: never, it
    can never be served; such a refusal is a client's error, not overload)."""

    reason: str
    numbers: Mapping[str, float] = field(default_factory=dict)
    retry_after_s: int | None = 1


def retry_after(wait_s: float) -> int:
    """Retry-After in whole seconds: the estimated wait rounded up, at least 1."""
    if not math.isfinite(wait_s):
        raise ValueError(f"estimated wait must be finite, got {wait_s}")
    return max(1, math.ceil(wait_s))


class View(NamedTuple):
    """What an admission rule sees of the queue when a request arrives: read-only numbers the
    queue core computed once. Rules read it by name; the first nine fields are the basic numbers
    (what a :attr:`Rule.basic` rule may read). Times are seconds, estimates include the speed
    factor."""

    queued: int  # requests waiting (not in service), not counting this one
    queued_work_s: float  # their estimated work
    remaining_s: float  # estimated work left in service, summed over the engines
    est_service_s: float  # this request's own estimated service time
    deadline_s: float | None  # its deadline, from now (shortened where a reserve applies)
    engines: int = 1
    idle: int = 0  # engines free now: with one free it starts at once (batching: a seat now)
    priority: int = 0  # below 0: sheddable
    ahead_s: float | None = None  # the part of queued_work_s that starts before it (None: all)
    client: Any = None
    wait_s: float | None = None  # the core's projection of its wait (batching); None: see wait
    ttft_s: float = math.nan  # projected time from now to its first token (NaN: not projected)
    tpot_s: float = math.nan  # projected time per output token
    kv_wait_s: float | None = None  # its wait with the KV blocks of everyone before it reserved
    kv_use: float = 0.0  # share of the KV blocks in use
    queued_tokens: int = 0  # prompt tokens waiting
    prompt_tokens: int = 0  # its own
    u: float = math.nan  # a uniform draw for randomised rules, the same for the same arrival

    @property
    def wait(self) -> float:
        """The estimated wait before it starts."""
        if self.wait_s is not None:
            return self.wait_s
        if self.idle > 0:
            return 0.0
        ahead = self.queued_work_s if self.ahead_s is None else self.ahead_s
        return (ahead + self.remaining_s) / self.engines


@dataclass(frozen=True)
class Rule:
    """One admission concern. Subclass it as a frozen dataclass (its fields are its parameters)
    and define :meth:`check`."""

    #: Reads only the basic numbers (the view's first nine fields). False, the safe default for
    #: a rule of one's own: the core builds it the whole view.
    basic: ClassVar[bool] = False
    #: Reads the core's projections (``wait_s``, ``ttft_s``, ``tpot_s``, ``kv_wait_s``): a
    #: batching core walks its batch to make them only for a policy with such a rule. True, the
    #: safe default for a rule of one's own.
    projected: ClassVar[bool] = True
    #: Refuses only a sheddable request while others wait (a policy of such rules alone admits
    #: everything else: the fast path need not sum the work in service for it).
    sheds_only: ClassVar[bool] = False

    def check(self, view: View) -> Rejection | None:
        """None to admit (as far as this rule goes), or the refusal."""
        raise NotImplementedError

    def state(self) -> RuleState | None:
        """The hook of a rule that keeps state over a run: a fresh :class:`RuleState`, or None
        (the default: the rule keeps none, and :meth:`check` is all of it).

        A queue core's admission (:class:`qsim.admission.Admission`) calls it once for each rule
        when the core is made (a recalibration keeps the states), and asks the states at every
        arrival before the policy's decision (:meth:`qsim.policy.Policy.decide`, or an override
        of it), in the order of the rules: see :class:`RuleState`. The rule's own :meth:`check`
        is what a view alone says (the decision asks it as any rule's; outside a core, as in
        :func:`qsim.policy.decide` on a record's numbers, it is all that is asked): a stateful
        rule's usually admits."""
        return None


class Arrival(NamedTuple):
    """What a :class:`RuleState` reads of an arrival besides its view: the core's clock and the
    request's calibrated estimate before the speed factor, and that factor."""

    now: float
    base_s: float
    factor: float


class RuleState:
    """The per-run part of a rule that keeps state (:meth:`Rule.state` makes one per queue core).

    At each arrival the states are asked in the order of their rules, before the policy's
    decision: :meth:`check` first (a refusal is the arrival's: no state after it, nor the
    decision, is asked, and no state is told), then :meth:`adjust` (the view the states after it
    and the decision see). Once the decision is made, each state whose check was asked (all,
    where no state refused) is told it by :meth:`decided`. A state spends what it spends in
    :meth:`check` (a client's token, asked for whatever the decision), and learns from the
    decision in :meth:`decided` (the reserve's EWMA; a count of admissions)."""

    __slots__ = ()

    def check(self, view: View, arrival: Arrival) -> Rejection | None:
        """None to go on, or the refusal."""
        return None

    def adjust(self, view: View, arrival: Arrival) -> View:
        """The view the states after it and the decision see (the default: ``view`` itself)."""
        return view

    def decided(self, view: View, arrival: Arrival, refusal: Rejection | None) -> None:
        """The decision on an arrival its check let through (``refusal`` None: admitted), on the
        view the decision saw."""


def take_token(
    tokens: float, last: float, now: float, rate: float, burst: float
) -> tuple[float, Rejection | None]:
    """One request from a client whose bucket held ``tokens`` at ``last``: the tokens left, and
    the refusal when there was not a whole one (its Retry-After: when there will be). Pure."""
    tokens = min(burst, tokens + (now - last) * rate)
    if tokens >= 1.0 - 1e-12:
        return tokens - 1.0, None
    wait = (1.0 - tokens) / rate
    return tokens, Rejection(
        Reason.RATE_LIMITED,
        {"client_rate": rate, "client_burst": burst, "tokens": tokens, "wait_s": wait},
        retry_after(wait),
    )


@dataclass(frozen=True)
class StateRule(Rule):
    """A rule whose work is all in its per-run state (:meth:`Rule.state`): its check on a view
    alone admits, and reads nothing (so the fast path and a batching core's projections need
    nothing for it). Subclass it and define :meth:`~Rule.state`."""

    basic: ClassVar[bool] = True
    projected: ClassVar[bool] = False
    sheds_only: ClassVar[bool] = True

    def check(self, view: View) -> Rejection | None:
        return None


@dataclass(frozen=True)
class ClientRate(StateRule):
    """A token bucket per client (``Policy.client_rate`` requests per second, ``client_burst`` at
    once; ``rate_limited``). A client's token is spent when it asks, admitted or not by the rest
    of the policy: the limit is on what a client sends, as a gateway's token bucket is. A request
    without a client is not limited. Its state holds each client's bucket; its check (a view
    alone) admits."""

    rate: float
    burst: float = 1.0

    def state(self) -> RuleState:
        return _Buckets(self.rate, self.burst)


class _Buckets(RuleState):
    """:class:`ClientRate`'s state: client -> (tokens, when last counted)."""

    __slots__ = ("rate", "burst", "held")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.held: dict = {}

    def check(self, view: View, arrival: Arrival) -> Rejection | None:
        client = view.client
        if client is None:
            return None
        now = arrival.now
        tokens, last = self.held.get(client, (self.burst, now))
        tokens, refusal = take_token(tokens, last, now, self.rate, self.burst)
        self.held[client] = (tokens, now)
        return refusal


@dataclass(frozen=True)
class ReserveShare(StateRule):
    """A reserved share for the long requests (``Policy.reserve_min_s``, ``reserve_share``): while
    fewer than ``share`` of those estimated at ``min_s`` or more (calibrated, before the speed
    factor) have been admitted lately (an EWMA of :data:`RESERVE_WEIGHT` over their arrivals),
    the others see a deadline shortened by ``min_s`` x the speed factor. It refuses nothing
    itself: its state shortens the deadline the decision sees and learns from the decision."""

    min_s: float
    share: float = 0.0

    def state(self) -> RuleState:
        return _Reserve(self.min_s, self.share)


class _Reserve(RuleState):
    """:class:`ReserveShare`'s state: the EWMA of the reserved class's admissions."""

    __slots__ = ("min_s", "share", "admitted")

    def __init__(self, min_s: float, share: float) -> None:
        self.min_s, self.share = min_s, share
        self.admitted = 1.0

    def adjust(self, view: View, arrival: Arrival) -> View:
        if arrival.base_s >= self.min_s or self.admitted >= self.share:
            return view
        return view._replace(deadline_s=view.deadline_s - self.min_s * arrival.factor)

    def decided(self, view: View, arrival: Arrival, refusal: Rejection | None) -> None:
        if arrival.base_s >= self.min_s:
            self.admitted += RESERVE_WEIGHT * ((refusal is None) - self.admitted)


def _refuse(reason: str, view: View, **numbers: float) -> Rejection:
    """A refusal whose numbers end with the wait, and whose Retry-After is that wait."""
    wait = view.wait
    numbers["wait_s"] = wait
    return Rejection(reason, numbers, retry_after(wait))


@dataclass(frozen=True)
class Sheddable(Rule):
    """A request of priority below 0 is refused (``shed``) whenever it would wait behind others,
    so that under overload the sheddable go first. Every preset starts with it."""

    basic: ClassVar[bool] = True
    projected: ClassVar[bool] = False
    sheds_only: ClassVar[bool] = True

    def check(self, view: View) -> Rejection | None:
        if view.idle <= 0 and view.priority < 0 and view.queued > 0:
            return _refuse(_SHED, view, priority=view.priority, queued=view.queued)
        return None


@dataclass(frozen=True)
class QueueBound(Rule):
    """At most ``max_queue`` waiting (``queue_full``); one that starts on an idle engine waits
    for nobody, so the bound does not apply to it (max_queue 0 is the Erlang loss system)."""

    max_queue: int
    basic: ClassVar[bool] = True
    projected: ClassVar[bool] = False

    def check(self, view: View) -> Rejection | None:
        if view.idle <= 0 and view.queued >= self.max_queue:
            return _refuse(_QUEUE_FULL, view, queued=view.queued, max_queue=self.max_queue)
        return None


@dataclass(frozen=True)
class TokenBound(Rule):
    """At most ``max_queued_tokens`` prompt tokens waiting, its own included (vLLM's
    ``max_num_queued_tokens``; ``tokens_queued``)."""

    max_queued_tokens: int
    projected: ClassVar[bool] = False

    def check(self, view: View) -> Rejection | None:
        if view.idle <= 0 and view.queued_tokens + view.prompt_tokens > self.max_queued_tokens:
            return _refuse(
                Reason.TOKENS_QUEUED,
                view,
                queued_tokens=view.queued_tokens,
                prompt_tokens=view.prompt_tokens,
                max_queued_tokens=self.max_queued_tokens,
            )
        return None


@dataclass(frozen=True)
class WorkBound(Rule):
    """At most ``max_queued_seconds`` of estimated work waiting, its own included
    (``work_limit``)."""

    max_queued_seconds: float
    basic: ClassVar[bool] = True
    projected: ClassVar[bool] = False

    def check(self, view: View) -> Rejection | None:
        est = view.est_service_s
        if view.idle <= 0 and view.queued_work_s + est > self.max_queued_seconds:
            return _refuse(
                _WORK_LIMIT,
                view,
                queued_work_s=view.queued_work_s,
                est_service_s=est,
                max_queued_seconds=self.max_queued_seconds,
            )
        return None


@dataclass(frozen=True)
class Shedding(Rule):
    """llm-d's probabilistic admitter: saturation = max(waiting / queue_threshold, KV share in
    use / kv_threshold); a request of priority below ``below_priority`` is shed with probability
    min(saturation ** power * k, 1), by the view's draw ``u``."""

    queue_threshold: float
    kv_threshold: float = 0.8
    power: float = 5.0
    k: float = 300.0
    below_priority: int = 0
    projected: ClassVar[bool] = False

    def check(self, view: View) -> Rejection | None:
        if view.priority >= self.below_priority:
            return None
        saturation = max(view.queued / self.queue_threshold, view.kv_use / self.kv_threshold)
        chance = min(saturation**self.power * self.k, 1.0)
        if view.u < chance:  # NaN (no draw) never sheds
            return _refuse(
                _SHED,
                view,
                saturation=saturation,
                probability=chance,
                queued=view.queued,
                kv_use=view.kv_use,
            )
        return None


@dataclass(frozen=True)
class KvAdmission(Rule):
    """Admission by memory (the reference study's exercise 6), for a batching engine: ``kv_full``
    when its KV blocks cannot be had in time for its deadline, though its wait alone fits."""

    def check(self, view: View) -> Rejection | None:
        deadline, kv_wait, est = view.deadline_s, view.kv_wait_s, view.est_service_s
        if deadline is None or kv_wait is None or kv_wait + est <= deadline + TIME_TOLERANCE_S:
            return None
        wait = view.wait
        if wait + est > deadline + TIME_TOLERANCE_S:  # late anyway: Predictive's refusal
            return None
        return Rejection(
            Reason.KV_FULL,
            {
                "kv_wait_s": kv_wait,
                "wait_s": wait,
                "est_service_s": est,
                "deadline_s": deadline,
                "kv_use": view.kv_use,
            },
            retry_after(kv_wait),
        )


@dataclass(frozen=True)
class Predictive(Rule):
    """Refuse at arrival (``deadline_unreachable``) when estimated wait + own service would pass
    the deadline (none: no refusal)."""

    basic: ClassVar[bool] = True

    def check(self, view: View) -> Rejection | None:
        deadline = view.deadline_s
        if deadline is None:
            return None
        wait, est = view.wait, view.est_service_s
        if wait + est > deadline + TIME_TOLERANCE_S:
            return Rejection(
                _UNREACHABLE,
                {"wait_s": wait, "est_service_s": est, "deadline_s": deadline},
                retry_after(wait),
            )
        return None


@dataclass(frozen=True)
class TtftObjective(Rule):
    """Predictive admission's objective on the time to first token: refuse one projected to miss
    ``ttft_slo_s`` (``deadline_unreachable``)."""

    ttft_slo_s: float

    def check(self, view: View) -> Rejection | None:
        # Predictive admission's objective: like its deadline, none for a request without one.
        if view.deadline_s is not None and view.ttft_s > self.ttft_slo_s + TIME_TOLERANCE_S:
            wait = view.wait
            return Rejection(
                _UNREACHABLE,
                {
                    "wait_s": wait,
                    "est_service_s": view.est_service_s,
                    "ttft_slo_s": self.ttft_slo_s,
                    "ttft_projected_s": view.ttft_s,
                },
                retry_after(wait),
            )
        return None


@dataclass(frozen=True)
class TpotObjective(Rule):
    """Predictive admission's objective on the time per output token (``tpot_slo_s``)."""

    tpot_slo_s: float

    def check(self, view: View) -> Rejection | None:
        # Predictive admission's objective: like its deadline, none for a request without one.
        if view.deadline_s is not None and view.tpot_s > self.tpot_slo_s + TIME_TOLERANCE_S:
            wait = view.wait
            return Rejection(
                _UNREACHABLE,
                {
                    "wait_s": wait,
                    "est_service_s": view.est_service_s,
                    "tpot_slo_s": self.tpot_slo_s,
                    "tpot_projected_s": view.tpot_s,
                },
                retry_after(wait),
            )
        return None
