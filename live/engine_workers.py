"""What runs a gate's engine: a thread of its own (:class:`_EngineThread`), or for a coroutine
engine a task on the gate's loop (:class:`_EngineTask`); :func:`_worker_for` picks one. Each is
given one :class:`_Ticket` at a time and posts its result back (a :class:`_Failure` where the
engine raised).

Every piece of state lives on the event loop thread; engine threads only run
``engine.run`` and post the result back with ``call_soon_threadsafe``, so no
lock is needed and ``submit`` never blocks. A coroutine engine (``arun``: the
upstream engine, whose work is waiting on a socket) needs no thread at all: each
of its runs is a task on the same loop, posting back the same way. Waiting requests are futures, not
threads: a thread pool in front of the gate would be a second, unbounded and
invisible queue.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .engine import (Asked, Cancel, Engine, EngineResult, abilities_of, cancellable, close_on_loop,
                     is_coroutine_engine)
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
    cut: bool = False  # the gate cut it at its deadline (a worker in tests tells this from a client leaving)
    released: bool = False  # cut, and its engine given its next request then (its hand-back only ends the run)
    emit: Callable[[str], None] | None = None  # a streamed job's: posts a piece of text to ``pieces``
    pieces: asyncio.Queue | None = None  # on the loop: the pieces, then END once the future is done
    prompt_tokens: int | None = None  # a batching engine's own count of its prompt, once it said (StepDone)
    replica: int | None = None  # where a fleet's router sent it (live.fleet_gate)


@dataclass(frozen=True)
class _Failure:
    """What an engine thread posts back when ``engine.run`` raised: the error and how long it ran."""

    error: BaseException
    engine_s: float


class _InboxThread:
    """A thread of its own that takes one piece of work at a time from its inbox (None stops it); ``_loop`` runs it."""

    def __init__(self, name: str) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def give(self, work) -> None:
        self._inbox.put(work)

    def stop(self, timeout_s: float) -> None:
        self._inbox.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        raise NotImplementedError


class _EngineThread(_InboxThread):
    """One thread per engine: takes one ticket at a time from the gate, posts the result back."""

    def __init__(self, k: int, engine: Engine, deliver: Callable) -> None:
        self.k, self.engine, self._deliver = k, engine, deliver
        self._abilities = abilities_of(engine)
        # Never holds more than one ticket: the gate gives work only to an idle engine.
        super().__init__(f"qlab-engine-{k}")

    def _loop(self) -> None:
        while (ticket := self._inbox.get()) is not None:
            job = ticket.job
            began = time.perf_counter()
            cancel = {"cancel": ticket.cancel} if self._abilities.cancel else {}
            if ticket.emit is not None and self._abilities.emit:
                cancel["emit"] = ticket.emit
            if self._abilities.asked and job.asked != Asked():
                cancel["asked"] = job.asked
            try:
                result = _checked(self.engine.run(job.prompt, job.max_new_tokens, job.stop or None, **cancel))
            except Exception as exc:  # one failed request must not take the engine down
                result = _Failure(exc, time.perf_counter() - began)
            self._deliver(self.k, ticket, result)


def _checked(result) -> EngineResult:
    if not isinstance(result, EngineResult):
        raise TypeError(f"engine returned {type(result).__name__}, not EngineResult")
    return result


class _EngineTask:
    """A coroutine engine (``arun``, :func:`live.engine.is_coroutine_engine`): each run is a task on the gate's
    loop. Its work is waiting on I/O, so a thread would add only the two hand-overs between threads (and the
    GIL's) to every request; ``emit`` puts each piece straight into the ticket's queue. Cancelling the run's
    Cancel cancels the task (:func:`live.engine.cancellable`)."""

    def __init__(self, k: int, engine: Engine, deliver: Callable) -> None:
        self.k, self.engine, self._deliver = k, engine, deliver
        self._abilities = abilities_of(engine)
        self._tasks: list[asyncio.Task] = []  # the run in progress, and a next one waiting for it to stop

    def start(self) -> None:
        """Nothing to start: a run's task is made when the gate gives the engine a ticket."""

    def give(self, ticket: _Ticket) -> None:
        # One run at a time: after a cut the gate gives the next request while the cut run is still stopping.
        self._tasks = [t for t in self._tasks if not t.done()]
        previous = self._tasks[-1] if self._tasks else None
        self._tasks.append(asyncio.get_running_loop().create_task(self._run(ticket, previous),
                                                                  name=f"qlab-engine-{self.k}"))

    def stop(self, timeout_s: float) -> None:
        for task in self._tasks:
            task.cancel()  # the gate is closing: the runs' answers have nobody to go to

    async def aclose(self) -> None:
        """Let the engine close what it holds on this loop (the upstream engine's session)."""
        await close_on_loop(self.engine)

    async def _run(self, ticket: _Ticket, previous: asyncio.Task | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])  # a run cut at its deadline, stopping
        job, began = ticket.job, time.perf_counter()
        pieces = ticket.pieces
        emit = {"emit": pieces.put_nowait} if pieces is not None and self._abilities.emit else {}
        if self._abilities.asked and job.asked != Asked():
            emit["asked"] = job.asked
        try:
            run = self.engine.arun(job.prompt, job.max_new_tokens, job.stop or None, **emit)
            result = _checked(await cancellable(run, ticket.cancel))
        except Exception as exc:  # as an engine thread's: one failed request must not take the engine down
            result = _Failure(exc, time.perf_counter() - began)
        # No await from here on: a cancel the loop delivers later finds this task done.
        self._deliver(self.k, ticket, result)


def _worker_for(k: int, engine: Engine, deliver: Callable):
    """A task on the loop for a coroutine engine, else a thread of its own."""
    return (_EngineTask if is_coroutine_engine(engine) else _EngineThread)(k, engine, deliver)

