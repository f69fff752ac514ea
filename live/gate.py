"""The live gate: one FIFO queue on the event loop in front of K engine threads.

The rules are qsim's, called at the same three moments as in
:mod:`qsim.model` and with the same numbers:

* arrival (:meth:`Gate.submit`): :func:`qsim.policy.decide` on the waiting
  count, their calibrated estimates x the speed factor, the estimated
  remaining work in service, the idle engines and K. A request admitted while
  an engine is idle is handed to that engine inside ``submit`` and counts as
  in service at once (else a burst slips one more past the bound per engine);
* reaching the front (an engine came free): with ``expire_at_front``, a
  request that :func:`qsim.policy.cannot_finish` is dropped unrun;
* completion: the :class:`qsim.service.SpeedTracker` learns actual over
  predicted engine time (engine failures teach it nothing).

Every piece of state lives on the event loop thread; engine threads only run
``engine.run`` and post the result back with ``call_soon_threadsafe``, so no
lock is needed and ``submit`` never blocks. Waiting requests are futures, not
threads: a thread pool in front of the gate would be a second, unbounded and
invisible queue. The clock is read once per event and passed to the pure rules.

Stalled engines. An engine thread cannot be interrupted, so a hung engine
would hold its request, and everyone behind it, forever. A watchdog on the
event loop (every ``watch_interval_s``, 50 ms) looks for them:

* an engine is *stalled* once its request has run longer than
  ``max(stall_factor x its estimate at start, stall_floor_s)`` (10 x, 5 s).
  Its request then ends as an error (:class:`EngineStalled`, counted once);
  the engine stays busy until ``engine.run`` returns, and what it returns
  then is dropped: a stalled request teaches the speed tracker nothing, so one
  hang cannot multiply every later estimate;
* a stalled engine's remaining work counts as its overrun so far (how long it
  has run past its estimate), not zero: the wait estimate keeps growing and
  predictive admission keeps refusing, instead of reading the engine as about
  to finish and letting everyone in;
* while *every* engine is stalled the queue cannot move, so a waiting request
  is ended once its deadline has passed: ``expired`` (``cannot_finish``, what
  the front would have decided) under a policy that expires at the front,
  else an error (:class:`EngineStalled`). Nothing waits longer than its
  deadline behind stalled engines, or than the threshold on an engine;
* ``stats()["stalled"]`` and :meth:`Gate.health` report stalled engines
  (``/healthz`` says "degraded").

When nothing stalls the watchdog changes nothing: below the threshold an
overrunning engine counts as about to finish (remaining 0), exactly as in
qsim, and requests wait as long as the policy lets them, so the gate and the
simulator still decide alike.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable, Sequence

from qsim.policy import (EXPIRE_REASON, REJECT_REASONS, Policy, Rejection, cannot_finish, decide, on_time,
                         retry_after)
from qsim.records import OUTCOMES
from qsim.service import ServiceModel, SpeedTracker

from .engine import Engine, EngineResult


@dataclass(frozen=True)
class GateConfig:
    """The policy, the calibration the estimates come from, and speed tracking."""

    policy: Policy
    model: ServiceModel = ServiceModel()
    fixed_estimate: bool = False  # keep the calibrated estimate: the baseline tracking is measured against
    tracker_weight: float = 0.2
    # An engine is stalled past max(stall_factor x estimate, stall_floor_s): far beyond any speed change
    # seen on a shared machine (2.25x), and the floor keeps a short request's hiccup from counting.
    stall_factor: float = 10.0
    stall_floor_s: float = 5.0
    watch_interval_s: float = 0.05  # how often the watchdog looks: the precision of stall detection

    def __post_init__(self) -> None:
        if not (self.stall_factor >= 1 and math.isfinite(self.stall_factor)):
            raise ValueError(f"stall_factor must be a finite number >= 1, got {self.stall_factor}")
        for name in ("stall_floor_s", "watch_interval_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")

    def stall_after_s(self, est_service_s: float) -> float:
        """How long a request estimated at ``est_service_s`` may run before its engine counts as stalled."""
        return max(self.stall_factor * est_service_s, self.stall_floor_s)


@dataclass(frozen=True)
class Job:
    """A prepared request. deadline_s: seconds after arrival; None takes the policy's default."""

    prompt: str
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    deadline_s: float | None = None


