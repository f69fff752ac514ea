"""``qlab simulate``'s engine options, written once: the engine model (K engines one at a time, with a concurrency
slowdown, or one batching engine), prompt lengths, and the objectives on time to first token and time per token.

A batching engine's ``--load`` is of its saturated throughput (:meth:`qsim.engines.Batching.capacity_rps`), as in a
sweep with a ``[batching]`` table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from inputs.argtypes import non_negative, positive, positive_int
from qsim.engines import Batching, OneAtATime, StepModel
from qsim.workload import Prompts

STEP_FIELDS = ("b0", "b1", "b2", "b3", "cv")


def step_spec(text: str) -> StepModel:
    """``B0,B1,B2,B3[,CV]`` (seconds: fixed, per prefill token, per sequence, per context token) or a JSON file
    with those fields (b0 ... cv), e.g. a fitted step model."""
    path = Path(text)
    try:
        if path.suffix == ".json" or path.is_file():
            raw = json.loads(path.read_text())
            raw = raw.get("step", raw) if isinstance(raw, dict) else raw
            if not isinstance(raw, dict) or set(raw) - set(STEP_FIELDS):
                raise ValueError(f"{text}: a step model file holds {', '.join(STEP_FIELDS)}")
            return StepModel(**{k: float(v) for k, v in raw.items()})
        numbers = [float(v) for v in text.split(",")]
        if not 4 <= len(numbers) <= 5:
            raise ValueError("give B0,B1,B2,B3 or B0,B1,B2,B3,CV")
        return StepModel(*numbers)
    except (OSError, json.JSONDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read step model {text}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"bad step model {text!r}: {exc}") from None


def prompts_spec(text: str) -> Prompts:
    try:
        return Prompts.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the engine model (default: --engines K, one request each at a time)")
    g.add_argument("--concurrency", type=non_negative, default=0.0,
                   help="engines one at a time: a run takes x (1 + C (busy - 1)) with that many engines busy")
    g.add_argument("--batching", action="store_true",
                   help="one engine that batches as vLLM's v1 scheduler (qsim.engines.Batching); --load is then of "
                        "its saturated throughput")
    g.add_argument("--step", type=step_spec, metavar="B0,B1,B2,B3[,CV] | FILE.json",
                   help="the batching engine's step model: seconds = B0 + B1 prefill tokens + B2 sequences + B3 "
                        f"context tokens (default {StepModel().b0:g},{StepModel().b1:g},{StepModel().b2:g},"
                        f"{StepModel().b3:g})")
    g.add_argument("--max-num-seqs", type=positive_int, help="at most this many running (vLLM's; default 256)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, help="tokens a step computes (default 2048)")
    g.add_argument("--no-chunked-prefill", action="store_true", help="a prompt must fit one step's token budget")
    g.add_argument("--kv-blocks", type=positive_int, help="KV memory in blocks (default unlimited)")
    g.add_argument("--block-size", type=positive_int, help="tokens per KV block (default 16)")
    g.add_argument("--prompts", type=prompts_spec, metavar="SPEC",
                   help="prompt lengths: none, fixed:N, uniform:LOW:HIGH or lognormal:MEAN:SIGMA (default none)")
    g.add_argument("--ttft-slo", type=positive, metavar="SECONDS",
                   help="objective on time to first token: a request is good only if it meets it too")
    g.add_argument("--tpot-slo", type=positive, metavar="SECONDS", help="objective on time per output token")


BATCHING_ONLY = ("step", "max_num_seqs", "max_num_batched_tokens", "kv_blocks", "block_size")


def engine_from_args(args) -> OneAtATime | Batching:
    """The engine the options describe; ValueError for a batching option without --batching (or the reverse)."""
    given = [name for name in BATCHING_ONLY if getattr(args, name) is not None]
    if args.no_chunked_prefill:
        given.append("no_chunked_prefill")
    if not args.batching:
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is a batching engine's: add --batching")
        return OneAtATime(args.engines, args.concurrency)
    if args.engines != 1 or args.concurrency:
        raise ValueError("--batching runs one batching engine: drop --engines and --concurrency")
    fields = {k: getattr(args, k) for k in BATCHING_ONLY if getattr(args, k) is not None}
    if args.no_chunked_prefill:
        fields["chunked_prefill"] = False
    return Batching(**fields)


def trace_options(args, engine, mix, model) -> dict:
    """build_trace's options for the engine: prompt lengths, and a batching engine's rate (load x its capacity)."""
    options = {} if args.prompts is None else {"prompts": args.prompts}
    if isinstance(engine, Batching) and args.trace and args.load is not None:
        raise ValueError("--load with --trace and --batching: a trace file's rate is scaled to engines x their "
                         "one-at-a-time capacity, not a batch's; give the file's own rate (--time-scale)")
    if isinstance(engine, Batching) and not args.trace:
        if args.service != "mix":
            raise ValueError("--batching needs --service mix: a batching engine's steps count tokens")
        mean_tokens = float(sum(s * p for s, p in zip(mix.sizes, mix.probs)))
        mean_prompt = 0.0 if args.prompts is None else args.prompts.mean()
        options["capacity_rps"] = engine.capacity_rps(mean_prompt, mean_tokens)
    return options


def describe(engine) -> str:
    """The engine in a few words, for simulate's header line."""
    if isinstance(engine, OneAtATime):
        slower = f" (concurrency {engine.concurrency:g})" if engine.concurrency else ""
        return f"{engine.engines} engine(s){slower}"
    kv = "unlimited KV" if engine.kv_blocks is None else f"{engine.kv_blocks} KV blocks of {engine.block_size}"
    chunked = "" if engine.chunked_prefill else ", no chunked prefill"
    return (f"a batching engine ({engine.max_num_seqs} seqs, {engine.max_num_batched_tokens} tokens a step, "
            f"{kv}{chunked})")


def with_objectives(policy, args):
    """The policy with the objectives the options set."""
    changes = {k: v for k, v in (("ttft_slo_s", args.ttft_slo), ("tpot_slo_s", args.tpot_slo)) if v is not None}
    return dataclasses.replace(policy, **changes) if changes else policy
