"""The upstream engine: each admitted request goes on to an OpenAI-compatible server.

``qlab serve --engine upstream --upstream-url URL --engines K`` puts the gate in front of a
server that speaks OpenAI's API (vLLM, or another ``qlab serve``): the gate decides who is
admitted, and each of its K engine threads forwards one request at a time to the upstream's
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

Failures (:class:`~live.engine.UpstreamError`, answered 502 ``upstream_error``): an error
status (its message is passed on), no connection, a stream that breaks off or ends without
``data: [DONE]``, an error event in the stream, a chunk that is not a completion chunk.
:class:`~live.engine.UpstreamTimeout` (504 ``upstream_timeout``): the upstream sent nothing
for ``timeout_s`` (connecting, or between two reads: a server that streams tokens sends
one per token; one that answers at the end, as ``qlab serve`` does, must finish in time).

Cancelling. When the gate sets the run's :class:`~live.engine.Cancel` (its client left),
the engine shuts its socket down from the gate's thread: a read blocked in the engine
thread returns at once, and the upstream sees its client leave and can free its own slot.
That is why each engine has its own ``httpx.Client`` holding one connection (K in all)
rather than one client sharing a pool: the socket to shut is the engine's one connection,
learned when it connects (httpx's ``trace`` extension), and no other request can be on it.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import httpx
from pydantic import ValidationError

from .contract import ForeignError, UpstreamChunk, UpstreamModels, UpstreamRequest
from .engine import Cancel, Emit, EngineResult, UpstreamError, UpstreamTimeout
from .openai_api import COMPLETIONS, MODELS
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


class _Connection:
    """The socket of an engine's one connection, learned from httpx's trace events when it connects."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.cancel: Cancel | None = None  # the run in progress's

    def trace(self, event: str, info: dict) -> None:
        """Called in the engine thread at each step of a request."""
        if event == "connection.connect_tcp.complete":
            self.sock = info["return_value"].get_extra_info("socket")
        if self.cancel is not None and self.cancel.is_set():
            self.shut()  # cancelled before the socket was known: stop at the next read

    def shut(self) -> None:
        """Shut the socket down (from any thread): a blocked read returns, the upstream sees us leave."""
        sock = self.sock
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already


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

    def result(self, stopped: bool = False) -> EngineResult:
        # Engine time: to the last token; a stream without text, to its end.
        engine_s = self.last_s if self.last_s is not None and not stopped else time.perf_counter() - self.start
        tokens = self.usage_tokens if self.usage_tokens is not None else self.chunks
        return EngineResult("".join(self.text), tokens, engine_s, self.first_s, stopped)


class UpstreamEngine:
    """Forwards one request at a time to an OpenAI-compatible server's streaming ``/v1/completions``."""

    max_new_tokens_limit = None

    def __init__(self, spec: UpstreamSpec, model: str) -> None:
        self.spec, self.model = spec, model
        self._tokenizer = ByteTokenizer()
        self._connection = _Connection()
        # One connection: the engine runs one request at a time, and a cancel must know its socket.
        self._client = httpx.Client(base_url=spec.url, timeout=spec.timeout_s,
                                    limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))

    def run(self, prompt: str, max_new_tokens: int, stop: Sequence[str] | None = None,
            cancel: Cancel | threading.Event | None = None, emit: Emit | None = None) -> EngineResult:
        reading = _Reading(time.perf_counter())
        if cancel is not None and cancel.is_set():
            return reading.result(stopped=True)
        forget = self._watch(cancel)
        try:
            self._stream(UpstreamRequest(model=self.model, prompt=prompt, max_tokens=max_new_tokens,
                                  stop=list(stop) if stop else None), reading, cancel, emit)
        except (httpx.HTTPError, UpstreamError) as exc:
            if cancel is not None and cancel.is_set():
                return reading.result(stopped=True)  # the error is the socket we shut
            raise self._failure(exc) from None
        finally:
            forget()
        # Set now: it came between two chunks (we stopped reading), or after the last (no matter: nobody waits).
        return reading.result(stopped=cancel is not None and cancel.is_set())

    def _watch(self, cancel: Cancel | threading.Event | None) -> Callable[[], None]:
        """Arrange for a cancel to shut the connection down; returns the undo."""
        if not isinstance(cancel, Cancel):
            return lambda: None  # none, or a plain Event: looked at between chunks only
        self._connection.cancel = cancel
        unregister = cancel.when_set(self._connection.shut)

        def forget() -> None:
            unregister()
            self._connection.cancel = None

        return forget

    def _stream(self, body: UpstreamRequest, reading: _Reading, cancel: threading.Event | None,
                emit: Emit | None) -> None:
        with self._client.stream("POST", COMPLETIONS, content=body.model_dump_json(exclude_none=True),
                                 headers={"content-type": "application/json"},
                                 extensions={"trace": self._connection.trace}) as response:
            if response.status_code != 200:
                response.read()
                message = _error_message(response.content) or _one_line(response.text) or "no body"
                raise UpstreamError(f"the upstream answered HTTP {response.status_code}: {message}")
            for payload in _data(response.iter_lines()):
                if payload == DONE:
                    return
                reading.add(_parse_chunk(payload), emit)
                if cancel is not None and cancel.is_set():
                    return
        raise UpstreamError(f"the upstream's stream ended before data: {DONE}")

    def _failure(self, exc: Exception) -> UpstreamError:
        if isinstance(exc, UpstreamError):
            return exc
        where = f"{self.spec.url}{COMPLETIONS}"
        if isinstance(exc, httpx.TimeoutException):
            return UpstreamTimeout(f"{where} sent nothing for {self.spec.timeout_s:g} s ({type(exc).__name__})")
        detail = _one_line(str(exc)) or "no detail"
        return UpstreamError(f"{where}: {type(exc).__name__}: {detail}")

    def count_tokens(self, text: str) -> int:
        return self._tokenizer.count(text)

    def warmup(self) -> None:
        """Nothing to warm here: start-up already asked the upstream for its models."""

    def close(self) -> None:
        self._client.close()

    def info(self) -> dict:
        return {"engine": "upstream", "url": self.spec.url, "model": self.model, "timeout_s": self.spec.timeout_s,
                "tokenizer": self._tokenizer.name}


def _data(lines: Iterator[str]) -> Iterator[str]:
    """The payloads of a server-sent event stream's ``data:`` lines (OpenAI's events are one line each)."""
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()


def _parse_chunk(payload: str) -> UpstreamChunk:
    message = _error_message(payload)
    if message is not None:
        raise UpstreamError(f"the upstream failed mid-stream: {_one_line(message) or 'no message'}")
    try:
        return UpstreamChunk.model_validate_json(payload)
    except ValidationError:
        raise UpstreamError(f"the upstream sent an event that is not a completion chunk: {payload[:200]!r}") from None
