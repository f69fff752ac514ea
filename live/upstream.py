"""The upstream engine: each admitted request goes on to an OpenAI-compatible server.

``qlab serve --engine upstream --upstream-url URL --engines K`` puts the gate in front of a
server that speaks OpenAI's API (vLLM, or another ``qlab serve``): the gate decides who is
admitted, and each of its K engines forwards one request at a time, with ``stream: true``, so K
is the concurrency the operator allows the upstream. The engine reads the stream to its end and
hands the gate the whole answer (and, for a client that asked for a stream, each chunk's text as
it comes: ``emit``, see :mod:`live.engine`):

* the route: a chat goes to the upstream's ``POST /v1/chat/completions`` with its messages as the
  client sent them (so an instruct model gets its chat template), a prompt (a completion, or
  ``/v1/generate``) to ``POST /v1/completions``. Which routes the upstream serves is asked at
  start-up (:func:`probe_routes`: one one-token request to each); where it serves only one, every
  request goes there (a chat flattened to its prompt, a prompt sent as one user message), and
  where it serves neither the gate does not start;
* what goes up: the model, ``max_tokens``, the stop strings, and every sampling field the client
  gave (:attr:`live.engine.Asked.sampling`), unchanged; the upstream's defaults apply to the rest;
* engine time: from sending the request to the last token (what the speed tracker learns,
  so ``qlab calibrate`` and speed tracking work as with the other engines); the time to the
  first token is kept apart (``EngineResult.first_token_s``);
* tokens: the upstream's ``usage`` (asked for with ``stream_options.include_usage`` and, where the
  upstream takes it, vLLM's ``continuous_usage_stats``: the tokens so far in every chunk), else one
  per chunk that carried text. A chunk may carry several tokens (a loaded vLLM's API process writes
  what several engine steps made in one chunk) or none (a token whose text is not yet whole). An
  upstream that sends more than ``max_tokens`` is cut there, and the tokens reported are at most
  ``max_tokens``;
* the prompt is counted for the gate's caps with the byte tokenizer (:mod:`live.tokenizer`): the
  gate never sees the upstream's tokenizer. The answer's ``usage.prompt_tokens`` is the upstream's
  count (``EngineResult.prompt_tokens``), which its clients get;
* ``--upstream-api-key`` (or the ``QLAB_UPSTREAM_API_KEY`` environment variable): sent as
  ``Authorization: Bearer`` to an upstream that needs a key.

A coroutine engine. Forwarding is waiting on a socket, so :meth:`UpstreamEngine.arun` is a
coroutine that the gate runs as a task on its own event loop (:mod:`live.gate`), with aiohttp's
client (the one vLLM's and SGLang's serving benchmarks use): no engine thread, no hand-over
between threads, and about a third of httpx's cost per request (benchmarks/bench_openai.py,
docs/benchmarks.md). Each engine keeps its own session with one keep-alive connection, made on
the loop that first runs it. :meth:`UpstreamEngine.run` is the same call for a thread (tests,
scripts): it runs ``arun`` on an event loop of its own.

An upstream that ignores ``stream: true`` and answers with one JSON body (a completion, or a chat
completion whose text is its ``message.content``) is read whole: its text and usage are one chunk's.

Failures (:class:`~live.engine.UpstreamError`, answered 502 ``upstream_error``): an error
status (its message is passed on), no connection, a stream that breaks off or ends without
``data: [DONE]``, an error event in the stream, a chunk that is not a completion chunk.
:class:`~live.engine.UpstreamTimeout` (504 ``upstream_timeout``): the upstream sent nothing
for ``timeout_s`` (connecting, or between two reads: a server that streams tokens sends
one per token; one that answers at the end, as ``qlab serve`` does, must finish in time). The
engine bounds its own runs so (``run_timeout_s``): the gate's stall rule does not end them, so a
hung upstream is a 504 whatever the stall settings, and one that keeps sending is not stalled.

Readiness (:class:`UpstreamHealth`, shared by the K engines): what the gate last learned of the
upstream, from each run's end (no connection, a timeout, a 5xx, 404, 405, 401 or 403 make it not
ready; an answer makes it ready) and, when nothing was learned for a few seconds, from a
``GET /v1/models``; ``GET /ready`` and ``/healthz`` report it.

The upstream's own counters (:class:`UpstreamCounters`, shared by the K engines): what a vLLM
upstream counted itself (requests, prompt and generated tokens, preemptions, which the gate
cannot see), read from its ``GET /metrics`` when ``/stats`` asks, and said there as
``upstream_counters``; an upstream without vLLM's counters gives none.

Cancelling. The gate cancels the run's task when the run's :class:`~live.engine.Cancel` is set
(its client left, or its deadline passed): aiohttp then closes the connection it was reading,
so the upstream sees its client leave and can free its own slot, and the next run opens a new one.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

import aiohttp
import httpx
from pydantic import ValidationError

from .contract_clients import (
    ForeignError,
    UpstreamChatRequest,
    UpstreamChunk,
    UpstreamModels,
    UpstreamRequest,
)
from .contract_openai import CHAT_FIELDS
from .engine import (
    Abilities,
    Asked,
    Emit,
    EngineResult,
    UpstreamError,
    UpstreamTimeout,
    run_coroutine,
)
from .routes import CHAT, COMPLETIONS, MODELS
from .serve_options import check_upstream_url, split_credentials
from .tokenizer import ByteTokenizer
from .vllm_metrics import upstream_counters

DONE = "[DONE]"
#: Where ``--upstream-api-key`` is read from when the flag is not given.
API_KEY_ENV = "QLAB_UPSTREAM_API_KEY"


@dataclass(frozen=True)
class UpstreamSpec:
    """Where to forward: the server's root URL, the model to ask for (None: the first it lists), the
    longest the engine waits for the upstream to connect or send its next bytes, and the key to send
    it (None: none; never shown)."""

    url: str
    model: str | None = None
    timeout_s: float = 60.0
    api_key: str | None = field(default=None, repr=False)
    # The URL's user info (user, password), taken out of url: sent as basic auth, never shown
    # (issue 32).
    basic: tuple[str, str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        url, basic = split_credentials(check_upstream_url(self.url))
        object.__setattr__(self, "url", url)
        if basic is not None:
            object.__setattr__(self, "basic", basic)
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(
                f"the upstream timeout must be a positive number of seconds, got {self.timeout_s}"
            )

    @property
    def headers(self) -> dict[str, str]:
        """What every request to the upstream carries besides its body: the key as Bearer, else the
        URL's user info as basic auth (one Authorization header: the key wins,
        docs/security.md)."""
        if self.api_key:
            return {"authorization": f"Bearer {self.api_key}"}
        return {"authorization": _basic_auth(*self.basic)} if self.basic else {}


# aiohttp 3.13 deprecates BasicAuth for encode_basic_auth; the range in pyproject.toml reaches back
# to 3.12.
_basic_auth = getattr(aiohttp, "encode_basic_auth", None) or (
    lambda user, password: aiohttp.BasicAuth(user, password).encode()
)


def api_key(given: str | None) -> str | None:
    """The upstream's key: the flag's, else the environment's (:data:`API_KEY_ENV`), else None."""
    return given or os.environ.get(API_KEY_ENV) or None


