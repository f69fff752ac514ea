"""Open-loop replay of a qsim trace against the live service.

Request i is sent at its scheduled time whatever happened to the others: a
dispatcher starts one asyncio task per request at its time on a shared start
clock and never waits for answers. The client never queues a request itself
(a connection of its own for every request in flight, see :class:`Lanes`), so
any waiting the rows show happened in the service, which is what we study.

Every request ends in exactly one row of qsim's schema (:mod:`qsim.records`),
even when the server dies: a transport failure is outcome ``error`` (the rows
themselves are built by :mod:`live.rows`).

Clients that give up and retry, as the simulator's do (:mod:`qsim.clients`, one
copy of the rules). Patience (the trace's ``patience_s``, counted from the
request's first send): the client hangs up on the attempt in flight at first send
+ patience, cancelling the HTTP request, which closes its connection (the gate
takes a waiting request out of its queue, and tells a running one's engine to
stop); the retry policy's ``timeout_s`` hangs up on each attempt that long after
its send. Either way the attempt is a row, ``abandoned`` (client_left,
client_timeout). After every other attempt, :class:`qsim.clients.Retrier` is told
how it ended (the HTTP status, None without an answer, and Retry-After) and
answers when to send again: the retry is sent at that time on the same clock as
the first attempts, whose open-loop schedule does not change. Patience "until
start" is the simulator's alone: over plain HTTP a client cannot see its request
start, so :func:`replay_async` refuses it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import resource
import ssl
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import numpy as np
import pandas as pd

from qsim import Policy, Trace
from qsim.config import ServerConfig
from qsim.clients import TIMEOUT_REASON, Decision, Retrier, RetryPolicy
from qsim.model import LEFT_REASON
from qsim.runfile import ClientSettings, batch_step_columns

from . import openai_replay
from .auth import client_headers
from .calibrate import (
    MAX_STEP_PAGES,
    ServerFacts,
    StepPage,
    default_prompt_tokens,
    page_params,
    server_facts,
    step_page,
)
from .contract import Stats
from .contract_fields import num
from .routes import GENERATE, TPOT_SLO_HEADER, TTFT_SLO_HEADER
from .rows import Exchange, ServerInfo, retry_after_s, server_info, to_frame
from .tokenizer import MIN_CONTEXT_TOKENS, ByteTokenizer, prompt_of

#: qlab: qlab's own /v1/generate; openai: POST /v1/completions, streamed, on any OpenAI-compatible
#: server.
APIS = ("qlab", "openai")
#: The last stretch before a send is spent yielding rather than sleeping (see :func:`_until`).
SPIN_S = 0.0015
#: Idle connections stay open this long: a warmed connection must outlive the gaps of a run.
KEEPALIVE_S = 600.0
#: Requests due within this window count as simultaneous when sizing the warm connection pool.
BURST_WINDOW_S = 0.05

# httpcore asks sniffio for the async library on every request; without it each ask is a failed
# import
try:
    import sniffio  # noqa: F401
except ImportError:  # pragma: no cover
    print(
        "qlab replay: warning: sniffio is not installed; every send costs a failed import (~0.3 "
        "ms)",
        file=sys.stderr,
    )


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay: where, how patiently, and with what prompts.

    timeout_s bounds one request end to end: long enough for a request stuck
    behind an unbounded queue to be answered late rather than counted an error.
    lead_s is the head start between starting the clock and the first send, so
    that the first requests do not leave late. Prompts are the trace's length in the
    server's tokens (prompt_words words where it has none: see :func:`plan_prompts`),
    capped at the context minus the request's new tokens; context_tokens: the
    engine's context (None: what the server's /healthz says, else no limit). retry: how clients send
    a request again (None: never; its timeout_s is the per-attempt hang-up); retry_seed: the
    jitter's seed (None: the trace's seed, as :func:`qsim.simulate` takes it).
    api: qlab (``/v1/generate``) or openai (streamed ``/v1/completions`` of ``model``, None: the
    first the server lists; see :class:`Api`).
    """

    url: str
    timeout_s: float = 300.0
    prompt_words: int = 16
    context_tokens: int | None = None
    lead_s: float = 0.2
    late_warn_s: float = 0.005
    max_warm_connections: int = 256
    retry: RetryPolicy | None = None
    retry_seed: int | None = None
    api: str = "qlab"
    model: str | None = None
    slo: Objectives | None = None  # sent with every request, and recorded (ttft_slo_s, tpot_slo_s)

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.model is not None and self.api != "openai":
            raise ValueError(
                "a model is named only with api openai (qlab's /v1/generate takes none)"
            )
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if not (self.timeout_s > 0 and self.lead_s >= 0 and self.late_warn_s > 0):
            raise ValueError("timeout_s and late_warn_s must be > 0 and lead_s >= 0")
        if self.prompt_words < 1:
            raise ValueError(f"prompt_words must be >= 1, got {self.prompt_words}")
        if self.context_tokens is not None and self.context_tokens < MIN_CONTEXT_TOKENS:
            raise ValueError(
                f"context_tokens must be >= {MIN_CONTEXT_TOKENS} (a prompt token and "
                "a new one), "
                f"got {self.context_tokens}"
            )
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise ValueError(
                f"retry must be a qsim.clients.RetryPolicy, got {type(self.retry).__name__}"
            )


