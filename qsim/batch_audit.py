"""The batching core's books checked: :class:`qsim.batch.BatchQueue`'s bookkeeping recounted from
its requests one by one, for tests and the test kit (``qsim.testing.audited_batches``).

:class:`Books` is a part of :class:`~qsim.batch.BatchQueue` (its base), as
:class:`qsim.batch_projection.Projections` is: it reads the batch, the line, the KV blocks and the
prefix cache and changes none of them; a slip is an AssertionError naming what is off.
"""

from __future__ import annotations


class Books:
    """The audit of :class:`qsim.batch.BatchQueue` (see the module)."""

    def audit(self) -> None:
        """Check the batch's bookkeeping against its requests one by one (AssertionError naming
        what is off): the blocks held add up, the cache and the seats are not overrun, the
        aggregates over the decoding match. For tests and the test kit; costs a walk over the
        batch."""
        engine = self.engine
        held, dec, kv, est = 0, 0, 0, 0
        for seq in self.running.values():
            if seq.decoding:
                tokens = seq.kv0 + self.decoded - seq.d0
                held += engine.blocks_for(tokens + self._decode_reserved)
                dec += 1
                kv += seq.kv0 - seq.d0
                est += seq.est_out - seq.generated + seq.d0
            else:
                held += seq.blocks
                assert seq in self.prefilling, (
                    f"request {seq.entry.req!r} runs, neither decoding nor computing its prompt"
                )
        if self.pool is None:
            assert held == self.kv_used, (
                f"KV blocks: {self.kv_used} counted, {held} held by the running"
            )
        else:  # shared blocks are held by several: the pool's count is of distinct blocks
            self._audit_pool(held)
        assert self.kv_used <= self.kv_cap, f"KV blocks: {self.kv_used} in use of {self.kv_cap}"
        assert self._seats_taken() <= engine.max_num_seqs, (
            f"{len(self.running)} running and {self.draining} streaming of "
            f"{engine.max_num_seqs} seats"
        )
        streaming = sum(1 for _, _, s in self.delivering if s.draining)
        assert streaming == self.draining, f"{self.draining} counted streaming, {streaming} are"
        assert (dec, kv, est) == (self.n_dec, self.kv_dec, self.dec_est), (
            f"decoding aggregates {(self.n_dec, self.kv_dec, self.dec_est)} against "
            f"{(dec, kv, est)} recounted"
        )
        line = [*self.front, *(self.seq_of[id(e)] for e in self.waiting)]
        assert sum(s.prompt for s in line) == self.line_tokens, "prompt tokens of the line"
        assert sum(s.hold for s in line) == self.line_hold, "seat-steps of the line"
        if self.plan is not None:
            tokens = self.plan.prefill_tokens + self.plan.decoders
            assert tokens <= engine.max_num_batched_tokens, (
                f"a step of {tokens} tokens over the budget"
            )

    def _audit_pool(self, held: int) -> None:
        """The prefix cache's books against the batch's: each block's holders, the decoding
        requests' blocks past their tables, and the blocks in use."""
        holders: dict[int, int] = {}
        beyond = 0
        for seq in self.running.values():
            for b in seq.table:
                holders[b] = holders.get(b, 0) + 1
            if seq.decoding:
                tokens = seq.kv0 + self.decoded - seq.d0 + self._decode_reserved
                beyond += self.engine.blocks_for(tokens) - len(seq.table)
            else:
                assert seq.blocks == len(seq.table), "a prompt's blocks apart from its table"
        for b in self.decode_blocks:
            holders[b] = holders.get(b, 0) + 1
        assert beyond == len(self.decode_blocks), (
            f"decoding blocks: {len(self.decode_blocks)} held, {beyond} counted from their tokens"
        )
        assert self.kv_used == self.pool.in_use <= held, (
            f"KV blocks: {self.kv_used} counted, {self.pool.in_use} in use, {held} held, shared"
        )
        self.pool.audit(self.kv_cap, holders)
