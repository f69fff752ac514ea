"""The live gate in real time, with engine threads and the synthetic engine (and coroutine engines
as tasks).

Exact agreement with the simulator is checked on a virtual clock
(tests/test_gate_sim.py); here the real threads, sleeps and futures, in tests
whose outcomes do not turn on how fast a busy machine is. Where an outcome
turns on a margin of milliseconds (a deadline met by 25 ms, the speed the
tracker learns), the same engine's times run on a virtual clock instead
(tests/virtual_time.py).
"""

import asyncio

import numpy as np
import pytest

from live.engine import (
    Abilities,
    Cancel,
    EngineResult,
    SyntheticEngine,
    UpstreamError,
    UpstreamTimeout,
    abilities_of,
)
from live.gate import Gate, gate_config
from live.gate_errors import (
    DeadlineExceeded,
    EngineFailed,
    Rejected,
    UpstreamFailed,
    UpstreamTimedOut,
)
from live.jobs import END, Job
from qsim import PRESETS, ServiceModel, from_arrays, simulate
from virtual_time import LoopSynthetic, on_virtual_clock

MODEL = ServiceModel(intercept_s=0.002, per_token_s=0.004)  # 12 tokens -> 0.05 s


async def _burst(gate: Gate, tokens: list[int]) -> list[str]:
    """Submit every job in one go (no await in between: a true burst), then collect outcomes in
    order."""
    pending = []
    for n in tokens:
        try:
            pending.append(gate.submit(Job("prompt", n)))
        except Rejected as exc:
            pending.append(exc)
    outcomes = []
    for item in pending:
        if isinstance(item, Rejected):
            outcomes.append("rejected")
            continue
        try:
            outcomes.append((await item).outcome)
        except DeadlineExceeded:
            outcomes.append("expired")
    return outcomes


def _live(policy, engines: int, tokens: list[int]) -> tuple[list[str], dict]:
    async def go():
        async with Gate(
            [SyntheticEngine(MODEL) for _ in range(engines)], gate_config(policy, model=MODEL)
        ) as gate:
            return await _burst(gate, tokens), gate.stats()

    return asyncio.run(go())


def _virtual(policy, engines: int, tokens: list[int]) -> tuple[list[str], dict]:
    """As _live, with the synthetic engines' times on a virtual clock: where an outcome turns on a
    margin of milliseconds, which a busy machine's threads could miss."""

    async def go():
        loop = asyncio.get_running_loop()
        engines_ = [LoopSynthetic(MODEL) for _ in range(engines)]
        async with Gate(engines_, gate_config(policy, model=MODEL), clock=loop.time) as gate:
            return await _burst(gate, tokens), gate.stats()

    return on_virtual_clock(go)


def _simulated(policy, engines: int, tokens: list[int]) -> list[str]:
    trace = from_arrays(np.zeros(len(tokens)), tokens, model=MODEL)
    return simulate(trace, policy, engines)["outcome"].tolist()


def test_a_burst_in_real_time_matches_the_simulator():
    # The counting trap, with real engine threads: two start at once, four wait, four are refused.
    policy, tokens = PRESETS["bounded"].with_overrides(max_queue=4), [12] * 10
    live, stats = _live(policy, 2, tokens)
    assert live == _simulated(policy, 2, tokens) == ["good"] * 6 + ["rejected"] * 4
    assert stats["counts"]["good"] == 6 and stats["rejected_by_reason"]["queue_full"] == 4
    assert stats["waiting"] == 0 and stats["in_service"] == 0


def test_bounded_deadline_expires_at_the_front():
    # Deadline 0.125 s, 0.05 s each: the second finishes at 0.10, the third would end at 0.15 ->
    # expired.
    live, stats = _virtual(
        PRESETS["bounded-deadline"].with_overrides(deadline_s=0.125), 1, [12] * 10
    )
    assert live == ["good", "good"] + ["expired"] * 7 + ["rejected"]
    assert stats["counts"]["expired"] == 7 and stats["rejected_by_reason"]["queue_full"] == 1


