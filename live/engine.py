"""Engines: what runs one request. The gate calls ``run`` from an engine thread, or awaits ``arun``
on its loop.

An engine is anything with the :class:`Engine` shape. Three exist: the GPT-2
engine (:mod:`live.gpt2`, the only module that imports torch),
:class:`SyntheticEngine`, which sleeps for the calibrated service time so the
whole harness runs on machines without a GPU, in tests and in the demo, and the
upstream engine (:mod:`live.upstream`), which forwards each request to an
OpenAI-compatible server (vLLM, or another ``qlab serve``).

Stopping a run. The gate hands ``run`` a :class:`Cancel` (``cancel=``, where the engine
declares it takes one: ``abilities = Abilities(cancel=True)``, :class:`Abilities`) and sets it when
the client of the running request leaves. An engine may stop early then and return an
:class:`EngineResult` with ``stopped=True``; the gate teaches the speed tracker nothing
from a stopped run's time. The synthetic engine waits on it instead of sleeping, GPT-2
looks at it between decoding steps, the upstream engine closes its connection at once
(:meth:`Cancel.when_set`: a thread blocked reading a socket cannot look at anything).

Streaming. An engine whose ``run`` also takes ``emit`` (an :data:`Emit`, declared like ``cancel``:
``Abilities(emit=True)``) is handed one when the client asked for a stream, and calls it in its
thread with each piece of text as it is produced: the upstream engine per upstream chunk, GPT-2 per
decoding step (the new token's text, held back while a stop string may be starting), the synthetic
engine per token (it then sleeps its run's time token by token, the same total). The pieces joined
are the result's text. An engine without ``emit`` streams its whole answer at the end.

What else a client asked. An engine whose ``run`` (or ``arun``) also takes ``asked`` (an
:class:`Asked`, declared like ``cancel``: ``Abilities(asked=True)``) is handed what the client asked
beyond the prompt, the size and the stop strings: ``min_tokens`` (the synthetic and GPT-2 engines
let no stop string end a run before that many tokens, as vLLM does), and, for the upstream engine,
the chat's messages as they came and the client's sampling fields, which it forwards unchanged.

Coroutine engines. An engine whose work is waiting on I/O (the upstream engine: a socket) may
instead define ``async def arun(prompt, max_new_tokens, stop, emit=None)`` and declare
``Abilities(coroutine=True)`` (:func:`is_coroutine_engine`). The
gate runs it as a task on its own event loop, with no thread: nothing to hand over between threads,
and ``emit`` is called on the loop. It is stopped by cancelling its task (:func:`cancellable`, which
turns a set :class:`Cancel` into that), so it takes no ``cancel``. :func:`run_coroutine` runs one
from a thread.

An upstream engine's failures are :class:`UpstreamError` (an error status, no connection,
an answer broken off) and :class:`UpstreamTimeout`; the gate tells them apart from an
engine's own failure (502 and 504 instead of 500, see :mod:`live.http_api`).

The synthetic engine also injects faults on a deterministic schedule
(:class:`Faults`, ``qlab serve --fail-every N --hang-after N --hang-for S``),
so the gate's handling of a failing or hung engine is tested through a real
server, not only in-process. A very slow engine needs no fault of its own:
``--speed-schedule 2:50`` makes it 50 x slower from 2 s on.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Awaitable, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from qsim.service import ServiceModel, SpeedSchedule, parse_schedule  # noqa: F401 (parse_schedule: re-exported)
from qsim.mixes import UsedShare
from qsim.workload import lognormal_noise

from .tokenizer import ByteTokenizer


@dataclass(frozen=True)
class Asked:
    """What a client asked of a run beyond its prompt, size and stop strings.

    min_tokens: no stop string ends the run before this many tokens are out (vLLM's ``min_tokens``;
    the engines here never stop at end-of-text, so that is all it changes). messages: a chat's
    messages as the client sent them (None: a prompt), for an engine that forwards a chat as a chat
    (the upstream engine). sampling: the client's sampling fields as (name, value) pairs, forwarded
    unchanged by the upstream engine (the synthetic and GPT-2 engines decode greedily, which every
    ``top_k`` admits).
    """

    min_tokens: int = 0
    messages: tuple[dict, ...] | None = None
    sampling: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class EngineResult:
    """What one run produced: the text, tokens generated and the engine's own seconds.

    first_token_s: seconds to the first token, where the engine sees it apart (None: it does not).
    stopped: the run was cut short because its :class:`Cancel` was set; text and tokens are what
    it had by then, and engine_s is not a service time (the gate teaches the tracker nothing from
    it). prompt_tokens: the engine's own count of the prompt (None: the gate's count,
    Job.prompt_tokens).
    """

    text: str
    tokens: int
    engine_s: float
    first_token_s: float | None = None
    stopped: bool = False
    # The prompt's tokens as the engine counted them, where that differs from the gate's count (an
    # upstream's usage.prompt_tokens, by its own tokenizer); None: the gate's count stands.
    prompt_tokens: int | None = None


class Cancel(threading.Event):
    """Set (by the gate, on its event loop) when the client of a running request left.

    An engine that polls calls ``is_set()`` or ``wait(seconds)``. One blocked in I/O registers
    a callback with :meth:`when_set`, which ``set`` runs in the setting thread: keep it short and
    non-blocking (shutting a socket down is), since that thread is the gate's event loop.
    """

    def __init__(self) -> None:
        super().__init__()
        self._callbacks_lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def set(self) -> None:
        with self._callbacks_lock:
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def when_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run ``callback`` once this is set (now, if it is already); returns a function that
        unregisters it."""
        with self._callbacks_lock:
            if not self.is_set():
                self._callbacks.append(callback)
                return partial(self._forget, callback)
        callback()
        return lambda: None

    def _forget(self, callback: Callable[[], None]) -> None:
        with self._callbacks_lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)


