"""``qlab live``: every trace under every policy against live servers
(:mod:`experiments.live_runner`), and the summary table it prints.
"""

from __future__ import annotations

import json
from pathlib import Path

from .jsonout import json_ready


LIVE_COLUMNS = [
    "trace",
    "policy",
    "effective_load",
    "good",
    "late",
    "rejected",
    "expired",
    "error",
    "goodput_rps",
    "good_tokens_per_s",
    "sim_disagreement_rate",
]


def cmd_live(args) -> int:
    from live import live_config

    from . import live_runner

    cfg = live_config.load(args.config)
    summary = live_runner.run(cfg, args.out, log=_live_log(args), bar=_live_bar(args))
    runs, table = Path(args.out) / "runs", Path(args.out) / "summary.parquet"
    if args.json:  # every column of the summary, one object a run
        print(
            json.dumps(
                json_ready(
                    {
                        "runs": summary.to_dict(orient="records"),
                        "rows": str(runs),
                        "summary": str(table),
                    }
                ),
                indent=2,
            )
        )
    else:
        print(summary[LIVE_COLUMNS].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        print(f"wrote {len(summary)} runs to {runs} and {table}")
    return 0 if summary["error"].sum() == 0 else 1


def _live_bar(args):
    """A bar over the runs (minutes each), on a terminal's stderr only; none with --quiet,
    --json."""
    from inputs.progress import progress_bar

    return lambda total, initial: progress_bar(
        total, unit="run", desc="live", initial=initial, quiet=args.quiet or args.json
    )


def _live_log(args):
    """Each run's lines as it goes: on stdout with the text, on stderr beside --json (stdout is one
    document), none with --quiet."""
    import sys

    if args.quiet:
        return lambda line: None
    stream = sys.stderr if args.json else sys.stdout
    return lambda line: print(line, file=stream, flush=True)


def _live_parser(sub) -> None:
    p = sub.add_parser(
        "live",
        help="run every trace under every policy against live servers",
        description="Start one qlab serve per policy, replay every trace under "
        "every policy "
        "(order rotated), probe speed before and after each run, write "
        "parquet.",
    )
    p.set_defaults(func=cmd_live)
    p.add_argument("config", help="the experiment's TOML file (see experiments/live.toml)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document instead of the table: every run's summary "
        "row, NaN as null (the lines as it goes on stderr)",
    )
    p.add_argument("--quiet", action="store_true", help="no line per run as it goes")


def register(subparsers) -> None:
    _live_parser(subparsers)