def test_expired_request_carries_numbers_and_retry_after():
    policy = PRESETS["bounded-deadline"].with_overrides(deadline_s=0.06)

    async def go():
        async with Gate([SyntheticEngine(MODEL)], gate_config(policy, model=MODEL)) as gate:
            first, second = gate.submit(Job("a", 12)), gate.submit(Job("b", 12))
            await first
            with pytest.raises(DeadlineExceeded) as info:
                await second
            return info.value

    exc = asyncio.run(go())
    assert exc.reason == "cannot_finish" and exc.retry_after_s >= 1
    assert exc.numbers["deadline_s"] == 0.06 and exc.numbers["waited_s"] >= 0.05


def test_rejection_carries_qsim_rejection():
    policy = PRESETS["bounded"].with_overrides(max_queue=0)

    async def go():
        async with Gate([SyntheticEngine(MODEL)], gate_config(policy, model=MODEL)) as gate:
            running = gate.submit(Job("a", 12))
            with pytest.raises(Rejected) as info:
                gate.submit(Job("b", 12))
            await running
            return info.value

    exc = asyncio.run(go())
    assert exc.rejection.reason == "queue_full" and exc.rejection.retry_after_s == 1
    assert exc.arrival.seen.queued == 0 and exc.arrival.seen.est_service_s == pytest.approx(0.05)


class _Recording(SyntheticEngine):
    """A synthetic engine that keeps what each run was given and returned."""

    abilities = Abilities(cancel=True)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompts, self.results = [], []

    def run(self, prompt, max_new_tokens, stop=None, cancel=None):
        self.prompts.append(prompt)
        result = super().run(prompt, max_new_tokens, stop, cancel)
        self.results.append(result)
        return result


def test_cancelled_waiting_request_leaves_the_queue_with_its_work():
    async def go():
        engine = _Recording(MODEL)
        async with Gate([engine], gate_config(PRESETS["none"], model=MODEL)) as gate:
            first = gate.submit(Job("a", 12))
            second = gate.submit(Job("b", 12))
            third = gate.submit(Job("c", 4))
            assert gate.waiting == 2
            second.cancel()  # what the service does when the client disconnects
            await asyncio.sleep(0)  # the done callback runs on the loop
            waiting, work = gate.waiting, gate.queued_work_s
            await first
            answer = await third
            return waiting, work, answer, engine.prompts, gate.stats()

    waiting, work, answer, ran, stats = asyncio.run(go())
    assert waiting == 1
    assert work == pytest.approx(float(MODEL.estimate(4)))
    assert ran == ["a", "c"]  # started after the first alone, not after the cancelled one too
    assert answer.started_at >= answer.arrival.at
    assert stats["cancelled"] == 1 and stats["counts"]["good"] == 2 and stats["waiting"] == 0


class _Flaky:
    """Fails on the prompt 'boom', otherwise a synthetic engine."""

    max_new_tokens_limit = None

    def __init__(self) -> None:
        self.inner = SyntheticEngine(MODEL, speed=2.0)

    def run(self, prompt, max_new_tokens, stop):
        if prompt == "boom":
            raise RuntimeError("out of memory (pretend)")
        return self.inner.run(prompt, max_new_tokens, stop)

    def count_tokens(self, text):
        return len(text)

    def warmup(self):
        pass

    def info(self):
        return {"engine": "flaky"}


def test_engine_exception_is_an_error_and_teaches_the_tracker_nothing():
    async def go():
        async with Gate([_Flaky()], gate_config(PRESETS["none"], model=MODEL)) as gate:
            boom = gate.submit(Job("boom", 12))
            after = gate.submit(Job("fine", 12))
            with pytest.raises(EngineFailed) as info:
                await boom
            factor_after_failure = gate.tracker.factor
            answer = await after  # the same engine thread goes on
            return info.value, factor_after_failure, answer, gate.stats()

    exc, factor, answer, stats = asyncio.run(go())
    assert isinstance(exc.__cause__, RuntimeError) and exc.engine == 0
    assert factor == 1.0
    assert answer.outcome == "good" and answer.engine == 0
    assert stats["counts"]["error"] == 1 and stats["counts"]["good"] == 1
    assert stats["speed_factor"] > 1.1  # the slow success did teach it


