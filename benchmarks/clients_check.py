"""Do the benchmark clients people point at OpenAI-compatible servers work against ``qlab serve``
unchanged?

For each tool (guidellm, inference-perf, aiperf, as installed by benchmarks/clients_check.sh in
throwaway environments from PyPI): a fresh ``qlab serve --engine synthetic --policy predictive``
(one engine, the reference line), a recording pass-through (:class:`Tap`) in front of it, and the
tool run against the tap for ``--seconds`` at a rate past the engine's capacity, streaming. Then:

* the HTTP statuses the tool got (the tap counts them): no 4xx other than 429 (503 is the
  gate's refusal, expected past capacity);
* the tool's own counts against the gate's ``/stats`` (:func:`agree`): its successes = good + late,
  its errors = rejected + expired + error + cancelled, the requests it cut off at its end =
  abandoned, or more: the gate may have answered or refused one before it saw the client go, and one
  cut off before it reached the gate is the tool's alone;
* its time to the first token is reported (a finite median).

The tools size prompts with a Hugging Face tokenizer they would download; this machine reaches
no hub, so each gets benchmarks/byte_tokenizer.py's (one token per byte, as qlab counts).

``--record DIR`` writes the first requests each tool sent (method, path, headers, body) to
DIR/TOOL.json: tests/test_clients_recorded.py replays them in ``make test``.

    bash benchmarks/clients_check.sh                     # installs the tools, runs this, prints the
                                                         table
    PYTHONPATH=. python benchmarks/clients_check.py --guidellm BIN --aiperf BIN --inference-perf BIN
    \\
        --tokenizer DIR [--seconds 20] [--record tests/data/clients]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx
import uvicorn

from live.contract import Stats
from live.procs import Server
from live.serve_options import ServeOptions
from qsim.records import ANSWERED

ROOT = Path(__file__).resolve().parents[1]
MODEL = "synthetic"
#: Requests a second: the reference line answers about 3.7 of these 32-token requests a second on
#: its one engine.
RATE = 8
TOKENS = 32
#: Headers a recording leaves out: the connection's own, and a key.
UNRECORDED = {"host", "content-length", "connection", "authorization", "transfer-encoding"}
#: The gate's outcome for a request whose client hung up.
LEFT = ("abandoned",)


# ---------------------------------------------------------------------- the recording pass-through


class Tap:
    """An ASGI pass-through to ``target`` that counts the statuses it passes back and keeps the
    first ``keep`` requests; a client that hangs up is passed on (the upstream request is closed, so
    the gate sees it leave)."""

    def __init__(self, target: str, keep: int) -> None:
        self.target, self.keep = target, keep
        self.statuses: Counter = Counter()  # every answer's
        # the generating requests' (the others: health checks, scrapes)
        self.post_statuses: Counter = Counter()
        self.recorded: list[dict] = []
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            if self._client is not None:
                await self._client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        if len(self.recorded) < self.keep and scope["method"] == "POST":
            self.recorded.append(
                {
                    "method": scope["method"],
                    "path": scope["path"],
                    "headers": {k: v for k, v in headers if k not in UNRECORDED},
                    "body": json.loads(body) if body else None,
                }
            )
        forward = asyncio.ensure_future(self._forward(scope, headers, body, send))
        gone = asyncio.ensure_future(_disconnected(receive))
        await asyncio.wait([forward, gone], return_when=asyncio.FIRST_COMPLETED)
        for task in (forward, gone):
            task.cancel()

    async def _forward(self, scope, headers, body: bytes, send) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None))
        query = f"?{scope['query_string'].decode()}" if scope["query_string"] else ""
        sent = [(k, v) for k, v in headers if k not in ("host", "content-length", "connection")]
        async with self._client.stream(
            scope["method"], self.target + scope["path"] + query, headers=sent, content=body
        ) as response:
            self.statuses[response.status_code] += 1
            if scope["method"] == "POST":
                self.post_statuses[response.status_code] += 1
            back = [
                (k.encode(), v.encode())
                for k, v in response.headers.items()
                if k not in ("content-length", "transfer-encoding", "connection")
            ]
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": back}
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Serving:
    """The tap on a free loopback port, in a thread of its own."""

    def __init__(self, tap: Tap) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(
                tap,
                host="127.0.0.1",
                port=0,
                log_level="warning",
                lifespan="on",
                timeout_keep_alive=30,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


# ---------------------------------------------------------------------- the tools


@dataclass(frozen=True)
class Counts:
    """What one side counted: answered, refused or failed, and cut off at the tool's end."""

    answered: int
    failed: int
    unfinished: int

    @property
    def total(self) -> int:
        return self.answered + self.failed + self.unfinished


