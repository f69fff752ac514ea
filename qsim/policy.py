"""Admission policies and the one decision shared by simulator and live gate.

A policy is data (:class:`Policy`): a name, a deadline, a discipline, an estimator, objectives
and a tuple of admission rules (:mod:`qsim.rules`), which its fields name. Its decision,
:meth:`Policy.decide`, is the first of its rules that refuses; the rules and
:func:`cannot_finish` are pure: the caller reads its clock and its queue once and passes the
numbers in, so the simulator and the gate cannot disagree about a rule, only about the numbers
they feed it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass, replace
from typing import Any, Mapping

from .disciplines import DISCIPLINES
from .estimators import ESTIMATORS, make_estimator
from .outcomes import REJECT_REASONS, Reason  # noqa: F401 (REJECT_REASONS: re-exported)

# Re-exported: the rules' vocabulary was this module's before the rules were parts.
from .rules import TIME_TOLERANCE_S, Rejection, View, retry_after, take_token  # noqa: F401
from .rules import (
    ClientRate,
    KvAdmission,
    Predictive,
    QueueBound,
    ReserveShare,
    Rule,
    Sheddable,
    Shedding,
    TokenBound,
    TpotObjective,
    TtftObjective,
    WorkBound,
)

RATE_LIMITED = Reason.RATE_LIMITED
#: Reason recorded for a request dropped unrun when it reached the front.
EXPIRE_REASON = Reason.CANNOT_FINISH


#: The policy fields a discipline is built with, in the order its class takes them.
DISCIPLINE_ARGS = {
    "codel": ("codel_target_s", "codel_interval_s"),
    "adaptive-lifo": ("lifo_threshold",),
}


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
    reserve_min_s / reserve_share: a reserved share for the long requests (calibrated
        estimate >= reserve_min_s). While fewer than reserve_share of them have been
        admitted lately (an EWMA over their arrivals), the others are admitted only if they
        would finish reserve_min_s x the speed factor before their deadline: the queue keeps
        room for a long one to fit.
    client_rate / client_burst: a token bucket per client (requests per second, and
        how many may come at once); a client over it is refused ``rate_limited``
        before anything else is looked at. None: no per-client limit.
    codel_target_s / codel_interval_s: CoDel's target sojourn and interval (discipline codel).
    lifo_threshold: the queue length from which adaptive LIFO serves the newest first.
    estimator: what a request's service time is estimated from (:mod:`qsim.estimators`): "limit"
        (its max_new_tokens, the study's), "learned" (the limit times the share of it that requests
        of its size class used lately: their mean, or the ``estimator_quantile``, over the last
        ``estimator_window`` completions) or "oracle" (the tokens it will generate: simulator only).
    cancel_at_deadline: stop a request in service when its deadline passes (outcome cancelled),
        freeing its engine; the study's gate (False) lets it finish late.
    ttft_slo_s / tpot_slo_s: objectives on the time to first token and the time per output token
        (None: none). A request is good only when it meets every objective it has (DistServe's
        goodput), and predictive admission refuses one it projects to miss any.
    max_queued_tokens: refuse when the prompt tokens waiting would pass this (vLLM's
        ``max_num_queued_tokens``; ``max_queue`` is its ``max_num_queued_reqs``).
    kv_admission: admission by memory (the reference study's exercise 6), for a batching
        engine: refuse (``kv_full``) a request whose prompt plus max_new_tokens cannot get its
        KV blocks in time to meet its deadline.
    shed_queue_threshold / shed_kv_threshold / shed_power / shed_k / shed_below_priority:
        llm-d's probabilistic admitter: saturation = max(waiting / shed_queue_threshold,
        KV share in use / shed_kv_threshold), and a request of priority below
        ``shed_below_priority`` (llm-d: 0, the sheddable) is shed with probability
        min(saturation ** shed_power * shed_k, 1). None: no such shedding.

    The admission fields name the policy's rules (:attr:`rules`, :meth:`make_rules`). A policy
    class of one's own may override :meth:`make_rules` (a rule of its own is one more part),
    :meth:`decide`, :meth:`make_discipline` (the order of the waiting) and :meth:`make_estimator`;
    its own dataclass fields are its parameters (docs/policies.md).
    """

    name: str = "custom"
    max_queue: int | None = None
    max_queued_seconds: float | None = None
    predictive: bool = False
    deadline_s: float = 2.0
    expire_at_front: bool = False
    discipline: str = "fifo"
    client_rate: float | None = None
    client_burst: float = 1.0
    reserve_min_s: float | None = None
    reserve_share: float = 0.0
    codel_target_s: float = 0.1
    codel_interval_s: float = 0.5
    lifo_threshold: int = 8
    estimator: str = "limit"
    estimator_quantile: float | None = None
    estimator_window: int = 200
    cancel_at_deadline: bool = False
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    max_queued_tokens: int | None = None
    kv_admission: bool = False
    shed_queue_threshold: float | None = None
    shed_kv_threshold: float = 0.8
    shed_power: float = 5.0
    shed_k: float = 300.0
    shed_below_priority: int = 0

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "tpot_slo_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.max_queued_tokens is not None and self.max_queued_tokens < 0:
            raise ValueError(f"max_queued_tokens must be >= 0, got {self.max_queued_tokens}")
        if self.shed_queue_threshold is not None and not (
            self.shed_queue_threshold > 0 and math.isfinite(self.shed_queue_threshold)
        ):
            raise ValueError(
                f"shed_queue_threshold must be a positive number, got {self.shed_queue_threshold}"
            )
        if not 0 < self.shed_kv_threshold <= 1:
            raise ValueError(f"shed_kv_threshold must be in (0, 1], got {self.shed_kv_threshold}")
        if not (
            self.shed_power > 0
            and self.shed_k > 0
            and math.isfinite(self.shed_power)
            and math.isfinite(self.shed_k)
        ):
            raise ValueError(
                "shed_power and shed_k must be positive numbers, got "
                f"{self.shed_power}, {self.shed_k}"
            )
        if self.client_rate is not None and not (
            self.client_rate > 0 and math.isfinite(self.client_rate)
        ):
            raise ValueError(
                "client_rate must be a positive number of requests per second, got "
                f"{self.client_rate}"
            )
        if self.reserve_min_s is not None and not (
            self.reserve_min_s > 0 and math.isfinite(self.reserve_min_s)
        ):
            raise ValueError(
                f"reserve_min_s must be a positive number of seconds, got {self.reserve_min_s}"
            )
        if not 0 <= self.reserve_share < 1:
            raise ValueError(f"reserve_share must be in [0, 1), got {self.reserve_share}")
        if not (self.client_burst >= 1 and math.isfinite(self.client_burst)):
            raise ValueError(f"client_burst must be a number >= 1, got {self.client_burst}")
        if self.discipline not in DISCIPLINES:
            raise ValueError(
                f"unknown discipline {self.discipline!r}; choose one of {', '.join(DISCIPLINES)}"
            )
        # a discipline parameter out of range is refused here, not at the first request
        Policy.make_discipline(self)
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_queued_seconds is not None and not self.max_queued_seconds > 0:
            raise ValueError(f"max_queued_seconds must be > 0, got {self.max_queued_seconds}")
        if not (self.deadline_s > 0 and math.isfinite(self.deadline_s)):
            raise ValueError(
                f"deadline_s must be a positive number of seconds, got {self.deadline_s}"
            )
        if self.estimator not in ESTIMATORS:
            raise ValueError(
                f"unknown estimator {self.estimator!r}; choose one of {', '.join(ESTIMATORS)}"
            )
        if self.estimator_quantile is not None and not 0 < self.estimator_quantile <= 1:
            raise ValueError(f"estimator_quantile must be in (0, 1], got {self.estimator_quantile}")
        if not self.estimator_window >= 1:
            raise ValueError(f"estimator_window must be >= 1, got {self.estimator_window}")

    def decide(self, view: View) -> Rejection | None:
        """Admit (None) or refuse the request ``view`` describes: the first of :attr:`rules` that
        refuses, in their order (so a request is told the first reason there is).

        The queue core calls this for every arrival, in the simulator and the gate alike, with a
        read-only :class:`View` of the queue it computed once. Keep an override pure: the same
        view, the same answer."""
        for rule in self.rules:
            refusal = rule.check(view)
            if refusal is not None:
                return refusal
        return None

    @functools.cached_property
    def rules(self) -> tuple[Rule, ...]:
        """The admission rules, in the order they are asked (:meth:`make_rules`, made once: a
        frozen policy's rules cannot change)."""
        return tuple(self.make_rules())

    def make_rules(self) -> tuple[Rule, ...]:
        """The rules this policy's fields name (:func:`field_rules`). A policy class of one's own
        adds a rule of its own as one more part: ``(*super().make_rules(), MyRule(...))``."""
        return field_rules(self)

    def make_discipline(self):
        """A new, empty queue of this policy's discipline (one per queue: it holds the waiting).

        A policy class of one's own overrides this to order the queue its way (see
        docs/policies.md).
        """
        return DISCIPLINES[self.discipline](
            *(getattr(self, a) for a in DISCIPLINE_ARGS.get(self.discipline, ()))
        )

    def make_estimator(self, model):
        """A new estimator of this policy's kind over the calibrated ``model`` (None: from the
        limit, as given)."""
        return make_estimator(self.estimator, model, self.estimator_quantile, self.estimator_window)

    def with_args(self, args: Mapping[str, Any]) -> "Policy":
        """This policy with some parameters changed. Values may be text (``--policy-arg k=v``),
        converted by the field's type; ValueError naming the parameter, or listing the parameters
        there are."""
        hints = typing.get_type_hints(type(self))
        names = [f.name for f in dataclasses.fields(self) if f.name != "name"]
        changes = {}
        for key, value in args.items():
            if key not in names:
                raise ValueError(
                    f"policy {self.name!r} has no parameter {key!r}; its parameters "
                    f"are {', '.join(names)}"
                )
            changes[key] = _typed(key, value, hints[key])
        return replace(self, **changes) if changes else self

    def with_overrides(
        self, max_queue: int | None = None, deadline_s: float | None = None
    ) -> "Policy":
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
    "bounded-deadline": Policy(
        "bounded-deadline", max_queue=8, deadline_s=2.0, expire_at_front=True
    ),
    # Expiry at the front stays as a second line behind the arrival check.
    "predictive": Policy("predictive", predictive=True, deadline_s=2.0, expire_at_front=True),
    # Beyond the study: the same predictive admission, other orders of service.
    "predictive-edf": Policy(
        "predictive-edf", predictive=True, expire_at_front=True, discipline="edf"
    ),
    "predictive-sjf": Policy(
        "predictive-sjf", predictive=True, expire_at_front=True, discipline="sjf"
    ),
    # No bound at arrival; the order (and CoDel's drops) does the work under overload.
    "adaptive-lifo": Policy("adaptive-lifo", expire_at_front=True, discipline="adaptive-lifo"),
    "codel": Policy("codel", discipline="codel"),
    # The study's open question: predictive starves the 64-token class (2 % in time at load 3). Keep
    # room for it while fewer than 30 % of those arriving are admitted (estimates >= 0.5 s: 64
    # tokens).
    "predictive-reserved": Policy(
        "predictive-reserved",
        predictive=True,
        expire_at_front=True,
        reserve_min_s=0.5,
        reserve_share=0.3,
    ),
    # Priority classes (vLLM's --scheduling-policy priority): a higher class first, EDF within a
    # class.
    "predictive-priority": Policy(
        "predictive-priority", predictive=True, expire_at_front=True, discipline="priority-edf"
    ),
    # Tenants: predictive admission, and the engines shared fairly among the clients who wait.
    "predictive-fair": Policy(
        "predictive-fair", predictive=True, expire_at_front=True, discipline="fair"
    ),
    # On a batching engine: predictive admission that also knows the memory (exercise 6): kv_full
    # when the KV blocks of its prompt and limit cannot be had in time.
    "predictive-kv": Policy(
        "predictive-kv", predictive=True, expire_at_front=True, kv_admission=True
    ),
    # vLLM's own caps on what waits (max_num_queued_reqs, max_num_queued_tokens; 503 when over).
    "vllm-caps": Policy("vllm-caps", max_queue=64, max_queued_tokens=16384),
    # llm-d's probabilistic admitter (its defaults): sheddable requests (priority below 0) shed with
    # probability min(saturation ** 5 * 300, 1), saturation = max(waiting / 5, KV share in use /
    # 0.8).
    "llm-d-shed": Policy("llm-d-shed", shed_queue_threshold=5.0),
}
#: The reference study's four policies (its sweeps and figures are over these).
STUDY = ("none", "bounded", "bounded-deadline", "predictive")


