"""The HTTP surface: ``POST /v1/generate``, ``GET /stats``, ``GET /healthz``, ``GET /metrics``, and
the OpenAI-compatible routes of :mod:`live.openai_api`.

A request goes prepare (read the body under a size cap, validate, count
prompt tokens) -> ``gate.submit`` (admit or refuse, never blocks) -> execute
(in an engine thread, while the route awaits a future) -> finish (build the
response). Routes are async: a waiting request is a future on the event loop,
never a thread.

Every answer that is not a 200 carries one envelope::

    {"error": {"type", "reason", "code", "message", "numbers", "retry_after_s"}}

(``code`` repeats ``reason``: with ``message`` and ``type`` it is OpenAI's error object,
so the openai SDK reads qlab's errors; see :mod:`live.openai_api` for the
OpenAI-compatible routes mounted beside ``/v1/generate``.)

type ``overloaded`` (503, refused at arrival), ``deadline_exceeded`` (503,
dropped at the front; 504, reason ``deadline_passed``, cut in service at its deadline
under a policy with ``cancel_at_deadline``), ``invalid_request`` (4xx), ``engine_error`` (500:
reason ``engine_exception`` when the engine raised, ``engine_stalled`` when
the gate gave up on a stalled engine, see :mod:`live.gate`; 502 ``upstream_error``
when the upstream server of ``--engine upstream`` answered an error, could not be
reached or broke its answer off; 504 ``upstream_timeout`` when it sent nothing for
``--upstream-timeout`` seconds), ``unavailable`` (503, reason ``shutting_down``: still running when
the server's graceful shutdown ran out of time, or waiting at a replica that went down, ``qlab serve
--replica-down``) or ``internal_error`` (500). Overload is 503 with
Retry-After, never 429: the server cannot take the work now, not "this client sent too much". That
one is type ``rate_limited`` (429 with Retry-After): a policy with a per-client token
bucket (``client_rate``, ``client_burst``) refused a client over its rate,
named by the body's ``client_id`` or the ``x-client-id`` header.

``GET /healthz`` answers 200 with ``status`` "ok", or "degraded" and the
stalled engines (how long each has run its request, and its threshold) while
any engine is stalled: the process is alive and answers, so the status code
stays 200; a monitor reads ``status``.

``GET /metrics`` answers in Prometheus' text format (:mod:`live.prometheus_metrics`):
the gate's counts, its queue, and histograms of engine time, queue time and time
to a refusal. The gate counts and times every request itself, so requests on the
direct path below are in it too.

``POST /v1/generate``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` skip FastAPI's
per-request machinery: :class:`GateService`
hands each straight to its route's function and the same exception handlers
(:class:`_Direct`). FastAPI's middleware stack, routing and dependency solving
cost about 0.4 ms per request on two shared cores, as much as the whole rest of
a refusal (benchmarks/soak.py); the answers are the same either way, which
tests/test_http_api.py (and tests/test_contract.py for the OpenAI-compatible routes)
checks by sending the same requests both ways.
Every other path goes through FastAPI as usual.

A client that hangs up cancels its request: a waiting one leaves the queue at
once; a running one is counted as ``cancelled`` at once, its engine is asked to
stop (see :mod:`live.gate`), and the engine is free for the next request when
``engine.run`` returns.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Annotated, Awaitable, Callable

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from . import admin, openai_api
from .auth import SCOPE_CLIENT, ApiKeys, declare_security
from .batching import STEP_PAGE
from .hosts import HostAllowList, without_addresses
from .contract import (
    LIVE,
    READY,
    Admission,
    ErrorEnvelope,
    GenerateResponse,
    Health,
    Liveness,
    Readiness,
    Stats,
    Timings,
    request_model,
)
from .contract_fields import Limits
from .engine import Checked, CountsUpstream, abilities_of
from .envelope import (
    ADMITTING,
    ANY_ROUTE,
    HANDLERS,
    answer_for,
    error_response,
    error_responses,
    json_response,
    parse_body,
    shutdown_response,
    stopped_by_shutdown,
)
from .gate import Gate
from .gate_errors import Rejected
from .jobs import Answer, Job
from .prometheus_metrics import CONTENT_TYPE_LATEST, exposition, metrics_registry
from .request_io import header_parameters, outcome, read_body, request_deadline, with_headers
from .routes import CHAT, COMPLETIONS, GENERATE
from .token_prompts import read_prompt

# Limits and request_model (the body schema with a server's caps) live in live.contract, with every
# body; the envelope and the answer to each exception in live.envelope.


# ---------------------------------------------------------------------- prepare


@dataclass(frozen=True)
class _Preparer:
    schema: type[BaseModel]
    limits: Limits
    engine: object  # the gate's first engine: it counts the prompt's tokens (all count alike)

    def __call__(self, body: bytes, request: Request) -> Job:
        req = parse_body(self.schema, body)
        prompt = read_prompt(req.prompt, self.engine, self.limits)
        stop = tuple(req.stop or ())
        deadline = request_deadline(req.deadline_ms, request, self.limits.max_deadline_ms)
        job = Job(
            prompt.text,
            req.max_new_tokens,
            stop,
            deadline,
            req.client_id,
            req.priority,
            prompt.tokens,
            prompt_ids=prompt.ids,
        )
        return with_headers(job, request, self.limits.max_deadline_ms)


# ---------------------------------------------------------------------- execute and finish


def _answer_body(answer: Answer, total_s: float) -> GenerateResponse:
    a = answer.arrival
    timings = Timings(
        queue_s=answer.queue_s,
        engine_s=answer.engine_s,
        total_s=total_s,
        est_service_s=a.seen.est_service_s,
        started_at=answer.started_at,
        returned_at=answer.returned_at,
        first_token_s=answer.first_token_s,
    )
    return GenerateResponse(
        text=answer.text,
        tokens=answer.tokens,
        outcome=answer.outcome,
        engine=answer.engine,
        prompt_tokens=answer.prompt_tokens,
        cached_prompt_tokens=answer.cached_prompt_tokens,
        timings=timings,
        admission=Admission.model_validate(a.numbers()),
    )


# ---------------------------------------------------------------------- the app


@dataclass(frozen=True)
class _Direct:
    """A route's function as a plain ASGI app: its answer, or the answer of its exception's
    handler in HANDLERS."""

    endpoint: Callable[[Request], Awaitable[Response]]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await self.endpoint(request)
        # only the server cancels a request's task: its shutdown timed out
        except asyncio.CancelledError:
            stopped_by_shutdown()
            response = shutdown_response()
        except Exception as exc:
            response = await answer_for(request, exc)
        await response(scope, receive, send)


class GateService(FastAPI):
    """FastAPI, with ``POST /v1/generate`` (:attr:`direct`) and the OpenAI-compatible POST routes
    sent straight to their functions (:attr:`direct_posts`, by path) when set (see the module
    docstring)."""

    direct: _Direct | None = None
    direct_posts: dict[str, _Direct] = {}  # replaced, never changed in place
    keys: ApiKeys | None = None  # set: the guarded routes want one of them (live.auth)
    hosts: HostAllowList | None = None  # set: the Host names it answers to (live.hosts; None: any)

    def openapi(self) -> dict:
        fresh = self.openapi_schema is None
        doc = super().openapi()  # made once, then kept
        return declare_security(doc, self.keys) if fresh else doc

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.hosts is not None
            and scope["type"] == "http"
            and not self.hosts.allows(_header(scope, b"host"))
        ):
            # First: a rebound name learns nothing, not even a 401.
            await MISDIRECTED(scope, receive, send)
            return
        if self.keys is not None and scope["type"] == "http" and self.keys.guards(scope["path"]):
            holder = self.keys.holder(_header(scope, b"authorization"))
            if holder is None:
                await UNAUTHORIZED(scope, receive, send)
                return
            # the key's client: what per-client limits count by
            scope[SCOPE_CLIENT] = holder.client_id
        route = (
            self.direct_posts.get(scope["path"])
            if scope["type"] == "http" and scope["method"] == "POST"
            else None
        )
        if route is not None:
            await route(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "HEAD" and scope["path"] not in POSTS:
            # HEAD on every GET route, as orchestrators' and load balancers' checks send it: routed
            # as the GET, whose body the server leaves out (uvicorn reads the method from its own
            # copy of the scope).
            scope = {**scope, "method": "GET"}
        await super().__call__(scope, receive, send)


#: The POST routes: HEAD on them stays a 405.
POSTS = frozenset({GENERATE, COMPLETIONS, CHAT})
#: A guarded route's answer to a request without one of the server's keys (the message never names a
#: key).
UNAUTHORIZED = error_response(
    401,
    "invalid_request",
    "unauthorized",
    "this route needs an API key: send Authorization: Bearer KEY with one of the server's keys",
    headers={"WWW-Authenticate": "Bearer"},
)


#: A request naming a Host the server does not answer to (live.hosts: DNS rebinding); the name is
#: not repeated.
MISDIRECTED = error_response(
    421,
    "invalid_request",
    "host_not_allowed",
    "this server does not answer to the Host this request names (qlab serve --allowed-hosts)",
)


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key == name), None)


async def readiness(gate: Gate) -> list[str]:
    """Why the service cannot answer now (empty: ready): it is stopping, every engine is stalled, or
    what an engine depends on is not there (the upstream engine's server:
    :class:`live.engine.Checked`)."""
    reasons = ["the server is shutting down"] if gate.draining else []
    if gate.queue.all_stalled:
        reasons.append(f"every engine ({gate.workers}) is stalled")
    checked = [e for e in gate.engines if isinstance(e, Checked)]
    problems = await asyncio.gather(*(e.readiness() for e in checked))
    if gate.fleet is not None and None in problems:
        problems = []  # one not ready is routed around (live.fleet_gate): the fleet answers
    for problem in problems:
        if problem is not None and problem not in reasons:
            reasons.append(problem)
    return reasons


async def upstream_counters(gate: Gate) -> dict | None:
    """What the gate's upstream counted itself, for /stats (:class:`live.engine.CountsUpstream`):
    each upstream read once, a fleet's summed (requests, tokens and preemptions add up; read_at:
    the oldest reading). None where an upstream gives none: a sum without it would be wrong."""
    readers = {id(e.counters): e.counters for e in gate.engines if isinstance(e, CountsUpstream)}
    readings = await asyncio.gather(*(r.reading(gate.clock) for r in readers.values()))
    if not readings or any(r is None for r in readings):
        return None
    return {
        key: (min if key == "read_at" else sum)(r[key] for r in readings) for key in readings[0]
    }


def effective_limits(gate: Gate, limits: Limits) -> Limits:
    """The caps, with max_new_tokens lowered to what every engine can generate."""
    caps = [limits.max_new_tokens] + [
        n for e in gate.engines if (n := getattr(e, "max_new_tokens_limit", None))
    ]
    default = None if limits.default_max_tokens is None else min(limits.default_max_tokens, *caps)
    return Limits(**{**asdict(limits), "max_new_tokens": min(caps), "default_max_tokens": default})


def create_app(
    gate: Gate,
    limits: Limits = Limits(),
    on_ready: Callable[[], None] | None = None,
    direct: bool = True,
    keys: ApiKeys | None = None,
    operator: ApiKeys | None = None,
    hosts: HostAllowList | None = None,
) -> GateService:
    """The service around ``gate``; the gate starts and stops with the app (lifespan).

    on_ready runs once the gate's engine threads are up (``qlab serve`` prints its URL then).
    direct=False sends ``POST /v1/generate`` and the OpenAI-compatible POST routes through FastAPI's
    routing too (same answers, slower). keys: the API keys the guarded routes want (live.auth; None:
    none). operator: the operator's key, which PUT /admin/calibration wants (live.admin; None: the
    route refuses everyone). hosts: the Host names it answers to (live.hosts; None: any).
    """
    limits = effective_limits(gate, limits)
    engine = gate.engines[0]
    vocab = abilities_of(engine).token_id_vocab
    prepare = _Preparer(request_model(limits, vocab), limits, engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        gate.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await gate.aclose()

    # redirect_slashes=False: /v1/generate/ is a 404 in the envelope, not a bare 307 to
    # /v1/generate.
    app = GateService(
        title="qlab gate",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        redirect_slashes=False,
    )
    app.keys, app.hosts = keys, hosts
    # With keys, the upstream's address is for callers with one: open routes say "the upstream"
    # (live.hosts).
    addresses = {url for e in gate.engines if (url := e.info().get("url"))}
    hide = {path: keys is not None and not keys.guards(path) for path in ("/healthz", "/ready")}
    # Handlers are async on purpose: Starlette runs a plain function in its thread pool, which
    # would put every refusal behind a hidden queue of threads in a burst.
    for exc_type, handler in HANDLERS.items():
        app.add_exception_handler(exc_type, handler)

    async def generate(request: Request) -> Response:
        t0 = gate.clock()
        job = prepare(await read_body(request, limits.max_body_bytes), request)
        # Rejected, DeadlineExceeded, EngineFailed and EngineStalled go to their handlers.
        try:
            future = gate.submit(job)
        except Rejected:  # refused at arrival (NeverInTime too)
            # Timed here, not in middleware: the direct path and FastAPI's routing both run this
            # function.
            gate.timings.refusal.observe(gate.clock() - t0)
            raise
        answer = await outcome(future, request)
        if answer is None:
            return Response(status_code=499)  # nobody is listening; the status is only for logs
        return json_response(_answer_body(answer, gate.clock() - t0).model_dump_json())

    # The route reads the raw body (to cap its size before parsing), so FastAPI cannot see the
    # schema: state it.
    body = {"application/json": {"schema": prepare.schema.model_json_schema()}}
    app.post(
        GENERATE,
        openapi_extra={
            "parameters": header_parameters(limits.max_deadline_ms),
            "requestBody": {"required": True, "content": body},
        },
        responses={200: {"model": GenerateResponse}, **error_responses(*ADMITTING)},
    )(generate)
    if direct:
        app.direct = _Direct(generate)

    # POST /v1/completions, POST /v1/chat/completions, GET /v1/models; the open document names the
    # model served only where /v1/models, which names it too, is open.
    posts = openai_api.mount(app, gate, limits, name_model=keys is None)
    if direct:
        app.direct_posts = {
            GENERATE: app.direct,
            **{path: _Direct(route) for path, route in posts.items()},
        }

    # 422: a bad steps_since (NaN or infinite too), steps_from or steps_limit.
    @app.get("/stats", response_model=Stats, responses=error_responses(*ANY_ROUTE, 422))
    async def stats(
        steps_since: Annotated[float | None, Query(allow_inf_nan=False)] = None,
        steps_from: Annotated[int | None, Query(ge=0)] = None,
        steps_limit: Annotated[int, Query(ge=1, le=STEP_PAGE)] = STEP_PAGE,
    ) -> Response:
        paging = steps_since is not None or steps_from is not None
        # A page of steps is about the steps: it waits on no upstream.
        counted = None if paging else await upstream_counters(gate)
        said = {**gate.stats(), "limits": asdict(limits), "engine": gate.engines[0].info()}
        if gate.fleet is not None and gate.config.batching:  # one engine a replica, each its own
            said["replica_engines"] = [engine.info() for engine in gate.engines]
        if counted is not None:
            said["upstream_counters"] = counted
        if paging:
            # A page: bounded, whatever the log holds.
            said.update(gate.step_page(steps_since, steps_from, steps_limit))
        return json_response(Stats.model_validate(said).model_dump_json(exclude_unset=True))

    @app.get("/healthz", response_model=Health, responses=error_responses(*ANY_ROUTE))
    async def healthz() -> Response:
        reasons, engine = await readiness(gate), gate.engines[0].info()
        if hide["/healthz"]:
            reasons = without_addresses(reasons, addresses)
            engine = {k: v for k, v in engine.items() if k != "url"}
        body = Health.model_validate(
            {
                **gate.health(),
                "engines": gate.workers,
                "engine": engine,
                "policy": gate.policy.name,
                "ready": not reasons,
                "not_ready": reasons,
            }
        )
        return json_response(body.model_dump_json(exclude_unset=True))

    @app.get("/health", response_model=Liveness, responses=error_responses(408, 421, 431))
    async def health() -> Response:
        # Liveness: the process answers. Nothing else is looked at (a restart would not mend an
        # upstream).
        return json_response(LIVE)

    @app.get(
        "/ready",
        response_model=Readiness,
        responses=error_responses(408, 421, 431, 503)
        | {
            503: {
                "model": ErrorEnvelope,
                "description": "unavailable: not_ready (why, in the message), Retry-After 1",
            }
        },
    )
    async def ready() -> Response:
        reasons = await readiness(gate)
        if hide["/ready"]:
            reasons = without_addresses(reasons, addresses)
        if reasons:
            return error_response(
                503, "unavailable", "not_ready", "not ready: " + "; ".join(reasons), retry_after_s=1
            )
        return json_response(READY)

    admin.mount(app, gate, limits, operator)  # PUT /admin/calibration
    registry = metrics_registry(gate)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {}}, "description": "Prometheus' text format"},
            **error_responses(*ANY_ROUTE),
        },
    )
    async def metrics() -> Response:
        # Async on purpose: the collector then reads the gate on the event loop, where the gate
        # changes it.
        return Response(exposition(registry), media_type=CONTENT_TYPE_LATEST)

    return app