class UpstreamError(RuntimeError):
    """An upstream server answered an error status, could not be reached, or broke its answer off.

    failing: whether it says the upstream is failing (no connection, a broken stream, a 5xx, a
    missing route), not only this request (a 400 for its body): the upstream is then not ready
    (``GET /ready``)."""

    reason = "upstream_error"

    def __init__(self, message: str, failing: bool = True) -> None:
        super().__init__(message)
        self.failing = failing


class UpstreamTimeout(UpstreamError):
    """An upstream server sent nothing for longer than the engine's timeout."""

    reason = "upstream_timeout"


@runtime_checkable
class Engine(Protocol):
    """One request at a time; ``run`` blocks and is called from one engine thread (or, instead, a
    coroutine ``arun`` that the gate awaits on its loop: module docstring, "Coroutine engines").

    max_new_tokens_limit: the most new tokens a request may ask for (None: no
    limit of the engine's own; the service applies its cap).
    """

    max_new_tokens_limit: int | None

    # It may also take ``cancel``, ``emit`` and ``asked``, declared in ``abilities`` (module
    # docstring).
    def run(self, prompt: str, max_new_tokens: int, stop: Sequence[str] | None) -> EngineResult: ...

    def count_tokens(self, text: str) -> int: ...

    def warmup(self) -> None: ...

    def info(self) -> dict: ...


@runtime_checkable
class SelfTimed(Protocol):
    """An engine that bounds its own runs (the upstream engine: nothing received for
    ``run_timeout_s`` is a timeout). The gate's stall rule does not end its runs: one that keeps
    producing is not stalled, and a silent one ends as the engine's own timeout (504
    ``upstream_timeout``), whatever the stall settings."""

    run_timeout_s: float


@runtime_checkable
class Checked(Protocol):
    """An engine that can say whether what it depends on is there (the upstream engine: its server),
    for ``GET /ready`` and ``/healthz``: None when ready, else why not, in one line."""

    async def readiness(self) -> str | None: ...


class CounterReader(Protocol):
    """What reads a server's own counters for ``/stats`` (live.upstream.UpstreamCounters): the
    reading now on ``clock`` (the gate's), with its ``read_at``; None where it gives none."""

    async def reading(self, clock: Callable[[], float]) -> dict | None: ...


@runtime_checkable
class CountsUpstream(Protocol):
    """An engine in front of a server that counts for itself (the upstream engines: vLLM's
    ``/metrics``), for ``/stats`` ``upstream_counters``: its ``counters``, one reader shared by the
    engines of one server (so that the gate reads each server once)."""

    counters: CounterReader


@runtime_checkable
class ClosesOnLoop(Protocol):
    """An engine that holds something on the gate's event loop (the upstream engines: their HTTP
    connections) and closes it there when the gate stops: ``async def aclose()``."""

    async def aclose(self) -> None: ...


