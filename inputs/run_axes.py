"""A run's axes, declared once: the knobs a sweep's grid varies, grouped by concern (the workload,
the admission policy, the server, its batching engine, the fleet), each field carrying what every
reader of it needs (:class:`Axis`).

Derived from here: a sweep's flat :class:`experiments.sweep.Cell` (its fields in
:data:`CELL_ORDER`), the [grid] keys and their TOML types and bounds
(:mod:`experiments.config_grid`), each axis's values when a grid lacks it and its "none"
sentinel, the axes whose None is left out of a cell's id, and the help and number type of the
``qlab simulate`` flags that set the same knob (:mod:`experiments.simflags`,
:mod:`experiments.engineflags`, :mod:`inputs.batchflags`). Adding an axis is a field in its group
and its name at the end of :data:`CELL_ORDER` (at the end: a summary's columns keep their order).
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field
from typing import Any

from .argtypes import Number, count, positive, positive_int

#: The key of an :class:`Axis` in a group field's metadata.
AXIS = "qlab.axis"


@dataclass(frozen=True)
class Axis:
    """What a run's knob is, to a sweep and to a flag.

    ``type``: str, bool, or a :class:`inputs.argtypes.Number` (its kind is the TOML type; its bound
    the TOML value's and the flag's). ``default``: the cells' values when the grid lacks the axis.
    ``none``: the grid's value that means None in a cell ("none": no clients). ``optional``: an axis
    added after cell ids existed: a cell's id leaves it out where it is None (its folder resumes),
    and its column is in a sweep's rows only when the sweep has the axis (``in_every_row``: always).
    ``estimation``: what the controller knows (a sweep with it gets the estimation columns).
    ``needs``: the axis applies only beside that one (a grid without it has None). ``in_grid``:
    False where the cell's values come from elsewhere (seeds, [policy_args]).
    """

    type: Any
    help: str
    default: tuple = (None,)
    none: str | None = None
    optional: bool = True
    in_every_row: bool = False
    estimation: bool = False
    needs: str | None = None
    in_grid: bool = True

    @property
    def toml_type(self) -> type:
        return self.type.kind if isinstance(self.type, Number) else self.type

    @property
    def number(self) -> Number | None:
        """The flag's (and the TOML value's) number type and bound; None for text and flags."""
        return self.type if isinstance(self.type, Number) else None


def axis(type_: Any, help_: str, **meta) -> Any:
    """A group's field: an optional axis defaults to None (a cell without it), another has none."""
    spec = Axis(type_, help_, **meta)
    return field(default=None if spec.optional else MISSING, metadata={AXIS: spec})


@dataclass(frozen=True, kw_only=True)
class WorkloadAxes:
    """What arrives: the mix, its rate, the clients and how they wait and retry, the prompts."""

    mix: str = axis(
        str, "the size mix of the requests (a [mixes] name)", default=("reference",), optional=False
    )
    load: float | None = axis(
        positive, "utilisation at the simulated speed (lambda = load * K / E[S])", optional=False
    )
    rate: float | None = axis(positive, "requests per second in place of a load")
    trace: str | None = axis(
        str,
        "a trace file (relative to the sweep file) instead of synthetic arrivals",
        optional=False,
    )
    time_scale: float | None = axis(
        positive,
        "--trace: multiply the file's arrival times",
        default=(1.0,),
        optional=False,
        needs="trace",
    )
    arrivals: str | None = axis(str, "the arrival process (None: [sweep] arrivals)")
    seed: int = axis(count, "the cell's replication", optional=False, in_grid=False)
    clients: str | None = axis(
        str, "a [clients] set (none: requests name no client)", none="none", in_every_row=True
    )
    retry: str | None = axis(str, "a [retry] policy (none: clients never retry)", none="none")
    patience: str | None = axis(
        str, "how long each client waits (none: forever, or a trace file's own)", none="none"
    )
    used: str | None = axis(
        str,
        "early stops: none (every request generates its limit, the default), study (the study's "
        "measured share: median 13 % of the limit, 4 in 60 at it) or AT_LIMIT:MEDIAN:SIGMA; the "
        "load then counts the work actually done (estimators: --policy-arg estimator=learned)",
        none="none",
        estimation=True,
    )
    system_prompt: str | None = axis(
        str,
        "a system prompt of S tokens before a share P of the prompts (a prefix cache shares it; "
        "default none)",
    )
    turns: str | None = axis(
        str,
        "conversations of T turns, each extending the one before with its answer; C open at once "
        "(default 16): a turn follows its last C arrivals later (default 1)",
    )


