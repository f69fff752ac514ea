"""vLLM's front end measured: its API process's CPU time per request and per generated token.

    python benchmarks/vllm_front_end.py [--url URL [--api-pid PID]] [--json] [--vllm-python PY]
                                        [--levels 1 2 4 8 16 32] [--lengths 16 64] [--repeat 2]

qlab's simulator models vLLM's API server process (one asyncio process: it tokenises each prompt,
hands the request to the engine-core process, then detokenises and streams every token back) as
one FIFO server with a job per request at intake (``request_s``) and a job per engine step for
that step's outputs (``token_s`` times the tokens the step produced). This script measures those
numbers on vLLM itself:

1. **the API process's CPU time**: ``process_cpu_seconds_total`` on vLLM's ``/metrics``
   (prometheus-client's process collector, served by the API process itself, so it works for a
   remote server too); where /metrics lacks it and the server is local, utime + stime of
   ``/proc/PID/stat`` of the process the launcher started (``--api-pid`` for a local ``--url``).
   Where local, the engine core (the API process's child ``VLLM::EngineCore``) and its worker
   (the engine core's child ``VLLM::Worker``) are read too, for reference, and every process's
   time runnable but waiting for a core (``/proc/PID/task/*/schedstat``), this script's included;
2. **phases straight at vLLM's OpenAI API**: ``/v1/completions`` with ``ignore_eos``, short text
   prompts, a closed loop keeping N requests in flight, at each N and output length, streamed;
   then the lowest and highest N not streamed; the whole plan ``--repeat`` times. Each phase
   records vLLM's counters (requests, generated tokens, engine steps, its end-to-end time), the
   API process's CPU seconds, the wall time and the client's mean latency;
3. **the fit**: API CPU s (less the idle rate's share) = request_s x requests + token_s x tokens,
   and the same with a step_s x steps term (each coefficient's standard error and p-value say
   whether the term is significant), by least squares, streamed and non-streamed phases apart;
   each phase's residual under both. A phase's utilisation (API CPU s / wall s) near 1.0 says the
   front end is the bottleneck.

Without ``--url`` the tiny-shape local model is started with :mod:`live.vllm_server` (100-180 s
on 2 cores) and stopped at the end. Progress goes to stderr, the report (or ``--json``) to
stdout. Exit status 2 when vLLM cannot be started or read (one line on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from scipy import stats

from live import vllm_server
from live.upstream import UpstreamSpec, resolve_model

#: prometheus-client's process collector: the CPU time of the process serving /metrics.
PROCESS_CPU = "process_cpu_seconds_total"
GENERATED, STEPS, ANSWERED, E2E = (
    "vllm:generation_tokens_total",
    "vllm:iteration_tokens_total_count",
    "vllm:request_success_total",
    "vllm:e2e_request_latency_seconds_sum",
)
#: /proc/PID/comm of vLLM's engine-core process and of its worker (the kernel cuts a name to 15).
ENGINE_COMMS = ("VLLM::EngineCor", "VLLM::Worker")
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")


# ---------------------------------------------------------------- where the CPU time is read


def proc_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` (its threads included, its children not), in seconds."""
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces: the fields after its closing parenthesis.
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_queue_wait_s(pid: int) -> float:
    """The seconds ``pid``'s threads spent runnable but waiting for a core (schedstat's second
    field, per thread): a front end that waits here is starved of CPU, not idle."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return total / 1e9


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's list: a child belongs to the thread that
    started it)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def engine_pids(api_pid: int) -> list[int]:
    """vLLM's engine core (a child of the API process) and its worker (the engine core's child)."""
    found, todo = [], children(api_pid)
    while todo:
        pid = todo.pop()
        try:
            if comm(pid) in ENGINE_COMMS:
                found.append(pid)
                todo += children(pid)
        except FileNotFoundError:  # gone between the listing and the read
            pass
    return sorted(found)


def scrape(url: str) -> dict[str, float]:
    """vLLM's counters and, where /metrics has it, the API process's CPU seconds: one GET, so that
    both are read at the same moment (each summed over its labels)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    wanted = {*vllm_server.COUNTERS, PROCESS_CPU}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


