"""The benchmarks' lean HTTP/1.1 client: what the service takes, with as little of the client's as
can be.

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
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httptools

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from live.contract_clients import read_error
from live.contract_clients import read_answer as answer_of
from live.contract_openai import ChatCompletionChunk

#: A pooled connection idle longer than this is closed, not reused.
IDLE_REUSE_S = 3.0
#: No request may take longer than this (the slowest admitted one waits a few seconds): past it, a
#: hang.
REQUEST_TIMEOUT_S = 30.0
#: Outcome of each non-200 envelope type; anything else is "unexpected".
OUTCOME_OF = {"overloaded": "rejected", "deadline_exceeded": "expired", "engine_error": "error"}
OUTCOMES = ("good", "late", "rejected", "expired", "error")


def client_loop():
    """uvloop's loop factory where uvloop is installed (it comes with uvicorn[standard]), else
    None."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def classify(status: int, payload: dict | list | None) -> str:
    """One outcome per answer, as the server counts it, read through live.contract (a streamed
    answer: the list of its chunks, see :func:`stream_events`); anything off-contract is
    'unexpected:STATUS'."""
    if status == 200:
        if isinstance(payload, list):
            outcome = _streamed_outcome(payload)
        else:
            answer = answer_of(payload)
            outcome = None if answer is None else answer.outcome
        return outcome or f"unexpected:{status}"
    error = read_error(payload)
    if error is not None and error.type in OUTCOME_OF:
        return OUTCOME_OF[error.type]
    return f"unexpected:{status}"


def _streamed_outcome(chunks: list | None) -> str | None:
    """The gate's outcome from a streamed chat answer: the chunk that carries ``qlab``."""
    for chunk in chunks or ():
        try:
            q = ChatCompletionChunk.model_validate(chunk).qlab
        except ValueError:
            return None
        if q is not None:
            return q.outcome
    return None


def stream_events(body: bytes) -> list | None:
    """The JSON events of a server-sent event stream that ends ``data: [DONE]``; None when it is
    not one."""
    events, done = [], False
    for line in body.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        try:
            events.append(json.loads(data))
        except ValueError:
            return None
    return events if done else None


@dataclass(frozen=True)
class Reply:
    outcome: str  # good late rejected expired error, or unexpected:STATUS / transport:ERROR
    seconds: float  # from the write to the last byte of the answer
    lateness_s: float = 0.0  # how late the write left against its schedule
    # from the write to the first byte of the body (a stream's first event)
    first_s: float = float("nan")


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
        self.first_at = float("nan")  # perf_counter when the body's first bytes were parsed
        self.stream = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
            self.stream = True

    def on_body(self, body: bytes) -> None:
        if not self.body:
            self.first_at = time.perf_counter()
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict | list | None, bool, float]:
    """(status, JSON body or None, whether the connection may be reused, perf_counter at the body's
    first bytes) of the next answer on ``reader``; a server-sent event stream's body is the list of
    its JSON events."""
    answer = _Answer()
    parser = httptools.HttpResponseParser(answer)
    while not answer.complete:
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("the server closed the connection before the end of its answer")
        parser.feed_data(data)
    if answer.stream:
        return (
            parser.get_status_code(),
            stream_events(bytes(answer.body)),
            parser.should_keep_alive(),
            answer.first_at,
        )
    try:
        payload = json.loads(answer.body) if answer.body else None
    except ValueError:
        payload = None
    return parser.get_status_code(), payload, parser.should_keep_alive(), answer.first_at


class Lean:
    """A pool of keep-alive connections to one server (see the module docstring)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self._idle: list[Conn] = []
        self._all: set[Conn] = set()

    def request(self, method: str, path: str, body: dict | None = None) -> bytes:
        """The bytes of one request, built once and written as they are (``body``: e.g. a contract
        model's ``.body()``, such as :class:`live.contract_openai.ChatCompletionRequest`'s)."""
        data = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: "
            "application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
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
        """Write one request on ``conn`` and read its answer; the connection goes back to the pool
        or is closed.

        The write happens before the first await: tasks started together write in the order they
        start.
        """
        start = time.perf_counter()
        try:
            conn.writer.write(data)
            # no task of its own, as wait_for would make
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                status, payload, reusable, first_at = await read_answer(conn.reader)
        # a transport failure is this request's one outcome, never a lost request
        except Exception as exc:
            self._discard(conn)
            return Reply(f"transport:{type(exc).__name__}", time.perf_counter() - start), None
        seconds = time.perf_counter() - start
        self.give_back(conn) if reusable else self._discard(conn)
        return Reply(classify(status, payload), seconds, first_s=first_at - start), payload

    async def send(self, data: bytes) -> tuple[Reply, dict | None]:
        """One request on a pooled connection (opened first if none is idle; the opening is not
        timed)."""
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
