"""How much does the gate cost on the OpenAI-compatible API? (issue 13, section 7)

Against real ``qlab serve`` subprocesses on loopback, with benchmarks/lean.py's client
(raw HTTP/1.1 on connections opened before the timed write, answers parsed by httptools and
read through live.contract) on uvloop. Figures are printed, never asserted:

1. Refusal time through ``POST /v1/chat/completions`` at a sustained 2x overload: policy
   ``predictive`` on the synthetic engine, Poisson arrivals at twice its capacity (the
   reference mix), sent open loop after a few long requests that fill the queue (so that the
   overload is at its steady state from the start). Client-measured time from the write to the
   complete 503. The same overload is then sent through ``/v1/generate`` (qlab's own route),
   printed beside it as a yardstick of how busy the machine was. The machine's floor is printed
   beside the figure: the same arrivals sent to a bare uvicorn app that answers a fixed 503
   (benchmarks/floor.py's refuser). Targets: p50 < 1 ms, p99 < 3 ms.
   The same again against a gate with ``--engines 8`` (a trace for 8 engines: eight times the
   rate, so the machine is idle for less between requests, as in front of a real upstream that
   serves many at once), with its own verdict and its own refuser floor under those arrivals.
2. Latency the gate adds to a served request: the gate (``qlab serve --engine upstream
   --upstream-url U --policy predictive``) in front of a fake upstream U (``qlab serve --engine
   synthetic --policy none``), minus U alone, one request at a time (low load). Each pair
   sends the same chat request to U and to the gate back to back (order rotating), and
   the figure is the per-pair difference (paired; its percentiles include the noise of two
   engine sleeps). The difference of the two sets' percentiles is printed beside it. The
   machine's floor: each pair is a triple, with the same request also sent through a bare
   pass-through proxy (benchmarks/floor.py's proxy: aiohttp to the same upstream, the answer
   streamed back), order rotating; printed beside the figure are what the bare proxy adds over
   the upstream alone and what the gate adds over the bare proxy (paired, per request).
   Targets: p50 < 1 ms, p99 < 3 ms.
3. Time to the first token the gate adds in streaming (``stream: true``): the same pairs,
   timed to the first bytes of the event stream. Target: p50 < 1 ms. Both sides stream token
   by token (the synthetic engine emits each token when its time is up, and the gate passes the
   upstream's chunks through as they arrive, see docs/http.md), so this is the gate's own delay
   to the first token, not the generation time. The bare proxy's figures as in 2.

The verdicts are on the absolute targets; the floor lines are information: what part of each
figure a bare server on the same machine, under the same arrivals, costs as well.

    PYTHONPATH=. python benchmarks/bench_openai.py            # ~3 minutes
    PYTHONPATH=. python benchmarks/bench_openai.py --quick    # ~1 minute smoke run
    PYTHONPATH=. python benchmarks/bench_openai.py --json
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import bench_main
from benchmarks.floor import floors, machine
from benchmarks.lean import Lean, Reply, client_loop
from live.contract import GenerateRequest
from live.contract_openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    QlabInfo,
)
from live.http_api import GENERATE
from live.openai_api import CHAT
from live.procs import serving
from live.serve_options import ServeOptions
from qsim import make_trace

MODEL = "synthetic"  # the model id both the fake upstream and the gate in front of it serve
#: The queue is filled at the start by this many 64-token requests (about the deadline's worth of
#: work), so that the 2x overload is at its steady state at once; refusals in the first SETTLE_S are
#: left out all the same.
PREFILL = 4
SETTLE_S = 0.5
#: Seconds for a gate's queue to drain after an overload, before the next measurement.
DRAIN_S = 3.0
#: The second overload row's engines (a trace made for them: ENGINES_MANY times the request rate).
ENGINES_MANY = 8
#: The fake upstream's engine at this fraction of the reference time: a 4-token answer takes about
#: 3.5 ms.
UPSTREAM_SPEED = 0.1
PAIR_TOKENS = 4


@dataclass(frozen=True)
class Sizes:
    overload_s: float  # seconds of sustained 2x overload
    # request triples (upstream alone, through the gate, through the bare proxy) per measurement
    pairs: int
    warmup: int  # pairs sent first and not counted


# Predictive refuses mostly the long requests at 2x (about one request in four or five): a run needs
# some seconds to have refusals to count.
FULL = Sizes(overload_s=30.0, pairs=400, warmup=20)
QUICK = Sizes(overload_s=4.0, pairs=30, warmup=5)


@dataclass(frozen=True)
class Target:
    name: str
    p50_ms: float
    p99_ms: float | None  # None: no p99 target


TARGETS = {
    "refusal": Target("refusal through /v1/chat/completions at 2x, predictive", 1.0, 3.0),
    "refusal_8": Target(
        f"refusal through /v1/chat/completions at 2x, predictive, {ENGINES_MANY} "
        "engines "
        f"({ENGINES_MANY}x the rate)",
        1.0,
        3.0,
    ),
    "added": Target("latency added by the gate to a served request", 1.0, 3.0),
    "added_ttft": Target("time to first token added by the gate, streaming", 1.0, None),
}


def chat(max_tokens: int, stream: bool = False, prompt: str = "say something") -> dict:
    """A chat body, built through the contract."""
    return ChatCompletionRequest(
        model=MODEL,
        messages=[ChatMessage(role="user", content=prompt)],
        max_tokens=max_tokens,
        stream=stream,
    ).body()


def percentiles_ms(seconds) -> dict:
    values = np.asarray(seconds, dtype=float) * 1e3
    if values.size == 0:
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan")}
    p50, p99 = np.percentile(values, [50, 99])
    return {"n": int(values.size), "p50_ms": float(p50), "p99_ms": float(p99)}


# ---------------------------------------------------------------------- 1. refusals at 2x


def generate(max_new_tokens: int) -> dict:
    return GenerateRequest(prompt="say something", max_new_tokens=max_new_tokens).body()


async def _overload(url: str, seconds: float, path: str = CHAT, engines: int = 1) -> dict:
    """A 2x overload of ``engines`` engines (the trace's rate: ``engines`` times one engine's)
    sent to ``url``."""
    trace = make_trace("poisson", load=2.0, seconds=seconds, seed=1, engines=engines)
    lean = Lean(url)
    body = chat if path == CHAT else generate
    fill = [
        asyncio.create_task(lean.send(lean.request("POST", path, body(64))))
        for _ in range(PREFILL * engines)
    ]
    data = [lean.request("POST", path, body(int(n))) for n in trace.max_new_tokens]
    # no connect inside a timing
    for conn in await asyncio.gather(*(lean.connect() for _ in range(48 * engines))):
        lean.give_back(conn)
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    tasks = []
    for at, body in zip(trace.arrival_s, data):  # open loop: each at its time, whatever the answers
        await asyncio.sleep(max(0.0, start + float(at) - loop.time()))
        tasks.append((float(at), asyncio.create_task(lean.send(body))))
    replies = [(at, (await task)[0]) for at, task in tasks]
    await asyncio.gather(*fill)
    lean.close()
    refused = [r.seconds for at, r in replies if r.outcome == "rejected" and at >= SETTLE_S]
    outcomes = {}
    for _, r in replies:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    return {**percentiles_ms(refused), "requests": len(replies), "outcomes": outcomes}


# ---------------------------------------------------------------------- 2 and 3. the gate in front
# of an upstream


# the upstream alone, through the gate, through the bare proxy
SIDES = ("upstream", "gate", "proxy")


async def _pairs(upstream: str, gate: str, proxy: str, sizes: Sizes, stream: bool) -> dict:
    """Per pair, the same request to the upstream alone, through the gate and through the bare proxy
    (the machine's floor), in rotating order (each side first, second and third equally often)."""
    clients = {"upstream": Lean(upstream), "gate": Lean(gate), "proxy": Lean(proxy)}
    data = {k: c.request("POST", CHAT, chat(PAIR_TOKENS, stream)) for k, c in clients.items()}
    times: dict[str, list[Reply]] = {k: [] for k in SIDES}
    told: dict[str, list[QlabInfo | None]] = {k: [] for k in SIDES}  # each answer's own timings
    for i in range(sizes.warmup + sizes.pairs):
        order = SIDES[i % 3 :] + SIDES[: i % 3]
        for k in order:
            reply, payload = await clients[k].send(data[k])
            if i >= sizes.warmup:
                times[k].append(reply)
                told[k].append(_qlab(payload))
    for c in clients.values():
        c.close()
    bad = {k: [r.outcome for r in v if r.outcome not in ("good", "late")] for k, v in times.items()}
    up, through, bare = times["upstream"], times["gate"], times["proxy"]
    pick = (lambda r: r.first_s) if stream else (lambda r: r.seconds)

    def paired(later: list[Reply], earlier: list[Reply]) -> dict:
        return percentiles_ms([pick(a) - pick(b) for a, b in zip(later, earlier)])

    alone, gated = percentiles_ms([pick(r) for r in up]), percentiles_ms([pick(r) for r in through])
    return {
        **paired(through, up),
        "upstream_alone": alone,
        "through_gate": gated,
        "difference_of_percentiles": {
            "p50_ms": gated["p50_ms"] - alone["p50_ms"],
            "p99_ms": gated["p99_ms"] - alone["p99_ms"],
        },
        "floor": {
            "through_bare_proxy": percentiles_ms([pick(r) for r in bare]),
            "bare_proxy_adds": paired(bare, up),
            "gate_adds_over_bare_proxy": paired(through, bare),
        },
        "where_p50_ms": _where(told["upstream"], told["gate"]),
        "not_answered": {k: v[:5] for k, v in bad.items() if v},
    }


def _qlab(payload) -> QlabInfo | None:
    """The gate's own timings of an answer (a chat completion, or a stream's chunks), through the
    contract."""
    chunks = payload if isinstance(payload, list) else [payload]
    for chunk in chunks:
        try:
            q = (
                ChatCompletionChunk.model_validate(chunk).qlab
                if isinstance(payload, list)
                else ChatCompletion.model_validate(chunk).qlab
            )
        except ValueError:
            return None
        if q is not None:
            return q
    return None


def _where(upstream: list[QlabInfo | None], gate: list[QlabInfo | None]) -> dict:
    """Medians of where the gate's time goes, from the servers' own timings: inside the gate apart
    from the call upstream (its total less its engine's time), and the call upstream less the
    upstream's own total for the same request alone (the upstream engine's HTTP client, and the
    upstream's HTTP layer)."""
    pairs = [(u, g) for u, g in zip(upstream, gate) if u is not None and g is not None]
    if not pairs:
        return {}
    return {
        "gate_apart_from_the_upstream_call": float(
            np.median([g.total_s - g.engine_s for _, g in pairs]) * 1e3
        ),
        "upstream_call_less_upstream_total": float(
            np.median([g.engine_s - u.total_s for u, g in pairs]) * 1e3
        ),
        "upstream_own_total": float(np.median([u.total_s for u, _ in pairs]) * 1e3),
    }


def run(sizes: Sizes) -> dict:
    results: dict = {}
    with tempfile.TemporaryDirectory() as logs:
        with (
            serving(
                [
                    ServeOptions(policy="predictive"),
                    ServeOptions(policy="none", speed=UPSTREAM_SPEED),
                ],
                logs,
                120,
            ) as (overloaded, upstream),
            serving(
                [ServeOptions(policy="predictive", engines=ENGINES_MANY)], logs, 120, prefix="many"
            ) as (many,),
        ):
            with (
                serving(
                    [
                        ServeOptions(
                            policy="predictive", engine="upstream", upstream_url=upstream.url
                        )
                    ],
                    logs,
                    120,
                    prefix="gate",
                ) as (gate,),
                floors(logs, upstream.url) as (refuser, proxy),
            ):
                with asyncio.Runner(loop_factory=client_loop()) as runner:
                    for key, server, engines in (
                        ("refusal", overloaded, 1),
                        ("refusal_8", many, ENGINES_MANY),
                    ):
                        # The floor first, on the same arrivals: the refuser has no queue to drain.
                        floor = runner.run(
                            _overload(refuser.url, sizes.overload_s, engines=engines)
                        )
                        results[key] = runner.run(
                            _overload(server.url, sizes.overload_s, engines=engines)
                        )
                        results[key]["floor"] = floor
                        time.sleep(DRAIN_S)  # the queue drains
                        # the same overload through qlab's own route: a yardstick of the machine
                        if key == "refusal":
                            results["refusal_generate"] = runner.run(
                                _overload(overloaded.url, sizes.overload_s, GENERATE)
                            )
                            time.sleep(DRAIN_S)
                    results["added"] = runner.run(
                        _pairs(upstream.url, gate.url, proxy.url, sizes, stream=False)
                    )
                    results["added_ttft"] = runner.run(
                        _pairs(upstream.url, gate.url, proxy.url, sizes, stream=True)
                    )
    for key, target in TARGETS.items():
        results[key]["target"] = asdict(target)
        results[key]["verdict"] = verdict(results[key], target)
    results["machine"] = machine()
    return results


def verdict(r: dict, target: Target) -> str:
    ok = (
        r["n"] > 0
        and r["p50_ms"] < target.p50_ms
        and (target.p99_ms is None or r["p99_ms"] < target.p99_ms)
    )
    return "PASS" if ok else "MISS"


def report(results: dict) -> None:
    m = results["machine"]
    print(
        f"machine: {m['cpus']} CPUs ({m['cpu_model']}), cpuidle governor "
        f"{m['cpuidle_governor']}, Linux "
        f"{m['kernel']}, Python {m['python']}, uvloop {m['uvloop']}"
    )
    for key, target in TARGETS.items():
        r = results[key]
        p99 = f"p99 {r['p99_ms']:.3f} ms" + (
            "" if target.p99_ms is None else f" (target < {target.p99_ms:g} ms)"
        )
        print(
            f"{target.name}: n {r['n']}, p50 {r['p50_ms']:.3f} ms (target < {target.p50_ms:g} "
            f"ms), {p99}: "
            f"{r['verdict']}"
        )
        if "difference_of_percentiles" in r:
            d, up, gate = r["difference_of_percentiles"], r["upstream_alone"], r["through_gate"]
            print(
                "  paired per-request difference above; difference of percentiles: p50 "
                f"{d['p50_ms']:.3f} ms, "
                f"p99 {d['p99_ms']:.3f} ms (upstream alone p50 {up['p50_ms']:.3f} ms, through "
                "the gate "
                f"p50 {gate['p50_ms']:.3f} ms)"
            )
            if r["where_p50_ms"]:
                w = r["where_p50_ms"]
                print(
                    "  where (medians, the servers' own timings): in the gate apart from the "
                    "upstream call "
                    f"{w['gate_apart_from_the_upstream_call']:.3f} ms; the upstream call less "
                    "the upstream's own "
                    f"total {w['upstream_call_less_upstream_total']:.3f} ms (upstream's own "
                    "total "
                    f"{w['upstream_own_total']:.3f} ms)"
                )
            f = r["floor"]
            bare, over = f["bare_proxy_adds"], f["gate_adds_over_bare_proxy"]
            print(
                f"  the machine's floor (paired): the bare proxy adds p50 {bare['p50_ms']:.3f} "
                "ms, p99 "
                f"{bare['p99_ms']:.3f} ms; the gate adds over the bare proxy p50 "
                f"{over['p50_ms']:.3f} ms, "
                f"p99 {over['p99_ms']:.3f} ms"
            )
            if r["not_answered"]:
                print(f"  NOT ANSWERED: {r['not_answered']}")
        else:
            print(f"  {r['requests']} requests sent, outcomes {r['outcomes']}")
            if key == "refusal":
                g = results["refusal_generate"]
                print(
                    f"  the same overload through {GENERATE} (qlab's own route, a yardstick): n "
                    f"{g['n']}, "
                    f"p50 {g['p50_ms']:.3f} ms, p99 {g['p99_ms']:.3f} ms"
                )
            f = r["floor"]
            print(
                "  the machine's floor (a bare uvicorn app answering a fixed 503, the same "
                f"arrivals): n {f['n']}, "
                f"p50 {f['p50_ms']:.3f} ms, p99 {f['p99_ms']:.3f} ms; the gate's p50 above it "
                f"{r['p50_ms'] - f['p50_ms']:.3f} ms"
            )


def main(argv=None) -> int:
    return bench_main(__doc__, run, report, QUICK, FULL, argv)


if __name__ == "__main__":
    sys.exit(main())