@dataclass(frozen=True)
class Source:
    """How the API process's CPU time is read, and why that process is the API server."""

    how: str  # "metrics" or "proc"
    api_pid: int | None  # where local
    engine_pids: tuple[int, ...]
    reason: str

    def read(self, url: str) -> dict[str, float]:
        """Everything a phase takes the difference of, read now; the /proc figures only where
        the server is local."""
        now = scrape(url)
        now["wall"], now["client"] = time.perf_counter(), time.process_time()
        now["client_wait"] = run_queue_wait_s(os.getpid())
        if self.api_pid:
            now["proc_api"] = proc_cpu_s(self.api_pid)
            now["api_wait"] = run_queue_wait_s(self.api_pid)
        if self.engine_pids:
            now["engine"] = sum(proc_cpu_s(p) for p in self.engine_pids)
            now["engine_wait"] = sum(run_queue_wait_s(p) for p in self.engine_pids)
        now["api"] = now[PROCESS_CPU] if self.how == "metrics" else now["proc_api"]
        return now


def identify(url: str, api_pid: int | None) -> Source:
    """Where the API process's CPU time comes from, with the evidence that it is that process."""
    scraped = scrape(url)
    engines = tuple(engine_pids(api_pid)) if api_pid else ()
    notes = []
    if api_pid:
        cmdline = Path(f"/proc/{api_pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        named = {p: comm(p) for p in engines}
        notes.append(
            f"pid {api_pid} ({comm(api_pid)}) "
            f"{'runs' if 'openai.api_server' in cmdline else 'does NOT run'} "
            f"vllm.entrypoints.openai.api_server; its engine processes: {named or 'none found'}"
        )
    if PROCESS_CPU in scraped:
        if api_pid:
            # The process serving /metrics is the API server: its figure must be pid's own.
            notes.append(
                f"/metrics' {PROCESS_CPU} {scraped[PROCESS_CPU]:.2f} s = "
                f"/proc/{api_pid}/stat {proc_cpu_s(api_pid):.2f} s (engine processes "
                f"{sum(proc_cpu_s(p) for p in engines):.2f} s)"
            )
        return Source("metrics", api_pid, engines, "; ".join(notes) or "read from /metrics")
    if not api_pid:
        raise vllm_server.Unavailable(
            f"{url}/metrics has no {PROCESS_CPU} and the server is not local: no CPU time to read"
        )
    notes.append(f"/metrics has no {PROCESS_CPU}: read from /proc/{api_pid}/stat")
    return Source("proc", api_pid, engines, "; ".join(notes))


# ---------------------------------------------------------------- the phases


@dataclass(frozen=True)
class PhaseSpec:
    in_flight: int
    max_tokens: int
    requests: int
    stream: bool = True


@dataclass(frozen=True)
class Phase:
    """One phase as vLLM's counters, the API process's clock and the client saw it."""

    in_flight: int
    max_tokens: int
    stream: bool
    requests: int  # vLLM's own count of requests finished
    tokens: int  # vLLM's generated tokens
    steps: int  # vLLM's engine steps (iteration_tokens_total's count)
    chunks: int  # streamed events the client read (several tokens each when the API lags)
    api_cpu_s: float
    wall_s: float
    latency_s: float  # the client's mean, a request's start to its last byte
    vllm_e2e_s: float  # vLLM's own mean end to end (arrival to its last output)
    client_cpu_s: float  # this script's own CPU time: it shares the cores
    client_wait_s: float  # ... and its time runnable, waiting for a core
    engine_cpu_s: float | None  # the engine core and its worker, where local
    api_wait_s: float | None  # the API process runnable, waiting for a core, where local
    engine_wait_s: float | None  # ... the engine core and its worker
    load_1min: float

    @property
    def utilisation(self) -> float:
        return self.api_cpu_s / self.wall_s


def prompts(count: int, seed: int) -> list[str]:
    """Short text prompts (16-48 words): vLLM tokenises each one in its API process, as it would a
    client's text."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(16, 48))) for _ in range(count)]


async def _one(client: httpx.AsyncClient, request: dict, stream: bool) -> tuple[float, int]:
    """One request: its latency at the client, and the streamed events it read (1 unstreamed)."""
    start = time.perf_counter()
    request = {**request, "stream": stream}
    if not stream:
        answer = await client.post("/v1/completions", json=request)
        answer.raise_for_status()
        return time.perf_counter() - start, 1
    # Events counted in the raw bytes, not parsed: the client shares the cores with vLLM, so it
    # does as little as it can. The tail carries an event's start cut between two reads.
    events, tail = 0, b""
    async with client.stream("POST", "/v1/completions", json=request) as answer:
        answer.raise_for_status()
        async for data in answer.aiter_raw():
            events += (tail + data).count(b"data: ")
            tail = data[-5:]
    return time.perf_counter() - start, events - 1  # less the closing "data: [DONE]"


async def _closed_loop(url: str, model: str, spec: PhaseSpec, seed: int) -> list[tuple]:
    """spec.requests requests, spec.in_flight at a time: each worker sends its next as soon as
    its last is answered, so the level holds until the last in_flight requests drain."""
    texts = iter(prompts(spec.requests, seed))
    limits = httpx.Limits(max_connections=spec.in_flight + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> list[tuple]:
            done = []
            for text in texts:  # one iterator shared by every worker
                request = {
                    "model": model,
                    "prompt": text,
                    "max_tokens": spec.max_tokens,
                    "ignore_eos": True,
                }
                done.append(await _one(client, request, spec.stream))
            return done

        results = await asyncio.gather(*(worker() for _ in range(spec.in_flight)))
    return list(itertools.chain.from_iterable(results))


def run_phase(url: str, model: str, spec: PhaseSpec, source: Source, seed: int) -> Phase:
    before = source.read(url)
    answers = asyncio.run(_closed_loop(url, model, spec, seed))
    after = source.read(url)

    def d(name: str) -> float | None:
        return after[name] - before[name] if name in after and name in before else None

    requests = round(d(ANSWERED) or 0)
    return Phase(
        spec.in_flight,
        spec.max_tokens,
        spec.stream,
        requests,
        round(d(GENERATED) or 0),
        round(d(STEPS) or 0),
        sum(c for _, c in answers),
        d("api"),
        d("wall"),
        sum(lat for lat, _ in answers) / len(answers),
        (d(E2E) or 0) / max(requests, 1),
        d("client"),
        d("client_wait"),
        d("engine"),
        d("api_wait"),
        d("engine_wait"),
        os.getloadavg()[0],
    )


def plan(levels: list[int], lengths: list[int], requests: int) -> list[PhaseSpec]:
    """Every level at every length, streamed; then the lowest and highest levels not streamed.
    A phase is at least three rounds of its level, so that most of it runs at the level, not in
    its drain."""
    streamed = [PhaseSpec(n, m, max(requests, 3 * n)) for n in levels for m in lengths]
    ends = sorted({min(levels), max(levels)})
    return streamed + [PhaseSpec(n, m, max(requests, 3 * n), False) for n in ends for m in lengths]


def idle_rate(url: str, source: Source, seconds: float = 10.0) -> float:
    """The API process's CPU seconds a second with no requests (its background loops and the
    scrapes): taken off each phase's CPU time, wall time for wall time, before the fit."""
    before = source.read(url)
    time.sleep(seconds)
    after = source.read(url)
    return (after["api"] - before["api"]) / (after["wall"] - before["wall"])