@pytest.mark.parametrize("fixed", [False, True])
def test_speed_tracking_and_fixed_estimate(fixed):
    def engine_on(clock: str):
        return (
            SyntheticEngine(MODEL, speed=2.0)
            if clock == "real"
            else LoopSynthetic(MODEL, speed=2.0)
        )

    async def go(clock: str):
        config = gate_config(PRESETS["none"], model=MODEL, fixed_estimate=fixed)
        loop = asyncio.get_running_loop()
        async with Gate([engine_on(clock)], config, clock=loop.time) as gate:
            for _ in range(4):
                await gate.submit(Job("x", 2))
            return gate.tracker.factor

    real, virtual = asyncio.run(go("real")), on_virtual_clock(lambda: go("virtual"))
    if fixed:
        assert real == virtual == 1.0
    else:
        # Four runs at twice their estimate, folded in with weight 0.2: exactly so on the virtual
        # clock; real sleeps only ever overshoot, so at least so on the wall clock.
        assert virtual == pytest.approx(1.0 + (1.0 - 0.8**4) * (2.0 - 1.0), rel=1e-12)
        assert real >= virtual - 1e-9


def test_submit_before_start_is_an_error():
    gate = Gate([SyntheticEngine(MODEL)], gate_config(PRESETS["none"], model=MODEL))
    with pytest.raises(RuntimeError):
        gate.submit(Job("x", 1))


def test_synthetic_engine_sleeps_the_estimate_times_speed_on_schedule():
    now = [0.0]
    engine = SyntheticEngine(
        ServiceModel(0.0, 0.01), speed=1.0, schedule=[(10.0, 3.0)], clock=lambda: now[0]
    )
    assert engine.duration_s(5) == pytest.approx(0.05)
    now[0] = 12.0
    assert engine.duration_s(5) == pytest.approx(0.15)
    result = engine.run("p", 3, stop=None)
    assert isinstance(result, EngineResult) and result.tokens == 3 and result.engine_s >= 0.09
    assert result.text == " tok" * 3
    noisy = SyntheticEngine(ServiceModel(0.0, 0.01), noise_cv=0.5, seed=3)
    draws = [noisy.duration_s(10) for _ in range(2000)]
    assert np.mean(draws) == pytest.approx(0.1, rel=0.05) and np.std(draws) / np.mean(
        draws
    ) == pytest.approx(0.5, rel=0.15)


class _Wrong(_Flaky):
    def run(self, prompt, max_new_tokens, stop):
        return "not an EngineResult"


def test_engine_returning_the_wrong_type_is_an_error_not_a_hang():
    async def go():
        async with Gate([_Wrong()], gate_config(PRESETS["none"], model=MODEL)) as gate:
            with pytest.raises(EngineFailed, match="EngineResult"):
                await asyncio.wait_for(gate.submit(Job("x", 1)), 5)
            return gate.stats()

    stats = asyncio.run(go())
    assert stats["counts"]["error"] == 1 and stats["in_service"] == 0


def test_close_cancels_the_waiting_and_refuses_new_work():
    async def go():
        engine = _Recording(MODEL)
        gate = Gate([engine], gate_config(PRESETS["none"], model=MODEL))
        gate.start()
        running, waiting = gate.submit(Job("a", 12)), gate.submit(Job("b", 12))
        # the engine thread finishes "a" (0.05 s) and is joined: nothing more starts
        gate.close(timeout_s=5.0)
        await asyncio.sleep(0)  # a's hand-back, posted by the thread, runs on the loop
        with pytest.raises(RuntimeError):
            gate.submit(Job("c", 1))
        return running.cancelled(), waiting.cancelled(), gate.waiting, engine.prompts

    assert asyncio.run(go()) == (True, True, 0, ["a"])


# ---------------------------------------------------------------- cancelling a run, upstream
# failures


