"""Engines that batch, and the gate that drives them through the queue core's batching model.

:class:`BatchGate` is :class:`live.gate.Gate` with :class:`qsim.batch.BatchQueue` in place of the one-at-a-time
core: the same core the simulator's batching run (``qsim.model._BatchSimulation``) drives on SimPy's clock, so admission,
batch membership, KV blocks, preemption and cuts at the deadline follow one set of rules in both, and the gate
only turns the core's answers into futures and engine steps:

* arrival (:meth:`Gate.submit`, unchanged): the core admits (into the batch at once, where it has a seat and
  blocks and nobody waits) or refuses;
* the core plans a step (its ``step`` hook): the gate hands the engine a :class:`StepWork` (who computes how much
  of their prompt, who decodes, the step's shape) and the engine runs it (:class:`SyntheticBatchEngine`: a sleep
  of its step model's time), then hands back a :class:`StepDone`; the gate tells the core
  (:meth:`~qsim.batch.BatchQueue.step_done`, with the engine's own time for the speed tracker), which ends the
  requests the step finished (good or late, by the gate's clock) and plans the next;
* an idle engine woken by an arrival begins its first step one loop turn later, so that a burst arriving at one
  instant starts in one step (the core's ``wake``, as the simulator's zero timeout);
* a client leaves: its request leaves the line or the batch (its blocks free for the next step);
* the core's timer (a joined request's deadline, where the policy cuts there) is a loop timer; a cut ends the
  request at its deadline (:class:`~live.gate_errors.DeadlineCut`, 504), as the simulator's.

As in the gate: every piece of state lives on the event loop; an engine's work runs as a task on the loop (a
coroutine engine, ``astep``) or on one engine thread (``step``) that posts the result back; waiting requests are
futures, never threads. Steps never overlap: the core plans the next only when the last is done.

Faults. The synthetic engine's schedule (:class:`live.engine.Faults`) applies to requests and steps: with
``fail_every`` N, the Nth request to join the batch (counting from 1) fails at the end of its first step (outcome
error, ``engine_exception``; it leaves the batch, its blocks free); with ``hang_after`` N, step N + 1 takes
``hang_s`` longer (the whole batch waits: a wedged driver). A batching engine has no stall rule in the core, so a
hang must end: ``qlab serve`` refuses one without ``--hang-for``. A speed schedule multiplies each step's time by
the speed at its start, as ``simulate(speed_schedule=)`` does.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from collections import deque
from dataclasses import asdict, astuple, dataclass, field, replace
from typing import Callable, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np

from qsim.batch import BatchQueue, RunStats, Step
from qsim.config import ServerConfig
from qsim.engines import Batching, StepModel
from qsim.outcomes import Outcome
from qsim.runfile import LoggedStep
from qsim.service import LoadTerms, ServiceModel, SpeedSchedule

from .engine import WORD, Abilities, Faults, InjectedFault, abilities_of, apply_stop, close_on_loop
from .engine_workers import _Failure, _InboxThread, _Ticket
from .gate import CUT_SLACK_S, Gate, _gone
from .gate_errors import DeadlineCut, _failure_type
from .jobs import Answer, Job
from .tokenizer import ByteTokenizer


#: Steps a batching gate remembers for ``GET /stats?steps_since=`` (about half an hour at 100 steps a second).
STEP_LOG = 200_000
#: The most steps one answer of ``GET /stats`` holds (and how many unless it asks for fewer): a
#: full log in one answer was 17 MB and held the event loop over a second; a page is under half a
#: megabyte.
STEP_PAGE = 5_000


class Chunk(NamedTuple):
    """A request computing part of its prompt in a step: ``tokens`` of them from ``start`` (those it had computed
    before this step: 0 for its first chunk, or the first after a preemption, which computes its prompt and what it
    had generated again)."""

    key: object
    job: Job
    start: int
    tokens: int


@dataclass(frozen=True)
class StepWork:
    """One step as the gate hands it to a batching engine.

    prefill: a :class:`Chunk` for each request computing its prompt (a request preempted, recompute, comes back
    here from its first token, to compute its prompt and what it had generated). decode: the keys of the requests that compute one token each; completing: the keys among prefill whose prompt
    completes in this step (each produces a token, as each of decode does). ended: the keys that left the batch for good
    since the last step (answered, cut, failed, or their client left): the engine may forget them. The step's
    shape, as the step model reads it: prefill_tokens, sampling (the requests that produce a token), context (KV
    tokens held); model_s: the gate's step model's seconds for it (its calibration, not the engine's truth).
    A key is the gate's handle of a request: hashable, compared by identity."""

    prefill: tuple[Chunk, ...]
    decode: tuple[object, ...]
    prefill_tokens: int
    sampling: int
    context: int
    model_s: float
    ended: tuple[object, ...] = ()
    completing: tuple[object, ...] = ()


@dataclass(frozen=True)
class StepDone:
    """What a step did: the engine's own seconds for it (what the speed tracker learns); failed: the requests that
    failed in it, key -> the exception (they leave the batch as errors); pieces: key -> the text of the token it
    produced, for the streamed requests (``job.stream``), which the gate hands to their clients as they come."""

    engine_s: float
    failed: Mapping[object, BaseException] = field(default_factory=dict)
    pieces: Mapping[object, str] = field(default_factory=dict)
    # key -> tokens generated, for the requests the engine ended before the core's count of their tokens (an
    # upstream server's end of text: live.upstream_batch): they finish at this step.
    finished: Mapping[object, int] = field(default_factory=dict)
    # key -> the prompt's tokens as the engine counted them, once it knows (an upstream's usage): what the
    # request's client is told, where the gate's own count differs.
    prompt_tokens: Mapping[object, int] = field(default_factory=dict)
    # A step model the engine learned in this step (live.upstream_batch): the gate plans with it from the
    # next step on, which is when a replay takes it too (the step log says after which step).
    step_model: StepModel | None = None


@runtime_checkable
class BatchEngine(Protocol):
    """An engine that runs requests together, one step at a time: ``step(work) -> StepDone`` (called from one
    engine thread) or ``async def astep(work) -> StepDone`` (a task on the gate's loop; it declares
    ``abilities = Abilities(coroutine=True)``, :class:`live.engine.Abilities`). ``text(key, job, tokens)``
    is the answer of a request that generated ``tokens`` tokens (called on the loop when it ends)."""

    max_new_tokens_limit: int | None

    def text(self, key, job: Job, tokens: int) -> str: ...

    def count_tokens(self, text: str) -> int: ...

    def warmup(self) -> None: ...

    def info(self) -> dict: ...


@runtime_checkable
class Releases(Protocol):
    """A batching engine that holds something outside the gate for each request (an upstream's stream), and lets
    it go as soon as the request is cut or its client leaves, rather than at the next step (which an idle batch
    may not have for a while): ``release(key)``, on the loop."""

    def release(self, key) -> None: ...


def is_batch_engine(engine) -> bool:
    """Whether ``engine`` runs steps (:class:`BatchEngine`: ``step`` or ``astep``) rather than one request a run."""
    steps = "astep" if abilities_of(engine).coroutine else "step"
    return isinstance(engine, BatchEngine) and callable(getattr(engine, steps, None))


class SyntheticBatchEngine:
    """A batching engine that sleeps each step for its step model's time (x speed, x noise): a real step loop on
    the server, so a real HTTP service with real batching runs wherever qlab does.

    The step's time is ``step.time(prefill tokens, sampling, context)`` of the :class:`StepWork`, times a gamma
    draw of mean 1 and the model's ``cv`` (where > 0; drawn from ``seed`` as the simulator draws its steps', so a
    run on a virtual clock is the simulator's step by step), times the speed at the step's start (``speed`` and
    ``schedule``, seconds since construction on ``clock``). ``faults``: see the module. The text is one word per
    token generated, cut at a stop string (which shortens the text, not the work)."""

    abilities = Abilities(coroutine=True)

    max_new_tokens_limit = None

    def __init__(self, step: StepModel = StepModel(), speed: float = 1.0, seed: int = 0,
                 schedule: Sequence[tuple[float, float]] = (), clock: Callable[[], float] = time.monotonic,
                 faults: Faults = Faults()) -> None:
        self.model = step
        self.speed = SpeedSchedule(float(speed), tuple((float(t), float(s)) for t, s in schedule))
        self.seed = seed
        self.faults = faults
        self._clock = clock
        self._started = clock()
        self._noise = None
        if step.cv > 0:  # the simulator's stream (qsim.model._BatchSimulation): the same draws, in step order
            rng, shape = np.random.default_rng([seed, 7919]), 1.0 / step.cv**2
            self._noise = lambda: rng.gamma(shape, 1.0 / shape)
        self._tokenizer = ByteTokenizer()
        self._seen: set = set()  # the requests in the batch (or preempted) that it has counted as runs
        self.runs = 0  # requests that joined, in order: what fail_every counts
        self.steps = 0
        self._streamed: dict = {}  # key -> [job, tokens streamed so far], for the streamed requests in the batch

    def _faulty(self, work: StepWork) -> dict:
        self._seen.difference_update(work.ended)
        for key in work.ended:
            self._streamed.pop(key, None)
        failed = {}
        for chunk in work.prefill:
            key, job = chunk.key, chunk.job
            if key not in self._seen:
                self._seen.add(key)
                self.runs += 1
                if self.faults.fails(self.runs):
                    failed[key] = InjectedFault(f"injected failure on request {self.runs} of the batch "
                                                f"(fail every {self.faults.fail_every})")
                elif job.stream:
                    self._streamed[key] = [job, 0]
        return failed

    def _pieces(self, work: StepWork) -> dict:
        """Each streamed request's token of this step: its share of the text it ends with (every run generates its
        limit), so that the pieces joined are the answer's text, a stop string's cut included."""
        pieces = {}
        for key in (*work.decode, *work.completing):
            streamed = self._streamed.get(key)
            if streamed is None:
                continue
            job, i = streamed
            streamed[1] = i + 1
            piece = self.text(key, job, job.max_new_tokens)[len(WORD) * i: len(WORD) * (i + 1)]
            if piece:  # empty past a stop string's cut
                pieces[key] = piece
        return pieces

    def duration_s(self, work: StepWork) -> float:
        """The step's seconds (draws the noise): the model, x noise, x the speed at its start (that order: the
        simulator's)."""
        run = self.model.time(work.prefill_tokens, work.sampling, work.context)
        if self._noise is not None:
            run *= self._noise()
        return run * self.speed.at(self._clock() - self._started)

    async def astep(self, work: StepWork) -> StepDone:
        began = self._clock()
        self.steps += 1
        failed = self._faulty(work)
        if self.faults.hangs(self.steps):
            await asyncio.sleep(self.faults.hang_s)  # a wedged driver: the whole batch waits
        await asyncio.sleep(self.duration_s(work))
        return StepDone(self._clock() - began, failed, self._pieces(work))

    def text(self, key, job: Job, tokens: int) -> str:
        text = WORD * tokens
        cut = apply_stop(text, job.stop, ends_after=len(WORD) * min(job.asked.min_tokens, tokens))
        return text if cut is None else cut

    def count_tokens(self, text: str) -> int:
        return self._tokenizer.count(text)

    def warmup(self) -> None:
        """Nothing to warm: sleeping needs no kernels or caches."""

    def info(self) -> dict:
        return {"engine": "synthetic", "batching": True, "step": asdict(self.model), "speed": self.speed.base,
                "schedule": [list(step) for step in self.speed.steps],
                # The engine's clock when the schedule's seconds began (as the one-at-a-time engine's info says).
                "schedule_started_at": self._started, "seed": self.seed, "tokenizer": self._tokenizer.name,
                **({"faults": self.faults.info()} if self.faults != Faults() else {})}


# ---------------------------------------------------------------- workers: where a step runs


class _StepTask:
    """A coroutine engine's steps, each a task on the gate's loop."""

    def __init__(self, engine, deliver: Callable) -> None:
        self.engine, self._deliver = engine, deliver
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Nothing to start: each step's task is made when it is given."""

    def give(self, work: StepWork) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(work), name="qlab-batch-engine")

    async def _run(self, work: StepWork) -> None:
        began = time.perf_counter()
        try:
            result = await self.engine.astep(work)
        except Exception as exc:  # one failed step must not take the engine down
            result = _Failure(exc, time.perf_counter() - began)
        self._deliver(work, result)

    def stop(self, timeout_s: float) -> None:
        if self._task is not None:
            self._task.cancel()

    async def aclose(self) -> None:
        """Let the engine close what it holds on this loop (an upstream's connections)."""
        await close_on_loop(self.engine)


