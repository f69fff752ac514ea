"""API keys, as OpenAI-compatible servers have them: ``qlab serve --api-key KEY`` or
``--api-key-file FILE``.

A request to a guarded route (every ``/v1/`` route; with ``--auth-stats`` also ``/stats``,
``/healthz`` and ``/metrics``) must carry ``Authorization: Bearer KEY`` with one of the server's
keys, else it is answered 401 ``unauthorized`` in the envelope (with ``WWW-Authenticate: Bearer``)
before anything else reads it. ``/health``, ``/ready`` and ``/openapi.json`` stay open:
orchestrators and clients read them unauthenticated.

Keys are compared in constant time (:func:`hmac.compare_digest`, on SHA-256 digests, against every
key the server has whatever matches first), are never logged or put in a message, and never go on a
child process's command line (``QLAB_API_KEY`` passes one through the environment instead).

A key file maps keys to client ids, one key a line: ``KEY CLIENT_ID`` (whitespace between; ``#``
starts a comment; a key alone names no client). The key's client id is the request's client,
whatever its body or ``x-client-id`` header say: it is what a policy's per-client rate
(``client_rate``) and fair share count by, as real gateways key their tenants.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

from qsim.records import CLIENT_ID_CHARS

#: Where ``--api-key`` is read from when the flag is not given.
API_KEY_ENV = "QLAB_API_KEY"
#: The ASGI scope key a route reads the authenticated client from (live.request_io.with_headers).
SCOPE_CLIENT = "qlab.client"
#: Routes guarded whatever ``--auth-stats`` says.
GUARDED_PREFIX = "/v1/"
#: Routes guarded with ``--auth-stats``.
STATS_ROUTES = frozenset({"/stats", "/healthz", "/metrics"})


#: /openapi.json's names of the two bearer schemes: the clients' API keys, and the operator's
#: (live.admin).
API_KEY_SCHEME = "apiKey"
OPERATOR_SCHEME = "operatorKey"
_SCHEMES = {
    API_KEY_SCHEME: "one of the server's API keys (qlab serve --api-key, --api-key-file); a route "
    "that wants one answers 401 unauthorized without it",
    OPERATOR_SCHEME: "the operator's key (qlab serve --admin-key), which PUT /admin/calibration "
    "wants",
}


def declare_security(doc: dict, keys: "ApiKeys | None") -> dict:
    """The OpenAPI document ``doc`` with the schemes the server enforces: its API keys on each
    route they guard (none without keys: every route is then open), and the operator's key on the
    routes that name it in their own ``security`` (PUT /admin/calibration, on a gate with an
    operator key)."""
    for path, item in doc.get("paths", {}).items():
        if keys is not None and keys.guards(path):
            for operation in item.values():
                operation["security"] = [{API_KEY_SCHEME: []}]
    used = {
        name
        for item in doc.get("paths", {}).values()
        for operation in item.values()
        for need in operation.get("security", ())
        for name in need
    }
    schemes = {
        name: {"type": "http", "scheme": "bearer", "description": text}
        for name, text in _SCHEMES.items()
        if name in used
    }
    if schemes:
        doc.setdefault("components", {})["securitySchemes"] = schemes
    return doc


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Holder:
    """Who a valid key belongs to: a client id (None: the key names none; the request's own then
    counts)."""

    client_id: str | None


@dataclass(frozen=True)
class ApiKeys:
    """The server's keys (their digests only, each with the client it names) and what they guard."""

    holders: tuple[tuple[bytes, Holder], ...] = field(repr=False)
    guard_stats: bool = False

    def __post_init__(self) -> None:
        if not self.holders:
            raise ValueError("no API key given")

    def guards(self, path: str) -> bool:
        return path.startswith(GUARDED_PREFIX) or (self.guard_stats and path in STATS_ROUTES)

    def holder(self, authorization: bytes | None) -> Holder | None:
        """Whose key an ``Authorization`` header carries; None when it carries none of the
        server's."""
        if authorization is None:
            return None
        scheme, _, token = authorization.decode("latin-1").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented = digest(token.strip())
        found = None
        # every key, whichever matches: the time does not tell which
        for kept, holder in self.holders:
            if hmac.compare_digest(presented, kept):
                found = holder
        return found


def _file_keys(path: str) -> list[tuple[str, str | None]]:
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path}: cannot read it ({type(exc).__name__})") from None
    keys = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:  # the message names the line, never the key
            raise ValueError(
                f"--api-key-file {path}:{number}: a line is KEY or KEY CLIENT_ID, "
                f"found {len(words)} words"
            )
        client = words[1] if len(words) == 2 else None
        if client is not None and len(client) > CLIENT_ID_CHARS:
            raise ValueError(
                f"--api-key-file {path}:{number}: a client id is at most "
                f"{CLIENT_ID_CHARS} characters"
            )
        keys.append((words[0], client))
    if not keys:
        raise ValueError(f"--api-key-file {path}: holds no key")
    return keys


def load_keys(
    api_key: str | None, key_file: str | None, guard_stats: bool = False
) -> ApiKeys | None:
    """The server's keys: ``--api-key`` (else ``QLAB_API_KEY``) and a key file's; None when there
    are none (every route open). ValueError (one line, without the key) on a file that cannot be
    read or a malformed line."""
    pairs = [(k, None) for k in [api_key or os.environ.get(API_KEY_ENV)] if k]
    if key_file:
        pairs += _file_keys(key_file)
    if not pairs:
        if guard_stats:
            raise ValueError("--auth-stats: only with --api-key, --api-key-file or QLAB_API_KEY")
        return None
    return ApiKeys(tuple((digest(k), Holder(client)) for k, client in pairs), guard_stats)


def client_headers() -> dict[str, str]:
    """What qlab's own clients (``qlab replay``, ``qlab calibrate``) send every server: the key in
    :data:`API_KEY_ENV`, where it is set, as ``Authorization: Bearer``."""
    key = os.environ.get(API_KEY_ENV)
    return {"authorization": f"Bearer {key}"} if key else {}
