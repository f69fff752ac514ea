"""The error envelope and the answer to every exception a request can end in.

Every answer of ``qlab serve`` that is not a 200 carries one envelope::

    {"error": {"type", "reason", "code", "message", "numbers", "retry_after_s"}}

(``code`` repeats ``reason``: with ``message`` and ``type`` it is OpenAI's error object, so the
openai SDK reads qlab's errors). :data:`HANDLERS` maps each exception to its answer; both
:mod:`live.http_api` (``/v1/generate``, FastAPI's exception handlers, the direct path) and
:mod:`live.openai_api` (a stream's last event) answer through it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from qsim.policy import RATE_LIMITED

from .contract import ErrorEnvelope, error_json
from .gate_errors import (
    DeadlineCut,
    DeadlineExceeded,
    EngineFailed,
    EngineStalled,
    NeverInTime,
    Rejected,
    ReplicaDown,
    ShuttingDown,
    UpstreamFailed,
    UpstreamTimedOut,
)
from .routes import ROUTES

log = logging.getLogger("live.http_api")


class InvalidRequest(Exception):
    """A 4xx found while preparing a request."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def error_response(
    status: int,
    type_: str,
    reason: str,
    message: str,
    numbers: dict | None = None,
    retry_after_s: int | None = None,
    headers: dict | None = None,
) -> Response:
    """The envelope (:class:`live.contract.ErrorEnvelope`), with Retry-After when it says when to
    come back."""
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    return json_response(
        error_json(type_, reason, message, numbers, retry_after_s), status, headers
    )


def json_response(text: str, status: int = 200, headers: dict | None = None) -> Response:
    """A body a contract model wrote (its model_dump_json: compact, non-finite numbers as null)."""
    return Response(text, status_code=status, headers=headers, media_type="application/json")


def validation_text(errors) -> str:
    """'max_new_tokens: Input should be less than or equal to 1024; prompt: Field required'."""
    parts = []
    for e in errors:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)


def parse_body(schema: type[BaseModel], body: bytes) -> BaseModel:
    """The body as ``schema``: 400 ``malformed_json`` when it is no JSON, 422 ``invalid_field``
    when a field is bad."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            raise InvalidRequest(
                400, "malformed_json", f"the body is not valid JSON: {validation_text(errors)}"
            ) from None
        raise InvalidRequest(422, "invalid_field", validation_text(errors)) from None


_REFUSAL_TEXT = {
    "shed": "sheddable (priority {priority}) and {queued} request(s) are waiting",
    "rate_limited": "this client is over its limit of {client_rate:g} requests/s (bursts of "
    "{client_burst:g})",
    "queue_full": "the queue is full: {queued} waiting, the limit is {max_queue}",
    "work_limit": "queued work {queued_work_s:.3f} s plus this request's {est_service_s:.3f} s "
    "passes the limit "
    "of {max_queued_seconds} s",
    "deadline_unreachable": "estimated wait {wait_s:.3f} s plus service {est_service_s:.3f} s "
    "exceeds the "
    "deadline of {deadline_s:.3f} s",
    "cannot_finish": "dropped when it reached the front after {waited_s:.3f} s: "
    "{est_service_s:.3f} s of service "
    "would end after its deadline of {deadline_s:.3f} s",
    "codel": "dropped by CoDel when it reached the front after waiting {waited_s:.3f} s: waits "
    "have stayed "
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
    # this client sent too much: 429, told apart from the service's overload
    if r.reason == RATE_LIMITED:
        return error_response(
            429,
            "rate_limited",
            r.reason,
            _refusal_message(r.reason, numbers, r.retry_after_s),
            numbers,
            r.retry_after_s,
        )
    return error_response(
        503,
        "overloaded",
        r.reason,
        _refusal_message(r.reason, numbers, r.retry_after_s),
        numbers,
        r.retry_after_s,
    )


async def _never_in_time(_: Request, exc: NeverInTime) -> Response:
    # Not overload: no queue could answer it in time, so no Retry-After (the openai SDK does not
    # retry a 400).
    return error_response(400, "invalid_request", exc.reason, str(exc), exc.numbers)


async def _deadline_exceeded(_: Request, exc: DeadlineExceeded) -> Response:
    return error_response(
        503,
        "deadline_exceeded",
        exc.reason,
        _refusal_message(exc.reason, exc.numbers, exc.retry_after_s),
        exc.numbers,
        exc.retry_after_s,
    )


async def _deadline_cut(_: Request, exc: DeadlineCut) -> Response:
    # 504, as a gateway's timeout: the answer would have come too late (Policy.cancel_at_deadline).
    # No Retry-After: the work was admitted and ran; sending it again meets the same deadline.
    return error_response(504, "deadline_exceeded", exc.reason, str(exc), exc.numbers)


async def _engine_failed(_: Request, exc: EngineFailed) -> Response:
    return error_response(
        500, "engine_error", exc.reason, str(exc), {**exc.arrival.numbers(), **exc.numbers}
    )


async def _upstream_failed(_: Request, exc: UpstreamFailed) -> Response:
    # 502: the server behind the gate failed; 504: it did not answer in time. Outcome error either
    # way.
    status = 504 if isinstance(exc, UpstreamTimedOut) else 502
    return error_response(
        status, "engine_error", exc.reason, str(exc), {**exc.arrival.numbers(), **exc.numbers}
    )


async def _engine_stalled(_: Request, exc: EngineStalled) -> Response:
    return error_response(500, "engine_error", exc.reason, str(exc), exc.numbers)


def shutdown_response(
    message: str = "the server is shutting down and stopped this request before "
    "it was answered; "
    "send it again",
) -> Response:
    """What a request still running when the server's graceful shutdown runs out of time is answered
    (uvicorn cancels it then): 503 in the envelope, as a stream's last event where the stream had
    begun. A request still waiting when the shutdown began, or arriving after, gets the same at once
    (:class:`live.gate_errors.ShuttingDown`)."""
    return error_response(503, "unavailable", "shutting_down", message, retry_after_s=1)


async def _shutting_down(_: Request, exc: ShuttingDown) -> Response:
    return shutdown_response(str(exc))


async def _replica_down(_: Request, exc: ReplicaDown) -> Response:
    return error_response(503, "unavailable", exc.reason, str(exc), exc.numbers, retry_after_s=1)


def stopped_by_shutdown() -> None:
    """The request's task was cancelled (the server's shutdown) and answers it instead of ending:
    the cancellation is handled, so the task is not counted as cancelled (asyncio.Task.uncancel)."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