# ---------------------------------------------------------------------- what goes up and comes back


# The bodies (what goes up, the chunks and errors that come back) are live.contract's:
# UpstreamRequest, UpstreamChatRequest, UpstreamChunk, ForeignError and UpstreamModels, read
# leniently there.


def _error_message(payload: bytes | str) -> str | None:
    try:
        return ForeignError.model_validate_json(payload).text
    except ValidationError:
        return None


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


@dataclass(frozen=True)
class UpstreamRoutes:
    """Which of OpenAI's generating routes the upstream serves, as :func:`probe_routes` found at
    start-up, and why not where it does not (one line per route); ``continuous_usage``: it takes
    vLLM's ``stream_options.continuous_usage_stats`` (the tokens so far in every chunk)."""

    completions: bool = True
    chat: bool = True
    why_not: tuple[str, ...] = ()
    continuous_usage: bool = False

    def says(self) -> str:
        """One line for the operator: what is served, and what the gate does about what is not."""
        if self.completions and self.chat:
            return f"the upstream serves {COMPLETIONS} and {CHAT}: each request goes to its own"
        if self.completions:
            return (
                f"the upstream serves {COMPLETIONS} only ({'; '.join(self.why_not)}): chats go "
                "there as their "
                "flattened prompt"
            )
        return (
            f"the upstream serves {CHAT} only ({'; '.join(self.why_not)}): a prompt goes there "
            "as one user "
            "message"
        )

    @property
    def stream_options(self) -> dict[str, bool]:
        """What each forwarded request asks of the stream: its usage, in every chunk where the
        upstream can."""
        return {
            "include_usage": True,
            **({"continuous_usage_stats": True} if self.continuous_usage else {}),
        }

    def info(self) -> dict:
        return {
            "completions": self.completions,
            "chat": self.chat,
            "continuous_usage": self.continuous_usage,
        }


