"""``qlab study``: the whole reference study (../shared/docs/brief.md) as one resumable command, written up.

The study is a list of :class:`Section` s, run in order into ``DIR/sections/NAME/``:

theory, reference (hypotheses H1-H3), burst, estimation, stale (H4), cancellation, batching (H5), capacity (exercise 8),
live, live_stale, live_cancellation, configuration.

Each section has its inputs (everything that decides its results: the scaled sweep config, the
theory's replications, the live config); their digest goes into ``inputs.json`` when the section
starts and into ``done.json`` when it ends. A re-run skips a done section whose inputs did not change,
resumes an unfinished one (a sweep's finished cells, a live experiment's finished runs are kept), and
starts afresh one whose inputs changed (its folder is cleared: the old results answer another question).
The report (``report.md``, ``report.html`` and ``figures/``) is rebuilt from the sections' files on every
run, which takes seconds.

Hypotheses are judged from the numbers with 95 % Student-t intervals across seeds. Cells that differ
only in policy (or speed, or load) share their seed's random numbers, so a comparison is the interval
of the per-seed *difference* (paired by seed), which is narrower than two separate intervals.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import hashlib
import html
import importlib
import io
import json
import math
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pandas as pd

from analysis.metrics import _class_key, aggregate, mean_ci
from analysis.styles import policy_order
from analysis.objectives import parse_objectives, written
from inputs.argtypes import positive_int
from inputs.atomic import atomic_write, write_parquet

from .tables import pipe_table, table_cell

HERE = Path(__file__).resolve().parent
#: Bump when a section's computation changes, so that done sections are recomputed.
STUDY_VERSION = 1
#: H1: an unbounded queue has collapsed when, at the highest load, its share in time is below this.
COLLAPSED_SHARE = 0.2
POLICIES = ("none", "bounded", "bounded-deadline", "predictive")


# ------------------------------------------------------------------ scale


@dataclass(frozen=True)
class Scale:
    """How big the study is. None: each experiment file's own value (the reference sizes)."""

    name: str
    seeds: int | None = None  # seeds of every sweep (at most; a file with fewer keeps its own)
    duration_s: float | None = None  # simulated seconds of every sweep (at most)
    loads: tuple[float, ...] | None = None  # the reference sweep's loads
    theory_replications: int = 10
    theory_scale: float = 1.0
    live_policies: tuple[str, ...] = POLICIES
    live_loads: tuple[float, ...] = (1.0, 2.0)
    live_seconds: float = 40.0
    live_stale_seconds: float = 60.0  # each live stale-estimator run (the machine slows a third in)
    live_cut_policies: tuple[str, ...] = ("none", "predictive")  # live cutting at the deadline, off and on
    live_cut_loads: tuple[float, ...] = (1.5, 3.0)
    live_cut_seconds: float = 40.0
    # The batching sweep (H5) on its own scale: its cells are several times the reference sweep's work.
    batching_seeds: int | None = None
    batching_duration_s: float | None = None
    batching_loads: tuple[float, ...] | None = None
    capacity_tolerance: float = 0.02  # the capacity search's brackets, as a share of their load
    predict_seeds: int = 20  # seeds of the model-only prediction of each live run (qlab compare --predict)


FULL = Scale("full")
# Theory in the quick study: 10 replications of a tenth of the length. At the Bonferroni level (about 0.9987 each) the
# Student-t quantile with 4 degrees of freedom is 1.75 times that with 9, so 5 replications twice as long would give
# intervals 1.75 times wider for the same time. At this size the heavy-traffic waits (M/M/1 at rho 0.8 and 0.95,
# M/M/c at 0.9 and 0.95, the P-K rows, Erlang A's) are too wide to judge and the report says so; judging them all
# would take runs about 4 times as long (docs/study.md).
QUICK = Scale("quick", seeds=5, duration_s=300.0, loads=(0.5, 0.9, 1.3, 2.0, 3.0), theory_replications=10,
              theory_scale=0.1, live_policies=("bounded-deadline", "predictive"), live_loads=(2.0,), live_seconds=20.0,
              live_stale_seconds=10.0, live_cut_policies=("predictive",), live_cut_loads=(1.5,),
              live_cut_seconds=10.0, batching_seeds=4, batching_duration_s=60.0, batching_loads=(0.5, 1.3, 3.0),
              capacity_tolerance=0.02, predict_seeds=3)


@dataclass(frozen=True)
class Context:
    out: Path
    scale: Scale
    workers: int | None = None
    skip_live: bool = False
    log: Callable[[str], None] = print
    live_engine: str = "auto"  # the live pass's engine (LIVE_ENGINES)


# ------------------------------------------------------------------ report blocks


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Table:
    frame: pd.DataFrame
    caption: str = ""


@dataclass(frozen=True)
class Figure:
    name: str  # file name stem under figures/
    png: bytes
    caption: str = ""


@dataclass(frozen=True)
class Code:
    text: str


@dataclass(frozen=True)
class Failed:
    error: str


@dataclass(frozen=True)
class Verdict:
    label: str  # "H1", or "check"
    claim: str
    supported: bool | None  # None: the data cannot test it (say why in evidence)
    evidence: str

    @property
    def word(self) -> str:
        return {True: "supported", False: "not supported", None: "not testable"}[self.supported]


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    inputs: Callable[[Context], dict]  # what decides the results; {"unavailable": why} when it cannot run
    run: Callable[[Context, Path], None]  # write results into the folder (resuming what is there)
    report: Callable[[Context, Path], list]  # the blocks, read back from the folder


# ------------------------------------------------------------------ numbers with intervals


@dataclass(frozen=True)
class Est:
    """A mean over seeds and its 95 % interval."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, values) -> "Est":
        return cls(*mean_ci(values))

    def __str__(self) -> str:
        if math.isnan(self.low):
            return f"{self.mean:.3g}"
        return f"{self.mean:.3g} [{self.low:.3g}, {self.high:.3g}]"


def _select(table: pd.DataFrame, equal: dict) -> pd.DataFrame:
    mask = np.ones(len(table), dtype=bool)
    for key, value in equal.items():
        mask &= (table[key] == value).to_numpy()
    return table[mask]


def per_seed(table: pd.DataFrame, metric: str, **equal) -> pd.Series:
    """``metric`` of the cells matching ``equal``, one value per seed (averaged over any other axis)."""
    return _select(table, equal).groupby("seed")[metric].mean()


def level(table: pd.DataFrame, metric: str, **equal) -> Est:
    return Est.of(per_seed(table, metric, **equal))


def difference(table: pd.DataFrame, metric: str, a: dict, b: dict) -> Est:
    """Mean and interval of metric(a) - metric(b), paired by seed."""
    return Est.of((per_seed(table, metric, **a) - per_seed(table, metric, **b)).dropna())


def with_ci(frame: pd.DataFrame) -> pd.DataFrame:
    """Columns ``m``, ``m_low``, ``m_high`` shown as one column "mean [low, high]"; other columns as they are."""
    out = pd.DataFrame(index=frame.index)
    for col in frame.columns:
        if col.endswith(("_low", "_high")) and col.rsplit("_", 1)[0] in frame.columns:
            continue
        if f"{col}_low" in frame.columns and f"{col}_high" in frame.columns:
            out[col] = [str(Est(m, lo, hi)) if pd.notna(m) else "-"
                        for m, lo, hi in zip(frame[col], frame[f"{col}_low"], frame[f"{col}_high"])]
        else:
            out[col] = frame[col]
    return out.reset_index(drop=True)


# ------------------------------------------------------------------ folders and markers


def _digest(inputs: dict) -> str:
    text = json.dumps({"study_version": STUDY_VERSION, **inputs}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict) -> None:
    atomic_write(path, (json.dumps(data, indent=2, sort_keys=True, default=str) + "\n").encode())


def check_out(out: Path) -> None:
    """OUT must be a folder that is new, empty or a study's; never a file or another tool's folder."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "study.json").is_file():
        raise ValueError(f"--out {out}: a folder that is not a qlab study (no study.json); choose an empty or new one")


def run_section(ctx: Context, section: Section, force: bool = False) -> str:
    """Run one section unless it is done with these inputs; return what happened (for the log)."""
    folder = ctx.out / "sections" / section.name
    inputs = section.inputs(ctx)
    if "unavailable" in inputs:
        return f"not available: {inputs['unavailable']}"
    digest = _digest(inputs)
    done = _read_json(folder / "done.json")
    if not force and done is not None and done.get("digest") == digest:
        return "done before with the same inputs: skipped"
    started = _read_json(folder / "inputs.json")
    fresh = force or started is None or started.get("digest") != digest
    if fresh:
        shutil.rmtree(folder, ignore_errors=True)  # another question's results (or none): nothing to resume
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "done.json").unlink(missing_ok=True)
    _write_json(folder / "inputs.json", {"digest": digest, "inputs": inputs})
    section.run(ctx, folder)
    _write_json(folder / "done.json", {"digest": digest})
    return "ran" if fresh else "resumed and finished"


# ------------------------------------------------------------------ sweeps


