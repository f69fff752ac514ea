"""``qlab study``: every section in order into OUT, then the report from their folders."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable

from inputs.argtypes import positive_int
from inputs.atomic import atomic_write

from . import (
    batching,
    burst,
    capacity,
    configuration,
    estimation,
    fleet,
    live_cancellation,
    live_pass,
    live_stale,
    reference,
    theory,
)
from .blocks import Failed, Figure, Text
from .configuration import qlab_version
from .render import hypotheses, render_html, render_markdown
from .scale import FULL, QUICK, Scale
from .section import Context, Section, check_out, read_json, run_section, write_json

#: The sections that run, in the report's order; the configuration section follows them.
_RUN = (
    theory.SECTION,
    reference.SECTION,
    burst.SECTION,
    estimation.ESTIMATION,
    estimation.STALE,
    estimation.CANCELLATION,
    batching.SECTION,
    capacity.SECTION,
    fleet.SECTION,
    live_pass.SECTION,
    live_stale.SECTION,
    live_cancellation.SECTION,
)
SECTIONS = (*_RUN, configuration.section(tuple(s.name for s in _RUN)))
NAMES = tuple(s.name for s in SECTIONS)


def _blocks(ctx: Context, section: Section, folder: Path) -> list:
    """The section's report, or why there is none: not available here, or failed (in its run or
    its report)."""
    inputs = section.inputs(ctx)
    if "unavailable" in inputs:
        return [Text(f"not available: {inputs['unavailable']}")]
    failed = read_json(folder / "failed.json")
    if failed is not None:
        return [Failed(failed["error"])]
    try:
        return section.report(ctx, folder)
    except Exception as exc:
        ctx.log(f"{section.name}: report FAILED: {type(exc).__name__}: {exc}")
        return [Failed(f"its report: {type(exc).__name__}: {exc}")]


def write_report(ctx: Context) -> list[tuple[Section, list]]:
    """Build every section's blocks from its folder, and write report.md, figures/ and
    report.html."""
    parts = []
    for section in SECTIONS:
        folder = ctx.out / "sections" / section.name
        parts.append((section, _blocks(ctx, section, folder)))
    quick = (
        ""
        if ctx.scale == FULL
        else (f" ({ctx.scale.name}: a reduced study, not the reference sizes)")
    )
    title = f"qlab study{quick}"
    preface = [
        f"qlab {qlab_version()}. Written by qlab study; every number is a mean over seeds "
        "with its 95 % Student-t confidence interval in brackets, and a verdict follows "
        "from "
        "the intervals stated beside it."
    ]
    figures = ctx.out / "figures"
    figures.mkdir(exist_ok=True)
    for _, blocks in parts:
        for b in blocks:
            if isinstance(b, Figure):
                atomic_write(figures / f"{b.name}.png", b.png)
    atomic_write(ctx.out / "report.md", render_markdown(title, preface, parts, "figures").encode())
    atomic_write(ctx.out / "report.html", render_html(title, preface, parts).encode())
    return parts


def run(
    out: str | Path,
    scale: Scale = FULL,
    *,
    workers: int | None = None,
    skip_live: bool = False,
    force: tuple[str, ...] = (),
    log: Callable[[str], None] = print,
    live_engine: str = "auto",
    quiet: bool = True,
) -> list[tuple[Section, list]]:
    """Run every section not yet done into OUT and write the report; return the report's parts.
    ``quiet`` False: a bar over the sections on a terminal's stderr (inputs.progress)."""
    from inputs.progress import progress_bar

    out = Path(out)
    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(
        out / "study.json", {"scale": dataclasses.asdict(scale), "qlab_version": qlab_version()}
    )
    ctx = Context(out, scale, workers, skip_live, log, live_engine)
    with progress_bar(len(SECTIONS), unit="section", desc="study", quiet=quiet) as bar:
        for section in SECTIONS:
            _run_one(ctx, out, section, force, log)
            bar.update(1)
    parts = write_report(ctx)
    log(f"wrote {out / 'report.md'} and {out / 'report.html'}")
    return parts


def _run_one(ctx: Context, out: Path, section: Section, force: tuple[str, ...], log) -> None:
    """One section, its failure kept in its folder (a server that will not start keeps the
    others)."""
    began = time.perf_counter()
    try:
        said = run_section(ctx, section, section.name in force)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        said = f"FAILED: {error}"
        (out / "sections" / section.name).mkdir(parents=True, exist_ok=True)
        write_json(out / "sections" / section.name / "failed.json", {"error": error})
    else:
        (out / "sections" / section.name / "failed.json").unlink(missing_ok=True)
    log(f"{section.name}: {said} ({time.perf_counter() - began:.1f} s)")


def cmd_study(args) -> int:
    # --json: stdout is one document, so each section's line goes to stderr (still minutes apart).
    stream = sys.stderr if args.json else sys.stdout
    parts = run(
        args.out,
        QUICK if args.quick else FULL,
        workers=args.workers,
        skip_live=args.skip_live,
        force=tuple(args.force or ()),
        log=lambda line: print(line, file=stream, flush=True),
        live_engine=args.live_engine,
        quiet=args.quiet or args.json,
    )
    failed = [
        section.name for section, blocks in parts if any(isinstance(b, Failed) for b in blocks)
    ]
    if args.json:
        out = Path(args.out)
        verdicts = [
            {"label": v.label, "claim": v.claim, "verdict": v.word, "evidence": v.evidence}
            for v in hypotheses(parts)
        ]
        report = [str(out / "report.md"), str(out / "report.html")]
        print(
            json.dumps(
                {"out": str(out), "report": report, "hypotheses": verdicts, "failed": failed},
                indent=2,
            )
        )
    else:
        for verdict in hypotheses(parts):
            print(f"{verdict.label} {verdict.word}")
    if failed:
        print(f"qlab study: failed sections (see the report): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def register(sub) -> None:
    p = sub.add_parser(
        "study",
        help="run the whole reference study and write report.md and report.html",
        description="Theory, the reference sweep (H1-H3), the burst of 30, "
        "estimation, the stale "
        "estimator (H4), cancellation, a batching engine (H5), each "
        "policy's capacity "
        "(exercise 8), a fleet of 4 behind routers (H6), a live pass, "
        "and the stale estimator and "
        "cancellation live, each live run compared with the simulator, "
        "into one folder, "
        "with a report. Re-running resumes: done sections are skipped.",
    )
    p.set_defaults(func=cmd_study)
    p.add_argument(
        "--out", required=True, help="the study's folder (created; resumed if it holds a study)"
    )
    p.add_argument("--quick", action="store_true", help="a reduced study: a few minutes on 2 cores")
    p.add_argument("--workers", type=positive_int, help="local processes (default: all cores)")
    p.add_argument("--quiet", action="store_true", help="no progress bar on a terminal")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document instead of the verdicts' lines: each hypothesis's "
        "verdict and evidence, the failed sections, the report's files (the "
        "sections' lines on stderr)",
    )
    p.add_argument(
        "--skip-live", action="store_true", help="leave out the live sections (no servers started)"
    )
    p.add_argument(
        "--live-engine",
        choices=live_pass.LIVE_ENGINES,
        default="auto",
        help="the live pass's engine: vllm (vLLM itself, installed by make vllm-check), "
        "synthetic, or "
        "auto (default): vLLM where it is installed, else the synthetic engine",
    )
    p.add_argument(
        "--force",
        action="append",
        choices=NAMES,
        metavar="SECTION",
        help=f"run this section again even if done (repeat): {', '.join(NAMES)}",
    )