@dataclass(frozen=True)
class Tool:
    name: str
    binary: str
    command: Callable[[str, Path], list[str]]  # (url, out dir) -> argv
    read: Callable[[Path], tuple[Counts, float]]  # out dir -> (its counts, its median TTFT in ms)
    shown: str = ""  # the command as the docs show it
    notes: list[str] = field(default_factory=list)


def _guidellm(binary: str, tokenizer: str, seconds: int) -> Tool:
    def command(url: str, out: Path) -> list[str]:
        return [
            binary,
            "run",
            "--backend",
            f"kind=openai_http,target={url},request_format=/v1/chat/completions",
            "--profile",
            f"kind=constant,rate={RATE}",
            "--constraint",
            f"kind=max_duration,seconds={seconds}",
            "--data",
            f"kind=synthetic_text,prompt_tokens={TOKENS},output_tokens={TOKENS}",
            "--tokenizer",
            f"kind=huggingface_auto,model={tokenizer}",
            "--output",
            f"kind=json,path={out / 'guidellm.json'}",
            "--disable-console-interactive",
        ]

    def read(out: Path) -> tuple[Counts, float]:
        bench = json.loads((out / "guidellm.json").read_text())["benchmarks"][0]
        requests = bench["requests"]
        ttft = [
            r["info"]["timings"]["first_token_iteration"] - r["info"]["timings"]["request_start"]
            for r in requests["successful"]
            if r["info"]["timings"].get("first_token_iteration")
        ]
        counts = Counts(
            len(requests["successful"]), len(requests["errored"]), len(requests["incomplete"])
        )
        return counts, statistics.median(ttft) * 1000 if ttft else math.nan

    shown = (
        "guidellm run --backend "
        "kind=openai_http,target=URL,request_format=/v1/chat/completions --profile "
        f"kind=constant,rate={RATE} --constraint kind=max_duration,seconds={seconds} --data "
        f"kind=synthetic_text,prompt_tokens={TOKENS},output_tokens={TOKENS} --tokenizer "
        "kind=huggingface_auto,model=BYTES --output kind=json,path=OUT"
    )
    return Tool("guidellm", binary, command, read, shown)


def _inference_perf(binary: str, tokenizer: str, seconds: int) -> Tool:
    def command(url: str, out: Path) -> list[str]:
        config = {
            "load": {"type": "constant", "stages": [{"rate": RATE, "duration": seconds}]},
            "api": {
                "type": "completion",
                "streaming": True,
                "headers": {"x-slo-ttft-ms": "500", "x-slo-tpot-ms": "50"},
            },
            "server": {"type": "vllm", "model_name": MODEL, "base_url": url, "ignore_eos": True},
            "tokenizer": {"pretrained_model_name_or_path": tokenizer},
            "data": {
                "type": "synthetic",
                "input_distribution": {
                    "min": 16,
                    "max": 48,
                    "mean": TOKENS,
                    "std_dev": 8,
                    "total_count": 1000,
                },
                "output_distribution": {
                    "min": 16,
                    "max": 48,
                    "mean": TOKENS,
                    "std_dev": 8,
                    "total_count": 1000,
                },
            },
            "report": {
                "request_lifecycle": {"summary": True, "per_stage": True, "per_request": True}
            },
            "storage": {"local_storage": {"path": str(out / "inference-perf")}},
        }
        path = out / "inference-perf.json"  # YAML is a superset of JSON
        path.write_text(json.dumps(config, indent=1))
        return [binary, "-c", str(path)]

    def read(out: Path) -> tuple[Counts, float]:
        summary = json.loads(
            (out / "inference-perf" / "summary_lifecycle_metrics.json").read_text()
        )
        ttft = (
            summary["successes"]["latency"].get("time_to_first_token", {}).get("median", math.nan)
        )
        failures = summary.get("failures") or {}
        return Counts(summary["successes"]["count"], failures.get("count", 0), 0), ttft * 1000

    shown = (
        f"inference-perf -c CONFIG (load constant, rate {RATE}, {seconds} s; api completion, "
        "streaming, headers "
        "x-slo-ttft-ms and x-slo-tpot-ms; server vllm, ignore_eos; data synthetic, about "
        f"{TOKENS} tokens in "
        "and out; tokenizer BYTES)"
    )
    return Tool("inference-perf", binary, command, read, shown)


