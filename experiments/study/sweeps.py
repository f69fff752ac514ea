"""The sections that run a sweep: its experiment file cut to the scale, run, and read back."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import pandas as pd

from .blocks import Table
from .scale import Scale
from .section import Context, Section

#: Where the experiment files are (experiments/*.toml).
HERE = Path(__file__).resolve().parents[1]


def scaled(cfg, scale: Scale, loads: bool = False):
    """A sweep config cut to the scale: at most its seeds and seconds, and the scale's loads if
    asked."""
    changes = {}
    if scale.seeds is not None:
        changes["seeds"] = min(cfg.seeds, scale.seeds)
    if scale.duration_s is not None:
        changes["duration_s"] = min(cfg.duration_s, scale.duration_s)
    if loads and scale.loads is not None and "load" in cfg.grid:
        changes["grid"] = {**cfg.grid, "load": tuple(scale.loads)}
    return dataclasses.replace(cfg, **changes)


def _config(file: str, scale: Scale, loads: bool = False):
    from .. import config

    return scaled(config.load(HERE / file), _own_scale(file, scale), loads or file == BATCHING_FILE)


#: The batching sweep (H5), scaled by the scale's batching fields.
BATCHING_FILE = "batching.toml"


def _own_scale(file: str, scale: Scale) -> Scale:
    if file != BATCHING_FILE:
        return scale
    return dataclasses.replace(
        scale,
        seeds=scale.batching_seeds,
        duration_s=scale.batching_duration_s,
        loads=scale.batching_loads,
    )


def _inputs(file: str, loads: bool = False) -> Callable[[Context], dict]:
    def inputs(ctx: Context) -> dict:
        from ..config import ConfigError

        if not (HERE / file).is_file():
            return {"unavailable": f"experiments/{file} is not in this qlab"}
        try:
            cfg = _config(file, ctx.scale, loads)
        except ConfigError as exc:  # e.g. an axis this qlab's sweeps do not know yet
            return {"unavailable": f"experiments/{file} does not load here: {exc}"}
        return {"file": f"experiments/{file}", "config": cfg.canonical()}

    return inputs


def _run(file: str, loads: bool = False) -> Callable[[Context, Path], None]:
    def run(ctx: Context, folder: Path) -> None:
        from .. import sweep

        cfg = _config(file, ctx.scale, loads)
        sweep.run(cfg, folder / "sweep", workers=ctx.workers, quiet=True)

    return run


def summaries(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """The sweep's summary (with share_late) and its summary by size class; None: not run."""
    path = folder / "sweep" / "summary.parquet"
    if not path.is_file():
        return None
    summary = pd.read_parquet(path)
    summary["share_late"] = summary["late"] / summary["requests"]
    return summary, pd.read_parquet(folder / "sweep" / "summary_by_class.parquet")


def sweep_table(summary: pd.DataFrame, caption: str) -> Table:
    from ..commands import summary_table

    return Table(summary_table(summary), caption)


def sweep_section(
    name: str, title: str, file: str, report: Callable[[Context, Path], list], loads: bool = False
) -> Section:
    """A section that runs experiments/FILE as a sweep (with the scale's loads, if ``loads``)."""
    return Section(name, title, _inputs(file, loads), _run(file, loads), report)
