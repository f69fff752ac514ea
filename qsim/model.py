"""A SimPy model of one FIFO queue in front of K identical engines.

One arrival process walks the trace; K engine processes run requests. The
rules are the shared ones from :mod:`qsim.policy`, applied at the same three
moments as in the live gate:

* arrival: :func:`~qsim.policy.decide` on the waiting count, the estimated
  queued work and the estimated remaining work in service;
* reaching the front (an engine is free for it): with ``expire_at_front``, a
  request that :func:`~qsim.policy.cannot_finish` is dropped unrun;
* completion: the :class:`~qsim.service.SpeedTracker` learns actual over predicted.

A request admitted while an engine is idle is in service from that instant
(the engine is claimed synchronously, before the next arrival is looked at),
so a burst cannot slip one more request past a queue bound than the bound allows.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pandas as pd
import simpy

from . import records
from .policy import EXPIRE_REASON, PRESETS, Policy, cannot_finish, decide, on_time
from .service import SpeedTracker
from .workload import Trace

_NAN = math.nan


class _Run:
    """State of one simulation; the engine and arrival generators are its methods."""

    def __init__(self, trace: Trace, policy: Policy, engines: int, tracker: SpeedTracker) -> None:
        n = len(trace)
        self.env = simpy.Environment()
        self.policy, self.engines, self.tracker = policy, engines, tracker
        # Python lists: element access in the event loop is several times faster than numpy's.
        self.arrival = trace.arrival_s.tolist()
        self.base_est = trace.est_service_s.tolist()
        self.true = trace.true_service_s.tolist()
        own = trace.deadline_s
        self.deadline = np.where(np.isnan(own), policy.deadline_s, own).tolist()
        self.est = [_NAN] * n
        self.outcome: list = [None] * n
        self.reason: list = [None] * n
        self.start = [_NAN] * n
        self.finish = [_NAN] * n
        self.queued_at_arrival = [0] * n
        self.queued_work = [_NAN] * n
        self.retry_after = [-1] * n
        self.engine_of = [-1] * n
        # Queue state.
        self.waiting: deque[int] = deque()
        self.waiting_base_s = 0.0  # calibrated estimates of the waiting, summed
        self.current = [-1] * engines  # request on each engine, -1 when idle
        self.busy_until = [0.0] * engines  # estimated end of the current request
        self.idle = list(range(engines - 1, -1, -1))  # pop() gives the lowest free engine
        self.wake: list[simpy.Event | None] = [None] * engines

    # -- the three moments -------------------------------------------------

    def arrive(self, i: int) -> None:
        # The trace's own time: SimPy's clock reaches it as now + (t - now), which can be off by
        # a rounding, and a request that starts at once should show exactly zero wait.
        now = self.arrival[i]
        factor = self.tracker.factor
        est = self.base_est[i] * factor
        queued = len(self.waiting)
        queued_work = self.waiting_base_s * factor
        idle = len(self.idle)
        remaining = 0.0 if idle else sum(max(0.0, end - now) for end in self.busy_until)
        self.est[i] = est
        self.queued_at_arrival[i] = queued
        self.queued_work[i] = queued_work
        refusal = decide(self.policy, queued, queued_work, remaining, est, self.deadline[i], self.engines, idle)
        if refusal is not None:
            self.outcome[i], self.reason[i] = "rejected", refusal.reason
            self.retry_after[i] = refusal.retry_after_s
            self.finish[i] = now
        elif idle:
            self.begin(self.idle.pop(), i, now)
        else:
            self.waiting.append(i)
            self.waiting_base_s += self.base_est[i]

    def begin(self, k: int, i: int, now: float) -> None:
        self.current[k] = i
        self.start[i] = now
        self.engine_of[i] = k
        self.busy_until[k] = now + self.base_est[i] * self.tracker.factor
        wake = self.wake[k]
        if wake is not None:
            self.wake[k] = None
            wake.succeed()

    def next_from_front(self, k: int, now: float) -> None:
        """Give engine k the first waiting request that can still make it, or mark k idle."""
        expire = self.policy.expire_at_front
        while self.waiting:
            j = self.waiting.popleft()
            self.waiting_base_s -= self.base_est[j]
            if expire and cannot_finish(now, self.base_est[j] * self.tracker.factor, self.arrival[j] + self.deadline[j]):
                self.outcome[j], self.reason[j] = "expired", EXPIRE_REASON
                self.finish[j] = now
                continue
            self.begin(k, j, now)
            return
        self.waiting_base_s = 0.0  # no drift from adding and subtracting floats
        self.current[k] = -1
        self.idle.append(k)

    # -- processes ---------------------------------------------------------

    def arrivals(self):
        env = self.env
        for i, t in enumerate(self.arrival):
            if t > env.now:
                yield env.timeout(t - env.now)
            self.arrive(i)

    def engine(self, k: int):
        env = self.env
        while True:
            i = self.current[k]
            if i < 0:
                self.wake[k] = env.event()
                yield self.wake[k]
                continue
            yield env.timeout(self.true[i])
            now = env.now
            self.finish[i] = now
            self.outcome[i] = "good" if on_time(now - self.arrival[i], self.deadline[i]) else "late"
            self.tracker.observe(self.base_est[i], self.true[i])
            self.next_from_front(k, now)

    def frame(self, trace: Trace) -> pd.DataFrame:
        finish = np.asarray(self.finish)
        return records.from_arrays(
            {
                "request_id": trace.request_id,
                "arrival_s": trace.arrival_s,
                "size_class": trace.size_class,
                "max_new_tokens": trace.max_new_tokens,
                "est_service_s": self.est,
                "true_service_s": trace.true_service_s,
                "deadline_s": self.deadline,
                "outcome": self.outcome,
                "reason": self.reason,
                "start_s": self.start,
                "finish_s": finish,
                "latency_s": finish - trace.arrival_s,
                "queued_at_arrival": self.queued_at_arrival,
                "queued_work_at_arrival_s": self.queued_work,
                "retry_after_s": self.retry_after,
                "engine": self.engine_of,
            }
        )


def simulate(
    trace: Trace,
    policy: Policy = PRESETS["none"],
    engines: int = 1,
    *,
    fixed_estimate: bool = False,
    tracker_weight: float = 0.2,
) -> pd.DataFrame:
    """Run ``trace`` through the queue and return one record per request (see :mod:`qsim.records`).

    fixed_estimate keeps the calibrated estimate (speed factor 1) instead of tracking speed.
    The frame's ``attrs`` carry the run's duration_s, policy, engines and final speed factor.
    """
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    if len(trace) and np.any(np.diff(trace.arrival_s) < 0):
        raise ValueError("trace arrivals must be sorted by time")
    tracker = SpeedTracker(weight=tracker_weight, fixed=fixed_estimate)
    run = _Run(trace, policy, engines, tracker)
    for k in range(engines):
        run.env.process(run.engine(k))
    run.env.process(run.arrivals())
    run.env.run()
    frame = run.frame(trace)
    frame.attrs.update(duration_s=trace.duration_s, policy=policy.name, engines=engines, speed_factor=tracker.factor)
    return frame
