"""What a live run does not say, as its replay (:mod:`analysis.replay`) settles it: the gate arrival
of an attempt no answer gave one and when the gate heard of a client's hang-up (:class:`Unsaid`),
moved where the queues the gate reported say they were (:func:`_misplaced`); how long a run whose
client hung up held its engine and what it taught (:func:`_cancelled_runs`), read where it can be
from the tracker's factor around its end (:class:`_TrackerEvidence`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from qsim.config import ServerConfig
from qsim.engines import OneAtATime
from qsim.service import SpeedTracker

from .replay_inputs import KEYS, TOLERANCE_S, gate_knew, trip_s


@dataclass
class Unsaid:
    """What the run does not say, as the replay takes it: each row's gate arrival (estimated where
    no answer gave it), and how long after a client hung up the gate let its request go
    (``notice_s``; per request where the queue others saw says otherwise, in ``late``). ``settled``:
    the engine times the last replay settled on for the runs whose clients hung up (request_id ->
    hold, reported, failed, rule), and ``usual`` its delay from a hang-up to the next start, where
    the next replay starts from (it differs by one arrival or hang-up moved, so it settles in a few
    passes, not one per such run again)."""

    arrival: np.ndarray
    notice_s: float
    late: dict
    settled: dict = dataclasses.field(default_factory=dict)
    usual: list = dataclasses.field(default_factory=list)

    def notice(self, firsts) -> np.ndarray:
        return np.array([self.late.get(int(f), self.notice_s) for f in firsts], dtype=float)


def _guessed(run: pd.DataFrame, origin: str) -> np.ndarray:
    """Rows whose gate arrival :func:`arrival_times` estimated (no answer said when the gate took
    them)."""
    if origin != "server" or "server_arrival_s" not in run.columns:
        return np.zeros(len(run), dtype=bool)
    known = np.isfinite(run["server_arrival_s"].to_numpy(float))
    return ~known if known.any() else np.zeros(len(run), dtype=bool)


def _misplaced(
    run: pd.DataFrame, sim: pd.DataFrame, unsaid: Unsaid, guessed: np.ndarray, moved: set
) -> bool:
    """Move one thing the run does not say to where the run says it was, and say so (True); each
    once.

    An attempt whose client hung up that the replay refused at its guessed arrival came later (it
    had been admitted): just after the replay next made room (a waiting attempt left, an engine took
    the next), one such at a time, else just before the next known arrival, within the run's spread
    of trips. Else, at the first request (in gate order) whose queue at arrival differs between the
    gate and the replay, look within that spread for what explains it: the replay saw more waiting
    work, so an arrival of guessed time just before it came after it, or a hang-up just after it
    reached the gate before it; less, the other way round. Move the nearest such just across."""
    arrival = unsaid.arrival
    keys = pd.MultiIndex.from_arrays([run["first_request_id"], run["attempt"]])
    simmed = sim.set_index(KEYS).reindex(keys)
    sent = run["arrival_s"].to_numpy(float)
    spread = (
        float(np.nanmax(np.abs(arrival - sent)[~guessed], initial=0.0)) if (~guessed).any() else 0.0
    )
    # A client that hung up had been admitted (a refusal is answered at once): where the replay
    # refuses it at its guessed arrival, it came later, before the next arrival the run knows.
    refused = (
        guessed
        & run["outcome"].eq("abandoned").to_numpy()
        & simmed["outcome"].eq("rejected").to_numpy()
    )
    # Where room opened in the replay (a waiting attempt left, an engine took the next) it may have
    # come just after.
    waited_out = sim["outcome"].eq("abandoned").to_numpy() & np.isnan(
        sim["start_s"].to_numpy(float)
    )
    freed = np.sort(
        np.concatenate([sim.loc[waited_out, "finish_s"].to_numpy(float), sim["start_s"].dropna()])
    )
    for k in np.flatnonzero(refused)[np.argsort(arrival[refused])]:
        later = ~guessed & (arrival > arrival[k])
        nxt = arrival[later].min() if later.any() else math.inf
        for when in freed[(freed > arrival[k]) & (freed < nxt) & (freed - arrival[k] <= spread)]:
            if ("admitted", int(k), float(when)) not in moved:
                moved.add(("admitted", int(k), float(when)))
                arrival[k] = when + TOLERANCE_S
                return True
        if ("admitted", int(k)) in moved or not later.any():
            continue
        if nxt - arrival[k] <= spread:
            moved.add(("admitted", int(k)))
            arrival[k] = nxt - TOLERANCE_S
            return True
    # Who waited, not their work: an arrival or a departure on the wrong side changes the count,
    # while the work also moves with the speed factor, which a run answered or stopped around its
    # client's hang-up (the run cannot say which) may have left a little apart for the rest of the
    # run.
    count = simmed["queued_at_arrival"].astype("Float64").to_numpy(dtype=float, na_value=np.nan)
    mine = run["queued_at_arrival"].astype("Float64").to_numpy(dtype=float, na_value=np.nan)
    differ = np.isfinite(mine) & np.isfinite(count) & (mine != count)
    if not differ.any():
        return False
    at = np.flatnonzero(differ)[np.argmin(arrival[differ])]
    when, more = arrival[at], count[at] > mine[at]
    options = []  # (distance, kind, key)
    for k in np.flatnonzero(guessed):
        gap = arrival[k] - when
        if ("arrival", int(k)) not in moved and 0 < abs(gap) <= spread and (gap < 0) == more:
            options.append((abs(gap), "arrival", int(k)))
    waited_out = sim["outcome"].eq("abandoned").to_numpy() & np.isnan(
        sim["start_s"].to_numpy(float)
    )
    for first, end in zip(sim.loc[waited_out, "first_request_id"], sim.loc[waited_out, "finish_s"]):
        gap = end - when
        if ("left", int(first)) not in moved and 0 < abs(gap) <= spread and (gap > 0) == more:
            options.append((abs(gap), "left", int(first)))
    if not options:
        return False
    _, kind, key = min(options)
    moved.add((kind, key))
    if kind == "arrival":
        arrival[key] = when + (TOLERANCE_S if more else -TOLERANCE_S)
    else:  # that request's hang-up reached the gate just before (or after) this arrival
        notice = unsaid.late.get(key, unsaid.notice_s)
        unsaid.late[key] = (
            notice
            + (when - TOLERANCE_S if more else when + TOLERANCE_S)
            - float(
                sim.loc[waited_out & sim["first_request_id"].eq(key).to_numpy(), "finish_s"].iloc[0]
            )
        )
    return True


def _cancelled_runs(
    run: pd.DataFrame,
    setup: ServerConfig,
    unsaid: Unsaid,
    ordered: pd.DataFrame,
    sim: pd.DataFrame,
    hold: np.ndarray,
    reported: np.ndarray,
    failed: np.ndarray,
    rule: np.ndarray,
    usual: list,
) -> bool:
    """Where the simulator ran an attempt the live client hung up on, and that request ran nowhere
    else live: hold its engine until the live engine was free again, teaching nothing (the gate
    stops such a run). Updates the arrays in place; True when something changed.

    When the live engine was free again: where the request the replay starts next on that engine had
    waited for it and the run knows its start, at that start (as for a stalled run), unless an
    attempt whose client hung up later was waiting then (the engine may have run it in between,
    unseen); else (the next is another attempt whose client hung up, or nobody was waiting) at the
    hang-up plus the run's usual delay from a hang-up to the engine's next start (its median where
    the first pass that knows any saw them, kept in ``usual`` so that the passes settle; else the
    trip to the gate). An engine free before the hang-up ran the request to its end: the gate
    answered it, the client had left. A run stopped by its client's hang-up had been let go by then:
    where the replay hears of that hang-up later (``unsaid``), it hears of it just before.
    """
    arrival = unsaid.arrival
    ran = np.isfinite(sim["start_s"].to_numpy(float))
    if not ran.any() or not run["outcome"].eq("abandoned").any():
        return False
    firsts = ordered["request_id"].to_numpy()
    position = pd.Series(
        np.arange(len(run)),
        index=pd.MultiIndex.from_arrays([run["first_request_id"], run["attempt"]]),
    )
    started = gate_knew(run)["engine_started_s"].to_numpy(float)
    # its engine was busy (or others ahead of it) when it came
    waited = started > arrival + TOLERANCE_S
    abandoned = run["outcome"].eq("abandoned").to_numpy()
    hangup = run["finish_s"].to_numpy(float)  # when the client hung up
    # when it meant to
    intended = run["hangup_s"].to_numpy(float) if "hangup_s" in run.columns else hangup
    on = sim[ran].sort_values("start_s", kind="stable")
    found = []  # (j, row position in the run, sim start, the next start if known)
    for engine, runs in on.groupby("engine", sort=False):
        rows = runs[["first_request_id", "attempt", "start_s"]].to_numpy()
        for n, (j, attempt, start) in enumerate(rows):
            j = int(j)
            k = position.get((firsts[j], int(attempt)))
            if k is None or not abandoned[k] or rule[j] not in ("estimate", "cancelled"):
                continue
            after = (
                position.get((firsts[int(rows[n + 1][0])], int(rows[n + 1][1])))
                if n + 1 < len(rows)
                else None
            )
            known = after is not None and np.isfinite(started[after]) and started[after] > start
            found.append(
                (j, k, start, started[after] if known else np.nan, known and waited[after])
            )
    if not found:
        return False
    # Attempts the replay had leave while waiting (their clients hung up): if one was waiting when
    # the engine was free, the live engine may have taken it first, and its start is unknown.
    left = sim["outcome"].eq("abandoned").to_numpy() & ~ran
    came = sim["arrival_s"].to_numpy(float)[left]
    mine = [
        position.get((firsts[int(f)], int(a)))
        for f, a in zip(sim.loc[left, "first_request_id"], sim.loc[left, "attempt"])
    ]
    # when its client hung up
    went = np.where(
        [m is None for m in mine],
        sim.loc[left, "finish_s"].to_numpy(float),
        [hangup[m] if m is not None else np.nan for m in mine],
    )

    def unseen(free: float, nxt: float) -> bool:
        return bool(((came < free) & (went > free) & (went < nxt)).any())

    # The usual delay: measured where nothing else can have run in between, and no longer than a
    # trip can take (a first pass, before the others settle, pairs runs that were not one after the
    # other).
    spread = float(np.nanmax(np.abs(arrival - run["arrival_s"].to_numpy(float)), initial=0.0))
    delays = [
        d
        for _, k, _, nxt, exact in found
        if exact and not unseen(hangup[k], nxt)
        for d in [nxt - hangup[k]]
        if 0 <= d <= spread
    ]
    if not usual and delays:
        usual.append(float(np.median(delays)))
    delay = usual[0] if usual else trip_s(run)
    changed = False
    tracker = _TrackerEvidence(run, setup, unsaid, ordered, sim, position, reported, failed)
    for j, k, start, nxt, exact in found:
        free = hangup[k] + delay
        exact = exact and not unseen(free, nxt)
        end = nxt if exact else min(free, nxt) if np.isfinite(nxt) else free
        target = max(0.0, end - start)
        # Ended before the hang-up: the gate answered (and its tracker learned) an answer the client
        # did not wait for, still on its way back; otherwise the stopped run teaches nothing. Where
        # the live speed factor around its end says which (and what it learned), that.
        stopped, taught = bool(end >= hangup[k]), target
        said = tracker.learned(j, end)
        if said is not None:
            stopped, taught = said is False, target if said is False else said
        if (
            rule[j] != "cancelled"
            or abs(hold[j] - target) > 1e-9
            or failed[j] != stopped
            or abs(reported[j] - taught) > 1e-12
        ):
            hold[j], reported[j], failed[j], rule[j] = target, taught, stopped, "cancelled"
            changed = True
        first, heard = int(firsts[j]), intended[k] + unsaid.notice([firsts[j]])[0]
        if stopped and heard > end - TOLERANCE_S:
            unsaid.late[first] = max(0.0, end - TOLERANCE_S - intended[k])
            changed = True
        # the gate heard of the hang-up after the run had ended: just after
        elif not stopped and heard <= end:
            # (within the tolerance: the same end)
            unsaid.late[first] = end + TOLERANCE_S / 2 - intended[k]
            changed = True
    return changed


class _TrackerEvidence:
    """What the gate's speed tracker says of a run whose client hung up around its end: the
    tracker's factor at the live arrivals just before and after the run's end (the run records it
    per answered request). Where the replay's factor agrees at the first, the replay's other runs
    that taught the tracker between the two are folded in as the replay has them, and this one's
    teaching is what makes the second agree: none (the factor as without it: the run was stopped),
    or the engine time the tracker's step solves for (it ran to its end, and the gate answered
    it)."""

    def __init__(
        self,
        run: pd.DataFrame,
        setup: ServerConfig,
        unsaid: Unsaid,
        ordered: pd.DataFrame,
        sim: pd.DataFrame,
        position: pd.Series,
        reported: np.ndarray,
        failed: np.ndarray,
    ) -> None:
        live = (
            run["arrival_speed_factor"]
            if "arrival_speed_factor" in run.columns
            else pd.Series(np.nan, index=run.index)
        ).to_numpy(float)
        # A learning estimator, engines that share, or a fixed estimate: the factor's steps are not
        # the plain EWMA's.
        self.usable = (
            not setup.fixed_estimate
            and setup.policy.estimator == "limit"
            and isinstance(setup.engine, OneAtATime)
            and not setup.engine.concurrency
            and np.isfinite(live).any()
        )
        if not self.usable:
            return
        known = np.flatnonzero(np.isfinite(live))
        order = np.argsort(unsaid.arrival[known], kind="stable")
        self.rows, self.at = known[order], unsaid.arrival[known][order]
        self.live, self.weight = live, setup.tracker_weight
        self.base, self.reported, self.failed = (
            ordered["calibrated_est_s"].to_numpy(float),
            reported,
            failed,
        )
        ran = sim[np.isfinite(sim["start_s"].to_numpy(float))].sort_values(
            "finish_s", kind="stable"
        )
        self.finished = ran[["first_request_id", "finish_s"]].to_numpy()
        keys = pd.MultiIndex.from_arrays(
            [
                ordered["request_id"].to_numpy()[sim["first_request_id"].to_numpy()],
                sim["attempt"].to_numpy(),
            ]
        )
        mine = position.reindex(keys).to_numpy(dtype=float, na_value=np.nan)
        factor = (
            sim["est_service_s"].to_numpy(float) / self.base[sim["first_request_id"].to_numpy()]
        )
        self.sim = np.full(len(run), np.nan)
        self.sim[mine[np.isfinite(mine)].astype(int)] = factor[np.isfinite(mine)]

    def learned(self, j: int, end: float) -> float | bool | None:
        """False: the run taught nothing; a number: the engine time it taught; None: the run
        cannot tell."""
        if not self.usable:
            return None
        n = int(np.searchsorted(self.at, end))
        if n == 0 or n == len(self.at):
            return None
        before, after = self.rows[n - 1], self.rows[n]
        lo, hi = self.at[n - 1], self.at[n]
        if not abs(self.sim[before] - self.live[before]) <= 1e-9:
            return None  # apart already: an earlier difference, not this run's
        # The others that taught in between, in the order they finished, around this one's end.
        taught = [
            (f, int(other))
            for other, f in self.finished
            if lo < f < hi and int(other) != j and not self.failed[int(other)]
        ]
        first = [(self.base[o], self.reported[o]) for f, o in taught if f <= end]
        then = [(self.base[o], self.reported[o]) for f, o in taught if f > end]
        without = self._fold(self.live[before], first + then)
        if abs(without - self.live[after]) <= 1e-12:
            return False
        # The tracker's steps are affine below its bound: solve for the ratio that lands on the live
        # factor.
        at = self._fold(self.live[before], first)
        slope = (1 - self.weight) ** len(then)
        offset = self._fold(0.0, then, bounded=False)
        ratio = ((self.live[after] - offset) / slope - (1 - self.weight) * at) / self.weight
        engine_s = ratio * self.base[j]
        if (
            not engine_s > 0
            or abs(
                self._fold(self.live[before], first + [(self.base[j], engine_s)] + then)
                - self.live[after]
            )
            > 1e-9
        ):
            # a step met the tracker's bound, or the window holds what the replay does not
            return None
        return float(engine_s)

    def _fold(self, factor: float, steps: list, bounded: bool = True) -> float:
        """The tracker's factor from ``factor`` after these (predicted, engine time)
        observations."""
        if not bounded:  # the affine part alone (an offset, from 0)
            for predicted, engine_s in steps:
                factor += self.weight * (engine_s / predicted - factor)
            return factor
        tracker = SpeedTracker(self.weight, factor)
        for predicted, engine_s in steps:
            tracker.observe(predicted, engine_s)
        return tracker.factor
