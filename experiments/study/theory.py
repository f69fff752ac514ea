"""The theory section: every closed form of the reference study against the simulator (``qlab
theory``)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from inputs.atomic import write_parquet

from .blocks import Table, Text, Verdict, not_run
from .section import Context, Section, read_json, write_json


def _inputs(ctx: Context) -> dict:
    from analysis.validation import TOO_WIDE, standard_scenarios

    # The cases' names too: a changed set of closed forms is another question, to be run afresh.
    return {
        "replications": ctx.scale.theory_replications,
        "scale": ctx.scale.theory_scale,
        "seed": 1,
        "level": 0.95,
        "too_wide": TOO_WIDE,
        "cases": [s.name for s in standard_scenarios(ctx.scale.theory_scale)],
    }


def _run(ctx: Context, folder: Path) -> None:
    from analysis.validation import check, standard_scenarios

    table = check(
        standard_scenarios(ctx.scale.theory_scale),
        replications=ctx.scale.theory_replications,
        seed=1,
        level=0.95,
        workers=ctx.workers,
    )
    write_json(folder / "attrs.json", dict(table.attrs))
    write_parquet(table, folder / "theory.parquet")


def theory_verdict(table: pd.DataFrame, too_wide: float) -> Verdict:
    """The theory check: supported when every row is judged and passes, not supported when a judged
    row fails, not testable when none fails but some intervals are too wide to judge."""
    from analysis.validation import tally

    counts = tally(table)
    judged = counts["pass"] + counts["fail"]
    evidence = (
        f"{counts['pass']} of {judged} judged closed-form values inside their simulated interval"
    )
    if counts["fail"]:
        failed = table[table["verdict"] == "fail"]
        evidence += "; outside: " + ", ".join(
            f"{c} {q}" for c, q in zip(failed["case"], failed["quantity"])
        )
    if counts["too wide"]:
        wide = table[table["verdict"] == "too wide"]
        evidence += (
            f"; {counts['too wide']} of {len(table)} intervals too wide to judge "
            "(half-width over "
            f"{too_wide:.0%} of the value: "
            + ", ".join(f"{c} {q}" for c, q in zip(wide["case"], wide["quantity"]))
            + ")"
        )
    supported = False if counts["fail"] else (None if counts["too wide"] else True)
    return Verdict("check", "the simulator agrees with every closed form", supported, evidence)


def _report(ctx: Context, folder: Path) -> list:
    from analysis.validation import TOO_WIDE, shown

    if not (folder / "theory.parquet").is_file():
        return not_run(folder)
    table = pd.read_parquet(folder / "theory.parquet")
    attrs = read_json(folder / "attrs.json") or {}
    too_wide = attrs.get("too_wide", TOO_WIDE)
    return [
        Text(
            "Every closed form of the reference study against the simulator: "
            f"{attrs.get('replications')} replications from "
            f"seed {attrs.get('seed')}, {attrs.get('level', 0.95):.0%} simultaneous intervals "
            "(Bonferroni over "
            f"{len(table)}: {attrs.get('level_each', math.nan):.4f} each), run lengths "
            f"x{ctx.scale.theory_scale:g}. "
            f"A row whose half-width exceeds {too_wide:.0%} of its value is too wide to judge "
            "(neither pass nor "
            "fail); rows with a control are regression estimates on a statistic of known mean."
        ),
        theory_verdict(table, too_wide),
        Table(shown(table), "closed forms (theory) against the simulator's mean and interval"),
    ]


SECTION = Section("theory", "Theory: closed forms against the simulator", _inputs, _run, _report)
