"""A trace a chunk of requests at a time, in the memory of one chunk: what a streamed run
(:mod:`qsim.stream`) reads.

:meth:`qsim.workload.TracePlan.chunks` draws a synthetic trace's requests a chunk at a time, the
same values that :func:`qsim.workload.make_trace` draws whole; :meth:`qsim.trace.Trace.chunks` cuts
a trace in memory.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

#: Values drawn at a time where a stream is drawn through only to find where it ends.
PIECE = 1 << 16


@dataclass(frozen=True)
class TraceChunks:
    """A trace as consecutive chunks of ``size`` requests (the last: what is left), each a
    :class:`qsim.trace.Trace` whose request_id counts from 0. ``requests``, ``duration_s``, ``meta``
    and ``name`` are the whole trace's. Each iteration draws the chunks again from the start (the
    same ones)."""

    requests: int
    size: int
    duration_s: float
    name: str
    meta: dict = field(compare=False)
    # Traces of qsim.trace and qsim.workload, which build on this module.
    draw: Callable[[], Iterator] = field(compare=False, repr=False)

    def __iter__(self) -> Iterator:
        return self.draw()


def spans(count: int, size: int | None) -> Iterator[tuple[int, int]]:
    """(lo, hi) of consecutive pieces of at most ``size`` (None: one) that cover range(count)."""
    step = max(count if size is None else size, 1)
    return ((lo, min(lo + step, count)) for lo in range(0, count, step))


def exactly(pieces: Iterable[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """The values of ``pieces`` in order, cut again into arrays of exactly ``size`` (the last:
    what is left)."""
    held: list[np.ndarray] = []
    count = 0
    for piece in pieces:
        while piece.size:
            take = min(size - count, piece.size)
            held.append(piece[:take])
            count += take
            piece = piece[take:]
            if count == size:
                yield np.concatenate(held)
                held, count = [], 0
    if count:
        yield np.concatenate(held)


class BlockStream:
    """One random stream as :func:`qsim.workload.make_trace` draws it, served a chunk of requests at
    a time.

    make_trace draws a stream in blocks of one value per request: a uniform for every request, then
    (say) a normal for every request. Drawn a chunk at a time, a chunk's k-th draw takes its values
    from block k at the chunk's place in it, from a generator of the block's own. Block k's
    generator is set at its start by drawing blocks 0..k-1 through once, a piece at a time: a numpy
    Generator draws n values in pieces exactly as it draws them at once. It has the Generator
    methods the workload's draws use, each called with one size per request of the chunk;
    :meth:`chunk` starts a chunk.
    """

    def __init__(self, rng: np.random.Generator, n: int) -> None:
        self._n = n
        self._blocks: list[np.random.Generator] = []
        self._start = rng  # where the next new block starts, while the last block's start is known
        self._last: tuple | None = None  # (a copy of the last block's start, how it draws)
        self._k = 0

    def chunk(self) -> None:
        self._k = 0

    def _draw(
        self, draw: Callable[[np.random.Generator, int], np.ndarray], size: int
    ) -> np.ndarray:
        k = self._k
        self._k += 1
        # a block not drawn before: find its start, after the blocks before it
        if k == len(self._blocks):
            start = self._start
            if self._last is not None:
                start, drew = self._last
                for lo, hi in spans(self._n, PIECE):
                    drew(start, hi - lo)
            self._last = (copy.deepcopy(start), draw)
            self._blocks.append(start)
        return draw(self._blocks[k], size)

    def random(self, size: int) -> np.ndarray:
        return self._draw(lambda g, m: g.random(m), size)

    def standard_normal(self, size: int) -> np.ndarray:
        return self._draw(lambda g, m: g.standard_normal(m), size)

    def standard_exponential(self, size: int) -> np.ndarray:
        return self._draw(lambda g, m: g.standard_exponential(m), size)

    def lognormal(self, mean: float, sigma: float, size: int) -> np.ndarray:
        return self._draw(lambda g, m: g.lognormal(mean, sigma, m), size)

    def integers(self, low: int, high: int, size: int) -> np.ndarray:
        return self._draw(lambda g, m: g.integers(low, high, m), size)
