"""Reading a request and waiting for its answer: what every route of ``qlab serve`` that admits
does.

:func:`read_body` reads the body under a size cap before anything parses it; :func:`outcome` waits
for the gate's answer while watching for the client to hang up (:func:`until_disconnect`), which
cancels the request.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

from fastapi import Request
from starlette.requests import ClientDisconnect

from qsim.records import CLIENT_ID_CHARS

from .auth import SCOPE_CLIENT
from .envelope import InvalidRequest
from .jobs import Answer, Job
from .routes import CLIENT_HEADER, DEADLINE_HEADER, TPOT_SLO_HEADER, TTFT_SLO_HEADER


async def read_body(request: Request, cap: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``cap`` bytes (declared or actual) and
    before parsing."""
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise InvalidRequest(
            415, "unsupported_media_type", f"send the body as application/json, not {media!r}"
        )
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", ""):
        raise InvalidRequest(
            415,
            "unsupported_media_type",
            "the body is "
            f"{encoding[:40]!r}-encoded; send it "
            "unencoded (this server reads no "
            "content-encoding)",
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise InvalidRequest(
            413, "body_too_large", f"the body is {declared} bytes; the limit is {cap}"
        )
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > cap:
                raise InvalidRequest(
                    413, "body_too_large", f"the body passes the limit of {cap} bytes"
                )
    except ClientDisconnect:
        # The client hung up mid-body: bad input, not a server error (nobody is left to read the
        # answer).
        raise InvalidRequest(
            400,
            "malformed_json",
            f"the body ended after {len(body)} bytes: the "
            "client closed "
            "the connection before sending all of it",
        ) from None
    return bytes(body)


async def until_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body is read, so receive() waits for that alone)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def outcome(future: asyncio.Future, request: Request) -> Answer | None:
    """The answer, or None when the client left first (its future is then cancelled: it leaves
    the queue)."""
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait((future, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not future.done():  # the client left, or this handler itself was cancelled
            future.cancel()
    return None if future.cancelled() else future.result()


# ---------------------------------------------------------------------- what the headers say


def client_header(request: Request) -> str | None:
    """The ``x-client-id`` header (None: absent or empty); 422 past CLIENT_ID_CHARS characters."""
    header = request.headers.get(CLIENT_HEADER)
    if header and len(header) > CLIENT_ID_CHARS:
        raise InvalidRequest(
            422, "invalid_field", f"{CLIENT_HEADER}: at most {CLIENT_ID_CHARS} characters"
        )
    return header or None


def deadline_header(request: Request, max_ms: int) -> float | None:
    """The ``x-request-deadline-ms`` header in seconds (None: absent); 422 unless an integer in
    1..max_ms."""
    value = request.headers.get(DEADLINE_HEADER)
    if value is None:
        return None
    value = value.strip()
    if not (value.isascii() and value.isdigit() and len(value) <= 12 and 1 <= int(value) <= max_ms):
        raise InvalidRequest(
            422,
            "invalid_field",
            f"{DEADLINE_HEADER}: an integer number of "
            "milliseconds in "
            f"1..{max_ms}, not {value[:40]!r}",
        )
    return int(value) / 1000.0


def request_deadline(body_ms: int | None, request: Request, max_ms: int) -> float | None:
    """A request's deadline in seconds, on every route that admits: the body's ``deadline_ms``,
    else the ``x-request-deadline-ms`` header (:func:`deadline_header`), else None (the policy's
    default)."""
    return body_ms / 1000.0 if body_ms is not None else deadline_header(request, max_ms)


def slo_header(request: Request, name: str, max_ms: int) -> float | None:
    """An objective's header (``x-slo-ttft-ms``, ``x-slo-tpot-ms``) in seconds (None: absent); 422
    unless a number of milliseconds in (0, max_ms]."""
    value = request.headers.get(name)
    if value is None:
        return None
    try:
        ms = float(value.strip()) if len(value) <= 24 else math.nan
    except ValueError:
        ms = math.nan
    if not 0 < ms <= max_ms:  # NaN and infinity fail here too
        raise InvalidRequest(
            422,
            "invalid_field",
            f"{name}: a number of milliseconds above 0 and at most {max_ms}, not {value[:40]!r}",
        )
    return ms / 1000.0


def header_parameters(max_ms: int) -> list[dict]:
    """The headers an admitting route reads, as /openapi.json's parameters (each optional; what
    :func:`deadline_header`, :func:`client_header` and :func:`slo_header` accept)."""
    ms = {"type": "number", "exclusiveMinimum": 0, "maximum": max_ms}
    said = {
        DEADLINE_HEADER: (
            {"type": "integer", "minimum": 1, "maximum": max_ms},
            "the deadline in milliseconds, where the body gives no deadline_ms",
        ),
        CLIENT_HEADER: (
            {"type": "string", "maxLength": CLIENT_ID_CHARS},
            "whose per-client limit it counts against, where the body and the API key name none",
        ),
        TTFT_SLO_HEADER: (ms, "the objective for the time to the first token, milliseconds"),
        TPOT_SLO_HEADER: (
            ms,
            "the objective for the time per output token after the first, milliseconds",
        ),
    }
    return [
        {"name": name, "in": "header", "required": False, "schema": schema, "description": text}
        for name, (schema, text) in said.items()
    ]


def with_headers(job: Job, request: Request, max_ms: int) -> Job:
    """The job with what the headers add: the client (the API key's, live.auth, whatever the request
    says; else the body's; else ``x-client-id``) and the objectives (``x-slo-ttft-ms``,
    ``x-slo-tpot-ms``)."""
    client = request.scope.get(SCOPE_CLIENT) or job.client_id
    client = client if client is not None else client_header(request)
    ttft, tpot = (
        slo_header(request, TTFT_SLO_HEADER, max_ms),
        slo_header(request, TPOT_SLO_HEADER, max_ms),
    )
    if client == job.client_id and ttft is None and tpot is None:
        return job  # the common case: nothing to copy
    return replace(job, client_id=client, ttft_slo_s=ttft, tpot_slo_s=tpot)
