"""What the gate tells whom: the Host names it answers to, the upstream's address, and its access
log.

The Host allow-list (``--allowed-hosts``): a page on another site can make a browser on this
machine send requests to a gate bound to loopback, by pointing a name of its own at 127.0.0.1 (DNS
rebinding); the browser then sends that name as Host. A gate bound to loopback answers only
loopback names (``localhost``, ``127.0.0.1``, ``[::1]``, with any port) unless told more; a request
naming another is refused 421 ``host_not_allowed`` in the envelope, before anything else reads it.
Starlette's TrustedHostMiddleware does the same check but answers plain text and reads
``[::1]:8000`` as the host ``[``; :class:`HostAllowList` keeps its patterns (a name, ``*.domain``,
``*``).

The upstream's address: a gate with API keys shows it only to callers with a key; what ``/ready``
(always open) and an open ``/healthz`` say of an upstream names it "the upstream"
(:func:`without_addresses`).

The access log (``--access-log``): a line per request, on stderr: method, path, status,
milliseconds and the client's address. Never a query, a header or a body (where keys and prompts
travel).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

# The web stack is the live extra's, and serve_options (so every qlab command) imports this module.
if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: The names a loopback-bound gate answers to by default (each with any port, or none).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
#: What an address is called where the caller may not see it.
HIDDEN = "the upstream"

access_log = logging.getLogger("qlab.access")


def host_name(header: str) -> str:
    """The name of a Host header, without its port: ``[::1]:8000`` -> ``::1``, ``Example.com.:80``
    -> ``example.com``."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal: its colons are not a port's
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0].rstrip(".") if ":" in header else header.rstrip(".")


@dataclass(frozen=True)
class HostAllowList:
    """The Host names a gate answers to: names, ``*.domain`` (any name under it) or ``*`` (any)."""

    patterns: tuple[str, ...]

    @classmethod
    def for_bind(cls, bound_to_loopback: bool, extra: Iterable[str] = ()) -> "HostAllowList | None":
        """A loopback-bound gate's list: the loopback names and ``extra``; None (any name) for a
        gate bound elsewhere unless ``extra`` names some (then loopback names and those)."""
        extra = tuple(
            e.strip().lower() if e.strip().startswith("*") else host_name(e)
            for e in extra
            if e.strip()
        )
        if not bound_to_loopback and not extra:
            return None
        return cls(LOOPBACK_NAMES + extra)

    def allows(self, header: bytes | None) -> bool:
        name = host_name(header.decode("latin-1")) if header else ""
        for pattern in self.patterns:
            if pattern == "*" or pattern == name:
                return True
            if pattern.startswith("*.") and name.endswith(pattern[1:]):
                return True
        return False


def without_addresses(reasons: list[str], addresses: Iterable[str]) -> list[str]:
    """``reasons`` with each of ``addresses`` (the upstream's URL) said as :data:`HIDDEN`."""
    hidden = []
    for reason in reasons:
        # A longer URL first: never half of one left.
        for address in sorted(addresses, key=len, reverse=True):
            reason = reason.replace(address, HIDDEN)
        hidden.append(reason)
    return hidden


@dataclass(frozen=True)
class AccessLog:
    """An ASGI wrapper that logs a line per HTTP request as it ends (see the module: what is in it
    and what never is). The time is from the request's arrival to its last byte sent."""

    app: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), [0]

        async def noting(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting)
        finally:  # a request cut by the client or the shutdown is a line too (status 0: none sent)
            client = scope.get("client") or ("-", 0)
            access_log.info(
                "%s %s %d %.1fms %s:%s",
                scope["method"],
                scope["path"],
                status[0],
                (time.perf_counter() - t0) * 1e3,
                client[0],
                client[1],
            )


def log_to_stderr() -> None:
    """Send the access log's lines to stderr (uvicorn's own loggers do not carry it)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s qlab access: %(message)s"))
    access_log.addHandler(handler)
    access_log.setLevel(logging.INFO)
    access_log.propagate = False
