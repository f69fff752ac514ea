"""``qlab sweep`` and ``qlab plot``: a TOML grid to a parquet dataset, and the dataset to
figures."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.metrics import aggregate

from .jsonout import json_ready

from inputs.argtypes import positive, positive_int


@dataclass(frozen=True)
class SummaryNumbers:
    """The headline figures of a sweep per cell of its grid but the seed: ``table`` has the ``axes``
    that tell cells apart, n (seeds), and for each of ``metrics`` its mean over seeds and 95 % CI
    (METRIC, METRIC_low, METRIC_high)."""

    table: pd.DataFrame
    axes: tuple[str, ...]
    metrics: tuple[str, ...]


def summary_numbers(summary: pd.DataFrame) -> SummaryNumbers:
    """Mean over seeds and 95 % CI of the headline figures per speed, load and policy.

    A sweep with a ``clients`` axis is also grouped by client set ("none": requests named no
    client), and shows Jain's indices across clients (jain_goodput, jain_share; NaN where none).
    One with a ``retry`` or ``patience`` axis is grouped by those too ("none": no retries, no
    patience) and shows the end-to-end view (share_good_e2e, attempts_per_request); one of surge
    arrivals, the seconds after the surge until goodput was back (recovery_s, over the seeds that
    recovered) and the share of seeds that did (recovered).
    """
    from .config_tables import NO_CLIENTS

    # Axes whose "none" cells carry no name (null).
    optional = ("clients", "retry", "patience", "used", "speed_schedule", "policy_args")
    summary = summary.assign(
        **{
            c: summary[c].astype(object).where(summary[c].notna(), NO_CLIENTS)
            for c in optional
            if c in summary
        }
    )
    by = [
        c
        for c in (
            "speed",
            "engines",
            "replicas",
            "router",
            "arrivals",
            "load",
            "rate",
            "clients",
            "retry",
            "patience",
            "used",
            "speed_schedule",
            "fixed_estimate",
            "cancel_at_deadline",
            "estimator",
            "policy",
            "policy_args",
        )
        if c in summary
        and summary[c].notna().any()
        and not (c in optional and set(summary[c]) == {NO_CLIENTS})
    ]
    metrics = ["share_good", "goodput_rps", "good_tokens_per_s", "latency_p99_s"]
    metrics += [
        m
        for m in (
            "jain_goodput",
            "jain_share",
            "share_good_e2e",
            "attempts_per_request",
            "recovery_s",
            "recovered",
            "load_imbalance",
            "jain_replicas",
        )
        if m in summary and summary[m].notna().any()
    ]
    agg = aggregate(summary, by, metrics)
    columns = [*by, "n", *(c for m in metrics for c in (m, f"{m}_low", f"{m}_high"))]
    return SummaryNumbers(agg[columns], tuple(by), tuple(metrics))


SUMMARY_FORMATS = ("table", "csv", "json", "markdown")


def summary_table(summary: pd.DataFrame) -> pd.DataFrame:
    """:func:`summary_numbers` as text: each metric's mean over seeds ± the 95 % CI half-width."""
    numbers = summary_numbers(summary)
    agg = numbers.table
    out = agg[list(numbers.axes)].copy()
    for m in numbers.metrics:
        half = (agg[f"{m}_high"] - agg[f"{m}_low"]) / 2
        out[m] = [
            "-" if pd.isna(v) else f"{v:.3g} ±{h:.2g}" if pd.notna(h) else f"{v:.3g}"
            for v, h in zip(agg[m], half)
        ]
    return out


def _print_summary(summary: pd.DataFrame) -> None:
    seeds = summary["seed"].nunique()
    print(
        f"{int(summary['requests'].sum()):,} requests; mean over {seeds} seed(s), ± 95 % CI "
        "half-width:"
    )
    print(summary_table(summary).to_string(index=False))


