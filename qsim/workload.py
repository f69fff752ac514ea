"""Workloads: size mixes, seeded arrival processes, service times (reading trace files, and building a trace
from a command's options: :mod:`qsim.tracefiles`).

Common random numbers: a seed is split into independent streams for arrival
gaps, sizes and service noise, and every stream is consumed in request order.
So the same seed gives request i the same gap (in units of the mean gap), size
and true service time whatever the policy, and at every load.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
from scipy import stats

from .chunks import PIECE, BlockStream, TraceChunks, exactly, spans
from .clients import Patience
from .datasets import Dataset
from .prefix import SYSTEM_KEY, Tokens, answer_key, own_key
from .service import ServiceModel

ARRIVALS = ("poisson", "constant", "gamma:CV", "periodic:PERIOD_S", "surge:START_S:LENGTH_S:LOAD", "burst:N",
            "periodic:N:PERIOD_S")
#: The arrival processes whose size sets their rate: they take no load (giving one is an error).
SIZED = ("burst:N", "periodic:N:PERIOD_S")
#: The load of a process that takes one when none is given (``qlab simulate``'s default).
DEFAULT_LOAD = 0.9
SERVICES = ("mix", "exponential", "deterministic")


@dataclass(frozen=True)
class Mix:
    """Size classes (max_new_tokens) and their probabilities."""

    sizes: tuple[int, ...] = (4, 16, 64)
    probs: tuple[float, ...] = (0.5, 0.35, 0.15)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.probs) or not self.sizes:
            raise ValueError("a mix needs as many probabilities as sizes, and at least one")
        if any(s < 1 for s in self.sizes) or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"mix sizes must be distinct, increasing and >= 1, got {self.sizes}")
        if any(p < 0 for p in self.probs) or not math.isclose(sum(self.probs), 1.0, abs_tol=1e-9):
            raise ValueError(f"mix probabilities must be >= 0 and sum to 1, got {self.probs}")

    def mean_s(self, model: ServiceModel) -> float:
        return float(np.dot(self.probs, model.estimate(self.sizes)))

    def second_moment_s(self, model: ServiceModel) -> float:
        return float(np.dot(self.probs, model.estimate(self.sizes) ** 2))

    def scv(self, model: ServiceModel) -> float:
        """Squared coefficient of variation of the service time."""
        mean = self.mean_s(model)
        return self.second_moment_s(model) / mean**2 - 1.0

    def capacity(self, model: ServiceModel, engines: int = 1) -> float:
        """Requests per second that ``engines`` engines can serve at the calibrated speed."""
        return engines / self.mean_s(model)

    def size_class(self, tokens) -> np.ndarray:
        """Label each token count by the smallest mix size that holds it ('16' = up to 16 tokens)."""
        tokens = np.asarray(tokens)
        edges = np.asarray(self.sizes)
        labels = np.array([str(s) for s in self.sizes] + [f">{self.sizes[-1]}"], dtype=object)
        return labels[np.searchsorted(edges, tokens, side="left")]


REFERENCE_MIX = Mix()


@dataclass(frozen=True)
class UsedShare:
    """How much of its limit (max_new_tokens) a request generates before it stops.

    A share ``at_limit`` of requests runs to the limit; the others stop early (a stop string, an
    end of text) at a share of it drawn lognormal with median ``median`` and log-sd ``sigma``,
    at least one token. The default is the reference study's measurement: 60 prompts with a
    limit of 64 and a full-stop stop string, 56 stopped on the string and 4 at the limit, median
    8.5 tokens (13 % of the limit), from 1 to 64.
    """

    at_limit: float = 4 / 60
    median: float = 8.5 / 64
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.at_limit <= 1:
            raise ValueError(f"at_limit must be a share in [0, 1], got {self.at_limit}")
        if not 0 < self.median <= 1:
            raise ValueError(f"median used share must be in (0, 1], got {self.median}")
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError(f"sigma must be a finite number >= 0, got {self.sigma}")

    def mean_tokens(self, limit: int) -> float:
        """Expected tokens generated at this limit, exactly: the rounded, clipped lognormal summed by scipy."""
        t = np.arange(1, limit + 1, dtype=float)
        if self.sigma == 0:
            early = float(np.clip(np.round(self.median * limit), 1, limit))
        else:
            cdf = stats.lognorm(s=self.sigma, scale=self.median).cdf
            edges = cdf(np.concatenate([[0.0], (t[:-1] + 0.5) / limit, [np.inf]]))
            early = float(np.dot(np.diff(edges), t))  # the last bin holds every share rounded up to the limit
        return self.at_limit * limit + (1 - self.at_limit) * early

    def draw(self, rng: np.random.Generator, limits) -> np.ndarray:
        """Tokens generated by requests of these limits: two draws each, in request order."""
        limits = np.asarray(limits, dtype=np.int64)
        full = rng.random(len(limits)) < self.at_limit
        share = np.minimum(1.0, self.median * np.exp(self.sigma * rng.standard_normal(len(limits))))
        early = np.clip(np.round(share * limits), 1, limits).astype(np.int64)
        return np.where(full, limits, early)


@dataclass(frozen=True)
class Prompts:
    """How long requests' prompts are, in tokens: ``none`` (0, the reference study's short prompts counted as
    nothing), ``fixed:N``, ``uniform:LOW:HIGH`` (whole numbers, both ends included) or ``lognormal:MEDIAN:SIGMA``
    (rounded, at least 1). A batching engine computes them before the first token (:mod:`qsim.batch`)."""

    kind: str = "none"
    a: float = 0.0
    b: float = 0.0

    KINDS = {"none": 0, "fixed": 1, "uniform": 2, "lognormal": 2}

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"prompt lengths are none, fixed:N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA, "
                             f"got {self.kind!r}")
        if self.kind in ("fixed", "uniform") and not (self.a >= 0 and self.a == int(self.a)):
            raise ValueError(f"prompt lengths are whole numbers of tokens >= 0, got {self.a}")
        if self.kind == "uniform" and not (self.b >= self.a and self.b == int(self.b)):
            raise ValueError(f"uniform prompt lengths need LOW <= HIGH, whole numbers, got {self.a}, {self.b}")
        if self.kind == "lognormal" and not (self.a >= 1 and self.b >= 0 and math.isfinite(self.a * self.b)):
            raise ValueError(f"lognormal prompt lengths need a median >= 1 and a sigma >= 0, got {self.a}, {self.b}")

    @classmethod
    def parse(cls, spec: str) -> "Prompts":
        kind, *numbers = str(spec).strip().split(":")
        if kind not in cls.KINDS or len(numbers) != cls.KINDS[kind]:
            raise ValueError(f"bad prompt lengths {spec!r}: expected none, fixed:N, uniform:LOW:HIGH or "
                             "lognormal:MEDIAN:SIGMA")
        try:
            return cls(kind, *(float(x) for x in numbers))
        except ValueError as exc:
            raise ValueError(f"bad prompt lengths {spec!r}: {exc}") from None

    @property
    def spec(self) -> str:
        return {"none": "none", "fixed": f"fixed:{self.a:g}", "uniform": f"uniform:{self.a:g}:{self.b:g}",
                "lognormal": f"lognormal:{self.a:g}:{self.b:g}"}[self.kind]

    def mean(self) -> float:
        if self.kind == "none":
            return 0.0
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return float(np.mean(self.draw(np.random.default_rng(0), 200_000)))  # rounding and the floor of 1

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "none":
            return np.zeros(n, dtype=np.int64)
        if self.kind == "fixed":
            return np.full(n, int(self.a), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b) + 1, n).astype(np.int64)
        return np.maximum(1, np.round(self.a * np.exp(self.b * rng.standard_normal(n)))).astype(np.int64)


@dataclass(frozen=True)
class SharedPrefix:
    """Prompts that share tokens, for a prefix cache (:mod:`qsim.prefix`): a system prompt and
    conversations. A request's drawn prompt length (:class:`Prompts`) is its own new tokens.

    system_tokens, system_share: a system prompt of S tokens, the same for all, is put before the
    prompt of a share p of the conversations (each drawn, from the trace's eighth stream). turns,
    conversations: each conversation has T turns; turn k's prompt is turn k - 1's prompt, its
    answer (the tokens it generates) and the new tokens of turn k. Requests are dealt in arrival
    order to C conversations open at once, round robin, each replaced by a new one after its T
    turns: a turn follows the one before it C arrivals later. T = 1: every request is a
    conversation alone. Spec: ``S:P`` (:meth:`parse_system`) and ``T:C`` (:meth:`parse_turns`);
    none is ``0:0`` / ``1``.
    """

    system_tokens: int = 0
    system_share: float = 0.0
    turns: int = 1
    conversations: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.system_tokens, int) and self.system_tokens >= 0):
            raise ValueError("a system prompt is a whole number of tokens >= 0, "
                             f"got {self.system_tokens!r}")
        if not 0 <= self.system_share <= 1:
            raise ValueError(f"the system prompt's share is in [0, 1], got {self.system_share}")
        for name in ("turns", "conversations"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")

    @property
    def shares(self) -> bool:
        """Whether any two requests share a token."""
        return (self.system_tokens > 0 and self.system_share > 0) or self.turns > 1

    @staticmethod
    def parse_system(spec: str) -> tuple[int, float]:
        """``S:P``: a system prompt of S tokens before a share P of the prompts ("none": 0:0)."""
        if str(spec).strip() == "none":
            return 0, 0.0
        try:
            tokens, share = str(spec).split(":")
            return int(tokens), float(share)
        except ValueError:
            raise ValueError(f"bad system prompt {spec!r}: expected TOKENS:SHARE, "
                             "e.g. 512:0.8") from None

    @staticmethod
    def parse_turns(spec: str) -> tuple[int, int]:
        """``T`` or ``T:C``: conversations of T turns, C of them open at once (default 16)."""
        try:
            turns, _, open_at_once = str(spec).partition(":")
            return int(turns), int(open_at_once or 16)
        except ValueError:
            raise ValueError(f"bad turns {spec!r}: expected TURNS or TURNS:CONVERSATIONS, "
                             "e.g. 4:16") from None

    @classmethod
    def parse(cls, system: str = "none", turns: str = "1") -> "SharedPrefix":
        """From the two specs (ValueError naming what is wrong)."""
        return cls(*cls.parse_system(system), *cls.parse_turns(turns))

    def compose(self, rng: np.random.Generator, own: np.ndarray, answers: np.ndarray):
        """(prompt lengths, token identities) of requests whose own new tokens are ``own`` and
        whose answers are ``answers`` long: one uniform per request (whether its conversation has
        the system prompt, read at its first turn), in request order."""
        n = len(own)
        system = rng.random(n) < self.system_share
        prompts = np.empty(n, dtype=np.int64)
        ids = np.empty(n, dtype=object)
        history: dict[int, tuple] = {}  # open conversation -> its next prompt's segments so far
        for i in range(n):
            slot, rounds = i % self.conversations, i // self.conversations
            if rounds % self.turns == 0:  # a new conversation in this slot
                history[slot] = ((SYSTEM_KEY, self.system_tokens),) \
                    if system[i] and self.system_tokens else ()
            segments = history[slot] + (((own_key(i), int(own[i])),) if own[i] else ())
            ids[i] = Tokens(segments, answer_key(i))
            prompts[i] = sum(length for _, length in segments)
            history[slot] = segments + ((answer_key(i), int(answers[i])),)
        return prompts, ids


def _used_of(used, size: int) -> "UsedShare | None":
    return used if isinstance(used, UsedShare) else used.get(size)


def used_mean_s(mix: Mix, clients: tuple, model: ServiceModel, used) -> float:
    """Mean calibrated time of the work requests actually do (tokens generated), over the blend's mixes."""
    shares, mixes = blend(mix, clients)
    def mean_of(m: Mix) -> float:
        tokens = [s if _used_of(used, s) is None else _used_of(used, s).mean_tokens(s) for s in m.sizes]
        return float(np.dot(m.probs, model.estimate(tokens)))
    return float(np.dot(shares, [mean_of(m) for m in mixes]))


def used_tokens(rng: np.random.Generator, limits, used) -> np.ndarray:
    """Tokens generated: ``used`` is one :class:`UsedShare` for every request, or a mapping from a
    limit to its class's (limits missing from it run to the limit)."""
    limits = np.asarray(limits, dtype=np.int64)
    if isinstance(used, UsedShare):
        return used.draw(rng, limits)
    out = limits.copy()
    draws = {size: share.draw(rng, limits) for size, share in sorted(used.items())}  # every class draws for all
    for size, tokens in draws.items():
        out = np.where(limits == size, tokens, out)
    return out


@dataclass(frozen=True)
class Client:
    """One sender in a workload: its share of the arrivals, its priority and its own size mix.

    A workload of clients draws each request's client independently with probability ``share``
    (so each client's arrivals are a thinned Poisson stream when the whole is Poisson), then its
    size from that client's ``mix`` (None: the workload's). ``priority`` is sent with every request
    (higher first under a priority discipline; below 0 sheddable).
    """

    name: str
    share: float
    priority: int = 0
    mix: Mix | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a client needs a name")
        if not (0 < self.share <= 1):
            raise ValueError(f"client {self.name!r}: share must be in (0, 1], got {self.share}")


def blend(mix: Mix, clients: tuple[Client, ...] = ()) -> tuple[list[float], list[Mix]]:
    """The mixes requests are drawn from and the share of each: each client's own (the workload's
    ``mix`` where it has none), or ``mix`` alone without clients. Checks the clients."""
    check_clients(clients)
    if not clients:
        return [1.0], [mix]
    return [c.share for c in clients], [c.mix or mix for c in clients]


def blended_means(mix: Mix, clients: tuple[Client, ...], model: ServiceModel) -> tuple[float, float]:
    """Mean calibrated service time and mean max_new_tokens of a request drawn from :func:`blend`."""
    shares, mixes = blend(mix, clients)
    return (float(np.dot(shares, [m.mean_s(model) for m in mixes])),
            float(np.dot(shares, [np.dot(m.sizes, m.probs) for m in mixes])))


def check_clients(clients: tuple[Client, ...]) -> None:
    """Clients of one workload: distinct names, shares that sum to 1."""
    names = [c.name for c in clients]
    if len(set(names)) != len(names):
        raise ValueError(f"client names must be distinct, got {names}")
    if clients and not math.isclose(sum(c.share for c in clients), 1.0, abs_tol=1e-9):
        raise ValueError(f"client shares must sum to 1, got {[c.share for c in clients]}")


@dataclass(frozen=True)
class Trace:
    """Arrivals with everything the executors need, one entry per request.

    est_service_s is the calibrated estimate (before speed tracking);
    true_service_s what the engine will take; deadline_s is relative to arrival,
    NaN meaning the policy default. priority and client_id are what the request
    is sent with (client_id None: no client). duration_s is the arrival window
    used for rates (goodput); 0 for a single burst. patience_s is how long each
    client waits from its first send (inf: forever; see :class:`qsim.clients.Patience`).
    tokens_generated is the work each request will actually do (max_new_tokens unless it stops
    early, :class:`UsedShare`); true_service_s follows it, est_service_s the limit.
    """

    arrival_s: np.ndarray
    max_new_tokens: np.ndarray
    size_class: np.ndarray
    est_service_s: np.ndarray
    true_service_s: np.ndarray
    deadline_s: np.ndarray
    prompt_tokens: np.ndarray
    priority: np.ndarray
    client_id: np.ndarray
    duration_s: float
    name: str = "trace"
    meta: dict = field(default_factory=dict)
    patience_s: np.ndarray | None = None
    tokens_generated: np.ndarray | None = None
    # Each request's token identities (qsim.prefix.Tokens, an object array) where prompts share
    # prefixes (SharedPrefix); None: no request shares a token with another. A prefix cache reads
    # it.
    tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        patience = np.full(len(self.arrival_s), math.inf) if self.patience_s is None else self.patience_s
        object.__setattr__(self, "patience_s", np.asarray(patience, dtype=float))
        used = self.max_new_tokens if self.tokens_generated is None else self.tokens_generated
        object.__setattr__(self, "tokens_generated", np.asarray(used, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def request_id(self) -> np.ndarray:
        return np.arange(len(self), dtype=np.int64)

    def rows(self, lo: int, hi: int) -> "Trace":
        """Requests lo to hi - 1 as a trace of their own (request_id from 0; duration, name and meta the whole's)."""
        part = slice(lo, hi)
        return Trace(self.arrival_s[part], self.max_new_tokens[part], self.size_class[part], self.est_service_s[part],
                     self.true_service_s[part], self.deadline_s[part], self.prompt_tokens[part], self.priority[part],
                     self.client_id[part], self.duration_s, self.name, self.meta, self.patience_s[part],
                     self.tokens_generated[part],
                     None if self.tokens is None else self.tokens[part])

    def chunks(self, size: int) -> TraceChunks:
        """This trace ``size`` requests at a time (what a streamed run reads: :mod:`qsim.stream`)."""
        if not (isinstance(size, (int, np.integer)) and size >= 1):
            raise ValueError(f"a chunk holds a whole number >= 1 of requests, got {size!r}")
        return TraceChunks(len(self), int(size), self.duration_s, self.name, self.meta,
                           lambda: (self.rows(lo, hi) for lo, hi in spans(len(self), int(size))))

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "request_id": self.request_id,
                "arrival_s": self.arrival_s,
                "max_new_tokens": self.max_new_tokens,
                "size_class": pd.array(self.size_class, dtype="string"),
                "est_service_s": self.est_service_s,
                "true_service_s": self.true_service_s,
                "deadline_s": self.deadline_s,
                "prompt_tokens": self.prompt_tokens,
                "priority": self.priority,
                "client_id": pd.array(self.client_id, dtype="string"),
                # Only where someone is impatient: a file without the column reads back as patient.
                **({"patience_s": self.patience_s} if np.isfinite(self.patience_s).any() else {}),
                **({"tokens_generated": self.tokens_generated}
                   if (self.tokens_generated != self.max_new_tokens).any() else {}),
            }
        )

    def save(self, path: str | Path) -> None:
        """Write the per-request file that :func:`qsim.tracefiles.load_trace` reads back (.parquet or .csv)."""
        frame = self.to_frame()
        if str(path).endswith(".parquet"):
            frame.to_parquet(path, index=False)
        else:
            frame.to_csv(path, index=False)


def assemble_trace(arrival_s, tokens, est, true, *, mix, duration_s, name, meta, deadline_s=None,
                   prompt_tokens=None, priority=None, client_id=None, patience_s=None, tokens_generated=None) -> Trace:
    """A :class:`Trace` from per-request arrays (what make_trace and the trace file reader both end with)."""
    n = len(arrival_s)
    if client_id is None:
        client_id = np.full(n, None, dtype=object)
    return Trace(
        arrival_s=np.asarray(arrival_s, dtype=float),
        max_new_tokens=np.asarray(tokens, dtype=np.int64),
        size_class=mix.size_class(tokens),
        est_service_s=np.asarray(est, dtype=float),
        true_service_s=np.asarray(true, dtype=float),
        deadline_s=np.full(n, np.nan) if deadline_s is None else np.asarray(deadline_s, dtype=float),
        prompt_tokens=np.zeros(n, dtype=np.int64) if prompt_tokens is None else np.asarray(prompt_tokens, dtype=np.int64),
        priority=np.zeros(n, dtype=np.int64) if priority is None else np.asarray(priority, dtype=np.int64),
        client_id=np.asarray(client_id, dtype=object),
        duration_s=float(duration_s),
        name=name,
        meta=meta,
        patience_s=patience_s,
        tokens_generated=tokens_generated,
    )


def from_arrays(
    arrival_s,
    max_new_tokens,
    *,
    true_service_s=None,
    est_service_s=None,
    deadline_s=None,
    priority=None,
    client_id=None,
    model: ServiceModel = ServiceModel(),
    mix: Mix = REFERENCE_MIX,
    name: str = "trace",
) -> Trace:
    """A trace from explicit requests; service times default to the model's estimate."""
    tokens = np.asarray(max_new_tokens, dtype=np.int64)
    arrival = np.asarray(arrival_s, dtype=float)
    if arrival.shape != tokens.shape or arrival.ndim != 1:
        raise ValueError("arrival_s and max_new_tokens must be 1-d and equally long")
    est = model.estimate(tokens) if est_service_s is None else est_service_s
    true = est if true_service_s is None else true_service_s
    duration = float(arrival.max() - arrival.min()) if arrival.size else 0.0
    return assemble_trace(arrival, tokens, est, true, mix=mix, duration_s=duration, name=name, meta={},
                          deadline_s=deadline_s, priority=priority, client_id=client_id)


# ---------------------------------------------------------------- arrivals


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


def renewal_pieces(kind: str, rng: np.random.Generator, rate: float, *, seconds=None, requests=None, cv=1.0,
                   size: int | None = None) -> Iterator[np.ndarray]:
    """:func:`renewal_arrivals`'s times in pieces of at most ``size`` (None: as they are drawn), the same numbers:
    the gaps are drawn in request order, and each piece's running sum goes on from the last one's."""
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"arrival rate must be a positive number, got {rate}")
    if requests is not None:
        return _running_sums(kind, rng, int(requests), cv, rate, 0.0, size)
    return _before(_rounds(kind, rng, rate, int(rate * seconds * 1.1) + 64, cv, size), seconds)