def test_a_client_leaving_a_running_request_stops_its_engine_and_teaches_nothing():
    async def go():
        engine = _Recording(MODEL)
        async with Gate([engine], gate_config(PRESETS["none"], model=MODEL)) as gate:
            running = gate.submit(Job("a", 2500))  # 10 s unless stopped; in service at once
            running.cancel()  # its client hung up while the engine ran it
            behind = gate.submit(Job("b", 2))  # starts once a's stopped run has returned
            answer = await behind
            return engine.results, gate.tracker.factor, answer, gate.stats()

    results, factor, answer, stats = asyncio.run(asyncio.wait_for(go(), 5))  # well before a's 10 s
    assert results[0].stopped and results[0].tokens == 0 and not results[1].stopped
    # The tracker learned b's run alone: the stopped run's time taught it nothing.
    assert factor == pytest.approx(
        1.0 + 0.2 * (answer.engine_s / float(MODEL.estimate(2)) - 1.0), rel=1e-12
    )
    assert (
        answer.outcome == "good" and answer.tokens == 2 and answer.arrival.seen.speed_factor == 1.0
    )
    assert (
        stats["cancelled"] == 1 and stats["counts"]["good"] == 1 and stats["counts"]["error"] == 0
    )


def test_cancel_runs_its_callbacks_once_and_engines_declare_whether_they_take_it():
    cancel, calls = Cancel(), []
    forget = cancel.when_set(lambda: calls.append("a"))
    cancel.when_set(lambda: calls.append("b"))
    forget()
    cancel.set()
    cancel.set()
    cancel.when_set(lambda: calls.append("late"))  # already set: at once
    assert calls == ["b", "late"] and cancel.is_set()
    assert abilities_of(SyntheticEngine(MODEL)).cancel and not abilities_of(_Flaky()).cancel


def test_an_engine_declares_its_abilities_with_the_one_dataclass():
    class Sloppy(_Flaky):
        abilities = {"cancel": True}  # a dict says nothing the gate reads: refused, not guessed at

    with pytest.raises(TypeError, match="not live.engine.Abilities"):
        abilities_of(Sloppy())


class _Upstream(_Flaky):
    """Raises what an upstream engine raises, on the prompts 'error' and 'timeout'."""

    def run(self, prompt, max_new_tokens, stop):
        if prompt == "error":
            raise UpstreamError("the upstream answered HTTP 500: boom")
        if prompt == "timeout":
            raise UpstreamTimeout("the upstream sent nothing for 1 s")
        return super().run(prompt, max_new_tokens, stop)


def test_upstream_failures_are_their_own_errors_counted_apart():
    async def go():
        async with Gate([_Upstream()], gate_config(PRESETS["none"], model=MODEL)) as gate:
            caught = []
            for prompt in ("error", "timeout"):
                with pytest.raises(EngineFailed) as info:
                    await gate.submit(Job(prompt, 2))
                caught.append(info.value)
            factor = gate.tracker.factor
            answer = await gate.submit(Job("fine", 2))  # the gate keeps serving
            return caught, factor, answer, gate

    (error, timeout), factor, answer, gate = asyncio.run(go())
    assert (
        type(error) is UpstreamFailed and error.reason == "upstream_error" and "boom" in str(error)
    )
    assert type(timeout) is UpstreamTimedOut and timeout.reason == "upstream_timeout"
    assert answer.outcome == "good" and gate.timings.upstream_errors == 2 and factor == 1.0
    assert gate.ended_by_reason[("error", "upstream_error")] == 1
    assert gate.ended_by_reason[("error", "upstream_timeout")] == 1


class _Quitter(_Flaky):
    """Says its run stopped though nobody asked."""

    abilities = Abilities(cancel=True)

    def run(self, prompt, max_new_tokens, stop, cancel=None):
        return EngineResult("", 0, 0.001, stopped=True)


def test_a_run_stopped_unasked_is_an_engine_error():
    async def go():
        async with Gate([_Quitter()], gate_config(PRESETS["none"], model=MODEL)) as gate:
            with pytest.raises(EngineFailed, match="stopped the run unasked"):
                await gate.submit(Job("x", 2))
            return gate.stats()

    stats = asyncio.run(go())
    assert stats["counts"]["error"] == 1 and stats["in_service"] == 0


# ---------------------------------------------------------------------- coroutine engines (arun: a
# task on the loop)


