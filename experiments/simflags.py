"""The workload, engine and client options that ``qlab simulate`` and ``qlab capacity`` share,
written once; and the trace file's options that ``qlab simulate`` and ``qlab replay`` share
(:func:`add_trace_flags`,
:func:`trace_window`).

Each command adds its own ``--policy``, ``--load`` and length options, and its output options.
"""

from __future__ import annotations

import argparse

from inputs import clientflags
from inputs.argtypes import count, non_negative, positive, positive_int
from inputs.run_axes import AXES, flag_help
from qsim.datasets import COUNTS, Dataset, read_dataset
from qsim.fleet import ADMISSION_AT
from qsim.service import parse_schedule
from qsim.tracefiles import TraceWindow, WindowNames
from qsim.arrivals import ARRIVALS

from .config_grid import parse_used


def admission_at(text: str) -> str:
    """Where a fleet admits (qsim.fleet.ADMISSION_AT), as argparse checks a type."""
    if text not in ADMISSION_AT:
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r}: a fleet admits at one of {', '.join(ADMISSION_AT)}"
        )
    return text


def add_admission_at(p) -> None:
    """--admission-at, beside --replicas and --router (qlab simulate's, qlab capacity's)."""
    p.add_argument(
        "--admission-at",
        type=admission_at,
        metavar="{replica,gate}",
        help=flag_help("admission_at"),
    )


def _checked(parse):
    """An argparse type that checks the text with ``parse`` and keeps the text (a sweep cell
    names it so)."""

    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    check.__name__ = parse.__name__  # argparse names the type in its error
    return check


class Remember(argparse.Action):
    """Store the value and note that it was given (to reject it beside --trace)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.trace_conflicts = [*getattr(namespace, "trace_conflicts", []), option_string]


def add_workload_options(
    p: argparse.ArgumentParser, *, seeds: int = 1, several_arrivals: bool = False
) -> None:
    """The options of the policy's settings, the engines, the workload and its clients (``seeds``:
    --seeds' default; ``several_arrivals``: --arrivals may be repeated, a list, None when not
    given)."""
    p.set_defaults(trace_conflicts=[])
    p.add_argument(
        "--policy-arg",
        action="append",
        metavar="KEY=VALUE",
        help="a parameter of the policy (repeat)",
    )
    # the knobs a sweep's grid sets too: their type and help are its axes' (inputs.run_axes)
    p.add_argument("--max-queue", type=AXES["max_queue"].number, help=flag_help("max_queue"))
    p.add_argument("--deadline", type=AXES["deadline_s"].number, help=flag_help("deadline_s"))
    p.add_argument("--engines", type=AXES["engines"].number, default=1, help=flag_help("engines"))
    p.add_argument("--speed", type=AXES["speed"].number, default=1.0, help=flag_help("speed"))
    p.add_argument(
        "--arrivals",
        default=None if several_arrivals else "poisson",
        action="append" if several_arrivals else Remember,
        help=" | ".join(ARRIVALS) + " (periodic:PERIOD_S: a burst every PERIOD_S whose "
        "size follows the "
        "load; burst:N and periodic:N:PERIOD_S bring their own rate and take no "
        "load)" + (" (repeat for several; default poisson)" if several_arrivals else ""),
    )
    p.add_argument(
        "--service", choices=["mix", "exponential", "deterministic"], default="mix", action=Remember
    )
    p.add_argument(
        "--mean-service",
        type=positive,
        action=Remember,
        help="mean service seconds for exponential/deterministic (default: the mix's mean)",
    )
    p.add_argument(
        "--noise",
        type=non_negative,
        help="CV of lognormal noise on true service times (mix and trace files; "
        "default: the --service-model "
        "calibration's CV under load, else 0)",
    )
    p.add_argument(
        "--service-model", help="JSON with intercept_s and per_token_s (from qlab calibrate)"
    )
    p.add_argument(
        "--fixed-estimate",
        action="store_true",
        help="do not track speed: keep the calibrated estimate",
    )
    p.add_argument(
        "--used",
        type=_checked(parse_used),
        metavar="SPEC",
        help=flag_help("used"),
    )
    p.add_argument(
        "--speed-schedule",
        type=_checked(parse_schedule),
        metavar="SECONDS:FACTOR,...",
        help=flag_help("speed_schedule"),
    )
    p.add_argument("--seed", type=count, default=1)
    p.add_argument(
        "--seeds",
        type=positive_int,
        default=seeds,
        help=f"replications, seeds SEED..SEED+N-1 (default {seeds})",
    )
    clientflags.add_flags(p)


def add_trace_flags(p: argparse.ArgumentParser, *, load_flag: str) -> None:
    """--trace, --time-scale and --start (``load_flag``: the command's load option, which with
    --trace sets the file's rate; --seconds is the command's own, a window of the file with
    --trace)."""
    p.add_argument(
        "--trace",
        help="a trace file (Azure LLM CSV or qlab .csv/.parquet) instead of synthetic arrivals",
    )
    p.add_argument(
        "--time-scale",
        type=AXES["time_scale"].number,
        default=1.0,
        help=flag_help("time_scale"),
    )
    p.add_argument(
        "--start",
        type=non_negative,
        metavar="S",
        help="--trace: take the requests arriving from S seconds into the file (its own "
        "clock, after "
        "--time-scale), their times shifted to start at 0; with --seconds N, those "
        "in [S, S+N). "
        f"{load_flag} with --trace scales the window's times so that its mean rate "
        "is that load "
        "x the engines' capacity at its requests' mean service time "
        "(docs/simulate.md)",
    )


def trace_window(args, load: float | None, load_flag: str) -> TraceWindow | None:
    """The window of the trace file that --start, --seconds and the load (given as ``load``, None
    when left out; ``load_flag`` names it) ask for (None without --trace; the load is of the engines
    build_trace is given). ValueError, one line, for what a trace file cannot take: --requests (a
    window is in seconds), --start without --trace, and a load beside --time-scale (both would set
    the file's rate)."""
    if not args.trace:
        if args.start is not None:
            raise ValueError("--start applies only with --trace")
        return None
    return TraceWindow.asked(
        args.start,
        args.seconds,
        load,
        requests=args.requests,
        time_scale=args.time_scale,
        names=WindowNames(load=load_flag),
    )


def add_dataset_flags(p: argparse.ArgumentParser, what: str) -> None:
    """--dataset and --dataset-tokens (``what``: what the command does with the rows, for the
    help)."""
    p.add_argument(
        "--dataset",
        metavar="FILE",
        help="a ShareGPT JSON or JSONL file (or JSONL of prompt with output_tokens or "
        f"completion): {what}, rows drawn by --seed (docs/simulate.md)",
    )
    p.add_argument(
        "--dataset-tokens",
        choices=COUNTS,
        default="pieces",
        help="how --dataset's texts are counted: pieces (GPT-2's pre-tokenizer pieces, "
        "close to a BPE count for English; default) or bytes (exact for qlab's "
        "byte tokenizer)",
    )


def dataset_from_args(args) -> Dataset | None:
    """The dataset --dataset names (None: none); ValueError, in a line, for a file that cannot be
    used and for --trace beside it (a trace file brings its own lengths)."""
    if args.dataset is None:
        return None
    if args.trace:
        raise ValueError(
            "--dataset gives synthetic arrivals their lengths; a --trace file brings "
            "its own: give one or the other"
        )
    return read_dataset(args.dataset, args.dataset_tokens)