def _aiperf(binary: str, tokenizer: str, seconds: int) -> Tool:
    def command(url: str, out: Path) -> list[str]:
        return [
            binary,
            "profile",
            "--model",
            MODEL,
            "--url",
            url,
            "--endpoint-type",
            "chat",
            "--streaming",
            "--tokenizer",
            tokenizer,
            "--request-rate",
            str(RATE),
            "--benchmark-duration",
            str(seconds),
            "--isl",
            str(TOKENS),
            "--osl",
            str(TOKENS),
            "--extra-inputs",
            "ignore_eos:true",
            "--artifact-dir",
            str(out / "aiperf"),
            "--ui-type",
            "simple",
        ]

    def read(out: Path) -> tuple[Counts, float]:
        export = json.loads((out / "aiperf" / "profile_export_aiperf.json").read_text())
        records = [
            json.loads(line)
            for line in (out / "aiperf" / "profile_export.jsonl").read_text().splitlines()
            if line
        ]
        cut = sum(1 for r in records if r["metadata"].get("was_cancelled"))
        answered = int(export["request_count"]["avg"])
        failed = int(export.get("error_request_count", {}).get("avg", 0)) - cut
        return Counts(answered, failed, cut), export["time_to_first_token"]["p50"]

    shown = (
        "aiperf profile --model synthetic --url URL --endpoint-type chat --streaming "
        "--tokenizer BYTES "
        f"--request-rate {RATE} --benchmark-duration {seconds} --isl {TOKENS} --osl {TOKENS} "
        "--extra-inputs ignore_eos:true"
    )
    return Tool("aiperf", binary, command, read, shown)


# ---------------------------------------------------------------------- one check


@dataclass
class Result:
    tool: str
    version: str
    command: str
    tool_counts: Counts | None = None
    gate_counts: Counts | None = None
    statuses: dict = field(default_factory=dict)
    ttft_ms: float = math.nan
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


#: The gate's outcomes a tool counts as an error: refused at arrival, dropped, failed, cut at the
#: deadline.
REFUSED = ("rejected", "expired", "error", "cancelled")


def agree(tool: Counts, gate: Counts) -> bool:
    """Whether the tool's counts are the gate's. A request the tool cut off at its end may have been
    answered or refused by the gate before it saw the client go, or never reached it: so the tool's
    answered and refused are at most the gate's, its cut-off ones at least the gate's abandoned, and
    it sent at least what the gate took. Without cut-offs at the end, all four are equalities."""
    return (
        tool.answered <= gate.answered
        and tool.failed <= gate.failed
        and tool.unfinished >= gate.unfinished
        and tool.total >= gate.total
    )


def gate_counts(stats: Stats) -> Counts:
    c = stats.counts
    return Counts(sum(c[o] for o in ANSWERED), sum(c[o] for o in REFUSED), sum(c[o] for o in LEFT))


def _settled(url: str) -> Stats:
    for _ in range(3000):
        stats = Stats.model_validate_json(httpx.get(f"{url}/stats", timeout=10).content)
        if stats.waiting == 0 and stats.in_service == 0:
            return stats
        time.sleep(0.02)
    raise RuntimeError("the gate did not settle")


