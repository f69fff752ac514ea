"""The replayer's connections: one keep-alive lane per request in flight (:class:`Lanes`), opened
before the clock starts (:func:`warm_up`), as many as a burst needs (:func:`peak_simultaneous`), and
a socket each within the descriptor limit (:func:`raise_fd_limit`).
"""

from __future__ import annotations

import asyncio
import resource
import ssl
import sys

import httpx
import numpy as np

from .auth import client_headers
from .replay_config import ReplayConfig

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


def raise_fd_limit(wanted: int) -> None:
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
