"""A sweep TOML's [grid] (:mod:`experiments.config`): every axis's values checked (the policies, the
names of [mixes], [clients], [retry] and [steps] tables, specs of patience, early stops, speed
schedules, arrivals, shared prefixes and routers), and the axes that exclude or need each other:
a trace and a load, a fleet's router and its replicas, synthetic arrivals and their load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inputs.clientflags import patience_from_table
from inputs.run_axes import AXES
from inputs.tomlfiles import ConfigError, no_unknown_keys, typed_value
from qsim import Mix
from qsim.estimators import ESTIMATORS
from qsim.service import SpeedSchedule, parse_schedule
from qsim.policy import resolve
from qsim.fleet import ADMISSION_AT
from qsim.routers import parse_router
from qsim.arrivals import arrivals_take_load, parse_arrivals
from qsim.mixes import SharedPrefix, UsedShare

from .config_batching import BATCHING_AXES, DEFAULT_STEP
from .config_tables import NO_CLIENTS, NO_RETRY, _key


#: Each [grid] key's TOML type (inputs.run_axes: every axis but those given elsewhere, seeds and
#: [policy_args]).
GRID_KEYS = {name: axis.toml_type for name, axis in AXES.items() if axis.in_grid}

#: The patience of a cell whose clients wait forever (a trace file's own patience_s column, if any).
NO_PATIENCE = AXES["patience"].none
#: The early stops of a cell whose requests all generate their limit (a trace file's own
#: tokens_generated).
NO_USED = AXES["used"].none
#: The speed schedule of a cell whose machine keeps its speed.
NO_SCHEDULE = AXES["speed_schedule"].none


def parse_used(spec: str) -> UsedShare | None:
    """A ``used`` spec: "none" (None: every request generates its limit), "study" (the study's
    measured
    :class:`qsim.mixes.UsedShare`) or "AT_LIMIT:MEDIAN:SIGMA"; ValueError saying what is
    expected."""
    text = spec.strip()
    if text == NO_USED:
        return None
    if text == "study":
        return UsedShare()
    parts = text.split(":")
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) != 3:
        raise ValueError(
            f"expected none, study or AT_LIMIT:MEDIAN:SIGMA (e.g. 0.067:0.13:1), got {spec!r}"
        )
    return UsedShare(*numbers)


def parse_speed_schedule(spec: str, base: float = 1.0) -> SpeedSchedule | None:
    """A ``speed_schedule`` spec: "none" (None) or SECONDS:FACTOR,... over a machine of speed
    ``base``."""
    return None if spec.strip() == NO_SCHEDULE else SpeedSchedule(base, parse_schedule(spec))


def _grid(
    path: str,
    table: Any,
    mixes: dict[str, Mix],
    base: Path,
    clients: dict,
    retries: dict | None = None,
    patience_until: str = "answer",
    batching: bool = False,
    steps: dict | None = None,
) -> dict[str, tuple]:
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"{path}: [grid] is missing or empty: it needs at least policy")
    no_unknown_keys(f"{path}: [grid]", table, GRID_KEYS)
    grid: dict[str, tuple] = {}
    for key, values in table.items():
        where = f"{path}: grid.{key}"
        values = values if isinstance(values, list) else [values]
        if not values:
            raise ConfigError(f"{where}: empty list: a grid axis needs at least one value")
        checked = tuple(
            typed_value(f"{where}[{i}]", v, GRID_KEYS[key]) for i, v in enumerate(values)
        )
        if len(set(checked)) != len(checked):
            raise ConfigError(f"{where}: a value appears twice")
        for i, v in enumerate(checked):
            if key == "policy":
                try:
                    resolve(v)
                except ValueError as exc:
                    raise ConfigError(f"{where}[{i}]: {exc}") from None
            if key == "mix" and v not in mixes:
                raise ConfigError(
                    f"{where}[{i}]: unknown mix {v!r}; define it under [mixes.{_key(v)}]"
                )
            if key == "clients" and v != NO_CLIENTS and v not in clients:
                raise ConfigError(
                    f"{where}[{i}]: unknown client set {v!r}; define it under "
                    f"[clients.{_key(v)}] "
                    f"(or use {NO_CLIENTS!r})"
                )
            if key == "retry" and v != NO_RETRY and v not in (retries or {}):
                raise ConfigError(
                    f"{where}[{i}]: unknown retry policy {v!r}; define it under "
                    f"[retry.{_key(v)}] "
                    f"(or use {NO_RETRY!r})"
                )
            if key == "patience":
                patience_from_table(f"{where}[{i}]", v, patience_until)
            if key == "estimator" and v not in ESTIMATORS:
                raise ConfigError(
                    f"{where}[{i}]: unknown estimator {v!r}; choose one of {', '.join(ESTIMATORS)}"
                )
            if key == "admission_at" and v not in ADMISSION_AT:
                raise ConfigError(
                    f"{where}[{i}]: a fleet admits at one of {', '.join(ADMISSION_AT)}, got {v!r}"
                )
            if key in ("used", "speed_schedule", "arrivals", "system_prompt", "turns", "router"):
                try:
                    {
                        "used": parse_used,
                        "speed_schedule": parse_speed_schedule,
                        "arrivals": parse_arrivals,
                        "system_prompt": _system_prompt,
                        "turns": _turns,
                        "router": parse_router,
                    }[key](v)
                except ValueError as exc:
                    raise ConfigError(f"{where}[{i}]: {exc}") from None
            # a number's bound, as its flag's (inputs.argtypes)
            number = AXES[key].number
            if number is not None and number.out_of_range(v):
                raise ConfigError(f"{where}[{i}]: {number.out_of_range(v)}, got {v!r}")
            if key == "trace" and not (base / v).is_file():
                raise ConfigError(
                    f"{where}[{i}]: no such trace file {v!r} (relative paths are "
                    "from the sweep file's folder)"
                )
        grid[key] = checked
    if "policy" not in grid:
        raise ConfigError(f"{path}: grid.policy is required")
    for key in ("load", "rate"):
        if "trace" in grid and key in grid:
            raise ConfigError(
                f"{path}: grid.trace and grid.{key} exclude each other: a trace "
                "brings its own arrivals"
            )
    if "load" in grid and "rate" in grid:
        raise ConfigError(
            f"{path}: grid.load and grid.rate exclude each other: a rate is a load "
            "(of the cell's capacity_rps); give one"
        )
    if "trace" in grid and "arrivals" in grid:
        raise ConfigError(
            f"{path}: grid.arrivals applies to synthetic arrivals; a trace file brings its own"
        )
    if "time_scale" in grid and "trace" not in grid:
        raise ConfigError(f"{path}: grid.time_scale applies only with grid.trace")
    if "trace" not in grid and any(p.strip() == "column" for p in grid.get("patience", ())):
        raise ConfigError(
            f"{path}: grid.patience 'column' reads a trace file's patience_s "
            "column; it needs grid.trace"
        )
    if any(axis in grid for axis in BATCHING_AXES) and not batching:
        raise ConfigError(
            f"{path}: grid.{next(a for a in BATCHING_AXES if a in grid)} is a "
            "batching engine's "
            "setting: add a [batching] table"
        )
    if batching and grid.get("engines", (1,)) != (1,):
        raise ConfigError(
            f"{path}: grid.engines: a [batching] sweep runs one batching engine per cell"
        )
    for i, name in enumerate(grid.get("step", ())):
        if name not in (steps or {}):
            raise ConfigError(
                f"{path}: grid.step[{i}]: unknown step model {name!r}; define it "
                "under "
                f"[steps.{_key(name)}] (or use {DEFAULT_STEP!r}: [batching]'s)"
            )
    _check_fleet(path, grid, batching)
    if "trace" in grid and set(grid.get("clients", (NO_CLIENTS,))) != {NO_CLIENTS}:
        raise ConfigError(
            f"{path}: grid.clients applies to synthetic arrivals; a trace file "
            "brings its own "
            "client_id and priority columns"
        )
    return grid


def _check_fleet(path: str, grid: dict, batching: bool) -> None:
    """A fleet's axes: replicas (each a copy of the cell's server, the load each replica's) and the
    router between them (default round_robin, as ``qlab simulate``'s); what a fleet cannot be yet
    (qsim.fleet.FleetSpec.check) is refused here, before any cell runs."""
    if "router" in grid and "replicas" not in grid:
        raise ConfigError(f"{path}: grid.router routes between replicas: add grid.replicas")
    if "admission_at" in grid and "replicas" not in grid:
        raise ConfigError(f"{path}: grid.admission_at is where a fleet admits: add grid.replicas")
    routers = {spec: parse_router(spec) for spec in grid.get("router", ())}
    # Checked at one replica too: a sizing search (experiments/sizing.py) starts there.
    for spec, router in routers.items():
        if router.needs_batching and not batching:
            raise ConfigError(
                f"{path}: grid.router {spec!r} reads a batching engine's KV "
                "memory and prefix cache: add a [batching] table"
            )
    if max(grid.get("replicas", (1,))) == 1:
        return
    fleets = [n for n in grid["replicas"] if n > 1]
    for spec, router in routers.items():
        d = getattr(router, "d", 1)
        if d > min(fleets):
            raise ConfigError(
                f"{path}: grid.router {spec!r}: {d} choices among {min(fleets)} replicas"
            )


def _system_prompt(spec: str) -> SharedPrefix:
    """A system prompt's spec, checked (ValueError naming what is wrong)."""
    return SharedPrefix(*SharedPrefix.parse_system(spec))


def _turns(spec: str) -> SharedPrefix:
    turns, open_at_once = SharedPrefix.parse_turns(spec)
    return SharedPrefix(turns=turns, conversations=open_at_once)


def shared_prefix(system_prompt: str, turns: str) -> SharedPrefix | None:
    """The prompts' shared prefixes of these specs (None: nothing shared)."""
    shared = SharedPrefix.parse(system_prompt, turns)
    return shared if shared.shares else None


def _check_load(path: str, grid: dict, sweep: dict) -> None:
    """Synthetic arrivals take the grid's load exactly when their process does: a load given to
    bursts of their own size would be ignored, so it is refused (and a process that needs one
    without it)."""
    if "trace" in grid:
        return
    if "arrivals" in grid and "arrivals" in sweep:
        raise ConfigError(f"{path}: sweep.arrivals and grid.arrivals exclude each other; give one")
    where = "grid.arrivals" if "arrivals" in grid else "sweep.arrivals"
    for spec in grid.get("arrivals", (sweep.get("arrivals", "poisson"),)):
        takes = arrivals_take_load(spec)
        given = next((k for k in ("load", "rate") if k in grid), None)
        if takes and given is None:
            raise ConfigError(
                f"{path}: the grid needs load (synthetic arrivals: {where} {spec!r} "
                "takes one), "
                "rate or trace (a file's arrivals)"
            )
        if not takes and given is not None:
            raise ConfigError(
                f"{path}: {where} {spec!r} takes no {given} (its burst size sets its "
                "rate); leave "
                f"grid.{given} out, give periodic:PERIOD_S (its burst size follows "
                "the load), or "
                "sweep it in a file of its own"
            )
