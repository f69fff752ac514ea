"""The benchmarks' lean HTTP/1.1 client: what the service takes, with as little of the client's as can be.

Through httpx the client's own ~1 ms per request would be most of a refusal's
measured time, so the benchmarks write requests on raw asyncio streams and
let httptools (the C parser uvicorn itself uses) read the answers. Run it on
uvloop (:func:`client_loop`): on asyncio's default loop each request costs
the client about 0.1 ms more.

A :class:`Lean` keeps a pool of keep-alive connections and never makes a
request wait for one: a request takes an idle connection or opens a new one,
so the only queue it meets is the server's. A connection idle past
:data:`IDLE_REUSE_S` is closed rather than reused (uvicorn drops idle ones
after 5 s).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httptools

#: A pooled connection idle longer than this is closed, not reused.
IDLE_REUSE_S = 3.0
#: No request may take longer than this (the slowest admitted one waits a few seconds): past it, a hang.
REQUEST_TIMEOUT_S = 30.0
#: Outcome of each non-200 envelope type; anything else is "unexpected".
OUTCOME_OF = {"overloaded": "rejected", "deadline_exceeded": "expired", "engine_error": "error"}
OUTCOMES = ("good", "late", "rejected", "expired", "error")


def client_loop():
    """uvloop's loop factory where uvloop is installed (it comes with uvicorn[standard]), else None."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def classify(status: int, payload: dict | None) -> str:
    """One outcome per answer, as the server counts it; anything off-contract is 'unexpected:STATUS'."""
    if status == 200 and isinstance(payload, dict) and payload.get("outcome") in ("good", "late"):
        return payload["outcome"]
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and error.get("type") in OUTCOME_OF:
        return OUTCOME_OF[error["type"]]
    return f"unexpected:{status}"


@dataclass(frozen=True)
class Reply:
    outcome: str  # good late rejected expired error, or unexpected:STATUS / transport:ERROR
    seconds: float  # from the write to the last byte of the answer
    lateness_s: float = 0.0  # how late the write left against its schedule


@dataclass(eq=False)  # identity: the pool's set holds each connection once
class Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    used_at: float = 0.0

    def close(self) -> None:
        self.writer.close()


class _Answer:
    """httptools' callbacks for one response."""

    def __init__(self) -> None:
        self.body = bytearray()
        self.complete = False

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict | None, bool]:
    """(status, JSON body or None, whether the connection may be reused) of the next answer on ``reader``."""
    answer = _Answer()
    parser = httptools.HttpResponseParser(answer)
    while not answer.complete:
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("the server closed the connection before the end of its answer")
        parser.feed_data(data)
    try:
        payload = json.loads(answer.body) if answer.body else None
    except ValueError:
        payload = None
    return parser.get_status_code(), payload, parser.should_keep_alive()


class Lean:
    """A pool of keep-alive connections to one server (see the module docstring)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self._idle: list[Conn] = []
        self._all: set[Conn] = set()

    def request(self, method: str, path: str, body: dict | None = None) -> bytes:
        """The bytes of one request, built once and written as they are."""
        data = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        return head + data

    async def connect(self) -> Conn:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        conn = Conn(reader, writer)
        self._all.add(conn)
        return conn

    async def take(self) -> Conn:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.used_at < IDLE_REUSE_S:
                return conn
            self._discard(conn)
        return await self.connect()

    def give_back(self, conn: Conn) -> None:
        conn.used_at = time.monotonic()
        self._idle.append(conn)

    def _discard(self, conn: Conn) -> None:
        conn.close()
        self._all.discard(conn)

    async def exchange(self, conn: Conn, data: bytes) -> tuple[Reply, dict | None]:
        """Write one request on ``conn`` and read its answer; the connection goes back to the pool or is closed.

        The write happens before the first await: tasks started together write in the order they start.
        """
        start = time.perf_counter()
        try:
            conn.writer.write(data)
            async with asyncio.timeout(REQUEST_TIMEOUT_S):  # no task of its own, as wait_for would make
                status, payload, reusable = await read_answer(conn.reader)
        except Exception as exc:  # a transport failure is this request's one outcome, never a lost request
            self._discard(conn)
            return Reply(f"transport:{type(exc).__name__}", time.perf_counter() - start), None
        seconds = time.perf_counter() - start
        self.give_back(conn) if reusable else self._discard(conn)
        return Reply(classify(status, payload), seconds), payload

    async def send(self, data: bytes) -> tuple[Reply, dict | None]:
        """One request on a pooled connection (opened first if none is idle; the opening is not timed)."""
        return await self.exchange(await self.take(), data)

    async def get_json(self, path: str) -> dict:
        reply, payload = await self.send(self.request("GET", path))
        if payload is None:
            raise RuntimeError(f"GET {path}: {reply.outcome}")
        return payload

    def close(self) -> None:
        for conn in list(self._all):
            self._discard(conn)
        self._idle.clear()
