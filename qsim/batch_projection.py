"""The batching core's projections for admission: what an arrival would wait, when its first token
and its finish would come, and when memory would let it in, from the running batch and the line.

:class:`Projections` is a part of :class:`qsim.batch.BatchQueue` (its base): it reads the
queue's batch, line, step model and front end and changes none of them; the queue calls it when
it builds an arrival's :class:`~qsim.admission.Projection` and when a fleet's router asks a
replica (``least_ttft``).
"""

from __future__ import annotations

import heapq
import math

from .admission import Projection
from .entry import Work
from .outcomes import Reason
from .policy import Rejection

_new = tuple.__new__


class Projections:
    """The projections of :class:`qsim.batch.BatchQueue` (see the module); ``seq`` and ``s`` are
    its sequences (``qsim.batch._Seq``)."""

    def _est_out(self, base_est_s: float, work: Work) -> int:
        """The tokens a request is estimated to generate (its limit, or the estimator's)."""
        if self.admission.estimator is None:
            return max(1, work.limit)
        est = min(work.limit, self.config.model.tokens_for(base_est_s)) if work.limit > 0 else 1
        return max(1, est)

    def _fe_lag(self, now: float, seqs: int) -> float:
        """What the front end adds to a request's first token joining now, ``seqs`` in the batch:
        the work it holds, its intake, and streaming one step's tokens (its last token's lag as
        well, while the front end keeps up)."""
        fe = self.fe
        if fe is None:
            return 0.0
        return max(0.0, self.fe_free - now) + fe.request_s + fe.step_s + fe.token_s * seqs

    def _never(self, seq) -> Rejection | None:
        """The refusal of a request no state of the engine could serve, or None: without chunked
        prefill its prompt and limit take more than a step, or its prompt and limit more KV blocks
        than the cache has."""
        engine = self.engine
        limit = seq.entry.work.limit
        if not engine.chunked_prefill and seq.prompt + limit > engine.max_num_batched_tokens:
            # Preempted, it computes its prompt and what it generated again in one step: vLLM
            # requires max_num_batched_tokens >= max_model_len without chunked prefill for the same
            # reason.
            return Rejection(
                Reason.TOO_LARGE,
                {
                    "prompt_tokens": seq.prompt,
                    "max_new_tokens": limit,
                    "max_num_batched_tokens": engine.max_num_batched_tokens,
                },
                None,
            )
        if engine.blocks_for(seq.prompt + seq.entry.work.limit) > self.kv_cap:
            return Rejection(
                Reason.TOO_LARGE,
                {
                    "prompt_tokens": seq.prompt,
                    "max_new_tokens": seq.entry.work.limit,
                    "kv_blocks": self.kv_cap,
                    "block_size": engine.block_size,
                },
                None,
            )
        return None

    def _has_room(self, seq) -> bool:
        """A seat free, and blocks for its first chunk, now."""
        engine = self.engine
        if self._seats_taken() >= engine.max_num_seqs:
            return False
        if self.pool is not None:
            _, _, blocks, extra = self._first_chunk(seq, engine.max_num_batched_tokens)
            return self.kv_used + extra + blocks <= self.kv_cap
        first = (
            min(seq.prompt, engine.max_num_batched_tokens) if engine.chunked_prefill else seq.prompt
        )
        return self.kv_used + engine.blocks_for(max(1, first)) <= self.kv_cap

    def _alone_s(self, seq) -> float:
        """Its estimated service in the batch as it is: its prompt, then its estimated tokens at
        today's step."""
        n = min(self.engine.max_num_seqs, len(self.running) + 1)
        step = self.step_s(n, self.context() + seq.prompt)
        return self._holds(seq) * step + self.model.b1 * seq.prompt * self.tracker.factor

    def _left(self, now: float) -> float:
        """Estimated seconds left of the step in flight (0: none)."""
        return (
            0.0
            if self.plan is None
            else max(0.0, self.plan_started + self.plan.model_s * self.tracker.factor - now)
        )

    def _running_steps(self) -> int:
        """Seat-steps the running are estimated to hold after the step in flight (self.dec_est keeps
        the decoding ones' in aggregate: est_out - generated summed is dec_est - n_dec x decode
        steps)."""
        decoded = self.decoded + (1 if self.plan is not None and self.plan.decoders else 0)
        return max(0, self.dec_est - self.n_dec * decoded) + sum(
            map(self._remaining_steps, self.prefilling)
        )

    def _line(self) -> tuple:
        """The line ahead of an arrival in aggregate: (requests, seat-steps they will hold, prompt
        tokens); a replica behind a central queue (qsim.batch_fleet) adds its share of that line."""
        return self.queued, self.line_hold, self.line_tokens

    def _ahead(self) -> list:
        """The line ahead of an arrival, request by request, in the order it is walked (as
        :meth:`_line`)."""
        return [*self.front, *(self.seq_of[id(e)] for e in self.waiting)]

    def _work_wait(self, now: float) -> float:
        """The wait without the projection (for rules that do not read it, and a Retry-After's
        basis): the step in flight, then the seat-steps the running and the line will hold over the
        seats, and the line's prompts (work over servers, as the one-at-a-time core estimates; exact
        for a batch of one)."""
        left = self._left(now)
        n, seats = self._seats_taken(), self.engine.max_num_seqs
        queued, hold, tokens = self._line()
        if n < seats and not queued:
            return left
        step = self.step_s(min(seats, n + queued + 1), self.context())
        return (
            left
            + (self._running_steps() + hold) / seats * step
            + self.model.b1 * self.tracker.factor * tokens
        )

    def _wait_now(self, now: float) -> float:
        """The wait an arrival would be given now (a Retry-After's basis)."""
        return self._work_wait(now)

    def _projection(self, seq, now: float, room: bool) -> Projection:
        """The batch's numbers for an arrival's view (see :class:`~qsim.admission.Projection`): its
        wait, first token and time per token projected (:meth:`_project`), nothing of the
        one-at-a-time wait's."""
        wait, ttft, finish, kv_wait = self._project(seq, now, room)
        seat = 1 if room else 0
        if self.admission.blind and seq.entry.priority >= 0:  # nothing reads more than the estimate
            return _new(
                Projection,
                (
                    self.queued,
                    math.nan,
                    math.nan,
                    finish - wait,
                    1,
                    seat,
                    None,
                    wait,
                    ttft,
                    math.nan,
                    kv_wait,
                    0.0,
                    0,
                ),
            )
        tpot = (finish - ttft) / (seq.est_out - 1) if seq.est_out > 1 else math.nan
        return _new(
            Projection,
            (
                self.queued,
                math.nan,
                math.nan,
                finish - wait,
                1,
                seat,
                None,
                wait,
                ttft,
                tpot,
                kv_wait,
                self.kv_use,
                self.line_tokens,
            ),
        )

    def _project(self, seq, now: float, room: bool) -> tuple[float, float, float, float | None]:
        """(wait, time to first token, finish, wait with memory held), in seconds from ``now``, for
        ``seq`` joining after the line: each running request keeps its seat for its estimated
        remaining tokens, each one waiting takes the first seat that frees for its prompt and
        estimated tokens, in steps of the step model at the batch size there will be. The memory
        projection (``kv_admission`` only) also holds every one of them to the blocks of its prompt
        and estimated tokens, so it joins when those fit."""
        engine = self.engine
        left = self._left(now)
        if not self._projects:
            wait = left if room else self._work_wait(now)
            step = self.step_s(
                min(engine.max_num_seqs, len(self.running) + 1), self.context() + seq.prompt
            )
            prompt_steps = self._holds(seq) - max(0, seq.est_out - 1)
            ttft = wait + prompt_steps * step + self.model.b1 * seq.prompt * self.tracker.factor
            ttft += self._fe_lag(now, len(self.running) + 1)
            return wait, ttft, ttft + (seq.est_out - 1) * step, None
        running = self.running
        ahead = self._ahead()
        n_after = min(engine.max_num_seqs, len(running) + len(ahead) + 1)
        per_seq = self.context() / len(running) if running else seq.prompt + seq.est_out / 2
        step = self.step_s(n_after, per_seq * n_after)
        prefill_s = self.model.b1 * self.tracker.factor
        ahead_prefill = prefill_s * sum(a.prompt for a in ahead)
        own_steps = (
            max(1, math.ceil(seq.prompt / engine.max_num_batched_tokens))
            if engine.chunked_prefill
            else 1
        )
        kv_wait = None
        if room:
            wait = left
            if self.policy.kv_admission and self.kv_cap != math.inf:
                kv_wait = left + self._seat_steps(seq, [], self.kv_cap) * step
        else:
            wait = left + self._seat_steps(seq, ahead, math.inf) * step + ahead_prefill
            if self.policy.kv_admission and self.kv_cap != math.inf:
                kv_wait = left + self._seat_steps(seq, ahead, self.kv_cap) * step + ahead_prefill
        ttft = wait + own_steps * step + prefill_s * seq.prompt
        if engine.chunked_prefill and seq.prompt:
            # A step's token budget goes to the prompts before it first (the running still computing
            # theirs, then the line's): where those fill the budget its prompt completes only when
            # the budget has got to it.
            budget = max(1, engine.max_num_batched_tokens - min(n_after, engine.max_num_seqs))
            backlog = sum(s.target - s.computed for s in self.prefilling) + sum(
                a.prompt for a in ahead
            )
            steps = math.ceil((backlog + seq.prompt) / budget)
            ttft = max(ttft, left + steps * self.step_s(n_after, per_seq * n_after, budget))
        ttft += self._fe_lag(now, n_after)
        return wait, ttft, ttft + (seq.est_out - 1) * step, kv_wait

    def _remaining_steps(self, s) -> int:
        """Steps it is estimated to hold its seat after the step in flight (if any) ends."""
        in_flight = self.plan is not None
        if s.decoding:
            done = (
                s.generated + self.decoded - s.d0 + (1 if in_flight and self.plan.decoders else 0)
            )
            return max(0, s.est_out - done)
        todo = s.target - s.computed - (s.chunk if in_flight else 0)
        # tokens after the one its prompt's last step produces
        left = max(0, s.est_out - s.generated - 1)
        if todo <= 0:
            return left  # its prompt completes in the step in flight
        return math.ceil(todo / self.engine.max_num_batched_tokens) + left

    def _holds(self, s) -> int:
        """Steps a request that joins holds its seat: its prompt's steps (the last produces its
        first token), then one per further token."""
        return max(1, math.ceil(s.target / self.engine.max_num_batched_tokens)) + max(
            0, s.est_out - 1
        )

    def _seat_steps(self, seq, ahead: list, cap: float) -> float:
        """Steps from now until ``seq`` gets a seat (and, with a finite ``cap``, the blocks of its
        prompt and estimated tokens while everyone holds theirs); inf where it never would. With
        memory held so, the running that do not fit beside those before them wait too (they would be
        preempted): the projection serialises what the cache cannot hold together."""
        engine = self.engine
        blocks = engine.blocks_for
        memory = cap != math.inf
        events, later = [], []
        held = 0
        for s in self.running.values():
            need = blocks(s.prompt + s.est_out) if memory else 0
            if memory and held + need > cap:
                later.append((self._remaining_steps(s), need))
                continue
            events.append((self._remaining_steps(s), need))
            held += need
        heapq.heapify(events)
        active, t = len(events), 0.0
        line = [
            *later,
            *(
                (self._holds(s), blocks(s.prompt + s.est_out) if memory else 0)
                for s in (*ahead, seq)
            ),
        ]
        for steps, need in line:
            if need > cap:
                return math.inf
            while active >= engine.max_num_seqs or held + need > cap:
                if not events:
                    return math.inf
                end, freed = heapq.heappop(events)
                t = max(t, end)
                active -= 1
                held -= freed
            heapq.heappush(events, (t + steps, need))
            active += 1
            held += need
        return t
