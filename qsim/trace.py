"""A trace: every request's arrival, size, estimate, true service time, deadline, priority and
client as arrays (:class:`Trace`), made from per-request arrays (:func:`assemble_trace`, what a
synthetic workload and a trace file's reader both end with) or from explicit requests
(:func:`from_arrays`). Synthetic traces are :mod:`qsim.workload`'s, trace files
:mod:`qsim.tracefiles`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .chunks import TraceChunks, spans
from .mixes import REFERENCE_MIX, Mix
from .service import ServiceModel


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
    early, :class:`qsim.mixes.UsedShare`); true_service_s follows it, est_service_s the limit.
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
        patience = (
            np.full(len(self.arrival_s), math.inf) if self.patience_s is None else self.patience_s
        )
        object.__setattr__(self, "patience_s", np.asarray(patience, dtype=float))
        used = self.max_new_tokens if self.tokens_generated is None else self.tokens_generated
        object.__setattr__(self, "tokens_generated", np.asarray(used, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def request_id(self) -> np.ndarray:
        return np.arange(len(self), dtype=np.int64)

    def rows(self, lo: int, hi: int) -> "Trace":
        """Requests lo to hi - 1 as a trace of their own (request_id from 0; duration, name and
        meta the whole's)."""
        part = slice(lo, hi)
        return Trace(
            self.arrival_s[part],
            self.max_new_tokens[part],
            self.size_class[part],
            self.est_service_s[part],
            self.true_service_s[part],
            self.deadline_s[part],
            self.prompt_tokens[part],
            self.priority[part],
            self.client_id[part],
            self.duration_s,
            self.name,
            self.meta,
            self.patience_s[part],
            self.tokens_generated[part],
            None if self.tokens is None else self.tokens[part],
        )

    def chunks(self, size: int) -> TraceChunks:
        """This trace ``size`` requests at a time (what a streamed run reads:
        :mod:`qsim.stream`)."""
        if not (isinstance(size, (int, np.integer)) and size >= 1):
            raise ValueError(f"a chunk holds a whole number >= 1 of requests, got {size!r}")
        return TraceChunks(
            len(self),
            int(size),
            self.duration_s,
            self.name,
            self.meta,
            lambda: (self.rows(lo, hi) for lo, hi in spans(len(self), int(size))),
        )

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
                **(
                    {"tokens_generated": self.tokens_generated}
                    if (self.tokens_generated != self.max_new_tokens).any()
                    else {}
                ),
            }
        )

    def save(self, path: str | Path) -> None:
        """Write the per-request file that :func:`qsim.tracefiles.load_trace` reads back
        (.parquet or .csv)."""
        frame = self.to_frame()
        if str(path).endswith(".parquet"):
            frame.to_parquet(path, index=False)
        else:
            frame.to_csv(path, index=False)


def assemble_trace(
    arrival_s,
    tokens,
    est,
    true,
    *,
    mix,
    duration_s,
    name,
    meta,
    deadline_s=None,
    prompt_tokens=None,
    priority=None,
    client_id=None,
    patience_s=None,
    tokens_generated=None,
) -> Trace:
    """A :class:`Trace` from per-request arrays (what make_trace and the trace file reader both
    end with)."""
    n = len(arrival_s)
    if client_id is None:
        client_id = np.full(n, None, dtype=object)
    return Trace(
        arrival_s=np.asarray(arrival_s, dtype=float),
        max_new_tokens=np.asarray(tokens, dtype=np.int64),
        size_class=mix.size_class(tokens),
        est_service_s=np.asarray(est, dtype=float),
        true_service_s=np.asarray(true, dtype=float),
        deadline_s=np.full(n, np.nan)
        if deadline_s is None
        else np.asarray(deadline_s, dtype=float),
        prompt_tokens=np.zeros(n, dtype=np.int64)
        if prompt_tokens is None
        else np.asarray(prompt_tokens, dtype=np.int64),
        priority=np.zeros(n, dtype=np.int64)
        if priority is None
        else np.asarray(priority, dtype=np.int64),
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
    return assemble_trace(
        arrival,
        tokens,
        est,
        true,
        mix=mix,
        duration_s=duration,
        name=name,
        meta={},
        deadline_s=deadline_s,
        priority=priority,
        client_id=client_id,
    )
