"""Workloads: size mixes, seeded arrival processes, service times, trace files.

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

from .service import ServiceModel

ARRIVALS = ("poisson", "constant", "gamma:CV", "burst:N", "periodic:N:PERIOD_S")
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
class Trace:
    """Arrivals with everything the executors need, one entry per request.

    est_service_s is the calibrated estimate (before speed tracking);
    true_service_s what the engine will take; deadline_s is relative to arrival,
    NaN meaning the policy default. duration_s is the arrival window used for
    rates (goodput); 0 for a single burst.
    """

    arrival_s: np.ndarray
    max_new_tokens: np.ndarray
    size_class: np.ndarray
    est_service_s: np.ndarray
    true_service_s: np.ndarray
    deadline_s: np.ndarray
    prompt_tokens: np.ndarray
    duration_s: float
    name: str = "trace"
    meta: dict = field(default_factory=dict)

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
            }
        )

    def save(self, path: str | Path) -> None:
        """Write the per-request file that :func:`load_trace` reads back (.parquet or .csv)."""
        frame = self.to_frame()
        if str(path).endswith(".parquet"):
            frame.to_parquet(path, index=False)
        else:
            frame.to_csv(path, index=False)


def _build(arrival_s, tokens, est, true, *, mix, duration_s, name, meta, deadline_s=None, prompt_tokens=None) -> Trace:
    n = len(arrival_s)
    return Trace(
        arrival_s=np.asarray(arrival_s, dtype=float),
        max_new_tokens=np.asarray(tokens, dtype=np.int64),
        size_class=mix.size_class(tokens),
        est_service_s=np.asarray(est, dtype=float),
        true_service_s=np.asarray(true, dtype=float),
        deadline_s=np.full(n, np.nan) if deadline_s is None else np.asarray(deadline_s, dtype=float),
        prompt_tokens=np.zeros(n, dtype=np.int64) if prompt_tokens is None else np.asarray(prompt_tokens, dtype=np.int64),
        duration_s=float(duration_s),
        name=name,
        meta=meta,
    )


def from_arrays(
    arrival_s,
    max_new_tokens,
    *,
    true_service_s=None,
    est_service_s=None,
    deadline_s=None,
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
    return _build(arrival, tokens, est, true, mix=mix, duration_s=duration, name=name, meta={},
                  deadline_s=deadline_s)


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
    """'poisson' | 'constant' | 'gamma:CV' | 'burst:N' | 'periodic:N:PERIOD_S' -> (kind, numbers)."""
    kind, *args = spec.split(":")
    arity = {"poisson": 0, "constant": 0, "gamma": 1, "burst": 1, "periodic": 2}
    if kind not in arity or len(args) != arity[kind]:
        raise ValueError(f"bad arrival process {spec!r}; expected one of {', '.join(ARRIVALS)}")
    try:
        numbers = tuple(float(a) for a in args)
    except ValueError:
        raise ValueError(f"bad arrival process {spec!r}: {':'.join(args)!r} is not a number") from None
    if any(not (x > 0 and math.isfinite(x)) for x in numbers):
        raise ValueError(f"bad arrival process {spec!r}: its numbers must be positive")
    if kind in ("burst", "periodic") and numbers[0] != int(numbers[0]):
        raise ValueError(f"bad arrival process {spec!r}: a burst size is a whole number")
    return kind, numbers


# ---------------------------------------------------------------- the trace


def _streams(seed: int) -> tuple[np.random.Generator, ...]:
    """Independent generators for gaps, sizes and service draws (common random numbers)."""
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))


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
) -> Trace:
    """A seeded synthetic trace.

    load is the utilisation at the simulated speed: lambda = load * engines / E[true S].
    speed multiplies every true service time (2.25 = the machine 2.25x slower).
    service: 'mix' (sizes from ``mix`` through ``model``, optional lognormal
    noise of CV ``noise_cv``), 'exponential' or 'deterministic' with mean
    ``mean_service_s`` (default: the mix's mean).
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
    mean_s = mix.mean_s(model) if mean_service_s is None else float(mean_service_s)
    if service == "mix" and mean_service_s is not None:
        raise ValueError("--mean-service applies to exponential and deterministic service, not to the mix")

    kind, numbers = parse_arrivals(arrivals)
    gaps_rng, size_rng, service_rng = _streams(seed)
    rate = load * engines / (speed * mean_s)
    if kind in ("poisson", "constant", "gamma"):
        cv = numbers[0] if numbers else 1.0
        times = renewal_arrivals(kind, gaps_rng, rate, seconds=seconds, requests=requests, cv=cv)
        duration = seconds if seconds is not None else (times[-1] if times.size else 0.0)
    elif kind == "burst":
        times = burst_arrivals(int(numbers[0]))
        duration = 0.0
    else:
        times = periodic_bursts(int(numbers[0]), numbers[1], seconds=seconds, requests=requests)
        duration = seconds if seconds is not None else (times[-1] + numbers[1] if times.size else 0.0)
    n = times.size

    if service == "mix":
        tokens = np.asarray(mix.sizes)[size_rng.choice(len(mix.sizes), size=n, p=mix.probs)]
        est = model.estimate(tokens)
        true = est * speed * lognormal_noise(service_rng, n, noise_cv)
    else:
        tokens = np.full(n, model.tokens_for(mean_s), dtype=np.int64)
        est = np.full(n, mean_s)
        draws = service_rng.standard_exponential(n) if service == "exponential" else np.ones(n)
        true = mean_s * speed * draws
    meta = dict(arrivals=arrivals, service=service, load=load, engines=engines, speed=speed,
                seed=seed, rate=rate, mean_service_s=mean_s, noise_cv=noise_cv)
    return _build(times, tokens, est, true, mix=mix, duration_s=duration, name=f"{arrivals}-{service}", meta=meta)


# ---------------------------------------------------------------- trace files

AZURE_COLUMNS = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
OWN_REQUIRED = ["arrival_s", "max_new_tokens"]


#: A time of day followed by a UTC offset (Z, +05:00, -0800, +05): a zoned ISO 8601 stamp.
_ZONED = r"\d:\d\d(?::\d\d(?:\.\d*)?)?\s*(?:Z|[+-]\d\d(?::?\d\d)?)$"


class _Columns:
    """Parses the columns of one trace file, naming the line (or row) of the first bad value."""

    def __init__(self, frame: pd.DataFrame, path: Path, first: int, where: str) -> None:
        self.frame, self.path, self.first, self.where = frame, path, first, where

    def fail_first(self, column: str, bad: pd.Series, why: str = "") -> None:
        hits = np.flatnonzero(bad.to_numpy())
        if hits.size:
            i = int(hits[0])
            value = self.frame[column].iloc[i]
            raise ValueError(f"{self.path}: {self.where} {i + self.first}: bad {column} {value!r}{why}")

    def number(self, column: str, ok=None, integer: bool = False, optional: bool = False) -> np.ndarray:
        """The column as numbers; with ``optional``, empty cells and 'nan' become NaN."""
        raw = self.frame[column].str.strip()
        values = pd.to_numeric(raw, errors="coerce")
        bad = values.isna()
        if optional:
            bad &= ~(raw.isna() | raw.str.lower().isin(["", "nan", "none", "<na>"]))
        if not optional:  # 'inf' parses as a number, but no arrival, size or time can be infinite
            bad |= values.notna() & ~np.isfinite(values)
        if integer:  # past 2**53 a float is no longer an exact count, and past 2**63 it wraps when cast
            bad |= values.notna() & ((values != values.round()) | (values.abs() >= 2.0**53))
        if ok is not None:
            bad |= values.notna() & ~ok(values)
        self.fail_first(column, bad)
        return values.to_numpy(dtype=float)

    def timestamps(self, column: str) -> pd.Series:
        """The column as times. Stamps with a UTC offset are put on UTC; a file may not mix them with stamps
        without one (local time of an unknown zone): the arrivals between the two would be guesses."""
        raw = self.frame[column].str.strip()
        zoned = raw.str.contains(_ZONED, na=False)
        utc = bool(zoned.iloc[0]) if len(zoned) else False  # the first line sets the kind
        self.fail_first(column, zoned != utc, f": {'no' if utc else 'a'} UTC offset, unlike {self.where} {self.first}")
        stamps = pd.to_datetime(raw, format="ISO8601", errors="coerce", utc=utc)
        self.fail_first(column, stamps.isna())
        return stamps


def _read_frame(path: Path) -> tuple[pd.DataFrame, int, str]:
    """All cells as strings, the number of the first data line (or row), and which word to use."""
    if path.suffix == ".parquet":
        try:
            return pd.read_parquet(path).astype(str), 0, "row"
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise ValueError(f"{path}: cannot read parquet: {exc}") from None
    try:
        # Line 1 is the header, so the first request is on line 2.
        return pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True), 2, "line"
    except pd.errors.ParserError as exc:
        raise ValueError(f"{path}: malformed CSV: {exc}".replace("\n", " ")) from None
    except pd.errors.EmptyDataError:
        raise ValueError(f"{path}: the file is empty") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a text CSV file ({exc.reason} on line {_first_bad_utf8_line(path)})") from None


