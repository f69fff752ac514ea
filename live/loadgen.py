"""Open-loop replay of a qsim trace against the live service.

Request i is sent at its scheduled time whatever happened to the others: a
dispatcher starts one asyncio task per request at its time on a shared start
clock and never waits for answers. The client never queues a request itself
(a connection of its own for every request in flight, see :class:`Lanes`), so
any waiting the rows show happened in the service, which is what we study.

Every request ends in exactly one row of qsim's schema (:mod:`qsim.records`),
even when the server dies: a transport failure is outcome ``error`` (the rows
themselves are built by :mod:`live.rows`).
"""

from __future__ import annotations

import asyncio
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

from qsim import Trace

from .rows import Exchange, number, server_info, to_frame

#: Words of the synthetic prompts; common lowercase words are one GPT-2 token each.
_WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak "
          "tree near the quiet river bank").split()
#: The last stretch before a send is spent yielding rather than sleeping (see :func:`_until`).
SPIN_S = 0.0015
#: Idle connections stay open this long: a warmed connection must outlive the gaps of a run.
KEEPALIVE_S = 600.0
#: Requests due within this window count as simultaneous when sizing the warm connection pool.
BURST_WINDOW_S = 0.05

try:  # httpcore asks sniffio for the async library on every request; without it each ask is a failed import
    import sniffio  # noqa: F401
except ImportError:  # pragma: no cover
    print("qlab replay: warning: sniffio is not installed; every send costs a failed import (~0.3 ms)",
          file=sys.stderr)


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay: where, how patiently, and with what prompts.

    timeout_s bounds one request end to end: long enough for a request stuck
    behind an unbounded queue to be answered late rather than counted an error.
    lead_s is the head start between starting the clock and the first send, so
    that the first requests do not leave late.
    """

    url: str
    timeout_s: float = 300.0
    prompt_words: int = 16
    max_prompt_words: int = 64
    lead_s: float = 0.2
    late_warn_s: float = 0.005
    max_warm_connections: int = 256

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if not (self.timeout_s > 0 and self.lead_s >= 0 and self.late_warn_s > 0):
            raise ValueError("timeout_s and late_warn_s must be > 0 and lead_s >= 0")
        if not 1 <= self.prompt_words <= self.max_prompt_words:
            raise ValueError("need 1 <= prompt_words <= max_prompt_words")


def synthetic_prompt(words: int) -> str:
    """A deterministic English-ish prompt of about ``words`` GPT-2 tokens."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(max(1, words)))


def prompt_lengths(trace: Trace, cfg: ReplayConfig) -> np.ndarray:
    """The trace's prompt lengths where it has them, else the default; capped (GPT-2's context is short)."""
    own = np.asarray(trace.prompt_tokens, dtype=np.int64)
    return np.clip(np.where(own > 0, own, cfg.prompt_words), 1, cfg.max_prompt_words)


def payloads(trace: Trace, cfg: ReplayConfig) -> list[dict]:
    """One request body per trace entry; deadline_ms only where the trace sets one (else the server's default),
    priority where it is not 0 and client_id where the trace names a client."""
    out = []
    for tokens, words, deadline, priority, client in zip(trace.max_new_tokens, prompt_lengths(trace, cfg),
                                                          trace.deadline_s, trace.priority, trace.client_id):
        body = {"prompt": synthetic_prompt(int(words)), "max_new_tokens": int(tokens)}
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
        self._ssl = ssl.create_default_context()  # made once: building one per transport costs ~25 ms
        self._limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=KEEPALIVE_S)
        self._idle: list[httpx.AsyncHTTPTransport] = []
        self._all: list[httpx.AsyncHTTPTransport] = []
        self.timeout = httpx.Timeout(cfg.timeout_s).as_dict()
        self.url = cfg.url

    def request(self, method: str, path: str, **kwargs) -> httpx.Request:
        return httpx.Request(method, self.url + path, extensions={"timeout": self.timeout}, **kwargs)

    async def send(self, request: httpx.Request) -> httpx.Response:
        """Send on an idle lane (or a new one) and read the whole answer."""
        lane = self._idle.pop() if self._idle else self._new()
        try:
            response = await lane.handle_async_request(request)
            await response.aread()
        except BaseException:
            await lane.aclose()  # its connection is in an unknown state: never reuse it
            raise
        self._idle.append(lane)
        return response

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
    return int((np.searchsorted(times, times + window_s, side="left") - np.arange(times.size)).max()) if times.size else 0