#: How a start-up probe asks each route: one new token.
_PROBES = {
    COMPLETIONS: {"prompt": "Hello", "max_tokens": 1},
    CHAT: {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1},
}
#: A probe streams as forwarded requests do, first asking for usage in every chunk.
_CONTINUOUS = {
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}
#: Statuses that say the route is there (it served, or refused the probe for load).
_THERE = (200, 429, 503)


def _route_problem(client: httpx.Client, route: str, model: str) -> tuple[str | None, bool]:
    """None when ``route`` served a one-token probe (or refused it for load: the route is there),
    else why not; and whether it took ``continuous_usage_stats`` (a server that refuses unknown
    stream options answers 400, and is asked again without it)."""
    body = {"model": model, **_PROBES[route]}
    try:
        response = client.post(route, json={**body, **_CONTINUOUS})
        if response.status_code in (400, 422):
            plain = client.post(route, json=body)
            if plain.status_code in _THERE:
                return None, False
    except httpx.HTTPError as exc:
        return f"{route}: {type(exc).__name__}: {_one_line(str(exc)) or 'no detail'}", False
    if response.status_code in _THERE:
        return None, True
    detail = _error_message(response.content) or _one_line(response.text) or "no body"
    return f"{route} answered HTTP {response.status_code}: {_one_line(detail, 160)}", False


def probe_routes(spec: UpstreamSpec, model: str) -> UpstreamRoutes:
    """Which generating routes the upstream serves: one one-token request to each. ValueError (one
    line) when it serves neither."""
    # A connection per probe: a server that closes a kept-alive one between them must not look like
    # a missing route.
    with httpx.Client(
        base_url=spec.url, timeout=spec.timeout_s, headers={**spec.headers, "connection": "close"}
    ) as client:
        found = {route: _route_problem(client, route, model) for route in (COMPLETIONS, CHAT)}
    why_not = tuple(problem for problem, _ in found.values() if problem is not None)
    if len(why_not) == 2:
        raise ValueError(
            f"--upstream-url {spec.url}: serves neither {COMPLETIONS} nor {CHAT} for "
            f"model {model!r} "
            f"({'; '.join(why_not)})"
        )
    served = [continuous for problem, continuous in found.values() if problem is None]
    return UpstreamRoutes(
        found[COMPLETIONS][0] is None, found[CHAT][0] is None, why_not, all(served)
    )


# ---------------------------------------------------------------------- start-up


def resolve_model(spec: UpstreamSpec) -> str:
    """The model to ask for: the spec's, else the first the upstream lists. ValueError (one line)
    when the upstream cannot be reached, or lists nothing usable and no model was given."""
    try:
        with httpx.Client(
            base_url=spec.url, timeout=spec.timeout_s, headers=spec.headers
        ) as client:
            response = client.get(MODELS)
    except httpx.HTTPError as exc:
        raise ValueError(
            f"--upstream-url {spec.url}: cannot reach the upstream "
            f"({type(exc).__name__}: {_one_line(str(exc)) or 'no detail'}); is it "
            "running?"
        ) from None
    if response.status_code in (401, 403):
        raise ValueError(
            f"--upstream-url {spec.url}: GET {MODELS} answered HTTP "
            f"{response.status_code}: the upstream "
            f"wants a key (--upstream-api-key, or {API_KEY_ENV})"
        )
    if spec.model:
        return spec.model  # it answered: reachable, and the model is the operator's word
    if response.status_code != 200:
        raise ValueError(
            f"--upstream-url {spec.url}: GET {MODELS} answered HTTP "
            f"{response.status_code}; "
            "name the model with --upstream-model"
        )
    try:
        models = UpstreamModels.model_validate_json(response.content).data
    except ValidationError:
        raise ValueError(
            f"--upstream-url {spec.url}: GET {MODELS} is not an OpenAI model list; "
            "name the model with --upstream-model"
        ) from None
    if not models:
        raise ValueError(
            f"--upstream-url {spec.url}: GET {MODELS} lists no model; name one with "
            "--upstream-model"
        )
    return models[0].id