def _running_sums(kind: str, rng: np.random.Generator, count: int, cv: float, rate: float, start: float,
                  size: int | None) -> Iterator[np.ndarray]:
    """start + the running sum of ``count`` unit gaps / rate, in pieces. A piece's sum starts from the last
    one's: the carry leads the cumsum and is dropped after, so the additions are those of one cumsum."""
    carry = 0.0
    for lo, hi in spans(count, size):
        units = np.cumsum(np.concatenate(([carry], _unit_gaps(kind, rng, hi - lo, cv))))[1:]
        carry = units[-1]
        yield start + units / rate


def _rounds(kind: str, rng: np.random.Generator, rate: float, count: int, cv: float,
            size: int | None) -> Iterator[np.ndarray]:
    """Rounds of ``count`` gaps without end, each from the last time of the round before."""
    start = 0.0
    while True:
        for times in _running_sums(kind, rng, count, cv, rate, start, size):
            yield times
        start = times[-1]


def _before(pieces: Iterator[np.ndarray], seconds: float | None) -> Iterator[np.ndarray]:
    """The times of nondecreasing ``pieces`` before ``seconds`` (all where None), up to the first past it."""
    for times in pieces:
        below = times if seconds is None else times[times < seconds]
        if below.size:
            yield below
        if below.size < times.size:
            return


