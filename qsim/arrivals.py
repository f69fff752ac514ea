"""Seeded arrival processes: renewal (Poisson, constant, gamma), a surge, a burst, periodic
bursts, each drawn whole or in pieces of a given size (the same numbers), and the specs that
name them (:data:`ARRIVALS`, :func:`parse_arrivals`), with whether one takes a load.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from .chunks import spans

ARRIVALS = (
    "poisson",
    "constant",
    "gamma:CV",
    "periodic:PERIOD_S",
    "surge:START_S:LENGTH_S:LOAD",
    "burst:N",
    "periodic:N:PERIOD_S",
)
#: The arrival processes whose size sets their rate: they take no load (giving one is an error).
SIZED = ("burst:N", "periodic:N:PERIOD_S")


def _unit_gaps(kind: str, rng: np.random.Generator, n: int, cv: float) -> np.ndarray:
    """n inter-arrival gaps with mean 1, drawn in request order from ``rng``."""
    if kind == "poisson":
        return rng.standard_exponential(n)
    if kind == "constant":
        return np.ones(n)
    if kind == "gamma":
        shape = 1.0 / cv**2
        return rng.standard_gamma(shape, n) / shape
    raise ValueError(f"unknown arrival process {kind!r}")


def renewal_pieces(
    kind: str,
    rng: np.random.Generator,
    rate: float,
    *,
    seconds=None,
    requests=None,
    cv=1.0,
    size: int | None = None,
) -> Iterator[np.ndarray]:
    """:func:`renewal_arrivals`'s times in pieces of at most ``size`` (None: as they are drawn), the
    same numbers: the gaps are drawn in request order, and each piece's running sum goes on from the
    last one's."""
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"arrival rate must be a positive number, got {rate}")
    if requests is not None:
        return _running_sums(kind, rng, int(requests), cv, rate, 0.0, size)
    return _before(_rounds(kind, rng, rate, int(rate * seconds * 1.1) + 64, cv, size), seconds)


def _running_sums(
    kind: str,
    rng: np.random.Generator,
    count: int,
    cv: float,
    rate: float,
    start: float,
    size: int | None,
) -> Iterator[np.ndarray]:
    """start + the running sum of ``count`` unit gaps / rate, in pieces. A piece's sum starts from
    the last one's: the carry leads the cumsum and is dropped after, so the additions are those of
    one cumsum."""
    carry = 0.0
    for lo, hi in spans(count, size):
        units = np.cumsum(np.concatenate(([carry], _unit_gaps(kind, rng, hi - lo, cv))))[1:]
        carry = units[-1]
        yield start + units / rate


def _rounds(
    kind: str, rng: np.random.Generator, rate: float, count: int, cv: float, size: int | None
) -> Iterator[np.ndarray]:
    """Rounds of ``count`` gaps without end, each from the last time of the round before."""
    start = 0.0
    while True:
        for times in _running_sums(kind, rng, count, cv, rate, start, size):
            yield times
        start = times[-1]


def _before(pieces: Iterator[np.ndarray], seconds: float | None) -> Iterator[np.ndarray]:
    """The times of nondecreasing ``pieces`` before ``seconds`` (all where None), up to the first
    past it."""
    for times in pieces:
        below = times if seconds is None else times[times < seconds]
        if below.size:
            yield below
        if below.size < times.size:
            return


def renewal_arrivals(
    kind: str, rng: np.random.Generator, rate: float, *, seconds=None, requests=None, cv=1.0
) -> np.ndarray:
    """Arrival times of a renewal process at ``rate``: the first ``requests``, or all before
    ``seconds``.

    The first arrival comes one gap after time 0, as in a stationary process seen from an empty
    system.
    """
    return _whole(renewal_pieces(kind, rng, rate, seconds=seconds, requests=requests, cv=cv))


def _whole(pieces: Iterator[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.empty(0), *pieces])


def surge_pieces(
    rng: np.random.Generator,
    rate: float,
    surge_rate: float,
    start_s: float,
    length_s: float,
    *,
    seconds=None,
    requests=None,
    size: int | None = None,
) -> Iterator[np.ndarray]:
    """:func:`surge_arrivals`'s times in pieces of at most ``size`` (None: as drawn), the same
    numbers."""
    if requests is not None:
        unit = renewal_pieces("poisson", rng, 1.0, requests=requests, size=size)
    else:  # enough unit points to pass ``seconds`` at the higher of the two rates
        unit = renewal_pieces(
            "poisson", rng, 1.0, seconds=max(rate, surge_rate) * seconds + 1.0, size=size
        )
    # Integrated rate at the surge's two ends; between them it grows at surge_rate, elsewhere at
    # rate.
    a = rate * start_s
    b = a + surge_rate * length_s
    return _before(
        (
            np.where(
                u <= a,
                u / rate,
                np.where(
                    u <= b, start_s + (u - a) / surge_rate, start_s + length_s + (u - b) / rate
                ),
            )
            for u in unit
        ),
        seconds,
    )


def surge_arrivals(
    rng: np.random.Generator,
    rate: float,
    surge_rate: float,
    start_s: float,
    length_s: float,
    *,
    seconds=None,
    requests=None,
) -> np.ndarray:
    """A Poisson process at ``rate``, and at ``surge_rate`` from ``start_s`` for ``length_s``
    seconds.

    Drawn by time change from the same unit-rate gaps as ``poisson`` (common random numbers: request
    i's gap is the same draw at every load): a unit point at s maps to the time where the integrated
    rate is s.
    """
    return _whole(
        surge_pieces(rng, rate, surge_rate, start_s, length_s, seconds=seconds, requests=requests)
    )


