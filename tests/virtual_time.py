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

from live.engine import WORD, Abilities, EngineResult, Faults
from live.gate import BatchGate, Gate, gate_config
from live.gate_errors import (
    DeadlineCut,
    DeadlineExceeded,
    EngineFailed,
    EngineStalled,
    Rejected,
    ReplicaDown,
)
from live.jobs import Job
from live.engine_workers import _Failure  # what a worker hands back for a run that raised
from live.batching import SyntheticBatchEngine
from qsim.config import ServerConfig
from qsim import Policy, ServiceModel, Trace
from qsim.clients import TIMEOUT_REASON, Retrier, RetryPolicy, status_of


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


def on_virtual_clock(main):
    """Run the coroutine function ``main`` on a fresh :class:`VirtualLoop` to its end; its
    result."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


class LoopSynthetic:
    """The synthetic engine's service line, speed and fault schedule as a coroutine engine on the
    loop's clock.

    The gate runs a coroutine engine as a task on its own loop (its real worker for one, not a
    test's), so on a :class:`VirtualLoop` a run takes its time in virtual seconds: the watchdog, the
    stall rule and the deadlines are checked to the exact time, where
    :class:`live.engine.SyntheticEngine`'s threads and sleeps on the wall clock need slack. As that
    engine's: a run takes the model's estimate x speed, and run n hangs ``faults.hang_s`` longer
    where ``faults.hangs(n)``; a cancel (a client that left) stops a run at once.
    """

    max_new_tokens_limit = None
    abilities = Abilities(coroutine=True)

    def __init__(self, model: ServiceModel, speed: float = 1.0, faults: Faults = Faults()) -> None:
        self.model, self.speed, self.faults = model, speed, faults
        self.runs = 0

    async def arun(self, prompt, max_new_tokens, stop=None):
        loop = asyncio.get_running_loop()
        began = loop.time()
        self.runs += 1
        hang = self.faults.hang_s if self.faults.hangs(self.runs) else 0.0
        await asyncio.sleep(hang + float(self.model.estimate(max_new_tokens)) * self.speed)
        return EngineResult(WORD * max_new_tokens, max_new_tokens, loop.time() - began)

    def count_tokens(self, text: str) -> int:
        return len(text.encode())

    def warmup(self) -> None:
        pass

    def info(self) -> dict:
        return {"engine": "loop-synthetic"}


class LoopWorker:
    """A gate worker on the loop's clock, with no thread: nothing to start or stop; a subclass's
    ``give`` schedules the run's hand-back (``deliver(k, ticket, result)``) on the loop."""

    def __init__(self, k: int, deliver) -> None:
        self.k, self.deliver = k, deliver

    def start(self) -> None:
        pass

    def stop(self, timeout_s: float) -> None:
        pass


class SimEngine(LoopWorker):
    """A gate worker that takes the request's true service time on the loop's clock; no thread.

    The job's prompt is the request's index into ``true_s`` (and ``failed``, and ``tokens``: the
    tokens each generates, default its limit). A run the gate cuts at its deadline stops at once
    (its Cancel), as the simulator's does; one whose client left runs on to its end, as the
    simulator models it.
    """

    def __init__(
        self, k: int, true_s, failed, deliver, tokens=None, schedule=None, replica_speed=1.0
    ) -> None:
        super().__init__(k, deliver)
        self.true_s, self.failed, self.tokens = true_s, failed, tokens
        # qsim.service.SpeedSchedule: a run takes true x speed at its start / base
        self.schedule = schedule
        # a fleet's replica's speed (qlab serve --replica-speeds): its runs x 1 / it, as the
        # synthetic engine's (live.engine.SyntheticEngine's replica_speed)
        self.slow = 1.0 / replica_speed

    def give(self, ticket) -> None:
        i = int(ticket.job.prompt)
        loop = asyncio.get_running_loop()
        s = self.true_s[i]
        # as the simulator's engines: the speed at the start, over the trace's
        if self.schedule is not None:
            s *= self.schedule.at(loop.time()) / self.schedule.base
        s *= self.slow
        if self.failed is not None and self.failed[i]:
            result = _Failure(RuntimeError("injected"), s)
        else:
            generated = ticket.job.max_new_tokens if self.tokens is None else self.tokens[i]
            result = EngineResult("", int(generated), s)
        began, done = loop.time(), []

        def hand_back(result) -> None:
            if not done:
                done.append(True)
                self.deliver(self.k, ticket, result)

        handle = loop.call_later(s, hand_back, result)

        def cut() -> None:
            if ticket.cut and not done:
                handle.cancel()
                loop.call_soon(hand_back, EngineResult("", 0, loop.time() - began, stopped=True))

        if ticket.cancel is not None:
            ticket.cancel.when_set(cut)


def _seen(row: dict, arrival) -> None:
    seen = arrival.seen
    row.update(
        queued=seen.queued,
        queued_work_s=seen.queued_work_s,
        est_service_s=seen.est_service_s,
        replica=-1 if arrival.replica is None else arrival.replica,
    )


_ENDS = {
    Rejected: "rejected",
    DeadlineExceeded: "expired",
    EngineFailed: "error",
    EngineStalled: "error",
    DeadlineCut: "cancelled",
    ReplicaDown: "error",
}


def run_gate(
    trace: Trace,
    policy: Policy,
    engines: int,
    *,
    model: ServiceModel | None = None,
    failed=None,
    cancel_after_s=None,
    fixed_estimate: bool = False,
    priority=None,
    client=None,
    retry: RetryPolicy | None = None,
    speed_schedule=None,
    config: ServerConfig | None = None,
    fleet=None,
    wrap_engine=None,
    prompt_ids=None,
) -> tuple[pd.DataFrame, dict]:
    """Replay ``trace`` through a real Gate on a virtual clock; one row per attempt, and the final
    /stats.

    The gate estimates from ``model``; give the trace the same model's estimates (from_arrays does).
    retry: clients that send again, through the same :class:`qsim.clients.Retrier` the simulator
    asks; each attempt is a row with first_request_id and attempt, appended in decision order.
    Patience (``cancel_after_s``, default the trace's) counts from the first send, as in the
    simulator. speed_schedule: the engines' speed over the virtual clock, as
    ``simulate(speed_schedule=)`` takes it. config: a batching server (its engine a
    :class:`qsim.engines.Batching`; policy, model and engines come from it): a
    :func:`live.gate.BatchGate` in front of the real :class:`live.batching.SyntheticBatchEngine` (a
    task on the loop, its steps taking the step model's time on the virtual clock); each row also
    has first_token_s (absolute, NaN where none) and tokens. Each request then runs to its limit
    (the gate cannot know early stops). fleet: a :class:`qsim.fleet.FleetSpec`: the gate routes over
    its replicas of ``engines`` engines each (live.fleet_gate), or, with a batching ``config``, of
    one batching engine each; each row's replica is where the router sent it (a central queue: where
    it joined a batch). wrap_engine: what the batching engine is given to before the gate (a test's
    engine around it). prompt_ids: each request's prompt as token ids (a prefix cache's: its
    prompt_tokens their number); each row also has cached (an answer's cached_prompt_tokens, -1:
    none).
    """
    batching = config
    if batching is not None:
        policy, model, engines = config.policy, config.model, 1
    model = model or ServiceModel()
    # The trace's own clients and priorities unless given (the coroutine below is named client).
    client_of = trace.client_id if client is None else client
    priority = trace.priority if priority is None else priority
    patience_of = (
        trace.patience_s if cancel_after_s is None else np.asarray(cancel_after_s, dtype=float)
    )
    true_s = trace.true_service_s.tolist()
    # what each run generates: what a learning estimator learns
    tokens = trace.tokens_generated.tolist()
    arrival = trace.arrival_s.tolist()
    retrier = (
        Retrier(retry, trace.arrival_s, trace.meta.get("seed", 0))
        if retry is not None and retry.retries
        else None
    )
    timeout_s = math.inf if retry is None or retry.timeout_s is None else retry.timeout_s
    rows: list[dict] = []
    pending = set()

    def new_row(first: int, attempt: int, at: float) -> int:
        rows.append(
            dict(
                first_request_id=first,
                attempt=attempt,
                arrival_s=at,
                outcome=None,
                reason=None,
                start_s=math.nan,
                finish_s=math.nan,
                engine=-1,
                queued=-1,
                queued_work_s=math.nan,
                est_service_s=math.nan,
                retry_after_s=-1,
                first_token_s=math.nan,
                tokens=-1,
                replica=-1,
                cached=-1,
            )
        )
        return len(rows) - 1

    def end(j: int, outcome: str, reason, retry_after_s: int = -1) -> None:
        loop = asyncio.get_running_loop()
        row = rows[j]
        row.update(
            outcome=outcome, reason=reason, finish_s=loop.time(), retry_after_s=retry_after_s
        )
        if retrier is None or (outcome == "abandoned" and reason != TIMEOUT_REASON):
            return
        first = row["first_request_id"]
        decision = retrier.after(
            first,
            row["attempt"],
            arrival[first],
            loop.time(),
            status_of(outcome, reason),
            retry_after_s if retry_after_s >= 0 else None,
            patience_of[first],
        )
        if decision.at_s is not None:
            k = new_row(first, row["attempt"] + 1, decision.at_s)
            pending.add(k)
            loop.call_at(decision.at_s, submit, k)

    async def wait(gate: Gate, j: int, future: asyncio.Future) -> None:
        row = rows[j]
        waiter = asyncio.ensure_future(asyncio.shield(future))
        first = row["first_request_id"]
        patience = patience_of[first] - (row["arrival_s"] - arrival[first])
        limit = min(patience, timeout_s)
        try:
            answer = await asyncio.wait_for(waiter, None if math.isinf(limit) else limit)
        except asyncio.TimeoutError:
            future.cancel()
            end(j, "abandoned", "client_left" if patience <= timeout_s else TIMEOUT_REASON)
            return
        except tuple(_ENDS) as exc:
            _seen(row, exc.arrival)
            if isinstance(exc, (EngineFailed, DeadlineCut)):
                row.update(engine=exc.numbers["engine"], start_s=exc.numbers["started_at"])
            end(j, _ENDS[type(exc)], exc.reason, getattr(exc, "retry_after_s", -1))
            return
        finally:
            pending.discard(j)
        row.update(
            outcome=answer.outcome,
            start_s=answer.started_at,
            finish_s=answer.returned_at,
            engine=answer.engine,
            tokens=answer.tokens,
            cached=-1 if answer.cached_prompt_tokens is None else answer.cached_prompt_tokens,
            first_token_s=math.nan
            if answer.first_token_s is None
            else answer.started_at + answer.first_token_s,
        )
        _seen(row, answer.arrival)

    def submit(j: int) -> None:
        row = rows[j]
        i = row["first_request_id"]
        deadline = None if np.isnan(trace.deadline_s[i]) else float(trace.deadline_s[i])
        try:
            future = gate_of[0].submit(
                Job(
                    str(i),
                    int(trace.max_new_tokens[i]),
                    (),
                    deadline,
                    None if client_of[i] is None else str(client_of[i]),
                    int(priority[i]),
                    int(trace.prompt_tokens[i]),
                    prompt_ids=None if prompt_ids is None else tuple(prompt_ids[i]),
                )
            )
        except Rejected as exc:
            pending.discard(j)
            _seen(row, exc.arrival)
            end(j, "rejected", exc.rejection.reason, exc.rejection.retry_after_s)
        else:
            pending.add(j)
            asyncio.ensure_future(wait(gate_of[0], j, future))

    gate_of: list[Gate] = []

    async def go():
        loop = asyncio.get_running_loop()
        config = (
            gate_config(policy, model=model, fixed_estimate=fixed_estimate)
            if batching is None
            else batching
        )
        worker = lambda k, engine, deliver: SimEngine(  # noqa: E731
            k,
            true_s,
            failed,
            deliver,
            tokens,
            speed_schedule,
            1.0 if fleet is None else fleet.speed(k // engines),
        )
        n = engines * (1 if fleet is None else fleet.replicas)
        if batching is None:
            gate = Gate([None] * n, config, clock=loop.time, worker=worker, fleet=fleet)
        else:  # one engine per replica, each drawing its replica's step noise
            made = [
                (wrap_engine or (lambda e: e))(
                    SyntheticBatchEngine(
                        batching.engine.step,
                        seed=batching.seed,
                        clock=loop.time,
                        schedule=() if speed_schedule is None else speed_schedule.steps,
                        replica=r,
                        replica_speed=1.0 if fleet is None else fleet.speed(r),
                    )
                )
                for r in range(n)
            ]
            gate = (
                BatchGate(made[0], batching, clock=loop.time)
                if fleet is None
                else Gate(made, batching, clock=loop.time, fleet=fleet)
            )
        async with gate:
            gate_of.append(gate)
            for i, t in enumerate(arrival):
                if t > loop.time():  # at t exactly, as the simulator's arrivals are
                    due = loop.create_future()
                    loop.call_at(t, due.set_result, None)
                    await due
                submit(new_row(i, 1, t))
            # retries to come; runs whose client left still hold their engine
            while pending or gate.in_service:
                await asyncio.sleep(0.01)
            if batching is None:
                return gate.stats()
            # every step
            return {
                **gate.stats(),
                "step_log": [list(step) for step in gate.driver.step_log],
                "step_models": gate.step_page(cursor=0, limit=len(gate.driver.step_log))[
                    "step_models"
                ],
            }

    stats = on_virtual_clock(go)
    frame = pd.DataFrame(rows)
    return frame, stats
