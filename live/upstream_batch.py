"""The upstream engine in front of a batching server, and the step model it learns from what the
server streams.

``qlab serve --engine upstream --upstream-url URL --batching`` puts a :func:`live.gate.BatchGate` in
front of an OpenAI-compatible server that batches (vLLM, SGLang, another ``qlab serve --batching``):
the gate's batching core (:class:`qsim.batch.BatchQueue`, the simulator's) decides who is admitted,
who is in the batch (at most ``max_num_seqs``: ``--max-num-seqs``, else what the upstream's ``GET
/stats`` says of its own batch, else vLLM's default), and plans with a step model, the one
:class:`StepLearner` learns; :class:`UpstreamBatchEngine` runs the core's steps by forwarding:

* a request that joins the batch (its first prefill chunk in a step) is forwarded at once, streamed,
  as the one-at-a-time upstream engine forwards it (:class:`live.upstream.UpstreamEngine`: the same
  routes, bodies, failures and readiness), on a session of up to ``max_num_seqs`` connections;
* a step is over when every request that the core says produces a token in it (decoding, or
  completing its prompt) has had its next chunk of text from the upstream, or its stream has ended:
  the gate's steps follow the upstream's, token by token, and a streamed client gets each chunk as
  its step ends. The step's seconds the speed tracker learns from are the upstream's (the gap
  between the chunks it took and the ones before, 0: none);
* a stream that ends before the core's count (end of text, a stop string at the upstream) finishes
  its request at that step (:meth:`qsim.batch.BatchQueue.finish`); one that fails fails its request
  (outcome error, as the upstream engine's failures); a request cut at its deadline or whose client
  left has its stream closed at once (:class:`live.batching.Releases`), so the upstream frees its
  slot;
* the answer's text is what the upstream sent.

Learning the step model (:class:`StepLearner`). The gate sees no step of the upstream, only when
each chunk of each streamed answer arrives. A server that batches ends a step with one token for
every sequence it runs, written together: the chunks of all answers fall in bursts, one a step
(chunks closer than :data:`BURST_SHARE` of the median gap between one answer's chunks are one burst;
the gate reads a burst within a fraction of a millisecond, a step is tens of them). A burst is what
the steps since the burst before computed: each answer with a chunk in it ran in them (``seqs``),
one whose *first* chunk is in it computed its prompt in them (``prefill``: its prompt tokens), and
each held its prompt and the tokens it had (``context``: the mean over those steps). A chunk of
``k`` tokens (``usage``'s count: a loaded vLLM's API server writes the tokens of several steps in
one chunk when it falls behind its engine) spans ``k`` steps of its answer, so a burst whose chunks
carry ``k`` tokens stands for ``k`` steps: its row is their mean (each term's sum over the answers'
own steps, over ``k``; seconds the median gap of the answers with a chunk in both bursts and ``k``
tokens, over ``k``). A burst with no such answer followed an idle server and is left out, as is one
where an answer has two chunks, one :data:`PAUSE` times the median step or longer, and the answers
whose ``usage.completion_tokens`` says more tokens than their chunks counted (tokens the gate cannot
place). The four coefficients are then :meth:`qsim.engines.StepModel.fit`'s (non-negative least
squares), the CV the spread of the steps around the fit.

The rule (a checkpoint, documented in docs/live.md): after every :data:`REFIT_EVERY` new gaps
between two chunks of an answer, once :data:`MIN_GAPS` steps have been read at two batch sizes at
least, the model is fitted again on the last :data:`WINDOW` steps and replaces the gate's at once
(its next admission and next step read it:
:meth:`live.drive_batch.BatchDriver.use_step_model`, from the step after the one that fitted it);
until the first fit the gate plans with ``--step`` (or its default). The learner settles: once
:data:`SETTLE` fits in a row each fall inside the 95 % intervals of the fit before (every
coefficient within 1.96 of its standard errors), more fits would only move the estimates within
their own uncertainty, and it stops refitting; at each later checkpoint it only checks the settled
model against the last steps, and a median error :data:`DRIFT` times the fit's own (the server's
speed moved) starts the fits again. ``/stats`` says the model in use (``server_config``) and the
learner's state (``engine.learned``: the fit, its errors, its intervals, whether it converged, how
many gaps, refits and drifts). Prompt tokens are the gate's count (the byte tokenizer): the same as
a ``qlab serve`` upstream's; another server's tokenizer makes ``b1`` per byte, not per token of its
own (the gate plans with its own count: it sees the upstream's only once a request ran).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from statistics import NormalDist
from dataclasses import asdict, dataclass, field
from typing import Callable

import aiohttp
import httpx
import numpy as np


from qsim.engines import STEP_FIELDS, StepFit, StepModel

from .batching import StepDone, StepWork
from .engine import Abilities, EngineResult, UpstreamError
from .jobs import Job
from .upstream import ChunkRead, UpstreamEngine, UpstreamSpec

#: The step model's coefficients, in the order of a fit's standard errors.
COEFFICIENTS = STEP_FIELDS[:4]

#: New gaps between two chunks of an answer between two fits of the step model.
REFIT_EVERY = 200
#: Steps read (at two batch sizes at least) before the first fit replaces the given model.
MIN_GAPS = 50
#: The last steps a fit reads: the server's speed now, not an hour ago.
WINDOW = 4000
#: Answers the learner keeps the chunk times of (enough to hold WINDOW gaps of short answers).
KEPT_ANSWERS = 2000


@dataclass
class Timeline:
    """One forwarded answer as the learner sees it: its prompt tokens and the arrival of each
    chunk of text."""

    prompt: int
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # each chunk's tokens; empty: one a chunk
    counted: bool = True  # False: usage said more tokens than its chunks counted

    def chunk_tokens(self) -> np.ndarray:
        return np.asarray(self.tokens if self.tokens else [1] * len(self.times), float)


@dataclass(frozen=True)
class Gaps:
    """Steps read off the chunk times: for each, the prefill tokens, sequences, context tokens
    and seconds."""

    prefill: np.ndarray
    seqs: np.ndarray
    context: np.ndarray
    seconds: np.ndarray

    def __len__(self) -> int:
        return len(self.seconds)


#: Chunks of different answers closer than this share of the median gap between one answer's chunks
#: belong to one step of the server (it writes a step's tokens together; the gate reads them within
#: a fraction of a millisecond).
BURST_SHARE = 0.25
#: Gaps between one answer's chunks shorter than this are left out of the median that sets the
#: bursts: they are events of one read of the stream (a read hands the gate its events within
#: microseconds; no decode step is this short), and where most are, the median would be theirs, not
#: a step's.
READ_S = 0.0005
#: A "step" this many times the median step is a pause of the server (a hang, a stop of the world),
#: not a step.
PAUSE = 10.0


def gaps_of(timelines: list[Timeline], window: int = WINDOW) -> Gaps:
    """The last ``window`` rows of steps that the answers' chunk times show (see the module)."""
    kept = [t for t in timelines if t.counted and t.times]
    own = np.concatenate([np.diff(t.times) for t in kept] or [np.zeros(0)])
    own = own[own > READ_S]
    rows = []
    if len(own):
        # Bursts: a server step's chunks, split where the time between two chunks is a real gap.
        tau = BURST_SHARE * float(np.median(own))
        kept = [_delivered(t, tau) for t in kept]
        times = np.concatenate([t.times for t in kept])
        rid = np.concatenate([np.full(len(t.times), i) for i, t in enumerate(kept)])
        steps = np.concatenate([t.tokens for t in kept])
        before = np.concatenate([np.cumsum(t.tokens) - t.tokens for t in kept])
        prompt = np.array([t.prompt for t in kept], float)[rid]
        order = np.argsort(times, kind="stable")
        chunks = _Chunks(times[order], rid[order], steps[order], before[order], prompt[order])
        burst = np.concatenate([[0], np.cumsum(np.diff(chunks.times) > tau)])
        rows = _steps(chunks, burst, window)
    a = np.array(rows, float).reshape(-1, 4)
    if len(a):
        a = a[a[:, 3] <= PAUSE * np.median(a[:, 3])]
    return Gaps(a[:, 0], a[:, 1], a[:, 2], a[:, 3])