class _Steered:
    """A coroutine engine whose runs end when the test says: each run waits on its own
    asyncio.Event."""

    max_new_tokens_limit = None
    abilities = Abilities(emit=True, coroutine=True)

    def __init__(self) -> None:
        self.runs: list[tuple[str, asyncio.Event]] = []  # (prompt, its release)
        self.ended: list[str] = []  # prompt and how: "done", "failed" or "cancelled"
        self.closed = False

    async def arun(self, prompt, max_new_tokens, stop=None, emit=None):
        release = asyncio.Event()
        self.runs.append((prompt, release))
        try:
            for i in range(max_new_tokens):
                if emit is not None:
                    emit(f"<{i}>")
            await release.wait()
        except asyncio.CancelledError:
            self.ended.append(f"{prompt} cancelled")
            raise
        if prompt == "fail":
            self.ended.append(f"{prompt} failed")
            raise RuntimeError("boom")
        self.ended.append(f"{prompt} done")
        return EngineResult("x" * max_new_tokens, max_new_tokens, 0.01)

    async def aclose(self) -> None:
        self.closed = True

    def count_tokens(self, text):
        return len(text)

    def warmup(self):
        pass

    def info(self):
        return {"engine": "steered"}


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_coroutine_engine_runs_as_a_task_on_the_loop_in_queue_order():
    import threading

    async def go():
        engine, before = _Steered(), threading.active_count()
        async with Gate([engine], gate_config(PRESETS["none"], model=MODEL)) as gate:
            first, second = gate.submit(Job("a", 3)), gate.submit(Job("b", 2))
            await _turns()
            # one at a time, b waits
            assert [p for p, _ in engine.runs] == ["a"] and gate.waiting == 1
            assert threading.active_count() == before  # no engine thread
            engine.runs[0][1].set()
            answer = await first
            await _turns()
            engine.runs[1][1].set()
            return engine, answer, await second, gate.stats()

    engine, a, b, stats = asyncio.run(go())
    assert (a.text, a.tokens, b.text) == ("xxx", 3, "xx") and engine.ended == ["a done", "b done"]
    assert stats["counts"]["good"] == 2 and engine.closed  # the gate's aclose let the engine close


def test_a_coroutine_engine_failure_is_an_engine_error_and_the_engine_serves_on():
    async def go():
        engine = _Steered()
        async with Gate([engine], gate_config(PRESETS["none"], model=MODEL)) as gate:
            failing, after = gate.submit(Job("fail", 1)), gate.submit(Job("ok", 1))
            await _turns()
            engine.runs[0][1].set()
            with pytest.raises(EngineFailed, match="boom"):
                await failing
            await _turns()
            engine.runs[1][1].set()
            return (await after).outcome, gate.stats()

    outcome, stats = asyncio.run(go())
    assert outcome == "good" and stats["counts"]["error"] == 1 and stats["in_service"] == 0


def test_a_client_leaving_cancels_a_coroutine_engines_task_and_frees_it():
    async def go():
        engine = _Steered()
        async with Gate([engine], gate_config(PRESETS["none"], model=MODEL)) as gate:
            leaving, next_one = gate.submit(Job("gone", 1)), gate.submit(Job("next", 1))
            await _turns()
            leaving.cancel()  # its client hung up while it ran
            await _turns()
            assert engine.ended == ["gone cancelled"] and [p for p, _ in engine.runs] == [
                "gone",
                "next",
            ]
            engine.runs[1][1].set()
            return (await next_one).outcome, gate.stats()

    outcome, stats = asyncio.run(go())
    assert outcome == "good" and stats["cancelled"] == 1 and stats["counts"]["error"] == 0


def test_a_coroutine_engine_streams_its_pieces_straight_into_the_queue():
    async def go():
        engine = _Steered()
        async with Gate([engine], gate_config(PRESETS["none"], model=MODEL)) as gate:
            streamed = gate.submit_streaming(Job("s", 3))
            await _turns()
            engine.runs[0][1].set()
            await streamed.future
            pieces = []
            while (piece := await streamed.pieces.get()) is not END:
                pieces.append(piece)
            return pieces

    assert asyncio.run(go()) == ["<0>", "<1>", "<2>"]


def test_closing_the_gate_cancels_a_running_coroutine_engine():
    async def go():
        engine = _Steered()
        gate = Gate([engine], gate_config(PRESETS["none"], model=MODEL))
        gate.start()
        running = gate.submit(Job("r", 1))
        await _turns()
        await gate.aclose()
        await _turns()
        return engine, running

    engine, running = asyncio.run(go())
    assert running.cancelled() and engine.ended == ["r cancelled"] and engine.closed
