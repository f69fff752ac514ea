"""qlab judged on vLLM: the gate in front of a real vLLM server, each claim with PASS or MISS.

    python benchmarks/vllm_check.py [--quick] [--url URL] [--shape tiny|small] [--out DIR]
    make vllm-check                          # the same, installing and starting vLLM first

Without ``--url`` vLLM is installed in its own venv and started on loopback with the local
random-weight model (:mod:`live.vllm_server`); with ``--url`` (a GPU user's own
``vllm serve``) nothing is installed or started. Then, against that server:

1. **tokens**: a batching gate (``qlab serve --engine upstream --batching``, policy none) in
   front; completions and chats, streamed and not, at 32 in flight, through the openai SDK. The
   gate's ``/stats`` (requests answered, prompt and generated tokens) and the clients' ``usage``
   must equal what vLLM's own ``/metrics`` counted over the same requests; every answer has all
   its ``max_tokens`` (the model has no end-of-text token); the gate's ``/stats``
   ``upstream_counters`` (vLLM's counters as the gate read them: requests, tokens, preemptions)
   must move as vLLM's ``/metrics`` read directly;
2. **calibration through a predictive gate**: ``qlab calibrate`` against a gate under the
   ``predictive`` policy, with no restart and no second gate: no request refused; then the gate
   takes the calibration while it runs (``PUT /admin/calibration``, the operator's key);
3. **the step model**: the fit's r^2 (target >= 0.9) and its median error on one step, and
   whether the upstream learner converged (a MISS says what the model lacks: docs/vllm.md);
4. **vLLM's steps by its own counters**, reported: at each level of requests in flight straight
   at vLLM (no gate), a step's mean time and what it held (``vllm:iteration_tokens_total``: one
   observation an engine step), and how much of a request's time at the client vLLM's own
   end-to-end time accounts for (the rest is its API process and the client, on the same cores).
5. **the prefix cache**: the same requests of shared prefixes (a system prompt before 80 % of the
   prompts; conversations of 4 turns) sent to vLLM one at a time as token ids, each turn carrying
   the ids vLLM generated for the turn before, and simulated with qsim's prefix cache (vLLM's CPU
   blocks of 128 tokens): the hit rates, in tokens, from vLLM's ``prefix_cache_queries`` and
   ``prefix_cache_hits`` and from the simulator's, must agree within 1 %.

Every section prints the machine's load average beside its figures (a busy machine's steps are
slower). The exit status is 0 when every check ran (PASS or MISS), 2 when vLLM could not be
installed or started (one line on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import secrets
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from pydantic import BaseModel

from live import vllm_server
from live.admin import ADMIN_KEY_ENV, send_calibration
from live.calibrate import CalibrationConfig, calibrate
from live.calibration_fit import StepCalibration
from live.contract import ServiceModelBody, Stats
from live.engine_steps import Counters, EnginePhase, fit_phases
from live.procs import Server
from live.serve_options import ServeOptions
from live.upstream import UpstreamSpec, resolve_model
from live.vllm_metrics import UPSTREAM_COUNTERS
from qsim import Batching, ServerConfig, StepModel, simulate
from qsim.policy import PRESETS
from qsim.mixes import Prompts, SharedPrefix
from qsim.trace import Trace
from qsim.workload import make_trace


class VllmChoice(BaseModel):
    """A completion's choice as vLLM answers it with ``return_token_ids``."""

    token_ids: list[int]


class VllmCompletion(BaseModel):
    choices: list[VllmChoice]


#: The step fit's target (the vLLM issue's): r^2 on the steps measured.
R2_TARGET = 0.9


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'MISS'}  {self.name}: {self.detail}"


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} (1 / 5 min) on {os.cpu_count()} cores"


@dataclass(frozen=True)
class Traffic:
    requests: int = 192
    in_flight: int = 32
    max_tokens: int = 64
    seed: int = 0