class _StepThread(_InboxThread):
    """A blocking engine's steps, on one thread of its own that posts each result back to the loop."""

    def __init__(self, engine, deliver: Callable) -> None:
        self.engine, self._deliver = engine, deliver
        super().__init__("qlab-batch-engine")

    def _loop(self) -> None:
        while (work := self._inbox.get()) is not None:
            began = time.perf_counter()
            try:
                result = self.engine.step(work)
            except Exception as exc:
                result = _Failure(exc, time.perf_counter() - began)
            self._deliver(work, result)


def _step_worker_for(k: int, engine, deliver: Callable):
    return (_StepTask if abilities_of(engine).coroutine else _StepThread)(engine, deliver)


# ---------------------------------------------------------------- the gate


class BatchGate(Gate):
    """The gate in front of one batching engine (:class:`BatchEngine`), driving it through
    :class:`qsim.batch.BatchQueue`; see the module. config: a :class:`~qsim.config.ServerConfig` whose engine is a
    :class:`qsim.engines.Batching` (its step model is the gate's calibration; the engine has its own truth)."""

    def __init__(self, engine, config: ServerConfig, clock: Callable[[], float] = time.monotonic,
                 worker: Callable = _step_worker_for) -> None:
        if not is_batch_engine(engine):
            raise ValueError(f"a batching gate needs an engine that runs steps (live.batching.BatchEngine), not "
                             f"{type(engine).__name__}")
        super().__init__([engine], config, clock, worker)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._ended: list = []  # keys out of the batch for good since the last step (StepWork.ended)
        self.steps = 0
        # The last STEP_LOG steps (qsim.runfile.LoggedStep's fields, as plain tuples: see
        # log_step): for a replay and a calibration (step_log).
        self.step_log: deque[tuple] = deque(maxlen=STEP_LOG)
        self.logged = 0  # steps ever logged: the cursor of the step after the newest (step_page)
        self.step_models: list[tuple[int, StepModel]] = []  # (the step's cursor, the model from it on)
        self._woken_at: float | None = None  # an idle engine was woken then (the core's wake), and not begun yet
        self._began = (math.nan, math.nan)  # the step in flight's wake and start, for the step log

    def _fitted(self, config: ServerConfig) -> ServerConfig:
        if not isinstance(config.engine, Batching):
            raise ValueError(f"a batching gate runs a batching engine (qsim.engines.Batching), not {config.engine.kind}")
        if len(self.engines) != 1:
            raise ValueError("a batching engine is one engine")
        return config

    def _make_queue(self, config: ServerConfig) -> BatchQueue:
        queue = BatchQueue(config, step=self._step, end=self._ended_run, drop=self._drop, joined=self._joined,
                           wake=self._wake, gone=_gone)
        queue._wants_members = True  # the engine needs the decoding requests by name
        return queue

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
        """Bind to the running event loop and start the engine's worker (no watchdog: no stall rule here)."""
        if self._loop is not None:
            raise RuntimeError("gate already started")
        self._loop = asyncio.get_running_loop()
        self._threads = [self._worker(0, self.engines[0], self._post_step)]
        self._threads[0].start()

    def close(self, timeout_s: float = 1.0) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        q = self.queue
        tickets = [*(e.req for e in q.waiting), *(s.entry.req for s in q.front),
                   *(s.entry.req for s in q.running.values())]
        for ticket in tickets:
            if ticket.future is not None:
                ticket.future.cancel()
        for t in self._threads:
            t.stop(timeout_s)
        self._closing, self._threads = self._threads, []

    # -- the core's hooks -------------------------------------------------------------

    def _now(self) -> float:
        """The clock, read once for an event the core is told of; deadlines passed before it are cut first (placed
        at their deadlines by the core), so that the core hears of events in their order, as the simulator's."""
        now = self.clock()
        while (due := self.queue.next_timer()) < now:
            self.queue.timer(due)  # at its own time: an idle engine it frees is woken then, as the simulator's
        return now

    def _joined(self, ticket: _Ticket, now: float) -> None:
        ticket.engine, ticket.start = 0, now
        # No arrival yet: it joined inside arrive(), at its arrival time.
        self.timings.queue.observe(0.0 if ticket.arrival is None else now - ticket.arrival.at)

    def _wake(self, now: float) -> None:
        # One loop turn later, as the simulator's zero timeout: arrivals at this same instant join the first step.
        # For the core the step begins then; the engine was busy from ``now`` (the step log's start, see _step).
        self._woken_at = now
        self._loop.call_soon(self._begin)

    def _begin(self) -> None:
        if self._closed:
            return
        self.queue.begin(self._now())
        self._arm()

    def _step(self, plan: Step, now: float) -> None:
        if self._closed:
            return
        self.steps += 1
        # The step log's: when an idle engine was woken for it (else now), and when the core began it (the loop
        # turn in between decides which arrivals join the first step: a replay waits it too).
        self._began, self._woken_at = ((now if self._woken_at is None else self._woken_at), now), None
        prefill = tuple(Chunk(t, t.job, start, n) for (t, n), start in zip(plan.chunks, plan.starts))
        work = StepWork(prefill, plan.decoding, plan.prefill_tokens,
                        plan.sampling, plan.context, plan.model_s, tuple(self._ended), plan.completing)
        self._ended = []
        self._threads[0].give(work)

    def _post_step(self, work: StepWork, result) -> None:
        """Engine thread (or task) -> event loop."""
        try:
            self._loop.call_soon_threadsafe(self._step_finished, work, result)
        except RuntimeError:  # the loop closed while the engine ran: nobody is waiting any more
            pass

    def _step_finished(self, work: StepWork, result: StepDone | _Failure) -> None:
        if self._closed:
            return
        now = self._now()
        if isinstance(result, _Failure):  # the whole step raised: every request in it fails
            failed = dict.fromkeys((*(chunk.key for chunk in work.prefill), *work.decode), result.error)
            finished = {}
        else:
            failed, finished = result.failed, result.finished
            for ticket, tokens in result.prompt_tokens.items():
                ticket.prompt_tokens = tokens
            for ticket, piece in result.pieces.items():  # before the step's ends: a stream's last piece, then END
                if ticket.pieces is not None and not ticket.future.done():
                    ticket.pieces.put_nowait(piece)
        for ticket, error in failed.items():
            if self.queue.cancel(ticket, now) == "running":  # out of the batch, its blocks free
                self._ended.append(ticket)
                numbers = {"started_at": ticket.start, "returned_at": now}
                # An upstream's failure is the one-at-a-time gate's (502 upstream_error, 504 upstream_timeout).
                failure = _failure_type(error)(0, error, ticket.arrival, numbers)
                self._resolve(ticket, Outcome.ERROR, exc=failure, cause=error)
        for ticket, tokens in finished.items():
            self.queue.finish(ticket, now, tokens)
        self.log_step(LoggedStep(*self._began, now, result.engine_s, work.model_s,
                                 work.prefill_tokens, work.sampling, work.context))
        if not isinstance(result, _Failure) and result.step_model is not None:
            self.use_step_model(result.step_model)
        self.queue.step_done(now, result.engine_s)
        self._arm()

    def _ended_run(self, ticket: _Ticket, now: float, outcome: str, reason: str | None, stats: RunStats) -> None:
        """A request that joined the batch ended: answered (good or late), or cut at its deadline."""
        self._ended.append(ticket)
        held = now - stats.start_s
        self.timings.engine.observe(held)
        arrival = ticket.arrival
        if outcome == Outcome.CANCELLED:
            ticket.cut = True
            self._release(ticket)
            numbers = {**arrival.numbers(), "engine": 0, "started_at": stats.start_s, "at": now, "running_s": held}
            self._resolve(ticket, outcome, exc=DeadlineCut(numbers, arrival))
            return
        text = self.engines[0].text(ticket, ticket.job, stats.tokens)
        first = stats.first_token_s - stats.start_s if stats.first_token_s == stats.first_token_s else None
        self._resolve(ticket, outcome, Answer(text, stats.tokens, outcome, stats.start_s - arrival.at, held,
                                              now - arrival.at, 0, arrival, stats.start_s, now, first,
                                              ticket.prompt_tokens))

    # -- the core's timer (cutting at the deadline) ----------------------------------------

    def _arm(self) -> None:
        """A loop timer at the core's next timer, where that is earlier than the one set (as the simulator's)."""
        if self._closed:
            return
        due = self.queue.next_timer()
        if due < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = due
            # On the loop's clock: call_at, so that the gate's and the loop's clock being one gives the deadline
            # to the last bit (a test's virtual clock); a real clock's timer comes up to a millisecond late.
            when = due if self.clock == self._loop.time else self._loop.time() + (due - self.clock())
            self._timer = self._loop.call_at(when, self._on_timer, due)

    def _on_timer(self, due: float) -> None:
        self._timer, self._timer_at = None, math.inf
        if self._closed:
            return
        if due - self.clock() > CUT_SLACK_S:
            # Early: a loop whose clock is coarser than the gate's (uvloop's is libuv's, cached a loop turn, in
            # milliseconds) fires a timer up to its staleness before the gate's clock gets there. Wait on: a cut
            # before its deadline would free blocks the simulator's core still counts.
            self._arm()
            return
        # At the deadline itself, though the loop came round to it later: the core cuts there, and an idle engine
        # it frees is woken there (the step log's wake), as the simulator's; nothing else came in between (_now).
        self.queue.timer(due)
        self._arm()

    def _on_future_done(self, ticket: _Ticket, future: asyncio.Future) -> None:
        """A cancelled future is a client that left: it leaves the line, or the batch (its blocks free)."""
        if not future.cancelled():
            return
        self.cancelled += 1
        self.counts[Outcome.ABANDONED] += 1
        if self.queue.cancel(ticket, self._now()) == "running":
            self._ended.append(ticket)
            self._release(ticket)
        self._arm()

    def _release(self, ticket: _Ticket) -> None:
        """Out of the batch before its end (cut, or its client left): an engine that holds something for it lets it
        go now (:class:`Releases`); every engine hears of it with the next step (StepWork.ended)."""
        if isinstance(self.engines[0], Releases):
            self.engines[0].release(ticket)

    def _submit(self, job: Job) -> _Ticket:
        try:
            return super()._submit(job)
        finally:
            if not self._closed and self._loop is not None:
                self._arm()

    def use_calibration(self, model: ServiceModel, terms: LoadTerms) -> None:
        """A new calibration (``PUT /admin/calibration``): its line, and its step model where it has one (an
        upstream's learner replaces that at its next refit, unless it has settled)."""
        self.config = self.config.replace(model=model)
        if terms.step is not None:
            self.use_step_model(terms.step)

    def use_step_model(self, step: StepModel) -> None:
        """Plan with ``step`` from now on (an engine that learns its server's steps: live.upstream_batch): the next
        admission and the next step read it, and /stats's server_config says it."""
        self.queue.model = step
        self.config = replace(self.config, engine=replace(self.config.engine, step=step))
        # Planned with from the step numbered ``logged`` on: the step log's pages say it (step_page).
        self.step_models.append((self.logged, step))

    def _idle_estimate_s(self, job: Job, base: float) -> float:
        """No "never in time" here: the gate's service line is not what a batching engine's steps take, so a
        refusal keeps the core's reason (deadline_unreachable), as the simulator's."""
        return 0.0

    # -- observation ------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self.queue.queued

    @property
    def queued_work_s(self) -> float:
        return math.nan

    def health(self) -> dict:
        """Always "ok": the core has no stall rule for a batching engine (a hang ends, see the module)."""
        return {"status": "ok", "stalled": []}

    def stats(self) -> dict:
        """As the gate's, with ``batching``: the batch and its KV blocks now, the steps so far (their log
        comes a page at a time: :meth:`step_page`)."""
        engine = self.config.engine
        return {**super().stats(), "batching": {
            "running": self.queue.in_service, "max_num_seqs": engine.max_num_seqs,
            "kv_blocks_used": self.queue.kv_used, "kv_blocks": engine.kv_blocks, "block_size": engine.block_size,
            "kv_use": self.queue.kv_use, "steps": self.steps}}

    def step_page(self, since: float | None = None, cursor: int | None = None,
                  limit: int = STEP_PAGE) -> dict:
        """At most ``limit`` steps of the log, oldest first, each as [woken, began, ended, the engine's
        seconds, the step model's seconds, prefill tokens, sequences sampling, context tokens]
        (:class:`qsim.runfile.LoggedStep`) on the gate's clock: when an arrival woke the idle engine for
        it (its start where it followed a step), when the core began it, when the gate had it back (what
        ``qlab compare`` replays with), and what it computed (what ``qlab calibrate`` fits a step model
        to). The steps are those woken for at ``since`` or later
        (gate clock), or from ``cursor`` on (a number a page before answered); ``step_log_next``:
        the cursor of the next page (None: this page ends the log). A cursor is a step's number
        since the gate started, so a page never repeats or skips a step, even among steps woken at
        the same time; one older than the log holds starts at its oldest. ``step_models``: the step
        models the gate took while these steps ran (a learner's refit, a new calibration), each as
        [the steps of this page before it, b0, b1, b2, b3, cv]: it planned every step after those
        with it (:func:`qsim.runfile.batch_step_times`)."""
        oldest = self.logged - len(self.step_log)
        if cursor is not None:
            start = max(cursor - oldest, 0)
        else:  # woken times never go back (woken at or after the last one ended): bisect, no scan
            start = bisect.bisect_left(self.step_log, since, key=lambda step: step[0])  # woken
        page = self._steps(start, min(start + limit, len(self.step_log)))
        first = oldest + start
        after = first + len(page)
        models = [[at - first, *astuple(step)] for at, step in self.step_models if first < at <= after]
        return {"step_log": page, "step_log_next": after if after < self.logged else None,
                "step_models": models}

    def _steps(self, start: int, end: int) -> list[tuple]:
        """The log's steps ``start`` to ``end``, walked from its nearer end (islice walks a deque
        from its left: a page near the newest would first pass 200,000 steps)."""
        if start > len(self.step_log) // 2:
            n = len(self.step_log)
            return list(itertools.islice(reversed(self.step_log), n - end, n - start))[::-1]
        return list(itertools.islice(self.step_log, start, end))

    def log_step(self, step: LoggedStep) -> None:
        """Keep ``step`` in the log, as a plain tuple: pydantic writes a NamedTuple's JSON about
        four times slower than a tuple's, and copying a page out of its steps cost as much again
        (the JSON is the same)."""
        self.step_log.append(tuple(step))
        self.logged += 1