# ---------------------------------------------------------------- the fit


@dataclass(frozen=True)
class Fit:
    names: tuple[str, ...]
    coef: tuple[float, ...]
    stderr: tuple[float, ...]  # nan where the fit has no degrees of freedom left
    p_value: tuple[float, ...]  # two-sided, that the coefficient is zero
    r2: float  # about the mean of y (the fit has no intercept)
    residuals: tuple[float, ...]  # y - fitted, seconds


def least_squares(columns: dict[str, list[float]], y: list[float]) -> Fit:
    """y = sum of coef x column, no intercept (no request, no token: no CPU), by least squares;
    each coefficient's standard error and p-value from the residuals' variance."""
    x, target = np.column_stack([np.asarray(c, float) for c in columns.values()]), np.asarray(y)
    coef, *_ = np.linalg.lstsq(x, target, rcond=None)
    residuals = target - x @ coef
    rss, dof = float(residuals @ residuals), len(target) - x.shape[1]
    tss = float(((target - target.mean()) ** 2).sum())
    if dof > 0:
        se = np.sqrt(np.diag(rss / dof * np.linalg.inv(x.T @ x)))
        p = 2 * stats.t.sf(np.abs(coef / se), dof)
    else:
        se = p = np.full(len(coef), np.nan)
    return Fit(
        tuple(columns),
        tuple(map(float, coef)),
        tuple(map(float, se)),
        tuple(map(float, p)),
        1 - rss / tss if tss > 0 else float("nan"),
        tuple(map(float, residuals)),
    )


