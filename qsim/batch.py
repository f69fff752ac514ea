"""The queue core of a batching engine: continuous batching as vLLM's v1 scheduler does it, and no
clock.

:class:`BatchQueue` is :class:`qsim.queue.AdmissionQueue`'s sibling for an engine that runs its
requests together (:class:`qsim.engines.Batching`). It holds the waiting line, the running batch and
the KV blocks, plans each step and learns from each step's time; its drivers (the simulator in
:mod:`qsim.model`, a live engine through the gate) only turn "run this step" into a timeout or a
forward pass and come back with :meth:`BatchQueue.step_done`. Events are steps, never tokens.

A step is planned as vLLM's v1 scheduler plans it (``vllm/v1/core/sched/scheduler.py``), in
aggregate where it can be:

1. every running request that is decoding computes one token (the token budget is at least
   ``max_num_seqs``, as vLLM requires). A decoding request needs a new KV block when its tokens
   fill the last one; where the free blocks do not suffice, the newest running request is
   preempted (recompute: its blocks are freed and it goes back to the head of the line, to
   compute its prompt and what it generated again) until they do;
2. each running request still computing its prompt (chunked prefill) gets the budget left, in
   order, preempting the newest where its chunk's blocks do not fit (itself, last);
3. only if nothing was preempted: waiting requests join while there is budget, a free seat
   (``max_num_seqs``) and the blocks for their first chunk (without chunked prefill, the whole
   prompt must fit in the budget), in the discipline's order, preempted ones first.

The one departure from vLLM is the order inside the running list: vLLM walks it in admission order,
so a request computing a long prompt can take the budget from decoding requests admitted after it;
here decoding requests go first (Sarathi-Serve's decode-maximal order). With the budget at least
the batch size, this differs only for requests admitted in the same step as a long chunk.

The step's time is the :class:`qsim.engines.StepModel` of what it computes: prefill tokens, the
sequences that produce a token (the decoding and those whose prompt completes), and the context
tokens held. A request's first token comes at the end of the step that completes its prompt; it
finishes at the end of the step that produces its last token. A request admitted while the batch
has a free seat and blocks for its first chunk, and nobody waits, is in the batch from that
instant (it computes from the next step on), as an idle engine's request is in service at once.

Admission (:meth:`BatchQueue.arrive`) is the one-at-a-time core's
(:class:`qsim.admission.Admission`: the estimator, token buckets, reserve, shedding draw and the
policy's rule); what differs is the queue's part of the :class:`~qsim.policy.View`
(:class:`~qsim.admission.Projection`): the wait
and the time to first token are projected from the running batch (each running request's remaining
tokens, the line before it, the step model at the batch size that will be), and with
``kv_admission`` a second projection in which everyone holds the blocks of their prompt and limit
says when memory would let it in.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any, Callable, NamedTuple

from .admission import Admission, Core, Seen
from .batch_audit import Books
from .batch_projection import Projections
from .batch_prefix import PrefixCache
from .batch_timers import Timers
from .config import ServerConfig
from .engines import Batching
from .entry import Entry, Work
from .outcomes import EXPIRED
from .policy import EXPIRE_REASON, Policy, Rejection, cannot_finish, retry_after
from .prefix import BlockPool, Tokens
from .queue import judge
from .routers import ReplicaState
from .service import SpeedTracker

_new = tuple.__new__
#: Weight of one step in the average of the prompt tokens steps compute (about the last twenty
#: steps).
PREFILL_WEIGHT = 0.05


class RunStats(NamedTuple):
    """What the engine did for one request, as its record's engine columns hold it."""

    start_s: float  # when it first joined the batch
    first_token_s: float  # absolute time of its first token (NaN: none)
    tokens: int  # tokens generated
    preemptions: int
    kv_blocks_peak: int
    cached_tokens: int = -1  # prompt tokens its first scheduling found cached (-1: no cache)


