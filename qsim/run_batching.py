"""A batching engine on SimPy's clock: the engine part of :class:`qsim.driver.Simulation`.

One event per step of each engine (:class:`qsim.batch.BatchQueue`: its time the step model's,
times a gamma draw of mean 1 and the model's ``cv`` where set, times the machine's speed and its
replica's), and one per deadline the core cuts at. A fleet's replicas (:class:`qsim.fleet.Fleet`
behind a router, or :class:`qsim.batch_fleet.CentralBatch` behind one line) are engines 0..N-1,
each with its line, step noise and timer; their steps' events carry the replica.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from simpy.events import Timeout

from .batch import BatchQueue
from .batch_fleet import CentralBatch
from .config import ServerConfig
from .fleet import Fleet, FleetSpec
from .outcomes import ANSWERED
from .prefix import Tokens

_NAN = math.nan


def step_noise(cv: float, seed: int, replica: int = 0) -> Callable[[], float] | None:
    """Engine ``replica``'s step noise: a draw of a gamma of mean 1 and CV ``cv`` per step (None:
    ``cv`` 0, no noise), from a stream of its own off the server's ``seed``, so that the draws are
    the same under every policy. Replica 0's is the one server's stream: a fleet of one runs as
    the server. A live synthetic batching engine draws from it too (live.batching), so a run on a
    virtual clock is the simulator's step by step."""
    if not cv > 0:
        return None
    key = [seed, 7919] + ([replica] if replica else [])
    rng, shape = np.random.default_rng(key), 1.0 / cv**2
    return lambda: rng.gamma(shape, 1.0 / shape)


