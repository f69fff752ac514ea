"""The admission queue: every piece of queue state, and no clock.

:class:`AdmissionQueue` owns the waiting requests and their summed estimate,
each engine (idle, busy with an estimated end, stalled), the speed tracker
and the policy. It is driven by events that carry their time and answers by
calling two hooks its driver passes in, as SimPy's queue variants plug in
through small hooks:

* ``start(k, req, now, est_s)``: run ``req`` on engine k from ``now``;
* ``drop(req, now, outcome, reason, est_s)``: end a waiting ``req`` unrun
  (``expired`` at the front, or given up behind stalled engines).

Events: :meth:`~AdmissionQueue.arrive` (admit, start or queue; or return the
:class:`~qsim.policy.Rejection`), :meth:`~AdmissionQueue.finished` (an engine
handed a request back, with the engine's own time and whether it failed),
:meth:`~AdmissionQueue.stall` (an engine ran past its stall threshold),
:meth:`~AdmissionQueue.cancel` (a client left),
:meth:`~AdmissionQueue.cut` (a running request's deadline passed, under a policy
that cancels at the deadline) and :meth:`~AdmissionQueue.give_up` (every engine
is stalled: waiting past a deadline is hopeless). The policy's estimator
(:mod:`qsim.estimators`) lives here too: it makes each arrival's estimate and
learns from each completion's tokens, for both drivers. Two drivers exist: :mod:`qsim.model` on SimPy's
simulated clock and :mod:`live.gate` on the event loop's real one. Neither
keeps queue state, so the simulator and the gate cannot drift apart: every
number :func:`~qsim.policy.decide`, :func:`~qsim.policy.cannot_finish` and the
tracker see is computed here and nowhere else.

``req`` is opaque to the queue (a request index in the simulator, a ticket in
the gate); it is compared with ``==``. The order in which waiting requests are
started is the *discipline*, a component the queue consults (FIFO by default;
:mod:`qsim.disciplines` holds the others): ``push``, ``pop_next(now)``,
``remove``, ``len``, iteration, and optionally ``drop_reason`` (CoDel),
``started`` (fair share) and ``ahead_s(entry)`` (fair share, priority classes:
how much waiting work an arrival would start behind, which the wait estimate
uses instead of all of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from .policy import EXPIRE_REASON, Policy, Rejection, cannot_finish, decide, on_time, take_token
from .service import ServiceModel, SpeedTracker

#: Weight of one arrival of the reserved class in the EWMA of its admissions (about the last 20).
RESERVE_WEIGHT = 0.05
#: Reason of a request ended because its engine stalled, or given up behind stalled engines.
STALL_REASON = "engine_stalled"


@dataclass(frozen=True)
class StallRule:
    """An engine is stalled once its request has run past max(factor x estimate at start, floor_s).

    Far beyond any speed change seen on a shared machine (2.25x); the floor keeps a
    short request's hiccup from counting.
    """

    factor: float = 10.0
    floor_s: float = 5.0

    def __post_init__(self) -> None:
        if not (self.factor >= 1 and math.isfinite(self.factor)):
            raise ValueError(f"stall factor must be a finite number >= 1, got {self.factor}")
        if not (self.floor_s > 0 and math.isfinite(self.floor_s)):
            raise ValueError(f"stall floor must be a positive number of seconds, got {self.floor_s}")

    def after_s(self, est_service_s: float) -> float:
        """How long a request estimated at ``est_service_s`` may run before its engine counts as stalled."""
        return max(self.factor * est_service_s, self.floor_s)


# A waiting or running request: (req, arrived_at, calibrated estimate, deadline relative to arrival, priority, client,
# work), work being (max_new_tokens, prompt tokens, tokens it will generate or None) or None where the driver gave none.
Entry = tuple
#: Reason of a request stopped in service when its deadline passed (outcome cancelled).
CUT_REASON = "deadline_passed"


class AdmissionQueue:
    """Queue state and the rules applied to it; see the module docstring."""

    def __init__(self, policy: Policy, engines: int, *, start: Callable, drop: Callable,
                 tracker: SpeedTracker | None = None, discipline=None, stall: StallRule | None = StallRule(),
                 gone: Callable[[Any], bool] | None = None, model: ServiceModel | None = None) -> None:
        """gone(req): True when a waiting request's client has left but has not been cancelled yet
        (the gate's futures report a hang-up a loop turn late); such a request is skipped at the front.
        model: the calibrated service line the policy's estimator scales by (default the reference)."""
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        self.policy = policy
        self.engines = engines
        self.tracker = tracker if tracker is not None else SpeedTracker()
        self.waiting = policy.make_discipline() if discipline is None else discipline
        self.estimator = policy.make_estimator(model if model is not None else ServiceModel())
        self.waiting_base_s = 0.0  # calibrated estimates of the waiting, summed
        self.running: list[Entry | None] = [None] * engines
        self.busy_until = [0.0] * engines  # estimated end of each engine's request
        self.started_at = [math.nan] * engines
        self.stall_after_s = [math.inf] * engines  # the engine is stalled once its request has run this long
        self.stalled = [False] * engines
        self.ended = [False] * engines  # its request already has an outcome (stalled, or its client left)
        self.idle = list(range(engines - 1, -1, -1))  # pop() gives the lowest free engine
        self.stall_rule = stall
        self._start, self._drop, self._gone = start, drop, gone
        self._drop_reason = getattr(self.waiting, "drop_reason", None)
        self._started = getattr(self.waiting, "started", None)
        self._ahead = getattr(self.waiting, "ahead_s", None)
        self._n_stalled = 0
        self.buckets: dict = {}  # client -> (tokens, when last counted): the per-client token buckets
        self.reserved_admitted = 1.0  # EWMA of the reserved class's admissions (see Policy.reserve_share)

    # -- events -------------------------------------------------------------------

    def arrive(self, req, now: float, base_est_s: float, deadline_s: float | None = None,
               priority: int = 0, client=None, work: tuple | None = None) -> Rejection | None:
        """Admit ``req`` (started on an idle engine at once, else queued) or return the refusal.

        deadline_s is relative to ``now``; None takes the policy's. priority orders it under a priority
        discipline (below 0: sheddable); client names whose token bucket it draws on, where the policy
        limits each client (None: no client). work: (max_new_tokens, prompt tokens, tokens it will
        generate or None), what the policy's estimator estimates from in place of base_est_s (which
        is the estimate at the limit); None: base_est_s as it is. ``self.seen`` holds what the decision was made on, the
        admission columns of its record: (estimate x speed factor, waiting count, their estimated
        work, speed factor). A request admitted while an engine is idle is in service from this
        instant, so a burst cannot slip one more past a bound than the bound allows.
        """
        if deadline_s is None:
            deadline_s = self.policy.deadline_s
        if self.estimator is not None and work is not None:
            base_est_s = self.estimator.base_s(base_est_s, *work)
        factor = self.tracker.factor
        est = base_est_s * factor
        waiting = self.waiting
        queued = len(waiting)
        queued_work = self.waiting_base_s * factor
        idle = self.idle
        self.seen = (est, queued, queued_work, factor)
        if client is not None and self.policy.client_rate is not None:
            refusal = self._rate_limit(client, now)
            if refusal is not None:
                return refusal
        budget = deadline_s if self.policy.reserve_min_s is None else self._reserve(base_est_s, deadline_s, factor)
        entry = (req, now, base_est_s, deadline_s, priority, client, work)
        ahead = None if self._ahead is None or idle else self._ahead(entry) * factor
        refusal = decide(self.policy, queued, queued_work, 0.0 if idle else self.remaining_s(now), est, budget,
                         self.engines, len(idle), priority, ahead)
        if self.policy.reserve_min_s is not None and base_est_s >= self.policy.reserve_min_s:
            self.reserved_admitted += RESERVE_WEIGHT * ((refusal is None) - self.reserved_admitted)
        if refusal is not None:
            return refusal
        if idle:
            self._begin(idle.pop(), entry, now)
        else:
            waiting.push(entry)
            self.waiting_base_s += base_est_s
        return None

    def finished(self, k: int, now: float, engine_s: float, ok: bool = True, tokens: int | None = None) -> str | None:
        """Engine k handed its request back at ``now``; ``engine_s`` is the engine's own time.

        Returns the request's outcome (good or late by ``now``, error when ``ok`` is false), or
        None when it already had one (stalled, cut, or its client left). A failed, stalled or cut
        run teaches the tracker nothing (a hang's time would multiply every later estimate); one
        whose client left still does. tokens: the tokens it generated, which the estimator learns
        (and the tracker compares against, where the estimator learns). Then engine k takes the
        next waiting request, or goes idle.
        """
        entry = self.running[k]
        if entry is None:
            raise RuntimeError(f"engine {k} finished but was running nothing")
        self.running[k] = None
        stalled, ended = self.stalled[k], self.ended[k]
        if stalled:
            self.stalled[k] = False
            self._n_stalled -= 1
        self.ended[k] = False
        outcome = None
        if ok and not stalled:
            work, est = entry[6], self.estimator
            if est is not None and est.learns and work is not None and tokens is not None:
                est.learn(work[0], tokens)
                self.tracker.observe(est.work_s(work[0], work[1], tokens), engine_s)
            else:
                # Against the estimate made at arrival (from max_new_tokens, the study's): a stop string
                # that ends a request early reads as a faster machine.
                self.tracker.observe(entry[2], engine_s)
            if not ended:
                outcome = "good" if on_time(now - entry[1], entry[3]) else "late"
        elif not ok and not (stalled or ended):
            outcome = "error"
        self._next(k, now)
        return outcome

    def cancel(self, req, now: float) -> str | None:
        """The client of ``req`` left: "waiting" (it left the queue with its work), "running" (its engine
        stays busy until it hands the request back: a run cannot always be stopped), or None (it had ended)."""
        for entry in self.waiting:
            if entry[0] == req:
                self.waiting.remove(entry)
                self.waiting_base_s = self.waiting_base_s - entry[2] if self.waiting else 0.0
                return "waiting"
        for k, entry in enumerate(self.running):
            if entry is not None and entry[0] == req and not self.ended[k]:
                self.ended[k] = True
                return "running"
        return None

    def cut(self, k: int, now: float):
        """Engine k's request passed its deadline under ``cancel_at_deadline``: it ends now (cancelled).

        Returns the request, or None when it had ended already. The driver stops the engine, which then
        hands the request back through :meth:`finished` (with ``ok`` False: a cut run teaches nothing).
        """
        entry = self.running[k]
        if entry is None or self.ended[k]:
            return None
        self.ended[k] = True
        return entry[0]

    def overdue(self, now: float) -> list[int]:
        """Engines whose request has run past its stall threshold and that are not marked stalled yet."""
        return [k for k in range(self.engines)
                if self.running[k] is not None and not self.stalled[k] and now - self.started_at[k] > self.stall_after_s[k]]

    def stall(self, k: int, now: float):
        """Mark engine k stalled. Returns its request when that request now ends (as an error), else None.

        The engine stays busy until it hands the request back; meanwhile its remaining work counts as
        its overrun so far, so the wait estimate keeps growing instead of reading it as about to finish.
        """
        if self.running[k] is None or self.stalled[k]:
            return None
        self.stalled[k] = True
        self._n_stalled += 1
        if self.ended[k]:
            return None
        self.ended[k] = True
        return self.running[k][0]

    @property
    def all_stalled(self) -> bool:
        return self._n_stalled == self.engines

    def give_up(self, now: float) -> int:
        """While every engine is stalled the queue cannot move: end each waiting request whose deadline
        has passed, ``expired`` where the policy expires at the front (what the front would decide), else
        an error. Returns how many were ended."""
        if not self.all_stalled:
            return 0
        late = [e for e in self.waiting if now >= e[1] + e[3]]
        for entry in late:
            self.waiting.remove(entry)
            self.waiting_base_s = self.waiting_base_s - entry[2] if self.waiting else 0.0
            if self._gone is not None and self._gone(entry[0]):
                continue
            expire = self.policy.expire_at_front
            self._drop(entry[0], now, "expired" if expire else "error", EXPIRE_REASON if expire else STALL_REASON,
                       entry[2] * self.tracker.factor)
        return len(late)

    def _reserve(self, base_est_s: float, deadline_s: float, factor: float) -> float:
        """The deadline the rule sees: shortened for the unreserved while the reserved class is under its share."""
        p = self.policy
        if base_est_s >= p.reserve_min_s or self.reserved_admitted >= p.reserve_share:
            return deadline_s
        return deadline_s - p.reserve_min_s * factor

    def _rate_limit(self, client, now: float) -> Rejection | None:
        # A client's tokens are spent when it asks, admitted or not by the rest of the policy:
        # the limit is on what a client sends, as a gateway's token bucket is.
        p = self.policy
        tokens, last = self.buckets.get(client, (p.client_burst, now))
        tokens, refusal = take_token(tokens, last, now, p.client_rate, p.client_burst)
        self.buckets[client] = (tokens, now)
        return refusal

    # -- the numbers ----------------------------------------------------------------

    def remaining_s(self, now: float) -> float:
        """Estimated work left in service, summed over the engines. An engine past its estimate counts as
        about to finish (0), unless it is stalled: then its overrun so far, since it has shown it is not."""
        if not self._n_stalled:
            if self.engines == 1:  # a generator per arrival costs a sixth of predictive's simulation time
                end = self.busy_until[0]
                return end - now if end > now else 0.0
            return sum(max(0.0, end - now) for end in self.busy_until)
        return sum((now - end) if st else max(0.0, end - now) for end, st in zip(self.busy_until, self.stalled))

    def wait_s(self, now: float) -> float:
        """The wait :func:`~qsim.policy.decide` would estimate for an arrival now (a Retry-After's basis)."""
        if self.idle:
            return 0.0
        return (self.waiting_base_s * self.tracker.factor + self.remaining_s(now)) / self.engines

    @property
    def queued_work_s(self) -> float:
        return self.waiting_base_s * self.tracker.factor

    @property
    def in_service(self) -> int:
        return self.engines - len(self.idle)

    def snapshot(self) -> dict:
        """The queue now, for /stats and tests."""
        return {"waiting": len(self.waiting), "in_service": self.in_service, "stalled": self._n_stalled,
                "queued_work_s": self.queued_work_s, "speed_factor": self.tracker.factor, "engines": self.engines}

    def stalled_engines(self, now: float) -> list[dict]:
        """Each stalled engine: how long its request has run, its threshold and estimate."""
        return [{"engine": k, "running_s": now - self.started_at[k],
                 "stall_after_s": self.stall_after_s[k],
                 "est_service_s": self.busy_until[k] - self.started_at[k]}
                for k in range(self.engines) if self.stalled[k]]

    # -- inside -------------------------------------------------------------------------

    def _begin(self, k: int, entry: Entry, now: float) -> None:
        est = entry[2] * self.tracker.factor
        self.running[k] = entry
        self.busy_until[k] = now + est
        self.started_at[k] = now
        rule = self.stall_rule
        self.stall_after_s[k] = math.inf if rule is None else rule.after_s(est)
        if self._started is not None:
            self._started(entry)
        self._start(k, entry[0], now, est)

    def _next(self, k: int, now: float) -> None:
        """Give engine k the first waiting request that can still make it, or mark k idle."""
        waiting = self.waiting
        expire = self.policy.expire_at_front
        gone, drop_reason = self._gone, self._drop_reason
        while waiting:
            entry = waiting.pop_next(now)
            self.waiting_base_s -= entry[2]
            if gone is not None and gone(entry[0]):
                continue
            if expire:
                est = entry[2] * self.tracker.factor
                if cannot_finish(now, est, entry[1] + entry[3]):
                    self._drop(entry[0], now, "expired", EXPIRE_REASON, est)
                    continue
            if drop_reason is not None:
                est = entry[2] * self.tracker.factor
                reason = drop_reason(entry, now, est)
                if reason is not None:
                    self._drop(entry[0], now, "expired", reason, est)
                    continue
            self._begin(k, entry, now)
            return
        self.waiting_base_s = 0.0  # no drift from adding and subtracting floats
        self.idle.append(k)
