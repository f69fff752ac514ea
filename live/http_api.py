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
dropped at the front), ``invalid_request`` (4xx), ``engine_error`` (500:
reason ``engine_exception`` when the engine raised, ``engine_stalled`` when
the gate gave up on a stalled engine, see :mod:`live.gate`; 502 ``upstream_error``
when the upstream server of ``--engine upstream`` answered an error, could not be
reached or broke its answer off; 504 ``upstream_timeout`` when it sent nothing for
``--upstream-timeout`` seconds) or ``internal_error`` (500). Overload is 503 with Retry-After, never 429: the
server cannot take the work now, not "this client sent too much". That one is
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

``POST /v1/generate`` skips FastAPI's per-request machinery: :class:`GateService`
hands it straight to the route's function and the same exception handlers
(:class:`_Direct`). FastAPI's middleware stack, routing and dependency solving
cost about 0.4 ms per request on two shared cores, as much as the whole rest of
a refusal (benchmarks/soak.py); the answers are the same either way, which
tests/test_http_api.py checks by sending the same requests both ways.
Every other path goes through FastAPI as usual.

A client that hangs up cancels its request: a waiting one leaves the queue at
once; a running one is counted as ``cancelled`` at once, its engine is asked to
stop (see :mod:`live.gate`), and the engine is free for the next request when
``engine.run`` returns.
"""

from __future__ import annotations

import asyncio
import logging
import math
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, replace
from typing import Annotated, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from qsim.policy import RATE_LIMITED
from qsim.records import CLIENT_ID_CHARS, PRIORITY_BOUND

from .gate import (Answer, DeadlineExceeded, EngineFailed, EngineStalled, Gate, Job, Rejected, UpstreamFailed,
                   UpstreamTimedOut)
from .prometheus_metrics import CONTENT_TYPE_LATEST, exposition, metrics_registry

GENERATE = "/v1/generate"
CLIENT_HEADER = "x-client-id"
ROUTES = (f"POST {GENERATE}, POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /stats, "
          "GET /healthz, GET /metrics, GET /openapi.json")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Caps on one request; the engine's own limit on new tokens also applies."""

    max_new_tokens: int = 1024
    max_deadline_ms: int = 600_000
    max_prompt_chars: int = 16_384
    max_prompt_tokens: int = 16_384
    max_body_bytes: int = 64 * 1024
    max_stops: int = 8
    max_stop_chars: int = 64


def request_model(limits: Limits) -> type[BaseModel]:
    """The body schema with these caps. Strict: "16" is not a number and unknown fields are refused."""
    stop_text = Annotated[str, StringConstraints(min_length=1, max_length=limits.max_stop_chars)]

    class GenerateRequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)

        prompt: Annotated[str, StringConstraints(max_length=limits.max_prompt_chars)]
        max_new_tokens: Annotated[int, Field(ge=1, le=limits.max_new_tokens)]
        deadline_ms: Annotated[int, Field(ge=1, le=limits.max_deadline_ms)] | None = None
        stop: Annotated[list[stop_text], Field(max_length=limits.max_stops)] | None = None
        # Whose per-client rate limit it counts against (also the x-client-id header; the body wins).
        client_id: Annotated[str, StringConstraints(min_length=1, max_length=CLIENT_ID_CHARS)] | None = None
        # Higher first under a priority discipline (the policy's; FIFO ignores it).
        priority: Annotated[int, Field(ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)] = 0

        @field_validator("stop", mode="before")
        @classmethod
        def _one_or_many(cls, value):
            # One stop string may come bare; a union type would make the error messages name its branches.
            return [value] if isinstance(value, str) else value

    return GenerateRequest


# ---------------------------------------------------------------------- the envelope


