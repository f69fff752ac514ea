"""Do /stats reads of a full step log keep /healthz fast? (issue 32, section 3)

A batching gate (the synthetic batching engine, policy none) whose step log is full (200,000
synthetic steps, as after half an hour at 100 steps a second) is served by uvicorn in a child
process, as ``qlab serve`` serves it. This process then runs, for a fixed time, readers that each
read the whole step log again and again as the replayer does (``/stats?steps_since=0``, then every
page's ``step_log_next`` cursor), and one prober that sends ``GET /healthz`` every 10 ms, each on
connections of its own (the readers in a process of their own, so that parsing their pages does not
delay the prober's clock). The figure is the prober's client-measured p99, against a target of 50
ms; beside it, the same prober's p99 with no reader (the machine's floor), each /stats page's time
and size, and how long one whole log takes to read.

Before the step log was paged, one ``/stats?steps_since=0`` was 17 MB and held the event loop 1-1.4
s, so a /healthz behind it waited as long. Figures are printed, never asserted.

    PYTHONPATH=. python benchmarks/bench_endpoints.py            # ~20 s
    PYTHONPATH=. python benchmarks/bench_endpoints.py --quick    # ~5 s smoke run
    PYTHONPATH=. python benchmarks/bench_endpoints.py --json
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import bench_main
from benchmarks.floor import machine
from live.batching import STEP_LOG, STEP_PAGE, SyntheticBatchEngine
from live.commands import _bind, run_app
from live.gate import BatchGate, gate_config
from live.http_api import create_app
from qsim import PRESETS
from qsim.engines import Batching, StepModel
from qsim.runfile import LoggedStep

TARGET_MS = 50.0
PROBE_EVERY_S = 0.01


@dataclass(frozen=True)
class Size:
    seconds: float
    readers: int
    steps: int = STEP_LOG


QUICK = Size(seconds=3.0, readers=2)
FULL = Size(seconds=15.0, readers=4)


def _serve(sock, steps: int) -> None:
    """The child: a batching gate with ``steps`` synthetic steps in its log, served on ``sock``
    until killed."""
    engine = Batching(StepModel(), max_num_seqs=256, max_num_batched_tokens=8192)
    gate = BatchGate(SyntheticBatchEngine(engine.step), gate_config(PRESETS["none"], engine=engine))
    for i in range(steps):  # what a step's numbers are does not matter, only how many there are
        t = i * 0.01
        gate.driver.log_step(LoggedStep(t, t, t + 0.009, 0.009, 0.009, 512, 64, 20_000))
    run_app(create_app(gate), sock, "warning", "httptools", watch_stdin=False)


def _ms(values: list[float]) -> dict:
    a = np.asarray(values) * 1e3
    if not a.size:
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}
    return {
        "n": int(a.size),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "max_ms": float(a.max()),
    }


async def _read_log(
    client: httpx.AsyncClient, pages: list, sizes: list, until: float = math.inf
) -> int | None:
    """The whole step log, page by page as the replayer reads it; the steps read (None: ``until``
    came first)."""
    params, read = {"steps_since": "0"}, 0
    while True:
        if time.perf_counter() >= until:
            return None
        t0 = time.perf_counter()
        response = await client.get("/stats", params=params)
        pages.append(time.perf_counter() - t0)
        sizes.append(len(response.content))
        answer = response.json()
        read += len(answer["step_log"])
        if answer.get("step_log_next") is None:
            return read
        params = {"steps_from": str(answer["step_log_next"])}


async def _reader(url: str, until: float, pages: list, sizes: list, logs: list) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            steps = await _read_log(client, pages, sizes, until)
            if steps is not None:
                logs.append((time.perf_counter() - t0, steps))


async def _prober(url: str, until: float, times: list) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            response = await client.get("/healthz")
            response.raise_for_status()
            times.append(time.perf_counter() - t0)
            await asyncio.sleep(max(0.0, PROBE_EVERY_S - (time.perf_counter() - t0)))


async def _readers(url: str, until: float, n: int) -> tuple[list, list, list]:
    pages, sizes, logs = [], [], []
    await asyncio.gather(*(_reader(url, until, pages, sizes, logs) for _ in range(n)))
    return pages, sizes, logs


def _reading(url: str, until: float, n: int, out) -> None:
    """The readers' process: their JSON parsing must not delay the prober's clock (a process of its
    own)."""
    out.send(asyncio.run(_readers(url, until, n)))


def _measure(url: str, size: Size) -> dict:
    async def alone() -> tuple[float, int]:  # one read with nothing else going on first
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            pages: list = []
            t0 = time.perf_counter()
            await _read_log(client, pages, [])
            return time.perf_counter() - t0, len(pages)

    alone_s, alone_pages = asyncio.run(alone())
    floor: list = []  # /healthz with no reader: what this machine gives the prober anyway
    asyncio.run(_prober(url, time.perf_counter() + size.seconds / 2, floor))
    until = time.perf_counter() + size.seconds  # CLOCK_MONOTONIC: the same clock in every process
    mine, theirs = multiprocessing.get_context("fork").Pipe()
    readers = multiprocessing.get_context("fork").Process(
        target=_reading, args=(url, until, size.readers, theirs)
    )
    readers.start()
    probes: list = []
    asyncio.run(_prober(url, until, probes))
    pages, sizes, logs = mine.recv()
    readers.join(30)
    healthz = _ms(probes)
    verdict = "PASS" if healthz["p99_ms"] < TARGET_MS else "MISS"
    healthz.update(target_ms=TARGET_MS, verdict=verdict)
    page = {**_ms(pages), "mean_bytes": float(np.mean(sizes)) if sizes else 0.0}
    under_load = float(np.median([s for s, _ in logs])) if logs else float("nan")
    return {
        "steps": size.steps,
        "page": STEP_PAGE,
        "readers": size.readers,
        "seconds": size.seconds,
        "healthz": healthz,
        "healthz_alone": _ms(floor),
        "stats_page": page,
        "whole_log": {
            "alone_s": alone_s,
            "pages": alone_pages,
            "reads_under_load": len(logs),
            "steps_each": logs[0][1] if logs else None,
            "p50_s_under_load": under_load,
        },
    }


def _wait_up(url: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            raise RuntimeError("the benchmark's gate did not start")
        time.sleep(0.05)


def run(size: Size) -> dict:
    sock = _bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    child = multiprocessing.get_context("fork").Process(
        target=_serve, args=(sock, size.steps), daemon=True
    )
    child.start()
    try:
        _wait_up(url)
        results = _measure(url, size)
    finally:
        child.kill()
        child.join(10)
        sock.close()
    return {**results, "load_average_1m": os.getloadavg()[0], "machine": machine()}


def report(r: dict) -> None:
    h, p, w = r["healthz"], r["stats_page"], r["whole_log"]
    print(
        f"a batching gate with {r['steps']:,} steps in its log; {r['readers']} readers of the "
        f"whole log (pages of {r['page']:,}) and a /healthz every {PROBE_EVERY_S * 1e3:g} ms, "
        f"for {r['seconds']:g} s"
    )
    print(
        f"GET /healthz: n {h['n']}, p50 {h['p50_ms']:.2f} ms, p99 {h['p99_ms']:.2f} ms, "
        f"max {h['max_ms']:.2f} ms "
        f"(target p99 < {h['target_ms']:g} ms): {h['verdict']}"
    )
    f = r["healthz_alone"]
    print(
        f"  the floor, /healthz with no reader (the same gate, the same prober): n {f['n']}, "
        f"p50 {f['p50_ms']:.2f} ms, "
        f"p99 {f['p99_ms']:.2f} ms, max {f['max_ms']:.2f} ms"
    )
    print(
        f"GET /stats, a page: n {p['n']}, p50 {p['p50_ms']:.1f} ms, p99 {p['p99_ms']:.1f} ms, "
        f"{p['mean_bytes'] / 1e3:.0f} kB"
    )
    print(
        f"the whole log: {w['pages']} pages in {w['alone_s']:.2f} s alone, "
        f"{w['p50_s_under_load']:.2f} s (p50) "
        f"with the others reading; read whole {w['reads_under_load']} times under load"
    )
    m = r["machine"]
    print(
        f"machine: {m['cpus']} CPUs, {m['cpu_model']}, Python {m['python']}; load average "
        f"{r['load_average_1m']:.2f} at the end (the server, the readers and the prober share "
        "these CPUs)"
    )


def main(argv=None) -> int:
    return bench_main(__doc__, run, report, QUICK, FULL, argv)


if __name__ == "__main__":
    sys.exit(main())