class Step(NamedTuple):
    """One planned step: what the engine computes, and how long the step model says it takes.

    ``chunks`` lists (request, tokens of its prompt computed in this step) for the requests
    computing their prompt; ``decoding`` the requests that compute one token each, and
    ``completing`` those among ``chunks`` whose prompt completes in this step (each produces a
    token: its first, or after a preemption its next); a live engine needs both, the simulator
    neither; ``starts``, for each of ``chunks``, the tokens its request had computed before this
    step (0: its first chunk, or the first after a preemption), for a live engine's cache. model_s:
    the step model's seconds (before the speed factor)."""

    chunks: tuple
    decoding: tuple
    decoders: int  # requests computing one token each
    prefill_tokens: int
    sampling: int  # requests that produce a token: the decoding, and those whose prompt completes
    context: int
    model_s: float
    completing: tuple = ()
    starts: tuple = ()


class _Seq:
    """A request in the batch, or preempted and waiting to join again."""

    __slots__ = (
        "entry",
        "prompt",
        "out",
        "est_out",
        "order",
        "computed",
        "target",
        "generated",
        "blocks",
        "peak",
        "preemptions",
        "start",
        "first_token",
        "decoding",
        "d0",
        "kv0",
        "finish_at",
        "alive",
        "chunk",
        "due",
        "in_line",
        "hold",
        "tokens",
        "table",
        "hashed",
        "hashes",
        "cached_tokens",
        "ready",
        "draining",
    )

    def __init__(self, entry: Entry, prompt: int, out: int, est_out: int) -> None:
        self.entry = entry
        self.prompt, self.out, self.est_out = prompt, out, est_out
        self.order = -1
        self.computed = 0  # tokens whose KV is computed (while computing its prompt)
        # tokens to compute before it samples: its prompt, and after a preemption what it generated
        self.target = prompt
        self.generated = 0
        # KV blocks held while computing its prompt (a decoding request's follow from its tokens)
        self.blocks = 0
        self.peak = 0
        self.preemptions = 0
        self.start = math.nan
        self.first_token = math.nan
        self.decoding = False
        self.d0 = self.kv0 = self.finish_at = 0
        self.alive = True
        self.chunk = 0
        self.due = math.inf
        # waiting (in the discipline's line or at its front): its prompt counts as queued
        self.in_line = False
        self.hold = 0  # the seat-steps it added to the line's when it joined it
        # With a prefix cache only: its tokens' identity, the physical blocks it holds for its
        # prompt (a decoding request's later blocks are the pool's, counted from its tokens), how
        # many of them are cached, its block hashes as far as computed, and the prompt tokens its
        # first join found cached.
        self.tokens: Tokens | None = None
        self.table: list[int] = []
        self.hashed = 0
        self.hashes: list[int] = []
        self.cached_tokens = -1
        # With a front end only: when its intake is done (it computes from then on), and whether
        # the engine is done with it while its last tokens are still on their way to the client.
        self.ready = 0.0
        self.draining = False