def scaled(cfg, scale: Scale, loads: bool = False):
    """A sweep config cut to the scale: at most its seeds and seconds, and the scale's loads if asked."""
    changes = {}
    if scale.seeds is not None:
        changes["seeds"] = min(cfg.seeds, scale.seeds)
    if scale.duration_s is not None:
        changes["duration_s"] = min(cfg.duration_s, scale.duration_s)
    if loads and scale.loads is not None and "load" in cfg.grid:
        changes["grid"] = {**cfg.grid, "load": tuple(scale.loads)}
    return dataclasses.replace(cfg, **changes)


def _sweep_config(file: str, scale: Scale, loads: bool = False):
    from . import config

    return scaled(config.load(HERE / file), _own_scale(file, scale), loads or file == BATCHING_FILE)


#: The batching sweep (H5), scaled by the scale's batching fields.
BATCHING_FILE = "batching.toml"


def _own_scale(file: str, scale: Scale) -> Scale:
    if file != BATCHING_FILE:
        return scale
    return dataclasses.replace(scale, seeds=scale.batching_seeds, duration_s=scale.batching_duration_s,
                               loads=scale.batching_loads)


def _sweep_inputs(file: str, loads: bool = False) -> Callable[[Context], dict]:
    def inputs(ctx: Context) -> dict:
        from .config import ConfigError

        if not (HERE / file).is_file():
            return {"unavailable": f"experiments/{file} is not in this qlab"}
        try:
            cfg = _sweep_config(file, ctx.scale, loads)
        except ConfigError as exc:  # e.g. an axis this qlab's sweeps do not know yet
            return {"unavailable": f"experiments/{file} does not load here: {exc}"}
        return {"file": f"experiments/{file}", "config": cfg.canonical()}
    return inputs


def _sweep_run(file: str, loads: bool = False) -> Callable[[Context, Path], None]:
    def run(ctx: Context, folder: Path) -> None:
        from . import sweep

        sweep.run(_sweep_config(file, ctx.scale, loads), folder / "sweep", workers=ctx.workers, quiet=True)
    return run


