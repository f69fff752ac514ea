"""Prefix caching of a batching engine's KV blocks, as vLLM v1 does it
(``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``, ``kv_cache_utils.py``), at block
granularity, with or without token ids.

A request's tokens are described compactly (:class:`Tokens`): its prompt as segments ``(key,
length)``, each the first ``length`` tokens of a token run named ``key`` (equal keys: equal tokens;
distinct keys: distinct tokens), then its answer, the run named ``Tokens.answer``. A position's
token is so ``(key, offset)``, and a full block of ``block_size`` positions is hashed, as vLLM
hashes it, from the hash of the block before it and its own tokens (:func:`block_hashes`): a
block's identity depends on everything before it, and a partial last block has no hash, so it is
never cached. A live request's tokens are its token ids (:class:`TokenIds`: the ids its prompt
carries, then its answer's), a full block's tokens then being its ids, as vLLM hashes them.

:class:`BlockPool` is vLLM's block pool: blocks in use are reference-counted (a cached prefix is
shared, not allocated again); a block whose count falls to 0 goes to the tail of the free queue and
keeps its hash until it is allocated again, from the head (least recently freed first), which
evicts it from the cache. A lookup finds the longest run of a request's leading block hashes that
are cached, at most ``num_tokens - 1`` tokens (the last token is always computed, for its logits),
and counts queries and hits in tokens as vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits``
do.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Iterable, Iterator, NamedTuple

import numpy as np

#: The parent hash of a request's first block (vLLM's NONE_HASH). Keys and hashes are ints, whose
#: hash() is the same in every process (a str's is salted per process): runs are reproducible.
ROOT_HASH = 0
#: The key of the shared system prompt's tokens (:class:`qsim.mixes.SharedPrefix`).
SYSTEM_KEY = 1


def own_key(request: int) -> int:
    """The key of the new tokens of trace request ``request``'s prompt: its own, shared with
    nobody."""
    return 2 * request + 2


def answer_key(request: int) -> int:
    """The key of the tokens trace request ``request`` generates."""
    return 2 * request + 3


class Tokens(NamedTuple):
    """A request's tokens: its prompt's segments ``((key, length), ...)`` in order, and its
    answer's key."""

    prompt: tuple
    answer: int

    @property
    def prompt_tokens(self) -> int:
        return sum(length for _, length in self.prompt)

    def blocks(self, block_size: int) -> Iterator[tuple]:
        """Each full block's tokens (see :func:`_full_blocks`), endless through the answer."""
        return _full_blocks(self, block_size)

    @classmethod
    def unique(cls, request: int, prompt_tokens: int) -> "Tokens":
        """A request that shares no token with any other (its prompt and answer its own)."""
        prompt = ((own_key(request), int(prompt_tokens)),) if prompt_tokens else ()
        return cls(prompt, answer_key(request))

    def first(self, n: int) -> "Tokens":
        """Its first ``n`` prompt tokens (a prompt capped to fit a context), the same answer."""
        kept, left = [], int(n)
        for key, length in self.prompt:
            if left <= 0:
                break
            kept.append((key, min(length, left)))
            left -= length
        return Tokens(tuple(kept), self.answer)

    def spec(self) -> str:
        """The compact text a run file keeps (:meth:`parse`): ``KEY:LENGTH`` per prompt segment,
        comma-separated, then ``;`` and the answer's key, e.g. ``1:96,10:40;11``."""
        return ",".join(f"{k}:{n}" for k, n in self.prompt) + f";{self.answer}"

    @classmethod
    def parse(cls, spec: str) -> "Tokens":
        """The tokens :meth:`spec` wrote (ValueError naming the text where it is not one)."""
        try:
            segments, answer = str(spec).split(";")
            prompt = tuple(
                (int(k), int(n))
                for k, n in (part.split(":") for part in segments.split(",") if part)
            )
            if any(n < 0 for _, n in prompt):
                raise ValueError
            return cls(prompt, int(answer))
        except ValueError:
            raise ValueError(
                f"bad prompt segments {spec!r}: expected KEY:LENGTH,...;ANSWER_KEY"
            ) from None


