"""Workloads: size mixes, seeded arrival processes, service times (reading trace files: :mod:`qsim.tracefiles`).

Common random numbers: a seed is split into independent streams for arrival
gaps, sizes and service noise, and every stream is consumed in request order.
So the same seed gives request i the same gap (in units of the mean gap), size
and true service time whatever the policy, and at every load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .clients import Patience
from .service import ServiceModel

ARRIVALS = ("poisson", "constant", "gamma:CV", "burst:N", "periodic:N:PERIOD_S", "surge:START_S:LENGTH_S:LOAD")
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

    def __post_init__(self) -> None:
        patience = np.full(len(self.arrival_s), math.inf) if self.patience_s is None else self.patience_s
        object.__setattr__(self, "patience_s", np.asarray(patience, dtype=float))

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def request_id(self) -> np.ndarray:
        return np.arange(len(self), dtype=np.int64)

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
                   prompt_tokens=None, priority=None, client_id=None, patience_s=None) -> Trace:
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


def renewal_arrivals(kind: str, rng: np.random.Generator, rate: float, *, seconds=None, requests=None, cv=1.0) -> np.ndarray:
    """Arrival times of a renewal process at ``rate``: the first ``requests``, or all before ``seconds``.

    The first arrival comes one gap after time 0, as in a stationary process seen from an empty system.
    """
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"arrival rate must be a positive number, got {rate}")
    if requests is not None:
        return np.cumsum(_unit_gaps(kind, rng, int(requests), cv)) / rate
    times = np.empty(0)
    chunk = int(rate * seconds * 1.1) + 64
    while times.size == 0 or times[-1] < seconds:
        start = times[-1] if times.size else 0.0
        times = np.concatenate([times, start + np.cumsum(_unit_gaps(kind, rng, chunk, cv)) / rate])
    return times[times < seconds]


def surge_arrivals(rng: np.random.Generator, rate: float, surge_rate: float, start_s: float, length_s: float, *,
                   seconds=None, requests=None) -> np.ndarray:
    """A Poisson process at ``rate``, and at ``surge_rate`` from ``start_s`` for ``length_s`` seconds.

    Drawn by time change from the same unit-rate gaps as ``poisson`` (common random numbers: request i's
    gap is the same draw at every load): a unit point at s maps to the time where the integrated rate is s.
    """
    if requests is not None:
        unit = renewal_arrivals("poisson", rng, 1.0, requests=requests)
    else:  # enough unit points to pass ``seconds`` at the higher of the two rates
        unit = renewal_arrivals("poisson", rng, 1.0, seconds=max(rate, surge_rate) * seconds + 1.0)
    # Integrated rate at the surge's two ends; between them it grows at surge_rate, elsewhere at rate.
    a = rate * start_s
    b = a + surge_rate * length_s
    times = np.where(unit <= a, unit / rate,
                     np.where(unit <= b, start_s + (unit - a) / surge_rate, start_s + length_s + (unit - b) / rate))
    return times if seconds is None else times[times < seconds]


def burst_arrivals(n: int, at_s: float = 0.0) -> np.ndarray:
    """n requests arriving at the same instant."""
    return np.full(int(n), float(at_s))


def periodic_bursts(n: int, period_s: float, *, seconds=None, requests=None) -> np.ndarray:
    """A burst of n every period_s, starting at 0: as many as fit before ``seconds``, or ``requests`` in all."""
    if not period_s > 0:
        raise ValueError(f"burst period must be > 0, got {period_s}")
    count = int(requests) if requests is not None else int(n) * math.ceil(seconds / period_s)
    return (np.arange(count) // int(n)) * float(period_s)


def parse_arrivals(spec: str) -> tuple[str, tuple[float, ...]]:
    """'poisson' | 'constant' | 'gamma:CV' | 'burst:N' | 'periodic:N:PERIOD_S' | 'surge:START_S:LENGTH_S:LOAD'
    -> (kind, numbers). A surge is Poisson at the workload's load, and at LOAD from START_S for LENGTH_S."""
    kind, *args = spec.split(":")
    arity = {"poisson": 0, "constant": 0, "gamma": 1, "burst": 1, "periodic": 2, "surge": 3}
    if kind not in arity or len(args) != arity[kind]:
        raise ValueError(f"bad arrival process {spec!r}; expected one of {', '.join(ARRIVALS)}")
    try:
        numbers = tuple(float(a) for a in args)
    except ValueError:
        raise ValueError(f"bad arrival process {spec!r}: {':'.join(args)!r} is not a number") from None
    # A surge may start at time 0; every other number is a size, a length or a rate.
    if any(not (x > 0 and math.isfinite(x)) for j, x in enumerate(numbers) if not (kind == "surge" and j == 0 and x == 0)):
        raise ValueError(f"bad arrival process {spec!r}: its numbers must be positive")
    if kind in ("burst", "periodic") and numbers[0] != int(numbers[0]):
        raise ValueError(f"bad arrival process {spec!r}: a burst size is a whole number")
    return kind, numbers


# ---------------------------------------------------------------- the trace


def random_streams(seed: int) -> tuple[np.random.Generator, ...]:
    """Independent generators for gaps, sizes, service draws, clients and patience (common random numbers).

    The fourth was added with clients and the fifth with patience; SeedSequence's children do not
    depend on how many are spawned, so the earlier ones (and every trace without them) are what they were.
    """
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(5))


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


