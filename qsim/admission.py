"""Admission: what both queue cores do with an arrival before each places it.

An :class:`Admission` is the policy's side of an arrival, the same for
:class:`qsim.queue.AdmissionQueue` and :class:`qsim.batch.BatchQueue`: the deadline a request
gets, the policy's estimator (its estimate from the work, and what it learns), the states of
the rules that keep one (:meth:`qsim.rules.Rule.state`: a client's token bucket, the reserve's
EWMA, a rule of one's own), llm-d's shedding draw, the :class:`~qsim.policy.View` built and the
policy's decision asked, and what the decision was made on (:class:`Seen`). What differs
between the cores is only the queue's part of the view, which each projects of itself
(:class:`Projection`: how much waits, what is in service, a batch's projected wait and first
token), and where an admitted request goes.

An arrival takes two calls: :meth:`Admission.arrival` (its estimate, deadline and work), then
:meth:`Admission.admit` with the core's projection (the refusal, or None: the core places it). A
policy that reads the basic numbers alone (:attr:`Admission.plain`) may take
:meth:`Admission.admit_plain` instead, the one fast path: the same decisions without the checks
that cannot apply (tests/test_admission.py holds it to the general path).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .clients import uniform
from .config import ServerConfig
from .entry import Entry, Work
from .policy import Policy, Rejection, View, reads_basic
from .rules import RESERVE_WEIGHT, Arrival

_new = tuple.__new__  # a named tuple from its fields in order, without its Python-level __new__
_NAN = math.nan
#: A view's fields after the basic numbers, for :meth:`Admission.admit_plain` (built once).
_NO_MORE = (None, None, _NAN, _NAN, None, 0.0, 0, 0, _NAN)

__all__ = ["RESERVE_WEIGHT", "Admission", "Core", "Projection", "Seen"]


class Seen(NamedTuple):
    """What an admission decision was made on: the admission columns of the request's record."""

    est_service_s: float  # its estimate x the speed factor
    queued: int  # requests waiting (not in service) before it
    queued_work_s: float  # their estimated work
    speed_factor: float  # the tracker's factor the estimates were scaled by
    # The rest of what the built-in rule reads, so that a decision can be checked against
    # qsim.policy.decide from its record alone (analysis.compare names a disagreement's cause so):
    # NaN and -1 where a queue does not say.
    in_service_s: float = math.nan  # estimated work left in service, summed over the busy engines
    idle: int = -1  # engines free


class Projection(NamedTuple):
    """The queue's part of an arrival's :class:`~qsim.policy.View`, as a core projects it of itself
    (the fields of the same names there). A core that projects the wait itself (``wait_s`` not
    None: a batch's) says nothing of what the one-at-a-time wait is made of: it leaves
    ``queued_work_s`` and ``remaining_s`` NaN, and its record shows -1 idle engines (its view has
    the seat the request would take)."""

    queued: int
    queued_work_s: float
    remaining_s: float
    est_service_s: float
    engines: int
    idle: int
    ahead_s: float | None
    wait_s: float | None
    ttft_s: float
    tpot_s: float
    kv_wait_s: float | None
    kv_use: float
    queued_tokens: int


