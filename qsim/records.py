"""The per-request record: one schema for the simulator, the live harness and analysis.

Every request in a trace ends in exactly one row with exactly one outcome per
attempt: a client that sends a refused request again (:mod:`qsim.clients`) adds a
row per attempt, which names its first in ``first_request_id``; the request's
end-to-end outcome is its last attempt's, judged from its first send
(:func:`analysis.metrics.end_to_end`).
Times are seconds on the run's clock (simulated time, or seconds since the
replay started); a quantity that does not apply is NaN (floats) or <NA> (ints).
Executors may append columns of their own (the live harness adds HTTP status,
send lateness, error); :func:`validate` checks only the shared ones.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from .outcomes import ANSWERED, OUTCOMES, Outcome
from .policy import on_time

#: What a request may carry, in a trace file as in an HTTP body: a priority within +-PRIORITY_BOUND,
#: a client id of 1 to CLIENT_ID_CHARS characters.
PRIORITY_BOUND = 1000
CLIENT_ID_CHARS = 128

#: column -> (pandas dtype, meaning). The order is the column order of a frame.
SCHEMA: dict[str, tuple[str, str]] = {
    "request_id": (
        "int64",
        "position of the request in its trace, from 0; a retry's follows the "
        "trace's, in the order retries were decided",
    ),
    "first_request_id": (
        "int64",
        "request_id of the request's first attempt (its own, for a first attempt)",
    ),
    "attempt": ("int64", "attempt number, from 1; arrival_s is this attempt's send time"),
    "arrival_s": ("float64", "arrival time"),
    "size_class": ("string", "size class label: the smallest mix size holding max_new_tokens"),
    "max_new_tokens": ("int64", "tokens the request may generate; the estimate is made from it"),
    "est_service_s": ("float64", "estimated service time at admission, speed factor included"),
    "true_service_s": ("float64", "engine time it took, or would have taken (simulator)"),
    "deadline_s": ("float64", "deadline relative to arrival"),
    "priority": (
        "int64",
        "priority it was sent with: higher first under a priority discipline, below 0 sheddable",
    ),
    "client_id": (
        "string",
        "the client that sent it (per-client limits, fair share); <NA>: none named",
    ),
    "outcome": ("string", "one of OUTCOMES"),
    "reason": (
        "string",
        "why refused, dropped or ended (queue_full, work_limit, "
        "deadline_unreachable, cannot_finish, engine_exception, engine_stalled, "
        "client_left, client_timeout, deadline_passed, prompt_cannot_fit: a "
        "live replayer did not send it, its new tokens fill the context); <NA> "
        "otherwise",
    ),
    "start_s": ("float64", "engine start time; NaN if never run"),
    "finish_s": ("float64", "time the answer, refusal or drop was given"),
    "latency_s": ("float64", "finish_s - arrival_s: latency of an answer, or time to a refusal"),
    "queued_at_arrival": (
        "Int64",
        "requests waiting (not in service) when it arrived; <NA> where a service did not say",
    ),
    "queued_work_at_arrival_s": ("float64", "estimated work of those waiting when it arrived"),
    # With the columns above, what the built-in admission rule read (qsim.policy.decide's numbers),
    # so that a decision can be checked from its record alone (analysis.compare: a disagreement's
    # cause, rule or timing).
    "in_service_work_at_arrival_s": (
        "float64",
        "estimated work left in service when it arrived, "
        "summed over the busy "
        "engines (0 with an engine idle); NaN where a "
        "service did not say",
    ),
    "idle_at_arrival": ("Int64", "engines idle when it arrived; <NA> where a service did not say"),
    "retry_after_s": (
        "Int64",
        "Retry-After given with a refusal or a drop at the front (503, 429), whole seconds",
    ),
    "engine": ("Int64", "engine that ran it, from 0"),
    # What the engine did, token by token (metric definitions: analysis.metrics and
    # docs/metrics.md).
    "ttft_s": (
        "float64",
        "time to first token: from arrival_s to its first token, queueing included; NaN: none",
    ),
    "tpot_s": (
        "float64",
        "time per output token after the first: (finish_s - first token) / "
        "(output_tokens - 1); "
        "NaN below two tokens or where unknown",
    ),
    "output_tokens": (
        "Int64",
        "tokens it generated (answered, or before it was cut); <NA>: never ran or unknown",
    ),
    "preemptions": (
        "Int64",
        "times a batching engine preempted it (recompute); <NA>: never ran or unknown",
    ),
    "kv_blocks_peak": (
        "Int64",
        "KV-cache blocks it held at its peak (a batching engine's); <NA>: unknown",
    ),
    "ttft_slo_s": ("float64", "its time-to-first-token objective; NaN: none"),
    "tpot_slo_s": ("float64", "its time-per-output-token objective; NaN: none"),
    "cached_prompt_tokens": (
        "Int64",
        "prompt tokens its first scheduling found in a batching "
        "engine's prefix cache (vLLM's num_cached_tokens); <NA>: "
        "no prefix cache, or never ran",
    ),
    "replica": (
        "Int64",
        "replica of a fleet it went to, from 0 (qsim.fleet): routed there, or "
        "bound where it started under a central queue; <NA>: none (a central "
        "queue's request that never started, one a fleet's gate refused, or a "
        "service that did not say)",
    ),
}
COLUMNS = tuple(SCHEMA)
#: Columns a driver may leave out of :func:`from_arrays` (filled as missing): what older drivers do
#: not know.
OPTIONAL = (
    "in_service_work_at_arrival_s",
    "idle_at_arrival",
    "ttft_s",
    "tpot_s",
    "output_tokens",
    "preemptions",
    "kv_blocks_peak",
    "ttft_slo_s",
    "tpot_slo_s",
)
OPTIONAL += ("cached_prompt_tokens",)  # a prefix cache's (qsim.prefix), added since
OPTIONAL += ("replica",)  # a fleet's (qsim.fleet), added since


def empty(n: int = 0) -> pd.DataFrame:
    """A frame of the schema's columns and dtypes with n rows of missing values."""
    return pd.DataFrame({c: pd.Series([pd.NA] * n, dtype=t) for c, (t, _) in SCHEMA.items()})


