"""How much does batching buy on GPT-2? Tokens a second of the batched engine at batch 1, 2, 4, 8,
against batch 1.

For each batch size B, B sequences (prompts of ``--prompt-tokens`` tokens less 0..7, so that rows
are padded, ``--new-tokens`` each) join :class:`live.gpt2_batch.BatchedGPT2` together, compute their
prompts in one step (a pass each) and decode to the end, one batched forward pass per step. Each run
also says whether every sequence got the tokens it gets decoded alone (greedy; on CUDA, batched
kernels may round differently and flip a near tie). Reported per B: tokens generated per second of
step time, over the whole run and over the decode steps alone, and each as a ratio to B = 1 measured
in the same run; the best of ``--repeat`` runs. The one-at-a-time engine
(:class:`live.gpt2.GPT2Engine`) on the same prompt is the reference line. Nothing is asserted on
speed: the numbers are measured and printed.

    PYTHONPATH=. python benchmarks/bench_gpt2_batch.py                    # GPT-2 small, random
    weights; cuda if there PYTHONPATH=. python benchmarks/bench_gpt2_batch.py --quick            #
    tiny model, short runs PYTHONPATH=. python benchmarks/bench_gpt2_batch.py --device cpu --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Measured:
    batch: int
    tokens: int
    seconds: float
    decode_seconds: float
    tokens_per_s: float
    decode_tokens_per_s: float
    matches_alone: bool
    ratio: float = float("nan")
    decode_ratio: float = float("nan")


#: Distinct prompts (the base prompt less 0..SHIFTS-1 of its first tokens); sequence i of a batch
#: gets i mod SHIFTS.
SHIFTS = 8


def one_run(
    engine, prompts: list[list[int]], alone: list[list[int]], batch: int, new_tokens: int
) -> Measured:
    for i in range(batch):
        engine.add(i, prompts[i % SHIFTS], new_tokens)
    got: dict[int, list[int]] = {i: [] for i in range(batch)}
    seconds, decode_s, first = 0.0, 0.0, True
    while len(engine):
        result = engine.step()
        seconds += result.seconds
        if not first:
            decode_s += result.seconds
        first = False
        for i, out in result.outputs.items():
            got[i].append(out.token)
    tokens = batch * new_tokens
    decode_tokens = batch * (new_tokens - 1)  # the first token of each comes from the prompt's step
    return Measured(
        batch,
        tokens,
        seconds,
        decode_s,
        tokens / seconds,
        decode_tokens / decode_s if decode_s else 0.0,
        all(got[i] == alone[i % SHIFTS] for i in range(batch)),
    )


def best(engine, prompts, alone, batch, new_tokens, repeat) -> Measured:
    runs = [one_run(engine, prompts, alone, batch, new_tokens) for _ in range(repeat)]
    fastest = max(runs, key=lambda m: m.tokens_per_s)
    return Measured(**{**asdict(fastest), "matches_alone": all(m.matches_alone for m in runs)})


def solo_tokens_per_s(solo, prompt: str, new_tokens: int, repeat: int) -> float:
    return max(new_tokens / solo.run(prompt, new_tokens).engine_s for _ in range(repeat))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help="tiny, random (GPT-2 small, random weights; the default) or a local model",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument(
        "--batches", default="1,2,4,8", help="batch sizes, comma-separated (default 1,2,4,8)"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=None, help="prompt length (default 64; --quick 16)"
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="tokens each sequence generates (default 64; --quick 16)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="runs per batch size, best kept (default 3; --quick 1)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="the tiny model and short runs (a smoke test)"
    )
    parser.add_argument(
        "--json", action="store_true", help="one JSON object on stdout instead of the table"
    )
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        if not batches or min(batches) < 1:
            raise ValueError
    except ValueError:
        print(
            "bench_gpt2_batch: --batches must be positive integers, comma-separated, got "
            f"{args.batches!r}",
            file=sys.stderr,
        )
        return 2
    quick = args.quick
    model = args.model or ("tiny" if quick else "random")
    prompt_tokens = args.prompt_tokens or (16 if quick else 64)
    new_tokens = args.new_tokens or (16 if quick else 64)
    repeat = args.repeat or (1 if quick else 3)

    # torch: imported only once the arguments are good
    from live.gpt2 import GPT2Engine, GPT2Spec, load
    from live.gpt2_batch import BatchedGPT2

    spec = GPT2Spec(model, args.device, threads=args.threads)
    try:
        loaded = load(spec)
    except ValueError as exc:
        print(f"bench_gpt2_batch: {exc}", file=sys.stderr)
        return 2
    engine, solo = BatchedGPT2(spec, loaded), GPT2Engine(spec, loaded)
    prompt = "The queue in front of the engine " * prompt_tokens
    prompt_ids = engine.encode(prompt, new_tokens)[-prompt_tokens:]
    prompts = [prompt_ids[min(i, len(prompt_ids) - 1) :] for i in range(SHIFTS)]
    began = time.perf_counter()
    engine.warmup()
    solo.warmup(rounds=1)
    ref = solo_tokens_per_s(solo, engine.tokenizer.decode(prompt_ids), new_tokens, repeat)
    alone = [solo.greedy_ids(p, new_tokens) for p in prompts[: min(SHIFTS, max(batches))]]
    rows = [best(engine, prompts, alone, b, new_tokens, repeat) for b in batches]
    base = next((m for m in rows if m.batch == 1), None) or best(
        engine, prompts, alone, 1, new_tokens, repeat
    )
    rows = [
        Measured(
            **{
                **asdict(m),
                "ratio": m.tokens_per_s / base.tokens_per_s,
                "decode_ratio": m.decode_tokens_per_s / base.decode_tokens_per_s,
            }
        )
        for m in rows
    ]
    info = {
        "model": model,
        "device": engine.device,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": new_tokens,
        "repeat": repeat,
        "one_at_a_time_tokens_per_s": ref,
        "seconds": time.perf_counter() - began,
        "rows": [asdict(m) for m in rows],
    }
    if args.json:
        print(json.dumps(info))
        return 0
    print(
        f"batched GPT-2 ({model}, {engine.device}): {len(prompt_ids)} prompt tokens, "
        f"{new_tokens} new tokens a "
        f"sequence, best of {repeat}"
    )
    print(f"one at a time (GPT2Engine): {ref:.1f} tokens/s")
    print(
        f"{'batch':>5} {'tokens/s':>10} {'ratio':>6} {'decode tok/s':>13} {'ratio':>6}  tokens "
        "as alone"
    )
    for m in rows:
        print(
            f"{m.batch:>5} {m.tokens_per_s:>10.1f} {m.ratio:>6.2f} "
            f"{m.decode_tokens_per_s:>13.1f} "
            f"{m.decode_ratio:>6.2f}  {'yes' if m.matches_alone else 'NO'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
