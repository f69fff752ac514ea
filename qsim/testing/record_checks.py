"""Checkers on the simulator's records, and :class:`InvariantBroken`, what every checker of the kit
(:mod:`qsim.testing`) raises: its message names the invariant and the request that breaks it.

:func:`check_one_outcome_each`, :func:`check_conservation`, :func:`check_at_most_k_in_service`
(a batching engine: :func:`check_at_most_seats_in_batch`, :func:`check_kv_blocks`),
:func:`check_work_conserving`, :func:`check_queue_bound`, :func:`check_order` (the order of
service where the records can say it, :func:`records_order`); a batching engine's books are
audited at every step while it runs (:func:`audited_batches`).
:func:`qsim.testing.simulations.check_records` runs them all for one simulation.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import numpy as np
import pandas as pd

from ..batch import BatchQueue
from ..disciplines import CoDel, Edf, Fifo, Lifo, Priority, ShortestFirst
from ..outcomes import Outcome, Reason
from ..records import OUTCOMES


class InvariantBroken(AssertionError):
    """An invariant does not hold: the message names it and the request (or engine) that breaks
    it."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant


#: Times that differ by less than this are the same instant (float sums of service times).
TIME_TOL = 1e-9


@contextlib.contextmanager
def audited_batches() -> Iterator[None]:
    """While in this block, every step a batching engine's core (:class:`qsim.batch.BatchQueue`)
    plans is audited before and after (:meth:`~qsim.batch.BatchQueue.audit`: the KV blocks held add
    up and never exceed the cache, at most ``max_num_seqs`` run, the aggregates match the batch, a
    step keeps to the token budget); a slip is an
    :class:`InvariantBroken` naming what is off. Patches the class: not for threads running other
    batches."""
    plan = BatchQueue._next_step

    def checked(self, now):
        _audit(self, now)
        plan(self, now)
        _audit(self, now)

    BatchQueue._next_step = checked
    try:
        yield
    finally:
        BatchQueue._next_step = plan


def _audit(queue: BatchQueue, now: float) -> None:
    try:
        queue.audit()
    except AssertionError as exc:
        raise InvariantBroken("the batch's books", f"at t={now}: {exc}") from None


# ---------------------------------------------------------------- checkers on the simulator's
# records


def check_one_outcome_each(frame: pd.DataFrame, requests: int) -> None:
    """Every request of a trace of ``requests`` has exactly one first attempt, each row (attempt)
    exactly one outcome of :data:`qsim.records.OUTCOMES`, and request_ids are unique."""
    invariant = "one outcome per request"
    ids = frame["request_id"]
    twice = ids[ids.duplicated()]
    if len(twice):
        raise InvariantBroken(
            invariant, f"request_id {twice.iloc[0]} has {int((ids == twice.iloc[0]).sum())} rows"
        )
    first = frame.loc[frame["attempt"] == 1, "first_request_id"] if "attempt" in frame else ids
    missing = sorted(set(range(requests)) - set(first.tolist()))
    if missing:
        raise InvariantBroken(
            invariant,
            f"request_id {missing[0]} has no row: lost "
            f"({len(missing)} of the "
            f"trace's {requests} requests have none)",
        )
    extra = sorted(set(first.tolist()) - set(range(requests)))
    if extra:
        raise InvariantBroken(
            invariant, f"request_id {extra[0]} is not in the trace of {requests} requests"
        )
    outcome = frame["outcome"]
    none = outcome.isna()
    if none.any():
        raise InvariantBroken(
            invariant,
            f"request_id {ids[none].iloc[0]} has no outcome ({int(none.sum())} rows have none)",
        )
    unknown = ~outcome.isin(OUTCOMES)
    if unknown.any():
        raise InvariantBroken(
            invariant,
            f"request_id {ids[unknown].iloc[0]} has outcome "
            f"{outcome[unknown].iloc[0]!r}, not one of {OUTCOMES}",
        )