def burst_pieces(n: int, at_s: float = 0.0, size: int | None = None) -> Iterator[np.ndarray]:
    """n requests arriving at the same instant, in pieces of at most ``size``."""
    return (np.full(hi - lo, float(at_s)) for lo, hi in spans(int(n), size))


def burst_arrivals(n: int, at_s: float = 0.0) -> np.ndarray:
    """n requests arriving at the same instant."""
    return _whole(burst_pieces(n, at_s))


def periodic_pieces(
    n: int, period_s: float, *, seconds=None, requests=None, size: int | None = None
) -> Iterator[np.ndarray]:
    """:func:`periodic_bursts`'s times in pieces of at most ``size``."""
    if not period_s > 0:
        raise ValueError(f"burst period must be > 0, got {period_s}")
    count = int(requests) if requests is not None else int(n) * math.ceil(seconds / period_s)
    return ((np.arange(lo, hi) // int(n)) * float(period_s) for lo, hi in spans(count, size))


def periodic_bursts(n: int, period_s: float, *, seconds=None, requests=None) -> np.ndarray:
    """A burst of n every period_s, starting at 0: as many as fit before ``seconds``, or
    ``requests`` in all."""
    return _whole(periodic_pieces(n, period_s, seconds=seconds, requests=requests))


def periodic_at_rate_pieces(
    rate: float, period_s: float, *, seconds=None, requests=None, size: int | None = None
) -> Iterator[np.ndarray]:
    """:func:`periodic_at_rate`'s times in pieces of at most ``size``."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"arrival rate must be a positive number, got {rate}")
    if not period_s > 0:
        raise ValueError(f"burst period must be > 0, got {period_s}")
    per_burst = rate * period_s
    count = int(requests) if requests is not None else math.ceil(seconds * rate - 1e-9)
    # The tolerance keeps request k * per_burst (a whole number in exact arithmetic) in burst k.
    return (
        np.floor(np.arange(lo, hi) / per_burst + 1e-9) * float(period_s)
        for lo, hi in spans(count, size)
    )


def periodic_at_rate(rate: float, period_s: float, *, seconds=None, requests=None) -> np.ndarray:
    """Bursts every period_s from 0 at a mean ``rate``: the requests a constant-rate process would
    send in each period, all at the period's start (request i at floor(i / (rate * period_s)) *
    period_s).

    A burst holds rate * period_s requests on average; where that is not whole, bursts of its floor
    and its ceiling alternate so that every window of whole periods has the rate exactly. With
    ``seconds``: the requests a constant rate sends before it (the last burst is of the part of its
    period inside the window).
    """
    return _whole(periodic_at_rate_pieces(rate, period_s, seconds=seconds, requests=requests))


def parse_arrivals(spec: str) -> tuple[str, tuple[float, ...]]:
    """One of :data:`ARRIVALS` -> (kind, numbers). A surge is Poisson at the workload's load, and at
    LOAD from START_S for LENGTH_S; ``periodic:PERIOD_S`` is a burst every PERIOD_S whose size
    follows the load (:func:`periodic_at_rate`), ``periodic:N:PERIOD_S`` one of N (its rate is its
    own: it takes no load)."""
    kind, *args = spec.split(":")
    arity = {
        "poisson": (0,),
        "constant": (0,),
        "gamma": (1,),
        "burst": (1,),
        "periodic": (1, 2),
        "surge": (3,),
    }
    if kind not in arity or len(args) not in arity[kind]:
        raise ValueError(f"bad arrival process {spec!r}; expected one of {', '.join(ARRIVALS)}")
    try:
        numbers = tuple(float(a) for a in args)
    except ValueError:
        raise ValueError(
            f"bad arrival process {spec!r}: {':'.join(args)!r} is not a number"
        ) from None
    # A surge may start at time 0; every other number is a size, a length or a rate.
    if any(
        not (x > 0 and math.isfinite(x))
        for j, x in enumerate(numbers)
        if not (kind == "surge" and j == 0 and x == 0)
    ):
        raise ValueError(f"bad arrival process {spec!r}: its numbers must be positive")
    if not takes_load(kind, numbers) and numbers[0] != int(numbers[0]):
        raise ValueError(f"bad arrival process {spec!r}: a burst size is a whole number")
    return kind, numbers


def takes_load(kind: str, numbers: tuple[float, ...]) -> bool:
    """Whether a parsed arrival process's rate comes from the load (False: from its own burst
    size)."""
    return not (kind == "burst" or (kind == "periodic" and len(numbers) == 2))


def arrivals_take_load(spec: str) -> bool:
    """Whether the arrival process ``spec`` takes a load (ValueError for a bad spec)."""
    return takes_load(*parse_arrivals(spec))


def check_load(spec: str, load: float | None) -> None:
    """ValueError when a load is given to a process that takes none (it would be ignored)."""
    kind, numbers = parse_arrivals(spec)
    if load is not None and not takes_load(kind, numbers):
        what = f"a burst of {numbers[0]:g}" + (
            f" every {numbers[1]:g} s" if kind == "periodic" else ""
        )
        raise ValueError(
            f"arrivals {spec!r} take no load ({what}: the size sets the rate); leave "
            "the load out, "
            "or give periodic:PERIOD_S, whose burst size follows the load"
        )
