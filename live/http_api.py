"""The HTTP surface: ``POST /v1/generate``, ``GET /stats``, ``GET /healthz``, ``GET /metrics``, and the
OpenAI-compatible routes of :mod:`live.openai_api`.

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
the server's graceful shutdown ran out of time) or ``internal_error`` (500). Overload is 503 with
Retry-After, never 429: the server cannot take the work now, not "this client sent too much". That one is
type ``rate_limited`` (429 with Retry-After): a policy with a per-client token
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
import logging
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, replace
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from qsim.policy import RATE_LIMITED
from qsim.records import CLIENT_ID_CHARS

from .contract import (Admission, GenerateResponse, Health, Limits, Stats, Timings, error_json,  # noqa: F401
                       request_model)
from .gate import (Answer, DeadlineCut, DeadlineExceeded, EngineFailed, EngineStalled, Gate, Job, Rejected, UpstreamFailed,
                   UpstreamTimedOut)
from .prometheus_metrics import CONTENT_TYPE_LATEST, exposition, metrics_registry

GENERATE = "/v1/generate"
CLIENT_HEADER = "x-client-id"
ROUTES = (f"POST {GENERATE}, POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /stats, "
          "GET /healthz, GET /metrics, GET /openapi.json")
log = logging.getLogger(__name__)


# Limits and request_model (the body schema with a server's caps) live in live.contract, with every body.


# ---------------------------------------------------------------------- the envelope


class InvalidRequest(Exception):
    """A 4xx found while preparing a request."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def error_response(status: int, type_: str, reason: str, message: str, numbers: dict | None = None,
                   retry_after_s: int | None = None, headers: dict | None = None) -> Response:
    """The envelope (:class:`live.contract.ErrorEnvelope`), with Retry-After when it says when to come back."""
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    return json_response(error_json(type_, reason, message, numbers, retry_after_s), status, headers)


def json_response(text: str, status: int = 200, headers: dict | None = None) -> Response:
    """A body a contract model wrote (its model_dump_json: compact, non-finite numbers as null)."""
    return Response(text, status_code=status, headers=headers, media_type="application/json")


_REFUSAL_TEXT = {
    "shed": "sheddable (priority {priority}) and {queued} request(s) are waiting",
    "rate_limited": "this client is over its limit of {client_rate:g} requests/s (bursts of {client_burst:g})",
    "queue_full": "the queue is full: {queued} waiting, the limit is {max_queue}",
    "work_limit": "queued work {queued_work_s:.3f} s plus this request's {est_service_s:.3f} s passes the limit "
                  "of {max_queued_seconds} s",
    "deadline_unreachable": "estimated wait {wait_s:.3f} s plus service {est_service_s:.3f} s exceeds the "
                            "deadline of {deadline_s:.3f} s",
    "cannot_finish": "dropped when it reached the front after {waited_s:.3f} s: {est_service_s:.3f} s of service "
                     "would end after its deadline of {deadline_s:.3f} s",
    "codel": "dropped by CoDel when it reached the front after waiting {waited_s:.3f} s: waits have stayed "
             "above the target for longer than the interval",
}


def _refusal_message(reason: str, numbers: dict, retry_after_s: int) -> str:
    try:
        text = _REFUSAL_TEXT[reason].format(**numbers)
    except (KeyError, ValueError):
        text = reason
    return f"{text}; retry after {retry_after_s} s"


async def _overloaded(_: Request, exc: Rejected) -> Response:
    r = exc.rejection
    numbers = {**exc.arrival.numbers(), **r.numbers}
    if r.reason == RATE_LIMITED:  # this client sent too much: 429, told apart from the service's overload
        return error_response(429, "rate_limited", r.reason, _refusal_message(r.reason, numbers, r.retry_after_s),
                              numbers, r.retry_after_s)
    return error_response(503, "overloaded", r.reason, _refusal_message(r.reason, numbers, r.retry_after_s),
                          numbers, r.retry_after_s)


async def _deadline_exceeded(_: Request, exc: DeadlineExceeded) -> Response:
    return error_response(503, "deadline_exceeded", exc.reason,
                          _refusal_message(exc.reason, exc.numbers, exc.retry_after_s),
                          exc.numbers, exc.retry_after_s)


async def _deadline_cut(_: Request, exc: DeadlineCut) -> Response:
    # 504, as a gateway's timeout: the answer would have come too late (Policy.cancel_at_deadline). No
    # Retry-After: the work was admitted and ran; sending it again meets the same deadline.
    return error_response(504, "deadline_exceeded", exc.reason, str(exc), exc.numbers)


async def _engine_failed(_: Request, exc: EngineFailed) -> Response:
    return error_response(500, "engine_error", exc.reason, str(exc), {**exc.arrival.numbers(), **exc.numbers})


async def _upstream_failed(_: Request, exc: UpstreamFailed) -> Response:
    # 502: the server behind the gate failed; 504: it did not answer in time. Outcome error either way.
    status = 504 if isinstance(exc, UpstreamTimedOut) else 502
    return error_response(status, "engine_error", exc.reason, str(exc), {**exc.arrival.numbers(), **exc.numbers})


