"""The admission queue: every piece of queue state, and no clock.

:class:`AdmissionQueue` owns the waiting requests and their summed estimate,
each engine (idle, busy with an estimated end, stalled), the speed tracker
and the policy. It is driven by events that carry their time and answers by
calling two hooks its driver passes in, as SimPy's queue variants plug in
through small hooks:

* ``start(k, req, now, est_s)``: run ``req`` on engine k from ``now``;
* ``drop(req, now, outcome, reason, est_s, retry_after_s)``: end a waiting ``req`` unrun
  (``expired`` at the front, with the Retry-After its 503 carries, or given up behind
  stalled engines, with None).

It is built from a :class:`qsim.config.ServerConfig` (the policy, the engine model, the
calibrated line, the tracker's settings, the stall rule), the one configuration every
driver reads. The rules every driver would otherwise write for itself live here: the
deadline a request gets when it brings none (:meth:`~AdmissionQueue.deadline_of`), when a
run is cut at its deadline (:meth:`~AdmissionQueue.cut_at`, :meth:`~AdmissionQueue.cut_after`),
when an engine counts as stalled (:meth:`~AdmissionQueue.overdue`) and the Retry-After of a drop.

Events: :meth:`~AdmissionQueue.arrive` (admit, start or queue; or return the
:class:`~qsim.policy.Rejection`), :meth:`~AdmissionQueue.finished` (an engine
handed a request back, with the engine's own time and whether it failed),
:meth:`~AdmissionQueue.stall` (an engine ran past its stall threshold),
:meth:`~AdmissionQueue.cancel` (a client left),
:meth:`~AdmissionQueue.cut` (a running request's deadline passed, under a policy
that cancels at the deadline) and :meth:`~AdmissionQueue.give_up` (every engine
is stalled: waiting past a deadline is hopeless). What the policy does with an
arrival (its estimator, token buckets, reserve, shedding draw and rule) is the
core's :class:`~qsim.admission.Admission`, the batching core's too; the core
projects its own numbers for it and places what it admits. The estimator learns
from each completion's tokens here, for both drivers. Two drivers exist:
:mod:`qsim.model` on SimPy's simulated clock and :mod:`live.gate` on the event
loop's real one. Neither keeps queue state, so the simulator and the gate cannot
drift apart: every number :func:`~qsim.policy.decide`,
:func:`~qsim.policy.cannot_finish` and the tracker see is computed here and
nowhere else.

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
from typing import Any, Callable

from .admission import Admission, Core, Projection, Seen
from .config import ServerConfig, StallRule, as_config
from .engines import OneAtATime
from .entry import Entry, Work
from .outcomes import ERROR, EXPIRED, GOOD, LATE, Outcome, Reason
from .policy import EXPIRE_REASON, Policy, Rejection, cannot_finish, on_time, retry_after
from .routers import ReplicaState
from .service import SpeedTracker

_new = tuple.__new__  # a named tuple from its fields in order, without its Python-level __new__
_NAN = math.nan
#: Reason of a request ended because its engine stalled, or given up behind stalled engines.
STALL_REASON = Reason.ENGINE_STALLED
#: Reason of a request stopped in service when its deadline passed (outcome cancelled).
CUT_REASON = Reason.DEADLINE_PASSED

__all__ = ["AdmissionQueue", "CUT_REASON", "STALL_REASON", "Core", "Seen", "StallRule"]


class AdmissionQueue(Core):
    """Queue state and the rules applied to it; see the module docstring."""

    def __init__(
        self,
        config: ServerConfig | Policy,
        engines: int | None = None,
        *,
        start: Callable,
        drop: Callable,
        gone: Callable[[Any], bool] | None = None,
    ) -> None:
        """config: the server (a bare Policy: that policy on ``engines`` engines, everything else at
        its default). gone(req): True when a waiting request's client has left but has not been
        cancelled yet (the gate's futures report a hang-up a loop turn late); such a request is
        skipped at the front."""
        if isinstance(config, Policy):
            config = ServerConfig(config, OneAtATime(1 if engines is None else engines))
        elif engines is not None:
            raise ValueError("engines come from the ServerConfig; pass them there")
        config = as_config(config)
        if not isinstance(config.engine, OneAtATime):
            raise ValueError(
                f"AdmissionQueue runs engines one at a time; {config.engine.kind} "
                "engines run in "
                "qsim.batch.BatchQueue (the simulator picks the core by the engine "
                "model)"
            )
        self.config = config
        self.policy = policy = config.policy
        self.engines = engines = config.engine.engines
        self._slowdown = config.engine.slowdown if config.engine.concurrency else None
        self.tracker = SpeedTracker(
            weight=config.tracker_weight,
            initial=config.initial_speed_factor,
            fixed=config.fixed_estimate,
        )
        self.waiting = policy.make_discipline()
        self.admission = Admission(
            config,
            counts_refused=False,
            empty=Seen(math.nan, 0, 0.0, self.tracker.factor, 0.0, engines),
        )
        self.waiting_base_s = 0.0  # calibrated estimates of the waiting, summed
        self.waiting_tokens = 0  # their prompt tokens, summed
        self.running: list[Entry | None] = [None] * engines
        self.busy_until = [0.0] * engines  # estimated end of each engine's request
        self.started_at = [math.nan] * engines
        # the engine is stalled once its request has run this long
        self.stall_after_s = [math.inf] * engines
        self.stalled = [False] * engines
        # its request already has an outcome (stalled, or its client left)
        self.ended = [False] * engines
        self.idle = list(range(engines - 1, -1, -1))  # pop() gives the lowest free engine
        self.stall_rule = config.stall
        self._start, self._drop, self._gone = start, drop, gone
        self._drop_reason = getattr(self.waiting, "drop_reason", None)
        self._started = getattr(self.waiting, "started", None)
        self._ahead = getattr(self.waiting, "ahead_s", None)
        self._n_stalled = 0
        # the slowdown each engine's run started with (OneAtATime.concurrency)
        self.slow = [1.0] * engines
        self._objectives = policy.ttft_slo_s is not None or policy.tpot_slo_s is not None
        if self.admission.plain and self._slowdown is None:
            # the basic policies: the same decisions on a shorter path
            self.arrive = self._arrive_plain

    # -- events -------------------------------------------------------------------

    def recalibrate(self, config: ServerConfig) -> None:
        """A new calibration taken mid-run (live: an operator's ``PUT /admin/calibration``):
        arrivals from now on are estimated with ``config``'s service model and engine slowdown (the
        engine count stays). The speed tracker starts again from its initial factor and a learning
        estimator from nothing: both were relative to the old model. Requests already waiting keep
        the estimates they arrived with."""
        if config.engine.engines != self.engines:
            raise ValueError(
                f"a calibration cannot change the engines ({self.engines} -> "
                f"{config.engine.engines})"
            )
        self.config = config
        self._slowdown = config.engine.slowdown if config.engine.concurrency else None
        self.tracker = SpeedTracker(
            weight=config.tracker_weight,
            initial=config.initial_speed_factor,
            fixed=config.fixed_estimate,
        )
        self.admission.recalibrate(config)

    def arrive(
        self,
        req,
        now: float,
        base_est_s: float,
        deadline_s: float | None = None,
        priority: int = 0,
        client=None,
        work: Work | tuple | None = None,
    ) -> Rejection | None:
        """Admit ``req`` (started on an idle engine at once, else queued) or return the refusal.

        deadline_s is relative to ``now``; None (or NaN) takes the policy's. priority orders it
        under a priority discipline (below 0: sheddable); client names whose token bucket it draws
        on, where the policy limits each client (None: no client). work: a :class:`~qsim.entry.Work`
        (max_new_tokens, prompt tokens, tokens it will generate or None), what the policy's
        estimator estimates from in place of base_est_s (which is the estimate at the limit); None:
        base_est_s as it is. ``self.seen`` says what the decision was made on (:class:`Seen`), the
        admission columns of its record. A request admitted while an engine is idle is in service
        from this instant, so a burst cannot slip one more past a bound than the bound allows.
        """
        admission = self.admission
        base_est_s, deadline_s, work = admission.arrival(base_est_s, deadline_s, work)
        entry = _new(Entry, (req, now, base_est_s, deadline_s, priority, client, work))
        factor = self.tracker.factor
        refusal = admission.admit(now, entry, factor, self._projection(entry, now, factor))
        if refusal is None:
            self._place(entry, now)
        return refusal

    def _arrive_plain(
        self,
        req,
        now: float,
        base_est_s: float,
        deadline_s: float | None = None,
        priority: int = 0,
        client=None,
        work: Work | tuple | None = None,
    ) -> Rejection | None:
        """:meth:`arrive` for a :attr:`~qsim.admission.Admission.plain` policy on engines that do
        not slow each other: the same decisions (tests/test_admission.py holds it to
        :meth:`arrive`), on the admission's fast path. It runs once per arrival of every plain
        simulation (bench_qsim's cases A and B)."""
        admission = self.admission
        base_est_s, deadline_s, work = admission.arrival(base_est_s, deadline_s, work)
        entry = _new(Entry, (req, now, base_est_s, deadline_s, priority, client, work))
        factor = self.tracker.factor
        idle = len(self.idle)
        if idle:
            remaining, ahead = 0.0, None
        elif admission.admits_all and priority >= 0:
            # A rule that admits all reads nothing: the work in service is left unsaid (NaN)
            # rather than summed on every arrival of bench_qsim's case A.
            remaining, ahead = _NAN, None
        else:
            remaining = self.remaining_s(now)
            ahead = None if self._ahead is None else self._ahead(entry) * factor
        refusal = admission.admit_plain(
            len(self.waiting),
            self.waiting_base_s * factor,
            remaining,
            base_est_s * factor,
            deadline_s,
            self.engines,
            idle,
            priority,
            ahead,
            factor,
        )
        if refusal is None:
            self._place(entry, now)
        return refusal

    def _projection(self, entry: Entry, now: float, factor: float) -> Projection:
        """The queue's numbers for an arrival's view (see :class:`~qsim.admission.Projection`)."""
        idle = len(self.idle)
        est = entry.base_s * factor
        queued_work = self.waiting_base_s * factor
        # engines that share a machine: what it would take when it starts
        if self._slowdown is not None:
            est *= self._slowdown(self.engines - idle + 1 if idle else self.engines)
            queued_work *= self._slowdown(self.engines)
        remaining = 0.0 if idle else self.remaining_s(now)
        ahead = None if self._ahead is None or idle else self._ahead(entry) * factor
        ttft = tpot = _NAN
        if self._objectives:
            ttft, tpot = first_token_split(self.config.model, entry, est, self.wait_s(now))
        return _new(
            Projection,
            (
                len(self.waiting),
                queued_work,
                remaining,
                est,
                self.engines,
                idle,
                ahead,
                None,
                ttft,
                tpot,
                None,
                0.0,
                self.waiting_tokens,
            ),
        )

    def _place(self, entry: Entry, now: float) -> None:
        """An admitted entry starts on the lowest idle engine, or waits."""
        if self.idle:
            self._begin(self.idle.pop(), entry, now)
            return
        self.waiting.push(entry)
        self.waiting_base_s += entry.base_s
        if entry.work is not None:
            self.waiting_tokens += entry.work.prompt

    def finished(
        self,
        k: int,
        now: float,
        engine_s: float,
        ok: bool = True,
        tokens: int | None = None,
        first_token_at: float = math.nan,
    ) -> Outcome | None:
        """Engine k handed its request back at ``now``; ``engine_s`` is the engine's own time.

        Returns the request's outcome (good or late by ``now``, error when ``ok`` is false), or
        None when it already had one (stalled, cut, or its client left). A failed, stalled or cut
        run teaches the tracker nothing (a hang's time would multiply every later estimate); one
        whose client left still does. tokens: the tokens it generated, which the estimator learns
        (and the tracker compares against, where the estimator learns). first_token_at: when its
        first token came (NaN: not known), which the policy's TTFT and TPOT objectives are judged
        on. Then engine k takes the next waiting request, or goes idle.
        """
        entry = self.running[k]
        if entry is None:
            raise RuntimeError(f"engine {k} finished but was running nothing")
        self.running[k] = None
        stalled, ended = self.stalled[k], self.ended[k]
        if stalled:
            self.stalled[k] = False
            self._n_stalled -= 1
        if ended:
            self.ended[k] = False
        outcome = None
        if ok and not stalled:
            est = self.admission.estimator
            slow = self.slow[k]  # 1.0 unless engines slow each other
            if est is not None and est.learns and entry.work is not None and tokens is not None:
                work = entry.work
                est.learn(work.limit, tokens)
                self.tracker.observe(est.work_s(work.limit, work.prompt, tokens) * slow, engine_s)
            else:
                # Against the estimate made at arrival (from max_new_tokens, the study's): a stop
                # string that ends a request early reads as a faster machine.
                self.tracker.observe(entry.base_s * slow, engine_s)
            if not ended:
                if self._objectives:
                    outcome = judge(self.policy, entry, now, first_token_at, tokens)
                else:  # the deadline alone (the common case, inlined: once per request)
                    outcome = GOOD if on_time(now - entry.arrived_at, entry.deadline_s) else LATE
        elif not ok and not (stalled or ended):
            outcome = ERROR
        self._next(k, now)
        return outcome

    def cancel(self, req, now: float) -> str | None:
        """The client of ``req`` left: "waiting" (it left the queue with its work), "running" (its
        engine stays busy until it hands the request back: a run cannot always be stopped), or None
        (it had ended)."""
        for entry in self.waiting:
            if entry.req == req:
                self._left(entry)
                return "waiting"
        for k, entry in enumerate(self.running):
            if entry is not None and entry.req == req and not self.ended[k]:
                self.ended[k] = True
                return "running"
        return None

    # -- cutting a run at its deadline (Policy.cancel_at_deadline) ---------------------------

    def cut_at(self, k: int) -> float:
        """When engine k's run is cut: its request's deadline where the policy cancels there, else
        never (inf). The gate sets its timer from this."""
        entry = self.running[k]
        if entry is None or not self.policy.cancel_at_deadline:
            return math.inf
        return entry.arrived_at + entry.deadline_s

    def cut_after(self, k: int, now: float, run_s: float) -> float | None:
        """For a run of ``run_s`` started on engine k at ``now`` (a driver that knows how long it
        will take: the simulator): the seconds after which it is cut, or None where it ends in time
        or the policy does not cut."""
        entry = self.running[k]
        if entry is None or not self.policy.cancel_at_deadline:
            return None
        if on_time(now + run_s - entry.arrived_at, entry.deadline_s):
            return None
        return max(0.0, entry.arrived_at + entry.deadline_s - now)

    def cut(self, k: int, now: float):
        """Engine k's request passed its deadline under ``cancel_at_deadline``: it ends now
        (cancelled).

        Returns the request, or None when it had ended already. The driver stops the engine, which
        then hands the request back through :meth:`finished` (with ``ok`` False: a cut run teaches
        nothing).
        """
        entry = self.running[k]
        if entry is None or self.ended[k]:
            return None
        self.ended[k] = True
        return entry.req

    # -- stalled engines -----------------------------------------------------------------------

    def stall_at(self, k: int) -> float:
        """When engine k counts as stalled if its run has not come back (inf: never, or nothing
        runs)."""
        return (
            self.started_at[k] + self.stall_after_s[k] if self.running[k] is not None else math.inf
        )

    def overdue(self, now: float) -> list[int]:
        """Engines whose request has run past its stall threshold and that are not marked stalled
        yet."""
        return [
            k
            for k in range(self.engines)
            if self.running[k] is not None
            and not self.stalled[k]
            and now - self.started_at[k] > self.stall_after_s[k]
        ]

    def stall(self, k: int, now: float):
        """Mark engine k stalled. Returns its request when that request now ends (as an error), else
        None.

        The engine stays busy until it hands the request back; meanwhile its remaining work counts
        as its overrun so far, so the wait estimate keeps growing instead of reading it as about to
        finish.
        """
        if self.running[k] is None or self.stalled[k]:
            return None
        self.stalled[k] = True
        self._n_stalled += 1
        if self.ended[k]:
            return None
        self.ended[k] = True
        return self.running[k].req

    @property
    def all_stalled(self) -> bool:
        return self._n_stalled == self.engines

    def give_up(self, now: float) -> int:
        """While every engine is stalled the queue cannot move: end each waiting request whose
        deadline has passed, ``expired`` where the policy expires at the front (what the front would
        decide), else an error. Returns how many were ended."""
        if not self.all_stalled:
            return 0
        late = [e for e in self.waiting if now >= e.arrived_at + e.deadline_s]
        for entry in late:
            self._left(entry)
            if self._gone is not None and self._gone(entry.req):
                continue
            est = entry.base_s * self.tracker.factor
            if self.policy.expire_at_front:
                self._drop(
                    entry.req, now, EXPIRED, EXPIRE_REASON, est, retry_after(self.wait_s(now))
                )
            else:
                self._drop(entry.req, now, ERROR, STALL_REASON, est, None)
        return len(late)

    def _left(self, entry: Entry) -> None:
        """A waiting entry leaves the line (its client left, or it is given up)."""
        self.waiting.remove(entry)
        self.waiting_base_s = self.waiting_base_s - entry.base_s if self.waiting else 0.0
        if entry.work is not None:
            self.waiting_tokens = self.waiting_tokens - entry.work.prompt if self.waiting else 0

    # -- the numbers ----------------------------------------------------------------

    def remaining_s(self, now: float) -> float:
        """Estimated work left in service, summed over the engines. An engine past its estimate
        counts as about to finish (0), unless it is stalled: then its overrun so far, since it has
        shown it is not."""
        if not self._n_stalled:
            # a generator per arrival costs a sixth of predictive's simulation time
            if self.engines == 1:
                end = self.busy_until[0]
                return end - now if end > now else 0.0
            return sum(max(0.0, end - now) for end in self.busy_until)
        return sum(
            (now - end) if st else max(0.0, end - now)
            for end, st in zip(self.busy_until, self.stalled)
        )

    def wait_s(self, now: float) -> float:
        """The wait :func:`~qsim.policy.decide` would estimate for an arrival now (a
        Retry-After's basis)."""
        if self.idle:
            return 0.0
        return (self.queued_work_s + self.remaining_s(now)) / self.engines

    @property
    def queued_work_s(self) -> float:
        """The waiting's estimated work (as each will run, with every engine busy)."""
        work = self.waiting_base_s * self.tracker.factor
        return work if self._slowdown is None else work * self._slowdown(self.engines)

    @property
    def in_service(self) -> int:
        return self.engines - len(self.idle)

    def replica_state(self, now: float, req=None, ask=None) -> ReplicaState:
        """What a fleet's router reads of this line at an arrival (``req``'s: unread here)."""
        busy = self.in_service
        work = self.queued_work_s + (self.remaining_s(now) if busy else 0.0)
        return ReplicaState(len(self.waiting) + busy, work, self.engines, len(self.idle))

    def snapshot(self) -> dict:
        """The queue now, for /stats and tests."""
        return {
            "waiting": len(self.waiting),
            "in_service": self.in_service,
            "stalled": self._n_stalled,
            "queued_work_s": self.queued_work_s,
            "speed_factor": self.tracker.factor,
            "engines": self.engines,
        }

    def stalled_engines(self, now: float) -> list[dict]:
        """Each stalled engine: how long its request has run, its threshold and estimate."""
        return [
            {
                "engine": k,
                "running_s": now - self.started_at[k],
                "stall_after_s": self.stall_after_s[k],
                "est_service_s": self.busy_until[k] - self.started_at[k],
            }
            for k in range(self.engines)
            if self.stalled[k]
        ]

    # -- inside -------------------------------------------------------------------------

    def _begin(self, k: int, entry: Entry, now: float) -> None:
        est = entry.base_s * self.tracker.factor
        if self._slowdown is not None:  # as many busy as will be, itself included
            self.slow[k] = self._slowdown(self.engines - len(self.idle))
            est *= self.slow[k]
        self.running[k] = entry
        self.busy_until[k] = now + est
        self.started_at[k] = now
        rule = self.stall_rule
        if rule is not None:  # else never: stall_after_s stays inf
            self.stall_after_s[k] = rule.after_s(est)
        if self._started is not None:
            self._started(entry)
        self._start(k, entry.req, now, est)

    def _next(self, k: int, now: float) -> None:
        """Give engine k the first waiting request that can still make it, or mark k idle."""
        waiting = self.waiting
        expire = self.policy.expire_at_front
        gone, drop_reason = self._gone, self._drop_reason
        while waiting:
            entry = waiting.pop_next(now)
            self.waiting_base_s -= entry.base_s
            if entry.work is not None:
                self.waiting_tokens -= entry.work.prompt
            if gone is not None and gone(entry.req):
                continue
            if expire:
                est = entry.base_s * self.tracker.factor
                if cannot_finish(now, est, entry.arrived_at + entry.deadline_s):
                    self._drop(
                        entry.req, now, EXPIRED, EXPIRE_REASON, est, retry_after(self.wait_s(now))
                    )
                    continue
            if drop_reason is not None:
                est = entry.base_s * self.tracker.factor
                reason = drop_reason(entry, now, est)
                if reason is not None:
                    self._drop(entry.req, now, EXPIRED, reason, est, retry_after(self.wait_s(now)))
                    continue
            self._begin(k, entry, now)
            return
        self.waiting_base_s = 0.0  # no drift from adding and subtracting floats
        self.waiting_tokens = 0
        self.idle.append(k)


def first_token_split(model, entry: Entry, est: float, wait: float) -> tuple[float, float]:
    """(time from now to the first token, time per output token) for a request of estimate ``est``
    (speed factor in) that waits ``wait`` first: the calibrated line's share of its first token
    (fixed and prompt terms and one token) of ``est``, and the rest over its other tokens."""
    work = entry.work
    limit, prompt = (1, 0) if work is None else (max(1, work.limit), work.prompt)
    whole = float(model.estimate(limit, prompt))
    first = est * float(model.estimate(1, prompt)) / whole if whole > 0 else est
    return wait + first, (est - first) / (limit - 1) if limit > 1 else math.nan


def judge(
    policy: Policy,
    entry: Entry,
    now: float,
    first_token_at: float = math.nan,
    tokens: int | None = None,
) -> Outcome:
    """An answered request's outcome at ``now``: good when it met every objective it had (its
    deadline; the policy's time to first token and per output token where set and known), else late
    (DistServe's goodput)."""
    if not on_time(now - entry.arrived_at, entry.deadline_s):
        return LATE
    if first_token_at == first_token_at:
        ttft, tpot = policy.ttft_slo_s, policy.tpot_slo_s
        if ttft is not None and not on_time(first_token_at - entry.arrived_at, ttft):
            return LATE
        if (
            tpot is not None
            and tokens is not None
            and tokens > 1
            and not on_time((now - first_token_at) / (tokens - 1), tpot)
        ):
            return LATE
    return GOOD