def make_engines(k: int, spec: UpstreamSpec) -> list["UpstreamEngine"]:
    """K engines forwarding to one upstream, each with its own connection, sharing what is known of
    the upstream: its model, the routes it serves (asked now), its readiness and its own
    counters."""
    if k < 1:
        raise ValueError(f"engines must be >= 1, got {k}")
    model = resolve_model(spec)
    routes = probe_routes(spec, model)
    health, counters = UpstreamHealth(spec), UpstreamCounters(spec)
    return [UpstreamEngine(spec, model, routes, health, counters) for _ in range(k)]


# ---------------------------------------------------------------------- readiness


#: What the gate learned of the upstream (a run's end, or a probe) counts for this long; then /ready
#: probes again.
FRESH_S = 5.0
#: The longest a readiness probe waits: a monitor's poll must not hang on a hung upstream.
PROBE_TIMEOUT_S = 2.0
#: Statuses of a run's answer that say the upstream is failing, not the request: it is then not
#: ready.
FAILING_STATUSES = frozenset({401, 403, 404, 405}) | frozenset(range(500, 600)) - {503}


class UpstreamHealth:
    """What the gate last learned of its upstream: None (ready) or why it is not, and when it
    learned it.

    Each run's end tells it (:meth:`learned`); :meth:`problem` probes ``GET /v1/models`` (at most
    every
    :data:`FRESH_S`) when nothing newer is known, so an idle gate still notices an upstream going
    away.
    """

    def __init__(self, spec: UpstreamSpec, clock=time.monotonic) -> None:
        self.spec, self.clock = spec, clock
        self.last_problem: str | None = None
        self.learned_at = -float("inf")
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None  # the loop that made it
        self._probing: asyncio.Task | None = None

    def learned(self, problem: str | None) -> None:
        self.last_problem, self.learned_at = problem, self.clock()

    async def problem(self) -> str | None:
        """None when the upstream is ready, else why not (one line)."""
        if self.clock() - self.learned_at > FRESH_S:
            # several monitors polling at once share one probe
            if self._probing is None or self._probing.done():
                self._probing = asyncio.ensure_future(self._probe())
            await asyncio.shield(self._probing)
        return self.last_problem

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session_loop = loop  # aiohttp's session.loop is deprecated: the loop is kept here
            self._session = _short_session(self.spec, PROBE_TIMEOUT_S)
        try:
            async with self._session.get(MODELS) as response:
                await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.learned(
                f"{self.spec.url}{MODELS}: cannot reach the upstream ({type(exc).__name__})"
            )
            return
        self.learned(None if status == 200 else f"{self.spec.url}{MODELS} answered HTTP {status}")

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()


def _short_session(spec: UpstreamSpec, timeout_s: float) -> aiohttp.ClientSession:
    """A session of one connection whose every call ends within ``timeout_s`` (or the upstream's
    timeout, if shorter), for the gate's own calls beside the runs: a probe, a read of /metrics."""
    timeout = aiohttp.ClientTimeout(total=min(timeout_s, spec.timeout_s))
    return aiohttp.ClientSession(
        spec.url, timeout=timeout, headers=spec.headers, connector=aiohttp.TCPConnector(limit=1)
    )


# ---------------------------------------------------------------------- the upstream's own counters


#: The longest ``/stats`` waits on the upstream's ``/metrics``: a slow upstream keeps /stats fast.
COUNTERS_TIMEOUT_S = 1.0
#: After a read that gave no counters (no /metrics, others than vLLM's, no answer in time), the
#: upstream is not asked again for this long: /stats waits on a failing upstream once in a while.
COUNTERS_RETRY_S = 5.0
#: Where vLLM serves its Prometheus counters.
METRICS = "/metrics"