class InvalidRequest(Exception):
    """A 4xx found while preparing a request."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def error_response(status: int, type_: str, reason: str, message: str, numbers: dict | None = None,
                   retry_after_s: int | None = None, headers: dict | None = None) -> JSONResponse:
    # code: OpenAI's name for the reason (message, type and code are OpenAI's error object, for its SDK).
    body = {"error": {"type": type_, "reason": reason, "code": reason, "message": message,
                      "numbers": _finite(numbers or {}), "retry_after_s": retry_after_s}}
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    return JSONResponse(body, status_code=status, headers=headers)


def _finite(numbers: dict) -> dict:
    """JSON has no NaN or infinity: such numbers become null."""
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in numbers.items()}


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


async def _overloaded(_: Request, exc: Rejected) -> JSONResponse:
    r = exc.rejection
    numbers = {**exc.arrival.numbers(), **r.numbers}
    if r.reason == RATE_LIMITED:  # this client sent too much: 429, told apart from the service's overload
        return error_response(429, "rate_limited", r.reason, _refusal_message(r.reason, numbers, r.retry_after_s),
                              numbers, r.retry_after_s)
    return error_response(503, "overloaded", r.reason, _refusal_message(r.reason, numbers, r.retry_after_s),
                          numbers, r.retry_after_s)


async def _deadline_exceeded(_: Request, exc: DeadlineExceeded) -> JSONResponse:
    return error_response(503, "deadline_exceeded", exc.reason,
                          _refusal_message(exc.reason, exc.numbers, exc.retry_after_s),
                          exc.numbers, exc.retry_after_s)


async def _engine_failed(_: Request, exc: EngineFailed) -> JSONResponse:
    return error_response(500, "engine_error", exc.reason, str(exc), {**exc.arrival.numbers(), **exc.numbers})


async def _upstream_failed(_: Request, exc: UpstreamFailed) -> JSONResponse:
    # 502: the server behind the gate failed; 504: it did not answer in time. Outcome error either way.
    status = 504 if isinstance(exc, UpstreamTimedOut) else 502
    return error_response(status, "engine_error", exc.reason, str(exc), {**exc.arrival.numbers(), **exc.numbers})


async def _engine_stalled(_: Request, exc: EngineStalled) -> JSONResponse:
    return error_response(500, "engine_error", exc.reason, str(exc), exc.numbers)


async def _invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
    return error_response(exc.status, "invalid_request", exc.reason, exc.message)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
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


async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(422, "invalid_request", "invalid_field", _validation_text(exc.errors()))


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
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
        return Job(req.prompt, req.max_new_tokens, stop, deadline, req.client_id, req.priority)


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


def _answer_body(answer: Answer, total_s: float) -> dict:
    a = answer.arrival
    return {
        "text": answer.text,
        "tokens": answer.tokens,
        "outcome": answer.outcome,
        "engine": answer.engine,
        # started_at / returned_at are the gate's clock: the engine counted busy in between.
        # first_token_s: the engine's own time to its first token (null for an engine that does not see it).
        "timings": {"queue_s": answer.queue_s, "engine_s": answer.engine_s, "total_s": total_s,
                    "est_service_s": a.est_service_s, "started_at": answer.started_at,
                    "returned_at": answer.returned_at, "first_token_s": answer.first_token_s},
        "admission": a.numbers(),
    }


# ---------------------------------------------------------------------- the app


#: Each exception's answer (looked up along its class's MRO, as Starlette does).
HANDLERS: dict[type, Callable[[Request, Exception], Awaitable[Response]]] = {
    Rejected: _overloaded, DeadlineExceeded: _deadline_exceeded, EngineFailed: _engine_failed,
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
        except Exception as exc:
            handler = next(HANDLERS[t] for t in type(exc).__mro__ if t in HANDLERS)
            if handler is _unexpected:  # as Starlette's ServerErrorMiddleware would, leave the traceback in the log
                log.exception("unexpected error in %s %s", request.method, request.url.path)
            response = await handler(request, exc)
        await response(scope, receive, send)


class GateService(FastAPI):
    """FastAPI, with ``POST /v1/generate`` sent to :attr:`direct` when it is set (see the module docstring)."""

    direct: _Direct | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.direct is not None and scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] == GENERATE):
            await self.direct(scope, receive, send)
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
    direct=False sends ``POST /v1/generate`` through FastAPI's routing too (same answers, slower).
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
            gate.close()

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
        return JSONResponse(_answer_body(answer, gate.clock() - t0))

    # The route reads the raw body (to cap its size before parsing), so FastAPI cannot see the schema: state it.
    app.post(GENERATE, openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": prepare.schema.model_json_schema()}}}})(generate)
    if direct:
        app.direct = _Direct(generate)

    from .openai_api import mount as mount_openai  # here: live.openai_api imports this module

    mount_openai(app, gate, limits)  # POST /v1/completions, POST /v1/chat/completions, GET /v1/models

    @app.get("/stats")
    async def stats() -> dict:
        return {**gate.stats(), "limits": asdict(limits)}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {**gate.health(), "engines": gate.workers, "engine": gate.engines[0].info(), "policy": gate.policy.name}

    registry = metrics_registry(gate)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus' text format"}})
    async def metrics() -> Response:
        # Async on purpose: the collector then reads the gate on the event loop, where the gate changes it.
        return Response(exposition(registry), media_type=CONTENT_TYPE_LATEST)

    return app