def _first_bad_utf8_line(path: Path) -> int:
    """The line of the file's first byte that is not UTF-8 (pandas' own offset is into a buffer, not the file)."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return data.count(b"\n", 0, exc.start) + 1
    return 1  # pandas read it in another encoding; the file as a whole decodes


def load_trace(
    path: str | Path,
    time_scale: float = 1.0,
    *,
    model: ServiceModel = ServiceModel(),
    mix: Mix = REFERENCE_MIX,
    speed: float = 1.0,
    noise_cv: float = 0.0,
    seed: int = 0,
) -> Trace:
    """Read an Azure LLM inference trace CSV or one of qlab's own per-request files.

    Azure: ``TIMESTAMP,ContextTokens,GeneratedTokens``; arrivals are seconds since
    the first request, GeneratedTokens becomes max_new_tokens, ContextTokens
    prompt_tokens, and true service times come from ``model`` times ``speed``
    (and seeded noise). qlab's own files (.csv or .parquet, from
    :meth:`Trace.save`) need arrival_s and max_new_tokens; est/true service
    times, deadlines and prompt lengths are used when present.
    Arrival times are multiplied by ``time_scale`` (0.5 replays twice as fast).
    """
    path = Path(path)
    if not time_scale > 0 or not math.isfinite(time_scale):
        raise ValueError(f"time scale must be a positive number, got {time_scale}")
    if not path.is_file():
        raise ValueError(f"{path}: no such trace file")
    frame, first, where = _read_frame(path)
    if frame.empty:
        raise ValueError(f"{path}: the trace has no requests")
    cols = _Columns(frame, path, first, where)
    present = set(frame.columns)
    positive = lambda v: v > 0  # noqa: E731
    if present >= set(AZURE_COLUMNS):
        stamps = cols.timestamps("TIMESTAMP")
        arrival = (stamps - stamps.min()).dt.total_seconds().to_numpy()
        prompt = cols.number("ContextTokens", ok=lambda v: v >= 0, integer=True)
        tokens = cols.number("GeneratedTokens", ok=lambda v: v >= 1, integer=True)
        est = true = deadline = None
    elif present >= set(OWN_REQUIRED):
        arrival = cols.number("arrival_s", ok=lambda v: v >= 0)
        tokens = cols.number("max_new_tokens", ok=lambda v: v >= 1, integer=True)
        prompt = cols.number("prompt_tokens", ok=lambda v: v >= 0, integer=True) if "prompt_tokens" in present else None
        est = cols.number("est_service_s", ok=positive) if "est_service_s" in present else None
        true = cols.number("true_service_s", ok=positive) if "true_service_s" in present else None
        deadline = cols.number("deadline_s", ok=positive, optional=True) if "deadline_s" in present else None
    else:
        raise ValueError(
            f"{path}: unrecognised trace columns {list(frame.columns)}; expected {','.join(AZURE_COLUMNS)} "
            f"(Azure LLM trace) or at least {','.join(OWN_REQUIRED)} (qlab trace)"
        )
    # Real logs are not always sorted; a stable sort keeps the file order among ties.
    order = np.argsort(arrival, kind="stable")
    pick = lambda a: None if a is None else a[order]  # noqa: E731
    arrival, tokens, prompt, est, true, deadline = map(pick, (arrival, tokens, prompt, est, true, deadline))
    arrival = arrival * time_scale
    est = model.estimate(tokens) if est is None else est
    if true is None:
        true = est * speed * lognormal_noise(_streams(seed)[2], len(tokens), noise_cv)
    duration = float(arrival[-1] - arrival[0])
    meta = dict(path=str(path), time_scale=time_scale, speed=speed, noise_cv=noise_cv, seed=seed)
    return _build(arrival, tokens, est, true, mix=mix, duration_s=duration, name=path.stem, meta=meta,
                  deadline_s=deadline, prompt_tokens=prompt)
