"""Sustained overload and a burst against a real ``qlab serve``: is anything lost or leaked?

For each policy (default ``bounded`` and ``predictive``; synthetic engine, loopback):

1. Sustained: Poisson arrivals at LOAD times the calibrated capacity (default 10x)
   for SECONDS (default 60), sent open-loop, the first WARMUP seconds (default 10)
   counted as warm-up for the memory figure.
2. Bursts: BURST requests (default 1,000) written at once, each on a connection
   of its own opened beforehand; three bursts, the first counted as warm-up.

Printed per case, never asserted: requests sent and their outcomes as the client
saw them next to the server's /stats counts (served, refused or expired: each
request exactly one outcome, and the two must agree); transport errors; the time
to a refusal (write to the last byte of the 503, p50 / p99 / max); how late the
client's sends left; the server's resident memory after warm-up, at its peak and
at the end, against a stated bound (+20 MB after warm-up); and, once the client
has hung up, the server's asyncio tasks, pending futures, open descriptors and
threads against their values before the run (a leak shows as a difference).

The server is ``qlab serve`` itself with one route added, ``GET /debug/loop``
(the event loop's task and pending-future counts): this script starts it as
``soak.py --serve FLAGS...``, which patches ``live.http_api.create_app`` and runs
``qlab serve FLAGS``. Memory, descriptors and threads come from /proc (Linux).

The client is benchmarks/lean.py's (raw HTTP/1.1 on asyncio streams, answers
parsed by httptools, on uvloop): through httpx the client's own ~1 ms per
request would be most of what is measured.
Refusal time targets (live harness): sustained p50 < 1 ms, p99 < 3 ms; a burst of
30 p99 < 15 ms (a burst of 1,000 has no target: its last refusal waits for the 999
before it on one event loop).

    PYTHONPATH=. python benchmarks/soak.py                 # ~3 minutes
    PYTHONPATH=. python benchmarks/soak.py --quick         # ~30 s
    PYTHONPATH=. python benchmarks/soak.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lean import OUTCOMES, Lean, Reply, client_loop  # noqa: E402
from live.contract import Stats  # noqa: E402
from live.procs import Server  # noqa: E402
from live.serve_options import ServeOptions  # noqa: E402
from qsim import make_trace  # noqa: E402

#: The stated bound: resident memory may grow this much after warm-up, over a whole sustained run.
RSS_BOUND_MB = 20.0


@dataclass(frozen=True)
class Plan:
    policy: str = "bounded"
    load: float = 10.0
    seconds: float = 60.0
    warmup_s: float = 10.0
    burst: int = 1000
    bursts: int = 3  # the first warms the memory up
    speed: float = 1.0
    seed: int = 1


FULL = dict(seconds=60.0, warmup_s=10.0, burst=1000)
QUICK = dict(seconds=8.0, warmup_s=2.0, burst=1000)


# ====================================================================== the server side


def _serve_with_probe(flags: list[str]) -> int:
    """Run ``qlab serve FLAGS`` with ``GET /debug/loop`` added (see the module docstring)."""
    import live.http_api as http_api

    original = http_api.create_app

    def create_app(*args, **kwargs):
        app = original(*args, **kwargs)

        @app.get("/debug/loop")
        async def loop_state() -> dict:
            # This handler's own task is running: it is not one of the counted.
            tasks = len(asyncio.all_tasks()) - 1
            pending = sum(
                1
                for o in gc.get_objects()
                if isinstance(o, asyncio.Future)
                and not isinstance(o, asyncio.Task)
                and not o.done()
            )
            return {"tasks": tasks, "pending_futures": pending}

        return app

    http_api.create_app = create_app
    from experiments.cli import main

    return main(["serve", *flags])


@dataclass(frozen=True)
class ProbedOptions(ServeOptions):
    """``qlab serve`` flags, started through :func:`_serve_with_probe`."""

    def argv(self) -> list[str]:
        flags = super().argv()[4:]  # after: python -m experiments serve
        return [sys.executable, str(Path(__file__).resolve()), "--serve", *flags]


def proc_status(pid: int) -> dict:
    """Resident memory (MB), threads and open descriptors of a process, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return {
        "rss_mb": int(fields["VmRSS"][0]) / 1024,
        "threads": int(fields["Threads"][0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


# ====================================================================== one case


@dataclass
class CaseResult:
    name: str
    requests: int
    client: dict  # outcome -> count, as the client saw them
    server: dict  # outcome -> count, the /stats delta over the case
    refusal_ms: dict  # p50, p99, max of the time to a refusal at arrival
    send_late_ms: dict  # p50, p99, max of how late the writes left
    memory_mb: dict  # rss after warm-up, peak, end, growth
    # server state before and after: tasks, pending futures, fds, threads, waiting, in service
    leaks: dict
    duration_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def counts_agree(self) -> bool:
        return all(
            self.client.get(k, 0) == self.server.get(k, 0)
            for k in set(self.client) | set(self.server)
        )


def _quantiles_ms(seconds: list[float]) -> dict:
    if not seconds:
        return {"n": 0, "p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    values = np.asarray(seconds) * 1e3
    return {
        "n": int(values.size),
        "p50": float(np.quantile(values, 0.5)),
        "p99": float(np.quantile(values, 0.99)),
        "max": float(values.max()),
    }


async def _until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    """Sleep until ``when`` (the loop's timers fire up to about a millisecond late).

    No spin-wait for a more punctual send: on two cores a client spinning before
    each send takes a core from the server, and the server's refusal p99 rose
    from about 2 ms to about 3 ms when this client did so.
    """
    await asyncio.sleep(max(0.0, when - loop.time()))


async def _send_at(lean: Lean, data: bytes, when: float) -> Reply:
    conn = await lean.take()
    late = asyncio.get_running_loop().time() - when
    reply, _ = await lean.exchange(conn, data)
    return Reply(reply.outcome, reply.seconds, late)


async def _sample_rss(pid: int, every_s: float, out: list, stop: asyncio.Event) -> None:
    """(seconds since start, RSS MB) every ``every_s`` until ``stop`` is set."""
    start = time.monotonic()
    while not stop.is_set():
        out.append((time.monotonic() - start, proc_status(pid)["rss_mb"]))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def _server_state(lean: Lean, pid: int) -> dict:
    loop_state = await lean.get_json("/debug/loop")
    stats = Stats.model_validate(await lean.get_json("/stats"))  # read through the contract
    return {
        **loop_state,
        **proc_status(pid),
        "waiting": stats.waiting,
        "in_service": stats.in_service,
        "counts": stats.counts,
    }


async def _settled_state(url: str, pid: int, before: dict, timeout_s: float = 5.0) -> dict:
    """The server's state once the client has hung up, on a fresh connection.

    uvicorn closes a connection's socket and task a moment after the client's FIN
    arrives, so this reads until descriptors and tasks are back to ``before``
    (or ``timeout_s`` passes: then the difference is the leak).
    """
    end = time.monotonic() + timeout_s
    while True:
        probe = Lean(url)
        try:
            state = await _server_state(probe, pid)
        finally:
            probe.close()
        settled = state["fds"] <= before["fds"] and state["tasks"] <= before["tasks"]
        if settled or time.monotonic() > end:
            return state
        await asyncio.sleep(0.05)


async def sustained(url: str, pid: int, plan: Plan) -> CaseResult:
    """Poisson at plan.load x capacity for plan.seconds, open loop; RSS sampled every 0.5 s."""
    trace = make_trace(
        "poisson", load=plan.load, seconds=plan.seconds, seed=plan.seed, speed=plan.speed
    )
    lean = Lean(url)
    bodies = [
        lean.request("POST", "/v1/generate", {"prompt": "soak", "max_new_tokens": int(n)})
        for n in trace.max_new_tokens
    ]
    before = await _server_state(lean, pid)
    lean.close()
    lean = Lean(url)
    # warm pool: no connect in the timing
    for conn in await asyncio.gather(*(lean.connect() for _ in range(64))):
        lean.give_back(conn)
    samples: list = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_rss(pid, 0.5, samples, stop))
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.1
    start = time.monotonic()
    tasks = []
    for at, data in zip(trace.arrival_s.tolist(), bodies):
        await _until(loop, t0 + at)
        tasks.append(asyncio.create_task(_send_at(lean, data, t0 + at)))
    replies = await asyncio.gather(*tasks)
    duration = time.monotonic() - start
    stop.set()
    await sampler
    lean.close()
    after = await _settled_state(url, pid, before)
    warm = [rss for t, rss in samples if t >= plan.warmup_s] or [samples[-1][1]]
    memory = {
        "before": before["rss_mb"],
        "after_warmup": warm[0],
        "peak": max(r for _, r in samples),
        "end": after["rss_mb"],
        "growth_after_warmup": after["rss_mb"] - warm[0],
        "bound": RSS_BOUND_MB,
    }
    return _result(
        f"sustained {plan.load:g}x, {plan.policy}", replies, before, after, memory, duration
    )


async def burst(url: str, pid: int, plan: Plan) -> CaseResult:
    """plan.bursts bursts of plan.burst requests, one after the other; the first is the memory's
    warm-up.

    In a burst every request has a connection of its own, opened beforehand, and
    all are written back to back before the first answer is read. The next burst
    starts once every answer of the last is in, so the gate is empty again.
    """
    lean = Lean(url)
    before = await _server_state(lean, pid)
    lean.close()
    _raise_fd_limit(plan.burst + 256)
    trace = make_trace(f"burst:{plan.burst}", requests=plan.burst, seed=plan.seed, speed=plan.speed)
    replies: list[Reply] = []
    rss_after: list[float] = []
    start = time.monotonic()
    for _ in range(plan.bursts):
        replies += await _one_burst(url, [int(n) for n in trace.max_new_tokens])
        rss_after.append(proc_status(pid)["rss_mb"])
    duration = time.monotonic() - start
    after = await _settled_state(url, pid, before)
    memory = {
        "before": before["rss_mb"],
        "after_warmup": rss_after[0],
        "peak": max(rss_after + [after["rss_mb"]]),
        "end": after["rss_mb"],
        "growth_after_warmup": after["rss_mb"] - rss_after[0],
        "bound": RSS_BOUND_MB,
    }
    name = f"{plan.bursts} bursts of {plan.burst}, {plan.policy}"
    return _result(name, replies, before, after, memory, duration)


async def _one_burst(url: str, sizes: list[int]) -> list[Reply]:
    lean = Lean(url)
    data = [
        lean.request("POST", "/v1/generate", {"prompt": "burst", "max_new_tokens": n})
        for n in sizes
    ]
    conns = []
    # opened in batches: the server's accept queue is deep, not infinite
    for i in range(0, len(sizes), 100):
        conns += await asyncio.gather(*(lean.connect() for _ in range(min(100, len(sizes) - i))))
    try:
        # exchange() writes before its first await, and gather starts the tasks in order in one pass
        # of the loop: every request is written before the first answer is read.
        return [
            reply
            for reply, _ in await asyncio.gather(
                *(lean.exchange(c, d) for c, d in zip(conns, data))
            )
        ]
    finally:
        lean.close()


def _result(
    name: str, replies: list[Reply], before: dict, after: dict, memory: dict, duration: float
) -> CaseResult:
    client = Counter(r.outcome for r in replies)
    server = {k: after["counts"][k] - before["counts"][k] for k in OUTCOMES}
    leaks = {
        k: {"before": before[k], "after": after[k]}
        for k in ("tasks", "pending_futures", "fds", "threads", "waiting", "in_service")
    }
    result = CaseResult(
        name,
        len(replies),
        dict(client),
        server,
        _quantiles_ms([r.seconds for r in replies if r.outcome == "rejected"]),
        _quantiles_ms([r.lateness_s for r in replies]),
        memory,
        leaks,
        duration,
    )
    if not result.counts_agree:
        result.notes.append("client and server counts DIFFER")
    if any(o.startswith(("transport:", "unexpected:")) for o in client):
        result.notes.append("some requests got no proper answer")
    if memory["growth_after_warmup"] > RSS_BOUND_MB:
        result.notes.append(f"memory grew past the bound of {RSS_BOUND_MB:g} MB")
    for key in ("tasks", "pending_futures", "fds", "threads"):
        if after[key] > before[key]:
            result.notes.append(f"{key} grew: {before[key]} -> {after[key]}")
    if after["waiting"] or after["in_service"]:
        result.notes.append("requests left in the gate")
    return result


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(
            resource.RLIMIT_NOFILE,
            (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard),
        )


# ====================================================================== the whole run


def run(plan: Plan, log_dir: str | Path) -> list[CaseResult]:
    """Both cases against one fresh server for ``plan.policy``."""
    # the server inherits it: it holds one descriptor per connection
    _raise_fd_limit(plan.burst + 256)
    server = Server(
        ProbedOptions(policy=plan.policy, speed=plan.speed),
        Path(log_dir) / f"soak-{plan.policy}.log",
    )
    server.start(60)
    try:

        async def both():
            return [
                await sustained(server.url, server.proc.pid, plan),
                await burst(server.url, server.proc.pid, plan),
            ]

        with asyncio.Runner(loop_factory=client_loop()) as runner:
            return runner.run(both())
    finally:
        server.stop()


def report(results: list[CaseResult]) -> None:
    for r in results:
        m, lk = r.memory_mb, r.leaks
        client = " ".join(f"{k} {r.client.get(k, 0)}" for k in OUTCOMES)
        server = " ".join(f"{k} {r.server.get(k, 0)}" for k in OUTCOMES)
        others = {k: v for k, v in r.client.items() if k not in OUTCOMES}
        print(f"\n{r.name}: {r.requests} requests in {r.duration_s:.1f} s")
        print(f"  client: {client}" + (f"  OTHER {others}" if others else ""))
        print(f"  server: {server}  ({'agree' if r.counts_agree else 'DIFFER'})")
        q = r.refusal_ms
        print(
            f"  time to a refusal: p50 {q['p50']:.2f} ms, p99 {q['p99']:.2f} ms, max "
            f"{q['max']:.2f} ms ({q['n']} refusals)"
        )
        s = r.send_late_ms
        print(
            f"  client send lateness: p50 {s['p50']:.2f} ms, p99 {s['p99']:.2f} ms, max "
            f"{s['max']:.2f} ms"
        )
        print(
            f"  server RSS: {m['before']:.1f} MB before, {m['after_warmup']:.1f} after warm-up, "
            f"peak {m['peak']:.1f}, "
            f"end {m['end']:.1f}: {m['growth_after_warmup']:+.1f} MB after warm-up (bound "
            f"+{m['bound']:g} MB)"
        )
        print(
            "  after the client hung up (before -> after): "
            + ", ".join(f"{k} {v['before']} -> {v['after']}" for k, v in lk.items())
        )
        for note in r.notes:
            print(f"  NOTE: {note}")
    print(
        "\ntargets (live harness): sustained refusal p50 < 1 ms, p99 < 3 ms; burst of 30 p99 < "
        "15 ms"
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return _serve_with_probe(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 s instead of 60 s per policy")
    parser.add_argument("--policies", default="bounded,predictive")
    parser.add_argument(
        "--load",
        type=float,
        default=10.0,
        help="utilisation at the engine's --speed: times its capacity at that speed (default 10)",
    )
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--burst", type=int)
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="synthetic engine speed (0.1: 10x faster, 10x the rate)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    sizes.update(
        {k: v for k, v in (("seconds", args.seconds), ("burst", args.burst)) if v is not None}
    )
    sizes["warmup_s"] = min(sizes["warmup_s"], sizes["seconds"] / 4)
    results = []
    with tempfile.TemporaryDirectory() as logs:
        for policy in args.policies.split(","):
            results += run(Plan(policy=policy, load=args.load, speed=args.speed, **sizes), logs)
    if args.json:
        print(
            json.dumps([{**asdict(r), "counts_agree": r.counts_agree} for r in results], indent=2)
        )
    else:
        report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