class BatchQueue(Projections, PrefixCache, Timers, Books, Core):
    """The waiting line, the running batch and the KV blocks of one batching engine; see the module.

    Hooks: ``step(plan, now)``: run this :class:`Step` from ``now`` and call :meth:`step_done` when
    it is over; ``end(req, now, outcome, reason, stats)``: a request that joined the batch ended
    (answered good or late, or cut at its deadline), with its :class:`RunStats`; ``drop(req, now,
    outcome, reason, est_s, retry_after_s)``: a waiting request ended unrun (as
    :class:`~qsim.queue.AdmissionQueue`'s). After any event the driver asks
    :meth:`next_timer` when to call :meth:`timer` (a running request's deadline, where the policy
    cuts there).
    """

    all_stalled = False  # no stall rule here (a live gate's readiness asks)
    # the decoding hold their next token's KV slot (a step is planned or in flight)
    _decode_reserved = False
    _planned: list = []

    def __init__(
        self,
        config: ServerConfig,
        *,
        step: Callable,
        end: Callable,
        drop: Callable,
        joined: Callable | None = None,
        wake: Callable | None = None,
        gone: Callable[[Any], bool] | None = None,
        tokens: Callable[[Any], Tokens | None] | None = None,
        members: bool = False,
    ) -> None:
        """joined(req, now): a request joins the batch for the first time (its start). wake(now):
        the engine was idle and has work: the driver calls :meth:`begin` once everything due at
        ``now`` has arrived, so that a burst starts in one step (None: the step is planned at once).
        tokens(req): with prefix caching, the :class:`~qsim.prefix.Tokens` of a request (None, or
        no hook: tokens shared with no other request). members: each :class:`Step` names its
        decoding and completing requests and where each chunk starts (a live driver hands them to
        its engine; the simulator needs only the counts)."""
        engine = config.engine
        if not isinstance(engine, Batching):
            raise ValueError(f"BatchQueue runs a batching engine, not {engine.kind}")
        if config.stall is not None:
            raise ValueError(
                "a stall rule applies to engines run one at a time; a batching engine has none here"
            )
        self.config, self.engine = config, engine
        self.policy = policy = config.policy
        self.model = engine.step
        self.tracker = SpeedTracker(
            weight=config.tracker_weight,
            initial=config.initial_speed_factor,
            fixed=config.fixed_estimate,
        )
        self.waiting = policy.make_discipline()
        # preempted, or pulled but not fitting yet: ahead of the discipline's line
        self.front: deque[_Seq] = deque()
        # A batch's rule reads more than the one-at-a-time numbers: those are not recorded.
        self.admission = Admission(
            config, counts_refused=True, empty=Seen(math.nan, 0, 0.0, self.tracker.factor)
        )
        self._step, self._end, self._drop, self._gone, self._joined = step, end, drop, gone, joined
        self._wake = wake
        self._wants_members = members
        self.waking = False  # the driver was asked to begin a step
        self._drop_reason = getattr(self.waiting, "drop_reason", None)
        self._started = getattr(self.waiting, "started", None)
        # Projecting the batch costs a walk over it and the line: only for rules that read the
        # projection.
        self._projects = type(policy).decide is not Policy.decide or any(
            rule.projected for rule in policy.rules
        )
        # id(entry) -> its sequence, while it waits in the discipline's line
        self.seq_of: dict[int, _Seq] = {}
        self.running: dict[int, _Seq] = {}  # order -> sequence, oldest first: the batch
        self.prefilling: list[_Seq] = []  # those still computing their prompt, in batch order
        self.finishing: list = []  # the decoding: heap of (decode count it finishes at, order, seq)
        self.residue = [0] * engine.block_size  # the decoding by (kv0 - d0) mod block size
        self.n_dec = 0
        # sum over the decoding of kv0 - d0: their KV tokens are kv_dec + n_dec x decoded
        self.kv_dec = 0
        self.decoded = 0  # decode steps so far
        self.kv_used = 0
        self.kv_cap = math.inf if engine.kv_blocks is None else engine.kv_blocks
        self.line_tokens = 0  # prompt tokens of the line
        # seat-steps the line will hold (each one's _holds when it joined the line)
        self.line_hold = 0
        # over the decoding: est_out - generated at d0 + d0, summed (see _running_steps)
        self.dec_est = 0
        self.joined = 0
        self.plan: Step | None = None
        self.plan_started = math.nan
        # an EWMA (weight PREFILL_WEIGHT) of the prompt tokens a step computed
        self.prefill_per_step = 0.0
        # heap of (deadline, order, seq) of those that joined, where the policy cuts there
        self.cuts: list = []
        # Prefix caching (qsim.prefix): the physical blocks, and the decoding requests' blocks past
        # their prompt's, which are interchangeable until a request leaves and hashes them (None:
        # no cache).
        self.pool = BlockPool(self.kv_cap) if engine.prefix_caching else None
        self.decode_blocks: list[int] = []
        self._tokens_of = tokens
        self._unique = 0  # requests without tokens of their own: each gets keys nobody else has
        # The front end (qsim.engines.FrontEnd): when its FIFO core is next free, the requests
        # whose intake is not done yet and those done in the engine whose tokens are not yet
        # delivered (heaps of (time, order, seq)); the latter hold their seats.
        self.fe = engine.front_end
        self.fe_free = 0.0
        self.intake: list = []
        self.delivering: list = []
        self.draining = 0

    # -- the numbers -----------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self.waiting) + len(self.front)

    @property
    def in_service(self) -> int:
        return len(self.running)

    @property
    def kv_use(self) -> float:
        return 0.0 if self.kv_cap == math.inf else self.kv_used / self.kv_cap

    def context(self) -> int:
        """KV tokens the batch holds."""
        return self.kv_dec + self.n_dec * self.decoded + sum(s.computed for s in self.prefilling)

    def step_s(self, seqs: float, context: float, prefill: float | None = None) -> float:
        """A step's estimated seconds (speed factor in) for ``seqs`` sequences holding ``context``
        tokens, computing ``prefill`` prompt tokens (None: as many as steps have lately, an average
        over the last twenty or so: others' prompts share the steps a request decodes in)."""
        return (
            self.model.time(self.prefill_per_step if prefill is None else prefill, seqs, context)
            * self.tracker.factor
        )

    def replica_state(self, now: float, req=None, ask=None) -> ReplicaState:
        """What a fleet's router reads of this engine at ``req``'s arrival: its outstanding, the
        wait an arrival would be given (its work per seat), a seat free, its KV use and the share of
        ``req``'s full prompt blocks its prefix cache holds (a probe: vLLM's counters not moved);
        with ``ask`` (a :class:`~qsim.routers.Arrival`), its projected time to first token here."""
        idle = int(not self.queued and self._seats_taken() < self.engine.max_num_seqs)
        ttft = math.nan if ask is None else self._probe_ttft(ask, now, req)
        return ReplicaState(
            self.queued + self.in_service,
            self._work_wait(now),
            1,
            idle,
            self.kv_use,
            self._prefix_hit(req),
            ttft,
        )

    def _probe_ttft(self, ask, now: float, req=None) -> float:
        """The time to first token :meth:`_project` gives an arrival of ``ask``'s estimate and
        work now, nothing counted (a router's question, not an arrival)."""
        work = ask.work
        if work is None:  # as arrive takes it
            work = Work(self.config.model.tokens_for(ask.base_est_s), 0, None)
        base_est_s, work = self.admission.estimated(ask.base_est_s, work)
        seq = _Seq(None, work.prompt, work.limit, self._est_out(base_est_s, work))
        if self.pool is not None:  # its own tokens where the trace says them; else shared by none
            own = None if req is None or self._tokens_of is None else self._tokens_of(req)
            seq.tokens = own or Tokens(((-1, work.prompt),) if work.prompt else (), -1)
        room = not self.queued and self._has_room(seq)
        return self._project(seq, now, room)[1]

    def snapshot(self) -> dict:
        """The queue now, for /stats and tests."""
        return {
            "waiting": self.queued,
            "in_service": self.in_service,
            "stalled": 0,
            "queued_work_s": math.nan,
            "speed_factor": self.tracker.factor,
            "engines": 1,
            "kv_blocks_used": self.kv_used,
            "kv_use": self.kv_use,
            **(self.prefix_cache_stats() or {}),
        }

    # -- events ------------------------------------------------------------------------

    def arrive(
        self,
        req,
        now: float,
        base_est_s: float,
        deadline_s: float | None = None,
        priority: int = 0,
        client=None,
        work: Work | tuple | None = None,
    ) -> Rejection | None:
        """Admit ``req`` (into the batch at once where it has a seat and blocks and nobody waits,
        else into the line) or return the refusal. ``work`` (limit, prompt tokens, tokens it will
        generate) is what the batch runs: without it the request asks for the tokens
        ``config.model`` gives ``base_est_s`` and no prompt; a ``generated`` of None (a live gate's)
        runs to the limit."""
        seq = self._arrival(req, now, base_est_s, deadline_s, priority, client, work)
        never = self._never(seq)
        if never is not None:
            self.admission.seen_numbers = (
                math.nan,
                self.queued,
                math.nan,
                self.tracker.factor,
                math.nan,
                -1,
            )
            return never
        room = not self.queued and self._has_room(seq)
        refusal = self.admission.admit(
            now, seq.entry, self.tracker.factor, self._projection(seq, now, room)
        )
        if refusal is not None:
            return refusal
        self._place(seq, now, room)
        return None

    def _place(self, seq: _Seq, now: float, room: bool | None = None) -> None:
        """An admitted arrival into the batch at once where it has room (None: see whether it
        has; a fleet's gate admits it before routing: qsim.gate_view), else into the line."""
        if room is None:
            room = not self.queued and self._has_room(seq)
        if room:
            self._take(seq, now)
        else:
            self.seq_of[id(seq.entry)] = seq
            self.waiting.push(seq.entry)
            self._into_line(seq)
        self._kick(now)

    def _arrival(
        self, req, now: float, base_est_s: float, deadline_s, priority: int, client, work
    ) -> _Seq:
        """An arrival's entry (its estimate, deadline and work as admission gives them) and its
        sequence (a central queue's fleet, qsim.batch_fleet, makes it so too)."""
        if work is None:
            work = Work(self.config.model.tokens_for(base_est_s), 0, None)
        base_est_s, deadline_s, work = self.admission.arrival(base_est_s, deadline_s, work)
        entry = _new(Entry, (req, now, base_est_s, deadline_s, priority, client, work))
        seq = _Seq(
            entry,
            work.prompt,
            work.limit if work.generated is None else work.generated,
            self._est_out(base_est_s, work),
        )
        seq.out = max(1, seq.out)
        if self.pool is not None:
            seq.tokens = self._tokens(req, work.prompt)
        return seq

    def _take(self, seq: _Seq, now: float) -> None:
        """An arrival with room (:meth:`_has_room`) into the batch at once, holding its first
        chunk's blocks (its cached prefix shared)."""
        if self.pool is not None:
            hit, _, blocks, _ = self._first_chunk(
                seq, self.engine.max_num_batched_tokens, count=True
            )
            self._join(seq, now, blocks, hit)
        else:
            first = (
                min(seq.prompt, self.engine.max_num_batched_tokens)
                if self.engine.chunked_prefill
                else seq.prompt
            )
            self._join(seq, now, self.engine.blocks_for(max(1, first)))

    def begin(self, now: float) -> None:
        """The driver's answer to ``wake``: plan the first step now (see __init__)."""
        self.waking = False
        if self.plan is None:
            self._next_step(now)

    def _kick(self, now: float) -> None:
        """Work for an idle engine: a step now, or once the driver has taken in the rest of this
        instant."""
        if self.plan is not None or self.waking:
            return
        if self._wake is None:
            self._next_step(now)
        else:
            self.waking = True
            self._wake(now)

    def step_done(self, now: float, elapsed_s: float | None = None) -> None:
        """The step in flight ended at ``now`` (it took ``elapsed_s``, for the speed tracker: a live
        engine's own time; None: ``now`` minus its start). Its tokens are counted, the requests it
        finished end, and the next step is planned."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("step_done with no step in flight")
        self.plan = None
        self.tracker.observe(
            plan.model_s, now - self.plan_started if elapsed_s is None else elapsed_s
        )
        self.prefill_per_step += PREFILL_WEIGHT * (plan.prefill_tokens - self.prefill_per_step)
        if plan.decoders:
            self.decoded += 1
        # the slots held for this step's tokens are now counted in their tokens
        self._decode_reserved = False
        # When this step's tokens reach their clients: at once, or once the front end has streamed
        # them.
        fe = self.fe
        delivered = now if fe is None else self._fe_job(now, fe.step_s + fe.token_s * plan.sampling)
        for seq, chunk in self._planned:
            if seq.alive and seq.chunk == chunk and seq.order in self.running:
                seq.chunk = 0
                seq.computed += chunk
                if seq.computed >= seq.target:
                    self._sampled(seq, now, delivered)
        finishing = self.finishing
        while finishing and finishing[0][0] <= self.decoded:
            _, order, seq = heapq.heappop(finishing)
            if seq.alive and seq.decoding and seq.order == order and seq.finish_at <= self.decoded:
                self._finish(seq, now, delivered)
        self._next_step(now)

    # -- planning -------------------------------------------------------------------------

    def _next_step(self, now: float) -> None:
        """Plan the next step from ``now`` and hand it to the driver, or rest when there is
        nothing to run."""
        engine, cap = self.engine, self.kv_cap
        preempted = False
        # 1. The decoding: one token each, a new block for those whose last block is full.
        need = self.residue[(-self.decoded) % engine.block_size] if self.n_dec else 0
        while self.kv_used + need > cap and self.running:
            self._preempt(self._newest())
            preempted = True
            need = self.residue[(-self.decoded) % engine.block_size] if self.n_dec else 0
        self.kv_used += need
        if self.pool is not None:
            self.decode_blocks.extend(self.pool.allocate(need))
        # each decoding request holds the slot of this step's token from here
        self._decode_reserved = True
        budget = engine.max_num_batched_tokens - self.n_dec
        chunks = []
        # 2. Those still computing their prompt, in batch order.
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            if seq.order not in self.running:
                continue  # preempted just now
            if seq.ready > now:
                continue  # the front end has not handed it over yet
            chunk = min(seq.target - seq.computed, budget)
            blocks = max(0, engine.blocks_for(seq.computed + chunk) - seq.blocks)
            while self.kv_used + blocks > cap and seq.order in self.running:
                self._preempt(self._newest())
                preempted = True
            if seq.order not in self.running:
                break  # it was the newest left: nothing after it runs either
            self._hold(seq, blocks)
            seq.chunk = chunk
            if self.pool is not None:
                self._cache_full(seq, seq.computed + chunk)
            budget -= chunk
            chunks.append((seq, chunk))
        # 3. The line, where nothing was preempted.
        if not preempted:
            while budget > 0 and self._seats_taken() < engine.max_num_seqs:
                seq = self._pull(now)
                if seq is None:
                    break
                hit, extra = (), 0
                if self.pool is not None:  # its cached prefix is computed already, and shared
                    hit, todo, blocks, extra = self._first_chunk(seq, budget, count=True)
                    chunk = min(todo, budget)
                else:
                    todo = seq.target - seq.computed
                    chunk = min(todo, budget)
                    blocks = engine.blocks_for(max(1, chunk))
                too_long = not engine.chunked_prefill and todo > budget
                if too_long or self.kv_used + extra + blocks > cap:
                    self._requeue(seq)  # it stays at the head of the line
                    break
                self._join(seq, now, blocks, hit)
                if seq.ready > now:
                    continue  # it holds its seat and first blocks while the front end takes it in
                seq.chunk = chunk
                if self.pool is not None:
                    self._cache_full(seq, seq.computed + chunk)
                budget -= chunk
                chunks.append((seq, chunk))
        decoders = self.n_dec
        if not chunks and not decoders:
            return  # nothing can run: idle until an arrival, a client leaving or a cut changes that
        prefill = sum(c for _, c in chunks)
        done = [s for s, c in chunks if s.computed + c >= s.target]
        context = (
            self.kv_dec + decoders * (self.decoded + 1) + sum(s.computed + c for s, c in chunks)
        )
        model_s = self.model.time(prefill, decoders + len(done), context)
        members, completing, starts = (), (), ()
        if self._wants_members:
            members = tuple(s.entry.req for s in self.running.values() if s.decoding)
            completing = tuple(s.entry.req for s in done)
            starts = tuple(s.computed for s, _ in chunks)
        self.plan = _new(
            Step,
            (
                tuple((s.entry.req, c) for s, c in chunks),
                members,
                decoders,
                prefill,
                decoders + len(done),
                context,
                model_s,
                completing,
                starts,
            ),
        )
        self._planned = chunks
        self.plan_started = now
        self._step(self.plan, now)

    def _pull(self, now: float) -> _Seq | None:
        """The next of the line that may still join (the preempted first), dropping at the front
        those the policy expires (they could not finish in time even if they joined now) and those
        whose client has left."""
        if self.front:
            seq = self.front.popleft()
            self._out_of_line(seq)
            return seq
        return self._next_waiting(now, self.waiting, self.seq_of, self._drop_reason)

    def _next_waiting(self, now: float, waiting, seq_of: dict, drop_reason) -> _Seq | None:
        """:meth:`_pull` from a discipline's line ``waiting`` (this engine's, or a central
        queue's)."""
        while waiting:
            entry = waiting.pop_next(now)
            seq = seq_of.pop(id(entry))
            self._out_of_line(seq)
            if self._gone is not None and self._gone(entry.req):
                seq.alive = False
                continue
            est = self._alone_s(seq)
            reason = None
            if self.policy.expire_at_front and cannot_finish(
                now, est, entry.arrived_at + entry.deadline_s
            ):
                reason = EXPIRE_REASON
            elif drop_reason is not None:
                reason = drop_reason(entry, now, est)
            if reason is not None:
                seq.alive = False
                self._drop(entry.req, now, EXPIRED, reason, est, retry_after(self._wait_now(now)))
                continue
            return seq
        return None

    def _join(self, seq: _Seq, now: float, blocks: int, hit=()) -> None:
        """Into the batch, holding ``blocks`` for its first chunk, and sharing the cached blocks
        ``hit`` of its prefix (computed already); it computes from the next step on."""
        self.joined += 1
        seq.order = self.joined
        self.running[seq.order] = seq
        self.prefilling.append(seq)
        seq.computed = 0
        seq.decoding = False
        seq.blocks = 0
        if self.pool is not None:
            self._reuse(seq, hit)
        self._hold(seq, blocks)
        if math.isnan(seq.start):
            seq.start = now
            if self.fe is not None:
                seq.ready = self._fe_job(now, self.fe.request_s)
                heapq.heappush(self.intake, (seq.ready, seq.order, seq))
            if self._joined is not None:
                self._joined(seq.entry.req, now)
            if self.policy.cancel_at_deadline:
                seq.due = seq.entry.arrived_at + seq.entry.deadline_s
                heapq.heappush(self.cuts, (seq.due, seq.order, seq))
            if self._started is not None:
                self._started(seq.entry)

    def _hold(self, seq: _Seq, blocks: int) -> None:
        self.kv_used += blocks
        seq.blocks += blocks
        if self.pool is not None:
            seq.table.extend(self.pool.allocate(blocks))
        if seq.blocks > seq.peak:
            seq.peak = seq.blocks

    def _sampled(self, seq: _Seq, now: float, delivered: float) -> None:
        """Its prompt (and, after a preemption, what it had generated) is computed: this step
        produced a token, which reaches its client at ``delivered``."""
        seq.generated += 1
        if seq.first_token != seq.first_token:
            seq.first_token = delivered
        if seq.generated >= seq.out:
            self._finish(seq, now, delivered)
            return
        # Decoding from now on: its KV tokens grow by one each decode step (the blocks follow from
        # the tokens).
        self.prefilling.remove(seq)
        seq.decoding = True
        seq.d0, seq.kv0 = self.decoded, seq.computed
        seq.finish_at = self.decoded + seq.out - seq.generated
        if self.pool is not None:
            self._trim(seq, self.engine.blocks_for(seq.kv0))
        self.kv_used += self.engine.blocks_for(seq.kv0) - seq.blocks
        seq.blocks = 0
        self.n_dec += 1
        self.kv_dec += seq.kv0 - seq.d0
        self.dec_est += seq.est_out - seq.generated + seq.d0
        self.residue[(seq.kv0 - seq.d0) % self.engine.block_size] += 1
        heapq.heappush(self.finishing, (seq.finish_at, seq.order, seq))

    def _release(self, seq: _Seq) -> None:
        """Out of the batch, its blocks freed (what it generated counted)."""
        if seq.decoding:
            computed = seq.kv0 + self.decoded - seq.d0
            seq.generated += self.decoded - seq.d0
            blocks = self.engine.blocks_for(seq.kv0 + self.decoded - seq.d0 + self._decode_reserved)
            self.n_dec -= 1
            self.kv_dec -= seq.kv0 - seq.d0
            self.dec_est -= seq.est_out - (seq.generated - (self.decoded - seq.d0)) + seq.d0
            self.residue[(seq.kv0 - seq.d0) % self.engine.block_size] -= 1
            seq.decoding = False
        else:
            computed = seq.computed + seq.chunk
            blocks = seq.blocks
            self.prefilling.remove(seq)
        if blocks > seq.peak:
            seq.peak = blocks
        if self.pool is None:
            self.kv_used -= blocks
        else:
            self._free_cached(seq, blocks, computed)
        del self.running[seq.order]
        seq.blocks = 0
        seq.chunk = 0

    def finish(self, req, now: float, tokens: int) -> bool:
        """A live engine ended ``req`` in the batch before its count of tokens did (an upstream
        server's end of text or stop string), having generated ``tokens``: it finishes now, as at
        its last token (judged, ended through ``end``). False when it is not in the batch."""
        for seq in self.running.values():
            if seq.entry.req == req:
                self._release(seq)
                seq.generated = tokens
                self._done(seq, now)
                return True
        return False

    def _finish(self, seq: _Seq, now: float, delivered: float) -> None:
        self._release(seq)
        if delivered > now:
            self._drain(seq, delivered)
        else:
            self._done(seq, now)

    def _done(self, seq: _Seq, now: float) -> None:
        seq.alive = False
        entry = seq.entry
        estimator = self.admission.estimator
        if estimator is not None and estimator.learns:
            estimator.learn(entry.work.limit, seq.generated)
        self._end(
            entry.req,
            now,
            judge(self.policy, entry, now, seq.first_token, seq.generated),
            None,
            self._stats(seq),
        )

    def _preempt(self, seq: _Seq) -> None:
        """Recompute preemption: out of the batch with its blocks freed, to the head of the line."""
        self._release(seq)
        seq.preemptions += 1
        seq.computed = 0
        seq.target = seq.prompt + seq.generated
        self._requeue(seq)

    def _requeue(self, seq: _Seq) -> None:
        """Back to the head of the line: preempted, or pulled and not fitting yet."""
        self.front.appendleft(seq)
        self._into_line(seq)

    def _leave(self, seq: _Seq) -> None:
        """Out of the batch for good (its client left, or it was cut): blocks freed, no outcome
        here."""
        self._release(seq)
        seq.alive = False

    def _into_line(self, seq: _Seq) -> None:
        seq.in_line = True
        seq.hold = self._holds(seq)
        self.line_tokens += seq.prompt
        self.line_hold += seq.hold

    def _out_of_line(self, seq: _Seq) -> None:
        if seq.in_line:
            seq.in_line = False
            self.line_tokens -= seq.prompt
            self.line_hold -= seq.hold

    def _newest(self) -> _Seq:
        return self.running[next(reversed(self.running))]

    @staticmethod
    def _stats(seq: _Seq) -> RunStats:
        return _new(
            RunStats,
            (
                seq.start,
                seq.first_token,
                seq.generated,
                seq.preemptions,
                seq.peak,
                seq.cached_tokens,
            ),
        )