async def close_on_loop(engine) -> None:
    """Let ``engine`` close what it holds on this loop, where it holds anything
    (:class:`ClosesOnLoop`)."""
    if isinstance(engine, ClosesOnLoop):
        await engine.aclose()


@dataclass(frozen=True)
class Abilities:
    """What an engine declares it takes beyond the prompt, the size and the stop strings, as a class
    attribute ``abilities`` (an engine without one takes none of them). Declared, not probed: a
    wrapper or a ``**kwargs`` signature says nothing about what an engine does with an argument.

    cancel: ``run`` takes ``cancel=`` (a :class:`Cancel`); emit: it takes ``emit=`` (streaming);
    asked: it takes ``asked=`` (an :class:`Asked`); coroutine: it defines ``async def arun`` (or, a
    batching engine, ``async def astep``) that the gate awaits on its loop, with no thread;
    token_id_vocab: a prompt may come as token ids below it (:mod:`live.token_prompts`; None:
    text only)."""

    cancel: bool = False
    emit: bool = False
    asked: bool = False
    coroutine: bool = False
    token_id_vocab: int | None = None


NO_ABILITIES = Abilities()


def abilities_of(engine) -> Abilities:
    """What ``engine`` declares (:class:`Abilities`); nothing for an engine that declares
    nothing."""
    declared = getattr(engine, "abilities", NO_ABILITIES)
    if not isinstance(declared, Abilities):
        raise TypeError(
            f"{type(engine).__name__}.abilities is {type(declared).__name__}, "
            "not live.engine.Abilities"
        )
    return declared


def is_coroutine_engine(engine) -> bool:
    """Whether the engine runs a request as a coroutine (``async def arun``, same arguments as
    ``run`` but ``cancel``): the gate then runs it as a task on its event loop (module
    docstring)."""
    return abilities_of(engine).coroutine


#: What an engine calls, in its own thread, with each piece of text as it produces it.
Emit = Callable[[str], None]


async def cancellable(run: Awaitable[EngineResult], cancel: Cancel | None) -> EngineResult:
    """Await a coroutine engine's run in the current task; ``cancel`` set (from any thread, before
    or during the run) cancels the task's wait, and the run ends as a stopped result (the engine's
    ``async with`` blocks have closed what they held: the upstream engine's connection)."""
    began = time.perf_counter()
    if cancel is None:
        return await run
    task, loop = asyncio.current_task(), asyncio.get_running_loop()

    def stop() -> None:
        try:
            # the setting thread may be the loop's own or another
            loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:
            pass  # the loop has closed: the run is over

    forget = cancel.when_set(stop)
    try:
        return await run
    except asyncio.CancelledError:
        if not cancel.is_set():
            raise  # cancelled by someone else (the gate closing): not a stopped run
        task.uncancel()
        return EngineResult("", 0, time.perf_counter() - began, stopped=True)
    finally:
        forget()


def run_coroutine(
    make: Callable[[], Awaitable[EngineResult]], cancel: threading.Event | None = None
) -> EngineResult:
    """A coroutine engine's run called from a thread (tests, scripts): on an event loop of its own.
    A
    :class:`Cancel` stops it at once; a plain Event is looked at before the run only."""
    if cancel is not None and cancel.is_set():
        return EngineResult("", 0, 0.0, stopped=True)

    async def main() -> EngineResult:
        return await cancellable(make(), cancel if isinstance(cancel, Cancel) else None)

    return asyncio.run(main())


class PieceFeed:
    """Hands ``emit`` the new part of a text that grows as decoding goes, holding back its last
    ``hold`` characters (where a stop string may be starting) and a character whose bytes are not
    all there yet."""

    def __init__(self, emit: Emit, hold: int = 0) -> None:
        self.emit, self.hold, self.sent = emit, hold, 0

    def grow(self, text: str, final: bool = False) -> None:
        end = len(text) if final else len(text) - self.hold
        # a partial UTF-8 sequence decoded
        while not final and end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        if end > self.sent:
            self.emit(text[self.sent : end])
            self.sent = end


def apply_stop(
    text: str, stop: Sequence[str] | None, search_from: int = 0, ends_after: int = 0
) -> str | None:
    """Text cut before the earliest stop string found at or after ``search_from`` that ends past the
    first ``ends_after`` characters (the text of a request's ``min_tokens``); None if none is found.

    The stop string itself is not part of the answer.
    """
    if not stop:
        return None
    hits = [
        i for i in (text.find(s, max(search_from, ends_after - len(s) + 1)) for s in stop) if i >= 0
    ]
    return text[: min(hits)] if hits else None