async def _send(base: str, model: str, traffic: Traffic) -> list:
    """Each request's usage as its client was told: completions and chats, streamed and not."""
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    rng = random.Random(traffic.seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "lantern"]
    prompts = [" ".join(rng.choices(words, k=rng.randint(4, 80))) for _ in range(traffic.requests)]
    gate = asyncio.Semaphore(traffic.in_flight)

    async def one(i: int):
        chat, stream = i % 4 in (2, 3), i % 2 == 1
        ask = {"model": model, "max_tokens": traffic.max_tokens}
        if stream:
            ask.update(stream=True, stream_options={"include_usage": True})
        async with gate:
            if chat:
                answer = await client.chat.completions.create(
                    messages=[{"role": "user", "content": prompts[i]}], **ask
                )
            else:
                answer = await client.completions.create(prompt=prompts[i], **ask)
            if not stream:
                return answer.usage
            usage = None
            async for chunk in answer:
                usage = chunk.usage or usage
            return usage

    try:
        return await asyncio.gather(*(one(i) for i in range(traffic.requests)))
    finally:
        await client.close()


def _stats(url: str) -> Stats:
    import httpx

    return Stats.model_validate(httpx.get(url + "/stats", timeout=30).json())


def upstream_counters_check(
    before: dict[str, float], after: dict[str, float], gate_before: Stats, gate_after: Stats
) -> Check:
    """vLLM's own counters as the gate's /stats says them (``upstream_counters``) against vLLM's
    /metrics read here, over the same requests: requests, tokens and preemptions alike."""
    name = "vLLM's counters in the gate's /stats == vLLM's /metrics"
    said = gate_before.upstream_counters, gate_after.upstream_counters
    direct = {key: round(after[c] - before[c]) for key, c in UPSTREAM_COUNTERS.items()}
    if None in said:
        return Check(name, False, f"the gate's /stats has no upstream_counters; vLLM {direct}")
    gate = {key: getattr(said[1], key) - getattr(said[0], key) for key in UPSTREAM_COUNTERS}
    return Check(name, gate == direct, f"gate {gate}, vLLM {direct}")


def check_tokens(upstream: str, logs: Path, traffic: Traffic) -> list[Check]:
    options = ServeOptions(
        policy="none",
        engine="upstream",
        upstream_url=upstream,
        batching=True,
        max_num_seqs=traffic.in_flight,
    )
    server = Server(options, logs / "gate-tokens.log")
    try:
        gate = server.start(120)
        model = _stats(gate).engine.model
        before, gate_before = vllm_server.metrics(upstream), _stats(gate)
        usages = asyncio.run(_send(gate, model, traffic))
        after, gate_after = vllm_server.metrics(upstream), _stats(gate)
    finally:
        server.stop()

    def vllm(name: str) -> int:
        return round(after[f"vllm:{name}"] - before[f"vllm:{name}"])

    answered = {
        k: gate_after.answered_tokens[k] - gate_before.answered_tokens.get(k, 0)
        for k in ("prompt", "generated")
    }
    good = sum(gate_after.counts[k] - gate_before.counts[k] for k in ("good", "late"))
    clients = {
        "prompt": sum(u.prompt_tokens for u in usages),
        "generated": sum(u.completion_tokens for u in usages),
    }
    full = sum(u.completion_tokens == traffic.max_tokens for u in usages)
    learned = gate_after.engine.learned
    counted = {
        "requests": vllm("request_success_total"),
        "prompt": vllm("prompt_tokens_total"),
        "generated": vllm("generation_tokens_total"),
    }
    return [
        Check(
            "requests answered: gate == vLLM",
            good == counted["requests"] == traffic.requests,
            f"gate {good}, vLLM {counted['requests']}, sent {traffic.requests}",
        ),
        Check(
            "generated tokens: gate == clients == vLLM",
            answered["generated"] == clients["generated"] == counted["generated"],
            f"gate {answered['generated']}, clients {clients['generated']}, "
            f"vLLM {counted['generated']}",
        ),
        Check(
            "prompt tokens: gate == clients == vLLM (vLLM's tokenizer)",
            answered["prompt"] == clients["prompt"] == counted["prompt"],
            f"gate {answered['prompt']}, clients {clients['prompt']}, vLLM {counted['prompt']}",
        ),
        Check(
            "every answer has its max_tokens",
            full == traffic.requests,
            f"{full} of {traffic.requests} have {traffic.max_tokens}; "
            f"vLLM preemptions {vllm('num_preemptions_total')}",
        ),
        upstream_counters_check(before, after, gate_before, gate_after),
        Check(
            "the upstream learner converged",
            bool(learned["converged"]),
            f"{learned['refits']} refits on {learned['gaps_seen']} gaps, {learned['drifts']} "
            f"drifts; model {learned['step']}; 95 % intervals {learned['intervals']}; median error "
            f"{learned['median_rel_error']}",
        ),
    ]


