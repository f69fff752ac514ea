"""A sweep TOML's batching engine (:mod:`experiments.config`): [batching], the engine with its step
model inline (or a calibration's), and [steps.NAME], the other step models a grid's step axis
names."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from inputs.run_axes import in_group
from inputs.tomlfiles import ConfigError, no_unknown_keys, typed_value
from qsim.engines import Batching, StepModel

from .config_tables import _key


#: The grid axes of a batching engine's settings: a sweep with any of them needs a [batching] table.
BATCHING_AXES = in_group("batching")
#: The step model of a cell without a step axis: [batching]'s own.
DEFAULT_STEP = "default"
STEP_KEYS = {"b0": float, "b1": float, "b2": float, "b3": float, "cv": float}
BATCHING_KEYS = {
    **STEP_KEYS,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "chunked_prefill": bool,
    "prefix_caching": bool,
    "front_end": dict,
    "kv_blocks": int,
    "block_size": int,
}


def _batching_dict(engine: Batching) -> dict:
    """[batching] as the digest reads it: without prefix_caching where it is off, so that a config
    written before it existed keeps its digest (and its folder)."""
    fields = asdict(engine)
    if not fields["prefix_caching"]:
        del fields["prefix_caching"]
    if fields["front_end"] is None:
        del fields["front_end"]
    return fields


def _step_model(where: str, table: dict, defaults: StepModel = StepModel()) -> StepModel:
    values = {
        k: typed_value(f"{where}.{k}", v, STEP_KEYS[k]) for k, v in table.items() if k in STEP_KEYS
    }
    try:
        return replace(defaults, **values)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _batching(
    path: str, table: Any, steps: Any, calibrated: StepModel | None = None
) -> tuple[Batching | None, dict[str, StepModel]]:
    """[batching] (the engine, with its step model inline) and [steps.NAME] (other step models).
    ``calibrated``: a calibration's step model, [batching]'s where it gives none of b0 .. cv (given
    ones win, as ``--step`` does)."""
    if table is None:
        if steps:
            raise ConfigError(
                f"{path}: [steps] are step models of a batching engine: add a [batching] table"
            )
        return None, {}
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [batching] must be a table")
    no_unknown_keys(f"{path}: [batching]", table, BATCHING_KEYS)
    inline = any(k in STEP_KEYS for k in table)
    step = _step_model(
        f"{path}: batching", table, StepModel() if inline or calibrated is None else calibrated
    )
    settings = {
        k: typed_value(f"{path}: batching.{k}", v, BATCHING_KEYS[k])
        for k, v in table.items()
        if k not in STEP_KEYS
    }
    try:
        engine = Batching(step=step, **settings)
    except ValueError as exc:
        raise ConfigError(f"{path}: [batching]: {exc}") from None
    models = {DEFAULT_STEP: step}
    if not isinstance(steps, dict):
        raise ConfigError(f"{path}: [steps] must be a table of named step models")
    for name, spec in steps.items():
        where = f"{path}: steps.{_key(name)}"
        if name == DEFAULT_STEP:
            raise ConfigError(
                f"{where}: {DEFAULT_STEP!r} is [batching]'s own step model; name yours otherwise"
            )
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: expected a table of b0, b1, b2, b3, cv")
        no_unknown_keys(where, spec, STEP_KEYS)
        models[name] = _step_model(where, spec, step)  # what it does not say is [batching]'s
    return engine, models
