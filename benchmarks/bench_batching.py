"""How fast does qsim simulate a batching engine? One event per step, so an hour of traffic in
seconds.

Target (issue 21, section 5): a one-hour trace of about 24,000 requests against a 256-sequence
batching engine simulates in under 10 s on one core, over 360x real time (BLIS, inference-sim's
simulator, reports about 200x). The trace: Poisson arrivals at 24,000 an hour, prompts lognormal
(median 512 tokens, sigma 0.8) and outputs of 64, 256 or 1,024 tokens (50 / 35 / 15 %: a chat-like
mix, longer than the reference study's), on vLLM's defaults (256 sequences, 2,048 tokens a step,
chunked prefill, blocks of 16) with 8,000 KV blocks and a step model of a 7B-class model on one GPU
(8 ms + 0.05 ms a prompt token + 0.1 ms a sequence + 0.1 us a context token). Each policy's time is
the best of ``--repeat`` runs of process time (``simulate`` with its per-request frame; making the
trace is not timed), so other processes on the machine count little.

    PYTHONPATH=. python benchmarks/bench_batching.py            # 24,000 requests, best of 3
    PYTHONPATH=. python benchmarks/bench_batching.py --quick    # 2,400 requests (6 minutes of
    traffic), 1 run PYTHONPATH=. python benchmarks/bench_batching.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from qsim import PRESETS, Batching, ServerConfig, StepModel, make_trace, simulate
from qsim.mixes import Mix, Prompts

TARGET_S = 10.0  # an hour's trace, on one core
TARGET_SPEEDUP = 360.0  # simulated seconds per wall-clock second
ENGINE = Batching(StepModel(b0=0.008, b1=5e-5, b2=1e-4, b3=1e-7), max_num_seqs=256, kv_blocks=8000)
MIX = Mix((64, 256, 1024), (0.5, 0.35, 0.15))
PROMPTS = "lognormal:512:0.8"
PER_HOUR = 24_000


def trace(requests: int, seed: int = 1):
    return make_trace(
        "poisson",
        load=1.0,
        requests=requests,
        seed=seed,
        mix=MIX,
        prompts=Prompts.parse(PROMPTS),
        capacity_rps=PER_HOUR / 3600,
    )


def best_of(repeat: int, fn, *args) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.process_time()
        out = fn(*args)
        best = min(best, time.process_time() - start)
    return best, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the hour, one run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    requests = PER_HOUR // 10 if args.quick else PER_HOUR
    repeat = 1 if args.quick else args.repeat
    t = trace(requests)
    simulated = float(t.arrival_s[-1])
    rows = []
    for name in ("none", "predictive", "predictive-kv"):
        seconds, frame = best_of(repeat, simulate, t, ServerConfig(PRESETS[name], ENGINE))
        scaled = seconds * PER_HOUR / requests  # an hour's worth at this rate
        rows.append(
            {
                "policy": name,
                "requests": requests,
                "simulated_s": simulated,
                "cpu_s": seconds,
                "hour_cpu_s": scaled,
                "speedup": simulated / seconds,
                "preempted": int(frame["preemptions"].fillna(0).gt(0).sum()),
                "verdict": "PASS"
                if scaled < TARGET_S and simulated / seconds > TARGET_SPEEDUP
                else "MISS",
            }
        )
    if args.json:
        print(
            json.dumps(
                {"target_s": TARGET_S, "target_speedup": TARGET_SPEEDUP, "rows": rows}, indent=2
            )
        )
        return 0
    print(
        f"batching engine, {requests:,} requests over {simulated:,.0f} simulated s "
        f"({'quick: a tenth of the hour' if args.quick else 'one hour'}), best of {repeat} "
        "(process time)"
    )
    for r in rows:
        print(
            f"  {r['policy']:<14} {r['cpu_s']:7.2f} s  ({r['hour_cpu_s']:5.2f} s an hour's "
            "trace, "
            f"{r['speedup']:6.0f}x real time, {r['preempted']} preempted)  target < {TARGET_S:g} "
            "s, "
            f"> {TARGET_SPEEDUP:g}x: {r['verdict']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
