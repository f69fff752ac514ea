"""The configuration section: the qlab version, the scale, and each section's inputs."""

from __future__ import annotations

import dataclasses
import json
import platform

import pandas as pd

from .blocks import Code, Table, Text
from .scale import FULL
from .section import Context, Section, read_json


def qlab_version() -> str:
    """The version of qlab the study ran with ("unknown" in a checkout that is not installed)."""
    from ..sweep import _version as version

    return version()


def _report(names: tuple[str, ...], ctx: Context) -> list:
    rows = [
        {"setting": "qlab version", "value": qlab_version()},
        {"setting": "python", "value": platform.python_version()},
        {
            "setting": "scale",
            "value": ctx.scale.name + ("" if ctx.scale == FULL else " (not the reference sizes)"),
        },
    ]
    rows += [
        {"setting": f"scale.{k}", "value": str(v)}
        for k, v in dataclasses.asdict(ctx.scale).items()
        if k != "name"
    ]
    markers = [(name, read_json(ctx.out / "sections" / name / "inputs.json")) for name in names]
    markers = [
        (name, marker) for name, marker in markers if marker is not None and marker.get("inputs")
    ]
    for name, marker in markers:
        given = marker["inputs"]
        rows.append(
            {
                "setting": f"{name} inputs",
                "value": f"{given.get('file', 'built in')}, sha256 {marker['digest'][:16]}",
            }
        )
    blocks = [Table(pd.DataFrame(rows), "the settings of this report")]
    for name, marker in markers:
        blocks += [
            Text(f"{name}: its inputs (their digest marks the section done)"),
            Code(json.dumps(marker["inputs"], indent=1, sort_keys=True, default=str)),
        ]
    return blocks


def section(names: tuple[str, ...]) -> Section:
    """The configuration section of a study whose sections are ``names`` (in order): it runs
    nothing, and reports the inputs each of them last started with."""
    return Section(
        "configuration",
        "Configuration",
        lambda ctx: {},
        lambda ctx, folder: None,
        lambda ctx, folder: _report(names, ctx),
    )
