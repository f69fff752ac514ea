"""The batching engine's options, written once for ``qlab simulate`` (and the commands that share
its engine flags,
:mod:`experiments.engineflags`) and ``qlab serve`` (:mod:`live.serve_options`): their names, help,
and the one function that turns them into a :class:`qsim.engines.Batching`.

Here, below both, because the live layer may not import experiments: the two commands read the same
table, so a setting is named, explained and checked in one place.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qsim.engines import Batching, FrontEnd, StepModel

from .argtypes import positive_int
from .run_axes import AXES, flag_help

BATCHING_HELP = "one engine that batches as vLLM's v1 scheduler (qsim.engines.Batching)"
NO_CHUNKED_PREFILL_HELP = "a prompt must fit one step's token budget"
PREFIX_CACHING_HELP = flag_help("prefix_caching")
STEP_METAVAR = "B0,B1,B2,B3[,CV] | FILE.json"
FRONT_END_HELP = (
    "an API process in front of the batching engine, as one FIFO core: seconds a "
    "request to take it in, seconds a token to stream it and seconds a step to "
    "handle "
    "its outputs (qsim.engines.FrontEnd), or a calibration's front_end (default: "
    "none; --service-model's where it has one)"
)


def _numbers_or_file(text: str, what: str, counts: tuple[int, ...], usage: str, build, from_file):
    """``text`` as comma-separated numbers (``counts`` of them, else ValueError ``usage``) given to
    ``build``, or a JSON file (a ``.json`` name, or a file that exists) given to ``from_file``;
    ValueError naming ``what`` and what is wrong."""
    path = Path(text)
    try:
        if path.suffix == ".json" or path.is_file():
            return from_file(json.loads(path.read_text()))
        numbers = [float(v) for v in text.split(",")]
        if len(numbers) not in counts:
            raise ValueError(usage)
        return build(*numbers)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {what} {text}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad {what} {text!r}: {exc}") from None


def parse_step(text: str) -> StepModel:
    """``B0,B1,B2,B3[,CV]`` (seconds: fixed, per prefill token, per sequence, per context token) or
    a JSON file with those fields (b0 ... cv), e.g. a fitted step model; ValueError naming what is
    wrong."""

    def from_file(raw):
        # a calibration's: its "step" key
        raw = raw.get("step", raw) if isinstance(raw, dict) else raw
        return StepModel.from_fields(raw)

    return _numbers_or_file(
        text, "step model", (4, 5), "give B0,B1,B2,B3 or B0,B1,B2,B3,CV", StepModel, from_file
    )


def parse_front_end(text: str) -> FrontEnd:
    """``REQUEST_S,TOKEN_S[,STEP_S]`` or a JSON file whose ``front_end`` key (a calibration's) holds
    them; ValueError naming what is wrong."""

    def from_file(raw):
        front = raw.get("front_end") if isinstance(raw, dict) else None
        if not isinstance(front, dict):
            raise ValueError(
                "it has no front_end table (qlab calibrate --engine-metrics writes one)"
            )
        return FrontEnd.from_fields(front)

    return _numbers_or_file(
        text,
        "front end",
        (2, 3),
        "give REQUEST_S,TOKEN_S or REQUEST_S,TOKEN_S,STEP_S",
        FrontEnd,
        from_file,
    )


def front_end_spec(text: str) -> FrontEnd:
    """:func:`parse_front_end` for argparse."""
    try:
        return parse_front_end(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def step_spec(text: str) -> StepModel:
    """:func:`parse_step` for argparse (a bad one is argparse's one-line error)."""
    try:
        return parse_step(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: Batching's settings that a flag sets: field -> (the flag's type, metavar, help).
BATCHING_FLAGS: dict[str, tuple] = {
    "step": (
        step_spec,
        STEP_METAVAR,
        "the batching engine's step model: seconds = B0 + B1 prefill tokens + B2 sequences + "
        "B3 context tokens "
        "(default "
        f"{StepModel().b0:g},{StepModel().b1:g},{StepModel().b2:g},{StepModel().b3:g})",
    ),
    # a sweep's axes too: their type and help are the axes' (inputs.run_axes)
    "max_num_seqs": (AXES["max_num_seqs"].number, None, flag_help("max_num_seqs")),
    "max_num_batched_tokens": (positive_int, None, "tokens a step computes (default 2048)"),
    "kv_blocks": (AXES["kv_blocks"].number, None, flag_help("kv_blocks")),
    "block_size": (positive_int, None, "tokens per KV block (default 16)"),
}
BATCHING_ONLY = tuple(BATCHING_FLAGS)


def add_batching_flags(group, simulated: bool = False) -> None:
    """Each of :data:`BATCHING_FLAGS` and ``--no-chunked-prefill`` on an argparse group
    (``--batching`` itself is the command's: what it does to the command's load differs);
    ``--prefix-caching`` and ``--front-end`` too where the engine is the simulator's (a live gate's
    upstream has its own)."""
    for name, (kind, metavar, text) in BATCHING_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), type=kind, metavar=metavar, help=text)
    group.add_argument("--no-chunked-prefill", action="store_true", help=NO_CHUNKED_PREFILL_HELP)
    if simulated:
        group.add_argument("--prefix-caching", action="store_true", help=PREFIX_CACHING_HELP)
        group.add_argument(
            "--front-end",
            type=front_end_spec,
            metavar="REQUEST_S,TOKEN_S[,STEP_S] | FILE.json",
            help=FRONT_END_HELP,
        )


def batching_engine(
    batching: bool,
    settings: dict,
    no_chunked_prefill: bool = False,
    prefix_caching: bool = False,
    front_end: FrontEnd | None = None,
) -> Batching | None:
    """The batching engine the options describe (None: not batching); ValueError naming the first
    batching option given without ``--batching``. settings: :data:`BATCHING_FLAGS`' fields, None
    where not given (``step`` a StepModel or its text)."""
    given = [name for name in BATCHING_ONLY if settings.get(name) is not None]
    if no_chunked_prefill:
        given.append("no_chunked_prefill")
    if prefix_caching:
        given.append("prefix_caching")
    if front_end is not None:
        given.append("front_end")
    if not batching:
        if given:
            raise ValueError(
                f"--{given[0].replace('_', '-')} is a batching engine's: add --batching"
            )
        return None
    fields = {k: settings[k] for k in BATCHING_ONLY if settings.get(k) is not None}
    if isinstance(fields.get("step"), str):
        fields["step"] = parse_step(fields["step"])
    if no_chunked_prefill:
        fields["chunked_prefill"] = False
    if prefix_caching:
        fields["prefix_caching"] = True
    if front_end is not None:
        fields["front_end"] = front_end
    return Batching(**fields)