async def _engine_stalled(_: Request, exc: EngineStalled) -> Response:
    return error_response(500, "engine_error", exc.reason, str(exc), exc.numbers)


def shutdown_response() -> Response:
    """What a request still running when the server's graceful shutdown runs out of time is answered (uvicorn
    cancels it then): 503 in the envelope, as a stream's last event where the stream had begun."""
    return error_response(503, "unavailable", "shutting_down", "the server is shutting down and stopped this request "
                                                               "before it was answered; send it again", retry_after_s=1)


def stopped_by_shutdown() -> None:
    """The request's task was cancelled (the server's shutdown) and answers it instead of ending: the
    cancellation is handled, so the task is not counted as cancelled (asyncio.Task.uncancel)."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


async def _invalid(_: Request, exc: InvalidRequest) -> Response:
    return error_response(exc.status, "invalid_request", exc.reason, exc.message)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    reason, message = {
        404: ("not_found", f"no route {request.method} {request.url.path}; the routes are {ROUTES}"),
        405: ("method_not_allowed", f"{request.method} is not allowed on {request.url.path}; the routes are {ROUTES}"),
    }.get(exc.status_code, ("http_error", str(exc.detail)))
    type_ = "invalid_request" if exc.status_code < 500 else "internal_error"
    return error_response(exc.status_code, type_, reason, message, headers=exc.headers)


def _validation_text(errors) -> str:
    """'max_new_tokens: Input should be less than or equal to 1024; prompt: Field required'."""
    parts = []
    for e in errors:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)


async def _request_validation(_: Request, exc: RequestValidationError) -> Response:
    return error_response(422, "invalid_request", "invalid_field", _validation_text(exc.errors()))


async def _unexpected(_: Request, exc: Exception) -> Response:
    return error_response(500, "internal_error", "unexpected", f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------- prepare


async def read_body(request: Request, cap: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``cap`` bytes (declared or actual) and before parsing."""
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise InvalidRequest(415, "unsupported_media_type", f"send the body as application/json, not {media!r}")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise InvalidRequest(413, "body_too_large", f"the body is {declared} bytes; the limit is {cap}")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > cap:
                raise InvalidRequest(413, "body_too_large", f"the body passes the limit of {cap} bytes")
    except ClientDisconnect:
        # The client hung up mid-body: bad input, not a server error (nobody is left to read the answer).
        raise InvalidRequest(400, "malformed_json", f"the body ended after {len(body)} bytes: the client closed "
                                                    "the connection before sending all of it") from None
    return bytes(body)


@dataclass(frozen=True)
class _Preparer:
    schema: type[BaseModel]
    limits: Limits
    count_tokens: Callable[[str], int]

    def __call__(self, body: bytes) -> Job:
        try:
            req = self.schema.model_validate_json(body)
        except ValidationError as exc:
            errors = exc.errors()
            if any(e.get("type") == "json_invalid" for e in errors):
                raise InvalidRequest(400, "malformed_json", f"the body is not valid JSON: {_validation_text(errors)}") from None
            raise InvalidRequest(422, "invalid_field", _validation_text(errors)) from None
        tokens = self.count_tokens(req.prompt)
        if tokens > self.limits.max_prompt_tokens:
            raise InvalidRequest(422, "prompt_too_long",
                                 f"prompt: {tokens} tokens; the limit is {self.limits.max_prompt_tokens}")
        stop = tuple(req.stop or ())
        deadline = None if req.deadline_ms is None else req.deadline_ms / 1000.0
        return Job(req.prompt, req.max_new_tokens, stop, deadline, req.client_id, req.priority, tokens)


# ---------------------------------------------------------------------- execute and finish