def fit_phases(phases: list[Phase], idle: float = 0.0, per_step: bool = False) -> Fit:
    """API CPU s (less the idle rate's share of the phase's wall time) = request_s x requests
    + token_s x tokens [+ step_s x steps]."""
    columns = {"request_s": [p.requests for p in phases], "token_s": [p.tokens for p in phases]}
    if per_step:
        columns["step_s"] = [p.steps for p in phases]
    return least_squares(columns, [p.api_cpu_s - idle * p.wall_s for p in phases])


def fits(phases: list[Phase], idle: float) -> dict[str, tuple[list[Phase], Fit]]:
    """The two-term model and the one with a per-step term, streamed and not, each with the
    phases it was fitted to."""
    found = {}
    for label, group in (
        ("streamed", [p for p in phases if p.stream]),
        ("not streamed", [p for p in phases if not p.stream]),
    ):
        if len(group) >= 2:
            found[label] = (group, fit_phases(group, idle))
        if len(group) >= 3:
            found[f"{label} + step"] = (group, fit_phases(group, idle, per_step=True))
    return found


# ---------------------------------------------------------------- the report


def _opt(value: float | None, width: int = 6) -> str:
    return "-".rjust(width) if value is None else f"{value:{width}.2f}"


HEADER = (
    " in  max str reqs tokens  steps chunks  API s  util wait s  eng s wait s  cli s wait s"
    " wall s  lat ms e2e ms  load  res ms res+step"
)


def phase_row(p: Phase, residuals: tuple[float | None, float | None] = (None, None)) -> str:
    res = " ".join("-".rjust(8) if r is None else f"{r * 1e3:+8.0f}" for r in residuals)
    return (
        f"{p.in_flight:>3} {p.max_tokens:>4} {'yes' if p.stream else 'no':>3} {p.requests:>4} "
        f"{p.tokens:>6} {p.steps:>6} {p.chunks:>6} {p.api_cpu_s:6.2f} {p.utilisation:5.2f} "
        f"{_opt(p.api_wait_s)} {_opt(p.engine_cpu_s)} {_opt(p.engine_wait_s)} "
        f"{p.client_cpu_s:6.2f} {p.client_wait_s:6.2f} {p.wall_s:6.2f} "
        f"{p.latency_s * 1e3:7.0f} {p.vllm_e2e_s * 1e3:6.0f} {p.load_1min:5.2f} {res}"
    )


def fit_line(label: str, fit: Fit) -> str:
    terms = ", ".join(
        f"{n} {c * 1e3:.4f} ms (se {s * 1e3:.4f}, p {p:.2g})"
        for n, c, s, p in zip(fit.names, fit.coef, fit.stderr, fit.p_value)
    )
    return f"{label}: {terms}; r^2 {fit.r2:.4f}"


def residuals_of(fitted: dict) -> dict[int, tuple[float | None, float | None]]:
    """Each phase's residual (by id) under its group's fit without and with the step term."""
    found: dict[int, list] = {}
    for label, (group, fit) in fitted.items():
        column = 1 if label.endswith("+ step") else 0
        for p, r in zip(group, fit.residuals):
            found.setdefault(id(p), [None, None])[column] = r
    return {k: tuple(v) for k, v in found.items()}


def report(result: dict, phases: list[Phase], fitted: dict, out: Callable) -> None:
    source = result["source"]
    out(f"API CPU read from {source['how']}: {source['reason']}")
    out(f"{PROCESS_CPU} on /metrics: {result['process_cpu_on_metrics']}")
    out(f"API CPU with no requests: {result['idle_api_cpu_rate'] * 1e3:.1f} ms a second")
    out(HEADER)
    residuals = residuals_of(fitted)
    for p in phases:
        out(phase_row(p, residuals.get(id(p), (None, None))))
    for label, (_, fit) in fitted.items():
        out(fit_line(label, fit))
    top = max(p.in_flight for p in phases)
    busiest = max(p.utilisation for p in phases if p.in_flight == top)
    out(
        f"API utilisation at {top} in flight: up to {busiest:.2f} (near 1.0: the front end is "
        "the bottleneck)"
    )
    loads = result["load_average"]
    out(
        f"load average (1 min) during the phases {min(loads):.2f}-{max(loads):.2f}, at the end "
        "{:.2f} / {:.2f} / {:.2f} (1 / 5 / 15 min) on {} cores".format(
            *result["load_average_end"], os.cpu_count()
        )
    )