@dataclass(frozen=True)
class _Delivered:
    """One answer's chunks as the server delivered them: when, and how many tokens each."""

    prompt: int
    times: np.ndarray
    tokens: np.ndarray


def _delivered(timeline: Timeline, tau: float) -> _Delivered:
    """Chunks of one answer closer than ``tau`` came in one read (the server wrote several steps'
    tokens before the gate read them): one delivery, at the last one's time, of all their tokens."""
    times, tokens = np.asarray(timeline.times, float), timeline.chunk_tokens()
    last = np.append(np.diff(times) > tau, True)  # each delivery's last chunk
    group = np.concatenate([[0], np.cumsum(last[:-1])])
    return _Delivered(timeline.prompt, times[last], np.bincount(group, weights=tokens))


@dataclass(frozen=True)
class _Chunks:
    """Every chunk of the kept answers in the order they came: when, whose, its tokens (the steps it
    spans), the tokens its answer had before it, and its answer's prompt tokens."""

    times: np.ndarray
    rid: np.ndarray
    steps: np.ndarray
    before: np.ndarray
    prompt: np.ndarray


def _steps(
    chunks: _Chunks, burst: np.ndarray, window: int
) -> list[tuple[float, float, float, float]]:
    """One row per burst that follows the burst before it: each answer in it has one chunk there,
    and some answer has its previous chunk in the burst before (the server was busy in between, not
    idle). The burst stands for the ``k`` steps its chunks span (the most tokens of those answers');
    its row is their mean."""
    bounds = np.flatnonzero(np.diff(burst)) + 1
    starts, ends = np.concatenate([[0], bounds]), np.concatenate([bounds, [len(chunks.times)]])
    rows, last = [], {}
    for lo, hi in zip(starts, ends):
        part = slice(lo, hi)
        who = chunks.rid[part].tolist()
        now = dict(zip(who, chunks.times[part].tolist()))
        if len(now) == len(who):  # an answer with two chunks in a burst: not one step's
            went = [
                (now[r] - last[r], k)
                for r, b, k in zip(who, chunks.before[part], chunks.steps[part])
                if b >= 1 and r in last
            ]
            if went:
                # The steps since the burst before: an answer that ran in all of them has k tokens
                # here (one that ended among them fewer, and its chunk waited for the rest); the
                # mean of each term is then its sum over the answers' own steps over k.
                k = max(k for _, k in went)
                steps = chunks.steps[part]
                first = chunks.before[part] == 0
                # An answer's mean context over its steps: its prompt, its tokens before, (steps +
                # 1) / 2.
                context = chunks.prompt[part] + chunks.before[part] + (steps + 1) / 2
                rows.append(
                    (
                        float(chunks.prompt[part][first].sum()) / k,
                        float(steps.sum()) / k,
                        float((context * steps).sum()) / k,
                        float(np.median([g for g, n in went if n == k])) / k,
                    )
                )
        last = now
    return rows[-window:]


