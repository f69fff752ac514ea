"""Sweep configuration: a TOML file read into frozen dataclasses, checked before any cell runs.

```toml
[sweep]                      # all optional
name = "reference"
duration_s = 600             # simulated seconds of arrivals per cell
seeds = 20                   # replications: seeds first_seed .. first_seed + seeds - 1
first_seed = 1
arrivals = "poisson"         # poisson | constant | gamma:CV | periodic:PERIOD_S |
                             surge:START_S:LENGTH_S:LOAD #   (these take the grid's load), or
                             burst:N | periodic:N:PERIOD_S # (their size sets their rate: the grid
                             then has no load)
service_dist = "mix"         # mix | exponential | deterministic (the latter two: mean_service_s,
                             else the mix's mean)
noise_cv = 0.0               # lognormal noise on true service times
fixed_estimate = false       # true: no speed tracking

[service]                    # optional: the calibrated line (default 1 ms + 8.5 ms per new token),
                             inline:
intercept_s = 0.001
per_token_s = 0.0085
# per_prompt_token_s = 0.0   #   the prefill term (seconds per prompt token)
# concurrency = 0.0          #   engines one at a time slow each other: a run x (1 + C (busy - 1))
# or instead, from a `qlab calibrate` JSON (relative to this file's folder; exclusive with the keys
# above): file = "calibration.json"  #   its line, its concurrency term, its noise CV (the cells'
# noise_cv unless #   [sweep] noise_cv is given) and, for a [batching] sweep, its step model (unless
#                            #   [batching] gives b0 .. cv); the manifest records the file and its
# terms

[mixes.reference]            # optional: named size mixes ("reference" is built in)
sizes = [4, 16, 64]
probs = [0.5, 0.35, 0.15]

[grid]                       # every combination is one cell (times each seed)
policy = ["none", "bounded", "bounded-deadline", "predictive"]
load = [0.5, 1.0, 2.0]       # utilisation at the simulated speed: lambda = load * engines / E[true
                             S]
# rate = [10.0, 20.0]        #   or instead: requests/s (load = rate / the cell's capacity_rps)
speed = [1.0, 2.25]          # true service times are SPEED times the calibration
engines = [1]
deadline_s = [2.0]           # optional, else the preset's
max_queue = [8]              # optional, else the preset's
mix = ["reference"]          # names from [mixes]; or
trace = ["data/x.csv"]       # trace files instead of synthetic arrivals (load then unused)
time_scale = [1.0]           # with trace
arrivals = ["poisson", "periodic:10"]  # optional: an axis of arrival processes, in place of [sweep]
                                       arrivals

[policy_args.codel]          # optional: parameters of a grid policy (its dataclass fields)
codel_target_s = 0.2
[policy_args.adaptive-lifo]  # a list is an axis of that parameter's values (for this policy only):
lifo_threshold = [4, 8]      #   each value is a cell of its own, labelled policy_args =
                             "lifo_threshold=4"

[clients.two-tenant]         # optional: named sets of clients (tenants), each client a table:
heavy = { share = 0.85 }     #   share of the arrivals (a set's shares sum to 1),
light = { share = 0.15, priority = 0, mix = "reference" }  # priority (default 0), mix (default the
cell's) # and in [grid]: clients = ["none", "two-tenant"]  ("none": requests name no client; the
default)

[retry.naive]                # optional: named retry policies (keys: qsim.clients.RetryPolicy's
                             fields)
mode = "immediate"           #   none | immediate | fixed | exponential
retry_after = "ignore"
max_attempts = 5
timeout_s = 8                #   the client hangs up on an attempt after 8 s and sends it again
# and in [grid]: retry = ["none", "naive"]  ("none": clients never retry; the default)
# and in [grid]: patience = ["none", "exponential:30"]  (qsim.clients.Patience specs; "none": the
# default) with, in [sweep], patience_until = "answer" | "start" (default answer)
# What the controller knows (optional axes; docs/sweeps.md "Estimation, stale estimates,
# cancelling"): estimator = ["limit", "learned", "oracle"]  # the policy's estimator
# (qsim.estimators); default the policy's used = ["none", "study"]    # early stops: "none" every
# request generates its limit (the default), "study" #   the study's measured UsedShare, or
# "AT_LIMIT:MEDIAN:SIGMA"; load counts the work done speed_schedule = ["none", "20:2.2"]  # the
# machine's speed over time, SECONDS:FACTOR,... ("none": constant) fixed_estimate = [false, true]
# # per cell, in place of [sweep] fixed_estimate cancel_at_deadline = [false, true]   # cut a run in
# service when its deadline passes (outcome cancelled)

[batching]                   # optional: one engine that runs requests together
                             (qsim.engines.Batching);
b0 = 0.008                   #   its step model (seconds: per step, per prefill token, per sequence
                             producing a
b1 = 5e-05                   #   token, per context token held), cv (a step's spread), and its vLLM
                             settings
b2 = 0.0001                  #   max_num_seqs, max_num_batched_tokens, chunked_prefill, kv_blocks
                             (absent:
b3 = 1e-07                   #   unlimited), block_size. load is then of its saturated throughput
kv_blocks = 2000             #   (Batching.capacity_rps) and grid.engines must be absent.
[steps.slow]                 # optional: named step models (b0, b1, b2, b3, cv), a grid axis:
b0 = 0.016                   # and in [grid]: step = ["default", "slow"] ("default": [batching]'s)
# Batching axes, each optional: max_num_seqs = [64, 256], kv_blocks = [1000, 4000], chunked_prefill
# = [true, false], step = [...]; objectives of any sweep: ttft_slo_s = [0.5], tpot_slo_s = [0.05] (a
# request is good only when it meets every objective it has). In [sweep], prompts =
# "lognormal:512:0.8" (qsim.mixes.Prompts; default none). Prefix caching (qsim.prefix):
# prefix_caching = true in [batching], or in [grid] prefix_caching = [false, true]; prompts that
# share tokens, in [sweep] or as [grid] axes (qsim.mixes.SharedPrefix): system_prompt = "512:0.8" (a
# system prompt of 512 tokens before a share 0.8 of the prompts; "none": the default) and turns =
# "4:16" (conversations of 4 turns, 16 open at once; "1": the default).
# An API process in front of the engine (qsim.engines.FrontEnd), in [batching]:
# front_end = {request_s = 0.002, token_s = 0.0004}.
# A fleet (qsim.fleet), optional axes: replicas = [2, 4, 8] (copies of the cell's server, each its
# engines, line and admission; the load is each replica's; with [batching] each replica a batching
# engine) and router = ["random", "power_of_d", "power_of_d:3", "central"] (qsim.routers; default
# round_robin; needs replicas; with [batching] also "least_kv", "prefix", "weighted").
```

A grid policy is a preset's name or ``module:Class``, a :class:`qsim.policy.Policy` of one's own
(``policy = ["predictive", "slack:LeastSlack"]``; the module must be importable).

This module reads the file into a :class:`SweepConfig` (:func:`load`, :func:`parse`) and checks
[sweep] and [policy_args]; [grid] is checked in :mod:`experiments.config_grid`, the named tables
and [service] in :mod:`experiments.config_tables`, [batching] and [steps] in
:mod:`experiments.config_batching`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from inputs.clientflags import patience_from_table
from inputs.policyflags import args_tables
from inputs.tomlfiles import ConfigError, no_unknown_keys, positive_value, read_toml, typed_value
from qsim import Mix, ServiceModel
from qsim.clients import PATIENCE_UNTIL, RetryPolicy
from qsim.engines import Batching, StepModel
from qsim.policy import resolve
from qsim.arrivals import parse_arrivals
from qsim.mixes import Client, Prompts
from qsim.workload import SERVICES

from .config_batching import _batching, _batching_dict
from .config_grid import GRID_KEYS, _check_load, _grid, _system_prompt, _turns
from .config_tables import CalibrationFile, _client_dict, _clients, _key, _mixes, _retries, _service

SWEEP_KEYS = {
    "name": str,
    "duration_s": float,
    "seeds": int,
    "first_seed": int,
    "arrivals": str,
    "noise_cv": float,
    "fixed_estimate": bool,
    "patience_until": str,
    "prompts": str,
    "service_dist": str,
    "mean_service_s": float,
    "system_prompt": str,
    "turns": str,
}


SECTIONS = {
    "sweep",
    "service",
    "mixes",
    "grid",
    "policy_args",
    "clients",
    "retry",
    "batching",
    "steps",
}


@dataclass(frozen=True)
class SweepConfig:
    name: str
    duration_s: float
    seeds: int
    first_seed: int
    arrivals: str
    noise_cv: float
    fixed_estimate: bool
    service: ServiceModel
    mixes: dict[str, Mix]
    grid: dict[str, tuple]
    source: str = field(default="", compare=False)
    policy_args: dict[str, dict] = field(default_factory=dict)  # grid policy -> its parameters
    # client set name -> its clients
    clients: dict[str, tuple[Client, ...]] = field(default_factory=dict)
    retries: dict[str, RetryPolicy] = field(default_factory=dict)  # [retry.NAME] -> its policy
    # what a grid patience waits for (the whole answer, or its start)
    patience_until: str = "answer"
    # [batching]: cells run one batching engine with these settings
    batching: Batching | None = None
    # [steps.NAME], and "default": [batching]'s
    steps: dict[str, StepModel] = field(default_factory=dict)
    prompts: str = "none"  # [sweep] prompts: qsim.mixes.Prompts' spec
    system_prompt: str = "none"  # [sweep] system_prompt: SharedPrefix.parse_system's spec
    turns: str = "1"  # [sweep] turns: SharedPrefix.parse_turns' spec
    # engines one at a time slow each other (qsim.engines.OneAtATime.concurrency)
    concurrency: float = 0.0
    # [service] file: where the line, concurrency, noise_cv and [batching]'s step model came from
    # (None: inline).
    calibration: CalibrationFile | None = field(default=None, compare=False)

    def engine(
        self,
        max_num_seqs: int | None = None,
        kv_blocks: int | None = None,
        chunked_prefill: bool | None = None,
        step: str | None = None,
        prefix_caching: bool | None = None,
    ) -> Batching | None:
        """A cell's batching engine: [batching] with the cell's axes applied (None: engines run
        one at a time)."""
        if self.batching is None:
            return None
        changes = {
            k: v
            for k, v in (
                ("max_num_seqs", max_num_seqs),
                ("kv_blocks", kv_blocks),
                ("chunked_prefill", chunked_prefill),
                ("prefix_caching", prefix_caching),
            )
            if v is not None
        }
        if step is not None:
            changes["step"] = self.steps[step]
        if (
            "max_num_seqs" in changes
            and changes["max_num_seqs"] > self.batching.max_num_batched_tokens
        ):
            changes["max_num_batched_tokens"] = changes["max_num_seqs"]
        return replace(self.batching, **changes) if changes else self.batching

    service_dist: str = "mix"  # mix | exponential | deterministic (qsim.make_trace's service)
    # exponential and deterministic: their mean (None: the mix's)
    mean_service_s: float | None = None

    def patience(self, spec: str | None):
        """The grid patience ``spec`` (None: the trace's own, i.e. none for synthetic arrivals)."""
        return (
            None
            if spec is None
            else patience_from_table("grid.patience", spec, self.patience_until)
        )

    def policy(self, name: str, variant: str | None = None):
        """The grid policy ``name`` with its [policy_args], at ``variant``: the label of one
        combination of its list-valued parameters (:meth:`policy_variants`; None: it has none)."""
        args = self.policy_args.get(name, {})
        fixed = {k: v for k, v in args.items() if not isinstance(v, list)}
        return resolve(
            name, {**fixed, **(self.policy_variants(name)[variant] if variant is not None else {})}
        )

    def policy_variants(self, name: str) -> dict[str | None, dict]:
        """The combinations of the grid policy's list-valued [policy_args] (its parameter axes),
        each by its label ("lifo_threshold=4", several joined by ", "), in the lists' order; {None:
        {}} when it has no list."""
        return policy_variants(self.policy_args.get(name, {}))

    @property
    def arrival_processes(self) -> tuple[str, ...]:
        """Every arrival process of the sweep: the grid's arrivals axis, else [sweep] arrivals."""
        return self.grid.get("arrivals", (self.arrivals,))

    def trace_path(self, trace: str) -> Path:
        """A grid trace path: relative ones are from the sweep file's folder."""
        return Path(self.source).parent / trace

    def canonical(self) -> dict[str, Any]:
        """Everything that decides the rows, as plain JSON-able data (the hash is over this)."""
        return {
            "name": self.name,
            "duration_s": self.duration_s,
            "seeds": self.seeds,
            "first_seed": self.first_seed,
            "arrivals": self.arrivals,
            "noise_cv": self.noise_cv,
            "fixed_estimate": self.fixed_estimate,
            "service": asdict(self.service),
            "mixes": {
                k: {"sizes": list(m.sizes), "probs": list(m.probs)}
                for k, m in sorted(self.mixes.items())
            },
            "grid": {k: list(v) for k, v in sorted(self.grid.items())},
            # Only when given, so a config without it keeps the digest (and the folders) it had.
            **({"policy_args": self.policy_args} if self.policy_args else {}),
            **(
                {
                    "clients": {
                        k: [_client_dict(c) for c in v] for k, v in sorted(self.clients.items())
                    }
                }
                if self.clients
                else {}
            ),
            **(
                {"retry": {k: asdict(v) for k, v in sorted(self.retries.items())}}
                if self.retries
                else {}
            ),
            **({"patience_until": self.patience_until} if "patience" in self.grid else {}),
            **(
                {
                    "batching": _batching_dict(self.batching),
                    "steps": {k: asdict(v) for k, v in sorted(self.steps.items())},
                }
                if self.batching is not None
                else {}
            ),
            **({"prompts": self.prompts} if self.prompts != "none" else {}),
            **({"system_prompt": self.system_prompt} if self.system_prompt != "none" else {}),
            **({"turns": self.turns} if self.turns != "1" else {}),
            # The terms, not the file they came from: a calibration file and the same settings
            # inline are one config.
            **({"concurrency": self.concurrency} if self.concurrency else {}),
            **(
                {"service_dist": self.service_dist, "mean_service_s": self.mean_service_s}
                if self.service_dist != "mix"
                else {}
            ),
        }

    @property
    def digest(self) -> str:
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def _label_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def policy_variants(args: dict) -> dict[str | None, dict]:
    """A [policy_args.NAME] table's list-valued parameters (axes) combined: {label: {parameter:
    value}}, the first parameter (by name) outermost; {None: {}} when none is a list."""
    axes = {k: v for k, v in sorted(args.items()) if isinstance(v, list)}
    if not axes:
        return {None: {}}
    combos = (dict(zip(axes, values)) for values in itertools.product(*axes.values()))
    return {
        ", ".join(f"{k}={_label_value(v)}" for k, v in combo.items()): combo for combo in combos
    }


def parse(data: dict, path: str = "<sweep>") -> SweepConfig:
    """Check a parsed TOML document and build the config; raise ConfigError naming the key."""
    no_unknown_keys(path, data, SECTIONS)
    sweep = data.get("sweep", {})
    if not isinstance(sweep, dict):
        raise ConfigError(f"{path}: [sweep] must be a table")
    no_unknown_keys(f"{path}: [sweep]", sweep, SWEEP_KEYS)
    s = {k: typed_value(f"{path}: sweep.{k}", v, SWEEP_KEYS[k]) for k, v in sweep.items()}
    defaults = dict(
        name=Path(path).stem,
        duration_s=600.0,
        seeds=20,
        first_seed=1,
        arrivals="poisson",
        noise_cv=0.0,
        fixed_estimate=False,
    )
    s = {**defaults, **s}
    positive_value(f"{path}: sweep.duration_s", s["duration_s"])
    positive_value(f"{path}: sweep.seeds", s["seeds"])
    positive_value(f"{path}: sweep.first_seed", s["first_seed"], zero_ok=True)
    positive_value(f"{path}: sweep.noise_cv", s["noise_cv"], zero_ok=True)
    until = s.pop("patience_until", None)
    if until is not None and until not in PATIENCE_UNTIL:
        raise ConfigError(
            f"{path}: sweep.patience_until: expected one of "
            f"{', '.join(PATIENCE_UNTIL)}, got {until!r}"
        )
    try:
        parse_arrivals(s["arrivals"])
    except ValueError as exc:
        raise ConfigError(f"{path}: sweep.arrivals: {exc}") from None
    if s.get("service_dist", "mix") not in SERVICES:
        raise ConfigError(
            f"{path}: sweep.service_dist: expected one of {', '.join(SERVICES)}, "
            f"got {s['service_dist']!r}"
        )
    if "mean_service_s" in s:
        positive_value(f"{path}: sweep.mean_service_s", s["mean_service_s"])
        if s.get("service_dist", "mix") == "mix":
            raise ConfigError(
                f"{path}: sweep.mean_service_s applies to exponential and "
                "deterministic service_dist, "
                "not to the mix"
            )
    model, concurrency, calibration = _service(path, data.get("service", {}))
    # the noise measured under load, unless given
    if calibration is not None and "noise_cv" not in sweep:
        s["noise_cv"] = calibration.terms.noise_cv or 0.0
    mixes = _mixes(path, data.get("mixes", {}))
    clients = _clients(path, data.get("clients", {}), mixes)
    retries = _retries(path, data.get("retry", {}))
    batching, steps = _batching(
        path,
        data.get("batching"),
        data.get("steps", {}),
        None if calibration is None else calibration.terms.step,
    )
    if batching is not None and concurrency:
        if calibration is None:
            raise ConfigError(
                f"{path}: service.concurrency slows engines that run one request at "
                "a time; a "
                "[batching] engine's requests share its steps (its step model says "
                "how)"
            )
        # a calibration's concurrency term is of engines one at a time, not of a batch
        concurrency = 0.0
    try:
        Prompts.parse(s.get("prompts", "none"))
    except ValueError as exc:
        raise ConfigError(f"{path}: sweep.prompts: {exc}") from None
    for key, check in (("system_prompt", _system_prompt), ("turns", _turns)):
        try:
            check(s.get(key, "none" if key == "system_prompt" else "1"))
        except ValueError as exc:
            raise ConfigError(f"{path}: sweep.{key}: {exc}") from None
    grid = _grid(
        path,
        data.get("grid"),
        mixes,
        Path(path).parent,
        clients,
        retries,
        until or "answer",
        batching is not None,
        steps,
    )
    shares = [k for k in ("system_prompt", "turns") if k in grid or k in s]
    if "trace" in grid and shares:
        raise ConfigError(
            f"{path}: {shares[0]} applies to synthetic arrivals; a trace file's prompts are its own"
        )
    if until is not None and "patience" not in grid:
        raise ConfigError(f"{path}: sweep.patience_until applies only with grid.patience")
    if "fixed_estimate" in sweep and "fixed_estimate" in grid:
        raise ConfigError(
            f"{path}: sweep.fixed_estimate and grid.fixed_estimate exclude each other; give one"
        )
    _check_load(path, grid, sweep)
    if concurrency and max(grid.get("replicas", (1,))) > 1:
        raise ConfigError(
            f"{path}: grid.replicas: engines that slow each other share one "
            "machine; a fleet's replicas take engines with concurrency 0 (no "
            "service.concurrency)"
        )
    if batching is not None and s.get("service_dist", "mix") != "mix":
        raise ConfigError(
            f"{path}: sweep.service_dist: a [batching] engine's work is its "
            "requests' tokens, drawn "
            "from the mix; service_dist applies to engines that run one request at "
            "a time"
        )
    return SweepConfig(
        service=model,
        mixes=mixes,
        grid=grid,
        source=path,
        clients=clients,
        retries=retries,
        patience_until=until or "answer",
        batching=batching,
        steps=steps,
        concurrency=concurrency,
        calibration=calibration,
        policy_args=_policy_args(path, data.get("policy_args", {}), grid["policy"], grid),
        **s,
    )


def _policy_args(path: str, table: Any, policies: tuple, grid: dict) -> dict[str, dict]:
    """[policy_args]: each policy's parameters; a list is an axis of that parameter's values, each
    combination checked as a plain table is."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [policy_args] must be a table of policies")
    candidates = []  # (name, one plain table): every combination of a table's lists
    for name, args in table.items():
        if not isinstance(args, dict):
            candidates.append((name, args))  # args_tables says what it should be
            continue
        for key, value in args.items():
            where = f"{path}: policy_args.{_key(name)}.{key}"
            if isinstance(value, list) and not value:
                raise ConfigError(f"{where}: empty list: a parameter axis needs at least one value")
            if isinstance(value, list) and len({json.dumps(v) for v in value}) != len(value):
                raise ConfigError(f"{where}: a value appears twice")
            if key in GRID_KEYS and key in grid:  # the grid's axis would set it over this value
                raise ConfigError(
                    f"{where}: the grid's {key} axis sets it for every policy; give "
                    "its values there"
                )
        plain = {k: v for k, v in args.items() if not isinstance(v, list)}
        candidates += [(name, {**plain, **combo}) for combo in policy_variants(args).values()]
    try:
        for name, args in candidates:
            args_tables({name: args}, policies)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return {name: dict(args) for name, args in table.items()}


def load(path: str | Path) -> SweepConfig:
    """Read and check a sweep file."""
    try:
        data = read_toml(path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return parse(data, str(path))
