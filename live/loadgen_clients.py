"""The load generator's clients (:class:`Clients`): the open-loop sends of the first attempts,
and clients that give up and retry, as the simulator's do (:mod:`qsim.clients`, one copy of the
rules).

Patience (the trace's ``patience_s``, counted from the request's first send): the client hangs up on
the attempt in flight at first send + patience, cancelling the HTTP request, which closes its
connection (the gate takes a waiting request out of its queue, and tells a running one's engine to
stop); the retry policy's ``timeout_s`` hangs up on each attempt that long after its send. Either
way the attempt is a row, ``abandoned`` (client_left, client_timeout). After every other attempt,
:class:`qsim.clients.Retrier` is told how it ended (the HTTP status, None without an answer, and
Retry-After) and answers when to send again: the retry is sent at that time on the same clock as
the first attempts, whose open-loop schedule does not change. Patience "until start" is the
simulator's alone: over plain HTTP a client cannot see its request start, so
:func:`check_patience` refuses it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import httpx
import numpy as np

from qsim import Trace
from qsim.clients import TIMEOUT_REASON, Decision, Retrier, RetryPolicy
from qsim.model import LEFT_REASON

from . import openai_replay
from .lanes import Lanes
from .replay_bodies import CANNOT_FIT, Api
from .rows import Exchange, retry_after_s

#: The last stretch before a send is spent yielding rather than sleeping (see :func:`_until`).
SPIN_S = 0.0015


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


class Clients:
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