def check_calibration(upstream: str, logs: Path, out: Path, quick: bool) -> list[Check]:
    options = ServeOptions(
        policy="predictive",
        engine="upstream",
        upstream_url=upstream,
        batching=True,
        max_num_seqs=32,
    )
    # The operator's key reaches the gate (a child) and send_calibration through the environment, as
    # qlab serve and qlab calibrate --apply read it; the caller's environment is left as it was.
    before = os.environ.get(ADMIN_KEY_ENV)
    os.environ[ADMIN_KEY_ENV] = before or secrets.token_hex(16)
    server = Server(options, logs / "gate-predictive.log")
    taken = None
    try:
        gate = server.start(120)
        cfg = CalibrationConfig(
            gate,
            rounds=2,
            per_size=2 if quick else 6,
            levels=(4, 16, 32) if quick else None,
            load_per_size=2 if quick else 4,
            engine_metrics=upstream,
        )
        try:
            result = calibrate(cfg)
            refused = None
        except Exception as exc:  # what a refused request raises, said as the check's detail
            result, refused = None, f"{type(exc).__name__}: {exc}"
        if result is not None:
            send_calibration(gate, result.as_dict())
            taken = _stats(gate).service_model
        stats = _stats(gate)
    finally:
        server.stop()
        if before is None:
            del os.environ[ADMIN_KEY_ENV]
    rejected = stats.counts.get("rejected", 0)
    checks = [
        Check(
            "calibrate through a predictive gate",
            refused is None and rejected == 0,
            refused or f"{stats.submitted} requests, {rejected} refused",
        )
    ]
    if result is not None:
        wanted = ServiceModelBody.model_validate(asdict(result.overall.model))
        checks.append(
            Check(
                "the gate takes it without a restart (PUT /admin/calibration)",
                taken == wanted,
                f"the gate plans with {taken}",
            )
        )
    if result is not None and result.steps is not None:
        result.save(out / "calibration.json")
        checks.extend(step_checks(result.steps))
    return checks


def step_checks(steps: StepCalibration) -> list[Check]:
    """The step model fitted to vLLM's own counters, judged on held-out phases; beside it, the fit
    to the gate's steps (reported: a gate's steps of an upstream are not the engine's)."""
    gate, engine = steps.fit, steps.engine
    m = steps.model
    return [
        Check(
            f"step model r^2 >= {R2_TARGET} on held-out phases (vLLM's counters)",
            engine.held_out_r2 >= R2_TARGET,
            f"r^2 {engine.held_out_r2:.3f}, median error {engine.held_out_median_rel_error:.1%} on "
            f"{sum(p.half for p in engine.phases)} held-out phases; b0 {m.b0 * 1e3:.2f} ms, "
            f"b1 {m.b1 * 1e6:.2f} us/prefill token, b2 {m.b2 * 1e3:.3f} ms/sequence; "
            + "; ".join(
                f"{p.level}: {1000 * p.step_s:.1f} ms, {p.seqs:.1f} seqs, "
                f"{1000 * p.outside_s:.0f} ms a request outside the engine"
                for p in engine.phases
            ),
        ),
        Check(
            "step model on the gate's own steps of vLLM (reported)",
            True,
            f"r^2 {gate.r2:.3f}, median error on one step {gate.median_rel_error:.1%}, {gate.n} "
            "steps",
        ),
    ]


