"""A section of the study, the markers in its folder, and how one is run, skipped or resumed.

A section's inputs decide its results; their digest goes into ``inputs.json`` when it starts and
into ``done.json`` when it ends (:func:`run_section`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from inputs.atomic import atomic_write

from .scale import Scale

#: Bump when a section's computation changes, so that done sections are recomputed.
STUDY_VERSION = 1


@dataclass(frozen=True)
class Context:
    """What every section is run with."""

    out: Path
    scale: Scale
    workers: int | None = None
    skip_live: bool = False
    log: Callable[[str], None] = print
    live_engine: str = "auto"  # the live pass's engine (live_pass.LIVE_ENGINES)


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    # what decides the results; {"unavailable": why} when it cannot run
    inputs: Callable[[Context], dict]
    run: Callable[[Context, Path], None]  # write results into the folder (resuming what is there)
    report: Callable[[Context, Path], list]  # the blocks, read back from the folder


def _digest(inputs: dict) -> str:
    text = json.dumps({"study_version": STUDY_VERSION, **inputs}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict) -> None:
    atomic_write(path, (json.dumps(data, indent=2, sort_keys=True, default=str) + "\n").encode())


def check_out(out: Path) -> None:
    """OUT must be a folder that is new, empty or a study's; never a file or another tool's
    folder."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "study.json").is_file():
        raise ValueError(
            f"--out {out}: a folder that is not a qlab study (no study.json); choose "
            "an empty or new one"
        )


def run_section(ctx: Context, section: Section, force: bool = False) -> str:
    """Run one section unless it is done with these inputs; return what happened (for the log)."""
    folder = ctx.out / "sections" / section.name
    inputs = section.inputs(ctx)
    if "unavailable" in inputs:
        return f"not available: {inputs['unavailable']}"
    digest = _digest(inputs)
    done = read_json(folder / "done.json")
    if not force and done is not None and done.get("digest") == digest:
        return "done before with the same inputs: skipped"
    started = read_json(folder / "inputs.json")
    fresh = force or started is None or started.get("digest") != digest
    if fresh:
        # another question's results (or none): nothing to resume
        shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "done.json").unlink(missing_ok=True)
    write_json(folder / "inputs.json", {"digest": digest, "inputs": inputs})
    section.run(ctx, folder)
    write_json(folder / "done.json", {"digest": digest})
    return "ran" if fresh else "resumed and finished"


def skippable(name: str, data: Callable[[Context], dict]) -> Callable[[Context], dict]:
    """A live section's inputs; with --skip-live, those of a pass finished earlier (reported, not
    run again)."""

    def inputs(ctx: Context) -> dict:
        if ctx.skip_live:
            folder = ctx.out / "sections" / name
            done, started = read_json(folder / "done.json"), read_json(folder / "inputs.json")
            if done and started and done.get("digest") == started.get("digest"):
                return started["inputs"]
            return {"unavailable": "skipped (--skip-live)"}
        return data(ctx)

    return inputs