def column(values, dtype) -> np.ndarray:
    """A column's values as an array of ``dtype``. A driver's Python list is read element by element
    (np.fromiter): np.asarray first walks a list to find its shape and type, which costs a plain
    simulation's records a sixth more."""
    if type(values) is list:
        try:
            return np.fromiter(values, dtype=dtype, count=len(values))
        # what fromiter cannot convert one by one: numpy's own rules decide
        except (TypeError, ValueError):
            pass
    return np.asarray(values, dtype=dtype)


def _int64(values: np.ndarray, missing: np.ndarray) -> pd.arrays.IntegerArray:
    """An Int64 column from its values and its mask, built directly: pd.array of a list of pd.NA, or
    a masked assignment after, costs a simulation of 50,000 requests about a tenth of its time
    (bench_qsim)."""
    return pd.arrays.IntegerArray(np.where(missing, 0, values), missing)


def _strings(values) -> pd.api.extensions.ExtensionArray:
    """A string column from str (or StrEnum) values and missing ones (None, NaN, pd.NA). Where
    pandas keeps strings in Arrow, the Arrow array is built directly: pd.array's own conversion
    checks and copies every element in Python, a tenth of a plain simulation's time for its three
    string columns (bench_qsim)."""
    if pd.StringDtype().storage == "pyarrow":
        try:
            return pd.arrays.ArrowStringArray(
                pa.array(values, type=pa.large_string(), from_pandas=True)
            )
        except pa.ArrowException:  # not all strings (client ids given as numbers)
            pass
    return pd.array(
        [v if v is None or isinstance(v, str) else str(v) for v in values], dtype="string"
    )


