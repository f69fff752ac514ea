"""``qlab simulate``'s engine options, written once: the engine model (K engines one at a time, with
a concurrency slowdown, or one batching engine), prompt lengths, and the objectives on time to first
token and time per token.

A batching engine's ``--load`` is of its saturated throughput
(:meth:`qsim.engines.Batching.capacity_rps`), as in a sweep with a ``[batching]`` table.
"""

from __future__ import annotations

import argparse
import dataclasses

from inputs.argtypes import non_negative
from inputs.run_axes import AXES, flag_help
from inputs.batchflags import BATCHING_HELP, BATCHING_ONLY, add_batching_flags, batching_engine
from qsim.engines import Batching, OneAtATime
from qsim.service import LoadTerms
from qsim.mixes import Prompts, SharedPrefix


def prompts_spec(text: str) -> Prompts:
    try:
        return Prompts.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def system_spec(text: str) -> tuple[int, float]:
    try:
        return SharedPrefix.parse_system(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def turns_spec(text: str) -> tuple[int, int]:
    try:
        return SharedPrefix.parse_turns(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the engine model (default: --engines K, one request each at a time)")
    g.add_argument(
        "--concurrency",
        type=non_negative,
        help="engines one at a time: a run takes x (1 + C (busy - 1)) with that many "
        "engines busy "
        "(default: the --service-model calibration's, measured under load; else 0)",
    )
    g.add_argument(
        "--batching",
        action="store_true",
        help=BATCHING_HELP + "; --load is then of its saturated throughput",
    )
    add_batching_flags(g, simulated=True)
    g.add_argument(
        "--prompts",
        type=prompts_spec,
        metavar="SPEC",
        help="prompt lengths: none, fixed:N, uniform:LOW:HIGH or lognormal:MEAN:SIGMA "
        "(default none)",
    )
    g.add_argument(
        "--system-prompt",
        type=system_spec,
        metavar="S:P",
        help=flag_help("system_prompt"),
    )
    g.add_argument(
        "--turns",
        type=turns_spec,
        metavar="T[:C]",
        help=flag_help("turns"),
    )
    for name in ("ttft_slo_s", "tpot_slo_s"):  # a sweep's axes too (inputs.run_axes)
        g.add_argument(
            "--" + name.removesuffix("_s").replace("_", "-"),
            type=AXES[name].number,
            metavar="SECONDS",
            help=flag_help(name),
        )


def calibrated_defaults(args) -> None:
    """--concurrency and --noise where they are not given: what the --service-model calibration
    measured under load (:class:`qsim.service.LoadTerms`; a batching engine takes no concurrency
    term), else 0; with --batching, --step where it is not given: the calibration's fitted step
    model, where it has one."""
    terms = LoadTerms.load(args.service_model)
    if args.batching and args.step is None:
        args.step = terms.step
    if args.batching and getattr(args, "front_end", None) is None:
        args.front_end = terms.front_end
    if args.concurrency is None:
        args.concurrency = 0.0 if args.batching else terms.concurrency
    if args.noise is None:
        args.noise = terms.noise_cv or 0.0


def engine_from_args(args) -> OneAtATime | Batching:
    """The engine the options describe; ValueError for a batching option without --batching (or
    the reverse)."""
    settings = {k: getattr(args, k) for k in BATCHING_ONLY}
    batching = batching_engine(
        args.batching,
        settings,
        args.no_chunked_prefill,
        getattr(args, "prefix_caching", False),
        getattr(args, "front_end", None),
    )
    if batching is None:
        return OneAtATime(args.engines, args.concurrency or 0.0)
    if args.engines != 1 or args.concurrency:
        raise ValueError("--batching runs one batching engine: drop --engines and --concurrency")
    return batching


def trace_options(args, engine, mix, model, dataset=None) -> dict:
    """build_trace's options for the engine: prompt lengths (``dataset``: a
    :class:`qsim.datasets.Dataset`'s, with its output lengths), and a batching engine's rate (load x
    its capacity)."""
    options = {} if args.prompts is None else {"prompts": args.prompts}
    if dataset is not None:
        options["dataset"] = dataset
    shared = shared_prefix(args)
    if shared is not None:
        if args.trace:
            raise ValueError("--system-prompt and --turns apply to synthetic arrivals only")
        options["prefixes"] = shared
    if isinstance(engine, Batching) and args.trace and args.load is not None:
        raise ValueError(
            "--load with --trace and --batching: a trace file's rate is scaled to "
            "engines x their "
            "one-at-a-time capacity, not a batch's; give the file's own rate "
            "(--time-scale)"
        )
    if isinstance(engine, Batching) and not args.trace:
        if args.service != "mix":
            raise ValueError(
                "--batching needs --service mix: a batching engine's steps count tokens"
            )
        mean_tokens = float(sum(s * p for s, p in zip(mix.sizes, mix.probs)))
        mean_prompt = 0.0 if args.prompts is None else args.prompts.mean()
        if dataset is not None:  # its rows are the sizes and the prompts
            mean_tokens = float(dataset.output_tokens.mean())
            mean_prompt = float(dataset.prompt_tokens.mean())
        options["capacity_rps"] = engine.capacity_rps(mean_prompt, mean_tokens)
    return options


def shared_prefix(args) -> SharedPrefix | None:
    """The prompts' shared prefixes --system-prompt and --turns describe (None: neither given)."""
    system, turns = getattr(args, "system_prompt", None), getattr(args, "turns", None)
    if system is None and turns is None:
        return None
    return SharedPrefix(*(system or (0, 0.0)), *(turns or (1, 1)))


def describe(engine) -> str:
    """The engine in a few words, for simulate's header line."""
    if isinstance(engine, OneAtATime):
        slower = f" (concurrency {engine.concurrency:g})" if engine.concurrency else ""
        return f"{engine.engines} engine(s){slower}"
    kv = (
        "unlimited KV"
        if engine.kv_blocks is None
        else (f"{engine.kv_blocks} KV blocks of {engine.block_size}")
    )
    chunked = "" if engine.chunked_prefill else ", no chunked prefill"
    chunked += ", prefix caching" if engine.prefix_caching else ""
    fe = engine.front_end
    chunked += (
        ""
        if fe is None
        else (
            f", a front end of {fe.request_s * 1e3:g} ms a request, "
            f"{fe.step_s * 1e3:g} ms a step, {fe.token_s * 1e3:g} ms a "
            "token"
        )
    )
    return (
        f"a batching engine ({engine.max_num_seqs} seqs, {engine.max_num_batched_tokens} "
        "tokens a step, "
        f"{kv}{chunked})"
    )


def with_objectives(policy, args):
    """The policy with the objectives the options set."""
    changes = {
        k: v
        for k, v in (("ttft_slo_s", args.ttft_slo), ("tpot_slo_s", args.tpot_slo))
        if v is not None
    }
    return dataclasses.replace(policy, **changes) if changes else policy
