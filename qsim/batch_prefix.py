"""The batching core's prefix cache (:mod:`qsim.prefix`), where its engine has one: a request's
tokens and block hashes, the cached blocks of its prefix it shares on joining, the blocks cached
as steps fill them and released as it leaves, and what a router or /stats reads of the cache.

:class:`PrefixCache` is a part of :class:`qsim.batch.BatchQueue` (its base), as
:class:`qsim.batch_projection.Projections` and :class:`qsim.batch_audit.Books` are: it works on
the queue's :class:`~qsim.prefix.BlockPool` (``pool``, None without a cache) and its KV count;
the queue calls it where it plans a step, a request joins and leaves the batch.
"""

from __future__ import annotations

from .prefix import Tokens, block_hashes


class PrefixCache:
    """The prefix cache of :class:`qsim.batch.BatchQueue` (see the module); ``seq`` is one of its
    sequences (``qsim.batch._Seq``)."""

    def _prefix_hit(self, req) -> float:
        if req is None or self.pool is None or self._tokens_of is None:
            return 0.0  # no arrival to probe for (its router reads no prefix_hit), or no cache
        tokens = self._tokens_of(req)
        if tokens is None:
            return 0.0
        size = self.engine.block_size
        prompt = tokens.prompt_tokens
        full = max(0, prompt - 1) // size  # what a lookup can find: the last token is computed
        if not full:
            return 0.0
        hit = self.pool.lookup(block_hashes(tokens, size), prompt, size, count=False)
        return len(hit) / full

    def prefix_cache_stats(self) -> dict | None:
        """vLLM's prefix cache counters so far, in tokens (None: no prefix cache): queries (the
        tokens of each request each time the scheduler looked its prefix up) and hits (of them,
        found cached)."""
        if self.pool is None:
            return None
        return {
            "prefix_cache_queries": self.pool.queries,
            "prefix_cache_hits": self.pool.hits,
            "prefix_cache_evictions": self.pool.evictions,
        }

    def _tokens(self, req, prompt: int) -> Tokens:
        tokens = None if self._tokens_of is None else self._tokens_of(req)
        if tokens is None:  # keys below 0: none of a trace's (qsim.prefix.own_key) nor another's
            self._unique += 1
            key = -2 * self._unique
            tokens = Tokens(((key, prompt),) if prompt else (), key - 1)
        return tokens

    def _hashes(self, seq, blocks: int) -> list[int]:
        """Its first ``blocks`` block hashes (each computed once, as the request's tokens are
        fixed)."""
        have = seq.hashes
        if len(have) < blocks:
            more = block_hashes(seq.tokens, self.engine.block_size)
            have[:] = [h for h, _ in zip(more, range(blocks))]
        return have[:blocks] if len(have) > blocks else have

    def _first_chunk(self, seq, budget: int, count: bool = False) -> tuple[list, int, int, int]:
        """(the cached blocks of its prefix, tokens left to compute, new blocks its first chunk
        within ``budget`` takes, how many of the cached are free) for ``seq`` joining now;
        ``count``: a scheduling lookup, counted in the cache's queries and hits."""
        size = self.engine.block_size
        target = seq.target
        hashes = self._hashes(seq, max(0, target - 1) // size)
        hit = self.pool.lookup(hashes, target, size, count)
        computed = len(hit) * size
        todo = target - computed
        first = min(todo, budget) if self.engine.chunked_prefill else todo
        blocks = self.engine.blocks_for(max(1, computed + first)) - len(hit)
        return hit, todo, blocks, self.pool.evictable(hit)

    def _reuse(self, seq, hit: list) -> None:
        """It holds the cached blocks of its prefix (one more holder each) and starts after them."""
        self.kv_used += self.pool.touch(hit)
        seq.table = list(hit)
        seq.blocks = seq.hashed = len(hit)
        seq.computed = len(hit) * self.engine.block_size
        if seq.cached_tokens < 0:  # vLLM's num_cached_tokens: its first scheduling's
            seq.cached_tokens = seq.computed

    def _cache_full(self, seq, tokens: int) -> None:
        """Its blocks filled by its first ``tokens`` tokens are cached (as vLLM caches them when
        the step that fills them is scheduled); a partial block is not."""
        full = min(tokens // self.engine.block_size, len(seq.table))
        if full <= seq.hashed:
            return
        hashes = self._hashes(seq, full)
        for b in range(seq.hashed, full):
            self.pool.cache(seq.table[b], hashes[b])
        seq.hashed = full

    def _free_cached(self, seq, blocks: int, computed: int) -> None:
        """Out of the batch with a prefix cache: its ``blocks`` (the table's, then the decoding
        ones' beyond it) are released last first, the full ones of its ``computed`` tokens cached
        first."""
        table = seq.table
        extra = blocks - len(table)
        if extra > 0:
            table.extend(self.decode_blocks[-extra:])
            del self.decode_blocks[-extra:]
        self._cache_full(seq, computed)
        self.kv_used -= self.pool.release(reversed(table))
        seq.table, seq.hashed = [], 0

    def _trim(self, seq, blocks: int) -> None:
        """Its table down to ``blocks`` (a prompt of no tokens held one for its first chunk): the
        rest released, and counted out of the blocks in use as the aggregate count already has
        them."""
        while len(seq.table) > blocks:
            self.kv_used -= self.pool.release((seq.table.pop(),))
            seq.blocks -= 1