class BatchingRun:
    """Batching engines, one step at a time each: a replay of a live run's steps
    (``step_times``), else the step model's."""

    #: Each engine's timer is armed after arrivals and cancellations.
    arms = True

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
        self.fleet = fleet
        self.noise, self.slow = [], []  # each engine's step noise (None: none) and slowness
        self.timer_at = []  # each engine's timer armed (inf: none)
        if fleet is None:
            self.queue = self._line(0, config)
            self.lines = [self.queue]  # the engines, by the index their steps' events carry
        else:
            kind = CentralBatch if fleet.router.shared else Fleet
            self.queue = kind(
                config,
                fleet,
                routed=run._routed,
                line=lambda r, cfg, make=BatchQueue: self._line(r, cfg, 1.0 / fleet.speed(r), make),
            )
            self.lines = self.queue.lines
        # (seconds from the wake, seconds it ran, seconds the tracker learns[, step model]) of
        # each step, in order.
        self.step_times = step_times
        self.steps_run = 0
        # Per engine, of its step in flight (a replay): the seconds its engine reported, and the
        # step model the live gate took after it (a fleet's replicas step at once).
        self.step_reported: dict[int, float] = {}
        self.step_model_after: dict[int, object] = {}
        n = run.n
        self.first_token, self.tokens = [_NAN] * n, [-1] * n
        self.preempted, self.kv_peak, self.cached = [-1] * n, [-1] * n, [-1] * n

    def _line(self, r: int, config: ServerConfig, slow: float = 1.0, make=BatchQueue) -> BatchQueue:
        """Engine r's queue core (``make``'s: a BatchQueue, or a central queue's replica), its
        hooks carrying r; its steps take ``slow`` x the model's."""
        caching = config.engine.prefix_caching
        queue = make(
            config,
            step=lambda plan, now: self._step(plan, now, r),
            end=self._ended,
            drop=self.run._drop,
            joined=lambda i, now: self._joined(i, now, r),
            wake=lambda now: self._wake(now, r),
            tokens=self._tokens if caching else None,
        )
        self.noise.append(step_noise(config.engine.step.cv, config.seed, r))
        self.slow.append(slow)
        self.timer_at.append(math.inf)
        return queue

    def attach(self) -> None:
        """Nothing to keep: a step's event is rare beside a request's."""

    def per_attempt(self) -> tuple:
        return (
            (self.first_token, _NAN),
            (self.tokens, -1),
            (self.preempted, -1),
            (self.kv_peak, -1),
            (self.cached, -1),
        )

    def rows(self) -> dict:
        return {
            "first_token": self.first_token,
            "tokens": self.tokens,
            "preempted": self.preempted,
            "kv_peak": self.kv_peak,
            "cached": self.cached,
        }

    def _tokens(self, i: int) -> Tokens:
        """Request (or attempt) i's tokens: the trace's, else its own prompt shared with nobody."""
        run = self.run
        first = i if run.first_of is None else run.first_of[i]
        if run.token_ids is not None:
            return run.token_ids[first]
        return Tokens.unique(first, int(run.prompt_tokens[first]))

    # -- what the driver tells it ------------------------------------------------------

    def arrived(self) -> None:
        self.arm()

    def touched(self, i: int) -> None:
        """Request (or attempt) i was admitted or cancelled: its engine's timer may change (none
        where a central queue has not bound it yet)."""
        r = 0 if self.fleet is None else self.run.replica_of[i]
        if r >= 0:
            self.arm(r)

    def after_down(self, r: int, ran: list) -> None:
        self.arm(r)  # the deadlines cut there are gone

    # -- the core's hooks --------------------------------------------------------------

    def _joined(self, i: int, now: float, r: int) -> None:
        run = self.run
        if self.fleet is not None:
            run.replica_of[i] = r  # a central queue binds here (routed: where it was routed)
        run.start[i], run.engine_of[i] = now, r

    def _wake(self, now: float, r: int) -> None:
        # An idle engine wakes on a zero timeout: arrivals at this same instant join its first
        # step. A live run's step began as long after its wake as the gate took (a replay):
        # arrivals in between join it too.
        k = self.steps_run
        wait = (
            self.step_times[k][0] if self.step_times is not None and k < len(self.step_times) else 0
        )
        Timeout(self.env, wait, r).callbacks.append(self._begin)

    def _begin(self, event) -> None:
        self.lines[event._value].begin(self.env.now)
        self.arm(event._value)

    def _step(self, plan, now: float, r: int) -> None:
        k = self.steps_run
        self.steps_run += 1
        if self.step_times is not None and k < len(self.step_times):  # a live run's step (replay)
            _, run, self.step_reported[r], *after = self.step_times[k]
            if after and after[0] is not None:
                self.step_model_after[r] = after[0]
        else:
            run = plan.model_s
            if self.noise[r] is not None:
                run *= self.noise[r]()
            schedule = self.run.schedule
            if schedule is not None:
                run *= schedule.at(now) / schedule.base
            if self.slow[r] != 1.0:  # a slower replica (FleetSpec.speeds): its tracker learns it
                run *= self.slow[r]
        Timeout(self.env, run, r).callbacks.append(self._step_done)

    def _step_done(self, event) -> None:
        # step_done plans (and sets) the next step's.
        r = event._value
        reported = self.step_reported.pop(r, None)
        line = self.lines[r]
        if r in self.step_model_after:  # the live gate took a new step model here (replay)
            line.model = self.step_model_after.pop(r)
        line.step_done(self.env.now, reported)
        self.arm(event._value)

    def _ended(self, i: int, now: float, outcome: str, reason: str | None, stats) -> None:
        self.first_token[i], self.tokens[i] = stats.first_token_s, stats.tokens
        self.preempted[i], self.kv_peak[i] = stats.preemptions, stats.kv_blocks_peak
        self.cached[i] = stats.cached_tokens
        self.run.ran[i] = now - stats.start_s
        self.run._end(i, now, outcome, reason)

    # -- the core's timers (cutting at the deadline) ----------------------------------------

    # Each engine's line has a timer of its own, armed where that line changed: a fleet's event
    # costs the same whatever its number of replicas (a timer over all of them would read every
    # line at every event).
    def arm(self, r: int = 0) -> None:
        due = self.lines[r].next_timer()
        if due < self.timer_at[r]:
            self.timer_at[r] = due
            Timeout(self.env, max(0.0, due - self.env.now)).callbacks.append(
                lambda _, due=due: self._timer(r, due)
            )

    def _timer(self, r: int, due: float) -> None:
        if due != self.timer_at[r]:
            return  # an earlier one was set since, and has run
        self.timer_at[r] = math.inf
        self.lines[r].timer(self.env.now)
        self.arm(r)

    # -- the records ------------------------------------------------------------------

    def columns(self, trace, first: np.ndarray, columns: dict) -> None:
        """How long each request was in the batch, and its tokens as its steps made them."""
        arrival, finish = columns["arrival_s"], columns["finish_s"]
        first_token, tokens = np.asarray(self.first_token), np.asarray(self.tokens)
        answered = np.isin(columns["outcome"], ANSWERED)
        many = answered & (tokens > 1)
        columns.update(
            {
                "true_service_s": np.asarray(self.run.ran),  # how long it was in the batch
                "ttft_s": first_token - arrival,
                "tpot_s": np.where(
                    many, (finish - first_token) / np.maximum(tokens - 1, 1), np.nan
                ),
                "output_tokens": tokens,
                "preemptions": np.asarray(self.preempted),
                "kv_blocks_peak": np.asarray(self.kv_peak),
                "cached_prompt_tokens": np.asarray(self.cached),  # -1 (NA) without a prefix cache
            }
        )