async def _invalid(_: Request, exc: InvalidRequest) -> Response:
    return error_response(exc.status, "invalid_request", exc.reason, exc.message)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    reason, message = {
        404: (
            "not_found",
            f"no route {request.method} {request.url.path}; the routes are {ROUTES}",
        ),
        405: (
            "method_not_allowed",
            f"{request.method} is not allowed on {request.url.path}; the routes are {ROUTES}",
        ),
    }.get(exc.status_code, ("http_error", str(exc.detail)))
    type_ = "invalid_request" if exc.status_code < 500 else "internal_error"
    return error_response(exc.status_code, type_, reason, message, headers=exc.headers)


async def _request_validation(_: Request, exc: RequestValidationError) -> Response:
    return error_response(422, "invalid_request", "invalid_field", validation_text(exc.errors()))


async def _unexpected(_: Request, exc: Exception) -> Response:
    return error_response(500, "internal_error", "unexpected", f"{type(exc).__name__}: {exc}")


#: Each exception's answer (looked up along its class's MRO, as Starlette does).
HANDLERS: dict[type, Callable[[Request, Exception], Awaitable[Response]]] = {
    Rejected: _overloaded,
    NeverInTime: _never_in_time,
    DeadlineExceeded: _deadline_exceeded,
    DeadlineCut: _deadline_cut,
    EngineFailed: _engine_failed,
    ShuttingDown: _shutting_down,
    ReplicaDown: _replica_down,
    UpstreamFailed: _upstream_failed,
    EngineStalled: _engine_stalled,
    InvalidRequest: _invalid,
    StarletteHTTPException: _http_error,
    RequestValidationError: _request_validation,
    Exception: _unexpected,
}


async def answer_for(request: Request, exc: Exception) -> Response:
    """The answer of ``exc``'s handler (an unexpected one leaves its traceback in the log, as
    Starlette's ServerErrorMiddleware would)."""
    handler = next(HANDLERS[t] for t in type(exc).__mro__ if t in HANDLERS)
    if handler is _unexpected:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
    return await handler(request, exc)


# ---------------------------------------------------------------------- /openapi.json: every status
# a route gives

#: What each error status means, for /openapi.json (docs/http.md's table says the same).
STATUS_TEXT = {
    400: "invalid_request: malformed_json (not JSON, or a body cut short), "
    "malformed_http (not HTTP/1.1 the parser can read: the connection is closed), "
    "invalid_calibration (PUT "
    "/admin/calibration), deadline_too_short (no queue could "
    "answer it in time: no Retry-After; numbers.fit_new_tokens says what fits); on the "
    "OpenAI-compatible "
    "routes also unsupported_parameter, conflicting_parameters",
    401: "invalid_request: unauthorized (no valid Authorization: Bearer key, where the server has "
    "keys)",
    403: "invalid_request: forbidden (PUT /admin/calibration on a gate started without an "
    "operator key)",
    404: "invalid_request: not_found (no such route), model_not_found (OpenAI-compatible routes)",
    405: "invalid_request: method_not_allowed",
    408: "invalid_request: request_timeout (the head or the body did not arrive in time; the "
    "connection is closed)",
    413: "invalid_request: body_too_large",
    415: "invalid_request: unsupported_media_type (not JSON, or a content-encoding)",
    421: "invalid_request: host_not_allowed (the Host names a name the server does not answer to: "
    "qlab serve --allowed-hosts)",
    422: "invalid_request: invalid_field, prompt_too_long",
    429: "rate_limited: this client is over its rate (Retry-After)",
    431: "invalid_request: headers_too_large (the request head passes 64 KiB; the connection is "
    "closed)",
    500: "engine_error: engine_exception, engine_stalled; internal_error: unexpected",
    502: "engine_error: upstream_error (the upstream server answered an error, could not be "
    "reached or broke off)",
    503: "overloaded (refused at arrival: shed, queue_full, work_limit, deadline_unreachable), "
    "deadline_exceeded "
    "(cannot_finish, codel: dropped at the front), unavailable (shutting_down); all with "
    "Retry-After",
    504: "engine_error: upstream_timeout; deadline_exceeded: deadline_passed (cut in service at "
    "its deadline)",
}


def error_responses(*statuses: int) -> dict[int, dict]:
    """FastAPI's ``responses`` for these statuses: each one the envelope
    (:class:`live.contract.ErrorEnvelope`)."""
    return {
        status: {"model": ErrorEnvelope, "description": STATUS_TEXT[status]} for status in statuses
    }


#: What any route can answer, whatever it does: a key missing (where the server has keys), a head or
#: body too slow, a Host it does not answer to, a head too large.
ANY_ROUTE = (401, 408, 421, 431)
#: What a route that admits a request through the gate can answer, besides its 200.
ADMITTING = (*ANY_ROUTE, 400, 413, 415, 422, 429, 500, 502, 503, 504)