# ---------------------------------------------------------------- running it


@contextmanager
def local_server(python: Path, shape: str, log: Path) -> Iterator[tuple[str, int]]:
    """vllm_server.serving's start and stop, keeping the process: its pid is the API server's."""
    spec = vllm_server.ServerSpec(vllm_server.model(python, shape))
    proc, url = vllm_server.launch(python, spec, log)
    try:
        vllm_server.wait_ready(proc, url, log)
        yield url, proc.pid
    finally:
        vllm_server.stop(proc)
        # stop() returns once the API process has exited; its engine processes may still be
        # ending: none of the server's session may outlive the script.
        vanish(proc.pid)


def vanish(pgid: int, grace_s: float = 30.0) -> None:
    """Until process group ``pgid`` has no process left; SIGKILL to it after ``grace_s``."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def measure(url: str, api_pid: int | None, args: argparse.Namespace, log: Callable) -> dict:
    source = identify(url, api_pid)
    model = resolve_model(UpstreamSpec(url))
    log(f"API CPU from {source.how}: {source.reason}")
    # Unmeasured warm-up: the first requests at a level pay for lazy set-up in vLLM.
    top = max(args.levels)
    run_phase(url, model, PhaseSpec(top, max(args.lengths), 2 * top), source, seed=-1)
    idle = idle_rate(url, source)
    # Each pass runs the whole plan again (new prompts): a pass's phases are never all at one
    # moment of the machine's load, which other processes change.
    specs = plan(args.levels, args.lengths, args.requests) * args.repeat
    phases = []
    for i, spec in enumerate(specs):
        phases.append(run_phase(url, model, spec, source, seed=i))
        p = phases[-1]
        log(
            f"[{i + 1}/{len(specs)}] {p.in_flight} in flight, {p.max_tokens} tokens, "
            f"{'streamed' if p.stream else 'not streamed'}: {p.wall_s:.1f} s, "
            f"API utilisation {p.utilisation:.2f}, load {p.load_1min:.2f}"
        )
    return {"source": source, "phases": phases, "idle": idle}


def summarise(measured: dict, on_metrics: bool) -> tuple[dict, dict]:
    phases, idle = measured["phases"], measured["idle"]
    fitted = fits(phases, idle)
    result = {
        "source": asdict(measured["source"]),
        "process_cpu_on_metrics": on_metrics,
        "idle_api_cpu_rate": idle,
        "phases": [asdict(p) | {"utilisation": p.utilisation} for p in phases],
        "fits": {k: asdict(f) for k, (_, f) in fitted.items()},
        "load_average": [p.load_1min for p in phases],
        "load_average_end": os.getloadavg(),
        "cores": os.cpu_count(),
    }
    return result, fitted


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a vLLM server already running (nothing started)")
    parser.add_argument(
        "--api-pid", type=int, help="with --url to a server on this machine: its API process"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--shape", choices=("tiny", "small"), default="tiny")
    parser.add_argument(
        "--vllm-python", type=Path, help="the Python of a venv with vLLM (default: install it)"
    )
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--requests", type=int, default=96, help="a phase's requests, at least")
    parser.add_argument("--repeat", type=int, default=2, help="passes over every phase")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)

    # Progress goes to stderr, so that stdout is the report (or the JSON) alone.
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with ExitStack() as stack:
        url, pid = args.url, args.api_pid
        try:
            if url is None:
                python = args.vllm_python or vllm_server.install()
                logs = Path(tempfile.mkdtemp(prefix="qlab-vllm-front-end-"))
                log(f"starting vLLM ({args.shape}; log {logs / 'vllm.log'}): 100-180 s ...")
                url, pid = stack.enter_context(local_server(python, args.shape, logs / "vllm.log"))
            url = url.rstrip("/")
            on_metrics = PROCESS_CPU in scrape(url)
            measured = measure(url, pid, args, log)
        except (vllm_server.Unavailable, httpx.HTTPError, ValueError) as exc:
            print(f"vllm_front_end: {exc}", file=sys.stderr)
            return 2
    result, fitted = summarise(measured, on_metrics)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result, measured["phases"], fitted, print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