def resolve(spec: str, args: Mapping[str, Any] | None = None) -> Policy:
    """The policy a name stands for, with ``args`` applied (:meth:`Policy.with_args`).

    ``spec`` is a preset's name, or ``module:attribute`` naming a :class:`Policy` subclass (built
    with its defaults and named ``spec``) or instance: the one way simulate, sweeps, serve and
    compare read a policy. ValueError saying what exists when it names nothing.
    """
    if ":" not in spec:
        return preset(spec).with_args(args or {})
    module, _, attr = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"cannot load policy {spec!r}: {type(exc).__name__}: {exc}") from None
    if isinstance(found, type) and issubclass(found, Policy):
        check_plugin(found, spec)
        found = found(name=spec)
    if not isinstance(found, Policy):
        raise ValueError(
            f"{spec} is a {type(found).__name__}, not a qsim Policy (a subclass or an instance)"
        )
    check_plugin(type(found), spec)
    return found.with_args(args or {})


#: What a policy class of one's own may define besides its fields: the hooks the queue core calls.
HOOKS = ("decide", "make_rules", "make_discipline", "make_estimator")


def check_plugin(cls: type, spec: str = "") -> None:
    """ValueError when a Policy subclass defines something qlab would silently ignore: a public
    method that is not one of :data:`HOOKS` (the core never calls it), a hook with the wrong
    parameters, a parameter (a dataclass field of its own) that none of its hooks reads, or a class
    that is not a frozen dataclass (its fields would not be parameters)."""
    name = spec or cls.__qualname__
    if cls is Policy:
        return
    own = {k: v for c in cls.__mro__[: cls.__mro__.index(Policy)] for k, v in vars(c).items()}
    undecorated = [
        c
        for c in cls.__mro__[: cls.__mro__.index(Policy)]
        if "__dataclass_fields__" not in vars(c) and vars(c).get("__annotations__")
    ]
    if undecorated:
        raise ValueError(
            f"policy {name}: decorate {undecorated[0].__qualname__} with "
            "@dataclass(frozen=True) so "
            "that its parameters are fields (docs/policies.md)"
        )
    for key, value in own.items():
        if (
            key.startswith("_")
            or not callable(value)
            and not isinstance(value, (staticmethod, classmethod))
        ):
            continue
        if key not in HOOKS and not hasattr(Policy, key):
            raise ValueError(
                f"policy {name}: method {key}() is never called by qlab; a policy "
                "class may override "
                f"{', '.join(HOOKS)} (docs/policies.md)"
            )
        if key in HOOKS:
            want = list(inspect.signature(getattr(Policy, key)).parameters)
            got = list(inspect.signature(value).parameters)
            if len(got) != len(want):
                raise ValueError(
                    f"policy {name}: {key} must take ({', '.join(want)}), as "
                    f"Policy.{key} does; "
                    f"it takes ({', '.join(got)})"
                )
    mine = [f.name for f in dataclasses.fields(cls) if f.name not in Policy.__dataclass_fields__]
    if mine:
        read = _attributes_read(cls)
        unused = [f for f in mine if f not in read]
        if unused:
            raise ValueError(
                f"policy {name}: parameter(s) {', '.join(unused)} are read by none of "
                "its methods "
                f"({', '.join(HOOKS)}, __post_init__): they would change nothing"
            )


