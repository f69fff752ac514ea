"""How fast does qsim simulate a fleet of batching replicas, and does its cost stay linear in N?

Targets (issue 31, item 7), each in this process's CPU time (time.process_time), best of
``--repeat`` runs (making the trace is not timed):

* hour: 16 batching replicas behind ``power_of_d`` for one hour at 16x the rate of the Azure
  LLM inference trace in ``data/`` (the hour replayed 16 times as fast, back to back for an hour:
  about 141,000 requests, each replica at the trace's own rate) simulate in under 60 s.
* linear: 16, 64 and 256 replicas at that same load per replica for ``--seconds``: N copies of
  the hour at once, copy k shifted along it by k / N of the hour (so that any stretch of time sees
  the whole hour's mix, at N x its rate); the CPU time per step (the simulator's unit of work:
  one event per step per replica) at 64 and 256 within 1.5x of 16's. The time per request is
  printed beside it: it also counts how many steps a request takes, which is the trace's (how
  its requests share steps), not the simulator's.

The baseline, measured in the same run: one batching engine without a fleet at the trace's rate
(the load of each replica), per step: a fleet's cost per step over it is what routing and the
fleet's bookkeeping add. The engine is bench_batching.py's (vLLM's defaults, 8,000 KV blocks,
a 7B-class step model on one GPU).

    PYTHONPATH=. python benchmarks/bench_fleet.py            # the hour, N of 16/64/256 for 60 s
    PYTHONPATH=. python benchmarks/bench_fleet.py --quick    # a tenth of each, 1 run
    PYTHONPATH=. python benchmarks/bench_fleet.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.bench_batching import ENGINE, best_of
from qsim import REFERENCE_MIX, PRESETS, ServerConfig, load_trace, simulate
from qsim.routers import PowerOfD
from qsim.trace import Trace, assemble_trace

AZURE = Path(__file__).resolve().parents[1] / "data" / "azure_llm_2023_code.csv"
HOUR_S = 3600.0
TARGET_S = 60.0  # 16 replicas, an hour at 16x the trace's rate, on one core
TARGET_LINEAR = 1.5  # cost per request at N over at 16
REPLICAS = (16, 64, 256)
ROUTER = PowerOfD(2)  # a router that reads d replicas, not N: what a large fleet runs


def azure(speedup: int, copies: int, seconds: float) -> Trace:
    """The Azure hour replayed ``speedup`` times as fast, ``copies`` of it at once (each shifted
    along the replay by its share of it, so that every stretch of time sees the same mix of the
    hour), back to back up to ``seconds``: ``speedup`` x ``copies`` the trace's rate."""
    one = load_trace(AZURE, time_scale=1.0 / speedup)
    span = HOUR_S / speedup
    shifted = [(one.arrival_s + k * span / copies) % span for k in range(copies)]
    order = np.argsort(np.concatenate(shifted), kind="stable")
    laps = int(np.ceil(seconds / span))
    arrival = np.concatenate([np.sort(np.concatenate(shifted)) + k * span for k in range(laps)])
    keep = arrival < seconds
    tile = lambda a: np.tile(np.tile(a, copies)[order], laps)[keep]  # noqa: E731
    return assemble_trace(
        arrival[keep],
        tile(one.max_new_tokens),
        tile(one.est_service_s),
        tile(one.true_service_s),
        mix=REFERENCE_MIX,
        duration_s=seconds,
        name=f"azure x{speedup * copies}",
        meta={},
        prompt_tokens=tile(one.prompt_tokens),
    )


def timed(trace: Trace, replicas: int, repeat: int) -> dict:
    config = ServerConfig(PRESETS["none"], ENGINE)
    fleet = {} if replicas == 1 else {"replicas": replicas, "router": ROUTER}
    seconds, frame = best_of(repeat, lambda: simulate(trace, config, **fleet))
    good = float((frame["outcome"] == "good").mean())
    steps = frame.attrs["steps"]
    return {
        "replicas": replicas,
        "requests": len(trace),
        "simulated_s": trace.duration_s,
        "steps": steps,
        "cpu_s": seconds,
        "us_per_request": 1e6 * seconds / len(trace),
        "us_per_step": 1e6 * seconds / steps,
        "good": good,
    }


def run(quick: bool, repeat: int, seconds: float) -> dict:
    share = 0.1 if quick else 1.0
    base = timed(azure(1, 1, HOUR_S * share), 1, repeat)
    hour = timed(azure(16, 1, HOUR_S * share), 16, repeat)
    hour["hour_cpu_s"] = hour["cpu_s"] / share
    hour["over_baseline"] = hour["us_per_step"] / base["us_per_step"]
    hour["verdict"] = "PASS" if hour["hour_cpu_s"] < TARGET_S else "MISS"
    rows = [timed(azure(1, n, seconds * share), n, repeat) for n in REPLICAS]
    for row in rows:
        row["over_16"] = row["us_per_step"] / rows[0]["us_per_step"]
        row["request_over_16"] = row["us_per_request"] / rows[0]["us_per_request"]
    worst = max(row["over_16"] for row in rows)
    return {
        "baseline": base,
        "hour": hour,
        "linear": rows,
        "worst_over_16": worst,
        "linear_verdict": "PASS" if worst <= TARGET_LINEAR else "MISS",
        "target_s": TARGET_S,
        "target_linear": TARGET_LINEAR,
        "router": "power_of_d:2",
    }


def report(data: dict, quick: bool) -> None:
    base, hour = data["baseline"], data["hour"]
    part = "quick: a tenth of the hour" if quick else "one hour"
    print(f"batching fleet on the Azure trace ({part}), router {data['router']}, process time")
    print(
        f"  baseline: 1 engine, no fleet, {base['requests']:,} requests: {base['cpu_s']:.2f} s "
        f"({base['us_per_request']:.0f} us a request, {base['us_per_step']:.1f} us a step)"
    )
    print(
        f"  16 replicas at 16x: {hour['requests']:,} requests, {hour['cpu_s']:.2f} s "
        f"({hour['hour_cpu_s']:.1f} s an hour; {hour['us_per_step']:.1f} us a step, "
        f"{hour['over_baseline']:.2f}x the baseline's; good {hour['good']:.3f})  "
        f"target < {data['target_s']:g} s: {hour['verdict']}"
    )
    for row in data["linear"]:
        print(
            f"  {row['replicas']:>4} replicas: {row['requests']:>7,} requests over "
            f"{row['simulated_s']:g} s, {row['cpu_s']:6.2f} s; {row['us_per_step']:4.1f} us a "
            "step "
            f"({row['over_16']:.2f}x 16's), {row['us_per_request']:4.0f} us a request "
            f"({row['request_over_16']:.2f}x)"
        )
    print(
        f"  linear: worst {data['worst_over_16']:.2f}x 16's per step, target <= "
        f"{data['target_linear']:g}x: {data['linear_verdict']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of each run, one run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="simulated seconds of each linearity run (default 60)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    data = run(args.quick, 1 if args.quick else args.repeat, args.seconds)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        report(data, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
