"""Engines one at a time on SimPy's clock: the engine part of :class:`qsim.driver.Simulation`.

Each engine runs what the queue core (:class:`qsim.queue.AdmissionQueue`, or a
:class:`qsim.fleet.Fleet` of them) starts: a timeout of the request's true service time (times
the machine's speed at its start, the busy engines' slowdown, its replica's speed; cut at its
deadline where the policy cuts), and hands it back. A run that fails ends as an error and
teaches the speed tracker nothing; the tracker learns what the engine reports; a run past its
engine's stall threshold ends as an error there, and while every engine is stalled a watchdog
ends waiting requests past their deadline every ``watch_interval_s``, as the gate's does.
"""

from __future__ import annotations

import math

import numpy as np
from simpy.events import Timeout

from . import records
from .config import ServerConfig
from .driver import FAILED_REASON, answered
from .fleet import Fleet, FleetSpec, offset
from .outcomes import CANCELLED, ERROR
from .queue import CUT_REASON, STALL_REASON, AdmissionQueue

_NAN = math.nan


class OneAtATimeRun:
    """K engines (N x K across a fleet), each running one request at a time."""

    #: No timers of its own to arm after arrivals and cancellations.
    arms = False

    def __init__(
        self,
        run,
        config: ServerConfig,
        fleet: FleetSpec | None,
        *,
        held: bool = False,
        step_times=None,
    ) -> None:
        self.run = run
        self.env = run.env
        self.spec = fleet
        if fleet is None:
            self.queue = AdmissionQueue(config, start=self._start, drop=run._drop)
        else:
            per = config.engines
            self.queue = Fleet(
                config,
                fleet,
                routed=run._routed,
                line=lambda r, cfg: AdmissionQueue(
                    cfg, start=offset(self._start_in_fleet, r * per), drop=run._drop
                ),
            )
        # The driver's hand-off to each engine (what the gate's engine threads get in their inbox).
        self.job = [-1] * (config.engines if fleet is None else self.queue.engines)
        self.finishing = -1  # the engine whose finish is being handled
        self.downed: set[int] = set()  # rows a replica's going down ended while they ran
        self.watch_interval_s = config.watch_interval_s
        self.watching = False
        # Engines that slow each other (OneAtATime.concurrency): a run takes its time x the core's
        # slowdown. A live run's replay (held) gives each run the time it held its engine, the
        # slowdown already in it.
        self.shared = config.engine.concurrency > 0 and not held
        # A fleet's replica speeds: each run's time goes through _run_time, its replica's in. A
        # replay's held times are what each engine took, its replica's speed already in them: the
        # speed is applied once, there (as the slowdown is).
        self.slowed = fleet is not None and fleet.speeds is not None and not held
        self.plain = run.schedule is None and not run.cuts and not self.shared and not self.slowed

    def attach(self) -> None:
        """Keep the driver's lists this part reads in the event loop (each is kept in place)."""
        run = self.run
        self.start, self.engine_of = run.start, run.engine_of
        self.true, self.ran = run.true, run.ran
        self.reported, self.speed_at, self.cut = run.reported, run.speed_at, run.cut
        self.failed, self.work, self.objectives = run.failed, run.work, run.objectives
        self._end = run._end

    def per_attempt(self) -> tuple:
        return ()

    def rows(self) -> dict:
        return {}

    def after_down(self, r: int, ran: list) -> None:
        """A run there holds its engine to its own end, and teaches the tracker nothing then: it
        ended as an engine's error (the gate's runs on a replica down hand back so, live.drive_one,
        and a replay cannot know their times)."""
        self.downed.update(ran)

    # -- the core's hooks --------------------------------------------------------

    def _start_in_fleet(self, k: int, i: int, now: float, est: float) -> None:
        self.run.replica_of[i] = self.queue.replica_of_engine(k)  # a central queue binds here
        self._start(k, i, now, est)

    def _start(self, k: int, i: int, now: float, est: float) -> None:
        self.start[i] = now
        self.engine_of[i] = k
        self.job[k] = i
        run = self.true[i] if self.plain else self._run_time(k, i, now)
        self.ran[i] = run
        stall_after_s = self.queue.stall_after_s[k]
        if run > stall_after_s:  # it will run past its threshold: the watchdog sees it then
            Timeout(self.env, stall_after_s).callbacks.append(lambda _, k=k, i=i: self._stall(k, i))
        if self.finishing == k:  # the engine goes straight on to its next request
            Timeout(self.env, run, k).callbacks.append(self._finished)
        else:  # an idle engine wakes first: a same-time arrival is looked at before its run is
            Timeout(self.env, 0, k).callbacks.append(self._run)

    def _run_time(self, k: int, i: int, now: float) -> float:
        """How long request i holds engine k from ``now``: its true time at its replica's speed and
        the machine's then (and slowed by the engines busy beside it), up to its deadline where
        the core cuts it there."""
        if self.slowed:  # its replica's speed, as a speed schedule's
            self.speed_at[i] = 1.0 / self.spec.speed(self.queue.replica_of_engine(k))
        run = self.true[i]
        schedule = self.run.schedule
        if schedule is not None:
            self.speed_at[i] *= schedule.at(now) / schedule.base
        if self.shared:  # the busy engines' slowdown at its start, which the core set then
            self.speed_at[i] *= self.queue.slow[k]
        run *= self.speed_at[i]
        if self.run.cuts:
            cut = self.queue.cut_after(k, now, run)
            if cut is not None:
                self.cut[i] = True
                return cut
        return run

    def _run(self, event) -> None:
        k = event._value
        Timeout(self.env, self.ran[self.job[k]], k).callbacks.append(self._finished)

    def _finished(self, event) -> None:
        k = event._value
        now = self.env.now
        i = self.job[k]
        # ended by its replica's going down: teaches nothing (its row, a stream's slot, is free
        # for another after this hand-back)
        downed = i in self.downed
        self.downed.discard(i)
        if self.cut[i]:  # its deadline passed in service: stopped there, its engine free at once
            if self.queue.cut(k, now) is not None:
                self._end(i, now, CANCELLED, CUT_REASON)
            ok, tokens = False, None
        else:
            ok = (self.failed is None or not self.failed[i]) and not downed
            tokens = None if self.work is None else self.work[i].generated
        first = self._first_token_at(i) if self.objectives else _NAN
        self.finishing = k
        # It may start k's next.
        outcome = self.queue.finished(
            k, now, self.reported[i] * self.speed_at[i], ok, tokens, first
        )
        self.finishing = -1
        if outcome is not None:
            self._end(i, now, outcome, None if ok else FAILED_REASON)

    def _first_token_at(self, i: int) -> float:
        """When run i's first token came: its start plus the calibrated line's share of the first
        token (fixed and prompt terms and one token) of the time it ran (what the records write as
        ttft_s, by the same operations)."""
        model = self.queue.config.model
        run = self.run
        first = run.first_of[i] if run.first_of is not None else i
        prompt, tokens = int(run.prompt_tokens[first]), int(run.generated[first])
        return self.start[i] + self.ran[i] * (
            float(model.estimate(1, prompt)) / float(model.estimate(tokens, prompt))
        )

    def _stall(self, k: int, i: int) -> None:
        now = self.env.now
        if self.queue.stall(k, now) == i:
            self._end(i, now, ERROR, STALL_REASON)
        if self.queue.all_stalled and not self.watching:
            self.watching = True
            self.env.process(self._watchdog())

    def _watchdog(self):
        """While every engine is stalled, end the hopeless waiting, as the gate's watchdog does."""
        while self.queue.all_stalled:
            yield self.env.timeout(self.watch_interval_s)
            self.queue.give_up(self.env.now)
        self.watching = False

    # -- the records ------------------------------------------------------------------

    def columns(self, trace, first: np.ndarray, columns: dict) -> None:
        """ttft_s, tpot_s, output_tokens and preemptions of answered runs (from the record's other
        ``columns``, arrays): the first token comes after the calibrated line's share of the
        first token of the time the run took."""
        model = self.queue.config.model
        prompt, tokens = trace.prompt_tokens[first], trace.tokens_generated[first]
        arrival, finish = columns["arrival_s"], columns["finish_s"]
        done = answered(columns["outcome"])
        share = np.asarray(model.estimate(np.ones_like(tokens), prompt), dtype=float) / np.asarray(
            model.estimate(tokens, prompt), dtype=float
        )
        first_token = columns["start_s"] + records.column(self.run.ran, float) * share
        many = done & (tokens > 1)
        columns.update(
            {
                "ttft_s": np.where(done, first_token - arrival, np.nan),
                "tpot_s": np.where(
                    many, (finish - first_token) / np.maximum(tokens - 1, 1), np.nan
                ),
                "output_tokens": np.where(done, tokens, -1),
                "preemptions": np.where(done, 0, -1),
            }
        )