class UpstreamCounters:
    """What the upstream counted itself (vLLM's counters,
    :func:`live.vllm_metrics.upstream_counters`), for ``/stats`` ``upstream_counters``; shared by
    the engines of one upstream.

    :meth:`reading` reads ``GET /metrics`` when /stats asks, so that a reading is as fresh as the
    /stats that carries it (one GET of the upstream's /metrics each, as a Prometheus scrape is);
    the /stats asking while a read is under way share it. A read that fails (no /metrics, other
    counters, garbage, no answer within :data:`COUNTERS_TIMEOUT_S`) raises nothing: the last
    reading stands, with its ``read_at``, and the upstream is left alone for
    :data:`COUNTERS_RETRY_S`. An upstream that never gave a reading gives None: no
    ``upstream_counters`` in /stats.
    """

    def __init__(self, spec: UpstreamSpec) -> None:
        self.spec = spec
        self.last: dict | None = None  # the last reading, read_at on the clock given to reading()
        self.retry_at = -float("inf")
        self._reading: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    async def reading(self, clock: Callable[[], float]) -> dict | None:
        """The upstream's counters now (read on ``clock``, the gate's), else the last reading, else
        None."""
        if clock() >= self.retry_at:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(self._read(clock))
            # Shielded: a /stats whose client left does not cancel the read the others wait on.
            await asyncio.shield(self._reading)
        return self.last

    async def _read(self, clock: Callable[[], float]) -> None:
        counted = await self._fetch()
        if counted is None:
            self.retry_at = clock() + COUNTERS_RETRY_S
        else:
            self.last = {**counted, "read_at": clock()}

    async def _fetch(self) -> dict[str, int] | None:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session_loop = loop
            self._session = _short_session(self.spec, COUNTERS_TIMEOUT_S)
        try:
            async with self._session.get(METRICS) as response:
                content = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        text = content.decode("utf-8", "replace")
        return upstream_counters(text) if status == 200 else None

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()


# ---------------------------------------------------------------------- the engine


@dataclass(frozen=True)
class ChunkRead:
    """One chunk of the upstream's stream as read: its text, the tokens it carried (either may be
    empty or 0), and the prompt's tokens as the upstream counted them (None: its usage has not said
    yet)."""

    text: str
    tokens: int
    prompt_tokens: int | None


#: Told of each chunk read (live.upstream_batch follows the upstream token by token with it).
Counted = Callable[[ChunkRead], None]


@dataclass
class _Reading:
    """What the stream has given so far, in tokens as the upstream counts them.

    A chunk's tokens: the rise of its ``usage.completion_tokens`` (vLLM's ``continuous_usage_stats``
    puts the tokens so far in every chunk) over the chunk before, else 1 for a chunk with text. A
    loaded vLLM writes several tokens in one chunk (its API process falls behind its engine), and a
    token whose text is not yet whole comes in a chunk with no text: counting chunks miscounts both.
    Text past ``max_tokens`` tokens is an overrun, dropped."""

    start: float
    max_tokens: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0  # tokens taken so far, at most max_tokens
    first_s: float | None = None
    last_s: float | None = None
    usage_tokens: int | None = None
    # the upstream's own count of the prompt (usage), where it says
    prompt_tokens: int | None = None

    def add(
        self, chunk: UpstreamChunk, emit: Emit | None = None, counted: Counted | None = None
    ) -> None:
        text = "".join(choice.piece for choice in chunk.choices)
        usage = chunk.usage
        said = usage.completion_tokens if usage is not None else None
        if said is not None:
            new = max(
                0, said - (self.usage_tokens if self.usage_tokens is not None else self.tokens)
            )
            self.usage_tokens = said
        else:
            new = 1 if text else 0
        if usage is not None and usage.prompt_tokens is not None:
            self.prompt_tokens = usage.prompt_tokens
        if self.tokens >= self.max_tokens or not (text or new):
            return
        new = min(new, self.max_tokens - self.tokens)
        now = time.perf_counter() - self.start
        if emit is not None and text:  # streamed on as it came
            emit(text)
        if counted is not None:
            counted(ChunkRead(text, new, self.prompt_tokens))
        self.text.append(text)
        self.tokens += new
        if new:
            self.first_s = now if self.first_s is None else self.first_s
            self.last_s = now

    def result(self) -> EngineResult:
        # Engine time: to the last token; a stream without one, to its end.
        engine_s = self.last_s if self.last_s is not None else time.perf_counter() - self.start
        tokens = self.usage_tokens if self.usage_tokens is not None else self.tokens
        return EngineResult(
            "".join(self.text),
            min(tokens, self.max_tokens),
            engine_s,
            self.first_s,
            prompt_tokens=self.prompt_tokens,
        )


