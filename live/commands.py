"""``qlab serve``: the gate and an engine behind HTTP, bound to loopback unless told otherwise.

The first line on stdout is ``qlab serve: listening on http://HOST:PORT`` (the
real port, also with ``--port 0``), printed once the engines are warm and the
gate is up, so a parent process can read it and start sending.
Torch is imported only for ``--engine gpt2``.

``--watch-stdin`` makes the server stop when its stdin reaches end of file:
a parent that starts servers with a pipe on their stdin (``qlab live``) takes
them down with it however it ends, even by SIGKILL, when the kernel closes
the pipe. Fault injection (synthetic engine): ``--fail-every N``,
``--hang-after N`` and ``--hang-for S``; ``--stall-factor`` and
``--stall-after`` set when the gate counts an engine as stalled (see
:mod:`live.gate`).
"""

from __future__ import annotations

import gc
import ipaddress
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass

from qsim.argtypes import count, non_negative, number, port, positive, positive_int
from qsim.policy import PRESETS, preset
from qsim.service import ServiceModel

from .engine import Faults, SyntheticEngine, parse_schedule

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``qlab serve`` needs, checked once."""

    policy: str
    max_queue: int | None
    deadline_s: float | None
    engine: str
    model: str
    device: str
    engines: int
    speed: float
    noise_cv: float
    schedule: tuple[tuple[float, float], ...]
    seed: int
    threads: int | None
    service_model: str | None
    fixed_estimate: bool
    host: str
    port: int
    log_level: str
    faults: Faults = Faults()
    stall_factor: float = 10.0
    stall_floor_s: float = 5.0
    watch_stdin: bool = False
    http: str = "httptools"

    @classmethod
    def from_args(cls, args) -> "ServeConfig":
        synthetic_only = [f for f, v in (("--speed", args.speed), ("--noise", args.noise),
                                         ("--speed-schedule", args.speed_schedule), ("--fail-every", args.fail_every),
                                         ("--hang-after", args.hang_after), ("--hang-for", args.hang_for))
                          if v is not None]
        gpt2_only = [f for f, v in (("--model", args.model), ("--device", args.device), ("--threads", args.threads))
                     if v is not None]
        if args.engine == "gpt2" and synthetic_only:
            raise ValueError(f"{', '.join(synthetic_only)}: only with --engine synthetic")
        if args.engine == "synthetic" and gpt2_only:
            raise ValueError(f"{', '.join(gpt2_only)}: only with --engine gpt2")
        if args.hang_for is not None and args.hang_after is None:
            raise ValueError("--hang-for: only with --hang-after (which run hangs)")
        return cls(
            policy=args.policy, max_queue=args.max_queue, deadline_s=args.deadline, engine=args.engine,
            model=args.model or "random", device=args.device or "auto", engines=args.engines,
            speed=1.0 if args.speed is None else args.speed, noise_cv=args.noise or 0.0,
            schedule=parse_schedule(args.speed_schedule or ""), seed=args.seed, threads=args.threads,
            service_model=args.service_model, fixed_estimate=args.fixed_estimate, host=args.host or LOOPBACK,
            port=args.port, log_level=args.log_level,
            faults=Faults(args.fail_every or 0, args.hang_after, args.hang_for),
            stall_factor=args.stall_factor, stall_floor_s=args.stall_after, watch_stdin=args.watch_stdin,
            http=args.http,
        )


def _engines(cfg: ServeConfig, model: ServiceModel) -> list:
    if cfg.engine == "synthetic":
        return [SyntheticEngine(model, cfg.speed, cfg.noise_cv, cfg.seed + k, cfg.schedule, faults=cfg.faults)
                for k in range(cfg.engines)]
    from . import gpt2  # torch loads here and nowhere else

    return gpt2.make_engines(cfg.engines, gpt2.GPT2Spec(cfg.model, cfg.device, cfg.seed, cfg.threads))


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket; with port 0 the kernel picks a free port (read back for the URL)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # connections queue in the kernel until uvicorn accepts them
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc}") from None
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _announce(url: str, cfg: ServeConfig, host_given: bool) -> None:
    print(f"qlab serve: listening on {url}", flush=True)
    if not host_given:
        print(f"qlab serve: bound to loopback ({LOOPBACK}) only; pass --host to listen elsewhere", flush=True)
    elif not _is_loopback(cfg.host):
        print(f"qlab serve: --host {cfg.host}: reachable from other machines; there is no authentication", flush=True)
    print(f"qlab serve: policy {cfg.policy}, {cfg.engines} {cfg.engine} engine(s)"
          + (", fixed estimate" if cfg.fixed_estimate else ", speed tracking"), flush=True)


def _stop_at_stdin_eof() -> None:
    """Stop the server (as SIGTERM does: uvicorn finishes gracefully) once stdin reaches end of file."""

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass  # whatever a parent writes means nothing; only the end does
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="qlab-stdin-watch", daemon=True).start()


def cmd_serve(args) -> int:
    cfg = ServeConfig.from_args(args)
    policy = preset(cfg.policy).with_overrides(max_queue=cfg.max_queue, deadline_s=cfg.deadline_s)
    model = ServiceModel.load(cfg.service_model) if cfg.service_model else ServiceModel()
    if cfg.engine == "gpt2" and not cfg.service_model:
        print("qlab serve: no --service-model: estimates start from the reference line (8.5 ms/token) and the "
              "speed tracker corrects them; `qlab calibrate` fits this machine", file=sys.stderr)
    import uvicorn  # the web stack loads only for the command that serves

    from .gate import Gate, GateConfig
    from .protocol import http_options
    from .service import create_app

    engines = _engines(cfg, model)
    for engine in engines:
        engine.warmup()
    gate = Gate(engines, GateConfig(policy, model, fixed_estimate=cfg.fixed_estimate, stall_factor=cfg.stall_factor,
                                    stall_floor_s=cfg.stall_floor_s))
    sock = _bind(cfg.host, cfg.port)
    app = create_app(gate, on_ready=lambda: _announce(_url(sock), cfg, args.host is not None))
    server = uvicorn.Server(uvicorn.Config(app, log_level=cfg.log_level, access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=5, **http_options(cfg.http)))
    if cfg.watch_stdin:
        _stop_at_stdin_eof()
    # What exists now (modules, weights, the app) lives as long as the server: take it out of the
    # collector's sight, so a full collection does not stall the event loop (and a refusal) for tens of ms.
    gc.collect()
    gc.freeze()
    server.run(sockets=[sock])
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve the gate and an engine over HTTP (loopback only unless --host)",
        description="Serve POST /v1/generate, GET /stats and GET /healthz: the admission gate (qsim's policy "
                    "function) in front of K engines. The first stdout line is 'qlab serve: listening on URL'.")
    p.set_defaults(func=cmd_serve)
    p.add_argument("--policy", choices=list(PRESETS), default="none")
    p.add_argument("--max-queue", type=count, help="override the preset's bound on waiting requests")
    p.add_argument("--deadline", type=positive, help="override the default deadline (seconds)")
    p.add_argument("--engine", choices=["gpt2", "synthetic"], default="synthetic")
    p.add_argument("--engines", type=positive_int, default=1, help="engines behind the queue (K), one thread each")
    p.add_argument("--model", help="gpt2: a hub name or local path, 'random' (GPT-2 small, random weights; default) "
                                   "or 'tiny' (2 layers, for tests)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="gpt2: where to run (default auto: cuda if available)")
    p.add_argument("--threads", type=positive_int, help="gpt2: torch CPU threads (default: torch's choice)")
    p.add_argument("--speed", type=positive, help="synthetic: service times are SPEED times the model (default 1)")
    p.add_argument("--noise", type=non_negative, help="synthetic: CV of lognormal noise on service times")
    p.add_argument("--speed-schedule", help="synthetic: SECONDS:FACTOR,... speed changes since start, e.g. 20:2.2")
    p.add_argument("--fail-every", type=positive_int, metavar="N",
                   help="synthetic, fault injection: every Nth run of an engine raises at once")
    p.add_argument("--hang-after", type=count, metavar="N",
                   help="synthetic, fault injection: run N+1 of an engine hangs (--hang-for seconds; default forever)")
    p.add_argument("--hang-for", type=positive, metavar="SECONDS", help="synthetic: how long the hang lasts")
    p.add_argument("--stall-factor", type=number(float, 1, strict=False), default=10.0,
                   help="an engine is stalled once its request runs this many times its estimate (default 10) ...")
    p.add_argument("--stall-after", type=positive, default=5.0, metavar="SECONDS",
                   help="... and at least this long (default 5 s); its request then ends as an engine_error")
    p.add_argument("--seed", type=count, default=0, help="random weights and synthetic noise")
    p.add_argument("--service-model", help="JSON with intercept_s and per_token_s (from qlab calibrate)")
    p.add_argument("--fixed-estimate", action="store_true", help="do not track speed: keep the calibrated estimate")
    p.add_argument("--host", help=f"address to bind (default {LOOPBACK}: this machine only)")
    p.add_argument("--port", type=port, default=8000, help="0 picks a free port (printed on the first line)")
    p.add_argument("--http", choices=["httptools", "h11"], default="httptools",
                   help="HTTP parser: httptools (default, fastest) or h11; both refuse a request head past 64 KiB")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="warning")
    p.add_argument("--watch-stdin", action="store_true",
                   help="stop when stdin reaches end of file (for a parent process: the server goes when it goes)")