@dataclass(frozen=True)
class Objectives:
    """A run's objectives beside the deadline: time to the first token and time per output token
    after it (seconds; None: not set), sent as the ``x-slo-ttft-ms`` and ``x-slo-tpot-ms`` headers
    and recorded as the ttft_slo_s and tpot_slo_s columns, which goodput (analysis.latency) judges
    by."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def headers(self) -> dict[str, str]:
        pairs = ((TTFT_SLO_HEADER, self.ttft_s), (TPOT_SLO_HEADER, self.tpot_s))
        return {name: f"{seconds * 1000:g}" for name, seconds in pairs if seconds is not None}

    def columns(self, frame: pd.DataFrame) -> pd.DataFrame:
        for name, seconds in (("ttft_slo_s", self.ttft_s), ("tpot_slo_s", self.tpot_s)):
            frame[name] = np.full(len(frame), math.nan if seconds is None else seconds)
        return frame


#: The reason of a request the replayer did not send: its new tokens leave no room for a prompt
#: token.
CANNOT_FIT = "prompt_cannot_fit"


@dataclass(frozen=True)
class PromptPlan:
    """Each request's prompt length in the server's tokens, and what the context did to it.

    tokens: the length sent (0 where nothing is sent); capped: shortened to fit the context beside
    its new tokens (or the gate's prompt cap); unfit: not sent at all, its new tokens fill the
    context.
    """

    tokens: np.ndarray
    capped: np.ndarray
    unfit: np.ndarray
    facts: ServerFacts

    def meta(self) -> dict:
        """The counts, for the run's attrs and the command's report."""
        return {
            "context_tokens": self.facts.context,
            "prompt_tokenizer": self.facts.tokenizer,
            "prompts_capped": int(self.capped.sum()),
            "prompts_cannot_fit": int(self.unfit.sum()),
        }


@dataclass(frozen=True)
class GivenPrompts:
    """Each request's own prompt text (a dataset's rows, :mod:`qsim.datasets`), whose length the
    trace's prompt_tokens gives under the rule ``counting`` (pieces or bytes)."""

    texts: tuple[str, ...]
    counting: str


def plan_prompts(
    trace: Trace,
    cfg: ReplayConfig,
    facts: ServerFacts = ServerFacts(),
    given: GivenPrompts | None = None,
) -> PromptPlan:
    """The trace's prompt lengths where it has them, else the default prompt's; each capped at the
    room its new tokens leave in the context (``cfg.context_tokens``, else the server's), and at the
    gate's prompt cap. A request that leaves no room (max_new_tokens >= context) is not sent: never
    shortened without being counted. A given text (``given``) is never shortened: where it would be,
    it is not sent either."""
    if cfg.context_tokens is not None:
        facts = dataclasses.replace(facts, context=cfg.context_tokens)
    own = np.asarray(trace.prompt_tokens, dtype=np.int64)
    wanted = np.where(own > 0, own, default_prompt_tokens(facts, cfg.prompt_words))
    room = np.array([facts.longest_prompt(int(n)) for n in trace.max_new_tokens], dtype=float)
    unfit = room < 1
    capped = ~unfit & (wanted > room)
    if given is not None:  # a dataset's text is sent whole or not at all
        unfit, capped = unfit | capped, np.zeros_like(capped)
    tokens = np.where(
        unfit, 0, np.minimum(wanted, np.where(np.isfinite(room), room, wanted))
    ).astype(np.int64)
    return PromptPlan(tokens, capped, unfit, facts)