def _attributes_read(cls: type) -> set[str]:
    """Names read as ``self.NAME`` in the methods a class (and its bases below Policy) defines."""
    names: set[str] = set()
    for klass in cls.__mro__[: cls.__mro__.index(Policy)]:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        # no source (made at run time): cannot tell, so do not refuse
        except (OSError, TypeError, SyntaxError):
            return {f.name for f in dataclasses.fields(cls)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
            ):
                names.update(a.value for a in node.args[1:2] if isinstance(a, ast.Constant))
    return names


def policy_from_fields(raw: Mapping[str, Any]) -> Policy:
    """The policy whose fields (``dataclasses.asdict``, as /stats and run files carry them) these
    are: resolved by its name, so a policy class of one's own comes back as itself; where the name
    resolves to nothing here (a class not importable, a renamed policy), a plain Policy of the
    fields it knows."""
    fields = {k: v for k, v in raw.items() if k != "name"}
    try:
        return resolve(str(raw.get("name")), fields)
    except ValueError:
        return Policy(**{k: raw[k] for k in Policy.__dataclass_fields__ if k in raw})


def _typed(key: str, value: Any, hint) -> Any:
    """``value`` as the field's type: text is converted, other values are checked."""
    kinds = (
        typing.get_args(hint)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        else (hint,)
    )
    optional = type(None) in kinds
    kind = next((k for k in kinds if k is not type(None)), str)
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        if optional and text in ("none", "null", ""):
            return None
        try:
            if kind is bool:
                if text not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(text)
                return text in ("true", "1", "yes")
            return kind(value)
        except ValueError:
            raise ValueError(
                f"policy parameter {key}: expected {kind.__name__}, got {value!r}"
            ) from None
    if value is None and optional:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"policy parameter {key}: expected {kind.__name__}, got {value!r}")
    return value