def _name(frame: pd.DataFrame, mask) -> str:
    return f"request_id {frame.loc[mask, 'request_id'].iloc[0]}"


def check_conservation(frame: pd.DataFrame, engines: int) -> None:
    """Each request goes arrival -> (queue) -> (engine) -> end, in that order and nowhere else:
    start and finish never before arrival, finish never before start, a refusal ends at its arrival,
    a request that ran has an engine of 0..K-1 and one that never ran has none, and latency is
    finish minus arrival."""
    invariant = "conservation"
    arrival, start, finish = frame["arrival_s"], frame["start_s"], frame["finish_s"]
    ran = start.notna()
    engine = frame["engine"]
    rules = [
        (finish.isna(), "has no finish time"),
        (ran & (start < arrival - TIME_TOL), "started before it arrived"),
        (ran & (finish < start - TIME_TOL), "finished before it started"),
        (finish < arrival - TIME_TOL, "ended before it arrived"),
        (
            frame["outcome"].eq(Outcome.REJECTED) & ((finish - arrival).abs() > TIME_TOL),
            "was refused after its arrival",
        ),
        (
            ran & (engine.isna() | (engine < 0) | (engine >= engines)).fillna(True),
            f"ran on no engine of 0..{engines - 1}",
        ),
        (~ran & engine.notna(), "never ran but names an engine"),
        (
            (frame["latency_s"] - (finish - arrival)).abs() > TIME_TOL,
            "has latency_s other than finish - arrival",
        ),
    ]
    for bad, what in rules:
        bad = bad.fillna(False).to_numpy(dtype=bool)
        if bad.any():
            raise InvariantBroken(invariant, f"{_name(frame, bad)} {what}")