class StepLearner:
    """Learns the upstream's step model from its answers' chunk times (module docstring: what,
    and when)."""

    def __init__(
        self,
        initial: StepModel,
        refit_every: int = REFIT_EVERY,
        min_gaps: int = MIN_GAPS,
        window: int = WINDOW,
    ) -> None:
        self.model = initial
        self.refit_every, self.min_gaps, self.window = refit_every, min_gaps, window
        self.timelines: deque[Timeline] = deque(maxlen=KEPT_ANSWERS)
        self.fit: StepFit | None = None
        self.refits = 0
        self.gaps_seen = 0
        self._since_fit = 0
        # why the last checkpoint kept the model (None: it did not, or none yet)
        self.last_problem: str | None = None
        self.settled = 0  # fits in a row inside the intervals of the one before
        self.drifts = 0  # times a settled model stopped fitting the steps, and the fits began again
        self.drift_error: float | None = None  # the settled model's median error on the last steps

    def started(self, prompt_tokens: int) -> Timeline:
        timeline = Timeline(prompt_tokens)
        self.timelines.append(timeline)
        return timeline

    def chunk(self, timeline: Timeline, at: float, tokens: int = 1) -> None:
        """A chunk of ``tokens`` tokens came at ``at``: it spans that many steps of its answer."""
        timeline.times.append(at)
        timeline.tokens.append(tokens)
        if len(timeline.times) > 1:
            self.gaps_seen += 1
            self._since_fit += 1

    @staticmethod
    def ended(timeline: Timeline, tokens: int) -> None:
        """The answer's tokens as the upstream counted them (``usage``, else its chunks): more than
        its chunks counted (a server that says its count only at the end) leaves tokens the gate
        cannot place."""
        if tokens > timeline.chunk_tokens().sum():
            timeline.counted = False

    def checkpoint(self) -> StepModel | None:
        """The refitted model when a fit is due and the gaps allow one (module docstring), else
        None. Once settled, no fit: only a check that the steps still follow the model (a drift
        starts the fits again)."""
        if self._since_fit < self.refit_every:
            return None
        self._since_fit = 0
        gaps = gaps_of(list(self.timelines), self.window)
        if self.converged:
            self._check_drift(gaps)
            return None
        if len(gaps) < self.min_gaps or len(np.unique(gaps.seqs)) < 2:
            self.last_problem = (
                f"{len(gaps)} steps read at {len(np.unique(gaps.seqs))} batch "
                "size(s): "
                f"a fit needs {self.min_gaps} at two sizes at least"
            )
            return None
        try:
            fit = StepModel.fit(gaps.prefill, gaps.seqs, gaps.context, gaps.seconds)
            model = fit.calibrated
        except ValueError as exc:  # every coefficient 0: no step would take time
            self.last_problem = str(exc)
            return None
        within = self.fit is not None and inside(fit.model, self.fit)
        self.settled = self.settled + 1 if within else 0
        self.fit, self.model, self.last_problem = fit, model, None
        self.refits += 1
        return model

    @property
    def converged(self) -> bool:
        """:data:`SETTLE` fits in a row each inside the one before's intervals: refitting would only
        move the estimates within their own uncertainty."""
        return self.settled >= SETTLE

    def _check_drift(self, gaps: Gaps) -> None:
        """The settled model against the steps since the last checkpoint: a median error
        :data:`DRIFT` times the fit's own starts the fits again (the server's speed moved)."""
        last = slice(-self.refit_every, None)
        if not len(gaps):
            return
        model = self.fit.model
        predicted = np.array(
            [
                model.time(p, q, c)
                for p, q, c in zip(gaps.prefill[last], gaps.seqs[last], gaps.context[last])
            ]
        )
        error = float(np.median(np.abs(gaps.seconds[last] / predicted - 1)))
        self.drift_error = error
        if error > DRIFT * max(self.fit.median_rel_error, 0.01):
            self.settled, self.drifts = 0, self.drifts + 1

    def intervals(self) -> dict[str, list[float | None]] | None:
        """The fit's 95 % intervals of b0 ... b3 (None bounds: a term the steps did not vary)."""
        if self.fit is None:
            return None
        return {
            name: _interval(getattr(self.fit.model, name), se)
            for name, se in zip(COEFFICIENTS, self.fit.se)
        }

    def info(self) -> dict:
        fit = self.fit
        return {
            "step": asdict(self.model),
            "refits": self.refits,
            "gaps_seen": self.gaps_seen,
            "refit_every": self.refit_every,
            "min_gaps": self.min_gaps,
            "window": self.window,
            "fitted_on": None if fit is None else fit.n,
            "median_rel_error": None if fit is None else fit.median_rel_error,
            "converged": self.converged,
            "settled": self.settled,
            "intervals": self.intervals(),
            "drift_error": self.drift_error,
            "drifts": self.drifts,
            "kept": self.last_problem,
        }


