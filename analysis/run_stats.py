"""The statistics the closed-form check (:mod:`analysis.validation`) reads of one replication's
records: means of waits, sojourns, lengths and steps, shares that waited, were blocked or left, and
the control variates' statistics (a run's mean service, its realised load)."""

from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np
import pandas as pd

Stat = Callable[[pd.DataFrame], float]


def _served(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["start_s"].notna()]


def mean_wait(frame: pd.DataFrame) -> float:
    served = _served(frame)
    return float((served["start_s"] - served["arrival_s"]).mean())


def mean_sojourn(frame: pd.DataFrame) -> float:
    return float(_served(frame)["latency_s"].mean())


def _wait_share_over(t: float, frame: pd.DataFrame) -> float:
    served = _served(frame)
    # Starting "at once" can differ from arrival by a float rounding of the clock.
    return float(((served["start_s"] - served["arrival_s"]) > t + 1e-9).mean())


def wait_share_over(t: float) -> Stat:
    """P(wait > t) among the served (a partial, so process pools can send it)."""
    return partial(_wait_share_over, t)


def _wait_where(column: str, value, frame: pd.DataFrame) -> float:
    served = _served(frame)
    served = served[served[column] == value]
    return float((served["start_s"] - served["arrival_s"]).mean())


def wait_where(column: str, value) -> Stat:
    """Mean wait of the served whose ``column`` equals ``value`` (a priority class, a size)."""
    return partial(_wait_where, column, value)


def work_weighted_wait(frame: pd.DataFrame) -> float:
    """Sum of S_i W_i over sum of S_i: the load-weighted mean wait that the M/G/1 conservation
    law fixes."""
    served = _served(frame)
    s = served["true_service_s"]
    return float(((served["start_s"] - served["arrival_s"]) * s).sum() / s.sum())


def mean_tokens(frame: pd.DataFrame) -> float:
    """Mean output length of the served, in tokens (a control variate: its true mean is the drawn
    lengths')."""
    return float(_served(frame)["output_tokens"].mean())


def mean_gap(frame: pd.DataFrame) -> float:
    """Mean time between arrivals (a control variate: its true mean is 1 / the arrival rate)."""
    return float(np.diff(frame["arrival_s"].to_numpy()).mean())


def mean_service(frame: pd.DataFrame) -> float:
    """Mean true service time of the served (a control variate: its true mean is the drawn
    sizes')."""
    return float(_served(frame)["true_service_s"].mean())


def load_deviation(rate: float, mean_s: float) -> Stat:
    """The run's realised load less the offered, to first order: mean service / ``mean_s`` minus
    ``rate`` x the mean gap between arrivals (a control variate whose true mean is 0). Unlike the
    mean service alone it sees the arrivals too, which move a wait as much as the sizes do."""
    return partial(_load_deviation, rate, mean_s)  # a partial, not a closure: workers pickle it


def _load_deviation(rate: float, mean_s: float, frame: pd.DataFrame) -> float:
    return mean_service(frame) / mean_s - rate * mean_gap(frame)


def mean_step_s(frame: pd.DataFrame) -> float:
    """Mean step time of a batching engine whose every request is one step long (no prompt, one
    token).

    Every step then ends with all of its requests, at their common finish time; it began when the
    previous step ended, or, where the engine was idle by then, when its first request arrived (an
    arrival to an idle engine starts a step at once): start_k = max(end_(k-1), first arrival in step
    k). The first step of the frame is left out: it may hold requests of the warm-up, left out of
    the frame. A step's time does not depend on who is in it, so these are independent draws of the
    step time.
    """
    ends, step_of = np.unique(frame["finish_s"].to_numpy(), return_inverse=True)
    first = np.full(len(ends), np.inf)
    np.minimum.at(first, step_of, frame["arrival_s"].to_numpy())
    starts = np.maximum(np.concatenate([[-np.inf], ends[:-1]]), first)
    return float((ends - starts)[1:].mean())


def blocked_share(frame: pd.DataFrame) -> float:
    return float(frame["outcome"].eq("rejected").mean())


def waited_share(frame: pd.DataFrame) -> float:
    """P(wait) over every arrival, the abandoned included: the share that did not start at once."""
    # never started (NaN) counts as waited
    at_once = (frame["start_s"] - frame["arrival_s"]) <= 1e-9
    return float(1.0 - at_once.mean())


def abandoned_share(frame: pd.DataFrame) -> float:
    """P(abandon): the share whose client left while waiting (``abandoned``) or that expiry at the
    front dropped unrun (``expired``), the two ways qlab models impatience while waiting."""
    return float(frame["outcome"].isin(("abandoned", "expired")).mean())


def mean_wait_all(frame: pd.DataFrame) -> float:
    """Mean wait over every arrival: to the start for the served, to the moment it left for the
    abandoned."""
    left = frame["start_s"].fillna(frame["finish_s"])
    return float((left - frame["arrival_s"]).mean())