@dataclass(frozen=True, kw_only=True)
class AdmissionAxes:
    """What the gate admits by: the policy, its bound and deadline, its estimates, the
    objectives."""

    policy: str = axis(str, "an admission policy (qsim.policy)", default=(), optional=False)
    policy_args: str | None = axis(
        str, "the label of the policy's [policy_args] lists' values", in_grid=False
    )
    deadline_s: float | None = axis(
        positive, "override the default deadline (seconds)", optional=False
    )
    max_queue: int | None = axis(
        count, "override the preset's bound on waiting requests", optional=False
    )
    estimator: str | None = axis(
        str, "what a request's work is estimated from: limit, learned or oracle", estimation=True
    )
    cancel_at_deadline: bool | None = axis(
        bool, "cut a request still running at its deadline", estimation=True
    )
    fixed_estimate: bool | None = axis(
        bool, "keep the calibrated estimate (true) or track speed", estimation=True
    )
    ttft_slo_s: float | None = axis(
        positive, "objective on time to first token: a request is good only if it meets it too"
    )
    tpot_slo_s: float | None = axis(positive, "objective on time per output token")


@dataclass(frozen=True, kw_only=True)
class ServerAxes:
    """The machine: its engines and their speed, over time."""

    speed: float = axis(
        positive,
        "true service times are SPEED times the calibration",
        default=(1.0,),
        optional=False,
    )
    engines: int = axis(positive_int, "engines behind the queue (K)", default=(1,), optional=False)
    speed_schedule: str | None = axis(
        str,
        "the machine's speed over time, e.g. 20:2.2 (2.2x slower than calibrated from 20 s on)",
        none="none",
        estimation=True,
    )


@dataclass(frozen=True, kw_only=True)
class BatchingAxes:
    """A batching engine's settings over [batching]'s (None: [batching]'s own)."""

    max_num_seqs: int | None = axis(positive_int, "at most this many running (vLLM's; default 256)")
    kv_blocks: int | None = axis(positive_int, "KV memory in blocks (default unlimited)")
    chunked_prefill: bool | None = axis(bool, "split a long prompt's prefill across steps")
    step: str | None = axis(str, "a [steps] step model (default: [batching]'s)")
    prefix_caching: bool | None = axis(
        bool,
        "cache full KV blocks by their prefix and share them, as vLLM v1 does by default "
        "(qsim.prefix; default off)",
    )


@dataclass(frozen=True, kw_only=True)
class FleetAxes:
    """Copies of the server behind a router (replicas None: one server)."""

    replicas: int | None = axis(positive_int, "copies of the server behind a router")
    router: str | None = axis(str, "how the router picks a replica (default round_robin)")
    admission_at: str | None = axis(
        str,
        "where a fleet admits: replica (default), each replica on its own state after routing; "
        "gate, one admission at the cluster gate on the fleet's state (all its waiting, its "
        "engines) before routing (docs/simulate.md)",
    )


#: The groups of a run's axes, by name.
GROUPS: dict[str, type] = {
    "workload": WorkloadAxes,
    "admission": AdmissionAxes,
    "server": ServerAxes,
    "batching": BatchingAxes,
    "fleet": FleetAxes,
}

#: A sweep cell's fields in the order they were added (a summary's columns, a Cell's positional
#: arguments): the first ten existed before any optional axis.
CELL_ORDER = (
    *("policy", "load", "speed", "engines", "deadline_s", "max_queue", "mix", "trace"),
    *("time_scale", "seed", "clients", "retry", "patience", "estimator", "cancel_at_deadline"),
    *("used", "speed_schedule", "fixed_estimate", "max_num_seqs", "kv_blocks", "chunked_prefill"),
    *("step", "ttft_slo_s", "tpot_slo_s", "arrivals", "policy_args", "prefix_caching"),
    *("system_prompt", "turns", "replicas", "router", "rate", "admission_at"),
)


def _fields() -> dict[str, dataclasses.Field]:
    found = {f.name: f for group in GROUPS.values() for f in dataclasses.fields(group)}
    if sorted(found) != sorted(CELL_ORDER):  # a field added to a group and not to the order
        raise RuntimeError(f"CELL_ORDER and the groups differ: {set(found) ^ set(CELL_ORDER)}")
    return {name: found[name] for name in CELL_ORDER}


FIELDS = _fields()
#: Every axis by name, in :data:`CELL_ORDER`.
AXES: dict[str, Axis] = {name: f.metadata[AXIS] for name, f in FIELDS.items()}
#: The group each axis is in.
GROUP_OF: dict[str, str] = {
    f.name: name for name, group in GROUPS.items() for f in dataclasses.fields(group)
}


def cell_fields() -> list[tuple]:
    """(name, type, field) of each axis in :data:`CELL_ORDER`, for a flat dataclass of them."""
    return [(n, f.type, field(default=f.default)) for n, f in FIELDS.items()]


def group(values: Any, name: str) -> Any:
    """The group ``name``'s dataclass of the axes that ``values`` (a flat cell) holds."""
    cls = GROUPS[name]
    return cls(**{f.name: getattr(values, f.name) for f in dataclasses.fields(cls)})


def in_group(name: str) -> tuple[str, ...]:
    """The names of the axes in group ``name``."""
    return tuple(f.name for f in dataclasses.fields(GROUPS[name]))


def flag_help(name: str) -> str:
    """The axis's help as a flag's (argparse reads % as a format)."""
    return AXES[name].help.replace("%", "%%")