@dataclass(frozen=True)
class StepLevel:
    """One level of requests in flight straight at vLLM, as its own counters saw it."""

    in_flight: int
    seconds: float  # the clients' wall time for the level
    requests: int
    steps: int
    generated: int
    computed: (
        int  # tokens the steps computed: prompts (less what the prefix cache held) and generated
    )
    e2e_s: float  # summed over the requests, vLLM's own end-to-end time
    inference_s: float  # ... of it in the engine (prefill and decode)

    def line(self) -> str:
        per = 1000 / self.requests
        client = 1000 * self.seconds * self.in_flight / self.requests
        step_ms = 1000 * self.seconds / self.steps
        seqs, prompt = self.generated / self.steps, (self.computed - self.generated) / self.steps
        e2e, engine = self.e2e_s * per, self.inference_s * per
        return (
            f"{self.in_flight:>3} in flight: a step {step_ms:6.2f} ms (wall / steps), {seqs:5.2f} "
            f"sequences a step, {prompt:6.1f} prompt tokens a step; a request {client:5.0f} ms at "
            f"the client, {e2e:5.0f} ms in vLLM's end to end, {engine:5.0f} ms in its engine: "
            f"{1 - e2e / client:.0%} outside vLLM's own accounting"
        )


async def _level(url: str, model: str, in_flight: int, requests: int, max_tokens: int = 64) -> None:
    import httpx

    rng = random.Random(in_flight)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def worker(share: int) -> None:
            for _ in range(share):
                prompt = " ".join(
                    rng.choices(["alpha", "beta", "gamma", "delta"], k=rng.randint(4, 80))
                )
                answer = await client.post(
                    "/v1/completions",
                    json={"model": model, "prompt": prompt, "max_tokens": max_tokens},
                )
                answer.raise_for_status()

        await asyncio.gather(*(worker(requests // in_flight) for _ in range(in_flight)))


#: The output lengths the straight-at-vLLM phases take by turns (measure_steps).
OUTPUT_LENGTHS = (16, 64)


def measure_steps(
    upstream: str, levels: tuple[int, ...], requests: int
) -> tuple[list[StepLevel], list[EnginePhase]]:
    """Requests straight at vLLM at each level (no gate): its steps and its own times, from its
    counters."""
    model = resolve_model(UpstreamSpec(upstream))
    found, phases = [], []
    for k, level in enumerate(levels):
        # Two halves, each a phase of the step model's held-out fit (live.engine_steps), of 16 or
        # 64 tokens by turns: with one length everywhere prompt tokens a step stay proportional to
        # sequences a step and the fit cannot tell them apart (qlab calibrate does the same).
        readings = [(vllm_server.metrics(upstream), time.perf_counter())]
        for half in (0, 1):
            tokens = OUTPUT_LENGTHS[(k + half) % 2]
            asyncio.run(_level(upstream, model, level, max(level, requests // 2), tokens))
            readings.append((vllm_server.metrics(upstream), time.perf_counter()))
        ends = [Counters.of(m, at) for m, at in readings]
        phases += [EnginePhase.between(level, h, ends[h], ends[h + 1]) for h in (0, 1)]
        (before, t0), (after, t1) = readings[0], readings[-1]
        seconds = t1 - t0

        def d(name: str) -> float:
            return after[f"vllm:{name}"] - before[f"vllm:{name}"]

        found.append(
            StepLevel(
                level,
                seconds,
                round(d("e2e_request_latency_seconds_count")),
                round(d("iteration_tokens_total_count")),
                round(d("generation_tokens_total")),
                round(d("iteration_tokens_total_sum")),
                d("e2e_request_latency_seconds_sum"),
                d("request_inference_time_seconds_sum"),
            )
        )
    return found, phases


def check_steps(upstream: str, quick: bool) -> list[Check]:
    """What a vLLM step costs here, read from vLLM's own counters (reported: docs/vllm.md reads
    it)."""
    levels, phases = measure_steps(
        upstream, (1, 4, 8, 32) if quick else (1, 2, 4, 8, 16, 24, 32), 32 if quick else 64
    )
    fitted = fit_phases(phases)
    m = fitted.fit.model
    return [
        Check(f"vLLM's steps at {level.in_flight} in flight (reported)", True, level.line())
        for level in levels
    ] + [
        Check(
            f"vLLM's steps straight at it: a step model of r^2 >= {R2_TARGET} on held-out phases",
            fitted.held_out_r2 >= R2_TARGET,
            f"r^2 {fitted.held_out_r2:.3f}, median error {fitted.held_out_median_rel_error:.1%} "
            f"(fitted to the first halves of {len(levels)} levels, judged on the second); "
            f"b0 {m.b0 * 1e3:.2f} ms, b1 {m.b1 * 1e6:.2f} us/prefill token, "
            f"b2 {m.b2 * 1e3:.3f} ms/sequence",
        )
    ]


#: The workloads whose prefix-cache hit rate the simulator must match (qsim.mixes.SharedPrefix):
#: a system prompt of 384 tokens (3 of vLLM's CPU blocks of 128) before 80 % of the prompts, and
#: conversations of 4 turns, 4 open at once, each turn's prompt the one before plus its answer.
PREFIX_WORKLOADS = {
    "system prompt 384:0.8": SharedPrefix(384, 0.8),
    "conversations 4 turns": SharedPrefix(turns=4, conversations=4),
}
#: vLLM's CPU KV cache as vllm_server starts it (2 GiB: 4,096 blocks of 128 tokens for GPT-2 tiny).
VLLM_CPU_BLOCK = 128
VLLM_CPU_BLOCKS = 4096
#: The hit rates of simulator and vLLM may differ by this much (absolute) and pass.
HIT_RATE_TOLERANCE = 0.01


def prefix_trace(prefixes: SharedPrefix, requests: int, seed: int = 0) -> Trace:
    """A seeded trace of shared prefixes (the reference mix's answers, prompts of 20 to 120 new
    tokens), its requests an hour apart: one at a time, in vLLM and in the simulator alike."""
    trace = make_trace(
        "poisson",
        requests=requests,
        seed=seed,
        load=0.1,
        prompts=Prompts("uniform", 20, 120),
        prefixes=prefixes,
    )
    return dataclasses.replace(trace, arrival_s=np.arange(len(trace.arrival_s)) * 3600.0)


def _token_ids(
    trace: Trace, i: int, answers: dict[int, list[int]], vocab: int, salt: int
) -> list[int]:
    """Request i's prompt as token ids: each segment's key names a run of tokens (a seeded draw,
    or the ids vLLM generated for an earlier request's answer), of which it takes the first ones.
    ``salt``: a check's own, so that a server that ran it before has none of its blocks cached."""
    ids = []
    for key, length in trace.tokens[i].prompt:
        run = answers.get(key)
        if run is None:
            run = np.random.default_rng((salt, key)).integers(16, vocab, size=length).tolist()
        ids.extend(run[:length])
    return ids


def vllm_hit_rate(upstream: str, model: str, trace: Trace, vocab: int) -> tuple[int, int]:
    """The trace's requests sent to vLLM one at a time as token ids (each answer's ids kept for the
    turns that follow it); vLLM's own prefix-cache queries and hits over them."""
    import httpx

    before = vllm_server.metrics(upstream)
    answers: dict[int, list[int]] = {}
    salt = secrets.randbits(32)
    with httpx.Client(base_url=upstream, timeout=300) as client:
        for i in range(len(trace.arrival_s)):
            body = {
                "model": model,
                "prompt": _token_ids(trace, i, answers, vocab, salt),
                "max_tokens": int(trace.max_new_tokens[i]),
                "return_token_ids": True,
            }
            answer = client.post("/v1/completions", json=body)
            answer.raise_for_status()
            answers[trace.tokens[i].answer] = (
                VllmCompletion.model_validate_json(answer.content).choices[0].token_ids
            )
    after = vllm_server.metrics(upstream)
    return tuple(
        round(after[f"vllm:prefix_cache_{k}_total"] - before[f"vllm:prefix_cache_{k}_total"])
        for k in ("queries", "hits")
    )


def simulated_hit_rate(trace: Trace) -> tuple[int, int]:
    engine = Batching(
        StepModel(),
        max_num_seqs=32,
        kv_blocks=VLLM_CPU_BLOCKS,
        block_size=VLLM_CPU_BLOCK,
        prefix_caching=True,
    )
    frame = simulate(trace, ServerConfig(PRESETS["none"], engine))
    return frame.attrs["prefix_cache_queries"], frame.attrs["prefix_cache_hits"]


def check_prefix_cache(upstream: str, quick: bool) -> list[Check]:
    """The simulator's prefix cache against vLLM's own counters on the same requests."""
    name = resolve_model(UpstreamSpec(upstream))
    vocab = (
        json.loads((Path(name) / "config.json").read_text())["vocab_size"]
        if (Path(name) / "config.json").exists()
        else 8192
    )
    checks = []
    for label, prefixes in PREFIX_WORKLOADS.items():
        trace = prefix_trace(prefixes, 24 if quick else 96)
        (vq, vh), (sq, sh) = vllm_hit_rate(upstream, name, trace, vocab), simulated_hit_rate(trace)
        detail = (
            f"vLLM {vh} of {vq} prompt tokens from its cache ({vh / vq:.1%}), the simulator "
            f"{sh} of {sq} ({sh / sq:.1%})"
        )
        checks.append(
            Check(
                f"prefix cache hit rate, {label}: simulator == vLLM within "
                f"{HIT_RATE_TOLERANCE:.0%}",
                abs(vh / vq - sh / sq) <= HIT_RATE_TOLERANCE,
                detail,
            )
        )
    return checks


def run(upstream: str, out: Path, quick: bool) -> list[Check]:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    traffic = Traffic(requests=64 if quick else 192)
    checks = []
    for section, fn in (
        ("tokens", lambda: check_tokens(upstream, logs, traffic)),
        ("calibration", lambda: check_calibration(upstream, logs, out, quick)),
        ("vLLM's steps", lambda: check_steps(upstream, quick)),
        ("prefix cache", lambda: check_prefix_cache(upstream, quick)),
    ):
        print(f"== {section} ({load_average()})", flush=True)
        for check in fn():
            print(check.line(), flush=True)
            checks.append(check)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", help="an OpenAI-compatible vLLM server already running (nothing started)"
    )
    parser.add_argument("--shape", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--quick", action="store_true", help="fewer requests: the CI test's form")
    parser.add_argument("--out", type=Path, default=None, help="where logs and the calibration go")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="qlab-vllm-check-"))
    with ExitStack() as stack:
        url = args.url
        if url is None:
            try:
                python = vllm_server.install()
                spec = vllm_server.ServerSpec(vllm_server.model(python, args.shape))
                print(f"starting vLLM ({spec.model.name}); this takes 100-180 s ...", flush=True)
                url = stack.enter_context(
                    vllm_server.serving(spec, out / "logs" / "vllm.log", python)
                )
            except vllm_server.Unavailable as exc:
                print(f"vllm_check: {exc}", file=sys.stderr)
                return 2
        print(f"vLLM at {url}; results in {out}", flush=True)
        checks = run(url.rstrip("/"), out, args.quick)
    missed = [c.name for c in checks if not c.passed]
    print(
        f"{len(checks) - len(missed)} PASS, {len(missed)} MISS"
        + (f": {'; '.join(missed)}" if missed else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
