"""Reading a request and waiting for its answer: what every route of ``qlab serve`` that admits does.

:func:`read_body` reads the body under a size cap before anything parses it; :func:`outcome` waits
for the gate's answer while watching for the client to hang up (:func:`until_disconnect`), which
cancels the request.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.requests import ClientDisconnect

from .envelope import InvalidRequest
from .gate import Answer


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


async def until_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body is read, so receive() waits for that alone)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def outcome(future: asyncio.Future, request: Request) -> Answer | None:
    """The answer, or None when the client left first (its future is then cancelled: it leaves the queue)."""
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait((future, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not future.done():  # the client left, or this handler itself was cancelled
            future.cancel()
    return None if future.cancelled() else future.result()
