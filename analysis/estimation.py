"""What the controller knows, and what knowing it wrongly costs: per-cell columns and the report's
tables.

Three experiments (issue 12; ``experiments/estimation.toml``, ``stale.toml``, ``cancellation.toml``)
ask

* *estimation*: with requests that stop early, how much do estimates from the limit, learned ones
  and exact ones (an oracle) refuse that would have fit, and admit that then miss;
* *stale*: when the machine slows down mid-run, how many of the answers are late with a tracking
  estimate and with a fixed one;
* *cancellation*: what cutting a run at its deadline saves in engine seconds and gains in goodput.

:func:`cell_summary` adds each cell's columns (a sweep with those axes calls it from
:func:`experiments.sweep.run_cell`); :func:`estimation_table`, :func:`stale_table` and
:func:`cancellation_table` turn a sweep's summary.parquet into the report's tables, means over seeds
with Student-t 95 % intervals (``<col>_low``/``<col>_high``, :func:`analysis.metrics.aggregate`).

*Would have fit* (``refused_would_fit``) is judged from what the rows hold, not by re-running the
queue without the refusal (which would change every later request):

* a request refused at arrival (``deadline_unreachable``) would have fit when the wait predicted at
  its arrival plus its TRUE service time is within its deadline. The predicted wait is rebuilt from
  the rows as the queue core computed it: the waiting's estimated work
  (``queued_work_at_arrival_s``) plus, for each run in service then, its estimate left (start +
  ``est_service_s`` - arrival, at least 0), over the engines; 0 when an engine was idle. The
  estimate of a run is the one made at its arrival, while the queue used the one at its start: the
  two differ only where the speed factor moved while it waited;
* a request dropped at the front (``expired``) would have fit when, started at that moment, its true
  time would have ended by its deadline.

Both use the estimated wait, not the wait it would really have had: the column measures the error of
the request's own estimate. Hence, where estimates are exact (the oracle at the calibrated speed,
no noise, no speed change, one engine in FIFO order), no refused request would have fit, by
construction.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from qsim.outcomes import Reason

from .metrics import aggregate, mean_ci

#: The refusal a wrong estimate makes at arrival (qsim.policy.decide's predictive rule).
UNREACHABLE = Reason.DEADLINE_UNREACHABLE


def _in_service_left(
    frame: pd.DataFrame, at: np.ndarray, engines: int
) -> tuple[np.ndarray, np.ndarray]:
    """For each time in ``at``: the estimated work left in service (summed over the engines' runs
    then) and whether an engine was idle. An engine runs one request at a time, from its start until
    it is released: at the cut for a cancelled run, else after its true time (a client that left
    does not free it)."""
    engine = frame["engine"].to_numpy(dtype=float, na_value=np.nan)
    start = frame["start_s"].to_numpy(dtype=float)
    est = frame["est_service_s"].to_numpy(dtype=float)
    cut = frame["outcome"].to_numpy(dtype=object) == "cancelled"
    release = np.where(
        cut,
        frame["finish_s"].to_numpy(dtype=float),
        start + frame["true_service_s"].to_numpy(dtype=float),
    )
    left = np.zeros(len(at))
    busy = np.zeros(len(at), dtype=np.int64)
    for k in range(engines):
        mine = np.flatnonzero((engine == k) & ~np.isnan(start))
        mine = mine[np.argsort(start[mine], kind="stable")]
        # The run engine k started last by each time; it is in service then unless released already.
        last = np.searchsorted(start[mine], at, side="right") - 1
        run = mine[np.maximum(last, 0)] if len(mine) else np.zeros(len(at), dtype=np.int64)
        inside = (last >= 0) & (release[run] > at) if len(mine) else np.zeros(len(at), dtype=bool)
        busy += inside
        left += np.where(inside, np.maximum(0.0, start[run] + est[run] - at), 0.0)
    return left, busy < engines


def predicted_wait(frame: pd.DataFrame, engines: int = 1, rows=None) -> np.ndarray:
    """The wait the queue core predicted at each arrival (of ``rows``, a boolean mask; default all),
    rebuilt from the rows: 0 with an engine idle, else the waiting's estimated work plus the
    estimates left of the runs in service, over the engines
    (:meth:`qsim.queue.AdmissionQueue.wait_s`)."""
    rows = np.ones(len(frame), dtype=bool) if rows is None else np.asarray(rows, dtype=bool)
    at = frame["arrival_s"].to_numpy(dtype=float)[rows]
    left, idle = _in_service_left(frame, at, engines)
    queued = np.nan_to_num(frame["queued_work_at_arrival_s"].to_numpy(dtype=float)[rows])
    return np.where(idle, 0.0, (queued + left) / engines)


def refused_would_fit(frame: pd.DataFrame, engines: int = 1) -> np.ndarray:
    """Per row: refused at arrival as deadline_unreachable, or expired, and it would have fit
    (module docstring)."""
    outcome = frame["outcome"].to_numpy(dtype=object)
    reason = frame["reason"].fillna("").to_numpy(dtype=object)
    arrival = frame["arrival_s"].to_numpy(dtype=float)
    deadline = frame["deadline_s"].to_numpy(dtype=float)
    true = frame["true_service_s"].to_numpy(dtype=float)
    finish = frame["finish_s"].to_numpy(dtype=float)
    fits = np.zeros(len(frame), dtype=bool)
    # Judged without the rounding allowance a good answer gets (TIME_TOLERANCE_S): a fit has to be a
    # real one.
    expired = outcome == "expired"
    fits[expired] = (finish[expired] - arrival[expired]) + true[expired] <= deadline[expired]
    refused = (outcome == "rejected") & (reason == UNREACHABLE)
    if refused.any():
        fits[refused] = predicted_wait(frame, engines, refused) + true[refused] <= deadline[refused]
    return fits


def engine_seconds(frame: pd.DataFrame) -> dict[str, float]:
    """Engine time used, and saved by cutting at the deadline.

    A run holds its engine for its true time (the row's true_service_s, the speed schedule included)
    unless it was cut (outcome cancelled): then from its start to the cut. engine_s_saved sums, over
    the cut runs, the true time they would have taken minus the time they ran.
    """
    outcome = frame["outcome"].to_numpy(dtype=object)
    start = frame["start_s"].to_numpy(dtype=float)
    finish = frame["finish_s"].to_numpy(dtype=float)
    true = frame["true_service_s"].to_numpy(dtype=float)
    cut = outcome == "cancelled"
    ran = ~np.isnan(start)
    held = np.where(cut, finish - start, true)
    return {
        "engine_s_total": float(held[ran].sum()),
        "engine_s_cancelled": float(held[cut].sum()),
        "engine_s_saved": float((true[cut] - held[cut]).sum()),
    }


def late_share(outcome) -> float:
    """Late answers over all answers (good + late) among these outcomes; NaN without an answer."""
    outcome = np.asarray(outcome, dtype=object)
    good, late = int((outcome == "good").sum()), int((outcome == "late").sum())
    return late / (good + late) if good + late else math.nan


def cell_summary(
    frame: pd.DataFrame, engines: int = 1, change_s: float | None = None
) -> dict[str, float]:
    """One cell's estimation columns; all shares are of every request (row) unless named otherwise.

    refused_would_fit: refused (deadline_unreachable at arrival, or expired) yet it would have fit.
    admitted_missed: admitted but not answered in time (late, expired, cancelled).
    share_late: late over all. est_rel_error_median: median |est - true| / true over the answered.
    late_share_of_completed: late / (good + late); late_share_before_change / _after_change: the
    same over the requests that arrived before / from ``change_s`` (the speed schedule's first step;
    NaN without). engine_s_total, engine_s_cancelled, engine_s_saved: :func:`engine_seconds`.
    """
    n = len(frame)
    outcome = frame["outcome"].to_numpy(dtype=object)
    answered = (outcome == "good") | (outcome == "late")
    est = frame["est_service_s"].to_numpy(dtype=float)[answered]
    true = frame["true_service_s"].to_numpy(dtype=float)[answered]
    missed = (outcome == "late") | (outcome == "expired") | (outcome == "cancelled")
    arrival = frame["arrival_s"].to_numpy(dtype=float)
    row = {
        "refused_would_fit": float(refused_would_fit(frame, engines).sum() / n) if n else math.nan,
        "admitted_missed": float(missed.sum() / n) if n else math.nan,
        "share_late": float((outcome == "late").sum() / n) if n else math.nan,
        "est_rel_error_median": float(np.median(np.abs(est - true) / true))
        if len(true)
        else math.nan,
        "late_share_of_completed": late_share(outcome),
        "late_share_before_change": math.nan
        if change_s is None
        else late_share(outcome[arrival < change_s]),
        "late_share_after_change": math.nan
        if change_s is None
        else late_share(outcome[arrival >= change_s]),
    }
    row.update(engine_seconds(frame))
    return row


# ------------------------------------------------------------------ the report's tables


def _by(
    summary: pd.DataFrame,
    keys: list[str],
    optional=(
        "policy",
        "speed",
        "engines",
        "used",
        "speed_schedule",
        "fixed_estimate",
        "estimator",
        "cancel_at_deadline",
        "load",
    ),
) -> list[str]:
    """``keys`` (those the summary has), and any other axis that varies in it: a row never mixes
    two cells."""
    present = [k for k in keys if k in summary]
    extra = [
        k
        for k in optional
        if k in summary
        and k not in present
        and summary[k].astype(object).fillna("none").nunique() > 1
    ]
    return extra + present


def _table(summary: pd.DataFrame, keys: list[str], columns: list[str]) -> pd.DataFrame:
    by = _by(summary, keys)
    wanted = [c for c in columns if c in summary]
    return aggregate(
        summary.assign(**{k: summary[k].astype(object).fillna("none") for k in by}), by, wanted
    )


def estimation_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Per load and estimator: goodput_rps, share_good, share_refused, share_late,
    refused_would_fit, admitted_missed and est_rel_error_median, each with its 95 % CI over
    seeds."""
    return _table(
        summary,
        ["load", "estimator"],
        [
            "goodput_rps",
            "share_good",
            "share_refused",
            "share_late",
            "refused_would_fit",
            "admitted_missed",
            "est_rel_error_median",
        ],
    )


def stale_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Per policy and fixed_estimate: the late share of the completed (all, before the speed change,
    from it) and goodput_rps, with CIs."""
    return _table(
        summary,
        ["policy", "fixed_estimate"],
        [
            "late_share_of_completed",
            "late_share_before_change",
            "late_share_after_change",
            "goodput_rps",
            "share_good",
        ],
    )


def cancellation_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Per policy, load and cancel_at_deadline: goodput_rps, engine_s_saved, engine_s_total and
    engine_s_cancelled with CIs; on the rows that cut, goodput_gained_rps (and its CI): the mean
    over seeds of goodput cutting minus goodput not cutting, paired by seed (the same arrivals:
    common random numbers), NaN on the rows that do not cut."""
    table = _table(
        summary,
        ["policy", "load", "cancel_at_deadline"],
        ["goodput_rps", "share_good", "engine_s_saved", "engine_s_total", "engine_s_cancelled"],
    )
    group = [k for k in _by(summary, ["policy", "load"]) if k != "cancel_at_deadline"]
    gained = {}
    filled = summary.assign(**{k: summary[k].astype(object).fillna("none") for k in group})
    for key, part in filled.groupby(group, sort=True):
        wide = part.pivot_table(index="seed", columns="cancel_at_deadline", values="goodput_rps")
        if True in wide and False in wide:
            gained[key if isinstance(key, tuple) else (key,)] = mean_ci(
                (wide[True] - wide[False]).dropna()
            )
    cols = ("goodput_gained_rps", "goodput_gained_rps_low", "goodput_gained_rps_high")
    none = (math.nan,) * 3
    values = [
        gained.get(tuple(row[k] for k in group), none) if bool(row["cancel_at_deadline"]) else none
        for _, row in table.iterrows()
    ]
    return table.assign(**{c: [v[i] for v in values] for i, c in enumerate(cols)})