#: The synthetic engine's text: this word once per token.
WORD = " tok"


def _waited_out(cancel: threading.Event | None, seconds: float) -> bool:
    """Sleep ``seconds``; True if ``cancel`` was set first (the sleep then ends at once)."""
    if cancel is None:
        time.sleep(seconds)
        return False
    return cancel.wait(seconds)


class InjectedFault(RuntimeError):
    """What a synthetic engine raises on a run its :class:`Faults` schedule fails."""


@dataclass(frozen=True)
class Faults:
    """Which runs of one engine go wrong; runs count from 1, in the order the engine gets them.

    fail_every: run n raises :class:`InjectedFault` at once when n is a multiple of it (0: never),
        as an engine that refuses its input (or runs out of memory) before doing any work.
    hang_after: run hang_after + 1 blocks for hang_s before doing its work (None: never), as a
        wedged driver or a deadlock would; hang_s None blocks until the process ends.
    """

    fail_every: int = 0
    hang_after: int | None = None
    hang_s: float | None = None

    def __post_init__(self) -> None:
        if self.fail_every < 0:
            raise ValueError(f"fail_every must be >= 0, got {self.fail_every}")
        if self.hang_after is not None and self.hang_after < 0:
            raise ValueError(f"hang_after must be >= 0, got {self.hang_after}")
        if self.hang_s is not None and not (self.hang_s > 0 and math.isfinite(self.hang_s)):
            raise ValueError(f"hang_s must be a positive number of seconds, got {self.hang_s}")

    def fails(self, n: int) -> bool:
        return self.fail_every > 0 and n % self.fail_every == 0

    def hangs(self, n: int) -> bool:
        return self.hang_after is not None and n == self.hang_after + 1

    def info(self) -> dict:
        return {"fail_every": self.fail_every, "hang_after": self.hang_after, "hang_s": self.hang_s}