def _occupancy(
    frame: pd.DataFrame, batching: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row positions, start, end) of each request's spell in service: from start to finish, or, on
    an engine run one at a time, where the request ended while its run went on (its client left, or
    its engine stalled), to start + its true service time. In a batch (``batching``) a request
    leaves the batch when it ends."""
    ran = frame["start_s"].notna().to_numpy()
    start = frame["start_s"].to_numpy(dtype=float)
    end = frame["finish_s"].to_numpy(dtype=float)
    if not batching:
        runs_on = (
            frame["outcome"].eq(Outcome.ABANDONED) | frame["reason"].eq(Reason.ENGINE_STALLED)
        ).fillna(False)
        runs_on = runs_on.to_numpy(bool)
        end = np.where(
            runs_on, np.maximum(end, start + frame["true_service_s"].to_numpy(dtype=float)), end
        )
    rows = np.flatnonzero(ran)
    return rows, start[rows], end[rows]


def check_at_most_k_in_service(frame: pd.DataFrame, engines: int) -> None:
    """No engine runs two requests at once, so never more than K are in service."""
    rows, start, end = _occupancy(frame)
    engine = frame["engine"].to_numpy(dtype=float, na_value=np.nan)[rows]
    order = np.lexsort((start, engine))
    for a, b in zip(order[:-1], order[1:]):
        if engine[a] == engine[b] and start[b] < end[a] - TIME_TOL:
            raise InvariantBroken(
                "at most K in service",
                f"request_id {frame['request_id'].iloc[rows[b]]} started on "
                f"engine {int(engine[b])} "
                f"at t={start[b]} while request_id "
                f"{frame['request_id'].iloc[rows[a]]} ran there "
                f"until t={end[a]}",
            )


def check_at_most_seats_in_batch(frame: pd.DataFrame, max_num_seqs: int) -> None:
    """A batching engine never holds more than ``max_num_seqs`` requests at once. Records give each
    request one spell, from its first joining the batch to its end; a request preempted meanwhile
    was out of the batch for part of it, so only the spells of requests never preempted are counted
    (a necessary condition; the
    :func:`audited_batches` audit counts seats exactly at every step)."""
    rows, start, end = _occupancy(frame, batching=True)
    kept = frame["preemptions"].to_numpy(dtype=float, na_value=np.nan)[rows] == 0
    rows, start, end = rows[kept], start[kept], end[kept]
    held = _busy_at(start, start, end)
    over = np.flatnonzero(held > max_num_seqs)
    if len(over):
        i = over[0]
        raise InvariantBroken(
            "at most K in service",
            f"request_id {frame['request_id'].iloc[rows[i]]} joined the batch at "
            f"t={start[i]} with "
            f"{held[i] - 1} others in it, over max_num_seqs {max_num_seqs}",
        )


def check_kv_blocks(frame: pd.DataFrame, kv_blocks: int | None) -> None:
    """No request of a batching engine held more KV blocks than the cache has."""
    if kv_blocks is None:
        return
    peak = frame["kv_blocks_peak"].to_numpy(dtype=float, na_value=np.nan)
    over = peak > kv_blocks
    if over.any():
        raise InvariantBroken(
            "KV blocks",
            f"{_name(frame, over)} held {int(peak[over][0])} blocks of a cache of {kv_blocks}",
        )


def _busy_at(t: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """How many engines are busy at each time in ``t`` (a spell covers [start, end))."""
    return ((start[None, :] <= t[:, None] + TIME_TOL) & (t[:, None] < end[None, :] - TIME_TOL)).sum(
        axis=1
    )


def _waited(frame: pd.DataFrame) -> np.ndarray:
    """When each admitted request left the queue: its start, or its end if it never started."""
    return frame["start_s"].fillna(frame["finish_s"]).to_numpy(dtype=float)


def _steps_in_flight(
    frame: pd.DataFrame, rows: np.ndarray, start: np.ndarray, end: np.ndarray
) -> np.ndarray:
    """Spell ends of a batch, where a request left it mid-step (its client left, or it was cut at
    its deadline) carried on to the next join: the step it was in runs to its end, and records do
    not say when that was."""
    left = frame["outcome"].isin([Outcome.ABANDONED, Outcome.CANCELLED]).to_numpy(bool)[rows]
    joins = np.sort(start)
    after = np.searchsorted(joins, end, side="right")
    nxt = np.where(after < len(joins), joins[np.minimum(after, len(joins) - 1)], end)
    return np.where(left, np.maximum(end, nxt), end)


def check_work_conserving(frame: pd.DataFrame, engines: int, batching: bool = False) -> None:
    """While a request waits, every engine is busy: at each event time between a request's arrival
    and its leaving the queue (its start, or its end unrun), K engines hold a request. A batching
    engine (``batching``, ``engines`` 1) may keep a request waiting beside free seats (the step in
    flight, the token budget, the KV blocks), but never idles while one waits: a request is in the
    batch, or a step is in flight."""
    rows, start, end = _occupancy(frame, batching)
    if batching:
        end = _steps_in_flight(frame, rows, start, end)
    arrival, left = frame["arrival_s"].to_numpy(dtype=float), _waited(frame)
    admitted = frame["outcome"].ne(Outcome.REJECTED).to_numpy(bool)
    events = np.unique(np.concatenate([start, end, arrival]))
    busy = _busy_at(events, start, end)
    for i in np.flatnonzero(admitted & (left > arrival + TIME_TOL)):
        during = (events >= arrival[i] - TIME_TOL) & (events < left[i] - TIME_TOL)
        idle = during & (busy < engines)
        if idle.any():
            t = events[idle][0]
            raise InvariantBroken(
                "no idle engine while work waits",
                f"request_id {frame['request_id'].iloc[i]} waited from "
                f"t={arrival[i]} to "
                f"t={left[i]}, and at t={t} only {busy[idle][0]} of {engines} "
                "engines were busy",
            )


def check_queue_bound(frame: pd.DataFrame, max_queue: int) -> None:
    """Never more than ``max_queue`` wait (not counting those in service): none admitted saw more at
    its arrival, and none made more by joining. (A batching engine puts the requests it preempts
    back in line whatever the bound: one that arrives then may see more, and is refused.)"""
    seen = frame["queued_at_arrival"].astype("Float64")
    admitted = frame["outcome"].ne(Outcome.REJECTED).to_numpy(bool)
    over = (seen > max_queue).fillna(False).to_numpy(bool) & admitted
    if over.any():
        raise InvariantBroken(
            "queue bound",
            f"{_name(frame, over)} arrived with "
            f"{seen[over].iloc[0]} waiting, "
            f"over the bound of {max_queue}",
        )
    admitted = frame["outcome"].ne(Outcome.REJECTED).to_numpy(bool)
    arrival, left = frame["arrival_s"].to_numpy(dtype=float)[admitted], _waited(frame)[admitted]
    times = np.concatenate([arrival, left])
    steps = np.concatenate([np.ones(len(arrival)), -np.ones(len(left))])
    # At equal times, leaving the queue (to an engine) comes before the next arrival joins it.
    order = np.lexsort((steps, times))
    depth = np.cumsum(steps[order])
    if len(depth) and depth.max() > max_queue:
        at = times[order][int(np.argmax(depth))]
        raise InvariantBroken(
            "queue bound", f"{int(depth.max())} waited at t={at}, over the bound of {max_queue}"
        )


def records_order(
    discipline, fixed_estimate: bool = False, batching: bool = False
) -> Callable[[pd.DataFrame], list] | None:
    """What a discipline of qsim's promises about starts, as a key over records' columns (see
    :func:`check_order`); None where records cannot say (adaptive LIFO, fair share, a discipline of
    one's own: :func:`check_queue_core` checks those). SJF only with fixed estimates (records hold
    the estimate times the speed factor of each arrival, which tracking changes). On a batching
    engine (``batching``) FIFO's alone: the head of the line that does not fit the batch yet keeps
    its place there, and a request that arrives meanwhile with a smaller key waits behind it."""
    kind = type(discipline)
    if kind in (Fifo, CoDel):
        return lambda f: list(f["arrival_s"])
    if batching:
        return None
    if kind is Lifo:
        return lambda f: list(-f["arrival_s"])
    if kind is Edf:
        return lambda f: list(f["arrival_s"] + f["deadline_s"])
    if kind is Priority:
        edf = discipline.within == "edf"
        return lambda f: list(
            zip(-f["priority"].astype("int64"), f["arrival_s"] + (f["deadline_s"] if edf else 0.0))
        )
    if kind is ShortestFirst and fixed_estimate:
        return lambda f: list(f["est_service_s"])
    return None


def check_order(
    frame: pd.DataFrame, key: Callable[[pd.DataFrame], list], name: str = "the discipline"
) -> None:
    """At every start, no request then waiting (admitted before it and still queued after it) has a
    smaller ``key(frame)`` (one comparable per row, in row order) than the request started."""
    keys = key(frame)
    ranks = {k: r for r, k in enumerate(sorted(set(keys)))}
    rank = np.asarray([ranks[k] for k in keys])
    admitted = frame["outcome"].ne(Outcome.REJECTED).to_numpy(bool)
    arrival, left = frame["arrival_s"].to_numpy(dtype=float), _waited(frame)
    start = frame["start_s"].to_numpy(dtype=float)
    for i in np.argsort(start, kind="stable"):
        if np.isnan(start[i]):
            break
        # Waiting then: arrived strictly before (a same-instant arrival may come after the start's
        # event) and leaving the queue strictly after (those leaving at the same instant went first,
        # or were dropped).
        waiting = admitted & (arrival < start[i] - TIME_TOL) & (left > start[i] + TIME_TOL)
        ahead = waiting & (rank < rank[i])
        if ahead.any():
            j = np.flatnonzero(ahead)[np.argmin(rank[ahead])]
            raise InvariantBroken(
                f"{name}'s order",
                f"request_id {frame['request_id'].iloc[i]} (key {keys[i]!r}) "
                f"started at t={start[i]} "
                f"while request_id {frame['request_id'].iloc[j]} (key "
                f"{keys[j]!r}) waited",
            )