def payloads(
    trace: Trace,
    cfg: ReplayConfig,
    plan: PromptPlan | None = None,
    given: GivenPrompts | None = None,
) -> list[dict | None]:
    """One request body per trace entry (None: not sent, see :func:`plan_prompts`); deadline_ms only
    where the trace sets one (else the server's default), priority where it is not 0 and client_id
    where the trace names a client. The prompt is the given text (``given``), else generated to the
    planned length."""
    plan = plan_prompts(trace, cfg, given=given) if plan is None else plan
    out = []
    for i, (tokens, length, unfit, deadline, priority, client) in enumerate(
        zip(
            trace.max_new_tokens,
            plan.tokens,
            plan.unfit,
            trace.deadline_s,
            trace.priority,
            trace.client_id,
        )
    ):
        if unfit:
            out.append(None)
            continue
        prompt = prompt_of(int(length), plan.facts.tokenizer) if given is None else given.texts[i]
        body = {"prompt": prompt, "max_new_tokens": int(tokens)}
        if math.isfinite(deadline):
            body["deadline_ms"] = int(round(deadline * 1000))
        if priority:
            body["priority"] = int(priority)
        if client is not None:
            body["client_id"] = str(client)
        out.append(body)
    return out


class Lanes:
    """One keep-alive connection per request in flight, each in an httpx transport of its own.

    Never a wait inside the client: a request takes an idle lane or a new one
    (no limit), so the only queue a request meets is the service's. Why not one
    client with an unlimited pool: httpcore's pool does work for every
    connection it holds on every request (it polls each idle one), so with 30
    connections each send costs milliseconds, and a burst leaves over a tenth
    of a second. A lane's pool holds one connection, which it keeps alive for
    the whole run (see :func:`warm_up`).
    """

    def __init__(self, cfg: ReplayConfig) -> None:
        # made once: building one per transport costs ~25 ms
        self._ssl = ssl.create_default_context()
        self._limits = httpx.Limits(
            max_connections=1, max_keepalive_connections=1, keepalive_expiry=KEEPALIVE_S
        )
        self._idle: list[httpx.AsyncHTTPTransport] = []
        self._all: list[httpx.AsyncHTTPTransport] = []
        self.timeout = httpx.Timeout(cfg.timeout_s).as_dict()
        self.url = cfg.url
        # A key for a server that wants one (QLAB_API_KEY), and the run's objectives.
        self.headers = {**client_headers(), **(cfg.slo.headers() if cfg.slo is not None else {})}

    def request(
        self, method: str, path: str, headers: dict | None = None, **kwargs
    ) -> httpx.Request:
        return httpx.Request(
            method,
            self.url + path,
            headers={**self.headers, **(headers or {})},
            extensions={"timeout": self.timeout},
            **kwargs,
        )

    async def send(self, request: httpx.Request, read=None):
        """Send on an idle lane (or a new one) and read the whole answer; with ``read`` (a coroutine
        function of the response that reads it to its end, e.g. event by event), what ``read``
        returns."""
        lane = self._idle.pop() if self._idle else self._new()
        try:
            response = await lane.handle_async_request(request)
            if read is not None:
                result = await read(response)
            else:
                await response.aread()
                result = response
        except BaseException:
            await lane.aclose()  # its connection is in an unknown state: never reuse it
            raise
        self._idle.append(lane)
        return result

    def _new(self) -> httpx.AsyncHTTPTransport:
        lane = httpx.AsyncHTTPTransport(verify=self._ssl, limits=self._limits)
        self._all.append(lane)
        return lane

    async def aclose(self) -> None:
        await asyncio.gather(*(lane.aclose() for lane in self._all), return_exceptions=True)

    async def __aenter__(self) -> "Lanes":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def _raise_fd_limit(wanted: int) -> None:
    """One socket per request in flight: lift the soft descriptor limit towards the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, wanted)
    if soft != resource.RLIM_INFINITY and soft < min(wanted, target):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, target), hard))


def peak_simultaneous(arrival_s, window_s: float = BURST_WINDOW_S) -> int:
    """The most requests due within any ``window_s``: how many connections a burst needs at once."""
    times = np.asarray(arrival_s, dtype=float)
    return (
        int((np.searchsorted(times, times + window_s, side="left") - np.arange(times.size)).max())
        if times.size
        else 0
    )


async def warm_up(lanes: Lanes, connections: int, path: str = "/healthz") -> None:
    """Open ``connections`` keep-alive lanes before the clock starts.

    A new connection costs the client a name lookup (a thread hop) and a
    handshake before the request's first byte leaves: for a burst of 30 that
    is tens of milliseconds during which the requests sit in the client.
    Opened in advance, a send is a write on an idle connection.
    """
    await asyncio.gather(*(lanes.send(lanes.request("GET", path)) for _ in range(connections)))


@dataclass(frozen=True)
class Api:
    """Where the requests go and how their answers are read: qlab's ``/v1/generate`` (``model``
    None; answers read whole, as they always were), or an OpenAI-compatible server's
    ``/v1/completions``, streamed, asking for ``model`` (:mod:`live.openai_replay`: time to the
    first token and to ``[DONE]``)."""

    model: str | None = None

    @property
    def path(self) -> str:
        return GENERATE if self.model is None else openai_replay.COMPLETIONS

    @property
    def read(self):
        return None if self.model is None else openai_replay.read_completion

    def request(self, lanes: Lanes, body: dict) -> httpx.Request:
        """The request of one ``/v1/generate`` body, in this API."""
        kwargs = (
            {"json": body}
            if self.model is None
            else openai_replay.completion_request(body, self.model)
        )
        return lanes.request("POST", self.path, **kwargs)


class _Clients:
    """Every attempt of one replay: the open-loop sends of the first attempts, the hang-ups, and the
    retries :class:`qsim.clients.Retrier` asks for, each sent at its time on the same clock.

    exchanges: the first attempts in trace order, then each retry in the order it was decided (its
    request_id), as :func:`qsim.simulate` numbers them.
    """

    def __init__(
        self,
        lanes: Lanes,
        trace: Trace,
        bodies: list[dict | None],
        retry: RetryPolicy | None,
        seed: int,
        t0: float,
        api: Api = Api(),
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.lanes, self.bodies, self.t0, self.api = lanes, bodies, t0, api
        # from the first send; inf: none
        self.patience = np.asarray(trace.patience_s, dtype=float).tolist()
        # As in the simulator: no retrier (and no per-attempt timeout) unless the policy retries.
        self.retrier = (
            Retrier(retry, trace.arrival_s, seed) if retry is not None and retry.retries else None
        )
        self.timeout_s = (
            math.inf if self.retrier is None or retry.timeout_s is None else retry.timeout_s
        )
        self.first_sent = [math.nan] * len(trace)
        self.new_tokens = np.asarray(trace.max_new_tokens).tolist()
        self.exchanges: list[Exchange | None] = [None] * len(trace)
        self._tasks: set[asyncio.Task] = set()
        self.sent = self.ended = 0  # attempts, retries included: what a progress bar shows

    async def run(self, requests: list[httpx.Request], times) -> list[Exchange]:
        """Start request i's first attempt at its time, never waiting for an answer: the open loop;
        then wait until every attempt, retries included, has ended.

        One dispatcher rather than one timer per request: asyncio orders equal timers
        arbitrarily, and requests due at the same instant (a burst) must leave in
        trace order. Tasks created together run in creation order.
        """
        loop, t0 = self.loop, self.t0
        for i, (request, at) in enumerate(zip(requests, times)):
            # not sent (its prompt cannot fit): its one row, at its time, and no retry
            if request is None:
                self.first_sent[i] = at
                self.exchanges[i] = Exchange(
                    at,
                    at,
                    at,
                    error=f"not sent: {CANNOT_FIT}: "
                    "max_new_tokens "
                    f"{self.new_tokens[i]} leaves no room for a prompt in "
                    "the "
                    "context",
                    reason=CANNOT_FIT,
                    first=i,
                )
                continue
            await _until(loop, t0 + at)
            self._spawn(self._attempt(i, i, 1, request, at))
        while self._tasks:
            done, _ = await asyncio.wait(set(self._tasks))
            for task in done:
                task.result()  # a bug in the client is raised, not lost
        return self.exchanges

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _hangup(self, first: int, sent: float) -> tuple[float, str]:
        """When, on the run's clock, the client hangs up on an attempt sent at ``sent``, and why:
        its patience's end (from the first send), or the per-attempt timeout when that comes first
        (the simulator's rule: the timeout only when shorter than the patience left)."""
        end = self.first_sent[first] + self.patience[first]
        if self.timeout_s < end - sent:
            return sent + self.timeout_s, TIMEOUT_REASON
        return end, LEFT_REASON

    async def _attempt(
        self, slot: int, first: int, attempt: int, request: httpx.Request, at: float
    ) -> None:
        loop, t0 = self.loop, self.t0
        sent = loop.time() - t0
        if attempt == 1:
            self.first_sent[first] = sent
        hangup, why = self._hangup(first, sent)
        self.sent += 1
        ex = await self._exchange(request, at, sent, hangup, why)
        self.ended += 1
        decision = self._next(first, attempt, ex)
        self.exchanges[slot] = dataclasses.replace(
            ex,
            first=first,
            attempt=attempt,
            hangup_s=hangup if math.isfinite(hangup) else math.nan,
            next=None if decision is None else decision.why,
        )
        if decision is not None and decision.at_s is not None:
            # its request_id: retries are numbered in the order they are decided
            retry = len(self.exchanges)
            self.exchanges.append(None)
            again = self.api.request(self.lanes, self.bodies[first])
            self._spawn(self._later(retry, first, attempt + 1, again, decision.at_s))

    async def _later(
        self, slot: int, first: int, attempt: int, request: httpx.Request, at: float
    ) -> None:
        await _until(self.loop, self.t0 + at)
        await self._attempt(slot, first, attempt, request, at)

    def _next(self, first: int, attempt: int, ex: Exchange) -> Decision | None:
        """Ask the retrier what the client does after this attempt (None: no retry policy)."""
        if self.retrier is None:
            return None
        if ex.left == LEFT_REASON:  # gone: a client that left sends nothing again
            return Decision(None, "left")
        status = None if ex.left is not None or ex.error is not None else ex.status
        told = retry_after_s(ex)
        return self.retrier.after(
            first,
            attempt,
            self.first_sent[first],
            ex.done_s,
            status,
            told if told >= 0 else None,
            self.patience[first],
        )

    async def _exchange(
        self, request: httpx.Request, at: float, sent: float, hangup: float, why: str
    ) -> Exchange:
        loop, t0 = self.loop, self.t0
        try:
            if math.isfinite(hangup):
                task = asyncio.ensure_future(self.lanes.send(request, self.api.read))
                if not await _within(loop, task, t0 + hangup):
                    left = loop.time() - t0
                    # Lanes.send closes the connection: the gate sees the client leave
                    task.cancel()
                    try:
                        response = await task
                    except asyncio.CancelledError:
                        # the replay itself is being cancelled
                        if asyncio.current_task().cancelling():
                            raise
                        return Exchange(at, sent, left, left=why)
                else:
                    response = task.result()
            else:
                response = await self.lanes.send(request, self.api.read)
        except Exception as exc:  # any failure is this attempt's one row, never a lost request
            return Exchange(at, sent, loop.time() - t0, error=f"{type(exc).__name__}: {exc}"[:300])
        if isinstance(response, openai_replay.StreamReading):
            return Exchange(
                at,
                sent,
                response.done_at - t0,
                response.status,
                response.body,
                response.retry_after,
                error=response.error,
                first_token_s=response.first_token_at - t0,
                last_token_s=response.last_token_at - t0,
                pieces=response.pieces,
            )
        done = loop.time() - t0
        try:
            payload = response.json()
        except ValueError:
            payload = None
        return Exchange(
            at, sent, done, response.status_code, payload, response.headers.get("retry-after")
        )


async def _within(loop: asyncio.AbstractEventLoop, task: asyncio.Future, until: float) -> bool:
    """Wait for ``task`` until ``until`` on the loop's clock (to well under a millisecond, as
    :func:`_until`); True when it finished by then."""
    if until - loop.time() > SPIN_S:
        await asyncio.wait({task}, timeout=until - loop.time() - SPIN_S)
    while not task.done() and loop.time() < until:
        await asyncio.sleep(0)
    return task.done()


async def _until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    """Sleep until ``when`` on the loop's clock, to well under a millisecond.

    The selector rounds its timeout up to whole milliseconds, so a plain sleep
    wakes up to 1 ms late; sleep to 1 ms short, then yield to the loop (which
    keeps handling answers) until the time has come.
    """
    if when - loop.time() > SPIN_S:
        await asyncio.sleep(when - loop.time() - SPIN_S)
    while loop.time() < when:
        await asyncio.sleep(0)


async def fetch_stats(lanes: Lanes) -> tuple[dict, float]:
    """/stats, and the server's clock minus ours (NaN when it does not report ``clock``).

    The server reads its clock somewhere inside our round trip. When its
    reading is within half a round trip of our midpoint, the two are taken to
    be the same clock (one machine's CLOCK_MONOTONIC, as on loopback): offset 0.
    """
    loop = asyncio.get_running_loop()
    before = loop.time()
    response = await lanes.send(lanes.request("GET", "/stats"))
    after = loop.time()
    if response.status_code != 200:
        raise ValueError(f"GET /stats answered HTTP {response.status_code}")
    stats = response.json()
    # the contract's reading (ValueError when /stats is not it)
    clock = num(Stats.model_validate(stats).clock)
    offset = clock - (before + after) / 2
    return stats, (0.0 if abs(offset) <= (after - before) / 2 else offset)


async def fetch_steps(lanes: Lanes, since: float) -> StepPage:
    """A batching server's steps woken for at ``since`` or later (its clock):
    :class:`qsim.runfile.LoggedStep`'s fields each (/stats' step_log, page after page), and the step
    models it took among them, each after the steps before it counted from the first
    (:func:`qsim.runfile.batch_step_columns`)."""
    steps, models, cursor = [], [], None
    for _ in range(MAX_STEP_PAGES):
        asked = lanes.request("GET", "/stats", params=page_params(since, cursor))
        response = await lanes.send(asked)
        page = step_page(response.status_code, response.json())
        models += [[len(steps) + after, *fields] for after, *fields in page.models]
        steps += page.steps
        cursor = page.next
        if cursor is None:
            return StepPage(steps, None, models)
    raise ValueError(f"GET /stats?steps_since=: more than {MAX_STEP_PAGES} pages of steps")


async def step_log(lanes: Lanes, since: float) -> tuple[StepPage | None, str | None]:
    """:func:`fetch_steps`, or None and why not. The step log is optional data (qlab compare
    replays with it): a gate that died, hung up or answered nonsense after the run costs the run
    its steps, never its rows."""
    try:
        return await fetch_steps(lanes, since), None
    except (httpx.HTTPError, OSError, ValueError) as exc:
        return None, f"the gate's step log was not read ({type(exc).__name__}: {exc})"[:300]


def counted_upstream(start: dict | None, end: dict | None, zero: float) -> dict | None:
    """The upstream's own counters (/stats' upstream_counters) at the run's start and end, for the
    run's metadata: what vLLM counted over the run (its preemptions too) beside the rows, each
    reading's ``read_at`` (gate clock) also as ``read_s`` on the run's clock (``zero``: the gate's
    clock at the run's time 0). None where either /stats lacks them (an upstream without vLLM's
    counters, another engine, a failed read at the end)."""
    said = [None if s is None else Stats.model_validate(s).upstream_counters for s in (start, end)]
    if None in said:
        return None
    return {
        at: {**c.model_dump(), "read_s": c.read_at - zero} for at, c in zip(("start", "end"), said)
    }


async def stats_at_end(lanes: Lanes) -> dict | None:
    """/stats after the run, or None: optional data (the upstream's counters), as the step log is:
    a gate that died or answered nonsense after the run costs the run nothing else."""
    try:
        return (await fetch_stats(lanes))[0]
    except (httpx.HTTPError, OSError, ValueError):
        return None


def check_patience(trace: Trace) -> None:
    """Refuse what a live client cannot do: patience until its request *starts* (the simulator's
    alone)."""
    if (
        trace.meta.get("patience_until", "answer") == "start"
        and np.isfinite(trace.patience_s).any()
    ):
        raise ValueError(
            "patience until start is simulator-only: over plain HTTP a client cannot "
            "see its request "
            "start; replay with patience until answer"
        )


async def _server(lanes: Lanes, cfg: ReplayConfig) -> tuple[dict | None, float, ServerFacts]:
    """/stats (None: the server is not a qlab gate, which only ``--api openai`` may replay against),
    the clocks' offset, and what prompts depend on (/healthz's tokenizer and context, /stats' prompt
    caps)."""
    try:
        stats, offset = await fetch_stats(lanes)
        server_info(stats)  # a qlab gate's /stats says which policy it runs
    except (httpx.HTTPError, ValueError) as exc:
        if cfg.api == "qlab":
            raise ValueError(f"{cfg.url}: cannot read the server's /stats: {exc}") from None
        return None, math.nan, ServerFacts()
    try:
        response = await lanes.send(lanes.request("GET", "/healthz"))
        health = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        health = None
    return stats, offset, server_facts(health, stats)


def bare_server_info() -> ServerInfo:
    """What a run against a server that is not a qlab gate records of it: nothing is known (no
    policy: the deadline where the trace has none is :class:`qsim.Policy`'s default, 2 s)."""
    return ServerInfo(ServerConfig(Policy("unknown")), model_known=False)


def report_prompts(plan: PromptPlan, requests: int) -> None:
    """Say on stderr what the context did to the prompts: never shortened or left unsent without
    a count."""
    if plan.capped.any():
        print(
            f"qlab replay: {int(plan.capped.sum())} of {requests} prompts capped to fit the "
            "context "
            f"({plan.facts.context} tokens) beside their new tokens, or the server's prompt cap",
            file=sys.stderr,
        )
    if plan.unfit.any():
        # A dataset's text, never shortened, is unfit also where its prompt and new tokens overflow.
        print(
            f"qlab replay: {int(plan.unfit.sum())} of {requests} requests not sent: "
            "max_new_tokens fills the "
            f"context of {plan.facts.context} tokens, or a dataset's prompt beside it would "
            "overflow it "
            f"(outcome error, reason {CANNOT_FIT})",
            file=sys.stderr,
        )


async def replay_async(
    trace: Trace, cfg: ReplayConfig, given: GivenPrompts | None = None, progress=None
) -> pd.DataFrame:
    """Send every request of ``trace`` at its time (and its retries at theirs); return one validated
    row per attempt. ``given``: each request's own prompt text, sent as it is. ``progress``: a tqdm
    bar to show attempts answered and sent as the run goes (None: none)."""
    if len(trace) == 0:
        raise ValueError("the trace has no requests")
    if given is not None and len(given.texts) != len(trace):
        raise ValueError(f"{len(given.texts)} prompt texts for {len(trace)} requests")
    if np.any(np.diff(trace.arrival_s) < 0):
        raise ValueError("trace arrivals must be sorted by time")
    check_patience(trace)
    seed = int(trace.meta.get("seed", 0)) if cfg.retry_seed is None else int(cfg.retry_seed)
    clients = ClientSettings(cfg.retry, seed, str(trace.meta.get("patience_until", "answer")))
    _raise_fd_limit(len(trace) + 64)
    api = Api(
        None
        if cfg.api == "qlab"
        else openai_replay.choose_model(cfg.url, cfg.model, min(cfg.timeout_s, 30.0))
    )
    async with Lanes(cfg) as lanes:
        stats, offset, facts = await _server(lanes, cfg)
        info = server_info(stats) if stats is not None else bare_server_info()
        plan = plan_prompts(trace, cfg, facts, given)
        bodies = payloads(trace, cfg, plan, given)
        if given is not None:
            warn_counting(given, facts)
        # Requests are built (JSON encoded) and connections opened before the clock starts:
        # at send time only the send is left.
        requests = [None if b is None else api.request(lanes, b) for b in bodies]
        await warm_up(
            lanes,
            min(peak_simultaneous(trace.arrival_s), cfg.max_warm_connections),
            "/healthz" if cfg.api == "qlab" else openai_replay.MODELS,
        )
        with _frozen_heap():
            t0 = asyncio.get_running_loop().time() + cfg.lead_s  # the trace's time 0
            run = _Clients(lanes, trace, bodies, cfg.retry, seed, t0, api)
            with _ticking(run, progress):
                exchanges = await run.run(requests, trace.arrival_s.tolist())
        # A batching server's steps since the run's time 0, for the replay (qlab compare), on the
        # run's clock.
        batching = stats is not None and info.config.batching
        steps, lost = await step_log(lanes, t0 + offset) if batching else (None, None)
        counts = stats is not None and Stats.model_validate(stats).upstream_counters is not None
        upstream = (
            counted_upstream(stats, await stats_at_end(lanes), t0 + offset) if counts else None
        )
    frame = to_frame(trace, exchanges, info, plan.tokens, server_zero=t0 + offset, clients=clients)
    if steps is not None:
        zero = t0 + offset
        frame = frame.assign(
            **batch_step_columns(
                [[w - zero, b - zero, e - zero, *rest] for w, b, e, *rest in steps.steps],
                len(frame),
                steps.models,
            )
        )
    first = frame["first_request_id"].to_numpy()
    frame["prompt_capped"] = plan.capped[first]
    # never sent: no lateness to speak of
    frame.loc[plan.unfit[first], "send_lateness_s"] = math.nan
    meta = {
        "url": cfg.url,
        "trace": trace.name,
        "trace_meta": _plain(trace.meta),
        "duration_s": trace.duration_s,
        "clock_offset_s": offset,
        "retry": None if cfg.retry is None else dataclasses.asdict(cfg.retry),
        "retry_seed": seed,
        **plan.meta(),
    }
    if upstream is not None:
        meta["upstream_counters"] = upstream
    # Said in the file and once on stderr: a reader of the run knows why it has no steps.
    if lost is not None:
        meta["warnings"] = [lost]
        print(f"qlab replay: warning: {lost}; the rows are written without it", file=sys.stderr)
    if cfg.slo is not None:
        frame = cfg.slo.columns(frame)
    if api.model is not None:
        # Time to the first and the last piece of text, client-measured from the send (NaN: no text
        # came, or not a stream), and the pieces: what analysis.latency reads TTFT, ITL and TPOT
        # from.
        frame["ttft_s"] = np.array([ex.first_token_s - ex.sent_s for ex in exchanges], dtype=float)
        frame["last_token_s"] = np.array(
            [ex.last_token_s - ex.sent_s for ex in exchanges], dtype=float
        )
        frame["pieces"] = np.array([ex.pieces for ex in exchanges], dtype=np.int64)
        frame["api"] = pd.array(["openai"] * len(frame), dtype="string")
        frame["qlab_gate"] = stats is not None
        meta.update(api="openai", model=api.model, qlab_gate=stats is not None)
    frame.attrs["qlab_run"] = meta
    report_prompts(plan, len(trace))
    warn_if_late(frame, cfg.late_warn_s)
    return frame


def warn_counting(given: GivenPrompts, facts: ServerFacts) -> None:
    """Say on stderr where the server counts tokens by another rule than the texts were counted by:
    the simulated run of the same rows then describes other lengths than the server sees."""
    if facts.tokenizer == ByteTokenizer.name and given.counting != "bytes":
        print(
            f"qlab replay: warning: the server counts bytes, the dataset's lengths are "
            f"{given.counting}; --dataset-tokens bytes counts as it does",
            file=sys.stderr,
        )


def replay(
    trace: Trace, cfg: ReplayConfig, given: GivenPrompts | None = None, progress=None
) -> pd.DataFrame:
    """Synchronous :func:`replay_async`."""
    return asyncio.run(replay_async(trace, cfg, given, progress))


#: How often the bar is redrawn. From a task of its own rather than at each answer: the sends keep
#: their schedule, and a terminal is written twice a second at most.
TICK_S = 0.5


@contextmanager
def _ticking(run: _Clients, bar):
    """Redraw ``bar`` from ``run``'s counts every TICK_S while the block runs, and once at its
    end."""
    if bar is None or bar.disable:
        yield
        return

    def draw() -> None:
        bar.n = run.ended
        bar.set_postfix_str(f"sent {run.sent}", refresh=False)
        bar.refresh()

    async def tick() -> None:
        while True:
            await asyncio.sleep(TICK_S)
            draw()

    task = asyncio.ensure_future(tick())
    try:
        yield
    finally:
        task.cancel()
        draw()
        bar.close()  # its line ended before the run's warnings (report_prompts, warn_if_late)


def _plain(meta: dict) -> dict:
    """Trace metadata as JSON-able scalars (numpy numbers become Python ones)."""
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in meta.items()}


