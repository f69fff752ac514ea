"""The machine's floor: the bare minimum of an HTTP server, measured beside the gate
(benchmarks/bench_openai.py).

On a small machine a good part of what bench_openai.py measures is not the
gate's: it is the kernel's loopback, waking idle CPUs, uvicorn and its HTTP
parser, and (in front of an upstream) one more hop through aiohttp. Two bare
ASGI apps, with nothing of qlab's in them, measure that floor in the same run
under the same load, so that a reader sees which part of each figure is the
gate's:

- ``refuser``: reads the request's body and answers a fixed 503 in qlab's
  error envelope with Retry-After (the body built once, through
  :func:`live.contract.error_json`): the least a refusal can cost.
- ``proxy``: a pass-through to ``--upstream URL``: reads the body, POSTs the
  same bytes to the same path upstream on one ``aiohttp.ClientSession``
  (created on the server's loop at the first request), sends back the
  status and content type, and streams the upstream's body back chunk by
  chunk as it arrives: the least a gate in front of an upstream can add.

Both run under uvicorn as ``qlab serve`` does (:func:`live.commands.cmd_serve`:
uvloop where installed, httptools with the head cap of
:func:`live.headcap.http_options`, no access log, the heap frozen), answer
``GET /healthz`` themselves, and print ``floor KIND: listening on URL`` as the
first stdout line, so :class:`FloorServer` starts and stops them as
:mod:`live.procs` does ``qlab serve`` (``--watch-stdin`` included: they never
outlive the benchmark).

    python -m benchmarks.floor refuser --port 0
    python -m benchmarks.floor proxy --upstream http://127.0.0.1:8001 --port 0
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from importlib import metadata
from pathlib import Path
from typing import Iterator

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from live.commands import _bind, _url, run_app
from live.contract import error_json
from live.procs import ROOT, Server
from live.serve_options import LOOPBACK, ServeOptions
from live.upstream import KEEPALIVE_S

#: The proxy's connections to its upstream at most (aiohttp's default): far above what the benchmark
#: has in flight.
PROXY_CONNECTIONS = 100
RETRY_AFTER_S = 1
#: A refusal as the gate writes one for an unreachable deadline (about the same size, the same
#: envelope).
REFUSAL = error_json(
    "overloaded",
    "deadline_unreachable",
    "estimated wait 0.820 s plus service 0.550 s exceeds the deadline of 1.000 "
    "s; "
    f"retry after {RETRY_AFTER_S} s",
    {
        "arrived_at": 12.345678,
        "est_service_s": 0.55,
        "deadline_s": 1.0,
        "queued": 3,
        "queued_work_s": 0.82,
        "speed_factor": 1.0,
        "wait_s": 0.82,
    },
    RETRY_AFTER_S,
).encode()
JSON = b"application/json"


async def _body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _answer(send, status: int, body: bytes, headers: list | None = None) -> None:
    head = [(b"content-type", JSON), (b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class FloorApp:
    """One of the two bare apps (see the module docstring); ``announce`` runs once the server is
    up."""

    def __init__(self, kind: str, announce, upstream: str | None = None) -> None:
        self.kind, self.announce, self.upstream = kind, announce, upstream
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            if scope["method"] == "GET" and scope["path"] == "/healthz":
                await _answer(send, 200, b'{"status":"ok"}')
            elif self.kind == "refuser":
                await _body(receive)  # read as the gate reads it, then thrown away
                await _answer(send, 503, REFUSAL, [(b"retry-after", str(RETRY_AFTER_S).encode())])
            else:
                await self._forward(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.announce()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._session is not None:
                    await self._session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope, receive, send) -> None:
        body = await _body(receive)
        if self._session is None:  # here, on the server's own loop
            # auto_decompress off: the bytes go back as they came, so the upstream's Content-Length
            # holds.
            self._session = aiohttp.ClientSession(
                self.upstream,
                auto_decompress=False,
                connector=aiohttp.TCPConnector(
                    limit=PROXY_CONNECTIONS, keepalive_timeout=KEEPALIVE_S
                ),
            )
        content_type = dict(scope["headers"]).get(b"content-type", JSON).decode("latin-1")
        async with self._session.request(
            scope["method"], scope["path"], data=body, headers={"content-type": content_type}
        ) as response:
            head = [
                (
                    b"content-type",
                    response.headers.get("content-type", "application/json").encode("latin-1"),
                )
            ]
            # a whole JSON answer: sent as the upstream framed it
            if "content-length" in response.headers:
                head.append(
                    (b"content-length", response.headers["content-length"].encode("latin-1"))
                )
            await send({"type": "http.response.start", "status": response.status, "headers": head})
            # each chunk as soon as it arrives (an event stream)
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="A bare ASGI server: the machine's floor beside the gate."
    )
    parser.add_argument("kind", choices=("refuser", "proxy"))
    parser.add_argument("--upstream", metavar="URL", help="proxy: the server to forward to")
    parser.add_argument("--host", default=LOOPBACK)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--watch-stdin", action="store_true", help="stop when stdin reaches end of file"
    )
    args = parser.parse_args(argv)
    if args.kind == "proxy" and not args.upstream:
        parser.error("proxy needs --upstream URL")
    sock = _bind(args.host, args.port)
    url = _url(sock)
    app = FloorApp(
        args.kind,
        lambda: print(f"floor {args.kind}: listening on {url}", flush=True),
        args.upstream.rstrip("/") if args.upstream else None,
    )
    run_app(app, sock, "warning", "httptools", args.watch_stdin)  # qlab serve's own server stack
    return 0


class FloorServer(Server):
    """A floor app as a subprocess, started, awaited and stopped as :class:`live.procs.Server`
    does qlab serve."""

    def __init__(self, kind: str, log_dir: str | Path, upstream: str | None = None) -> None:
        # The options only name it in Server's messages; the argv is the floor's own (spawn).
        super().__init__(ServeOptions(policy=f"floor-{kind}"), Path(log_dir) / f"floor-{kind}.log")
        self.kind, self.upstream = kind, upstream

    def spawn(self) -> None:
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        argv = [sys.executable, "-m", "benchmarks.floor", self.kind, "--port", "0", "--watch-stdin"]
        argv += ["--upstream", self.upstream] if self.upstream else []
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def machine() -> dict:
    """What a floor depends on, printed beside the figures: the same code meets or misses the
    targets by the host (docs/benchmarks.md). Linux's /proc and /sys where they are; None where
    not."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        None,
    )
    try:
        uvloop = metadata.version("uvloop")
    except metadata.PackageNotFoundError:
        uvloop = None
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "cpuidle_governor": _read("/sys/devices/system/cpu/cpuidle/current_governor").strip()
        or None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "uvloop": uvloop,
    }


@contextmanager
def floors(
    log_dir: str | Path, upstream: str, timeout_s: float = 60.0
) -> Iterator[tuple[FloorServer, FloorServer]]:
    """The refuser and a proxy to ``upstream``, started side by side; always stopped."""
    with ExitStack() as stack:
        servers = (FloorServer("refuser", log_dir), FloorServer("proxy", log_dir, upstream))
        for server in servers:
            stack.callback(server.stop)
            server.spawn()
        for server in servers:
            server.wait_ready(timeout_s)
        yield servers


if __name__ == "__main__":
    sys.exit(main())