@dataclass(frozen=True)
class Arrival:
    """The gate's view when the request arrived (what a record's admission columns hold)."""

    at: float  # gate clock
    est_service_s: float  # calibrated estimate x speed factor
    deadline_s: float
    queued: int  # waiting (not in service) before it
    queued_work_s: float  # their estimated work

    def numbers(self) -> dict[str, float]:
        """For answers and refusals; arrived_at lets a client put the gate's own arrival order on its clock."""
        return {"arrived_at": self.at, "est_service_s": self.est_service_s, "deadline_s": self.deadline_s,
                "queued": self.queued, "queued_work_s": self.queued_work_s}


@dataclass(frozen=True)
class Answer:
    """A request the engine ran; outcome good or late by the gate's clock."""

    text: str
    tokens: int
    outcome: str
    queue_s: float
    engine_s: float
    latency_s: float
    engine: int
    arrival: Arrival


class Rejected(Exception):
    """Refused at arrival; ``rejection`` is qsim's :class:`~qsim.policy.Rejection`."""

    def __init__(self, rejection: Rejection, arrival: Arrival) -> None:
        super().__init__(rejection.reason)
        self.rejection = rejection
        self.arrival = arrival


class DeadlineExceeded(Exception):
    """Dropped unrun at the front: it could not finish by its deadline even if started then."""

    reason = EXPIRE_REASON

    def __init__(self, numbers: dict[str, float], retry_after_s: int, arrival: Arrival) -> None:
        super().__init__(EXPIRE_REASON)
        self.numbers = numbers
        self.retry_after_s = retry_after_s
        self.arrival = arrival


class EngineFailed(Exception):
    """The engine raised while running the request; ``__cause__`` is what it raised."""

    def __init__(self, engine: int, error: BaseException, arrival: Arrival) -> None:
        super().__init__(f"engine {engine} failed: {type(error).__name__}: {error}")
        self.engine = engine
        self.arrival = arrival


class EngineStalled(Exception):
    """Given up behind a stalled engine: it ran past its engine's threshold, or it waited past its
    deadline while every engine was stalled.

    engine: the engine that ran it (None: it was still waiting). numbers: what the gate saw.
    """

    reason = "engine_stalled"

    def __init__(self, message: str, engine: int | None, numbers: dict[str, float], arrival: Arrival) -> None:
        super().__init__(message)
        self.engine = engine
        self.numbers = numbers
        self.arrival = arrival


@dataclass(eq=False)  # identity: a ticket is removed from the deque by being itself
class _Ticket:
    job: Job
    arrival: Arrival
    base_est_s: float  # calibrated estimate, before the speed factor
    future: asyncio.Future
    state: str = "waiting"  # waiting -> running -> done (or stalled -> done), or cancelled / expired / given_up
    engine: int = -1
    start: float = math.nan
    stall_after_s: float = math.inf  # set when it starts: its engine is stalled past start + this


class _EngineThread:
    """One thread per engine: takes one ticket at a time from the gate, posts the result back."""

    def __init__(self, k: int, engine: Engine, deliver: Callable) -> None:
        self.k, self.engine, self._deliver = k, engine, deliver
        # Never holds more than one ticket: the gate gives work only to an idle engine.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"qlab-engine-{k}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def give(self, ticket: _Ticket) -> None:
        self._inbox.put(ticket)

    def stop(self, timeout_s: float) -> None:
        self._inbox.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (ticket := self._inbox.get()) is not None:
            job = ticket.job
            try:
                result = self.engine.run(job.prompt, job.max_new_tokens, job.stop or None)
                if not isinstance(result, EngineResult):
                    raise TypeError(f"engine returned {type(result).__name__}, not EngineResult")
            except Exception as exc:  # one failed request must not take the engine down
                result = exc
            self._deliver(self.k, ticket, result)