class TokenIds(NamedTuple):
    """A request's tokens as token ids (a live request's: the ids its prompt carries or its
    tokenizer gives): its prompt's ids, then its answer's, the endless run :func:`answer_ids` of
    ``answer`` (its seed). A full block's tokens are its ids, whichever part of the request they
    come from, so two requests whose ids agree on their first k full blocks share k cached blocks,
    as vLLM's hash chain over block token ids has them; a conversation's next turn carrying the
    ids of the answer before it finds that answer's full blocks cached."""

    ids: tuple
    answer: int

    @classmethod
    def of(cls, ids) -> "TokenIds":
        """A prompt's ids, its answer seeded from them (the same prompt, the same answer: a
        deterministic engine's, as greedy decoding's)."""
        ids = tuple(int(i) for i in ids)
        return cls(ids, hash(ids))

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    def blocks(self, block_size: int) -> Iterator[tuple]:
        """Each full block's ids, prompt then answer, endless."""
        ids, n = self.ids, len(self.ids)
        whole = n - n % block_size
        for start in range(0, whole, block_size):
            yield ids[start : start + block_size]
        first = block_size - (n - whole)  # the answer's ids in the block after those
        yield ids[whole:] + answer_ids(self.answer, 0, first)
        while True:
            yield answer_ids(self.answer, first, first + block_size)
            first += block_size


#: The column in which a live run file keeps each request's tokens as :meth:`Tokens.spec` writes
#: them (the replayer's, live.replay_bodies; read by analysis.replay_inputs).
SEGMENTS = "prompt_segments"

#: The answer ids of :class:`TokenIds` are drawn from [0, ANSWER_VOCAB) (GPT-2's vocabulary).
ANSWER_VOCAB = 50257


def answer_ids(seed: int, start: int, end: int) -> tuple:
    """Ids ``start`` to ``end`` of the answer run seeded ``seed`` (:class:`TokenIds`): each a fixed
    draw (hash() of a tuple of ints is the same in every process)."""
    return tuple(hash((seed, o)) % ANSWER_VOCAB for o in range(start, end))


def render_ids(tokens, vocab: int = ANSWER_VOCAB, salt: int = 0) -> list[tuple]:
    """Each request's prompt as token ids, from its :class:`Tokens` (in trace order), such that a
    server hashing ids (:class:`TokenIds`) shares exactly the blocks the simulator's keys share: a
    key's run a seeded draw from [16, vocab) (``salt``: a run's own, so that a server that ran the
    trace before has none of its blocks cached), an earlier request's answer the ids a synthetic
    engine generates for it (:func:`answer_ids`, seeded from that request's prompt ids). An answer
    of a request not rendered before (a later one's) is a seeded draw too: no engine gave it."""
    seeds: dict[int, int] = {}  # answer key -> its answer's seed
    out = []
    for request in tokens:
        ids: list[int] = []
        for key, length in request.prompt:
            if key in seeds:
                ids.extend(answer_ids(seeds[key], 0, length))
            else:
                ids.extend(np.random.default_rng((salt, key)).integers(16, vocab, size=length))
        rendered = tuple(int(i) for i in ids)
        seeds[request.answer] = TokenIds.of(rendered).answer
        out.append(rendered)
    return out


def _full_blocks(tokens: Tokens, block_size: int) -> Iterator[tuple]:
    """Each full block's tokens, as runs ``(key, first offset, end offset)``: prompt, then
    answer."""
    piece: list = []
    room = block_size
    segments = (*tokens.prompt, (tokens.answer, math.inf))  # the answer: as long as it is asked
    for key, length in segments:
        offset = 0
        while offset < length:
            take = min(room, length - offset)
            piece.append((key, offset, offset + take))
            offset += take
            room -= take
            if room == 0:
                yield tuple(piece)
                piece, room = [], block_size


def block_hashes(tokens: "Tokens | TokenIds", block_size: int) -> Iterator[int]:
    """The chained hash of each full block of ``tokens``, first block first (vLLM's
    hash_block_tokens: hash((parent hash, the block's tokens))); endless, through the answer: take
    what is needed."""
    parent = ROOT_HASH
    for piece in tokens.blocks(block_size):
        parent = hash((parent, piece))
        yield parent