#: Fits in a row inside the intervals of the one before, after which the learner stops refitting.
SETTLE = 2
#: Standard errors each side of an estimate in its interval (95 %, the normal's: the fits read
#: thousands of steps).
Z95 = NormalDist().inv_cdf(0.975)
#: A settled model whose median error on the last steps reaches this many times its fit's starts
#: fitting again.
DRIFT = 2.0


def _interval(value: float, se: float) -> list[float | None]:
    if not math.isfinite(se):
        return [None, None]
    return [value - Z95 * se, value + Z95 * se]


def inside(model: StepModel, fit: StepFit) -> bool:
    """Every coefficient of ``model`` inside ``fit``'s 95 % interval of it; a term the fit could not
    tell (its standard error NaN) counts where both are 0, as non-negative least squares leaves a
    term it does not need."""
    for name, se in zip(COEFFICIENTS, fit.se):
        new, old = getattr(model, name), getattr(fit.model, name)
        if math.isfinite(se):
            if abs(new - old) > Z95 * se:
                return False
        elif new != old:
            return False
    return True


class _Forward:
    """One request forwarded: its task, the tokens come and not yet taken by a step (each with its
    text: a chunk of several tokens is its text and then empty pieces, so that the core's token a
    step meets the upstream's count), and how it ended."""

    def __init__(self, job: Job, timeline: Timeline) -> None:
        self.job, self.timeline = job, timeline
        self.pieces: deque[str] = deque()
        self.text: list[str] = []
        self.arrived = asyncio.Event()
        self.result: EngineResult | None = None
        self.error: BaseException | None = None
        self.task: asyncio.Task | None = None
        self.taken = 0  # tokens handed to steps
        self.prompt_tokens: int | None = None  # the upstream's count, once its usage said
        self._held = ""  # text that came with no token of its own: it goes with the next token
        self._last_at: float | None = None
        self.gap: float | None = None

    @property
    def over(self) -> bool:
        return self.task is not None and self.task.done()

    def counted(self, chunk: ChunkRead, at: float) -> None:
        """A chunk read at ``at`` (the engine's clock)."""
        self.text.append(chunk.text)
        if chunk.prompt_tokens is not None:
            self.prompt_tokens = chunk.prompt_tokens
        if not chunk.tokens:
            self._held += chunk.text
            return
        self.pieces.append((self._held + chunk.text, at))
        self.pieces.extend([("", at)] * (chunk.tokens - 1))
        self._held = ""
        self.arrived.set()

    async def next(self) -> str | None:
        """Its next token's text; None when its stream ended (or failed) without one. ``gap``: then
        the time between the chunks of this token and the one before (None: its first; 0: the same
        chunk)."""
        while not self.pieces:
            if self.over:
                return None
            self.arrived.clear()
            await self.arrived.wait()
        self.taken += 1
        piece, at = self.pieces.popleft()
        self.gap = None if self._last_at is None else at - self._last_at
        self._last_at = at
        return piece