async def _until_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body is read, so receive() waits for that alone)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _outcome(future: asyncio.Future, request: Request) -> Answer | None:
    """The answer, or None when the client left first (its future is then cancelled: it leaves the queue)."""
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait((future, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not future.done():  # the client left, or this handler itself was cancelled
            future.cancel()
    return None if future.cancelled() else future.result()


def _answer_body(answer: Answer, total_s: float) -> GenerateResponse:
    a = answer.arrival
    timings = Timings(queue_s=answer.queue_s, engine_s=answer.engine_s, total_s=total_s,
                      est_service_s=a.est_service_s, started_at=answer.started_at,
                      returned_at=answer.returned_at, first_token_s=answer.first_token_s)
    return GenerateResponse(text=answer.text, tokens=answer.tokens, outcome=answer.outcome, engine=answer.engine,
                            timings=timings, admission=Admission.model_validate(a.numbers()))


# ---------------------------------------------------------------------- the app


#: Each exception's answer (looked up along its class's MRO, as Starlette does).
HANDLERS: dict[type, Callable[[Request, Exception], Awaitable[Response]]] = {
    Rejected: _overloaded, DeadlineExceeded: _deadline_exceeded, DeadlineCut: _deadline_cut,
    EngineFailed: _engine_failed,
    UpstreamFailed: _upstream_failed, EngineStalled: _engine_stalled, InvalidRequest: _invalid, StarletteHTTPException: _http_error,
    RequestValidationError: _request_validation, Exception: _unexpected,
}


@dataclass(frozen=True)
class _Direct:
    """A route's function as a plain ASGI app: its answer, or the answer of its exception's handler in HANDLERS."""

    endpoint: Callable[[Request], Awaitable[Response]]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await self.endpoint(request)
        except asyncio.CancelledError:  # only the server cancels a request's task: its shutdown timed out
            stopped_by_shutdown()
            response = shutdown_response()
        except Exception as exc:
            handler = next(HANDLERS[t] for t in type(exc).__mro__ if t in HANDLERS)
            if handler is _unexpected:  # as Starlette's ServerErrorMiddleware would, leave the traceback in the log
                log.exception("unexpected error in %s %s", request.method, request.url.path)
            response = await handler(request, exc)
        await response(scope, receive, send)


class GateService(FastAPI):
    """FastAPI, with ``POST /v1/generate`` (:attr:`direct`) and the OpenAI-compatible POST routes sent
    straight to their functions (:attr:`direct_posts`, by path) when set (see the module docstring)."""

    direct: _Direct | None = None
    direct_posts: dict[str, _Direct] = {}  # replaced, never changed in place

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.direct_posts.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is not None:
            await route(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def effective_limits(gate: Gate, limits: Limits) -> Limits:
    """The caps, with max_new_tokens lowered to what every engine can generate."""
    caps = [limits.max_new_tokens] + [n for e in gate.engines if (n := getattr(e, "max_new_tokens_limit", None))]
    return Limits(**{**asdict(limits), "max_new_tokens": min(caps)})


def create_app(gate: Gate, limits: Limits = Limits(), on_ready: Callable[[], None] | None = None,
               direct: bool = True) -> GateService:
    """The service around ``gate``; the gate starts and stops with the app (lifespan).

    on_ready runs once the gate's engine threads are up (``qlab serve`` prints its URL then).
    direct=False sends ``POST /v1/generate`` and the OpenAI-compatible POST routes through FastAPI's routing
    too (same answers, slower).
    """
    limits = effective_limits(gate, limits)
    prepare = _Preparer(request_model(limits), limits, gate.engines[0].count_tokens)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        gate.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await gate.aclose()

    # redirect_slashes=False: /v1/generate/ is a 404 in the envelope, not a bare 307 to /v1/generate.
    app = GateService(title="qlab gate", lifespan=lifespan, docs_url=None, redoc_url=None,
                      openapi_url="/openapi.json", redirect_slashes=False)
    # Handlers are async on purpose: Starlette runs a plain function in its thread pool, which
    # would put every refusal behind a hidden queue of threads in a burst.
    for exc_type, handler in HANDLERS.items():
        app.add_exception_handler(exc_type, handler)

    async def generate(request: Request) -> Response:
        t0 = gate.clock()
        job = prepare(await read_body(request, limits.max_body_bytes))
        header = request.headers.get(CLIENT_HEADER)
        if job.client_id is None and header:
            if len(header) > CLIENT_ID_CHARS:
                raise InvalidRequest(422, "invalid_field", f"{CLIENT_HEADER}: at most {CLIENT_ID_CHARS} characters")
            job = replace(job, client_id=header)
        # Rejected, DeadlineExceeded, EngineFailed and EngineStalled go to their handlers.
        try:
            future = gate.submit(job)
        except Rejected:
            # Timed here, not in middleware: the direct path and FastAPI's routing both run this function.
            gate.timings.refusal.observe(gate.clock() - t0)
            raise
        answer = await _outcome(future, request)
        if answer is None:
            return Response(status_code=499)  # nobody is listening; the status is only for logs
        return json_response(_answer_body(answer, gate.clock() - t0).model_dump_json())

    # The route reads the raw body (to cap its size before parsing), so FastAPI cannot see the schema: state it.
    app.post(GENERATE, openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": prepare.schema.model_json_schema()}}}})(generate)
    if direct:
        app.direct = _Direct(generate)

    from .openai_api import mount as mount_openai  # here: live.openai_api imports this module

    posts = mount_openai(app, gate, limits)  # POST /v1/completions, POST /v1/chat/completions, GET /v1/models
    if direct:
        app.direct_posts = {GENERATE: app.direct, **{path: _Direct(route) for path, route in posts.items()}}

    @app.get("/stats", response_model=Stats)
    async def stats() -> Response:
        body = Stats.model_validate({**gate.stats(), "limits": asdict(limits), "engine": gate.engines[0].info()})
        return json_response(body.model_dump_json(exclude_unset=True))

    @app.get("/healthz", response_model=Health)
    async def healthz() -> Response:
        body = Health.model_validate({**gate.health(), "engines": gate.workers, "engine": gate.engines[0].info(),
                                      "policy": gate.policy.name})
        return json_response(body.model_dump_json(exclude_unset=True))

    registry = metrics_registry(gate)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus' text format"}})
    async def metrics() -> Response:
        # Async on purpose: the collector then reads the gate on the event loop, where the gate changes it.
        return Response(exposition(registry), media_type=CONTENT_TYPE_LATEST)

    return app
