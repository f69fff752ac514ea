"""Trace files: an Azure LLM inference trace CSV, or qlab's own per-request .csv/.parquet, read into
a :class:`Trace`; and :func:`build_trace`, the one way a command's options become a trace (a file,
or :func:`~qsim.workload.make_trace`), whole or a chunk at a time (:func:`build_chunks`).

A bad file is a ValueError that names the file and the line (or row) of the first bad value. This
module builds on :mod:`qsim.workload` and never the other way round (tests/test_layout.py checks
there is no circle).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .clients import Patience
from .records import CLIENT_ID_CHARS, PRIORITY_BOUND
from .service import ServiceModel
from .chunks import TraceChunks
from .mixes import REFERENCE_MIX, Mix, used_tokens
from .trace import Trace, assemble_trace
from .workload import TracePlan, load_rate, lognormal_noise, plan_trace, random_streams

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
            raise ValueError(
                f"{self.path}: {self.where} {i + self.first}: bad {column} {value!r}{why}"
            )

    def number(
        self, column: str, ok=None, integer: bool = False, optional: bool = False
    ) -> np.ndarray:
        """The column as numbers; with ``optional``, empty cells and 'nan' become NaN."""
        raw = self.frame[column].str.strip()
        values = pd.to_numeric(raw, errors="coerce")
        bad = values.isna()
        if optional:
            bad &= ~(raw.isna() | raw.str.lower().isin(["", "nan", "none", "<na>"]))
        if not optional:  # 'inf' parses as a number, but no arrival, size or time can be infinite
            bad |= values.notna() & ~np.isfinite(values)
        # past 2**53 a float is no longer an exact count, and past 2**63 it wraps when cast
        if integer:
            bad |= values.notna() & ((values != values.round()) | (values.abs() >= 2.0**53))
        if ok is not None:
            bad |= values.notna() & ~ok(values)
        self.fail_first(column, bad)
        return values.to_numpy(dtype=float)

    def client_ids(self, column: str) -> np.ndarray:
        """Client names as objects; an empty cell (or NA) is no client (None)."""
        raw = self.frame[column].str.strip()
        none = raw.isna() | raw.isin(["", "nan", "None", "<NA>"])
        self.fail_first(
            column,
            raw.str.len() > CLIENT_ID_CHARS,
            f": a client id is at most {CLIENT_ID_CHARS} characters",
        )
        return np.where(none.to_numpy(), None, raw.to_numpy(dtype=object))

    def timestamps(self, column: str) -> pd.Series:
        """The column as times. Stamps with a UTC offset are put on UTC; a file may not mix them
        with stamps without one (local time of an unknown zone): the arrivals between the two would
        be guesses."""
        raw = self.frame[column].str.strip()
        zoned = raw.str.contains(_ZONED, na=False)
        utc = bool(zoned.iloc[0]) if len(zoned) else False  # the first line sets the kind
        self.fail_first(
            column,
            zoned != utc,
            f": {'no' if utc else 'a'} UTC offset, unlike {self.where} {self.first}",
        )
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
        raise ValueError(
            f"{path}: not a text CSV file ({exc.reason} on line {_first_bad_utf8_line(path)})"
        ) from None


def _first_bad_utf8_line(path: Path) -> int:
    """The line of the file's first byte that is not UTF-8 (pandas' own offset is into a buffer,
    not the file)."""
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
    patience: Patience | None = None,
    used=None,
) -> Trace:
    """Read an Azure LLM inference trace CSV or one of qlab's own per-request files.

    Azure: ``TIMESTAMP,ContextTokens,GeneratedTokens``; arrivals are seconds since
    the first request, GeneratedTokens becomes max_new_tokens, ContextTokens
    prompt_tokens, and true service times come from ``model`` times ``speed``
    (and seeded noise). qlab's own files (.csv or .parquet, from
    :meth:`Trace.save`) need arrival_s and max_new_tokens; est/true service
    times, deadlines, prompt lengths, priorities, client ids and patience (``patience_s``, seconds
    from the first send; empty: forever) are used when present. ``patience`` draws each request's
    patience instead (from the seed's fifth stream); its kind "column" takes the file's and needs
    it. A file's ``tokens_generated`` (at most max_new_tokens) is the work each request does where
    it stops early; ``used`` (:class:`qsim.mixes.UsedShare`) draws it instead, from the seed's sixth
    stream. Arrival times are multiplied by ``time_scale`` (0.5 replays twice as fast).
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
        est = true = deadline = priority = client = patience_col = generated = None
    elif present >= set(OWN_REQUIRED):
        arrival = cols.number("arrival_s", ok=lambda v: v >= 0)
        tokens = cols.number("max_new_tokens", ok=lambda v: v >= 1, integer=True)
        prompt = (
            cols.number("prompt_tokens", ok=lambda v: v >= 0, integer=True)
            if "prompt_tokens" in present
            else None
        )
        est = cols.number("est_service_s", ok=positive) if "est_service_s" in present else None
        true = cols.number("true_service_s", ok=positive) if "true_service_s" in present else None
        deadline = (
            cols.number("deadline_s", ok=positive, optional=True)
            if "deadline_s" in present
            else None
        )
        bounded = lambda v: v.abs() <= PRIORITY_BOUND  # noqa: E731
        priority = (
            cols.number("priority", ok=bounded, integer=True) if "priority" in present else None
        )
        client = cols.client_ids("client_id") if "client_id" in present else None
        patience_col = (
            cols.number("patience_s", ok=positive, optional=True)
            if "patience_s" in present
            else None
        )
        generated = (
            cols.number("tokens_generated", ok=lambda v: v >= 1, integer=True)
            if "tokens_generated" in present
            else None
        )
        if generated is not None:
            cols.fail_first(
                "tokens_generated", pd.Series(generated > tokens), ": more than its max_new_tokens"
            )
    else:
        raise ValueError(
            f"{path}: unrecognised trace columns {list(frame.columns)}; expected "
            f"{','.join(AZURE_COLUMNS)} "
            f"(Azure LLM trace) or at least {','.join(OWN_REQUIRED)} (qlab trace)"
        )
    # Real logs are not always sorted; a stable sort keeps the file order among ties.
    order = np.argsort(arrival, kind="stable")
    pick = lambda a: None if a is None else a[order]  # noqa: E731
    arrival, tokens, prompt, est, true, deadline, priority, client, patience_col, generated = map(
        pick,
        (arrival, tokens, prompt, est, true, deadline, priority, client, patience_col, generated),
    )
    arrival = arrival * time_scale
    prompt_or_0 = 0 if prompt is None else prompt
    est = model.estimate(tokens, prompt_or_0) if est is None else est
    if used is not None:  # early stops drawn, in place of the file's own tokens_generated
        generated = used_tokens(random_streams(seed)[5], tokens.astype(np.int64), used)
    if true is None:  # the engine's time follows the work done: the tokens generated where known
        work = est if generated is None else model.estimate(generated, prompt_or_0)
        true = work * speed * lognormal_noise(random_streams(seed)[2], len(tokens), noise_cv)
    duration = float(arrival[-1] - arrival[0])
    meta = dict(path=str(path), time_scale=time_scale, speed=speed, noise_cv=noise_cv, seed=seed)
    if patience is not None:
        if patience.kind == "column" and patience_col is None:
            raise ValueError(
                f"{path}: patience 'column' needs a patience_s column, and the file has none"
            )
        patience_col = patience.draw(random_streams(seed)[4], len(tokens), patience_col)
        meta.update(patience=patience.spec, patience_until=patience.until)
    elif patience_col is not None:  # the file's own, empty cells waiting forever
        patience_col = Patience("column").draw(None, len(tokens), patience_col)
    return assemble_trace(
        arrival,
        tokens,
        est,
        true,
        mix=mix,
        duration_s=duration,
        name=path.stem,
        meta=meta,
        deadline_s=deadline,
        prompt_tokens=prompt,
        priority=priority,
        client_id=client,
        patience_s=patience_col,
        tokens_generated=generated,
    )


# ---------------------------------------------------------------- a window of a trace file


@dataclass(frozen=True)
class WindowNames:
    """What a window's options are called where they were given (the command line's flags by
    default), for its refusals."""

    trace: str = "--trace"
    start: str = "--start"
    seconds: str = "--seconds"
    requests: str = "--requests"
    load: str = "--load"
    time_scale: str = "--time-scale"


@dataclass(frozen=True)
class TraceWindow:
    """Which part of a trace file a run takes, and at what rate: ``--start``, ``--seconds`` and the
    load (``qlab simulate --load``, ``qlab replay --nominal-load``) beside ``--trace``.

    The window is on the file's clock (its arrival times as read, after ``--time-scale``): the
    requests that arrive in [start_s, start_s + seconds), their times shifted by start_s so that the
    run starts at 0. start_s None: at the file's first request; seconds None: to its last. The
    window's length is ``seconds``, or less where the file ends sooner (its last request then closes
    it); rates (goodput) are over it.

    With ``load``, the window's times (and its length) are then multiplied by one factor so that its
    mean rate, its requests over its length, is ``load`` x the capacity of the run's engines (K,
    given to
    :meth:`apply`; build_trace's ``engines``) at its requests' mean true service time:
    lambda = load * K / mean(true S) (:func:`qsim.workload.load_rate`, synthetic arrivals' rule,
    with the window's own requests as the mix). The gaps keep their shape; each request keeps its
    sizes, deadline, client and patience; the factor is in the trace's
    ``meta["window"]["time_factor"]``. The true service times are those the trace was built with: at
    the simulated speed in ``qlab simulate``, the calibration's (speed 1) in ``qlab replay``, so
    that the load means there what the command's load means for synthetic arrivals.
    """

    start_s: float | None = None
    seconds: float | None = None
    load: float | None = None

    def __post_init__(self) -> None:
        if self.start_s is not None and not (self.start_s >= 0 and math.isfinite(self.start_s)):
            raise ValueError(
                f"a trace window's start must be a number of seconds >= 0, got {self.start_s}"
            )
        for name, value in (("seconds", self.seconds), ("load", self.load)):
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"a trace window's {name} must be a positive number, got {value}")

    @classmethod
    def asked(
        cls,
        start_s: float | None,
        seconds: float | None,
        load: float | None,
        *,
        requests: int | None = None,
        time_scale: float = 1.0,
        names: WindowNames | None = None,
    ) -> TraceWindow:
        """The window that a command's (or a config's) options ask of a trace file, refusing
        (ValueError, one line, in ``names``' words) what a trace file cannot take: a number of
        requests (a window is in seconds), and a load beside a time scale (both would set the file's
        rate)."""
        n = names or WindowNames()
        if requests is not None:
            raise ValueError(
                f"{n.requests} applies to synthetic arrivals; with {n.trace} take a "
                "window with "
                f"{n.start} and {n.seconds}"
            )
        if load is not None and time_scale != 1.0:
            raise ValueError(
                f"{n.load} and {n.time_scale} both set the trace's rate: give one or the other"
            )
        return cls(start_s, seconds, load)

    @property
    def whole(self) -> bool:
        """Nothing asked: the file as it is."""
        return self.start_s is None and self.seconds is None and self.load is None

    def apply(self, trace: Trace, engines: int = 1) -> Trace:
        """The window of ``trace`` (arrivals sorted, as :func:`load_trace` reads them); ValueError
        when it holds no request, or when a load is asked of a window with no length to take a rate
        over."""
        if self.whole or len(trace) == 0:
            return trace
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        arrival = trace.arrival_s
        start = float(arrival[0]) if self.start_s is None else self.start_s
        end = math.inf if self.seconds is None else start + self.seconds
        lo, hi = (int(i) for i in np.searchsorted(arrival, [start, end], side="left"))
        if lo == hi:
            raise ValueError(
                f"{trace.name}: no request arrives in [{start:g}, {end:g}) s (its "
                "arrivals run from "
                f"{arrival[0]:g} to {arrival[-1]:g} s)"
            )
        length = min(end, float(arrival[-1])) - start
        factor = 1.0
        if self.load is not None:
            if not length > 0:
                raise ValueError(
                    f"{trace.name}: the window [{start:g}, {end:g}) s has no length "
                    "to take a rate "
                    "over (its requests arrive at one instant): a load cannot scale "
                    "it"
                )
            part = trace.true_service_s[lo:hi]
            factor = (hi - lo) / length / load_rate(self.load, engines, float(part.mean()))
        window = dict(
            start_s=start,
            seconds=self.seconds,
            load=self.load,
            engines=engines,
            time_factor=factor,
            requests_in_file=len(trace),
        )
        return dataclasses.replace(
            trace.rows(lo, hi),
            arrival_s=(arrival[lo:hi] - start) * factor,
            duration_s=length * factor,
            meta={**trace.meta, "window": window},
        )