def make_trace(
    arrivals: str = "poisson",
    service: str = "mix",
    *,
    load: float = 0.9,
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
) -> Trace:
    """A seeded synthetic trace.

    load is the utilisation at the simulated speed: lambda = load * engines / E[true S].
    speed multiplies every true service time (2.25 = the machine 2.25x slower).
    service: 'mix' (sizes from ``mix`` through ``model``, optional lognormal
    noise of CV ``noise_cv``), 'exponential' or 'deterministic' with mean
    ``mean_service_s`` (default: the mix's mean). clients: who sends each request
    (:class:`Client`; each brings its priority and may bring its own mix); the load counts
    their mixes by their shares. patience: how long each client waits (:class:`qsim.clients.Patience`,
    drawn from a fifth stream; None or "none": forever).
    """
    if (seconds is None) == (requests is None):
        raise ValueError("give exactly one of seconds and requests")
    if seconds is not None and not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if requests is not None and requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    if not load > 0:
        raise ValueError(f"load must be > 0, got {load}")
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    if service not in SERVICES:
        raise ValueError(f"unknown service distribution {service!r}; choose one of {', '.join(SERVICES)}")
    if mean_service_s is not None and not mean_service_s > 0:
        raise ValueError(f"mean service time must be > 0, got {mean_service_s}")
    shares, mixes = blend(mix, clients)
    mean_s = blended_means(mix, clients, model)[0] if mean_service_s is None else float(mean_service_s)
    if service == "mix" and mean_service_s is not None:
        raise ValueError("--mean-service applies to exponential and deterministic service, not to the mix")

    kind, numbers = parse_arrivals(arrivals)
    gaps_rng, size_rng, service_rng, client_rng, patience_rng = random_streams(seed)
    rate = load * engines / (speed * mean_s)
    if kind in ("poisson", "constant", "gamma"):
        cv = numbers[0] if numbers else 1.0
        times = renewal_arrivals(kind, gaps_rng, rate, seconds=seconds, requests=requests, cv=cv)
        duration = seconds if seconds is not None else (times[-1] if times.size else 0.0)
    elif kind == "surge":
        start_s, length_s, surge_load = numbers
        times = surge_arrivals(gaps_rng, rate, surge_load * engines / (speed * mean_s), start_s, length_s,
                               seconds=seconds, requests=requests)
        duration = seconds if seconds is not None else (times[-1] if times.size else 0.0)
    elif kind == "burst":
        times = burst_arrivals(int(numbers[0]))
        duration = 0.0
    else:
        times = periodic_bursts(int(numbers[0]), numbers[1], seconds=seconds, requests=requests)
        duration = seconds if seconds is not None else (times[-1] + numbers[1] if times.size else 0.0)
    n = times.size
    which = _draw_index(client_rng, shares, n) if clients else np.zeros(n, dtype=np.int64)

    if service == "mix":
        tokens = _sizes(size_rng, mixes, which)
        est = model.estimate(tokens)
        true = est * speed * lognormal_noise(service_rng, n, noise_cv)
    else:
        tokens = np.full(n, model.tokens_for(mean_s), dtype=np.int64)
        est = np.full(n, mean_s)
        draws = service_rng.standard_exponential(n) if service == "exponential" else np.ones(n)
        true = mean_s * speed * draws
    meta = dict(arrivals=arrivals, service=service, load=load, engines=engines, speed=speed,
                seed=seed, rate=rate, mean_service_s=mean_s, noise_cv=noise_cv)
    priority = client_id = None
    if clients:
        meta["clients"] = [c.name for c in clients]
        priority = np.asarray([c.priority for c in clients], dtype=np.int64)[which]
        client_id = np.asarray([c.name for c in clients], dtype=object)[which]
    if patience is not None and patience.kind != "none":
        meta.update(patience=patience.spec, patience_until=patience.until)
    return assemble_trace(times, tokens, est, true, mix=mix, duration_s=duration, name=f"{arrivals}-{service}",
                          meta=meta, priority=priority, client_id=client_id,
                          patience_s=None if patience is None else patience.draw(patience_rng, n))


# ---------------------------------------------------------------- a trace from options


def build_trace(
    file: str | Path | None = None,
    *,
    time_scale: float = 1.0,
    arrivals: str = "poisson",
    service: str = "mix",
    load: float = 0.9,
    engines: int = 1,
    speed: float = 1.0,
    seconds: float | None = None,
    requests: int | None = None,
    default_seconds: float | None = None,
    seed: int = 0,
    mix: Mix = REFERENCE_MIX,
    model: ServiceModel = ServiceModel(),
    mean_service_s: float | None = None,
    noise_cv: float = 0.0,
    clients: tuple[Client, ...] = (),
    patience: Patience | None = None,
) -> Trace:
    """The trace that a command's options describe; every command (simulate, replay, live, sweep) builds it here.

    With ``file``: that trace file, read by :func:`qsim.tracefiles.load_trace` (``time_scale``,
    ``model``, ``mix``, ``speed``, ``noise_cv`` and ``seed`` apply; the arrival and length options
    do not, and a file brings its own clients, in its client_id and priority columns; ``patience`` None keeps
    the file's patience_s column, if any). Otherwise :func:`make_trace`, ``default_seconds`` long when neither ``seconds`` nor
    ``requests`` is given (a burst's length is its size whatever they are).
    """
    if file:
        if clients:
            raise ValueError("a trace file brings its own clients (its client_id and priority columns); "
                             "workload clients apply to synthetic arrivals")
        from .tracefiles import load_trace  # imported here: tracefiles builds on this module's Trace

        return load_trace(file, time_scale, model=model, mix=mix, speed=speed, noise_cv=noise_cv, seed=seed,
                          patience=patience)
    if seconds is None and requests is None:
        seconds = default_seconds
    return make_trace(arrivals, service, load=load, engines=engines, speed=speed, seconds=seconds, requests=requests,
                      seed=seed, mix=mix, model=model, mean_service_s=mean_service_s, noise_cv=noise_cv,
                      clients=clients, patience=patience)
