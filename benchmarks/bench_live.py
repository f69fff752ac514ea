"""How fast does the live gate say no, and how punctual is the load generator?

Against real ``qlab serve`` subprocesses (synthetic engine, loopback); figures
are printed, never asserted:

1. Time to a refusal under a sustained 2x overload (Poisson at twice the
   calibrated capacity, policies ``bounded`` and ``predictive``): p50 and p99
   of the client-measured time from send to the complete 503. Targets: p50 < 1 ms,
   p99 < 3 ms.
2. The same for bursts of 30 at once (the queue drains between bursts).
   Target: p99 < 15 ms.
3. The load generator's send lateness at 200 requests/s (Poisson) against a
   server fast enough to answer all (synthetic engine at 1 % of the reference time).

Each refusal time is measured by two clients. "replayer" is ``qlab replay``
itself (httpx), driving the load: its figures include httpx's own cost, about
1 ms of CPU per request, which in a burst of 30 adds up to tens of
milliseconds before the last request's bytes leave. "lean" is
benchmarks/lean.py's client (raw HTTP/1.1 on connections opened before the
timed write, answers parsed by httptools): it shows what the service itself
takes. In the sustained case the lean client probes every 20 ms from the
replayer's own event loop while the replayer holds the overload (so its
figures include waits behind the replayer's work); the bursts run it alone on
uvloop. Both clients and the servers share the machine's cores.

    PYTHONPATH=. python benchmarks/bench_live.py            # ~2.5 minutes
    PYTHONPATH=. python benchmarks/bench_live.py --quick    # ~45 s smoke run
    PYTHONPATH=. python benchmarks/bench_live.py --json
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import bench_main
from benchmarks.lean import Lean, client_loop
from live.loadgen import ReplayConfig, lateness, replay, replay_async
from live.procs import serving
from live.serve_options import ServeOptions
from qsim import REFERENCE_MIX, ServiceModel, make_trace


@dataclass(frozen=True)
class Sizes:
    sustained_s: float
    bursts: int
    burst_period_s: float
    lateness_s: float


FULL = Sizes(sustained_s=20.0, bursts=6, burst_period_s=2.5, lateness_s=15.0)
QUICK = Sizes(sustained_s=4.0, bursts=2, burst_period_s=2.0, lateness_s=3.0)


def quantiles(seconds) -> dict:
    values = pd.Series(seconds, dtype=float)
    return {
        "refusals": int(len(values)),
        "p50_ms": float(values.quantile(0.5) * 1e3),
        "p99_ms": float(values.quantile(0.99) * 1e3),
        "max_ms": float(values.max() * 1e3),
    }


def refusal_times(frame: pd.DataFrame) -> pd.Series:
    """Client-measured seconds from send to a complete 503 (refusals at arrival)."""
    return frame.loc[frame["outcome"] == "rejected", "latency_s"]


async def _probe_while(url: str, until: asyncio.Future, every_s: float = 0.02) -> list[float]:
    """Probe every ``every_s`` until ``until`` is done; the refusals' times (a 503 after a wait
    is not one)."""
    lean = Lean(url)
    data = lean.request("POST", "/v1/generate", {"prompt": "probe", "max_new_tokens": 64})
    tasks = []
    while not until.done():
        tasks.append(asyncio.create_task(lean.send(data)))
        await asyncio.sleep(every_s)
    replies = [reply for reply, _ in await asyncio.gather(*tasks)]
    lean.close()
    return [r.seconds for r in replies if r.outcome == "rejected"]


async def _sustained(url: str, seconds: float) -> dict:
    trace = make_trace("poisson", load=2.0, seconds=seconds, seed=1)
    load = asyncio.ensure_future(replay_async(trace, ReplayConfig(url)))
    await asyncio.sleep(min(2.0, seconds / 3))  # let the queue fill first
    lean = await _probe_while(url, load)
    frame = await load
    return {
        "replayer": quantiles(refusal_times(frame)),
        "lean": quantiles(lean),
        "send_p99_ms": lateness(frame)["p99_s"] * 1e3,
    }


async def _lean_bursts(url: str, count: int, period_s: float) -> list[float]:
    lean = Lean(url)
    data = lean.request("POST", "/v1/generate", {"prompt": "burst", "max_new_tokens": 16})
    out = []
    for _ in range(count):
        conns = [await lean.connect() for _ in range(30)]
        # exchange() writes before its first await: all 30 are written before the first answer is
        # read.
        answers = await asyncio.gather(*(lean.exchange(c, data) for c in conns))
        out += [reply.seconds for reply, _ in answers if reply.outcome == "rejected"]
        lean.close()
        await asyncio.sleep(period_s)  # the admitted drain
    return out


def bursts(url: str, count: int, period_s: float) -> dict:
    trace = make_trace(f"periodic:30:{period_s:g}", requests=30 * count, seed=1)
    # a burst leaves over some ms by nature
    frame = replay(trace, ReplayConfig(url, late_warn_s=0.05))
    time.sleep(period_s)
    with asyncio.Runner(loop_factory=client_loop()) as runner:
        lean = runner.run(_lean_bursts(url, count, period_s))
    return {
        "replayer": quantiles(refusal_times(frame)),
        "lean": quantiles(lean),
        "send_p99_ms": lateness(frame)["p99_s"] * 1e3,
    }


def punctuality(url: str, seconds: float, rate: float = 200.0) -> dict:
    model = ServiceModel()
    # make_trace's load is relative to the reference capacity
    load = rate * REFERENCE_MIX.mean_s(model)
    frame = replay(make_trace("poisson", load=load, seconds=seconds, seed=2), ReplayConfig(url))
    late = frame["send_lateness_s"]
    return {
        "rate_per_s": len(frame) / seconds,
        "requests": len(frame),
        "p50_ms": late.quantile(0.5) * 1e3,
        "p99_ms": late.quantile(0.99) * 1e3,
        "max_ms": late.max() * 1e3,
        "errors": int((frame["outcome"] == "error").sum()),
    }


def run(sizes: Sizes) -> dict:
    options = [
        ServeOptions(policy="bounded"),
        ServeOptions(policy="predictive"),
        ServeOptions(policy="none", speed=0.01),
    ]
    results: dict = {}
    with (
        tempfile.TemporaryDirectory() as logs,
        serving(options, logs, 120) as (bounded, predictive, fast),
    ):
        for server in (bounded, predictive):
            policy = server.options.policy
            results[f"sustained 2x, {policy}"] = asyncio.run(
                _sustained(server.url, sizes.sustained_s)
            )
            results[f"burst of 30, {policy}"] = bursts(
                server.url, sizes.bursts, sizes.burst_period_s
            )
        results["send lateness at 200/s"] = punctuality(fast.url, sizes.lateness_s)
    return results


def report(results: dict) -> None:
    print("time to a refusal (send to the complete 503), milliseconds:")
    rows = []
    for case, r in results.items():
        if case.startswith("send"):
            continue
        for client in ("replayer", "lean"):
            rows.append({"case": case, "client": client, **r[client]})
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print("targets: sustained p50 < 1 ms and p99 < 3 ms; burst p99 < 15 ms")
    late = results["send lateness at 200/s"]
    print(
        f"\nload generator at {late['rate_per_s']:.0f} requests/s ({late['requests']} requests, "
        f"{late['errors']} errors): send lateness p50 {late['p50_ms']:.2f} ms, p99 "
        f"{late['p99_ms']:.2f} ms, "
        f"max {late['max_ms']:.2f} ms"
    )


def main(argv=None) -> int:
    return bench_main(__doc__, run, report, QUICK, FULL, argv)


if __name__ == "__main__":
    sys.exit(main())