# ---------------------------------------------------------------- a trace from options


#: The options of :func:`make_trace` that also apply to a trace file
#: (:func:`qsim.tracefiles.load_trace`).
FILE_OPTIONS = ("model", "mix", "speed", "noise_cv", "seed", "patience", "used")


def build_trace(
    file: str | Path | None = None,
    *,
    time_scale: float = 1.0,
    default_seconds: float | None = None,
    window: TraceWindow | None = None,
    **options,
) -> Trace:
    """The trace that a command's options describe; every command (simulate, replay, live, sweep)
    builds it here.

    ``options`` are :func:`make_trace`'s (``arrivals`` and ``service`` by name). With ``file``: that
    trace file, read by :func:`qsim.tracefiles.load_trace` (``time_scale`` and the
    :data:`FILE_OPTIONS` apply; the arrival and length options do not, and a file brings its own
    clients, in its client_id and priority columns; ``patience`` None keeps the file's patience_s
    column, if any; ``window``, a :class:`TraceWindow`, takes part of it at a rate of its own).
    Otherwise :func:`make_trace`, ``default_seconds`` long when neither ``seconds`` nor ``requests``
    is given (a burst's length is its size whatever they are).
    """
    source = _source(file, time_scale, default_seconds, options, window)
    return source if isinstance(source, Trace) else source.trace()