class BlockPool:
    """Physical KV blocks: reference counts, the free queue (least recently freed at its head) and
    the cache of full blocks by hash; see the module. ``capacity`` inf: never-used blocks never run
    out."""

    def __init__(self, capacity: float) -> None:
        self.fresh = capacity  # never-used blocks: the head of vLLM's free queue at start
        self.next_id = 0
        self.free: OrderedDict[int, None] = OrderedDict()  # freed blocks, oldest first
        self.ref: dict[int, int] = {}  # blocks in use -> holders
        self.hash_of: dict[int, int] = {}  # cached blocks (in use or free) -> hash
        # hash -> its blocks (a dict as an ordered set): two requests computing the same block at
        # once both cache it, as vLLM's cached_block_hash_to_block does; a lookup finds the first.
        self.by_hash: dict[int, dict[int, None]] = {}
        self.queries = 0  # tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of them, tokens found cached (prefix_cache_hits)
        self.evictions = 0

    @property
    def in_use(self) -> int:
        return len(self.ref)

    def lookup(
        self, hashes: Iterable[int], num_tokens: int, block_size: int, count: bool = True
    ) -> list[int]:
        """The cached blocks of the longest cached prefix of a request of ``num_tokens`` tokens
        whose block hashes are ``hashes``: at most (num_tokens - 1) // block_size blocks.
        ``count``: a scheduling lookup, counted in queries and hits (False: a probe, as
        admission's)."""
        limit = max(0, num_tokens - 1) // block_size
        found = []
        for h, _ in zip(hashes, range(limit)):
            blocks = self.by_hash.get(h)
            if not blocks:
                break
            found.append(next(iter(blocks)))
        if count:
            self.queries += num_tokens
            self.hits += len(found) * block_size
        return found

    def evictable(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` are free (reusing them takes them off the free queue)."""
        return sum(1 for b in blocks if b not in self.ref)

    def touch(self, blocks: Iterable[int]) -> int:
        """One more holder of each block; returns how many were free (now in use)."""
        taken = 0
        for b in blocks:
            held = self.ref.get(b, 0)
            if held == 0:
                del self.free[b]
                taken += 1
            self.ref[b] = held + 1
        return taken

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the head of the free queue, in use by one holder; a cached one is
        evicted."""
        out = []
        for _ in range(n):
            if self.fresh > 0:
                self.fresh -= 1
                b = self.next_id
                self.next_id += 1
            else:
                b, _ = self.free.popitem(last=False)
                self._evict(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def _evict(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is None:
            return
        self.evictions += 1
        blocks = self.by_hash[h]
        del blocks[block]
        if not blocks:
            del self.by_hash[h]

    def cache(self, block: int, h: int) -> None:
        """A full block now holds the tokens hashed ``h``: later lookups find it."""
        if block in self.hash_of:
            return
        self.hash_of[block] = h
        self.by_hash.setdefault(h, {})[block] = None

    def release(self, blocks: Iterable[int]) -> int:
        """One holder fewer of each block, in the order given (vLLM frees a request's blocks last
        first, so that its tail is evicted before its prefix); returns how many became free."""
        freed = 0
        for b in blocks:
            held = self.ref[b] - 1
            if held:
                self.ref[b] = held
            else:
                del self.ref[b]
                self.free[b] = None
                freed += 1
        return freed

    def audit(self, capacity: float, holders: dict[int, int]) -> None:
        """AssertionError where the pool's books disagree with ``holders`` (block -> holders
        counted from the requests) or with the capacity."""
        what = "prefix cache:"
        assert self.ref == holders, f"{what} reference counts differ from the blocks requests hold"
        assert not set(self.ref) & set(self.free), f"{what} a block in use is on the free queue"
        if capacity != math.inf:
            assert self.fresh + len(self.free) + len(self.ref) == capacity, (
                f"{what} {self.fresh} fresh + {len(self.free)} free + {len(self.ref)} in use "
                f"!= {capacity} blocks"
            )
        for h, blocks in self.by_hash.items():
            assert all(self.hash_of.get(b) == h for b in blocks), f"{what} hash index out of date"