class Gate:
    """Admission, the FIFO queue and K engine threads; use inside one running event loop."""

    def __init__(self, engines: Sequence[Engine], config: GateConfig, clock: Callable[[], float] = time.monotonic) -> None:
        if not engines:
            raise ValueError("the gate needs at least one engine")
        self.engines = list(engines)
        self.config = config
        self.policy = config.policy
        self.clock = clock
        self.workers = len(self.engines)
        self.tracker = SpeedTracker(weight=config.tracker_weight, fixed=config.fixed_estimate)
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.rejected_by_reason = dict.fromkeys(REJECT_REASONS, 0)
        self.cancelled = 0  # clients that left before their answer
        self.submitted = 0  # every request decided on: at rest, the outcome counts plus cancelled add up to it
        self._waiting: deque[_Ticket] = deque()
        self._waiting_base_s = 0.0  # calibrated estimates of the waiting, summed
        self._current: list[_Ticket | None] = [None] * self.workers
        self._busy_until = [0.0] * self.workers  # estimated end of each engine's request
        self._idle = list(range(self.workers - 1, -1, -1))  # pop() gives the lowest free engine, as in qsim
        self._stalled = [False] * self.workers  # running past its stall threshold (see the module docstring)
        self._threads: list[_EngineThread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: asyncio.TimerHandle | None = None
        self._closed = False

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
        """Bind to the running event loop and start the engine threads."""
        if self._loop is not None:
            raise RuntimeError("gate already started")
        self._loop = asyncio.get_running_loop()
        self._threads = [_EngineThread(k, e, self._post) for k, e in enumerate(self.engines)]
        for t in self._threads:
            t.start()
        self._watch = self._loop.call_later(self.config.watch_interval_s, self._watchdog)

    def close(self, timeout_s: float = 1.0) -> None:
        """Cancel what is still pending and stop the engine threads (a run in progress is not waited for)."""
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        for ticket in [*self._waiting, *filter(None, self._current)]:
            ticket.future.cancel()
        for t in self._threads:
            t.stop(timeout_s / max(1, len(self._threads)))
        self._threads = []

    async def __aenter__(self) -> "Gate":
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    # -- arrival ----------------------------------------------------------------

    def submit(self, job: Job) -> asyncio.Future:
        """Admit the job and return a future of its :class:`Answer`, or raise :class:`Rejected`.

        Never blocks. The future fails with :class:`DeadlineExceeded` (dropped at
        the front), :class:`EngineFailed` or :class:`EngineStalled`; cancelling it
        while the job waits takes the job out of the queue. Cancelling it while it
        runs leaves the engine busy until ``engine.run`` returns (a thread cannot
        be stopped mid-generation): only then is the engine free for the next.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("the gate is not running: start it inside the event loop (and not after close)")
        now = self.clock()
        self.submitted += 1
        factor = self.tracker.factor
        base = float(self.config.model.estimate(job.max_new_tokens))
        deadline = self.policy.deadline_s if job.deadline_s is None else job.deadline_s
        idle = len(self._idle)
        arrival = Arrival(now, base * factor, deadline, len(self._waiting), self._waiting_base_s * factor)
        refusal = decide(self.policy, arrival.queued, arrival.queued_work_s, self._remaining(now, idle),
                         arrival.est_service_s, deadline, self.workers, idle)
        if refusal is not None:
            self.counts["rejected"] += 1
            self.rejected_by_reason[refusal.reason] = self.rejected_by_reason.get(refusal.reason, 0) + 1
            raise Rejected(refusal, arrival)
        ticket = _Ticket(job, arrival, base, self._loop.create_future())
        ticket.future.add_done_callback(partial(self._on_future_done, ticket))
        if idle:
            self._begin(self._idle.pop(), ticket, now)
        else:
            self._waiting.append(ticket)
            self._waiting_base_s += base
        return ticket.future

    def _remaining(self, now: float, idle: int) -> float:
        """Estimated work left in service, summed over the engines (as qsim's model computes it).

        A stalled engine's is its overrun so far: it has shown it is not about to finish.
        """
        if idle:
            return 0.0
        return sum((now - end) if stalled else max(0.0, end - now)
                   for end, stalled in zip(self._busy_until, self._stalled))

    def _begin(self, k: int, ticket: _Ticket, now: float) -> None:
        if self._closed:  # shutting down: no engine thread will take it
            ticket.state = "cancelled"
            ticket.future.cancel()
            return
        ticket.state, ticket.engine, ticket.start = "running", k, now
        self._current[k] = ticket
        est = ticket.base_est_s * self.tracker.factor
        self._busy_until[k] = now + est
        ticket.stall_after_s = self.config.stall_after_s(est)
        self._threads[k].give(ticket)

    # -- completion and the front -------------------------------------------------

    def _post(self, k: int, ticket: _Ticket, result) -> None:
        """Engine thread -> event loop."""
        try:
            self._loop.call_soon_threadsafe(self._finished, k, ticket, result)
        except RuntimeError:  # the loop closed while the engine ran: nobody is waiting any more
            pass

    def _finished(self, k: int, ticket: _Ticket, result: EngineResult | BaseException) -> None:
        now = self.clock()
        stalled, self._stalled[k] = self._stalled[k], False  # it returned: the engine works again
        ticket.state = "done"
        self._current[k] = None
        if stalled:
            pass  # its request already ended as an error; a hang's engine time would poison the tracker
        elif isinstance(result, BaseException):
            self._resolve(ticket, "error", exc=EngineFailed(k, result, ticket.arrival), cause=result)
        else:
            # Against the estimate from max_new_tokens, as qsim's model does: a stop string that ends a
            # request early reads as a faster machine (learning the used share is a separate estimator).
            self.tracker.observe(ticket.base_est_s, result.engine_s)
            latency = now - ticket.arrival.at
            outcome = "good" if on_time(latency, ticket.arrival.deadline_s) else "late"
            self._resolve(ticket, outcome, Answer(result.text, result.tokens, outcome, ticket.start - ticket.arrival.at,
                                                  result.engine_s, latency, k, ticket.arrival))
        self._next_from_front(k, now)

    def _next_from_front(self, k: int, now: float) -> None:
        """Give engine k the first waiting request that can still make it, or mark k idle."""
        while self._waiting:
            ticket = self._waiting.popleft()
            self._waiting_base_s -= ticket.base_est_s
            if ticket.future.cancelled():  # its client left; the done callback has not run yet
                ticket.state = "cancelled"
                continue
            est = ticket.base_est_s * self.tracker.factor
            if self.policy.expire_at_front and cannot_finish(now, est, ticket.arrival.at + ticket.arrival.deadline_s):
                self._expire(ticket, est, now)
                continue
            self._begin(k, ticket, now)
            return
        self._waiting_base_s = 0.0  # no drift from adding and subtracting floats
        self._idle.append(k)

    def _expire(self, ticket: _Ticket, est: float, now: float) -> None:
        ticket.state = "expired"
        waited = now - ticket.arrival.at
        numbers = {**ticket.arrival.numbers(), "est_service_s": est, "waited_s": waited,
                   "left_s": ticket.arrival.deadline_s - waited}
        self._resolve(ticket, "expired", exc=DeadlineExceeded(numbers, retry_after(self._wait_now(now)), ticket.arrival))

    def _wait_now(self, now: float) -> float:
        """The wait decide() would estimate for an arrival now: the basis of a Retry-After."""
        idle = len(self._idle)
        return 0.0 if idle else (self._waiting_base_s * self.tracker.factor + self._remaining(now, idle)) / self.workers

    def _resolve(self, ticket: _Ticket, outcome: str, answer: Answer | None = None, exc: Exception | None = None,
                 cause: BaseException | None = None) -> None:
        if ticket.future.done():  # cancelled: the client left, and was counted then
            return
        self.counts[outcome] += 1
        if exc is None:
            ticket.future.set_result(answer)
        else:
            exc.__cause__ = cause
            ticket.future.set_exception(exc)

    # -- the watchdog: stalled engines and the queue behind them ----------------------

    def _watchdog(self) -> None:
        now = self.clock()
        for k, ticket in enumerate(self._current):
            if ticket is not None and not self._stalled[k] and now - ticket.start > ticket.stall_after_s:
                self._stall(k, ticket, now)
        if all(self._stalled):
            self._give_up_waiting(now)
        if not self._closed:
            self._watch = self._loop.call_later(self.config.watch_interval_s, self._watchdog)

    def _stall(self, k: int, ticket: _Ticket, now: float) -> None:
        """Engine k ran past its threshold: end its request now; the engine stays busy until it returns."""
        self._stalled[k] = True
        ticket.state = "stalled"
        running = now - ticket.start
        est = self._busy_until[k] - ticket.start
        numbers = {**ticket.arrival.numbers(), "engine": k, "running_s": running, "est_service_s": est,
                   "stall_after_s": ticket.stall_after_s}
        message = (f"engine {k} has run this request for {running:.3f} s, past its stall threshold of "
                   f"{ticket.stall_after_s:.3f} s (max of {self.config.stall_factor:g} x its {est:.3f} s estimate "
                   f"and {self.config.stall_floor_s:g} s); the gate stopped waiting for it")
        self._resolve(ticket, "error", exc=EngineStalled(message, k, numbers, ticket.arrival))

    def _give_up_waiting(self, now: float) -> None:
        """Every engine is stalled: end each waiting request whose deadline has passed (too late to answer)."""
        for ticket in [t for t in self._waiting if now >= t.arrival.at + t.arrival.deadline_s]:
            self._waiting.remove(ticket)
            self._waiting_base_s = self._waiting_base_s - ticket.base_est_s if self._waiting else 0.0
            if ticket.future.done():  # cancelled: its done callback has not run yet, and will count it
                ticket.state = "cancelled"
                continue
            est = ticket.base_est_s * self.tracker.factor
            if self.policy.expire_at_front:  # what the front would decide: it cannot finish by its deadline
                self._expire(ticket, est, now)
                continue
            ticket.state = "given_up"
            waited = now - ticket.arrival.at
            numbers = {**ticket.arrival.numbers(), "waited_s": waited, "stalled_engines": self.workers}
            message = (f"every engine is stalled; this request waited {waited:.3f} s, past its deadline of "
                       f"{ticket.arrival.deadline_s:.3f} s, and no engine can take it")
            self._resolve(ticket, "error", exc=EngineStalled(message, None, numbers, ticket.arrival))

    def _on_future_done(self, ticket: _Ticket, future: asyncio.Future) -> None:
        """A cancelled future is a client that left: a waiting one leaves the queue with its work."""
        if not future.cancelled():
            return
        self.cancelled += 1
        if ticket.state == "waiting":
            ticket.state = "cancelled"
            self._waiting.remove(ticket)
            self._waiting_base_s = self._waiting_base_s - ticket.base_est_s if self._waiting else 0.0
        # A running one cannot be stopped mid-generation; its engine time still teaches the tracker.

    # -- observation ------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def in_service(self) -> int:
        return self.workers - len(self._idle)

    @property
    def queued_work_s(self) -> float:
        return self._waiting_base_s * self.tracker.factor

    def health(self) -> dict:
        """Status "ok", or "degraded" with each stalled engine: how long its request has run, and its threshold."""
        now = self.clock()
        stalled = [{"engine": k, "running_s": now - t.start, "stall_after_s": t.stall_after_s,
                    "est_service_s": self._busy_until[k] - t.start}
                   for k, t in enumerate(self._current) if t is not None and self._stalled[k]]
        return {"status": "degraded" if stalled else "ok", "stalled": stalled}

    def stats(self) -> dict:
        """The queue now; ``clock`` is the gate's clock (monotonic seconds) at this reading."""
        return {
            "clock": self.clock(),
            "waiting": self.waiting,
            "in_service": self.in_service,
            "stalled": sum(self._stalled),
            "queued_work_s": self.queued_work_s,
            "speed_factor": self.tracker.factor,
            "fixed_estimate": self.config.fixed_estimate,
            "engines": self.workers,
            "policy": asdict(self.policy),
            "service_model": asdict(self.config.model),
            "counts": dict(self.counts),
            "rejected_by_reason": dict(self.rejected_by_reason),
            "cancelled": self.cancelled,
            "submitted": self.submitted,
        }