#: Longest line of the upstream's event stream read (aiohttp's buffer): far above any token's chunk.
READ_BUFFER = 1 << 20
#: A kept-alive connection idle this long is closed rather than reused: below uvicorn's 5 s (``qlab
#: serve`` as the upstream), so that the engine never writes on a connection the upstream is
#: closing.
KEEPALIVE_S = 4.0


class UpstreamEngine:
    """Forwards one request at a time to an OpenAI-compatible server's streaming completions or
    chat route."""

    abilities = Abilities(cancel=True, emit=True, asked=True, coroutine=True)

    max_new_tokens_limit = None

    def __init__(
        self,
        spec: UpstreamSpec,
        model: str,
        routes: UpstreamRoutes = UpstreamRoutes(),
        health: UpstreamHealth | None = None,
        counters: UpstreamCounters | None = None,
    ) -> None:
        self.spec, self.model, self.routes = spec, model, routes
        self.health = health if health is not None else UpstreamHealth(spec)
        # For /stats' upstream_counters (live.engine.CountsUpstream).
        self.counters = counters if counters is not None else UpstreamCounters(spec)
        self._tokenizer = ByteTokenizer()
        # on the loop that runs arun (the gate's)
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    @property
    def run_timeout_s(self) -> float:
        """The engine bounds its own runs (live.engine.SelfTimed): nothing received for this long
        is a timeout."""
        return self.spec.timeout_s

    async def arun(
        self,
        prompt: str,
        max_new_tokens: int,
        stop: Sequence[str] | None = None,
        emit: Emit | None = None,
        asked: Asked = Asked(),
    ) -> EngineResult:
        """Forward one request; the gate cancels the task to stop it (its connection is then
        closed)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session, self._session_loop = self.new_session(), loop
        return await self.forward(self._session, prompt, max_new_tokens, stop, emit, asked)

    def run(
        self,
        prompt: str,
        max_new_tokens: int,
        stop: Sequence[str] | None = None,
        cancel: threading.Event | None = None,
        emit: Emit | None = None,
        asked: Asked = Asked(),
    ) -> EngineResult:
        """:meth:`arun` from a thread, on an event loop (and a session) of its own; ``cancel``
        stops it."""

        async def once() -> EngineResult:
            async with self.new_session() as session:
                return await self.forward(session, prompt, max_new_tokens, stop, emit, asked)

        return run_coroutine(once, cancel)

    def new_session(self, connections: int = 1) -> aiohttp.ClientSession:
        """A session of ``connections`` kept-alive connections: one where the engine runs one
        request at a time, a batch's seats where it forwards a batch (live.upstream_batch).
        Timeouts: connecting, and between two reads."""
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.spec.timeout_s, sock_read=self.spec.timeout_s
        )
        return aiohttp.ClientSession(
            self.spec.url,
            timeout=timeout,
            read_bufsize=READ_BUFFER,
            headers=self.spec.headers,
            connector=aiohttp.TCPConnector(limit=connections, keepalive_timeout=KEEPALIVE_S),
        )

    def request(
        self, prompt: str, max_new_tokens: int, stop: Sequence[str] | None, asked: Asked
    ) -> UpstreamRequest:
        """The body for one request (its ``route`` says where it goes): a chat to the chat route
        with its messages, a prompt to the completions route, each to the other where the upstream
        serves only that one (module docstring)."""
        gate = {
            "model": self.model,
            "max_tokens": max_new_tokens,
            "stop": list(stop) if stop else None,
            "stream_options": self.routes.stream_options,
        }
        sampling = dict(asked.sampling)
        chat = self.routes.chat and (asked.messages is not None or not self.routes.completions)
        if chat:
            messages = (
                list(asked.messages)
                if asked.messages is not None
                else [{"role": "user", "content": prompt}]
            )
            return UpstreamChatRequest(**sampling, **gate, messages=messages)
        # a flattened chat's own fields stay
        plain = {k: v for k, v in sampling.items() if k not in CHAT_FIELDS}
        return UpstreamRequest(**plain, **gate, prompt=prompt)

    async def forward(
        self,
        session: aiohttp.ClientSession,
        prompt: str,
        max_new_tokens: int,
        stop: Sequence[str] | None,
        emit: Emit | None,
        asked: Asked,
        counted: Counted | None = None,
    ) -> EngineResult:
        """One request forwarded on ``session``, read to its end (``emit``: each chunk's text as it
        comes; ``counted``: each chunk's text and tokens); the health learns how it went.
        UpstreamError (or UpstreamTimeout) for a failure."""
        body = self.request(prompt, max_new_tokens, stop, asked)
        reading = _Reading(time.perf_counter(), max_new_tokens)
        try:
            await self._stream(session, body, reading, emit, counted)
        # ValueError: a line past READ_BUFFER
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            failure = self._failure(body.route, exc)
            self.health.learned(str(failure) if failure.failing else None)
            raise failure from None
        except UpstreamError as exc:
            self.health.learned(str(exc) if exc.failing else None)
            raise
        self.health.learned(None)
        return reading.result()

    async def _stream(
        self,
        session: aiohttp.ClientSession,
        body: UpstreamRequest,
        reading: _Reading,
        emit: Emit | None,
        counted: Counted | None,
    ) -> None:
        async with session.post(
            body.route, data=body.wire(), headers={"content-type": "application/json"}
        ) as response:
            if response.status != 200:
                content = await response.read()
                text = content.decode("utf-8", "replace")
                message = _error_message(content) or _one_line(text) or "no body"
                raise UpstreamError(
                    f"the upstream answered HTTP {response.status}: {message}",
                    failing=response.status in FAILING_STATUSES,
                )
            # it ignored stream: true: one answer, read whole
            if response.content_type == "application/json":
                reading.add(
                    _parse_chunk((await response.read()).decode("utf-8", "replace")), emit, counted
                )
                return
            async for payload in _data(response.content):
                if payload == DONE:
                    return
                reading.add(_parse_chunk(payload), emit, counted)
        raise UpstreamError(f"the upstream's stream ended before data: {DONE}")

    def _failure(self, route: str, exc: Exception) -> UpstreamError:
        where = f"{self.spec.url}{route}"
        if isinstance(exc, TimeoutError):  # aiohttp's connect and read timeouts are TimeoutErrors
            return UpstreamTimeout(
                f"{where} sent nothing for {self.spec.timeout_s:g} s ({type(exc).__name__})"
            )
        detail = _one_line(str(exc)) or "no detail"
        return UpstreamError(f"{where}: {type(exc).__name__}: {detail}")

    def count_tokens(self, text: str) -> int:
        return self._tokenizer.count(text)

    def warmup(self) -> None:
        """Nothing to warm here: start-up already asked the upstream for its models and routes."""

    async def readiness(self) -> str | None:
        """None when the upstream is ready, else why not (live.engine.Checked)."""
        return await self.health.problem()

    async def aclose(self) -> None:
        """Close the session (on the loop that made it); the next run makes a new one."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()
        await self.health.aclose()
        await self.counters.aclose()

    def info(self) -> dict:
        return {
            "engine": "upstream",
            "url": self.spec.url,
            "model": self.model,
            "timeout_s": self.spec.timeout_s,
            "routes": self.routes.info(),
            "tokenizer": self._tokenizer.name,
        }


async def _data(lines: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The payloads of a server-sent event stream's ``data:`` lines (OpenAI's events are one line
    each)."""
    async for raw in lines:
        line = raw.decode("utf-8", "replace")
        if line.startswith("data:"):
            yield line[5:].strip()


def _parse_chunk(payload: str) -> UpstreamChunk:
    # only such an event can be an error
    message = _error_message(payload) if "error" in payload else None
    if message is not None:
        raise UpstreamError(f"the upstream failed mid-stream: {_one_line(message) or 'no message'}")
    try:
        return UpstreamChunk.model_validate_json(payload)
    except ValidationError:
        raise UpstreamError(
            f"the upstream sent an event that is not a completion chunk: {payload[:200]!r}"
        ) from None