@contextmanager
def _frozen_heap():
    """Keep the collector off the objects that exist before the replay.

    A full collection walks every object of pandas, numpy and pyarrow (and the
    prepared requests): 30-70 ms during which no request leaves. Frozen, they
    are skipped; the replay's own garbage is still collected.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# ---------------------------------------------------------------- lateness


def lateness(frame: pd.DataFrame, retries: bool = False) -> dict[str, float]:
    """p50, p99 and max of how late the sends left, in seconds: of the first attempts (the open
    loop's schedule), or with ``retries`` of the retries alone (NaN where there were none)."""
    late = frame["send_lateness_s"]
    if "attempt" in frame.columns:
        late = late[frame["attempt"].gt(1) == retries]
    elif retries:
        late = late.iloc[:0]
    return {
        "p50_s": float(late.quantile(0.5)),
        "p99_s": float(late.quantile(0.99)),
        "max_s": float(late.max()),
    }


def warn_if_late(frame: pd.DataFrame, threshold_s: float) -> bool:
    """Say on stderr when sends left late: the replay was then not the open loop it claims to be."""
    if frame.empty:
        return False
    late = lateness(frame)
    if late["p99_s"] <= threshold_s:
        return False
    print(
        f"qlab replay: WARNING: sends ran late: p99 {late['p99_s'] * 1e3:.1f} ms, max "
        f"{late['max_s'] * 1e3:.1f} ms "
        f"behind schedule (threshold {threshold_s * 1e3:.0f} ms); the client, not the service, "
        "delayed these "
        "requests",
        file=sys.stderr,
    )
    return True