def _summaries(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    path = folder / "sweep" / "summary.parquet"
    if not path.is_file():
        return None
    summary = pd.read_parquet(path)
    summary["share_late"] = summary["late"] / summary["requests"]
    return summary, pd.read_parquet(folder / "sweep" / "summary_by_class.parquet")


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _sweep_table(summary: pd.DataFrame, caption: str) -> Table:
    from .commands import summary_table

    return Table(summary_table(summary), caption)


def _not_run(folder: Path) -> list:
    return [Text(f"not available: no results in {folder} (the section did not run)")]


# ------------------------------------------------------------------ theory


def _theory_inputs(ctx: Context) -> dict:
    from analysis.validation import TOO_WIDE, standard_scenarios

    # The cases' names too: a changed set of closed forms is another question, to be run afresh.
    return {"replications": ctx.scale.theory_replications, "scale": ctx.scale.theory_scale, "seed": 1, "level": 0.95,
            "too_wide": TOO_WIDE, "cases": [s.name for s in standard_scenarios(ctx.scale.theory_scale)]}


def _theory_run(ctx: Context, folder: Path) -> None:
    from analysis.validation import check, standard_scenarios

    table = check(standard_scenarios(ctx.scale.theory_scale), replications=ctx.scale.theory_replications, seed=1,
                  level=0.95, workers=ctx.workers)
    _write_json(folder / "attrs.json", dict(table.attrs))
    write_parquet(table, folder / "theory.parquet")


def theory_verdict(table: pd.DataFrame, too_wide: float) -> Verdict:
    """The theory check: supported when every row is judged and passes, not supported when a judged row fails,
    not testable when none fails but some intervals are too wide to judge."""
    from analysis.validation import tally

    counts = tally(table)
    judged = counts["pass"] + counts["fail"]
    evidence = f"{counts['pass']} of {judged} judged closed-form values inside their simulated interval"
    if counts["fail"]:
        failed = table[table["verdict"] == "fail"]
        evidence += "; outside: " + ", ".join(f"{c} {q}" for c, q in zip(failed["case"], failed["quantity"]))
    if counts["too wide"]:
        wide = table[table["verdict"] == "too wide"]
        evidence += (f"; {counts['too wide']} of {len(table)} intervals too wide to judge (half-width over "
                     f"{too_wide:.0%} of the value: " + ", ".join(f"{c} {q}" for c, q in zip(wide["case"], wide["quantity"]))
                     + ")")
    supported = False if counts["fail"] else (None if counts["too wide"] else True)
    return Verdict("check", "the simulator agrees with every closed form", supported, evidence)


def _theory_report(ctx: Context, folder: Path) -> list:
    from analysis.validation import TOO_WIDE, shown

    if not (folder / "theory.parquet").is_file():
        return _not_run(folder)
    table = pd.read_parquet(folder / "theory.parquet")
    attrs = _read_json(folder / "attrs.json") or {}
    too_wide = attrs.get("too_wide", TOO_WIDE)
    return [
        Text(f"Every closed form of the brief against the simulator: {attrs.get('replications')} replications from "
             f"seed {attrs.get('seed')}, {attrs.get('level', 0.95):.0%} simultaneous intervals (Bonferroni over "
             f"{len(table)}: {attrs.get('level_each', math.nan):.4f} each), run lengths x{ctx.scale.theory_scale:g}. "
             f"A row whose half-width exceeds {too_wide:.0%} of its value is too wide to judge (neither pass nor "
             "fail); rows with a control are regression estimates on a statistic of known mean."),
        theory_verdict(table, too_wide),
        Table(shown(table), "closed forms (theory) against the simulator's mean and interval"),
    ]


# ------------------------------------------------------------------ the reference sweep and H1-H3


def _split_loads(summary: pd.DataFrame, speed: float) -> tuple[list[float], list[float]]:
    loads = sorted(summary.loc[summary["speed"] == speed, "load"].dropna().unique())
    return [v for v in loads if v <= 1], [v for v in loads if v > 1]


def hypothesis_1(summary: pd.DataFrame) -> tuple[Verdict, pd.DataFrame]:
    """H1: the unbounded queue collapses past capacity (goodput falls below its value at capacity)."""
    claim = "the unbounded queue (none) collapses beyond capacity"
    rows, evidence, ok = [], [], True
    for speed in sorted(summary["speed"].unique()):
        under, over = _split_loads(summary, speed)
        if not under or not over:
            why = f"speed x{speed:g} lacks a load at or below 1 or one above"
            return Verdict("H1", claim, None, why), pd.DataFrame()
        # Its best at or below capacity (at load 1 itself an unbounded queue is already unstable).
        best = max(under, key=lambda v: level(summary, "goodput_rps", policy="none", speed=speed, load=v).mean)
        ref = {"policy": "none", "speed": speed, "load": best}
        for load in over:
            here = {"policy": "none", "speed": speed, "load": load}
            drop = difference(summary, "goodput_rps", here, ref)
            ok &= drop.high < 0
            rows.append({"speed": speed, "load": load, "share in time": str(level(summary, "share_good", **here)),
                         "goodput (requests/s)": str(level(summary, "goodput_rps", **here)),
                         f"goodput minus at load {best:g}": str(drop)})
        top = {"policy": "none", "speed": speed, "load": over[-1]}
        share = level(summary, "share_good", **top)
        ok &= share.high < COLLAPSED_SHARE
        evidence.append(f"service x{speed:g}: at load {over[-1]:g} none answers {share} of requests in time "
                        f"(collapsed: below {COLLAPSED_SHARE:g}); goodput {level(summary, 'goodput_rps', **top)} "
                        f"requests/s against its best at or below capacity, {level(summary, 'goodput_rps', **ref)} "
                        f"at load {best:g}, difference {difference(summary, 'goodput_rps', top, ref)}")
    return Verdict("H1", claim, ok, "; ".join(evidence)), pd.DataFrame(rows)


def hypothesis_2(summary: pd.DataFrame) -> tuple[Verdict, pd.DataFrame]:
    """H2: a bound on the count of waiting requests does not bound their wait when the machine is slower."""
    claim = "a count bound (bounded, 8 waiting) does not bound the wait across speeds"
    speeds = sorted(summary["speed"].unique())
    if len(speeds) < 2:
        return Verdict("H2", claim, None, "the sweep has one speed"), pd.DataFrame()
    fast, slow = speeds[0], speeds[-1]
    over = sorted(set(_split_loads(summary, fast)[1]) & set(_split_loads(summary, slow)[1]))
    if not over:
        return Verdict("H2", claim, None, "no load beyond capacity at both speeds"), pd.DataFrame()
    deadline = float(summary.loc[summary["policy"] == "bounded", "deadline_s"].iloc[0])
    rows, ok = [], True
    for load in over:
        a, b = {"policy": "bounded", "speed": slow, "load": load}, {"policy": "bounded", "speed": fast, "load": load}
        p99, late = difference(summary, "latency_p99_s", a, b), difference(summary, "share_late", a, b)
        ok &= p99.low > 0 and late.low > 0
        rows.append({"load": load, f"p99 latency (s) x{fast:g}": str(level(summary, "latency_p99_s", **b)),
                     f"p99 latency (s) x{slow:g}": str(level(summary, "latency_p99_s", **a)),
                     "p99 difference": str(p99),
                     f"share late x{fast:g}": str(level(summary, "share_late", **b)),
                     f"share late x{slow:g}": str(level(summary, "share_late", **a)),
                     "share late difference": str(late)})
    top = rows[-1]
    evidence = (f"at load {over[-1]:g} bounded's p99 latency of the answered is {top[f'p99 latency (s) x{fast:g}']} s "
                f"at service x{fast:g} and {top[f'p99 latency (s) x{slow:g}']} s at x{slow:g} (difference "
                f"{top['p99 difference']} s; the deadline is {deadline:g} s), and its share late goes from "
                f"{top[f'share late x{fast:g}']} to {top[f'share late x{slow:g}']}; the p99 and the share late "
                f"rise at every load beyond capacity: {'yes' if ok else 'no'}")
    return Verdict("H2", claim, ok, evidence), pd.DataFrame(rows)


def hypothesis_3(summary: pd.DataFrame, by_class: pd.DataFrame) -> tuple[Verdict, list[pd.DataFrame]]:
    """H3: predictive beats deadline expiry beyond capacity, and does so by serving the short requests."""
    claim = ("predictive beats deadline expiry (bounded-deadline) in goodput and share in time beyond capacity, "
             "by preferring short requests")
    pred, bd = {"policy": "predictive"}, {"policy": "bounded-deadline"}
    rows, classes, evidence, ok = [], [], [], True
    for speed in sorted(summary["speed"].unique()):
        over = _split_loads(summary, speed)[1]
        if not over:
            return Verdict("H3", claim, None, f"no load beyond capacity at speed x{speed:g}"), [pd.DataFrame()] * 2
        for load in over:
            at = {"speed": speed, "load": load}
            diffs = {m: difference(summary, m, {**pred, **at}, {**bd, **at})
                     for m in ("goodput_rps", "share_good", "good_tokens_per_s")}
            ok &= diffs["goodput_rps"].low > 0 and diffs["share_good"].low > 0
            rows.append({"speed": speed, "load": load, **{f"{m} predictive minus bounded-deadline": str(d)
                                                          for m, d in diffs.items()}})
        at = {"speed": speed, "load": over[-1]}
        labels = sorted(by_class.loc[by_class["speed"] == speed, "size_class"].unique(), key=_class_key)
        gain = {c: per_seed(by_class, "share_good", **pred, **at, size_class=c)
                - per_seed(by_class, "share_good", **bd, **at, size_class=c) for c in labels}
        short_first = Est.of((gain[labels[0]] - gain[labels[-1]]).dropna())
        ok &= short_first.low > 0
        for c in labels:
            classes.append({"speed": speed, "load": over[-1], "size class": c,
                            "predictive share in time": str(level(by_class, "share_good", **pred, **at, size_class=c)),
                            "bounded-deadline share in time": str(level(by_class, "share_good", **bd, **at,
                                                                        size_class=c)),
                            "difference": str(Est.of(gain[c].dropna()))})
        last = rows[-1]
        evidence.append(f"service x{speed:g}, load {over[-1]:g}, predictive minus bounded-deadline: goodput "
                        f"{last['goodput_rps predictive minus bounded-deadline']} requests/s, share in time "
                        f"{last['share_good predictive minus bounded-deadline']}, good tokens/s "
                        f"{last['good_tokens_per_s predictive minus bounded-deadline']}; its gain in share in time for "
                        f"size {labels[0]} exceeds that for size {labels[-1]} by {short_first}")
    return Verdict("H3", claim, ok, "; ".join(evidence)), [pd.DataFrame(rows), pd.DataFrame(classes)]


def _reference_report(ctx: Context, folder: Path) -> list:
    from analysis import plots
    from . import sweep
    from .commands import _cdf_load

    tables = _summaries(folder)
    if tables is None:
        return _not_run(folder)
    summary, by_class = tables
    seeds, seconds = summary["seed"].nunique(), summary["duration_s"].max()
    v1, t1 = hypothesis_1(summary)
    v2, t2 = hypothesis_2(summary)
    v3, (t3, t3c) = hypothesis_3(summary, by_class)
    load = _cdf_load(summary)
    speed = sorted(summary["speed"].unique())[0]
    rows = sweep.load_rows(folder / "sweep", load=load, speed=speed)
    return [
        Text(f"Every policy at loads {', '.join(f'{v:g}' for v in sorted(summary['load'].unique()))} (utilisation at "
             f"the simulated speed), at the calibrated speed and with service times x"
             f"{', x'.join(f'{v:g}' for v in sorted(summary['speed'].unique()))}; {seeds} seeds of {seconds:g} "
             "simulated seconds. Differences are paired by seed (common random numbers). A policy can raise "
             "request goodput by serving cheap requests, so good tokens/s is shown beside it."),
        v1, Table(t1, "H1: the unbounded queue beyond capacity"),
        v2, Table(t2, "H2: bounded at the two speeds"),
        v3, Table(t3, "H3: predictive minus bounded-deadline beyond capacity"),
        Table(t3c, "H3: share in time by size class at the highest load"),
        *(Figure(f"reference_policies_x{v:g}", _png(plots.policy_comparison(summary, by_class, speed=v)),
                 f"service times x{v:g}: good tokens/s and share in time against load, and by size class at the "
                 "highest load") for v in sorted(summary["speed"].unique())),
        Figure("reference_share_in_time", _png(plots.share_in_time(summary)), "share in time against load"),
        Figure("reference_goodput", _png(plots.goodput(summary)), "goodput against load"),
        Figure("reference_share_by_class", _png(plots.share_by_class(by_class)), "share in time by size class"),
        Figure("reference_outcomes", _png(plots.outcome_bars(summary)), "outcomes by policy and load"),
        Figure("reference_latency_cdf", _png(plots.latency_cdf(rows, float(summary["deadline_s"].mode().iloc[0]))),
               f"latency of the answered at load {load:g}, service x{speed:g}"),
        _sweep_table(summary, "the sweep: mean over seeds ± 95 % CI half-width"),
    ]


# ------------------------------------------------------------------ the burst of 30


BURST = {"sweep": {"name": "burst30", "arrivals": "burst:30", "duration_s": 1.0, "seeds": 20},
         "grid": {"policy": list(POLICIES), "engines": [1, 3]}}  # a burst of its own size: no load


def _burst_config(scale: Scale):
    from . import config

    return scaled(config.parse(BURST, "<study burst>"), dataclasses.replace(scale, duration_s=None))


def _burst_inputs(ctx: Context) -> dict:
    return {"config": _burst_config(ctx.scale).canonical()}


def _burst_run(ctx: Context, folder: Path) -> None:
    from . import sweep

    sweep.run(_burst_config(ctx.scale), folder / "sweep", workers=ctx.workers, quiet=True)


def _burst_report(ctx: Context, folder: Path) -> list:
    tables = _summaries(folder)
    if tables is None:
        return _not_run(folder)
    summary = tables[0].assign(accepted=lambda t: t["requests"] - t["rejected"])
    columns = ["accepted", "rejected", "expired", "good", "late"]
    agg = aggregate(summary, ["engines", "policy"], columns)
    spread = summary.groupby(["engines", "policy"])["accepted"].agg(["min", "max"]).reset_index()
    shown = with_ci(agg.drop(columns="n")).merge(spread.rename(columns={"min": "accepted min", "max": "accepted max"}))
    bounded = summary[summary["policy"] == "bounded"]
    expected = (bounded["engines"] + bounded["max_queue"]).astype(int)
    right = bool((bounded["accepted"] == expected).all())
    seen = ", ".join(f"{k} engine(s): {sorted(set(part['accepted'].astype(int)))}"
                     for k, part in bounded.groupby("engines"))
    return [
        Text(f"30 requests arrive at once ({summary['seed'].nunique()} seeds of sizes). A request admitted to an idle "
             "engine is in service from that instant: with K engines and at most 8 waiting, bounded accepts K + 8 "
             "(the brief's trap: counting those that start at once as waiting admits too few, or too many)."),
        Verdict("check", "bounded accepts exactly K + 8 of a burst of 30", right,
                f"accepted by bounded, per seed: {seen} (expected {', '.join(map(str, sorted(set(expected))))})"),
        Table(shown, "a burst of 30 per policy and number of engines: mean [95 % CI] over seeds"),
    ]


# ------------------------------------------------------------------ estimation, stale, cancellation


def _analysis(name: str):
    """analysis.estimation.NAME and analysis.plots.NAME-like callables, or the reason they are missing."""
    try:
        module = importlib.import_module("analysis.estimation")
    except ModuleNotFoundError as exc:
        if exc.name != "analysis.estimation":
            raise
        return None, "analysis.estimation is not in this qlab"
    fn = getattr(module, name, None)
    return (fn, None) if fn is not None else (None, f"analysis.estimation has no {name}")


def _figure_of(name: str, summary: pd.DataFrame, caption: str) -> list:
    from analysis import plots

    draw = getattr(plots, name, None)
    if draw is None:
        return [Text(f"figure not available: analysis.plots has no {name}")]
    return [Figure(name, _png(draw(summary)), caption)]


def _experiment_report(name: str, table_fn: str, what: str) -> Callable[[Context, Path], list]:
    def report(ctx: Context, folder: Path) -> list:
        tables = _summaries(folder)
        if tables is None:
            return _not_run(folder)
        summary = tables[0]
        fn, why = _analysis(table_fn)
        blocks = [Text(f"{what} {summary['seed'].nunique()} seeds of {summary['duration_s'].max():g} simulated s.")]
        blocks.append(Table(with_ci(fn(summary)), f"{name}: mean [95 % CI] over seeds") if fn is not None
                      else Text(f"table not available ({why}); the sweep's summary follows"))
        blocks += _figure_of(name, summary, name)
        blocks.append(_sweep_table(summary, f"the {name} sweep: mean over seeds ± 95 % CI half-width"))
        return blocks
    return report


def hypothesis_4(stale: pd.DataFrame | None, estimation: pd.DataFrame | None) -> tuple[Verdict, pd.DataFrame]:
    """H4: not knowing costs: a stale estimate lets late work in, an estimate from the limit turns fitting work away."""
    claim = ("the estimator's knowledge costs: after a slowdown a fixed estimate lets deadline-aware policies start "
             "work they cannot finish, and an estimate from the limit refuses work that would have fit")
    need = {"stale": (stale, ("fixed_estimate", "late_share_of_completed")),
            "estimation": (estimation, ("estimator", "goodput_rps"))}
    for what, (table, columns) in need.items():
        if table is None or not set(columns) <= set(table.columns):
            return Verdict("H4", claim, None, f"the {what} sweep's results (columns {', '.join(columns)}) are not "
                                              "available"), pd.DataFrame()
    rows, ok, evidence = [], True, []
    for policy in sorted(stale["policy"].unique()):
        d = difference(stale, "late_share_of_completed", {"policy": policy, "fixed_estimate": True},
                       {"policy": policy, "fixed_estimate": False})
        ok &= d.low > 0
        rows.append({"experiment": "stale", "policy": policy, "comparison": "fixed minus tracking estimate",
                     "metric": "late share of completed", "difference": str(d)})
        evidence.append(f"{policy}: late share of completed, fixed minus tracking {d}")
    for load in [v for v in sorted(estimation["load"].unique()) if v > 1]:
        at = {"load": load}
        d = difference(estimation, "goodput_rps", {**at, "estimator": "learned"}, {**at, "estimator": "limit"})
        ok &= d.low > 0
        rows.append({"experiment": "estimation", "policy": "predictive",
                     "comparison": f"learned minus limit, load {load:g}", "metric": "goodput (requests/s)",
                     "difference": str(d)})
        evidence.append(f"load {load:g}: goodput learned minus limit {d} requests/s")
    return Verdict("H4", claim, ok, "; ".join(evidence)), pd.DataFrame(rows)


def _stale_report(ctx: Context, folder: Path) -> list:
    blocks = _experiment_report("stale", "stale_table", "The machine slows during the run; tracking versus a fixed "
                                "estimate for the deadline-aware policies,")(ctx, folder)
    stale, estimation = _summaries(folder), _summaries(folder.parent / "estimation")
    verdict, table = hypothesis_4(None if stale is None else stale[0], None if estimation is None else estimation[0])
    return [verdict, Table(table, "H4: paired differences by seed")] + blocks


# ------------------------------------------------------------------ a batching engine: H5

#: Rules that know the batch and the memory, and the baselines H5 holds them against (a count bound and the
#: engine's own caps); the others in the sweep are shown beside them.
KNOWING = ("predictive", "predictive-kv")
BASELINES = ("bounded", "vllm-caps")


def hypothesis_5(summary: pd.DataFrame) -> tuple[Verdict, pd.DataFrame]:
    """H5: on a batching engine, admission that knows the batch and the memory keeps goodput beyond capacity where
    a count bound and the engine's own caps do not."""
    claim = ("on a batching engine, an admission rule that knows the batch and the memory (predictive, predictive-kv) "
             "keeps goodput beyond capacity where a count bound (bounded) and the engine's own caps (vllm-caps) do not")
    present = set(summary["policy"])
    missing = [p for p in (*KNOWING, *BASELINES) if p not in present]
    over = sorted(v for v in summary["load"].unique() if v > 1)
    if missing or not over:
        why = f"the sweep lacks {', '.join(missing)}" if missing else "the sweep has no load beyond capacity"
        return Verdict("H5", claim, None, why), pd.DataFrame()
    rows, ok, evidence = [], True, []
    for load in over:
        for knowing in KNOWING:
            row = {"load": load, "policy": knowing,
                   "goodput (requests/s)": str(level(summary, "goodput_rps", policy=knowing, load=load))}
            for base in (*BASELINES, *sorted(present - set(KNOWING) - set(BASELINES) - {"none"})):
                d = difference(summary, "goodput_rps", {"policy": knowing, "load": load}, {"policy": base, "load": load})
                if base in BASELINES:
                    ok &= d.low > 0
                row[f"minus {base}"] = str(d)
            rows.append(row)
    top = over[-1]
    at = {"load": top}
    capacity = float(summary["capacity_rps"].iloc[0])
    admitted = summary.assign(late_of_answered=summary["late"] / (summary["good"] + summary["late"]))
    evidence.append(f"at load {top:g} (capacity {capacity:.3g} requests/s) goodput is " + ", ".join(
        f"{p} {level(summary, 'goodput_rps', policy=p, **at)}" for p in policy_order(summary["policy"].unique())))
    evidence.append("predictive minus " + ", ".join(
        f"{b} {difference(summary, 'goodput_rps', {'policy': 'predictive', **at}, {'policy': b, **at})}"
        for b in BASELINES) + " requests/s, paired by seed")
    evidence.append(f"predictive-kv minus predictive {difference(summary, 'goodput_rps', {'policy': 'predictive-kv', **at}, {'policy': 'predictive', **at})}"
                    ": what admitting by memory adds to the time projection here")
    evidence.append("in good tokens/s (what a request goodput can hide: refusing the long requests raises it) " + ", ".join(
        f"{p} {level(summary, 'good_tokens_per_s', policy=p, **at)}" for p in (*KNOWING, *BASELINES, "llm-d-shed")
        if p in present))
    evidence.append(f"of what predictive answered at load {top:g}, {level(admitted, 'late_of_answered', policy='predictive', **at)} "
                    "missed an objective (the projection is an estimate: it cannot see what arrives after it decides)")
    return Verdict("H5", claim, ok, "; ".join(evidence)), pd.DataFrame(rows)


def _batching_report(ctx: Context, folder: Path) -> list:
    from analysis import plots

    tables = _summaries(folder)
    if tables is None:
        return _not_run(folder)
    summary = tables[0]
    verdict, table = hypothesis_5(summary)
    slo = summary["ttft_slo_s"].dropna().unique() if "ttft_slo_s" in summary else []
    objective = f" with its first token within {slo[0]:g} s" if len(slo) else ""
    return [
        Text(f"One batching engine (experiments/batching.toml: vLLM's limits, chunked prefill, KV memory in blocks) "
             f"at loads {', '.join(f'{v:g}' for v in sorted(summary['load'].unique()))} of its saturated throughput; "
             f"{summary['seed'].nunique()} seeds of {summary['duration_s'].max():g} simulated seconds. A request is "
             f"good when answered within its deadline{objective} (DistServe's goodput). Differences are paired by "
             "seed."),
        verdict, Table(table, "H5: goodput beyond capacity, and each rule that knows the batch minus the others"),
        Figure("batching_goodput_vs_refused", _png(plots.goodput_vs_refused(summary)),
               "goodput against the share refused, one point per load"),
        Figure("batching_goodput", _png(plots.goodput(summary)), "goodput against load"),
        _sweep_table(summary, "the batching sweep: mean over seeds ± 95 % CI half-width"),
    ]


# ------------------------------------------------------------------ capacity (exercise 8)


#: Exercise 8: the highest load at which each policy answers 90 % of requests in time, under Poisson arrivals and
#: under a burst every 10 s at the same load (the requests a constant rate sends in 10 s, at once).
CAPACITY_OBJECTIVE = "share_good>=0.9"
CAPACITY_ARRIVALS = {"poisson": "Poisson", "periodic:10": "a burst every 10 s"}
#: The search's seeds and seconds at the reference sizes; a reduced scale's cut them, as they cut every sweep.
CAPACITY_SEEDS, CAPACITY_SECONDS = 10, 600.0


def _capacity_search(scale: Scale):
    from . import capacity

    seeds = CAPACITY_SEEDS if scale.seeds is None else min(CAPACITY_SEEDS, scale.seeds)
    seconds = CAPACITY_SECONDS if scale.duration_s is None else min(CAPACITY_SECONDS, scale.duration_s)
    cfg = capacity.search_config(list(POLICIES), list(CAPACITY_ARRIVALS), seconds=seconds, seeds=seeds,
                                 where="<study capacity>")
    return capacity.Search(cfg, parse_objectives(CAPACITY_OBJECTIVE),
                           capacity.Bounds(tolerance=scale.capacity_tolerance))


def _capacity_inputs(ctx: Context) -> dict:
    spec = _capacity_search(ctx.scale)
    return {"config": spec.config.canonical(), "objective": written(spec.objective), "level": spec.level,
            "bounds": dataclasses.asdict(spec.bounds)}


def _capacity_run(ctx: Context, folder: Path) -> None:
    from . import capacity

    capacity.run(_capacity_search(ctx.scale), folder / "sweep", workers=ctx.workers)


def capacity_table(results: list[dict], bounds: dict) -> pd.DataFrame:
    """A row per policy: its capacity [95 % interval] and the rate it is, under each arrival process."""
    from .capacity import Bounds, shown

    rows: dict[str, dict] = {}
    for r in results:
        what = CAPACITY_ARRIVALS.get(r["arrivals"], r["arrivals"])
        text = shown(r, Bounds(**bounds))
        row = rows.setdefault(r["policy"], {"policy": r["policy"]})
        row[f"{what}: capacity [95 % interval]"] = f"{text['capacity']} {text['95 % interval']}"
        row[f"{what}: requests/s"] = text["requests/s"]
    return pd.DataFrame(list(rows.values()))


def _capacity_report(ctx: Context, folder: Path) -> list:
    from .commands import _capacity_figure

    data = _read_json(folder / "sweep" / "capacity.json")
    if data is None:
        return _not_run(folder)
    summary = pd.read_parquet(folder / "sweep" / "summary.parquet")
    bounds = data["bounds"]
    return [
        Text(f"Exercise 8: the highest load at which each policy answers 90 % of requests within the deadline "
             f"({data['objective']}, the mean over {data['seeds']} seeds of {data['duration_s']:g} simulated s), under "
             "Poisson arrivals and under a burst every 10 s at the same load (each burst is the requests a constant "
             "rate would send in its 10 s, sent at once; the same seeds, so the same requests, at every load and for "
             "every policy). This is DistServe's goodput: the highest rate at which 90 % of requests meet their "
             "objective. qlab capacity searches it by bracketing and bisection on the seeds' mean until each bracket "
             f"is narrower than {bounds['tolerance']:.0%} of its load. The 95 % interval runs from the last load at "
             "which the seeds' t-interval of the share in time lay wholly above 0.9 to the first at which it lay "
             "wholly below (test inversion). Requests/s is the capacity times the requests/s one engine serves at "
             "the calibrated speed."),
        Table(capacity_table(data["results"], bounds), "capacity: the highest load answering 90 % in time"),
        Figure("capacity", _png(_capacity_figure(folder / "sweep", summary)["capacity"]),
               "share in time at every load the search tried (mean and 95 % band over the seeds), each policy's "
               "capacity (diamond) and its 95 % interval (bar) on the 0.9 line, per arrival process"),
    ]


# ------------------------------------------------------------------ live


def _live_data(ctx: Context) -> dict:
    """The live experiment as a ``qlab live`` TOML document: short, on vLLM where it is installed (the vLLM issue's
    reference engine; ``--live-engine``), else on the synthetic engine (GPT-2 on CUDA). vLLM's server is started for
    the run (:func:`_live_run`): the document says its shape and package (the inputs' digest), not its port."""
    server = {"engine": "synthetic", "policies": list(ctx.scale.live_policies), "startup_timeout_s": 180}
    data = {"probe": {"requests": 3}}
    if _live_engine(ctx) == "vllm":
        from live import vllm_server

        server.update(engine="upstream", batching=True, max_num_seqs=vllm_server.ServerSpec.max_num_seqs)
        data["calibrate"] = {"rounds": 1, "per_size": 4}
        data["vllm"] = {"package": vllm_server.PACKAGE, "shape": VLLM_SHAPE}
    elif _cuda():
        server.update(engine="gpt2", model="random", device="cuda")
        data["calibrate"] = {"rounds": 1, "per_size": 4}
    data["server"] = server
    data["trace"] = [{"name": "poisson", "arrivals": "poisson", "nominal_load": list(ctx.scale.live_loads),
                      "seconds": ctx.scale.live_seconds, "seed": 1},
                     {"name": "burst30", "arrivals": "burst:30", "seed": 1}]
    return data


#: The local model vLLM serves in the study (live.vllm_server: tiny, 4 layers x 256).
VLLM_SHAPE = "tiny"
#: ``--live-engine``: auto takes vLLM where its venv has it (live.vllm_server.installed), else the synthetic engine.
LIVE_ENGINES = ("auto", "vllm", "synthetic")


def _live_engine(ctx: Context) -> str:
    if ctx.live_engine != "auto":
        return ctx.live_engine
    return "vllm" if _vllm_installed() else "synthetic"


@functools.lru_cache(maxsize=1)
def _vllm_installed() -> bool:
    from live import vllm_server

    return vllm_server.installed()


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _live_inputs(ctx: Context) -> dict:
    return _skippable("live", lambda c: {"live": _live_data(c)})(ctx)


def _live_run(ctx: Context, folder: Path) -> None:
    from live import live_config

    from . import live_runner

    data = _live_data(ctx)
    with _vllm_for(data, folder, ctx):
        cfg = live_config.parse(data, str(folder / "live.toml"))
        live_runner.run(cfg, folder / "live", log=lambda line: ctx.log(f"  live: {line}"))


@contextlib.contextmanager
def _vllm_for(data: dict, folder: Path, ctx: Context) -> Iterator[None]:
    """Where the live document says vLLM (its ``vllm`` key, taken out), a vLLM server for the block,
    its URL the server's upstream; otherwise nothing."""
    said = data.pop("vllm", None)
    if said is None:
        yield
        return
    from live import vllm_server

    python = vllm_server.install()
    spec = vllm_server.ServerSpec(vllm_server.model(python, said["shape"]))
    ctx.log(f"  live: starting vLLM ({spec.model.name}; 1-3 minutes)")
    with vllm_server.serving(spec, folder / "vllm.log", python) as url:
        data["server"]["upstream_url"] = url
        yield


#: The columns a live run's model-only prediction adds beside its per-request replay (metric: column).
PREDICTION_COLUMNS = {"share_good": "predicted share in time, rel. error", "goodput_rps": "predicted goodput, rel. error",
                      "latency_p99_s": "predicted p99 latency, rel. error"}


def _prediction(run: pd.DataFrame, seeds: int) -> dict:
    """A live run's model-only prediction (``qlab compare --predict``: its arrivals and the calibrated model alone),
    as report columns: the relative error of each judged metric, and whether all are within their targets."""
    from analysis.prediction import predict

    judged = predict(run, seeds=seeds)
    return {**{column: float(judged.table.loc[m, "relative_error"]) for m, column in PREDICTION_COLUMNS.items()},
            "prediction": judged.verdict()}


def _prediction_verdict(rows: list[dict], seeds: int) -> Verdict:
    """Whether the model alone predicted every live run within the targets, with the worst error of each metric."""
    from analysis.prediction import PREDICTION_TARGETS

    judged = [r for r in rows if r.get("prediction") in ("PASS", "MISS")]
    worst = "; ".join(f"{column.split(',')[0]} worst {max(abs(r[column]) for r in judged):.1%} "
                      f"(target {PREDICTION_TARGETS[m]:.0%})" for m, column in PREDICTION_COLUMNS.items()) if judged else ""
    passed = sum(r["prediction"] == "PASS" for r in judged)
    return Verdict("check", "the simulator predicts each live run from its arrivals and the calibrated model alone "
                            "(share in time and goodput within 5 %, p99 latency within 10 %)",
                   None if not judged else passed == len(judged),
                   f"{passed} of {len(judged)} runs within every target over {seeds} seeds of the model's noise"
                   + (f"; {worst}" if worst else "") + " (the per-request replay, exact by construction, cannot tell "
                   "whether the model is right; this can)")


def _live_report(ctx: Context, folder: Path) -> list:
    path = folder / "live" / "summary.parquet"
    if not path.is_file():
        return _not_run(folder)
    from analysis import compare

    summary = pd.read_parquet(path)
    judged = (summary["requests"] - summary["error"]).sum()
    share = summary["sim_disagreements"].sum() / judged if judged else math.nan
    inputs = (_read_json(folder / "inputs.json") or {}).get("inputs", {}).get("live", {})
    engine = inputs.get("server", {}).get("engine", "synthetic")
    if "vllm" in inputs:  # the reference engine: vLLM itself behind a batching upstream gate
        engine = (f"vLLM ({inputs['vllm']['package']}, GPT-2 {inputs['vllm']['shape']} shape with random weights; "
                  "the gate an upstream batching one) as the")
    cols = ["trace", "policy", "nominal_load", "effective_load", "requests", "good", "late", "rejected", "expired",
            "error", "goodput_rps", "sim_disagreements", "sim_disagreement_rate", *CAUSE_COLUMNS]
    cols = [c for c in cols if c in summary.columns]  # a summary from before the causes were counted lacks them
    blocks = [
        Text(f"Each trace under each policy against a resident `qlab serve` ({engine} engine), order rotated, a speed "
             "probe before and after each run; then each run replayed in the simulator with what the gate knew, "
             "request by request (`qlab compare`), and predicted from its arrivals and the calibrated model alone "
             f"(`qlab compare --predict`, {ctx.scale.predict_seeds} seeds of the model's noise)."),
        Verdict("check", "the simulator and the service agree request by request",
                None if not judged else bool(share <= 0.05),
                f"{int(summary['sim_disagreements'].sum())} of {int(judged)} requests disagree ({share:.1%}; the "
                "reference study found about 1.6 %; judged against 5 %)"),
        *_rule_verdict(summary.to_dict("records")),
    ]
    keys = list(zip(summary["trace"], summary["policy"]))
    runs = {key: pd.read_parquet(folder / "live" / "runs" / f"{key[0]}__{key[1]}.parquet") for key in keys}
    predicted = pd.DataFrame([_prediction(runs[key], ctx.scale.predict_seeds) for key in keys])
    blocks += [_prediction_verdict(predicted.to_dict("records"), ctx.scale.predict_seeds),
               Table(pd.concat([summary[cols].reset_index(drop=True), predicted], axis=1),
                     "live runs: their per-request disagreement with the simulator, and the model-only prediction's "
                     "relative error (simulated mean minus live, over live)")]
    for _, row in summary[summary["trace"] != "burst30"].iterrows():
        run = runs[(row["trace"], row["policy"])]
        png = folder / f"compare-{row['trace']}__{row['policy']}.png"
        compare.figure(compare.compare(run), png)
        blocks.append(Figure(png.stem, png.read_bytes(), f"simulator against service, {row['policy']} at nominal load "
                                                         f"{row['nominal_load']:g}"))
    return blocks


# ------------------------------------------------------------------ live: a stale estimator, cutting at the deadline

#: A live section's servers start together (seconds each, in parallel) and its runs go one after another. The
#: run of cell i begins LIVE_LEAD_S + i x (its seconds + LIVE_DRAIN_S) after its server's start (the engine's
#: clock), and its speed schedule steps a third of the way into that: a speed schedule counts from the server's
#: start. A run that begins late (the one before it drained slowly) slows earlier in its run; the report reads
#: the step on each run's clock back from its run file, so it says where it fell.
LIVE_LEAD_S = 5.0
LIVE_DRAIN_S = 4.0  # a run outlasts its arrivals by its drain and the replay's own start and end: 1.5-2.5 s seen
SLOWDOWN = 2.2  # as experiments/stale.toml


def _skippable(name: str, data: Callable[[Context], dict]) -> Callable[[Context], dict]:
    """A live section's inputs; with --skip-live, those of a pass finished earlier (reported, not run again)."""
    def inputs(ctx: Context) -> dict:
        if ctx.skip_live:
            folder = ctx.out / "sections" / name
            done, started = _read_json(folder / "done.json"), _read_json(folder / "inputs.json")
            if done and started and done.get("digest") == started.get("digest"):
                return started["inputs"]
            return {"unavailable": "skipped (--skip-live)"}
        return data(ctx)
    return inputs


def _stale_cells(ctx: Context) -> dict:
    seconds = ctx.scale.live_stale_seconds
    pairs = [(policy, fixed) for policy in ("bounded-deadline", "predictive") for fixed in (False, True)]
    cells = []
    for i, (policy, fixed) in enumerate(pairs):
        lead = LIVE_LEAD_S + i * (seconds + LIVE_DRAIN_S)
        cells.append({"name": f"{policy}__{'fixed' if fixed else 'tracking'}", "seconds": seconds, "load": 0.9,
                      "seed": 1, "early_stops": False, "lead_s": lead,
                      "options": {"policy": policy, "speed_schedule": f"{lead + seconds / 3:g}:{SLOWDOWN:g}",
                                  "fixed_estimate": fixed}})
    return {"cells": cells}


def _cut_cells(ctx: Context) -> dict:
    # Early stops (as experiments/cancellation.toml): the estimate from the limit is right only on average, so
    # the runs that go to their limit pass their deadline and there is something to cut; the seed is the engine's.
    cells = [{"name": f"{policy}__load{load:g}__{'cut' if cut else 'nocut'}", "seconds": ctx.scale.live_cut_seconds,
              "load": load, "seed": 1, "early_stops": True, "lead_s": 0.0,
              "options": {"policy": policy, "early_stops": True, "seed": 1,
                          "policy_arg": "cancel_at_deadline=true" if cut else ""}}
             for policy in ctx.scale.live_cut_policies for load in ctx.scale.live_cut_loads for cut in (False, True)]
    return {"cells": cells}


def _live_cell_trace(cell: dict):
    from qsim import make_trace
    from qsim.workload import UsedShare

    # The load counts the work actually done where runs stop early, as the simulated sweep's (used = "study").
    return make_trace("poisson", load=cell["load"], seconds=cell["seconds"], seed=cell["seed"],
                      used=UsedShare() if cell["early_stops"] else None)


def _run_cells(ctx: Context, folder: Path, cells: list[dict]) -> None:
    """Each cell against its own `qlab serve`, started together, the runs one after another; a cell whose run
    file exists is kept (resuming)."""
    from contextlib import ExitStack

    from live.loadgen import ReplayConfig, replay
    from live.procs import Server
    from live.serve_options import ServeOptions

    runs = folder / "runs"
    runs.mkdir(exist_ok=True)
    todo = [cell for cell in cells if not (runs / f"{cell['name']}.parquet").is_file()]
    (folder / "logs").mkdir(exist_ok=True)
    with ExitStack() as stack:
        servers = []
        for cell in todo:
            server = Server(ServeOptions(**cell["options"], port=0), folder / "logs" / f"{cell['name']}.log")
            stack.callback(server.stop)
            server.spawn()
            servers.append(server)
        for cell, server in zip(todo, servers):
            server.wait_ready(180)
            _wait_lead(server.url, cell["lead_s"])
            began = time.perf_counter()
            run = replay(_live_cell_trace(cell), ReplayConfig(server.url))
            write_parquet(run, runs / f"{cell['name']}.parquet")
            ctx.log(f"  {folder.name}: {cell['name']}: {len(run)} requests in {time.perf_counter() - began:.1f} s")


def _wait_lead(url: str, lead_s: float) -> None:
    """Wait until the server's engine has run for lead_s (its schedule_started_at in /stats is on this machine's
    monotonic clock); at once if it has, or if the engine does not say."""
    import httpx

    if lead_s <= 0:
        return
    started = (httpx.get(f"{url}/stats", timeout=10).json().get("engine") or {}).get("schedule_started_at")
    if isinstance(started, (int, float)):
        time.sleep(max(0.0, min(lead_s, started + lead_s - time.monotonic())))


def _live_cells_run(cells: Callable[[Context], dict]) -> Callable[[Context, Path], None]:
    def run(ctx: Context, folder: Path) -> None:
        _run_cells(ctx, folder, cells(ctx)["cells"])
    return run


def _cell_row(cell: dict, run: pd.DataFrame) -> dict:
    """One live run: its outcomes, goodput, engine seconds and its per-request disagreement with the simulator."""
    from analysis import compare, metrics

    versus = compare.compare(run).summary
    row = metrics.summary(run, cell["seconds"])
    # A cut run reports no engine time: it held its engine from its start until the gate cut it.
    engine = run["engine_s"].to_numpy(dtype=float, na_value=np.nan).copy()
    cut = run["outcome"].eq("cancelled").to_numpy()
    engine[cut] = (run["server_finish_s"] - run["engine_started_s"]).to_numpy(dtype=float, na_value=np.nan)[cut]
    return {"requests": len(run), "good": int(run["outcome"].eq("good").sum()),
            "late": int(run["outcome"].eq("late").sum()), "cancelled": int(run["outcome"].eq("cancelled").sum()),
            "refused": int(run["outcome"].isin(["rejected", "expired"]).sum()),
            "error": int(run["outcome"].eq("error").sum()), "goodput_rps": row["goodput_rps"],
            "engine_s_per_s": float(np.nansum(engine)) / cell["seconds"],
            "sim_disagreements": int(versus["disagreements"]), "sim_disagreement_rate": versus["disagreement_rate"],
            "sim_rule_disagreements": int(versus["rule_disagreements"]),
            "sim_timing_disagreements": int(versus["timing_disagreements"]),
            "judged": len(run) - int(versus["live_errors"])}


def _cell_rows(folder: Path, cells: list[dict]) -> list[tuple[dict, pd.DataFrame, dict]]:
    out = []
    for cell in cells:
        path = folder / "runs" / f"{cell['name']}.parquet"
        if path.is_file():
            run = pd.read_parquet(path)
            out.append((cell, run, _cell_row(cell, run)))
    return out


def _cells_of(folder: Path) -> list[dict]:
    return ((_read_json(folder / "inputs.json") or {}).get("inputs") or {}).get("cells", [])


def _disagreement(rows: list[dict]) -> list[Verdict]:
    wrong, judged = sum(r["sim_disagreements"] for r in rows), sum(r["judged"] for r in rows)
    share = wrong / judged if judged else math.nan
    return [Verdict("check", "the simulator and the service agree request by request", None if not judged
                    else bool(share <= 0.05), f"{wrong} of {judged} requests disagree ({share:.1%}; judged against 5 %)"),
            *_rule_verdict(rows)]


#: Per live run, its disagreements with the simulator by cause (analysis.diagnosis.CAUSES).
CAUSE_COLUMNS = ("sim_rule_disagreements", "sim_timing_disagreements")


def _rule_verdict(rows: list[dict]) -> list[Verdict]:
    """Whether the gate decided by the simulator's rule wherever they disagree: a rule difference is a bug, a
    timing one a coin flip of the machine (none where the runs predate the causes)."""
    if not rows or any(c not in r for r in rows for c in CAUSE_COLUMNS):
        return []
    rule, timing = (int(sum(r[c] for r in rows)) for c in CAUSE_COLUMNS)
    return [Verdict("check", "where they disagree, it is timing, not the rule", bool(rule == 0),
                    f"disagreements by cause: rule {rule} (the gate's decision is not qsim.policy.decide's on the "
                    f"numbers it decided on: a bug), timing {timing} (the queues met differed, or they parted after "
                    "admission); the rest unknown")]


def _sim_summary(folder: Path, name: str) -> pd.DataFrame | None:
    tables = _summaries(folder.parent / name)
    return None if tables is None else tables[0]


def _live_stale_report(ctx: Context, folder: Path) -> list:
    from qsim.runfile import speed_schedule
    from analysis.estimation import late_share

    done = _cell_rows(folder, _cells_of(folder))
    if not done:
        return _not_run(folder)
    sim = _sim_summary(folder, "stale")
    rows = []
    for cell, run, row in done:
        schedule = speed_schedule(run)
        # No step left on the run's clock: it came before the run began, which then ran slow from its start.
        change = math.nan if schedule is None else schedule.steps[0][0] if schedule.steps else 0.0
        after = run["arrival_s"] >= change
        policy, fixed = cell["options"]["policy"], cell["options"]["fixed_estimate"]
        shown = {"policy": policy, "estimate": "fixed" if fixed else "tracking", "slows at (s of the run)": change,
                 "late share of completed, from the change": late_share(run.loc[after, "outcome"]),
                 "late share of completed, before": late_share(run.loc[~after, "outcome"]),
                 **{k: row[k] for k in ("requests", "good", "late", "refused", "error", "goodput_rps",
                                        "sim_disagreements", "sim_disagreement_rate", *CAUSE_COLUMNS)},
                 **_prediction(run, ctx.scale.predict_seeds)}
        if sim is not None:
            at = {"policy": policy, "fixed_estimate": fixed}
            shown["simulated late share from the change"] = str(level(sim, "late_share_after_change", **at))
            shown["simulated goodput_rps"] = str(level(sim, "goodput_rps", **at))
        rows.append(shown)
    cell = done[0][0]
    return [
        Text(f"Live: bounded-deadline and predictive at load 0.9 on the synthetic engine, which becomes "
             f"{SLOWDOWN:g}x slower a third of the way into each {cell['seconds']:g} s run (`--speed-schedule`; a "
             "fresh server per run, the step on the run's clock read back from the run file), tracking the speed "
             "or keeping the calibrated estimate (`--fixed-estimate`). Each run is replayed in the simulator "
             "request by request (`qlab compare`). One live seed: no interval; the simulated columns are the stale "
             "section's means [95 % CI] over its seeds (its runs are longer and slow at 20 s, so its goodput is "
             "over a larger share of slow time)."),
        *_disagreement([r for *_, r in done]),
        _prediction_verdict(rows, ctx.scale.predict_seeds),
        Table(pd.DataFrame(rows), "live stale estimator, beside the simulated stale sweep, with the model-only "
                                  "prediction's relative errors"
              + ("" if sim is not None else " (not available: the stale section has no results)")),
    ]


def _live_cut_report(ctx: Context, folder: Path) -> list:
    done = _cell_rows(folder, _cells_of(folder))
    if not done:
        return _not_run(folder)
    sim = _sim_summary(folder, "cancellation")
    if sim is not None:
        sim = sim.assign(engine_s_total_per_s=sim["engine_s_total"] / sim["duration_s"])
    runs = pd.DataFrame([{"policy": c["options"]["policy"], "load": c["load"],
                          "cut at the deadline": bool(c["options"]["policy_arg"]), **r,
                          **_prediction(run, ctx.scale.predict_seeds)} for c, run, r in done])
    pairs = []
    for (policy, load), part in runs.groupby(["policy", "load"], sort=False):
        on, off = part[part["cut at the deadline"]], part[~part["cut at the deadline"]]
        if on.empty or off.empty:
            continue
        on, off = on.iloc[0], off.iloc[0]
        pair = {"policy": policy, "load": load, "runs cut": int(on["cancelled"]),
                "engine s/s saved (not cut minus cut)": off["engine_s_per_s"] - on["engine_s_per_s"],
                "goodput gained (cut minus not cut)": on["goodput_rps"] - off["goodput_rps"]}
        if sim is not None and load in set(sim["load"]) and policy in set(sim["policy"]):
            at = {"policy": policy, "load": load}
            # The live runs' measure (total engine time, not cut minus cut, paired by seed), not the sweep's
            # engine_s_saved: a cut frees an engine for requests that would otherwise have been refused.
            pair["simulated engine s/s saved"] = str(difference(sim, "engine_s_total_per_s",
                                                                {**at, "cancel_at_deadline": False},
                                                                {**at, "cancel_at_deadline": True}))
            pair["simulated goodput gained"] = str(difference(sim, "goodput_rps", {**at, "cancel_at_deadline": True},
                                                              {**at, "cancel_at_deadline": False}))
        pairs.append(pair)
    cell = done[0][0]
    return [
        Text(f"Live: each policy and load with `--policy-arg cancel_at_deadline=true` and without, "
             f"{cell['seconds']:g} s of Poisson arrivals each on the synthetic engine with early stops "
             "(`--early-stops`, seeded: the study's used share, as experiments/cancellation.toml), a server per run. "
             "Engine seconds are the engine time the service reported (a cut run's from its start to its cut), per "
             "second of arrivals; saved and gained are "
             "the difference of the two live runs (one live seed, same arrivals: no interval). Saved is the whole "
             "engine time of the run without cutting minus that with it, so it can be negative: a cut frees the "
             "engine for requests that would otherwise have been refused (the cancellation section's "
             "engine_s_saved counts only the cut runs' unrun time). The simulated columns are the same differences "
             "in the cancellation section, means [95 % CI] paired by seed."),
        *_disagreement(runs.to_dict("records")),
        _prediction_verdict(runs.to_dict("records"), ctx.scale.predict_seeds),
        Table(pd.DataFrame(pairs), "live cutting at the deadline: what it saved and gained, beside the simulated sweep"
              + ("" if sim is not None else " (not available: the cancellation section has no results)")),
        Table(runs.drop(columns="judged"), "the live runs: their per-request disagreement with the simulator, and the "
                                           "model-only prediction's relative errors"),
    ]


# ------------------------------------------------------------------ configuration


def _version() -> str:
    from .sweep import _version as version

    return version()


def _configuration_report(ctx: Context, folder: Path) -> list:
    rows = [{"setting": "qlab version", "value": _version()},
            {"setting": "python", "value": platform.python_version()},
            {"setting": "scale", "value": ctx.scale.name + ("" if ctx.scale == FULL else " (not the reference sizes)")}]
    rows += [{"setting": f"scale.{k}", "value": str(v)}
             for k, v in dataclasses.asdict(ctx.scale).items() if k != "name"]
    for section in SECTIONS:
        marker = _read_json(ctx.out / "sections" / section.name / "inputs.json")
        if marker is not None and marker.get("inputs"):
            given = marker["inputs"]
            rows.append({"setting": f"{section.name} inputs", "value": f"{given.get('file', 'built in')}, sha256 "
                                                                       f"{marker['digest'][:16]}"})
    blocks = [Table(pd.DataFrame(rows), "the settings of this report")]
    for section in SECTIONS:
        marker = _read_json(ctx.out / "sections" / section.name / "inputs.json")
        if marker is not None and marker.get("inputs"):
            blocks += [Text(f"{section.name}: its inputs (their digest marks the section done)"),
                       Code(json.dumps(marker["inputs"], indent=1, sort_keys=True, default=str))]
    return blocks


def _nothing(ctx: Context) -> dict:
    return {}


def _no_run(ctx: Context, folder: Path) -> None:
    return None


SECTIONS = (
    Section("theory", "Theory: closed forms against the simulator", _theory_inputs, _theory_run, _theory_report),
    Section("reference", "The reference sweep: H1, H2, H3", _sweep_inputs("reference.toml", loads=True),
            _sweep_run("reference.toml", loads=True), _reference_report),
    Section("burst", "A burst of 30", _burst_inputs, _burst_run, _burst_report),
    Section("estimation", "Estimation: the estimate from the limit, learned, or exact",
            _sweep_inputs("estimation.toml"), _sweep_run("estimation.toml"),
            _experiment_report("estimation", "estimation_table", "Predictive at loads of the work actually done, with "
                               "the estimate from the limit, learned online, or exact (an oracle);")),
    Section("stale", "A stale estimator: H4", _sweep_inputs("stale.toml"), _sweep_run("stale.toml"), _stale_report),
    Section("cancellation", "Cancelling at the deadline", _sweep_inputs("cancellation.toml"),
            _sweep_run("cancellation.toml"),
            _experiment_report("cancellation", "cancellation_table", "Runs cut at their deadline or left to finish;")),
    Section("batching", "A batching engine: H5", _sweep_inputs(BATCHING_FILE), _sweep_run(BATCHING_FILE),
            _batching_report),
    Section("capacity", "Capacity under Poisson arrivals and bursts every 10 s (exercise 8)", _capacity_inputs,
            _capacity_run, _capacity_report),
    Section("live", "A live pass and the simulator against the service", _live_inputs, _live_run, _live_report),
    Section("live_stale", "Live: a stale estimator", _skippable("live_stale", _stale_cells),
            _live_cells_run(_stale_cells), _live_stale_report),
    Section("live_cancellation", "Live: cutting at the deadline", _skippable("live_cancellation", _cut_cells),
            _live_cells_run(_cut_cells), _live_cut_report),
    Section("configuration", "Configuration", _nothing, _no_run, _configuration_report),
)
NAMES = tuple(s.name for s in SECTIONS)


# ------------------------------------------------------------------ rendering


def _sentence(text: str) -> str:
    return "Evidence: " + text + ("" if text.endswith(".") else ".")


def _verdict_line(v: Verdict) -> str:
    name = v.label if v.label != "check" else "Check"
    return f"**{name} {v.word}**: {v.claim}. {_sentence(v.evidence)}"


def _hypotheses(parts: list[tuple[Section, list]]) -> list[Verdict]:
    return [b for _, blocks in parts for b in blocks if isinstance(b, Verdict) and b.label != "check"]


def render_markdown(title: str, preface: list[str], parts: list[tuple[Section, list]], figures: str) -> str:
    out = [f"# {title}", "", *preface, "", "## Verdicts", ""]
    out += [f"- {_verdict_line(b)}" for b in _hypotheses(parts)]
    out.append("")
    for number, (section, blocks) in enumerate(parts, 1):
        out += [f"## {number}. {section.title}", ""]
        for b in blocks:
            if isinstance(b, Text):
                out += [b.text, ""]
            elif isinstance(b, Verdict):
                out += [_verdict_line(b), ""]
            elif isinstance(b, Table):
                out += [f"*{b.caption}*", ""] if b.caption else []
                out += [pipe_table(b.frame) if len(b.frame) else "(empty)", ""]
            elif isinstance(b, Figure):
                out += [f"![{b.caption}]({figures}/{b.name}.png)", ""]
            elif isinstance(b, Code):
                out += ["```", b.text, "```", ""]
            elif isinstance(b, Failed):
                out += [f"**FAILED**: {b.error}", ""]
    return "\n".join(out)


CSS = """body{font-family:system-ui,sans-serif;max-width:75em;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:0.85em;margin:0.5em 0 1.5em}th,td{border:1px solid #ccc;padding:2px 6px}
th{background:#f0f0f0}caption{caption-side:top;text-align:left;font-style:italic;padding:4px 0}
.verdict{padding:0.5em 0.8em;margin:0.8em 0;border-left:5px solid #999}.yes{border-color:#2a9d8f;background:#eef8f6}
.no{border-color:#e76f51;background:#fdf0ec}img{max-width:100%}figure{margin:1em 0}figcaption{font-style:italic}"""


def _html_block(b) -> str:
    if isinstance(b, Text):
        return f"<p>{html.escape(b.text)}</p>"
    if isinstance(b, Verdict):
        kind = {True: "yes", False: "no", None: ""}[b.supported]
        name = b.label if b.label != "check" else "Check"
        return (f'<div class="verdict {kind}"><b>{html.escape(name)} {b.word}</b>: {html.escape(b.claim)}. '
                f"{html.escape(_sentence(b.evidence))}</div>")
    if isinstance(b, Table):
        shown = b.frame.map(table_cell) if len(b.frame) else b.frame
        table = shown.to_html(index=False, border=0, escape=True) if len(b.frame) else "<p>(empty)</p>"
        return (f"<p><i>{html.escape(b.caption)}</i></p>" if b.caption else "") + table
    if isinstance(b, Code):
        return f"<pre>{html.escape(b.text)}</pre>"
    if isinstance(b, Failed):
        return f'<div class="verdict no"><b>FAILED</b>: {html.escape(b.error)}</div>'
    data = base64.b64encode(b.png).decode()
    return (f'<figure><img alt="{html.escape(b.caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(b.caption)}</figcaption></figure>")


def render_html(title: str, preface: list[str], parts: list[tuple[Section, list]]) -> str:
    verdicts = _hypotheses(parts)
    body = [f"<h1>{html.escape(title)}</h1>", *(f"<p>{html.escape(p)}</p>" for p in preface), "<h2>Verdicts</h2>",
            "<ul>" + "".join(f"<li>{_html_block(v)}</li>" for v in verdicts) + "</ul>"]
    for number, (section, blocks) in enumerate(parts, 1):
        body.append(f'<h2 id="{section.name}">{number}. {html.escape(section.title)}</h2>')
        body += [_html_block(b) for b in blocks]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _blocks(ctx: Context, section: Section, folder: Path) -> list:
    """The section's report, or why there is none: not available here, or failed (in its run or its report)."""
    inputs = section.inputs(ctx)
    if "unavailable" in inputs:
        return [Text(f"not available: {inputs['unavailable']}")]
    failed = _read_json(folder / "failed.json")
    if failed is not None:
        return [Failed(failed["error"])]
    try:
        return section.report(ctx, folder)
    except Exception as exc:  # noqa: BLE001 - the other sections' reports are still worth writing
        ctx.log(f"{section.name}: report FAILED: {type(exc).__name__}: {exc}")
        return [Failed(f"its report: {type(exc).__name__}: {exc}")]


def write_report(ctx: Context) -> list[tuple[Section, list]]:
    """Build every section's blocks from its folder, and write report.md, figures/ and report.html."""
    parts = []
    for section in SECTIONS:
        folder = ctx.out / "sections" / section.name
        parts.append((section, _blocks(ctx, section, folder)))
    quick = "" if ctx.scale == FULL else f" ({ctx.scale.name}: a reduced study, not the reference sizes)"
    title = f"qlab study{quick}"
    preface = [f"qlab {_version()}. Written by qlab study; every number is a mean over seeds with its 95 % "
               "Student-t confidence interval in brackets, and a verdict follows from the intervals stated beside it."]
    figures = ctx.out / "figures"
    figures.mkdir(exist_ok=True)
    for _, blocks in parts:
        for b in blocks:
            if isinstance(b, Figure):
                atomic_write(figures / f"{b.name}.png", b.png)
    atomic_write(ctx.out / "report.md", render_markdown(title, preface, parts, "figures").encode())
    atomic_write(ctx.out / "report.html", render_html(title, preface, parts).encode())
    return parts


# ------------------------------------------------------------------ command


def run(out: str | Path, scale: Scale = FULL, *, workers: int | None = None, skip_live: bool = False,
        force: tuple[str, ...] = (), log: Callable[[str], None] = print,
        live_engine: str = "auto") -> list[tuple[Section, list]]:
    """Run every section not yet done into OUT and write the report; return the report's parts."""
    out = Path(out)
    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "study.json", {"scale": dataclasses.asdict(scale), "qlab_version": _version()})
    ctx = Context(out, scale, workers, skip_live, log, live_engine)
    for section in SECTIONS:
        began = time.perf_counter()
        try:
            said = run_section(ctx, section, section.name in force)
        except Exception as exc:  # noqa: BLE001 - one failed section (a server that will not start) keeps the others
            error = f"{type(exc).__name__}: {exc}"
            said = f"FAILED: {error}"
            (out / "sections" / section.name).mkdir(parents=True, exist_ok=True)
            _write_json(out / "sections" / section.name / "failed.json", {"error": error})
        else:
            (out / "sections" / section.name / "failed.json").unlink(missing_ok=True)
        log(f"{section.name}: {said} ({time.perf_counter() - began:.1f} s)")
    parts = write_report(ctx)
    log(f"wrote {out / 'report.md'} and {out / 'report.html'}")
    return parts


def cmd_study(args) -> int:
    parts = run(args.out, QUICK if args.quick else FULL, workers=args.workers, skip_live=args.skip_live,
                force=tuple(args.force or ()), log=lambda line: print(line, flush=True),
                live_engine=args.live_engine)
    for verdict in _hypotheses(parts):
        print(f"{verdict.label} {verdict.word}")
    failed = [section.name for section, blocks in parts if any(isinstance(b, Failed) for b in blocks)]
    if failed:
        print(f"qlab study: failed sections (see the report): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def register(sub) -> None:
    p = sub.add_parser("study", help="run the whole reference study and write report.md and report.html",
                       description="Theory, the reference sweep (H1-H3), the burst of 30, estimation, the stale "
                                   "estimator (H4), cancellation, a batching engine (H5), each policy's capacity "
                                   "(exercise 8), a live pass, and the stale estimator and "
                                   "cancellation live, each live run compared with the simulator, into one folder, "
                                   "with a report. Re-running resumes: done sections are skipped.")
    p.set_defaults(func=cmd_study)
    p.add_argument("--out", required=True, help="the study's folder (created; resumed if it holds a study)")
    p.add_argument("--quick", action="store_true", help="a reduced study: a few minutes on 2 cores")
    p.add_argument("--workers", type=positive_int, help="local processes (default: all cores)")
    p.add_argument("--skip-live", action="store_true", help="leave out the live sections (no servers started)")
    p.add_argument("--live-engine", choices=LIVE_ENGINES, default="auto",
                   help="the live pass's engine: vllm (vLLM itself, installed by make vllm-check), synthetic, or "
                        "auto (default): vLLM where it is installed, else the synthetic engine")
    p.add_argument("--force", action="append", choices=NAMES, metavar="SECTION",
                   help=f"run this section again even if done (repeat): {', '.join(NAMES)}")