def renewal_arrivals(kind: str, rng: np.random.Generator, rate: float, *, seconds=None, requests=None, cv=1.0) -> np.ndarray:
    """Arrival times of a renewal process at ``rate``: the first ``requests``, or all before ``seconds``.

    The first arrival comes one gap after time 0, as in a stationary process seen from an empty system.
    """
    return _whole(renewal_pieces(kind, rng, rate, seconds=seconds, requests=requests, cv=cv))


def _whole(pieces: Iterator[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.empty(0), *pieces])


def surge_pieces(rng: np.random.Generator, rate: float, surge_rate: float, start_s: float, length_s: float, *,
                 seconds=None, requests=None, size: int | None = None) -> Iterator[np.ndarray]:
    """:func:`surge_arrivals`'s times in pieces of at most ``size`` (None: as drawn), the same numbers."""
    if requests is not None:
        unit = renewal_pieces("poisson", rng, 1.0, requests=requests, size=size)
    else:  # enough unit points to pass ``seconds`` at the higher of the two rates
        unit = renewal_pieces("poisson", rng, 1.0, seconds=max(rate, surge_rate) * seconds + 1.0, size=size)
    # Integrated rate at the surge's two ends; between them it grows at surge_rate, elsewhere at rate.
    a = rate * start_s
    b = a + surge_rate * length_s
    return _before((np.where(u <= a, u / rate, np.where(u <= b, start_s + (u - a) / surge_rate,
                                                         start_s + length_s + (u - b) / rate)) for u in unit), seconds)