async def warm_up(lanes: Lanes, connections: int) -> None:
    """Open ``connections`` keep-alive lanes before the clock starts.

    A new connection costs the client a name lookup (a thread hop) and a
    handshake before the request's first byte leaves: for a burst of 30 that
    is tens of milliseconds during which the requests sit in the client.
    Opened in advance, a send is a write on an idle connection.
    """
    await asyncio.gather(*(lanes.send(lanes.request("GET", "/healthz")) for _ in range(connections)))


async def _send(lanes: Lanes, request: httpx.Request, at: float, t0: float) -> Exchange:
    loop = asyncio.get_running_loop()
    sent = loop.time()
    try:
        response = await lanes.send(request)
    except Exception as exc:  # any failure is this request's one row, never a lost request
        return Exchange(at, sent - t0, loop.time() - t0, error=f"{type(exc).__name__}: {exc}"[:300])
    done = loop.time()
    try:
        payload = response.json()
    except ValueError:
        payload = None
    return Exchange(at, sent - t0, done - t0, response.status_code, payload, response.headers.get("retry-after"))


async def _dispatch(lanes: Lanes, requests: list[httpx.Request], times, t0: float) -> list[Exchange]:
    """Start request i's task at its time, never waiting for an answer: the open loop.

    One dispatcher rather than one timer per request: asyncio orders equal timers
    arbitrarily, and requests due at the same instant (a burst) must leave in
    trace order. Tasks created together run in creation order.
    """
    loop = asyncio.get_running_loop()
    tasks = []
    for request, at in zip(requests, times):
        await _until(loop, t0 + at)
        tasks.append(asyncio.create_task(_send(lanes, request, at, t0)))
    return list(await asyncio.gather(*tasks))


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
    clock = number(stats, "clock")
    offset = clock - (before + after) / 2
    return stats, (0.0 if abs(offset) <= (after - before) / 2 else offset)


async def replay_async(trace: Trace, cfg: ReplayConfig) -> pd.DataFrame:
    """Send every request of ``trace`` at its time; return one validated row per request."""
    if len(trace) == 0:
        raise ValueError("the trace has no requests")
    if np.any(np.diff(trace.arrival_s) < 0):
        raise ValueError("trace arrivals must be sorted by time")
    _raise_fd_limit(len(trace) + 64)
    bodies = payloads(trace, cfg)
    async with Lanes(cfg) as lanes:
        try:
            stats, offset = await fetch_stats(lanes)
            info = server_info(stats)
        except (httpx.HTTPError, ValueError) as exc:
            raise ValueError(f"{cfg.url}: cannot read the server's /stats: {exc}") from None
        # Requests are built (JSON encoded) and connections opened before the clock starts:
        # at send time only the send is left.
        requests = [lanes.request("POST", "/v1/generate", json=b) for b in bodies]
        await warm_up(lanes, min(peak_simultaneous(trace.arrival_s), cfg.max_warm_connections))
        with _frozen_heap():
            t0 = asyncio.get_running_loop().time() + cfg.lead_s  # the trace's time 0
            exchanges = await _dispatch(lanes, requests, trace.arrival_s.tolist(), t0)
    frame = to_frame(trace, exchanges, info, prompt_lengths(trace, cfg), server_zero=t0 + offset)
    frame.attrs["qlab_run"] = {"url": cfg.url, "trace": trace.name, "trace_meta": _plain(trace.meta),
                               "duration_s": trace.duration_s, "clock_offset_s": offset}
    warn_if_late(frame, cfg.late_warn_s)
    return frame


def replay(trace: Trace, cfg: ReplayConfig) -> pd.DataFrame:
    """Synchronous :func:`replay_async`."""
    return asyncio.run(replay_async(trace, cfg))


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


def lateness(frame: pd.DataFrame) -> dict[str, float]:
    """p50, p99 and max of how late the sends left, in seconds."""
    late = frame["send_lateness_s"]
    return {"p50_s": float(late.quantile(0.5)), "p99_s": float(late.quantile(0.99)), "max_s": float(late.max())}


def warn_if_late(frame: pd.DataFrame, threshold_s: float) -> bool:
    """Say on stderr when sends left late: the replay was then not the open loop it claims to be."""
    if frame.empty:
        return False
    late = lateness(frame)
    if late["p99_s"] <= threshold_s:
        return False
    print(f"qlab replay: WARNING: sends ran late: p99 {late['p99_s'] * 1e3:.1f} ms, max {late['max_s'] * 1e3:.1f} ms "
          f"behind schedule (threshold {threshold_s * 1e3:.0f} ms); the client, not the service, delayed these "
          "requests", file=sys.stderr)
    return True
