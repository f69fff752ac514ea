"""``qlab serve``: the gate and an engine behind HTTP, bound to loopback unless told otherwise.

The first line on stdout is ``qlab serve: listening on http://HOST:PORT`` (the
real port, also with ``--port 0``), printed once the engines are warm and the
gate is up, so a parent process can read it and start sending.
Torch is imported only for ``--engine gpt2``. The flags are the fields of
:class:`live.serve_options.ServeOptions`.

``--watch-stdin`` makes the server stop when its stdin reaches end of file:
a parent that starts servers with a pipe on their stdin (``qlab live``) takes
them down with it however it ends, even by SIGKILL, when the kernel closes
the pipe. Fault injection (synthetic engine): ``--fail-every N``,
``--hang-after N`` and ``--hang-for S``; ``--stall-factor`` and
``--stall-after`` set when the gate counts an engine as stalled (see
:mod:`live.gate`).

``--engine upstream --upstream-url URL`` forwards each admitted request to an
OpenAI-compatible server (:mod:`live.upstream`), ``--engines K`` at a time; the
upstream is asked for its models before the server starts, so an unreachable
one is one line on stderr and exit status 2.
"""

from __future__ import annotations

import gc
import ipaddress
import logging
import os
import signal
import socket
import ssl
import sys
import threading

from qsim.engines import OneAtATime
from qsim.fleet import FleetSpec
from qsim.service import LoadTerms, ServiceModel
from qsim.mixes import UsedShare

from .admin import operator_key
from .auth import load_keys
from .engine import Faults, SyntheticEngine, parse_schedule
from .serve_options import LOOPBACK, ServeOptions, redacted