class SyntheticEngine:
    """Sleeps the service model's estimate x speed (x optional lognormal noise).

    speed > 1 is a slower machine. ``schedule`` changes the speed at given
    seconds since construction (the machine slowing down mid-run). The text is
    ``tokens`` copies of one word, so its length follows the request.
    ``faults`` makes given runs raise or hang (see :class:`Faults`). A run's ``cancel``
    ends its wait at once (``stopped``); a hang does not listen, as a wedged driver would not.
    ``early_stops`` (a :class:`qsim.mixes.UsedShare`, ``qlab serve --early-stops``): each run
    generates a share of its limit drawn from it, as if a stop string ended it, and takes the time
    of the tokens it generated (what a learning estimator learns); None: every run generates its
    limit. ``replica_speed``: a fleet's replica's speed over the server's (``qlab serve
    --replica-speeds``; 0.5: each run takes twice as long), as the simulator's replica_speeds.
    """

    abilities = Abilities(cancel=True, emit=True, asked=True)

    max_new_tokens_limit = None

    def __init__(
        self,
        model: ServiceModel = ServiceModel(),
        speed: float = 1.0,
        noise_cv: float = 0.0,
        seed: int = 0,
        schedule: Sequence[tuple[float, float]] = (),
        clock=time.monotonic,
        faults: Faults = Faults(),
        early_stops: UsedShare | None = None,
        replica_speed: float = 1.0,
    ) -> None:
        if noise_cv < 0:
            raise ValueError(f"noise_cv must be >= 0, got {noise_cv}")
        if not replica_speed > 0:
            raise ValueError(f"replica_speed must be > 0, got {replica_speed}")
        # x 1 / speed, as the simulator's run: the same operations, the same seconds
        self.slow = 1.0 / float(replica_speed)
        self.model = model
        self.speed = SpeedSchedule(float(speed), tuple((float(t), float(s)) for t, s in schedule))
        self.noise_cv = float(noise_cv)
        self._rng = np.random.default_rng(seed)
        # an engine is normally used by one thread; be safe anyway
        self._rng_lock = threading.Lock()
        self._clock = clock
        self._started = clock()
        self._tokenizer = ByteTokenizer()
        self.faults = faults
        self.early_stops = early_stops
        self._runs = 0  # under _rng_lock
        self._never = threading.Event()  # never set: what a hang waits on

    def duration_s(self, max_new_tokens: int, prompt_tokens: int = 0) -> float:
        """Seconds the next run of this size will take (draws the noise); the model's prompt term
        counts the prompt's tokens under this engine's tokenizer (bytes)."""
        speed = self.speed.at(self._clock() - self._started)
        with self._rng_lock:
            noise = float(lognormal_noise(self._rng, 1, self.noise_cv)[0])
        return float(self.model.estimate(max_new_tokens, prompt_tokens)) * speed * noise * self.slow

    def run(
        self,
        prompt: str,
        max_new_tokens: int,
        stop: Sequence[str] | None = None,
        cancel: threading.Event | None = None,
        emit: Emit | None = None,
        asked: Asked = Asked(),
    ) -> EngineResult:
        start = time.perf_counter()
        with self._rng_lock:
            self._runs += 1
            n = self._runs
        if self.faults.fails(n):
            raise InjectedFault(
                f"injected failure on run {n} (fail every {self.faults.fail_every})"
            )
        if self.faults.hangs(n):
            self._never.wait(self.faults.hang_s)  # a wedged driver: deaf to cancel too
        generated = max_new_tokens
        if self.early_stops is not None:
            # two draws per run, after the noise's: the same seed gives the same runs
            with self._rng_lock:
                generated = int(self.early_stops.draw(self._rng, [max_new_tokens])[0])
            # no early end before min_tokens
            generated = max(generated, min(asked.min_tokens, max_new_tokens))
        prompt_tokens = self.count_tokens(prompt)
        duration = self.duration_s(generated, prompt_tokens)
        text = WORD * generated
        cut = apply_stop(text, stop, ends_after=len(WORD) * min(asked.min_tokens, generated))
        # The sleep is for every token generated: a stop string given by the client shortens the
        # text, not the work.
        text = text if cut is None else cut
        if emit is not None and generated > 0:
            return self._stream(text, generated, prompt_tokens, duration, start, cancel, emit)
        # the client left, or its deadline passed: the rest of the work is not done
        if _waited_out(cancel, duration):
            return EngineResult("", 0, time.perf_counter() - start, stopped=True)
        return EngineResult(text, generated, time.perf_counter() - start)

    def _stream(
        self,
        text: str,
        generated: int,
        prompt_tokens: int,
        duration: float,
        start: float,
        cancel: threading.Event | None,
        emit: Emit,
    ) -> EngineResult:
        """The run's time token by token: each token the model's per-token share of it, the rest
        (intercept, prompt) before the first; each token's text is emitted when its time is up. Each
        wait runs to the token's time since the start, so that the sleeps' overshoots do not add up:
        the run takes its time."""
        estimate = float(self.model.estimate(generated, prompt_tokens))
        step = (
            duration * self.model.per_token_s / estimate if estimate > 0 else duration / generated
        )
        first_s = None
        for i in range(generated):
            # seconds since the start at which token i is out
            due = duration - step * (generated - 1 - i)
            if _waited_out(cancel, max(0.0, due - (time.perf_counter() - start))):
                return EngineResult(
                    text[: len(WORD) * i], i, time.perf_counter() - start, first_s, stopped=True
                )
            first_s = time.perf_counter() - start if first_s is None else first_s
            piece = text[len(WORD) * i : len(WORD) * (i + 1)]  # empty past a stop string's cut
            if piece:
                emit(piece)
        return EngineResult(text, generated, time.perf_counter() - start, first_s)

    def count_tokens(self, text: str) -> int:
        return self._tokenizer.count(text)

    def warmup(self) -> None:
        """Nothing to warm: sleeping needs no kernels or caches."""

    def info(self) -> dict:
        return {
            "engine": "synthetic",
            "intercept_s": self.model.intercept_s,
            "per_token_s": self.model.per_token_s,
            "per_prompt_token_s": self.model.per_prompt_token_s,
            "speed": self.speed.base,
            "schedule": [list(step) for step in self.speed.steps],
            # The engine's clock (the gate's: time.monotonic) when the schedule's seconds began: a
            # run file maps the schedule onto its own clock with it, so that qlab compare simulates
            # the same change.
            "schedule_started_at": self._started,
            "noise_cv": self.noise_cv,
            "early_stops": None if self.early_stops is None else asdict(self.early_stops),
            "tokenizer": self._tokenizer.name,
            **({"faults": self.faults.info()} if self.faults != Faults() else {}),
        }