def preset(name: str) -> Policy:
    """The named preset, or a ValueError listing the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(PRESETS)}") from None


def decide(
    policy: Policy,
    queued: int,
    queued_work_s: float,
    in_service_remaining_s: float,
    est_service_s: float,
    deadline_s: float | None,
    workers: int = 1,
    idle: int = 0,
    priority: int = 0,
    ahead_s: float | None = None,
) -> Rejection | None:
    """Admit (``None``) or refuse (:class:`Rejection`) one arriving request: :meth:`Policy.decide`
    on a :class:`View` of the basic numbers alone (the rest at their defaults).

    queued / queued_work_s: requests waiting and their estimated work, not counting this one.
    in_service_remaining_s: estimated remaining work summed over busy engines. idle: engines free
    right now; with one free the request starts at once, so it waits for nobody and the queue
    bounds do not apply to it (this is what makes max_queue=0 the Erlang loss system). ahead_s:
    the part of queued_work_s that would start before this request (None: all of it, as in
    FIFO); a discipline that serves some arrivals ahead of others says how much (fair share does).
    """
    return policy.decide(
        View(
            queued,
            queued_work_s,
            in_service_remaining_s,
            est_service_s,
            deadline_s,
            workers,
            idle,
            priority,
            ahead_s,
        )
    )


#: Refuses the sheddable while others wait: first in every policy's rules (a value: it has none).
SHEDDABLE = Sheddable()


def field_rules(policy: Policy) -> tuple[Rule, ...]:
    """The rules ``policy``'s admission fields name, in the order they are asked: a client's token
    bucket (``client_rate``) and the reserved share (``reserve_min_s``), the two that keep state
    (asked before the rest, :meth:`qsim.rules.Rule.state`), then the sheddable while others
    wait, the bounds on what waits (count, prompt tokens, estimated work), llm-d's shedding, then
    with ``predictive`` memory (``kv_admission``), the deadline and the objectives. A preset is so
    a tuple of rules (``PRESETS["vllm-caps"].rules``)."""
    rules: list[Rule] = []
    if policy.client_rate is not None:
        rules.append(ClientRate(policy.client_rate, policy.client_burst))
    if policy.reserve_min_s is not None:
        rules.append(ReserveShare(policy.reserve_min_s, policy.reserve_share))
    rules.append(SHEDDABLE)
    if policy.max_queue is not None:
        rules.append(QueueBound(policy.max_queue))
    if policy.max_queued_tokens is not None:
        rules.append(TokenBound(policy.max_queued_tokens))
    if policy.max_queued_seconds is not None:
        rules.append(WorkBound(policy.max_queued_seconds))
    if policy.shed_queue_threshold is not None:
        rules.append(
            Shedding(
                policy.shed_queue_threshold,
                policy.shed_kv_threshold,
                policy.shed_power,
                policy.shed_k,
                policy.shed_below_priority,
            )
        )
    if policy.predictive:
        if policy.kv_admission:  # before the deadline: kv_full says it is memory that is short
            rules.append(KvAdmission())
        rules.append(Predictive())
        if policy.ttft_slo_s is not None:
            rules.append(TtftObjective(policy.ttft_slo_s))
        if policy.tpot_slo_s is not None:
            rules.append(TpotObjective(policy.tpot_slo_s))
    return tuple(rules)


def reads_basic(policy: Policy) -> bool:
    """Whether ``policy`` decides on the basic numbers alone (the view's first nine fields): it
    keeps :meth:`Policy.decide` and every rule of it is :attr:`~qsim.rules.Rule.basic`. The queue
    cores build the whole view (projections, a draw) only where it does not."""
    return type(policy).decide is Policy.decide and all(r.basic for r in policy.rules)


def cannot_finish(now: float, est_service_s: float, deadline_at: float) -> bool:
    """True when a request started ``now`` would still end after ``deadline_at``."""
    return now + est_service_s > deadline_at + TIME_TOLERANCE_S


def on_time(latency_s, deadline_s):
    """Whether an answer was good (True) or late; works on scalars and arrays."""
    return latency_s <= deadline_s + TIME_TOLERANCE_S