def _engines(cfg: ServeOptions, model: ServiceModel, fleet: FleetSpec | None = None) -> list:
    """Every replica's engines in the fleet's order (replica r's engine k at r * K + k)."""
    replicas = 1 if fleet is None else fleet.replicas
    if cfg.engine == "synthetic":
        early = UsedShare() if cfg.early_stops else None
        return [
            SyntheticEngine(
                model,
                cfg.speed,
                cfg.noise,
                cfg.seed + k,
                parse_schedule(cfg.speed_schedule),
                faults=_faults(cfg, k // cfg.engines),
                early_stops=early,
                replica_speed=_replica_speed(fleet, k // cfg.engines),
            )
            for k in range(cfg.engines * replicas)
        ]
    if cfg.engine == "upstream":
        from . import upstream

        urls = cfg.upstream_urls()  # one replica each
        return [
            e for url in urls for e in upstream.make_engines(cfg.engines, _upstream_spec(cfg, url))
        ]
    from . import gpt2  # torch loads here and nowhere else

    spec = gpt2.GPT2Spec(cfg.model, cfg.device, cfg.seed, cfg.threads)
    return gpt2.make_engines(cfg.engines * replicas, spec)


def _replica_speed(fleet: FleetSpec | None, replica: int) -> float:
    """A synthetic replica's speed over the server's (--replica-speeds; 1 without)."""
    return 1.0 if fleet is None else fleet.speed(replica)


def _faults(cfg: ServeOptions, replica: int) -> Faults:
    """The synthetic engines' fault schedule: every engine's, or --faulty-replica's alone."""
    if cfg.faulty_replica not in (None, replica):
        return Faults()
    return Faults(cfg.fail_every, cfg.hang_after, cfg.hang_for)


def _upstream_spec(cfg: ServeOptions, url: str | None = None):
    """Where --engine upstream forwards (``url``: one of several, default the one). The URL's user
    info is sent as basic auth, unless a key is given (--upstream-api-key, QLAB_UPSTREAM_API_KEY):
    one Authorization header, and the key wins, said once."""
    from . import upstream

    spec = upstream.UpstreamSpec(
        url or cfg.upstream_url,
        cfg.upstream_model,
        cfg.upstream_timeout,
        upstream.api_key(cfg.upstream_api_key),
    )
    if spec.api_key and spec.basic:
        print(
            "qlab serve: --upstream-url has a user and password and an upstream key is given: "
            "the key is sent (Authorization: Bearer), the URL's user info is not",
            file=sys.stderr,
        )
    return spec


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


def _tls(certfile: str | None, keyfile: str | None) -> dict:
    """uvicorn's TLS arguments (empty: plain HTTP), after loading the pair once here: a file that is
    not a certificate and its key is one line on stderr, not a traceback from inside the server."""
    if not certfile:
        return {}
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: not a usable "
            "certificate and key "
            f"({type(exc).__name__}: {exc.strerror or exc})"
        ) from None
    return {"ssl_certfile": certfile, "ssl_keyfile": keyfile}


def _url(sock: socket.socket, tls: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _announce(
    url: str, cfg: ServeOptions, host_given: bool, engines: list, keyed: bool, fleet=None
) -> None:
    print(f"qlab serve: listening on {url}", flush=True)
    if not host_given:
        print(
            f"qlab serve: bound to loopback ({LOOPBACK}) only; pass --host to listen elsewhere",
            flush=True,
        )
    elif not _is_loopback(cfg.host):
        if not keyed:
            guard = "there is no authentication (--api-key, --api-key-file)"
        elif not cfg.ssl_certfile:
            guard = "keys travel in clear text (--ssl-certfile, --ssl-keyfile)"
        else:
            guard = "requests need a key, over TLS"
        print(f"qlab serve: --host {cfg.host}: reachable from other machines; {guard}", flush=True)
    engine = (
        f"1 batching {cfg.engine} engine"
        if cfg.batching
        else (f"{cfg.engines} {cfg.engine} engine(s)")
    )
    if fleet is not None:
        engine = f"{fleet.replicas} replicas of {engine} behind router {fleet.router.name}"
        if fleet.admission == "gate":
            engine += ", admitted at the gate"
    urls = ", ".join(map(redacted, cfg.upstream_urls()))
    print(
        f"qlab serve: policy {cfg.policy}, {engine}"
        + (f" forwarding to {urls}" if cfg.engine == "upstream" else "")
        + (", fixed estimate" if cfg.fixed_estimate else ", speed tracking"),
        flush=True,
    )
    if cfg.engine == "upstream":
        print(f"qlab serve: {engines[0].routes.says()}", flush=True)


def _stop_at_stdin_eof() -> None:
    """Stop the server (as SIGTERM does: uvicorn finishes gracefully) once stdin reaches end of
    file."""

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass  # whatever a parent writes means nothing; only the end does
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="qlab-stdin-watch", daemon=True).start()


def cmd_serve(args) -> int:
    cfg = ServeOptions.from_args(args)
    policy = cfg.make_policy()
    model = ServiceModel.load(cfg.service_model) if cfg.service_model else ServiceModel()
    from qsim.config import StallRule

    from .gate import Gate, gate_config  # the web stack loads only for the command that serves

    batching = cfg.engine_model()
    fleet = cfg.fleet()
    if batching is not None:
        _serve(args, cfg, _batching_gate(cfg, policy, model, batching, fleet), fleet)
        return 0
    # First: an engine that cannot start is the one line said.
    engines = _engines(cfg, model, fleet)
    if cfg.engine != "synthetic" and not cfg.service_model:
        print(
            "qlab serve: no --service-model: estimates start from the reference line (8.5 "
            "ms/token) and the "
            "speed tracker corrects them; `qlab calibrate` fits this engine",
            file=sys.stderr,
        )
    for engine in engines:
        engine.warmup()
    # The calibration's load terms (LoadTerms): admission counts the slowdown of engines that share
    # the machine, and the run files of this server say the noise that qlab compare --predict draws.
    terms = LoadTerms.load(cfg.service_model)
    engine = OneAtATime(len(engines), terms.concurrency, terms.noise_cv or 0.0)
    gate = Gate(
        engines,
        gate_config(
            policy,
            engine=engine,
            model=model,
            fixed_estimate=cfg.fixed_estimate,
            stall=StallRule(cfg.stall_factor, cfg.stall_after),
            # --seed seeds a fleet's router (one server's gate: 0)
            seed=0 if fleet is None else cfg.seed,
        ),
        fleet=fleet,
    )
    _serve(args, cfg, gate, fleet)
    return 0


def _batching_gate(cfg: ServeOptions, policy, model: ServiceModel, batching, fleet=None):
    """The batching engine (synthetic: its step model the one given, x --speed; gpt2: one forward
    pass a step) behind a gate that drives it through the simulator's batching core
    (live.drive_batch); a fleet: one synthetic batching engine per replica (each its replica's step
    noise and --faulty-replica's faults) behind the router."""
    from .batching import SyntheticBatchEngine
    from .gate import BatchGate, Gate, gate_config

    if fleet is not None and cfg.engine == "upstream":
        return _upstream_batching_gate(cfg, policy, model, batching, fleet)
    if fleet is not None:  # ServeOptions.engine_model: synthetic (or upstream, above) only
        schedule = parse_schedule(cfg.speed_schedule)
        engines = [
            SyntheticBatchEngine(
                batching.step,
                cfg.speed,
                cfg.seed,
                schedule,
                faults=_faults(cfg, r),
                replica=r,
                replica_speed=fleet.speed(r),
            )
            for r in range(fleet.replicas)
        ]
        config = gate_config(
            policy, model=model, fixed_estimate=cfg.fixed_estimate, engine=batching, seed=cfg.seed
        )
        return Gate(engines, config, fleet=fleet)

    if cfg.engine == "upstream":
        return _upstream_batching_gate(cfg, policy, model, batching)
    if cfg.engine == "gpt2":
        from . import gpt2, gpt2_batch  # torch loads here and nowhere else

        engine = gpt2_batch.GPT2BatchEngine(
            gpt2.GPT2Spec(cfg.model, cfg.device, cfg.seed, cfg.threads)
        )
        engine.warmup()
    else:
        engine = SyntheticBatchEngine(
            batching.step,
            cfg.speed,
            cfg.seed,
            parse_schedule(cfg.speed_schedule),
            faults=Faults(cfg.fail_every, cfg.hang_after, cfg.hang_for),
        )
    return BatchGate(
        engine,
        gate_config(
            policy, model=model, fixed_estimate=cfg.fixed_estimate, engine=batching, seed=cfg.seed
        ),
    )


def _upstream_batching_gate(
    cfg: ServeOptions, policy, model: ServiceModel, batching, fleet: FleetSpec | None = None
):
    """A batching gate in front of batching upstreams (live.upstream_batch), one replica per
    --upstream-url behind the fleet's router: the batch limit --max-num-seqs, else the least
    the upstreams say of their own (the fleet's replicas share one Batching), else vLLM's
    default; each replica's step model --step (or the default) until its own learner has learned
    its server's."""
    from dataclasses import replace

    from . import upstream, upstream_batch
    from .gate import BatchGate, Gate, gate_config

    specs = [_upstream_spec(cfg, url) for url in cfg.upstream_urls()]
    said = [s for s in map(upstream_batch.upstream_batch, specs) if s]
    seats = cfg.max_num_seqs or (min(said) if said else batching.max_num_seqs)
    batching = replace(
        batching,
        max_num_seqs=seats,
        max_num_batched_tokens=max(seats, batching.max_num_batched_tokens),
    )
    engines = [
        upstream_batch.UpstreamBatchEngine(
            upstream.make_engines(1, spec)[0], seats, upstream_batch.StepLearner(batching.step)
        )
        for spec in specs
    ]
    config = gate_config(
        policy, model=model, fixed_estimate=cfg.fixed_estimate, engine=batching, seed=cfg.seed
    )
    return BatchGate(engines[0], config) if fleet is None else Gate(engines, config, fleet=fleet)


def _serve(args, cfg: ServeOptions, gate, fleet=None) -> None:
    from .contract_fields import Limits
    from .http_api import create_app

    from .hosts import AccessLog, HostAllowList, log_to_stderr

    keys = load_keys(cfg.api_key, cfg.api_key_file, cfg.auth_stats)
    tls = _tls(cfg.ssl_certfile, cfg.ssl_keyfile)
    sock = _bind(cfg.host, cfg.port)
    hosts = HostAllowList.for_bind(_is_loopback(cfg.host), cfg.allowed_hosts.split(","))
    app = create_app(
        gate,
        Limits(default_max_tokens=cfg.default_max_tokens),
        keys=keys,
        hosts=hosts,
        operator=operator_key(cfg.admin_key),
        on_ready=lambda: _announce(
            _url(sock, bool(tls)), cfg, args.host is not None, gate.engines, keys is not None, fleet
        ),
    )
    if cfg.access_log:
        log_to_stderr()
        app = AccessLog(app)
    run_app(
        app,
        sock,
        cfg.log_level,
        cfg.http,
        cfg.watch_stdin,
        on_exit=gate.drain_soon,
        head_timeout_s=cfg.header_timeout,
        body_timeout_s=cfg.body_timeout,
        tls=tls,
    )


#: Seconds the server gives the requests still running after SIGTERM or SIGINT (those waiting are
#: answered at once).
GRACEFUL_S = 5


class _GracefulCut(logging.Filter):
    """uvicorn logs the requests its graceful shutdown cut at ERROR; they are answered (503
    shutting_down) and a stop is normal, so the line is a warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            record.levelno == logging.ERROR
            and "timeout graceful shutdown exceeded" in record.getMessage()
        ):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def run_app(
    app,
    sock,
    log_level: str,
    http: str,
    watch_stdin: bool,
    on_exit=None,
    head_timeout_s: float = ServeOptions.header_timeout,
    body_timeout_s: float = ServeOptions.body_timeout,
    tls: dict | None = None,
) -> None:
    """Serve ``app`` on ``sock`` as ``qlab serve`` does (benchmarks/floor.py serves its bare apps
    the same way). on_exit runs when a signal asks the server to stop (in the signal handler: it
    must only schedule work); head_timeout_s and body_timeout_s: how long a request head and its
    body may take to arrive (live.headcap); tls: uvicorn's ``ssl_certfile`` and ``ssl_keyfile``, for
    HTTPS."""
    import uvicorn

    from .headcap import http_options

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            if on_exit is not None:
                on_exit()

    server = Server(
        uvicorn.Config(
            app,
            log_level=log_level,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_S,
            **http_options(http, head_timeout_s, body_timeout_s),
            **(tls or {}),
        )
    )
    logging.getLogger("uvicorn.error").addFilter(_GracefulCut())
    if watch_stdin:
        _stop_at_stdin_eof()
    # What exists now (modules, weights, the app) lives as long as the server: take it out of the
    # collector's sight, so a full collection does not stall the event loop (and a refusal) for tens
    # of ms.
    gc.collect()
    gc.freeze()
    server.run(sockets=[sock])


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the gate and an engine over HTTP (loopback only unless --host)",
        description="Serve POST /v1/generate, the OpenAI-compatible POST /v1/completions, POST "
        "/v1/chat/completions "
        "and GET /v1/models, GET /stats and GET /healthz: the admission gate (qsim's "
        "policy "
        "function) in front of K engines. The first stdout line is 'qlab serve: "
        "listening on URL'.",
    )
    # own_signals: SIGTERM is uvicorn's graceful stop, not an interrupt (experiments.cli.main).
    p.set_defaults(func=cmd_serve, own_signals=True)
    ServeOptions.add_flags(p)