class UpstreamBatchEngine:
    """Runs a :func:`~live.gate.BatchGate`'s steps by forwarding to a batching server (module
    docstring). ``forwarder``: the one-at-a-time upstream engine whose forwarding it reuses. A model
    the learner fits in a step goes back with the step (:attr:`live.batching.StepDone.step_model`):
    the gate plans with it from the next step on, a point its step log says, so that a replay takes
    it where the gate did."""

    abilities = Abilities(coroutine=True)

    max_new_tokens_limit = None

    def __init__(
        self,
        forwarder: UpstreamEngine,
        max_num_seqs: int,
        learner: StepLearner,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.forwarder, self.max_num_seqs, self.learner = forwarder, max_num_seqs, learner
        self._clock = clock
        self._forwards: dict[object, _Forward] = {}
        self._session: aiohttp.ClientSession | None = None
        # the loop that made it (the gate's)
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self.steps = 0

    def _start(self, job: Job) -> _Forward:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session, self._session_loop = self.forwarder.new_session(self.max_num_seqs), loop
        forward = _Forward(job, self.learner.started(job.prompt_tokens))
        learner, clock = self.learner, self._clock

        def counted(chunk: ChunkRead) -> None:
            at = clock()
            if chunk.tokens:
                learner.chunk(forward.timeline, at, chunk.tokens)
            forward.counted(chunk, at)

        async def run() -> None:
            try:
                forward.result = await self.forwarder.forward(
                    self._session,
                    job.prompt,
                    job.max_new_tokens,
                    job.stop,
                    None,
                    job.asked,
                    counted,
                )
                if forward.result.prompt_tokens is not None:
                    forward.prompt_tokens = forward.result.prompt_tokens
                learner.ended(forward.timeline, forward.result.tokens)
            except UpstreamError as exc:
                forward.error = exc
            finally:
                forward.arrived.set()

        forward.task = loop.create_task(run(), name="qlab-upstream-forward")
        return forward

    async def astep(self, work: StepWork) -> StepDone:
        self.steps += 1
        # out of the batch for good: close its stream, so the upstream frees its slot
        for key in work.ended:
            forward = self._forwards.pop(key, None)
            if forward is not None and not forward.over:
                forward.task.cancel()
        for chunk in work.prefill:
            if chunk.key not in self._forwards:
                self._forwards[chunk.key] = self._start(chunk.job)
        producing = [*work.decode, *work.completing]
        got = await asyncio.gather(*(self._forwards[key].next() for key in producing))
        if not producing:
            # a step of prompt chunks alone: the upstream shows nothing of it
            await asyncio.sleep(0)
        failed, finished, pieces = {}, {}, {}
        for key, piece in zip(producing, got):
            forward = self._forwards[key]
            if piece is not None and forward.job.stream:
                pieces[key] = piece
            if not forward.over or forward.pieces:
                continue
            # its stream failed: it fails at this step (its last chunk sent on)
            if forward.error is not None:
                failed[key] = forward.error
            elif forward.taken < forward.job.max_new_tokens:
                # Its stream ended (end of text, or a stop string, at the upstream) short of the
                # core's count: it finishes at this step, with the chunks it had (the core counts a
                # token a step).
                finished[key] = forward.taken
        said = {
            key: self._forwards[key].prompt_tokens
            for key in producing
            if self._forwards[key].prompt_tokens is not None
        }
        return StepDone(
            self._upstream_s(producing, got, work.model_s),
            failed,
            pieces,
            finished,
            said,
            step_model=self.learner.checkpoint(),
        )

    def _upstream_s(self, producing: list, got: list, model_s: float) -> float:
        """The step's seconds for the speed tracker: the upstream's own, the median gap between the
        chunk of the token each producing answer took now and its token before (the gate's step may
        have found them waiting, or waited for two). Gaps under :data:`BURST_SHARE` of the model's
        step are chunks read together (the gate's loop was busy, or one chunk held several tokens),
        not a step; 0 where no gap is left (the tracker then learns nothing from the step)."""
        gaps = []
        for key, piece in zip(producing, got):
            gap = self._forwards[key].gap
            if piece is not None and gap is not None and gap >= BURST_SHARE * model_s:
                gaps.append(gap)
        return float(np.median(gaps)) if gaps else 0.0

    def release(self, key) -> None:
        """Its request was cut or its client left: close its stream now, so the upstream frees its
        slot (the gate may have no next step for a while to say so); its text stays until the next
        step's ``ended``."""
        forward = self._forwards.get(key)
        if forward is not None and not forward.over:
            forward.task.cancel()

    def text(self, key, job: Job, tokens: int) -> str:
        forward = self._forwards.get(key)
        return "" if forward is None else "".join(forward.text)

    @property
    def counters(self):
        """The upstream's own counters, for /stats (the forwarder's: live.engine.CountsUpstream)."""
        return self.forwarder.counters

    @property
    def routes(self):
        """The routes the upstream serves (what ``qlab serve`` says at start-up)."""
        return self.forwarder.routes

    def count_tokens(self, text: str) -> int:
        return self.forwarder.count_tokens(text)

    def warmup(self) -> None:
        """Nothing to warm: start-up asked the upstream for its model, routes and batch."""

    async def readiness(self) -> str | None:
        return await self.forwarder.readiness()

    async def aclose(self) -> None:
        for forward in self._forwards.values():
            if not forward.over:
                forward.task.cancel()
        self._forwards.clear()
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()
        await self.forwarder.aclose()

    def info(self) -> dict:
        return {
            **self.forwarder.info(),
            "batching": True,
            "max_num_seqs": self.max_num_seqs,
            "learned": self.learner.info(),
        }


def upstream_batch(spec: UpstreamSpec) -> int | None:
    """What the upstream says of its own batch: a qlab gate's ``GET /stats``
    ``batching.max_num_seqs`` (None: it does not say; vLLM's API does not)."""
    try:
        response = httpx.get(spec.url + "/stats", timeout=spec.timeout_s, headers=spec.headers)
        seats = (
            response.json().get("batching", {}).get("max_num_seqs")
            if response.status_code == 200
            else None
        )
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return seats if isinstance(seats, int) and seats >= 1 else None