def check(tool: Tool, version: str, seconds: int, work: Path, record: Path | None) -> Result:
    result = Result(tool.name, version, tool.shown)
    out = work / tool.name
    out.mkdir(parents=True, exist_ok=True)
    server = Server(ServeOptions(policy="predictive"), out / "serve.log")
    server.start(120)
    try:
        tap = Tap(server.url, keep=4)
        with _Serving(tap) as url:
            run = subprocess.run(
                tool.command(url, out),
                capture_output=True,
                text=True,
                timeout=seconds + 300,
                cwd=out,
            )
            (out / "tool.log").write_text(run.stdout + run.stderr)
        stats = _settled(server.url)
        # what `qlab replay --import --stats` reads
        (out / "stats.json").write_text(stats.model_dump_json())
    finally:
        server.stop()
    result.statuses = dict(sorted(tap.post_statuses.items()))
    result.gate_counts = gate_counts(stats)
    if run.returncode != 0:
        result.problems.append(
            f"exit status {run.returncode}: {(run.stderr or run.stdout).strip().splitlines()[-1:]}"
        )
        return result
    result.tool_counts, result.ttft_ms = tool.read(out)
    bad = {s: n for s, n in tap.statuses.items() if 400 <= s < 500 and s != 429}
    if bad:
        result.problems.append(f"4xx other than 429: {bad}")
    if not agree(result.tool_counts, result.gate_counts):
        result.problems.append(
            f"the tool counted {result.tool_counts}, the gate {result.gate_counts}"
        )
    if not (result.ttft_ms > 0 and math.isfinite(result.ttft_ms)):
        result.problems.append("no time to first token reported")
    if record is not None:
        record.mkdir(parents=True, exist_ok=True)
        (record / f"{tool.name}.json").write_text(
            json.dumps({"tool": tool.name, "version": version, "requests": tap.recorded}, indent=1)
            + "\n"
        )
    return result


def table(results: list[Result]) -> str:
    lines = [
        "| tool | version | answered (tool / gate) | refused (tool / gate) | cut off at its "
        "end (tool / gate) "
        "| statuses of its POSTs | TTFT median (tool's) | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t, g = r.tool_counts, r.gate_counts

        def pair(f: str, t=t, g=g) -> str:
            return f"{getattr(t, f)} / {getattr(g, f)}" if t and g else "-"

        statuses = ", ".join(f"{s}: {n}" for s, n in r.statuses.items()) or "-"
        ttft = f"{r.ttft_ms:.0f} ms" if math.isfinite(r.ttft_ms) else "-"
        verdict = "pass" if r.passed else "FAIL: " + "; ".join(r.problems)
        lines.append(
            f"| {r.tool} | {r.version} | {pair('answered')} | {pair('failed')} | "
            f"{pair('unfinished')} "
            f"| {statuses} | {ttft} | {verdict} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guidellm", help="the guidellm command (absent: skipped)")
    p.add_argument(
        "--inference-perf",
        dest="inference_perf",
        help="the inference-perf command (absent: skipped)",
    )
    p.add_argument("--aiperf", help="the aiperf command (absent: skipped)")
    p.add_argument("--version", action="append", default=[], metavar="TOOL=VERSION")
    p.add_argument(
        "--skip", action="append", default=[], metavar="TOOL=WHY", help="a tool not run, and why"
    )
    p.add_argument("--tokenizer", required=True, help="benchmarks/byte_tokenizer.py's directory")
    p.add_argument("--seconds", type=int, default=20)
    p.add_argument("--record", type=Path, help="write each tool's first requests to DIR/TOOL.json")
    p.add_argument(
        "--keep", type=Path, help="keep each tool's output, log and the gate's /stats in DIR/TOOL/"
    )
    args = p.parse_args(argv)
    versions = dict(v.split("=", 1) for v in args.version)
    makers = {
        "guidellm": (_guidellm, args.guidellm),
        "inference-perf": (_inference_perf, args.inference_perf),
        "aiperf": (_aiperf, args.aiperf),
    }
    results = []
    with tempfile.TemporaryDirectory(prefix="clients-check-") as temporary:
        work = args.keep or temporary
        for name, (make, binary) in makers.items():
            if binary is None:
                continue
            tool = make(binary, args.tokenizer, args.seconds)
            print(
                f"clients_check: {name} {versions.get(name, '?')} for {args.seconds} s ...",
                file=sys.stderr,
                flush=True,
            )
            results.append(
                check(tool, versions.get(name, "?"), args.seconds, Path(work), args.record)
            )
    print(table(results))
    for skipped in args.skip:
        name, why = skipped.split("=", 1)
        print(f"| {name} | - | - | - | - | - | - | not run: {why} |")
    print()
    for r in results:
        print(f"- {r.tool}: `{r.command}`")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
