"""The live gate on a simulated clock: an asyncio loop whose time jumps to the next timer.

The gate's exactness against the simulator is a property of the shared queue
core, not of how fast a machine happens to be. So tests run the real
:class:`live.gate.Gate` (its futures, hooks, watchdog and counts) on an event
loop whose clock is virtual: when nothing is ready, the loop moves its clock to
the next timer instead of sleeping. Engines are :class:`SimEngine` workers that
hand each request back after its true service time on that clock, as the
simulator's engines do. No wall-clock slack is involved anywhere.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pandas as pd

from live.engine import EngineResult
from live.gate import DeadlineExceeded, EngineFailed, EngineStalled, Gate, GateConfig, Job, Rejected
from live.gate import _Failure  # what a worker hands back for a run that raised
from qsim import Policy, ServiceModel, Trace


class _FastForward:
    """A selector that, instead of sleeping until the next timer, moves the loop's clock there."""

    def __init__(self, selector, loop: "VirtualLoop") -> None:
        self._selector, self._loop = selector, loop

    def select(self, timeout=None):
        ready = self._selector.select(0)
        if not ready and timeout is not None and timeout > 0:
            # Exactly the timer's time (now + (when - now) can differ from it in the last bit).
            self._loop.now = max(self._loop.now, self._loop._scheduled[0].when())
        return ready

    def __getattr__(self, name):
        return getattr(self._selector, name)


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self._selector = _FastForward(self._selector, self)

    def time(self) -> float:
        return self.now


class SimEngine:
    """A gate worker that takes the request's true service time on the loop's clock; no thread.

    The job's prompt is the request's index into ``true_s`` (and ``failed``).
    """

    def __init__(self, k: int, true_s, failed, deliver) -> None:
        self.k, self.true_s, self.failed, self.deliver = k, true_s, failed, deliver

    def start(self) -> None:
        pass

    def stop(self, timeout_s: float) -> None:
        pass

    def give(self, ticket) -> None:
        i = int(ticket.job.prompt)
        s = self.true_s[i]
        if self.failed is not None and self.failed[i]:
            result = _Failure(RuntimeError("injected"), s)
        else:
            result = EngineResult("", int(ticket.job.max_new_tokens), s)
        asyncio.get_running_loop().call_later(s, self.deliver, self.k, ticket, result)


def _seen(row: dict, arrival) -> None:
    row.update(queued=arrival.queued, queued_work_s=arrival.queued_work_s, est_service_s=arrival.est_service_s)


_ENDS = {Rejected: "rejected", DeadlineExceeded: "expired", EngineFailed: "error", EngineStalled: "error"}


def run_gate(trace: Trace, policy: Policy, engines: int, *, model: ServiceModel | None = None, failed=None,
             cancel_after_s=None, fixed_estimate: bool = False, priority=None, client=None
             ) -> tuple[pd.DataFrame, dict]:
    """Replay ``trace`` through a real Gate on a virtual clock; one row per request, and the final /stats.

    The gate estimates from ``model``; give the trace the same model's estimates (from_arrays does).
    """
    model = model or ServiceModel()
    # The trace's own clients and priorities unless given (the coroutine below is named client).
    client_of = trace.client_id if client is None else client
    priority = trace.priority if priority is None else priority
    true_s = trace.true_service_s.tolist()
    rows = [dict(outcome=None, reason=None, start_s=math.nan, finish_s=math.nan, engine=-1, queued=-1,
                 queued_work_s=math.nan, est_service_s=math.nan) for _ in range(len(trace))]

    async def client(gate: Gate, i: int, future: asyncio.Future) -> None:
        row = rows[i]
        waiter = asyncio.ensure_future(asyncio.shield(future))
        patience = math.inf if cancel_after_s is None else cancel_after_s[i]
        try:
            answer = await asyncio.wait_for(waiter, None if math.isinf(patience) else patience)
        except asyncio.TimeoutError:
            future.cancel()
            row.update(outcome="abandoned", reason="client_left", finish_s=asyncio.get_running_loop().time())
            return
        except tuple(_ENDS) as exc:
            row.update(outcome=_ENDS[type(exc)], reason=exc.reason, finish_s=asyncio.get_running_loop().time())
            _seen(row, exc.arrival)
            if isinstance(exc, EngineFailed):
                row.update(engine=exc.engine, start_s=exc.numbers["started_at"])
            return
        row.update(outcome=answer.outcome, start_s=answer.started_at, finish_s=answer.returned_at,
                   engine=answer.engine)
        _seen(row, answer.arrival)

    async def go():
        loop = asyncio.get_running_loop()
        config = GateConfig(policy, model, fixed_estimate=fixed_estimate)
        worker = lambda k, engine, deliver: SimEngine(k, true_s, failed, deliver)  # noqa: E731
        async with Gate([None] * engines, config, clock=loop.time, worker=worker) as gate:
            tasks = []
            for i, t in enumerate(trace.arrival_s.tolist()):
                if t > loop.time():  # at t exactly, as the simulator's arrivals are
                    due = loop.create_future()
                    loop.call_at(t, due.set_result, None)
                    await due
                deadline = None if np.isnan(trace.deadline_s[i]) else float(trace.deadline_s[i])
                try:
                    future = gate.submit(Job(str(i), int(trace.max_new_tokens[i]), (), deadline,
                                             None if client_of[i] is None else str(client_of[i]),
                                             int(priority[i])))
                except Rejected as exc:
                    rows[i].update(outcome="rejected", reason=exc.rejection.reason, finish_s=loop.time())
                    _seen(rows[i], exc.arrival)
                else:
                    tasks.append(asyncio.ensure_future(client(gate, i, future)))
            await asyncio.gather(*tasks)
            while gate.in_service:  # runs whose client left still hold their engine
                await asyncio.sleep(0.01)
            return gate.stats()

    loop = VirtualLoop()
    try:
        stats = loop.run_until_complete(go())
    finally:
        loop.close()
    frame = pd.DataFrame(rows)
    return frame, stats