def _sweep_summary(folder: str) -> tuple[Path, pd.DataFrame]:
    from .sweep import old_load_meaning

    src = Path(folder)
    if not (src / "summary.parquet").exists():
        raise ValueError(
            f"{src}: no summary.parquet here; run `qlab sweep FILE.toml --out {src}` first"
        )
    try:
        manifest = json.loads((src / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = None
    why = old_load_meaning(src, manifest) if isinstance(manifest, dict) else None
    if why:  # still readable, but its load column (and the axes drawn from it) mean the old thing
        print(f"qlab: warning: {why}; its load column is that old, nominal load", file=sys.stderr)
    return src, pd.read_parquet(src / "summary.parquet")


def cmd_sweep(args) -> int:
    from . import config, sweep

    cfg = config.load(args.file)
    n = len(sweep.cells(cfg))
    began = time.perf_counter()
    summary = sweep.run(
        cfg, args.out, workers=args.workers, scheduler=args.scheduler, quiet=args.quiet or args.json
    )
    wall = time.perf_counter() - began
    if args.json:
        print(json.dumps(json_ready(_sweep_facts(cfg, summary, n, wall, Path(args.out))), indent=2))
    elif not args.quiet:
        print(
            f"sweep {cfg.name}: {n} cells ({summary.attrs['ran']} run, "
            f"{summary.attrs['skipped']} already done) "
            f"in {wall:.1f} s -> {args.out}"
        )
        _print_summary(summary)
    return 0


def _sweep_facts(cfg, summary: pd.DataFrame, cells: int, wall_s: float, out: Path) -> dict:
    """--json's document: what the text says (cells run and skipped, requests, the summary table of
    qlab summary --format json) and the files written at the folder's top (cells/ holds the
    rows)."""
    table = summary_numbers(summary).table
    files = sorted(str(p) for p in out.iterdir() if p.is_file() and not p.name.startswith("."))
    return {
        "sweep": cfg.name,
        "cells": cells,
        "ran": summary.attrs["ran"],
        "skipped": summary.attrs["skipped"],
        "wall_s": wall_s,
        "out": str(out),
        "requests": int(summary["requests"].sum()),
        "seeds": int(summary["seed"].nunique()),
        "files": files,
        "rows": str(out / "cells"),
        "summary": table.to_dict(orient="records"),
    }


def cmd_summary(args) -> int:
    if args.json:  # as every other command that prints results takes it
        args.format = "json"
    src, summary = _sweep_summary(args.dir)
    if args.format == "table":
        print(f"{src}: {len(summary)} cells")
        _print_summary(summary)
    elif args.format == "markdown":
        from .tables import pipe_table

        print(pipe_table(summary_table(summary)))
    # numbers for a program: mean and CI bounds in columns of their own, no NaN but null (JSON)
    else:
        table = summary_numbers(summary).table
        print(
            table.to_csv(index=False)
            if args.format == "csv"
            else table.to_json(orient="records", indent=2, double_precision=15),
            end="" if args.format == "csv" else "\n",
        )
    return 0


def cmd_plot(args) -> int:
    from analysis import plots
    from analysis.objectives import parse_objectives

    from . import sweep

    objectives = tuple(o for text in args.objective or () for o in parse_objectives(text))
    plots.check_objectives(objectives)
    src, summary = _sweep_summary(args.dir)
    by_class = pd.read_parquet(src / "summary_by_class.parquet")
    speed = sorted(summary["speed"].unique())[0]
    load = (
        _cdf_load(summary)
        if args.cdf_load is None
        else _grid_load(summary[summary["speed"] == speed], args.cdf_load)
    )
    rows = sweep.load_rows(src, load=load, speed=speed) if load is not None else None
    # By client and by priority where the sweep has cells with more than one
    # (sweep.write_summaries).
    grouped = {
        key: pd.read_parquet(src / f"summary_{key}.parquet")
        if (src / f"summary_{key}.parquet").exists()
        else None
        for key in ("by_client", "by_priority")
    }
    # Over time where the sweep kept its cells' seconds (retry or patience axes, surge arrivals).
    timeseries = (
        pd.read_parquet(src / "timeseries.parquet")
        if (src / "timeseries.parquet").exists()
        else None
    )
    paths = plots.save_all(
        summary,
        by_class,
        rows,
        args.out,
        by_client_table=grouped["by_client"],
        by_priority_table=grouped["by_priority"],
        timeseries=timeseries,
        surge=_surge(src),
        objectives=objectives,
        extra=_capacity_figure(src, summary),
    )
    drew_cdf = Path(args.out) / "latency_cdf.png" in paths
    print(
        f"wrote {len(paths)} files to {args.out} (latency CDF at load {load:g}, speed {speed:g})"
        if drew_cdf
        else f"wrote {len(paths)} files to {args.out}"
    )
    return 0


def _grid_load(summary: pd.DataFrame, wanted: float) -> float:
    """The sweep's load equal to ``wanted`` (to rounding); ValueError naming the loads there are."""
    loads = sorted(summary["load"].dropna().unique())
    for load in loads:
        if math.isclose(load, wanted, rel_tol=1e-9, abs_tol=1e-12):
            return float(load)
    raise ValueError(
        f"--cdf-load {wanted:g} is not a load of this sweep; its loads: "
        + (", ".join(f"{v:g}" for v in loads) or "none")
    )


def _capacity_figure(src: Path, summary: pd.DataFrame) -> dict:
    """{"capacity": its figure} for a folder written by qlab capacity (its capacity.json), else
    {}."""
    from analysis import plots
    from analysis.objectives import parse_objectives

    path = src / "capacity.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    first = parse_objectives(data["objective"])[0]  # the figure draws the first clause's metric
    return {"capacity": plots.capacity(summary, data["results"], first)}


def _surge(src: Path) -> tuple[float, float] | None:
    """(start_s, end_s) of the sweep's surge of arrivals (the first of its arrivals axis), from its
    manifest; None for other arrivals."""
    from qsim.arrivals import parse_arrivals

    try:
        cfg = json.loads((src / "manifest.json").read_text())["config"]
        processes = [parse_arrivals(a) for a in cfg["grid"].get("arrivals") or [cfg["arrivals"]]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return next(
        ((numbers[0], numbers[0] + numbers[1]) for kind, numbers in processes if kind == "surge"),
        None,
    )


def _cdf_load(summary: pd.DataFrame) -> float | None:
    """The swept load closest to 1.3 (just past capacity), where the policies differ most."""
    loads = summary["load"].dropna().unique()
    return float(min(loads, key=lambda v: abs(v - 1.3))) if len(loads) else None


def register(sub) -> None:
    s = sub.add_parser(
        "sweep",
        help="run a TOML grid of simulations into a parquet dataset",
        description="Run every cell of a sweep file (policy x load x speed x ... x "
        "seeds) and "
        "write per-request rows, a summary and a manifest. Re-running "
        "skips finished cells.",
    )
    s.set_defaults(func=cmd_sweep)
    s.add_argument("file", help="sweep TOML, e.g. experiments/reference.toml")
    s.add_argument(
        "--out", required=True, help="output folder (created; resumed if it holds this config)"
    )
    s.add_argument("--workers", type=positive_int, help="local processes (default: all cores)")
    s.add_argument(
        "--scheduler", help="run on an existing dask.distributed cluster, e.g. tcp://HOST:8786"
    )
    s.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    s.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document instead of the text: cells run and skipped, "
        "requests, "
        "the files written and the summary (as qlab summary --format json), NaN "
        "as null",
    )

    t = sub.add_parser(
        "summary",
        help="print a sweep's summary table",
        description="Mean over seeds and 95 % CI of share in time, goodput and p99 "
        "latency per cell "
        "(and client set, with Jain's fairness index across clients, "
        "where the sweep has them).",
    )
    t.set_defaults(func=cmd_summary)
    t.add_argument("dir", help="a folder written by qlab sweep")
    t.add_argument(
        "--format",
        choices=SUMMARY_FORMATS,
        default="table",
        help="table: mean ± 95 %% CI half-width, for reading (the default); markdown: "
        "the same as a pipe "
        "table; csv, json: one row (object) per cell of the grid but the seed, "
        "with the axes, n (seeds), "
        "and each metric's mean, METRIC_low and METRIC_high (95 %% CI)",
    )
    t.add_argument("--json", action="store_true", help="the same as --format json")

    p = sub.add_parser(
        "plot",
        help="draw a sweep's figures (PNG and SVG)",
        description="Share in time, goodput (requests/s and tokens/s), share by "
        "size class, "
        "latency CDF of the answered, and outcome bars, from a sweep "
        "folder; by client "
        "(with Jain's index) and by priority where the sweep has them; "
        "goodput and "
        "offered attempts over time, and recovery after a surge, where "
        "it has a retry axis.",
    )
    p.set_defaults(func=cmd_plot)
    p.add_argument("dir", help="a folder written by qlab sweep")
    p.add_argument("--out", default="figures", help="folder for the figures (default: figures)")
    p.add_argument(
        "--cdf-load",
        type=positive,
        help="load (utilisation at the simulated speed) of the latency CDF, one of the "
        "sweep's "
        "(default: the one closest to 1.3)",
    )
    p.add_argument(
        "--objective",
        action="append",
        metavar="METRIC>=VALUE",
        help="draw an objective on each panel of its metric, e.g. share_good>=0.9 "
        "(METRIC=VALUE: at least "
        "for shares and goodput, at most for latencies; several joined with "
        "'and', or repeat)",
    )