def from_arrays(columns: dict[str, np.ndarray]) -> pd.DataFrame:
    """Build a frame in schema order and dtypes; -1 in an Int64 column means missing, as does an
    :data:`OPTIONAL` column left out."""
    data = {}
    n = len(next(iter(columns.values()))) if columns else 0
    for name, (dtype, _) in SCHEMA.items():
        if name not in columns and name in OPTIONAL:
            data[name] = (
                _int64(np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool))
                if dtype == "Int64"
                else np.full(n, np.nan)
            )
            continue
        values = columns[name]
        if dtype == "Int64":
            values = column(values, np.int64)
            values = _int64(values, values < 0)
        elif dtype == "string":
            values = _strings(values)
        else:
            values = column(values, dtype)
        data[name] = values
    extra = {k: v for k, v in columns.items() if k not in SCHEMA}
    return pd.DataFrame({**data, **extra})


def with_optional(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with any :data:`OPTIONAL` column it lacks added as missing: a run file written
    before that column existed still reads (``qlab compare``)."""
    absent = [c for c in OPTIONAL if c not in frame.columns]
    if not absent:
        return frame
    return frame.assign(
        **{
            c: pd.array([pd.NA] * len(frame), dtype=SCHEMA[c][0])
            if SCHEMA[c][0] == "Int64"
            else np.full(len(frame), np.nan)
            for c in absent
        }
    )


def validate(frame: pd.DataFrame) -> pd.DataFrame:
    """Check a frame against the schema and the invariants every executor keeps; return it.

    Raises ValueError naming the first broken rule.
    """
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"records lack columns {missing}")
    for name, (dtype, _) in SCHEMA.items():
        if str(frame[name].dtype) != dtype:
            raise ValueError(f"column {name} has dtype {frame[name].dtype}, expected {dtype}")
    twice = frame["request_id"].duplicated()
    if twice.any():
        raise ValueError(
            f"request_id {frame['request_id'][twice].iloc[0]} appears twice: every "
            "request has exactly "
            "one outcome"
        )
    if (frame["attempt"] < 1).any() or frame[["first_request_id", "attempt"]].duplicated().any():
        raise ValueError("attempts count from 1, once each per first_request_id")
    if (frame["attempt"].eq(1) != frame["first_request_id"].eq(frame["request_id"])).any():
        raise ValueError(
            "a first attempt's first_request_id is its own request_id, and only a first attempt's"
        )
    # none (a lost request) or an unknown one: name the first
    bad = ~frame["outcome"].isin(OUTCOMES)
    if bad.any():
        first = frame[bad].iloc[0]
        has = "no outcome" if pd.isna(first["outcome"]) else f"outcome {first['outcome']!r}"
        raise ValueError(
            f"request_id {first['request_id']} has {has}: every request ends in "
            "exactly one of "
            f"{', '.join(OUTCOMES)}"
        )
    answered = frame["outcome"].isin(ANSWERED)
    if frame.loc[answered | frame["outcome"].eq(Outcome.CANCELLED), "start_s"].isna().any():
        raise ValueError("an answered or cancelled request has no start time")
    if (
        frame.loc[frame["outcome"].isin([Outcome.REJECTED, Outcome.EXPIRED]), "start_s"].notna()
    ).any():
        raise ValueError("a refused or expired request has a start time")
    if (frame.loc[answered, "outcome"].eq(Outcome.GOOD) != met_objectives(frame)[answered]).any():
        raise ValueError(
            "good/late disagrees with latency_s against deadline_s (and the TTFT and "
            "TPOT objectives)"
        )
    return frame


def met_objectives(frame: pd.DataFrame) -> pd.Series:
    """Per row: its latency met its deadline, and its TTFT and TPOT met their objectives where it
    has them and they are known (DistServe's goodput counts a request good only when it meets every
    objective set)."""
    met = pd.Series(on_time(frame["latency_s"], frame["deadline_s"]), index=frame.index)
    for value, slo in (("ttft_s", "ttft_slo_s"), ("tpot_s", "tpot_slo_s")):
        if slo in frame.columns and value in frame.columns:
            checked = frame[slo].notna() & frame[value].notna()
            met &= ~checked | pd.Series(on_time(frame[value], frame[slo]), index=frame.index)
    return met