def build_chunks(
    size: int,
    file: str | Path | None = None,
    *,
    time_scale: float = 1.0,
    default_seconds: float | None = None,
    window: TraceWindow | None = None,
    **options,
) -> TraceChunks:
    """:func:`build_trace`'s trace ``size`` requests at a time (what a streamed run reads,
    :mod:`qsim.stream`): a synthetic one drawn a chunk at a time
    (:meth:`qsim.workload.TracePlan.chunks`), a file read whole, its window taken, and cut."""
    return _source(file, time_scale, default_seconds, options, window).chunks(size)


def _source(
    file,
    time_scale: float,
    default_seconds: float | None,
    options: dict,
    window: TraceWindow | None = None,
) -> Trace | TracePlan:
    unknown = set(options) - set(inspect.signature(plan_trace).parameters)
    if unknown:
        raise TypeError(f"build_trace() got unexpected options: {', '.join(sorted(unknown))}")
    if file:
        if options.get("clients"):
            raise ValueError(
                "a trace file brings its own clients (its client_id and priority "
                "columns); "
                "workload clients apply to synthetic arrivals"
            )
        trace = load_trace(
            file, time_scale, **{k: v for k, v in options.items() if k in FILE_OPTIONS}
        )
        return trace if window is None else window.apply(trace, options.get("engines", 1))
    if window is not None and not window.whole:
        raise ValueError(
            "a trace window (start, seconds and load of a trace file) applies to a trace file"
        )
    if options.get("seconds") is None and options.get("requests") is None:
        options["seconds"] = default_seconds
    return plan_trace(**options)