def surge_arrivals(rng: np.random.Generator, rate: float, surge_rate: float, start_s: float, length_s: float, *,
                   seconds=None, requests=None) -> np.ndarray:
    """A Poisson process at ``rate``, and at ``surge_rate`` from ``start_s`` for ``length_s`` seconds.

    Drawn by time change from the same unit-rate gaps as ``poisson`` (common random numbers: request i's
    gap is the same draw at every load): a unit point at s maps to the time where the integrated rate is s.
    """
    return _whole(surge_pieces(rng, rate, surge_rate, start_s, length_s, seconds=seconds, requests=requests))


def burst_pieces(n: int, at_s: float = 0.0, size: int | None = None) -> Iterator[np.ndarray]:
    """n requests arriving at the same instant, in pieces of at most ``size``."""
    return (np.full(hi - lo, float(at_s)) for lo, hi in spans(int(n), size))


def burst_arrivals(n: int, at_s: float = 0.0) -> np.ndarray:
    """n requests arriving at the same instant."""
    return _whole(burst_pieces(n, at_s))


def periodic_pieces(n: int, period_s: float, *, seconds=None, requests=None,
                    size: int | None = None) -> Iterator[np.ndarray]:
    """:func:`periodic_bursts`'s times in pieces of at most ``size``."""
    if not period_s > 0:
        raise ValueError(f"burst period must be > 0, got {period_s}")
    count = int(requests) if requests is not None else int(n) * math.ceil(seconds / period_s)
    return ((np.arange(lo, hi) // int(n)) * float(period_s) for lo, hi in spans(count, size))


def periodic_bursts(n: int, period_s: float, *, seconds=None, requests=None) -> np.ndarray:
    """A burst of n every period_s, starting at 0: as many as fit before ``seconds``, or ``requests`` in all."""
    return _whole(periodic_pieces(n, period_s, seconds=seconds, requests=requests))


def periodic_at_rate_pieces(rate: float, period_s: float, *, seconds=None, requests=None,
                           size: int | None = None) -> Iterator[np.ndarray]:
    """:func:`periodic_at_rate`'s times in pieces of at most ``size``."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"arrival rate must be a positive number, got {rate}")
    if not period_s > 0:
        raise ValueError(f"burst period must be > 0, got {period_s}")
    per_burst = rate * period_s
    count = int(requests) if requests is not None else math.ceil(seconds * rate - 1e-9)
    # The tolerance keeps request k * per_burst (a whole number in exact arithmetic) in burst k.
    return (np.floor(np.arange(lo, hi) / per_burst + 1e-9) * float(period_s) for lo, hi in spans(count, size))


def periodic_at_rate(rate: float, period_s: float, *, seconds=None, requests=None) -> np.ndarray:
    """Bursts every period_s from 0 at a mean ``rate``: the requests a constant-rate process would send in each
    period, all at the period's start (request i at floor(i / (rate * period_s)) * period_s).

    A burst holds rate * period_s requests on average; where that is not whole, bursts of its floor and its
    ceiling alternate so that every window of whole periods has the rate exactly. With ``seconds``: the
    requests a constant rate sends before it (the last burst is of the part of its period inside the window).
    """
    return _whole(periodic_at_rate_pieces(rate, period_s, seconds=seconds, requests=requests))


def parse_arrivals(spec: str) -> tuple[str, tuple[float, ...]]:
    """One of :data:`ARRIVALS` -> (kind, numbers). A surge is Poisson at the workload's load, and at LOAD from
    START_S for LENGTH_S; ``periodic:PERIOD_S`` is a burst every PERIOD_S whose size follows the load
    (:func:`periodic_at_rate`), ``periodic:N:PERIOD_S`` one of N (its rate is its own: it takes no load)."""
    kind, *args = spec.split(":")
    arity = {"poisson": (0,), "constant": (0,), "gamma": (1,), "burst": (1,), "periodic": (1, 2), "surge": (3,)}
    if kind not in arity or len(args) not in arity[kind]:
        raise ValueError(f"bad arrival process {spec!r}; expected one of {', '.join(ARRIVALS)}")
    try:
        numbers = tuple(float(a) for a in args)
    except ValueError:
        raise ValueError(f"bad arrival process {spec!r}: {':'.join(args)!r} is not a number") from None
    # A surge may start at time 0; every other number is a size, a length or a rate.
    if any(not (x > 0 and math.isfinite(x)) for j, x in enumerate(numbers) if not (kind == "surge" and j == 0 and x == 0)):
        raise ValueError(f"bad arrival process {spec!r}: its numbers must be positive")
    if not takes_load(kind, numbers) and numbers[0] != int(numbers[0]):
        raise ValueError(f"bad arrival process {spec!r}: a burst size is a whole number")
    return kind, numbers


def takes_load(kind: str, numbers: tuple[float, ...]) -> bool:
    """Whether a parsed arrival process's rate comes from the load (False: from its own burst size)."""
    return not (kind == "burst" or (kind == "periodic" and len(numbers) == 2))


def arrivals_take_load(spec: str) -> bool:
    """Whether the arrival process ``spec`` takes a load (ValueError for a bad spec)."""
    return takes_load(*parse_arrivals(spec))


def check_load(spec: str, load: float | None) -> None:
    """ValueError when a load is given to a process that takes none (it would be ignored)."""
    kind, numbers = parse_arrivals(spec)
    if load is not None and not takes_load(kind, numbers):
        what = f"a burst of {numbers[0]:g}" + (f" every {numbers[1]:g} s" if kind == "periodic" else "")
        raise ValueError(f"arrivals {spec!r} take no load ({what}: the size sets the rate); leave the load out, "
                         "or give periodic:PERIOD_S, whose burst size follows the load")


# ---------------------------------------------------------------- the trace


def random_streams(seed: int) -> tuple[np.random.Generator, ...]:
    """Independent generators for gaps, sizes, service draws, clients, patience and early stops
    (common random numbers).

    The fourth was added with clients, the fifth with patience, the sixth with early stops and the
    seventh with prompt lengths, the eighth with shared prefixes;
    SeedSequence's children do not depend on how many are spawned, so the earlier ones (and every
    trace without them) are what they were.
    """
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(8))


def dataset_rows(dataset: Dataset, n: int, seed: int) -> np.ndarray:
    """The rows of ``dataset`` that a trace of n requests from ``seed`` takes, in request order: from
    the ninth stream (the eight before unchanged). What the simulator and the replayer both read."""
    return dataset.sample(n, np.random.default_rng(np.random.SeedSequence(seed).spawn(9)[8]))


def _draw_index(rng: np.random.Generator, probs, n: int) -> np.ndarray:
    """n draws of an index with these probabilities, one uniform each: what ``rng.choice(len(probs), n,
    p=probs)`` draws, written out so that each request's uniform can be mapped through its own client's mix."""
    cdf = np.cumsum(probs)
    return np.searchsorted(cdf / cdf[-1], rng.random(n), side="right")


def _sizes(rng: np.random.Generator, mixes: list[Mix], which: np.ndarray) -> np.ndarray:
    """Each request's size from the mix ``mixes[which[i]]``, one uniform per request in request order."""
    u = rng.random(len(which))
    tokens = np.empty(len(which), dtype=np.int64)
    for j, mix in enumerate(mixes):
        mine = which == j
        cdf = np.cumsum(mix.probs)
        tokens[mine] = np.asarray(mix.sizes)[np.searchsorted(cdf / cdf[-1], u[mine], side="right")]
    return tokens


def lognormal_noise(rng: np.random.Generator, n: int, cv: float) -> np.ndarray:
    """Multiplicative noise with mean 1 and coefficient of variation ``cv`` (ones when cv = 0)."""
    if cv <= 0:
        return np.ones(n)
    sigma2 = math.log1p(cv**2)
    return rng.lognormal(-sigma2 / 2, math.sqrt(sigma2), n)


class _Streams(NamedTuple):
    """The random streams a request's values are drawn from (:func:`random_streams`, gaps aside): numpy
    Generators, or :class:`qsim.chunks.BlockStream` s that serve the same draws a chunk at a time."""

    size: np.random.Generator
    service: np.random.Generator
    client: np.random.Generator
    patience: np.random.Generator
    used: np.random.Generator
    prompt: np.random.Generator
    prefix: np.random.Generator


@dataclass(frozen=True)
class TracePlan:
    """A synthetic workload as :func:`plan_trace` resolves it from its options: its requests drawn whole
    (:meth:`trace`, what :func:`make_trace` returns) or a chunk at a time (:meth:`chunks`), the same values."""

    kind: str  # the arrival process (parse_arrivals) and its numbers
    numbers: tuple[float, ...]
    rate: float
    surge_rate: float  # a surge's rate during it (NaN for other processes)
    seconds: float | None
    requests: int | None
    seed: int
    service: str
    model: ServiceModel
    mean_s: float
    speed: float
    noise_cv: float
    mix: Mix
    shares: tuple[float, ...]
    mixes: tuple[Mix, ...]
    clients: tuple[Client, ...]
    used: "UsedShare | dict[int, UsedShare] | None"
    prompts: "Prompts | None"
    patience: Patience | None
    name: str
    meta: dict = field(compare=False)
    prefixes: SharedPrefix | None = None
    dataset: Dataset | None = None

    def trace(self) -> Trace:
        gaps, *rest = random_streams(self.seed)
        times = _whole(self._pieces(gaps, None))
        duration = self._duration(times[-1] if times.size else None)
        return self._requests(times, duration, _Streams(*rest), self.dataset_rows(times.size))

    def dataset_rows(self, n: int) -> np.ndarray | None:
        """The dataset's rows that the n requests take, in request order (None: no dataset): drawn
        for all n at once (:meth:`qsim.datasets.Dataset.sample`, a shuffle), from a stream of its
        own, so the other streams draw what they drew without a dataset."""
        return None if self.dataset is None else dataset_rows(self.dataset, n, self.seed)

    def chunks(self, size: int) -> TraceChunks:
        """The requests of :meth:`trace`, ``size`` at a time, in memory of a chunk: the arrivals are drawn through
        once first (to count them and find the duration), every other stream as :class:`qsim.chunks.BlockStream`
        serves it."""
        if not (isinstance(size, (int, np.integer)) and size >= 1):
            raise ValueError(f"a chunk holds a whole number >= 1 of requests, got {size!r}")
        if self.prefixes is not None:  # a conversation's turns span chunks: no history there
            raise ValueError("a workload of shared prefixes is drawn whole: it does not stream")
        count, last = 0, None
        for times in self._pieces(random_streams(self.seed)[0], PIECE):
            count, last = count + times.size, times[-1]
        duration = float(self._duration(last))
        return TraceChunks(count, int(size), duration, self.name, self.meta,
                           lambda: self._chunked(int(size), count, duration))

    def _chunked(self, size: int, count: int, duration: float) -> Iterator[Trace]:
        gaps, *rest = random_streams(self.seed)
        streams = _Streams(*(BlockStream(rng, count) for rng in rest))
        rows, done = self.dataset_rows(count), 0  # one int a request: a dataset's shuffle is whole
        for times in exactly(self._pieces(gaps, size), size):
            for stream in streams:
                stream.chunk()
            part = None if rows is None else rows[done:done + times.size]
            done += times.size
            yield self._requests(times, duration, streams, part)

    def _pieces(self, gaps: np.random.Generator, size: int | None) -> Iterator[np.ndarray]:
        """The arrival times in pieces of at most ``size`` (None: as drawn)."""
        kind, numbers, seconds, requests = self.kind, self.numbers, self.seconds, self.requests
        if kind in ("poisson", "constant", "gamma"):
            cv = numbers[0] if numbers else 1.0
            return renewal_pieces(kind, gaps, self.rate, seconds=seconds, requests=requests, cv=cv, size=size)
        if kind == "surge":
            start_s, length_s, _ = numbers
            return surge_pieces(gaps, self.rate, self.surge_rate, start_s, length_s, seconds=seconds,
                                requests=requests, size=size)
        if kind == "burst":
            return burst_pieces(int(numbers[0]), size=size)
        if takes_load(kind, numbers):  # periodic:PERIOD_S, bursts whose size follows the load
            return periodic_at_rate_pieces(self.rate, numbers[-1], seconds=seconds, requests=requests, size=size)
        return periodic_pieces(int(numbers[0]), numbers[1], seconds=seconds, requests=requests, size=size)

    def _duration(self, last: float | None) -> float:
        """The arrival window that rates are per, from the last arrival (None: none came)."""
        if self.kind == "burst":
            return 0.0
        if self.seconds is not None:
            return self.seconds
        if last is None:
            return 0.0
        return last + self.numbers[-1] if self.kind == "periodic" else last

    def _requests(self, times: np.ndarray, duration: float, rng: _Streams,
                  rows: np.ndarray | None = None) -> Trace:
        """The requests that arrive at ``times``: each stream drawn once per request, in request order
        (``rows``: the dataset's row of each, whose lengths replace the mix's and the prompts')."""
        n = times.size
        which = _draw_index(rng.client, self.shares, n) if self.clients else np.zeros(n, dtype=np.int64)
        model, speed, used, prompts = self.model, self.speed, self.used, self.prompts
        generated = ids = None
        prompt = None if prompts is None or prompts.kind == "none" else prompts.draw(rng.prompt, n)
        if rows is not None:
            prompt = self.dataset.prompt_tokens[rows]
        if self.service == "mix":
            tokens = _sizes(rng.size, self.mixes, which)
            if rows is not None:  # the sizes' stream still draws: the noise's is its own anyway
                tokens = self.dataset.output_tokens[rows]
            # Each stream is its own: drawing the early stops first changes none of the others'
            # draws.
            generated = None if used is None else used_tokens(rng.used, tokens, used)
            if self.prefixes is not None:
                prompt, ids = self._shared(rng, prompt, tokens if generated is None else generated)
            est = model.estimate(tokens) if prompt is None else model.estimate(tokens, prompt)
            noise = lognormal_noise(rng.service, n, self.noise_cv)
            if used is None:
                true = est * speed * noise
            else:  # the engine does the work actually generated; the estimate still sees the limit
                work = model.estimate(generated) if prompt is None else model.estimate(generated, prompt)
                true = work * speed * noise
        else:
            tokens = np.full(n, model.tokens_for(self.mean_s), dtype=np.int64)
            if self.prefixes is not None:
                prompt, ids = self._shared(rng, prompt, tokens)
            est = np.full(n, self.mean_s)
            draws = rng.service.standard_exponential(n) if self.service == "exponential" else np.ones(n)
            true = self.mean_s * speed * draws
        priority = client_id = None
        if self.clients:
            priority = np.asarray([c.priority for c in self.clients], dtype=np.int64)[which]
            client_id = np.asarray([c.name for c in self.clients], dtype=object)[which]
        patience = self.patience
        drawn = None if patience is None else patience.draw(rng.patience, n)
        trace = assemble_trace(times, tokens, est, true, mix=self.mix, duration_s=duration,
                               name=self.name, meta=self.meta, priority=priority,
                               client_id=client_id, prompt_tokens=prompt, patience_s=drawn,
                               tokens_generated=generated)
        return trace if ids is None else dataclasses.replace(trace, tokens=ids)

    def _shared(self, rng: _Streams, prompt: np.ndarray | None, answers: np.ndarray):
        """The prompts (lengths, token identities) with their shared prefixes: ``prompt`` is each
        request's own new tokens (None: none)."""
        own = np.zeros(len(answers), dtype=np.int64) if prompt is None else prompt
        return self.prefixes.compose(rng.prefix, own, np.asarray(answers, dtype=np.int64))


def make_trace(arrivals: str = "poisson", service: str = "mix", **options) -> Trace:
    """A seeded synthetic trace: :func:`plan_trace`'s (which says what each option does), drawn whole."""
    return plan_trace(arrivals, service, **options).trace()


def trace_chunks(size: int, **options) -> TraceChunks:
    """:func:`make_trace`'s trace for these options, ``size`` requests at a time (:meth:`TracePlan.chunks`)."""
    return plan_trace(**options).chunks(size)


def load_rate(load: float, engines: int, mean_true_s: float) -> float:
    """Requests per second at utilisation ``load`` of ``engines`` engines whose requests take ``mean_true_s``
    on average: lambda = load * K / E[true S] (synthetic arrivals here, a trace file's window in
    :class:`qsim.tracefiles.TraceWindow`)."""
    return load * engines / mean_true_s


def load_at_rate(rate_rps: float, **options) -> float:
    """The load at which :func:`plan_trace` with ``options`` sends ``rate_rps`` requests per second.
    The rate is linear in the load (:func:`load_rate`, or load x capacity_rps), so this is the
    rate over the one at load 1: whatever counts in the load (engines, speed, the mix, clients,
    early stops, a batching engine's capacity) counts here. ValueError for a process that takes
    no load (its bursts bring their own rate)."""
    if not (rate_rps > 0 and math.isfinite(rate_rps)):
        raise ValueError(f"a rate must be a positive number of requests per second, got {rate_rps}")
    arrivals = options.get("arrivals", "poisson")
    if not arrivals_take_load(arrivals):
        raise ValueError(f"arrivals {arrivals!r} bring their own rate (their burst size sets it) "
                         "and take no --rate")
    return rate_rps / plan_trace(**{**options, "load": 1.0}).rate


def plan_trace(
    arrivals: str = "poisson",
    service: str = "mix",
    *,
    load: float | None = None,
    engines: int = 1,
    speed: float = 1.0,
    seconds: float | None = None,
    requests: int | None = None,
    seed: int = 0,
    mix: Mix = REFERENCE_MIX,
    model: ServiceModel = ServiceModel(),
    mean_service_s: float | None = None,
    noise_cv: float = 0.0,
    clients: tuple[Client, ...] = (),
    patience: Patience | None = None,
    used: "UsedShare | dict[int, UsedShare] | None" = None,
    prompts: "Prompts | None" = None,
    capacity_rps: float | None = None,
    prefixes: SharedPrefix | None = None,
    dataset: Dataset | None = None,
) -> TracePlan:
    """A seeded synthetic workload: what :func:`make_trace` draws whole and :meth:`TracePlan.chunks` a chunk at a
    time.

    load is the utilisation at the simulated speed: lambda = load * engines / E[true S] (None:
    :data:`DEFAULT_LOAD`); a process whose size sets its rate (:data:`SIZED`) takes none, and
    giving it one is a ValueError. speed multiplies every true service time (2.25 = the machine
    2.25x slower). service: 'mix' (sizes from ``mix`` through ``model``, optional lognormal noise
    of CV ``noise_cv``), 'exponential' or 'deterministic' with mean ``mean_service_s`` (default:
    the mix's mean). clients: who sends each request (:class:`Client`; each brings its priority and
    may bring its own mix); the load counts their mixes by their shares. patience: how long each
    client waits (:class:`qsim.clients.Patience`, drawn from a fifth stream; None or "none":
    forever). used: early stops (:class:`UsedShare`, one for all or a mapping from a size to its
    own, from a sixth stream; None: every request generates its limit): true service times follow
    the tokens generated, and ``load`` counts that work. prompts: prompt lengths (:class:`Prompts`,
    from a seventh stream; None: none). prefixes: prompts that share tokens (:class:`SharedPrefix`:
    a system prompt, conversations; from an eighth stream; None or sharing nothing: every prompt
    its own), whose tokens a prefix cache reads (Trace.tokens). capacity_rps: the requests per
    second the server can take (a batching engine's, :func:`qsim.engines.Batching.capacity_rps`):
    then lambda = load * capacity_rps, and engines, speed and the mix's mean time no longer set the
    rate. dataset: each request's prompt and output lengths from a dataset's rows
    (:class:`qsim.datasets.Dataset`, sampled from a ninth stream); it replaces the mix's sizes
    and ``prompts``, and the load counts its mean estimate.
    """
    if (seconds is None) == (requests is None):
        raise ValueError("give exactly one of seconds and requests")
    if seconds is not None and not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if requests is not None and requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    check_load(arrivals, load)
    kind, numbers = parse_arrivals(arrivals)
    if load is None and takes_load(kind, numbers):
        load = DEFAULT_LOAD
    if load is not None and not load > 0:
        raise ValueError(f"load must be > 0, got {load}")
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    if service not in SERVICES:
        raise ValueError(f"unknown service distribution {service!r}; choose one of {', '.join(SERVICES)}")
    if mean_service_s is not None and not mean_service_s > 0:
        raise ValueError(f"mean service time must be > 0, got {mean_service_s}")
    shares, mixes = blend(mix, clients)
    mean_s = blended_means(mix, clients, model)[0] if mean_service_s is None else float(mean_service_s)
    if used is not None and service == "mix":  # the load is of the work actually done
        mean_s = used_mean_s(mix, clients, model, used)
    if dataset is not None:
        _check_dataset(service, used, prompts, prefixes, clients)
        mean_s = float(np.mean(model.estimate(dataset.output_tokens, dataset.prompt_tokens)))
    if service == "mix" and mean_service_s is not None:
        raise ValueError("--mean-service applies to exponential and deterministic service, not to the mix")

    if capacity_rps is not None and not (capacity_rps > 0 and math.isfinite(capacity_rps)):
        raise ValueError(f"capacity_rps must be a positive number of requests per second, got {capacity_rps}")
    if used is not None and service != "mix":
        raise ValueError("early stops (used share) apply to the mix's sizes, not to exponential or deterministic service")
    if load is None:  # a sized process's rate is its own: a burst has none, periodic bursts of N one every period
        rate = numbers[0] / numbers[1] if kind == "periodic" else math.nan
    else:
        rate = load_rate(load, engines, speed * mean_s) if capacity_rps is None else load * capacity_rps
    surge_rate = load_rate(numbers[2], engines, speed * mean_s) if kind == "surge" else math.nan
    meta = dict(arrivals=arrivals, service=service, load=load, engines=engines, speed=speed,
                seed=seed, rate=rate, mean_service_s=mean_s, noise_cv=noise_cv)
    if clients:
        meta["clients"] = [c.name for c in clients]
    if patience is not None and patience.kind != "none":
        meta.update(patience=patience.spec, patience_until=patience.until)
    if prompts is not None and prompts.kind != "none":
        meta["prompts"] = prompts.spec
    if prefixes is not None and not prefixes.shares:
        prefixes = None  # nothing shared: the trace it was without (no tokens to carry)
    if prefixes is not None:
        meta["prefixes"] = dataclasses.asdict(prefixes)
    if dataset is not None:
        meta.update(dataset=dataset.path, dataset_tokens=dataset.counting)
    return TracePlan(kind, numbers, rate, surge_rate, seconds, requests, seed, service, model, mean_s, speed, noise_cv,
                     mix, tuple(shares), tuple(mixes), tuple(clients), used, prompts, patience,
                     f"{arrivals}-{service}", meta, prefixes, dataset)


def _check_dataset(service: str, used, prompts, prefixes, clients) -> None:
    """What a dataset's lengths cannot stand beside (ValueError): they are the sizes, the prompts
    and the tokens generated (each request generates its output length, as vLLM's benchmark asks)."""
    if service != "mix":
        raise ValueError("a dataset's output lengths are the sizes: it needs --service mix")
    if used is not None:
        raise ValueError("a dataset's output lengths are the tokens generated: drop the early stops (--used)")
    if prompts is not None and prompts.kind != "none":
        raise ValueError("a dataset brings its own prompt lengths: drop --prompts")
    if prefixes is not None and prefixes.shares:
        raise ValueError("a dataset's prompts share no prefixes here: drop --system-prompt and --turns")
    if any(c.mix is not None for c in clients):
        raise ValueError("a dataset's output lengths replace every mix: clients may bring no mix of their own")
