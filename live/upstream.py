"""The upstream engine: each admitted request goes on to an OpenAI-compatible server.

``qlab serve --engine upstream --upstream-url URL --engines K`` puts the gate in front of a
server that speaks OpenAI's API (vLLM, or another ``qlab serve``): the gate decides who is
admitted, and each of its K engines forwards one request at a time to the upstream's
``POST /v1/completions`` with ``stream: true``, so K is the concurrency the operator allows
the upstream. The engine reads the stream to its end and hands the gate the whole answer (and, for
a client that asked for a stream, each chunk's text as it comes: ``emit``, see :mod:`live.engine`):

* engine time: from sending the request to the last token (what the speed tracker learns,
  so ``qlab calibrate`` and speed tracking work as with the other engines); the time to the
  first token is kept apart (``EngineResult.first_token_s``);
* tokens: the upstream's ``usage.completion_tokens`` (asked for with
  ``stream_options.include_usage``), else the number of chunks that carried text;
* the prompt is counted for the gate's caps with the byte tokenizer (:mod:`live.tokenizer`):
  the gate never sees the upstream's tokenizer;
* only ``prompt``, ``max_tokens`` and ``stop`` go upstream: sampling fields the gate accepts
  and ignores are not forwarded, so the upstream's defaults apply.

A coroutine engine. Forwarding is waiting on a socket, so :meth:`UpstreamEngine.arun` is a
coroutine that the gate runs as a task on its own event loop (:mod:`live.gate`), with aiohttp's
client (the one vLLM's and SGLang's serving benchmarks use): no engine thread, no hand-over
between threads, and about a third of httpx's cost per request (benchmarks/bench_openai.py,
docs/benchmarks.md). Each engine keeps its own session with one keep-alive connection, made on
the loop that first runs it. :meth:`UpstreamEngine.run` is the same call for a thread (tests,
scripts): it runs ``arun`` on an event loop of its own.

Failures (:class:`~live.engine.UpstreamError`, answered 502 ``upstream_error``): an error
status (its message is passed on), no connection, a stream that breaks off or ends without
``data: [DONE]``, an error event in the stream, a chunk that is not a completion chunk.
:class:`~live.engine.UpstreamTimeout` (504 ``upstream_timeout``): the upstream sent nothing
for ``timeout_s`` (connecting, or between two reads: a server that streams tokens sends
one per token; one that answers at the end, as ``qlab serve`` does, must finish in time).

Cancelling. The gate cancels the run's task when the run's :class:`~live.engine.Cancel` is set
(its client left, or its deadline passed): aiohttp then closes the connection it was reading,
so the upstream sees its client leave and can free its own slot, and the next run opens a new one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import aiohttp
import httpx
from pydantic import ValidationError

from .contract import ForeignError, UpstreamChunk, UpstreamModels, UpstreamRequest
from .engine import Emit, EngineResult, UpstreamError, UpstreamTimeout, run_coroutine
from .routes import COMPLETIONS, MODELS
from .serve_options import check_upstream_url
from .tokenizer import ByteTokenizer

DONE = "[DONE]"


@dataclass(frozen=True)
class UpstreamSpec:
    """Where to forward: the server's root URL, the model to ask for (None: the first it lists), and
    the longest the engine waits for the upstream to connect or send its next bytes."""

    url: str
    model: str | None = None
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", check_upstream_url(self.url))
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"the upstream timeout must be a positive number of seconds, got {self.timeout_s}")


# ---------------------------------------------------------------------- what goes up and comes back


# The bodies (what goes up, the chunks and errors that come back) are live.contract's: UpstreamRequest,
# UpstreamChunk, ForeignError and UpstreamModels, read leniently there.


def _error_message(payload: bytes | str) -> str | None:
    try:
        return ForeignError.model_validate_json(payload).text
    except ValidationError:
        return None


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


# ---------------------------------------------------------------------- start-up


def resolve_model(spec: UpstreamSpec) -> str:
    """The model to ask for: the spec's, else the first the upstream lists. ValueError (one line) when the
    upstream cannot be reached, or lists nothing usable and no model was given."""
    try:
        with httpx.Client(base_url=spec.url, timeout=spec.timeout_s) as client:
            response = client.get(MODELS)
    except httpx.HTTPError as exc:
        raise ValueError(f"--upstream-url {spec.url}: cannot reach the upstream "
                         f"({type(exc).__name__}: {_one_line(str(exc)) or 'no detail'}); is it running?") from None
    if spec.model:
        return spec.model  # it answered: reachable, and the model is the operator's word
    if response.status_code != 200:
        raise ValueError(f"--upstream-url {spec.url}: GET {MODELS} answered HTTP {response.status_code}; "
                         "name the model with --upstream-model")
    try:
        models = UpstreamModels.model_validate_json(response.content).data
    except ValidationError:
        raise ValueError(f"--upstream-url {spec.url}: GET {MODELS} is not an OpenAI model list; "
                         "name the model with --upstream-model") from None
    if not models:
        raise ValueError(f"--upstream-url {spec.url}: GET {MODELS} lists no model; name one with --upstream-model")
    return models[0].id


def make_engines(k: int, spec: UpstreamSpec) -> list["UpstreamEngine"]:
    """K engines forwarding to one upstream, each with its own connection."""
    if k < 1:
        raise ValueError(f"engines must be >= 1, got {k}")
    model = resolve_model(spec)
    return [UpstreamEngine(spec, model) for _ in range(k)]


# ---------------------------------------------------------------------- the engine


@dataclass
class _Reading:
    """What the stream has given so far."""

    start: float
    text: list[str] = field(default_factory=list)
    chunks: int = 0  # chunks that carried text
    first_s: float | None = None
    last_s: float | None = None
    usage_tokens: int | None = None

    def add(self, chunk: UpstreamChunk, emit: Emit | None = None) -> None:
        text = "".join(choice.text for choice in chunk.choices)
        if text:
            now = time.perf_counter() - self.start
            if emit is not None:  # streamed on as it came
                emit(text)
            self.text.append(text)
            self.chunks += 1
            self.first_s = now if self.first_s is None else self.first_s
            self.last_s = now
        if chunk.usage is not None:
            self.usage_tokens = chunk.usage.completion_tokens

    def result(self) -> EngineResult:
        # Engine time: to the last token; a stream without text, to its end.
        engine_s = self.last_s if self.last_s is not None else time.perf_counter() - self.start
        tokens = self.usage_tokens if self.usage_tokens is not None else self.chunks
        return EngineResult("".join(self.text), tokens, engine_s, self.first_s)


#: Longest line of the upstream's event stream read (aiohttp's buffer): far above any token's chunk.
READ_BUFFER = 1 << 20
#: A kept-alive connection idle this long is closed rather than reused: below uvicorn's 5 s (``qlab serve``
#: as the upstream), so that the engine never writes on a connection the upstream is closing.
KEEPALIVE_S = 4.0


class UpstreamEngine:
    """Forwards one request at a time to an OpenAI-compatible server's streaming ``/v1/completions``."""

    max_new_tokens_limit = None

    def __init__(self, spec: UpstreamSpec, model: str) -> None:
        self.spec, self.model = spec, model
        self._tokenizer = ByteTokenizer()
        self._session: aiohttp.ClientSession | None = None  # on the loop that runs arun (the gate's)

    async def arun(self, prompt: str, max_new_tokens: int, stop: Sequence[str] | None = None,
                   emit: Emit | None = None) -> EngineResult:
        """Forward one request; the gate cancels the task to stop it (its connection is then closed)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session.loop is not loop:
            self._session = self._new_session()
        return await self._forward(self._session, prompt, max_new_tokens, stop, emit)

    def run(self, prompt: str, max_new_tokens: int, stop: Sequence[str] | None = None,
            cancel: threading.Event | None = None, emit: Emit | None = None) -> EngineResult:
        """:meth:`arun` from a thread, on an event loop (and a session) of its own; ``cancel`` stops it."""
        async def once() -> EngineResult:
            async with self._new_session() as session:
                return await self._forward(session, prompt, max_new_tokens, stop, emit)

        return run_coroutine(once, cancel)

    def _new_session(self) -> aiohttp.ClientSession:
        # One connection: the engine runs one request at a time. Timeouts: connecting, and between two reads.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.spec.timeout_s, sock_read=self.spec.timeout_s)
        return aiohttp.ClientSession(self.spec.url, timeout=timeout, read_bufsize=READ_BUFFER,
                                     connector=aiohttp.TCPConnector(limit=1, keepalive_timeout=KEEPALIVE_S))

    async def _forward(self, session: aiohttp.ClientSession, prompt: str, max_new_tokens: int,
                       stop: Sequence[str] | None, emit: Emit | None) -> EngineResult:
        reading = _Reading(time.perf_counter())
        body = UpstreamRequest(model=self.model, prompt=prompt, max_tokens=max_new_tokens,
                               stop=list(stop) if stop else None)
        try:
            await self._stream(session, body, reading, emit)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: a line past READ_BUFFER
            raise self._failure(exc) from None
        return reading.result()

    async def _stream(self, session: aiohttp.ClientSession, body: UpstreamRequest, reading: _Reading,
                      emit: Emit | None) -> None:
        async with session.post(COMPLETIONS, data=body.model_dump_json(exclude_none=True).encode(),
                                headers={"content-type": "application/json"}) as response:
            if response.status != 200:
                content = await response.read()
                text = content.decode("utf-8", "replace")
                message = _error_message(content) or _one_line(text) or "no body"
                raise UpstreamError(f"the upstream answered HTTP {response.status}: {message}")
            async for payload in _data(response.content):
                if payload == DONE:
                    return
                reading.add(_parse_chunk(payload), emit)
        raise UpstreamError(f"the upstream's stream ended before data: {DONE}")

    def _failure(self, exc: Exception) -> UpstreamError:
        if isinstance(exc, UpstreamError):
            return exc
        where = f"{self.spec.url}{COMPLETIONS}"
        if isinstance(exc, TimeoutError):  # aiohttp's connect and read timeouts are TimeoutErrors
            return UpstreamTimeout(f"{where} sent nothing for {self.spec.timeout_s:g} s ({type(exc).__name__})")
        detail = _one_line(str(exc)) or "no detail"
        return UpstreamError(f"{where}: {type(exc).__name__}: {detail}")

    def count_tokens(self, text: str) -> int:
        return self._tokenizer.count(text)

    def warmup(self) -> None:
        """Nothing to warm here: start-up already asked the upstream for its models."""

    async def aclose(self) -> None:
        """Close the session (on the loop that made it); the next run makes a new one."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    def info(self) -> dict:
        return {"engine": "upstream", "url": self.spec.url, "model": self.model, "timeout_s": self.spec.timeout_s,
                "tokenizer": self._tokenizer.name}


async def _data(lines: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The payloads of a server-sent event stream's ``data:`` lines (OpenAI's events are one line each)."""
    async for raw in lines:
        line = raw.decode("utf-8", "replace")
        if line.startswith("data:"):
            yield line[5:].strip()


def _parse_chunk(payload: str) -> UpstreamChunk:
    message = _error_message(payload) if "error" in payload else None  # only such an event can be an error
    if message is not None:
        raise UpstreamError(f"the upstream failed mid-stream: {_one_line(message) or 'no message'}")
    try:
        return UpstreamChunk.model_validate_json(payload)
    except ValidationError:
        raise UpstreamError(f"the upstream sent an event that is not a completion chunk: {payload[:200]!r}") from None