class Admission:
    """One core's admission; see the module docstring.

    counts_refused: every arrival takes an index of the shedding draw
    (:func:`qsim.clients.uniform`), also one refused before the decision (by a rule's state: its
    client over its rate; or one the core refuses as too large): the batching core's. False:
    only an arrival the states let through, the one-at-a-time core's. The two differ only under
    a stateful rule that refuses and shedding together; both are kept so that no seeded run
    moves. empty: what :attr:`seen_numbers` holds before any arrival."""

    def __init__(self, config: ServerConfig, *, counts_refused: bool, empty: Seen) -> None:
        self.policy = policy = config.policy
        self.seed = config.seed
        self.estimator = policy.make_estimator(config.model)
        #: The per-run states of the rules that keep one, in the order of the rules (made once:
        #: a recalibration keeps them).
        self.states = tuple(s for s in (rule.state() for rule in policy.rules) if s is not None)
        self.sheds = policy.shed_queue_threshold is not None
        self.counts_refused = counts_refused
        self.arrivals = 0  # the shedding draw's index
        self.seen_numbers: tuple = empty
        self._decide = policy.decide
        #: Whether :meth:`admit_plain` decides as :meth:`admit` for this policy: its rules read
        #: nothing beyond the basic numbers, and none keeps a state.
        self.plain = reads_basic(policy) and not self.states
        #: Rules that can refuse only the sheddable (priority below 0) while others wait.
        self.admits_all = all(r.sheds_only for r in policy.rules)
        #: Whether the rules admit every request that is not sheddable reading nothing of its view
        #: (policy none's): a core that projects its wait need make no view for those.
        self.blind = type(policy).decide is Policy.decide and self.admits_all and not self.sheds

    def recalibrate(self, config: ServerConfig) -> None:
        """A new calibration (the policy stays): a learning estimator starts again from nothing, as
        it was relative to the old model; the draws follow the new configuration's seed."""
        self.seed = config.seed
        self.estimator = self.policy.make_estimator(config.model)

    def deadline_of(self, deadline_s: float | None) -> float:
        """The deadline a request gets: its own (seconds after arrival), or the policy's where it
        brings none (None or NaN)."""
        if deadline_s is None or deadline_s != deadline_s:
            return self.policy.deadline_s
        return deadline_s

    def deadlines_of(self, deadline_s: np.ndarray) -> list[float]:
        """:meth:`deadline_of` of a trace's column at once (the simulator's: per request it cost a
        tenth of a plain run's set-up and loop)."""
        return np.where(np.isnan(deadline_s), self.policy.deadline_s, deadline_s).tolist()

    def arrival(
        self, base_est_s: float, deadline_s: float | None, work: Work | tuple | None
    ) -> tuple[float, float, Work | None]:
        """An arrival's (calibrated estimate, deadline, work): the estimator's estimate from its
        work (None: ``base_est_s``, the estimate at the limit, as it is), its deadline or the
        policy's, its work as a Work."""
        if self.counts_refused:
            self.arrivals += 1
        if deadline_s is None or deadline_s != deadline_s:
            deadline_s = self.policy.deadline_s
        base_est_s, work = self.estimated(base_est_s, work)
        return base_est_s, deadline_s, work

    def estimated(self, base_est_s: float, work: Work | tuple | None) -> tuple[float, Work | None]:
        """An arrival's calibrated estimate from its work (the estimator's; None: ``base_est_s`` as
        it is) and its work as a Work; nothing counted (a fleet router's probe asks it too)."""
        if work is not None:
            if type(work) is not Work:
                work = Work(*work)
            if self.estimator is not None:
                base_est_s = self.estimator.base_s(base_est_s, *work)
        return base_est_s, work

    def admit(self, now: float, entry: Entry, factor: float, p: Projection) -> Rejection | None:
        """The refusal of ``entry`` (arrived at ``now``; estimates scaled by ``factor``), or None.

        The rules' states first, in order (:class:`~qsim.rules.RuleState`: a refusal there ends it,
        and teaches no state anything; each may adjust the view, as the reserve shortens the
        deadline), then the shedding draw, the policy's decision on the view of ``p`` and the
        request, and each state told the decision."""
        self.seen_numbers = (
            p.est_service_s,
            p.queued,
            p.queued_work_s,
            factor,
            p.remaining_s,
            p.idle if p.wait_s is None else -1,
        )
        states = self.states
        if not states:
            if not self.counts_refused:
                self.arrivals += 1
            if self.blind and entry.priority >= 0:  # the rules would read nothing of a view
                return None
            return self._decide(self._view(entry, p))
        # The view holds the draw this arrival takes if the states let it through.
        view = self._view(entry, p, 0 if self.counts_refused else 1)
        arrival = _new(Arrival, (now, entry.base_s, factor))
        for state in states:
            refusal = state.check(view, arrival)
            if refusal is not None:
                return refusal
            view = state.adjust(view, arrival)
        if not self.counts_refused:
            self.arrivals += 1
        if self.blind and entry.priority >= 0:
            refusal = None
        else:
            refusal = self._decide(view)
        for state in states:
            state.decided(view, arrival, refusal)
        return refusal

    def admit_plain(
        self,
        queued: int,
        queued_work_s: float,
        remaining_s: float,
        est: float,
        deadline_s: float,
        engines: int,
        idle: int,
        priority: int,
        ahead_s: float | None,
        factor: float,
    ) -> Rejection | None:
        """:meth:`admit` for a :attr:`plain` policy, on the basic numbers as arguments (no
        projection made): it runs once per arrival of every plain simulation (bench_qsim's cases A
        and B). A rule that admits all reads nothing while an engine is idle, nor for a request
        that is not sheddable: there the core may leave ``remaining_s`` unsaid (NaN)."""
        self.seen_numbers = (est, queued, queued_work_s, factor, remaining_s, idle)
        if self.admits_all and (idle or priority >= 0):
            return None
        return self._decide(
            _new(
                View,
                (
                    queued,
                    queued_work_s,
                    remaining_s,
                    est,
                    deadline_s,
                    engines,
                    idle,
                    priority,
                    ahead_s,
                )
                + _NO_MORE,
            )
        )

    def _view(self, entry: Entry, p: Projection, ahead: int = 0) -> View:
        """The view of ``p`` and the request; its draw is the ``ahead``-th after the last taken."""
        work = entry.work
        u = uniform(self.seed, self.arrivals + ahead, 0) if self.sheds else _NAN
        return _new(
            View,
            (
                p.queued,
                p.queued_work_s,
                p.remaining_s,
                p.est_service_s,
                entry.deadline_s,
                p.engines,
                p.idle,
                entry.priority,
                p.ahead_s,
                entry.client,
                p.wait_s,
                p.ttft_s,
                p.tpot_s,
                p.kv_wait_s,
                p.kv_use,
                p.queued_tokens,
                0 if work is None else work.prompt,
                u,
            ),
        )


class Core:
    """What every queue core (:class:`qsim.queue.AdmissionQueue`, :class:`qsim.batch.BatchQueue`)
    answers the same way, through its :class:`Admission`: the deadline a request gets, the
    estimator, and what its last admission decision was made on.

    ``seen_numbers`` holds :class:`Seen`'s fields in their order as a plain tuple: a named tuple
    made on every arrival cost a plain simulation a twentieth of its time (bench_qsim's case A),
    and the simulator, which unpacks the numbers straight into its record columns, reads them so.
    ``seen`` is the named view."""

    policy: Policy
    admission: Admission

    @property
    def seen_numbers(self) -> tuple:
        return self.admission.seen_numbers

    @property
    def seen(self) -> Seen:
        return _new(Seen, self.admission.seen_numbers)

    @property
    def estimator(self):
        return self.admission.estimator

    def deadline_of(self, deadline_s: float | None) -> float:
        return self.admission.deadline_of(deadline_s)

    def deadlines_of(self, deadline_s: np.ndarray) -> list[float]:
        return self.admission.deadlines_of(deadline_s)
