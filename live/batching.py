"""Engines that batch: the step protocol (:class:`StepWork` in, :class:`StepDone` back,
:class:`BatchEngine`) and the synthetic batching engine; :func:`live.gate.BatchGate` makes the
gate in front of one.

The gate (:class:`live.gate.Gate`) drives a batching engine through its batching driver
(:class:`live.drive_batch.BatchDriver`) and :class:`qsim.batch.BatchQueue`, the core the
simulator's batching run (``qsim.run_batching.BatchingRun``) drives on SimPy's clock, so admission,
batch membership, KV blocks, preemption and cuts at the deadline follow one set of rules in both:

* arrival (:meth:`Gate.submit`): the core admits (into the batch at once, where it has a seat and
  blocks and nobody waits) or refuses;
* the core plans a step: the gate hands the engine a :class:`StepWork` (who computes how much of
  their prompt, who decodes, the step's shape: with a prefix cache, ``--prefix-caching``, only the
  prompt tokens not found cached, :class:`HasTokenIds`) and the engine runs it
  (:class:`SyntheticBatchEngine`: a sleep of its step model's time), then hands back a
  :class:`StepDone`; the core ends the requests the step finished (good or late, by the gate's
  clock) and plans the next;
* a client leaves: its request leaves the line or the batch (its blocks free for the next step);
* a cut ends the request at its deadline (:class:`~live.gate_errors.DeadlineCut`, 504), as the
  simulator's.

An engine's steps run as a task on the loop (a coroutine engine, ``astep``, declared by
``abilities = Abilities(coroutine=True)``) or on one engine thread (``step``) that posts the result
back (:class:`live.engine_workers.Worker`); waiting requests are futures, never threads.

Faults. The synthetic engine's schedule (:class:`live.engine.Faults`) applies to requests and
steps: with ``fail_every`` N, the Nth request to join the batch (counting from 1) fails at the end
of its first step (outcome error, ``engine_exception``; it leaves the batch, its blocks free); with
``hang_after`` N, step N + 1 takes ``hang_s`` longer (the whole batch waits: a wedged driver). A
batching engine has no stall rule in the core, so a hang must end: ``qlab serve`` refuses one
without ``--hang-for``. A speed schedule multiplies each step's time by the speed at its start, as
``simulate(speed_schedule=)`` does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

from qsim.engines import StepModel
from qsim.prefix import ANSWER_VOCAB, TokenIds
from qsim.run_batching import step_noise
from qsim.service import SpeedSchedule

from .engine import WORD, Abilities, Faults, InjectedFault, abilities_of, apply_stop
from .jobs import Job
from .tokenizer import ByteTokenizer


#: Steps a batching gate remembers for ``GET /stats?steps_since=`` (about half an hour at 100 steps
#: a second).
STEP_LOG = 200_000
#: The most steps one answer of ``GET /stats`` holds (and how many unless it asks for fewer): a
#: full log in one answer was 17 MB and held the event loop over a second; a page is under half a
#: megabyte.
STEP_PAGE = 5_000


class Chunk(NamedTuple):
    """A request computing part of its prompt in a step: ``tokens`` of them from ``start`` (those it
    had computed before this step: 0 for its first chunk, or the first after a preemption, which
    computes its prompt and what it had generated again)."""

    key: object
    job: Job
    start: int
    tokens: int


@dataclass(frozen=True)
class StepWork:
    """One step as the gate hands it to a batching engine.

    prefill: a :class:`Chunk` for each request computing its prompt (a request preempted, recompute,
    comes back here from its first token, to compute its prompt and what it had generated). decode:
    the keys of the requests that compute one token each; completing: the keys among prefill whose
    prompt completes in this step (each produces a token, as each of decode does). ended: the keys
    that left the batch for good since the last step (answered, cut, failed, or their client left):
    the engine may forget them. The step's shape, as the step model reads it: prefill_tokens,
    sampling (the requests that produce a token), context (KV tokens held); model_s: the gate's step
    model's seconds for it (its calibration, not the engine's truth). A key is the gate's handle of
    a request: hashable, compared by identity."""

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
    """What a step did: the engine's own seconds for it (what the speed tracker learns); failed: the
    requests that failed in it, key -> the exception (they leave the batch as errors); pieces: key
    -> the text of the token it produced, for the streamed requests (``job.stream``), which the gate
    hands to their clients as they come."""

    engine_s: float
    failed: Mapping[object, BaseException] = field(default_factory=dict)
    pieces: Mapping[object, str] = field(default_factory=dict)
    # key -> tokens generated, for the requests the engine ended before the core's count of their
    # tokens (an upstream server's end of text: live.upstream_batch): they finish at this step.
    finished: Mapping[object, int] = field(default_factory=dict)
    # key -> the prompt's tokens as the engine counted them, once it knows (an upstream's usage):
    # what the request's client is told, where the gate's own count differs.
    prompt_tokens: Mapping[object, int] = field(default_factory=dict)
    # A step model the engine learned in this step (live.upstream_batch): the gate plans with it
    # from the next step on, which is when a replay takes it too (the step log says after which
    # step).
    step_model: StepModel | None = None


@runtime_checkable
class BatchEngine(Protocol):
    """An engine that runs requests together, one step at a time: ``step(work) -> StepDone`` (called
    from one engine thread) or ``async def astep(work) -> StepDone`` (a task on the gate's loop; it
    declares ``abilities = Abilities(coroutine=True)``, :class:`live.engine.Abilities`). ``text(key,
    job, tokens)`` is the answer of a request that generated ``tokens`` tokens (called on the loop
    when it ends)."""

    max_new_tokens_limit: int | None

    def text(self, key, job: Job, tokens: int) -> str: ...

    def count_tokens(self, text: str) -> int: ...

    def warmup(self) -> None: ...

    def info(self) -> dict: ...


@runtime_checkable
class Releases(Protocol):
    """A batching engine that holds something outside the gate for each request (an upstream's
    stream), and lets it go as soon as the request is cut or its client leaves, rather than at the
    next step (which an idle batch may not have for a while): ``release(key)``, on the loop."""

    def release(self, key) -> None: ...


@runtime_checkable
class HasTokenIds(Protocol):
    """A batching engine whose KV blocks the gate's core can model with a prefix cache
    (``qlab serve --prefix-caching``): ``token_ids(job)`` is the request's tokens as ids
    (:class:`qsim.prefix.TokenIds`: its prompt's, then its answer's), and its steps compute only
    the prompt tokens the plan gives them (a cached prefix is not computed again)."""

    def token_ids(self, job: Job) -> TokenIds: ...


def is_batch_engine(engine) -> bool:
    """Whether ``engine`` runs steps (:class:`BatchEngine`: ``step`` or ``astep``) rather than
    one request a run."""
    steps = "astep" if abilities_of(engine).coroutine else "step"
    return isinstance(engine, BatchEngine) and callable(getattr(engine, steps, None))


class SyntheticBatchEngine:
    """A batching engine that sleeps each step for its step model's time (x speed, x noise): a real
    step loop on the server, so a real HTTP service with real batching runs wherever qlab does.

    The step's time is ``step.time(prefill tokens, sampling, context)`` of the :class:`StepWork`,
    times a gamma draw of mean 1 and the model's ``cv`` (where > 0; drawn from ``seed`` as the
    simulator draws its steps', so a run on a virtual clock is the simulator's step by step), times
    the speed at the step's start (``speed`` and ``schedule``, seconds since construction on
    ``clock``). ``faults``: see the module. ``replica``: which replica of a fleet it is (its noise:
    that replica's stream, qsim.run_batching.step_noise); ``replica_speed``: its speed over the
    server's (``qlab serve --replica-speeds``: each step takes 1 / it times as long, as the
    simulator's replica_speeds). The text is one word per token generated, cut at a stop string
    (which shortens the text, not the work)."""

    # A prompt may come as token ids from ANSWER_VOCAB (live.token_prompts): its answers' ids
    # are drawn from it (qsim.prefix.answer_ids), so a conversation's turn may carry them.
    abilities = Abilities(coroutine=True, token_id_vocab=ANSWER_VOCAB)

    max_new_tokens_limit = None

    def __init__(
        self,
        step: StepModel = StepModel(),
        speed: float = 1.0,
        seed: int = 0,
        schedule: Sequence[tuple[float, float]] = (),
        clock: Callable[[], float] = time.monotonic,
        faults: Faults = Faults(),
        replica: int = 0,
        replica_speed: float = 1.0,
    ) -> None:
        if not replica_speed > 0:
            raise ValueError(f"replica_speed must be > 0, got {replica_speed}")
        self.slow = 1.0 / float(replica_speed)
        self.model = step
        self.speed = SpeedSchedule(float(speed), tuple((float(t), float(s)) for t, s in schedule))
        self.seed = seed
        self.faults = faults
        self._clock = clock
        self._started = clock()
        self.replica = replica
        # The simulator's stream for this replica's steps: the same draws, in step order.
        self._noise = step_noise(step.cv, seed, replica)
        self._tokenizer = ByteTokenizer()
        # the requests in the batch (or preempted) that it has counted as runs
        self._seen: set = set()
        self.runs = 0  # requests that joined, in order: what fail_every counts
        self.steps = 0
        # key -> [job, tokens streamed so far], for the streamed requests in the batch
        self._streamed: dict = {}

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
                    failed[key] = InjectedFault(
                        f"injected failure on request {self.runs} of the "
                        "batch "
                        f"(fail every {self.faults.fail_every})"
                    )
                elif job.stream:
                    self._streamed[key] = [job, 0]
        return failed

    def _pieces(self, work: StepWork) -> dict:
        """Each streamed request's token of this step: its share of the text it ends with (every run
        generates its limit), so that the pieces joined are the answer's text, a stop string's cut
        included."""
        pieces = {}
        for key in (*work.decode, *work.completing):
            streamed = self._streamed.get(key)
            if streamed is None:
                continue
            job, i = streamed
            streamed[1] = i + 1
            piece = self.text(key, job, job.max_new_tokens)[len(WORD) * i : len(WORD) * (i + 1)]
            if piece:  # empty past a stop string's cut
                pieces[key] = piece
        return pieces

    def duration_s(self, work: StepWork) -> float:
        """The step's seconds (draws the noise): the model, x noise, x the speed at its start, x
        1 / its replica's speed (that order: the simulator's)."""
        run = self.model.time(work.prefill_tokens, work.sampling, work.context)
        if self._noise is not None:
            run *= self._noise()
        return run * self.speed.at(self._clock() - self._started) * self.slow

    async def astep(self, work: StepWork) -> StepDone:
        began = self._clock()
        self.steps += 1
        failed = self._faulty(work)
        if self.faults.hangs(self.steps):
            await asyncio.sleep(self.faults.hang_s)  # a wedged driver: the whole batch waits
        await asyncio.sleep(self.duration_s(work))
        return StepDone(self._clock() - began, failed, self._pieces(work))

    def token_ids(self, job: Job) -> TokenIds:
        """The request's tokens as ids (:class:`HasTokenIds`): its prompt's as sent, else its
        text's bytes (the engine's tokenizer), then its answer's, a run seeded from its prompt's
        ids (:func:`qsim.prefix.answer_ids`: the same prompt, the same answer)."""
        ids = job.prompt_ids
        return TokenIds.of(self._tokenizer.encode(job.prompt) if ids is None else ids)

    def text(self, key, job: Job, tokens: int) -> str:
        text = WORD * tokens
        cut = apply_stop(text, job.stop, ends_after=len(WORD) * min(job.asked.min_tokens, tokens))
        return text if cut is None else cut

    def count_tokens(self, text: str) -> int:
        return self._tokenizer.count(text)

    def warmup(self) -> None:
        """Nothing to warm: sleeping needs no kernels or caches."""

    def info(self) -> dict:
        return {
            "engine": "synthetic",
            "batching": True,
            "step": asdict(self.model),
            "speed": self.speed.base,
            "schedule": [list(step) for step in self.speed.steps],
            # The engine's clock when the schedule's seconds began (as the one-at-a-time
            # engine's info says).
            "schedule_started_at": self._started,
            "seed": self.seed,
            "tokenizer": self._tokenizer.name,
            "token_id_vocab": self.abilities.token_id_vocab,
            **({"faults": self.faults.info()} if self.faults != Faults() else {}),
        }
