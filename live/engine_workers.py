"""What runs a gate's engine: :class:`Worker`, one call at a time, on a thread of its own or, for a
coroutine engine, as a task on the gate's loop; each call's result (a :class:`_Failure` where the
call raised) is delivered back. The one-at-a-time driver (:mod:`live.drive_one`) gives it engine
runs, the batching driver (:mod:`live.drive_batch`) steps: the same worker runs both.

Every piece of state lives on the event loop thread; an engine thread only runs its call and
delivers the result, which the gate posts to the loop with ``call_soon_threadsafe``, so no lock
is needed and ``submit`` never blocks. A coroutine engine (``arun`` or ``astep``: the upstream
engines, whose work is waiting on a socket) needs no thread at all: each call is a task on the
same loop, delivering the same way. Waiting requests are futures, not threads: a thread pool in
front of the gate would be a second, unbounded and invisible queue.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from .engine import Cancel, close_on_loop
from .jobs import Arrival, Job


@dataclass(eq=False)  # identity: the queue core finds a ticket by being itself
class _Ticket:
    job: Job
    arrival: Arrival
    future: asyncio.Future
    engine: int = -1
    start: float = math.nan
    cancel: Cancel | None = None  # set when its client leaves while it runs, or the gate cuts it
    due: float = math.inf  # gate clock: arrival + deadline, where the policy cuts a run there
    timer: asyncio.TimerHandle | None = None  # the cut at ``due``, while it runs
    cut: bool = False  # the gate cut it at its deadline (a test's worker: not a client that left)
    released: bool = False  # cut, its engine given its next request then (its hand-back ends it)
    emit: Callable[[str], None] | None = None  # a streamed job's: posts a piece of text to pieces
    pieces: asyncio.Queue | None = None  # on the loop: the pieces, then END once the future is done
    prompt_tokens: int | None = None  # a batching engine's own count of its prompt (StepDone)
    replica: int | None = None  # where a fleet's router sent it (live.fleet_gate)
    tokens: object = None  # with a prefix cache: its qsim.prefix.TokenIds, once asked for
    # ended running by its replica's going down (--replica-down): its hand-back teaches nothing
    downed: bool = False


def _gone(ticket: _Ticket) -> bool:
    """Its client left, and the done callback that tells the core has not run yet."""
    return ticket.future.done()


@dataclass(frozen=True)
class _Failure:
    """What a worker delivers when its call raised: the error and how long the call ran."""

    error: BaseException
    engine_s: float


class Worker:
    """Runs ``call(work)`` for each piece of work it is given, one at a time, and delivers
    ``deliver(work, result)`` (a :class:`_Failure` where the call raised: one failed call must not
    take the engine down).

    coroutine False: ``call`` blocks, and runs on a thread of its own named ``name`` (None in the
    inbox stops it). coroutine True: ``call`` is a coroutine function, each call a task on the
    running loop; a call given while the last still runs (a run cut at its deadline, stopping)
    waits for it. ``engine``: what :meth:`aclose` lets close what it holds on the loop."""

    def __init__(
        self, name: str, call: Callable, deliver: Callable, *, coroutine: bool, engine=None
    ) -> None:
        self.name, self._call, self._deliver = name, call, deliver
        self.coroutine, self.engine = coroutine, engine
        self._tasks: list[asyncio.Task] = []  # the call in progress, and a next one waiting for it
        self._inbox: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if not coroutine:
            self._inbox = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread (a coroutine's task is made when it is given work)."""
        if self._thread is not None:
            self._thread.start()

    def give(self, work) -> None:
        if self._inbox is not None:
            self._inbox.put(work)
            return
        self._tasks = [t for t in self._tasks if not t.done()]
        previous = self._tasks[-1] if self._tasks else None
        self._tasks.append(
            asyncio.get_running_loop().create_task(self._run(work, previous), name=self.name)
        )

    def stop(self, timeout_s: float) -> None:
        """Stop taking work: the thread ends after its call (waited for up to ``timeout_s``); the
        tasks are cancelled (the gate is closing: their results have nobody to go to)."""
        if self._inbox is not None:
            self._inbox.put(None)
            self._thread.join(timeout_s)
        for task in self._tasks:
            task.cancel()

    async def aclose(self) -> None:
        """Let a coroutine engine close what it holds on this loop (an upstream's connections)."""
        if self.coroutine and self.engine is not None:
            await close_on_loop(self.engine)

    def _serve(self) -> None:
        while (work := self._inbox.get()) is not None:
            began = time.perf_counter()
            try:
                result = self._call(work)
            except Exception as exc:
                result = _Failure(exc, time.perf_counter() - began)
            self._deliver(work, result)

    async def _run(self, work, previous: Awaitable | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])  # a run cut at its deadline, stopping
        began = time.perf_counter()
        try:
            result = await self._call(work)
        except Exception as exc:
            result = _Failure(exc, time.perf_counter() - began)
        # No await from here on: a cancel the loop delivers later finds this task done.
        self._deliver(work, result)


async def closed(workers: list) -> None:
    """Each stopped worker's end awaited on the loop (:meth:`Worker.aclose`): a task's cancel, a
    thread's engine closed there; a test's worker holds nothing on the loop."""
    for w in workers:
        if hasattr(w, "aclose"):
            await w.aclose()
