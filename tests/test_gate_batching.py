"""The batching gate (live.batching) and the simulator are two drivers of one batching core: request
by request, they agree.

On the virtual clock (tests/virtual_time.py) the real :func:`live.gate.BatchGate` drives the real
:class:`live.batching.SyntheticBatchEngine` (a task on the loop whose steps take the step model's
time), and ``simulate()`` runs the same trace through the same :class:`qsim.config.ServerConfig`:
outcome, reason, start, finish, time to first token and tokens must agree, under several policies,
with KV blocks that bind (preemption), step noise, clients that leave, a speed change and cuts at
the deadline. Then the live pieces: the faults, the one-line refusals of ``qlab serve``, and a real
HTTP server with ``--batching``.
"""

import asyncio
import dataclasses
import json

import numpy as np
import pytest

from live.batching import StepWork, SyntheticBatchEngine
from live.engine import NO_ABILITIES, Faults
from live.gate import BatchGate, gate_config
from live.gate_errors import EngineFailed
from live.jobs import Job
from qsim import PRESETS, make_trace, simulate
from qsim.config import ServerConfig
from qsim.engines import Batching, StepModel
from qsim.service import SpeedSchedule
from qsim.mixes import Prompts
from virtual_time import on_virtual_clock, run_gate

STEP = StepModel(0.01, 0.0001, 0.0002, 0.000001)
ENGINE = Batching(STEP, max_num_seqs=8, max_num_batched_tokens=256)
#: So little KV memory that a full batch does not fit: the newest running are preempted (recompute).
TIGHT = Batching(STEP, max_num_seqs=8, max_num_batched_tokens=256, kv_blocks=40, block_size=16)
PROMPTS = Prompts.parse("uniform:10:200")


def _trace(engine: Batching, load: float, seed: int, seconds: float = 20.0, **options):
    return make_trace(
        "poisson",
        "mix",
        load=load,
        engines=1,
        seconds=seconds,
        seed=seed,
        prompts=PROMPTS,
        capacity_rps=engine.capacity_rps(PROMPTS.mean(), 28.0),
        **options,
    )


def _agree(trace, config: ServerConfig, **inputs):
    """Outcome, reason, start, finish, first token, tokens and the admission view agree; /stats'
    counts too."""
    gate, stats = run_gate(trace, None, 1, config=config, **inputs)
    sim = simulate(trace, config, **inputs)
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    assert gate["reason"].fillna("-").tolist() == sim["reason"].fillna("-").tolist()
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-9)
    # a client that left does not hear when it joined
    known = gate["outcome"].ne("abandoned").to_numpy()
    np.testing.assert_allclose(
        gate.loc[known, "start_s"], sim.loc[known, "start_s"], rtol=0, atol=1e-9
    )
    answered = sim["outcome"].isin(["good", "late"]).to_numpy()
    np.testing.assert_allclose(
        gate.loc[answered, "first_token_s"] - gate.loc[answered, "arrival_s"],
        sim.loc[answered, "ttft_s"],
        rtol=0,
        atol=1e-9,
    )
    np.testing.assert_array_equal(gate.loc[answered, "tokens"], sim.loc[answered, "output_tokens"])
    seen = gate["queued"].ge(0).to_numpy()
    np.testing.assert_array_equal(
        gate.loc[seen, "queued"], sim.loc[seen, "queued_at_arrival"].astype(int)
    )
    np.testing.assert_allclose(
        gate.loc[seen, "est_service_s"], sim.loc[seen, "est_service_s"], rtol=0, atol=1e-9
    )
    counts = sim["outcome"].value_counts()
    assert {k: v for k, v in stats["counts"].items() if v} == {k: int(v) for k, v in counts.items()}
    assert stats["waiting"] == 0 and stats["in_service"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["batching"]["steps"] > 0 and stats["server_config"]["engine"]["kind"] == "batching"
    return sim


@pytest.mark.parametrize("policy", ["none", "bounded", "predictive", "bounded-deadline"])
def test_the_batching_gate_matches_the_simulator_request_by_request(policy):
    sim = _agree(_trace(ENGINE, 1.5, seed=3), ServerConfig(PRESETS[policy], engine=ENGINE))
    assert len(sim) > 400
    assert sim["ttft_s"].notna().sum() > 100


@pytest.mark.parametrize("policy", ["none", "predictive", "predictive-kv"])
def test_kv_blocks_that_bind_preempt_alike(policy):
    sim = _agree(_trace(TIGHT, 1.2, seed=5), ServerConfig(PRESETS[policy], engine=TIGHT))
    assert sim["preemptions"].max() >= 1 and (sim["preemptions"] > 0).sum() >= 5


def test_noisy_steps_are_the_simulators_draws():
    noisy = Batching(
        StepModel(STEP.b0, STEP.b1, STEP.b2, STEP.b3, cv=0.4),
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )
    _agree(_trace(noisy, 1.3, seed=6), ServerConfig(PRESETS["predictive"], engine=noisy, seed=11))


def test_cuts_at_the_deadline_match_the_simulator():
    policy = PRESETS["none"].with_args({"cancel_at_deadline": True}).with_overrides(deadline_s=1.5)
    sim = _agree(_trace(TIGHT, 1.5, seed=7), ServerConfig(policy, engine=TIGHT))
    cut = sim[sim["outcome"].eq("cancelled")]
    assert len(cut) >= 5 and cut["reason"].eq("deadline_passed").all()
    assert not sim["outcome"].eq("late").any()


def test_clients_that_leave_and_a_speed_change_match_the_simulator():
    trace = _trace(ENGINE, 1.0, seed=8)
    # every fourth leaves after 0.4 s
    patience = np.where(np.arange(len(trace)) % 4 == 0, 0.4, np.inf)
    sim = _agree(
        trace,
        ServerConfig(PRESETS["predictive"], engine=ENGINE),
        cancel_after_s=patience,
        speed_schedule=SpeedSchedule(1.0, ((8.0, 2.0),)),
    )
    left = sim[sim["outcome"].eq("abandoned")]
    assert len(left) >= 5 and left["start_s"].notna().any()  # some left from the batch


def test_a_runs_own_steps_replayed_give_its_rows():
    """qlab compare's replay of a batching run: simulate(step_times=) takes each step's time from
    the gate's step log (stats' step_log), in order; the simulator's own noise (another seed here)
    then plays no part."""
    noisy = Batching(
        StepModel(STEP.b0, STEP.b1, STEP.b2, STEP.b3, cv=0.5),
        max_num_seqs=8,
        max_num_batched_tokens=256,
        kv_blocks=40,
        block_size=16,
    )
    trace = _trace(noisy, 1.4, seed=9)
    config = ServerConfig(
        PRESETS["predictive"].with_args({"cancel_at_deadline": True}), engine=noisy, seed=3
    )
    gate, stats = run_gate(trace, None, 1, config=config)
    log = stats["step_log"]
    assert len(log) == stats["batching"]["steps"] > 100
    times = [(began - woken, ended - began, engine) for woken, began, ended, engine, *_ in log]
    replayed = simulate(trace, config.replace(seed=4), step_times=times)
    assert gate["outcome"].tolist() == replayed["outcome"].tolist()
    np.testing.assert_allclose(gate["finish_s"], replayed["finish_s"], rtol=0, atol=1e-9)
    assert (
        replayed["outcome"].value_counts().get("cancelled", 0) >= 3
        and replayed["preemptions"].max() >= 1
    )
    own = simulate(trace, config.replace(seed=4))  # its own draws: another run
    assert own["finish_s"].tolist() != replayed["finish_s"].tolist()
    with pytest.raises(ValueError, match="step_times are a batching engine's"):
        simulate(trace, PRESETS["none"], step_times=times)


class _Refits:
    """A batching engine that, as a learner does, hands the gate a new step model with some steps:
    ``refits`` maps a step's number (from 0) to the model."""

    def __init__(self, engine, refits: dict) -> None:
        self.engine, self.refits, self.steps = engine, refits, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def astep(self, work: StepWork):
        done = await self.engine.astep(work)
        k, self.steps = self.steps, self.steps + 1
        return dataclasses.replace(done, step_model=self.refits[k]) if k in self.refits else done


def test_a_step_model_the_gate_took_mid_run_is_replayed_where_it_took_it():
    """A learner's refit changes the model the gate plans and admits with from the next step on: the
    step log's pages say after which step (step_models), the run file keeps it, and the replay
    takes it there (qsim.runfile.batch_step_times); without it, the replay parts from the run."""
    import pandas as pd

    from qsim.runfile import batch_step_columns, batch_step_times

    trace = _trace(ENGINE, 1.4, seed=12)
    config = ServerConfig(PRESETS["predictive"], engine=ENGINE)
    slower = StepModel(4 * STEP.b0, 2 * STEP.b1, 4 * STEP.b2, STEP.b3)
    refits = {150: slower, 400: STEP}
    gate, stats = run_gate(
        trace, None, 1, config=config, wrap_engine=lambda engine: _Refits(engine, refits)
    )
    models = stats["step_models"]
    assert [m[0] for m in models] == [151, 401]  # each after the step it came with
    assert stats["server_config"]["engine"]["step"]["b0"] == STEP.b0
    run = pd.DataFrame(batch_step_columns(stats["step_log"], 1, models))
    times = batch_step_times(run)
    assert [k for k, t in enumerate(times) if t[3] is not None] == [150, 400]
    replayed = simulate(trace, config, step_times=times)
    assert gate["outcome"].tolist() == replayed["outcome"].tolist()
    assert gate["reason"].fillna("-").tolist() == replayed["reason"].fillna("-").tolist()
    np.testing.assert_allclose(gate["finish_s"], replayed["finish_s"], rtol=0, atol=1e-9)
    seen = gate["queued"].ge(0).to_numpy()
    np.testing.assert_allclose(
        gate.loc[seen, "est_service_s"], replayed.loc[seen, "est_service_s"], rtol=0, atol=1e-9
    )
    blind = simulate(trace, config, step_times=[t[:3] for t in times])
    moved = ~np.isclose(
        gate.loc[seen, "est_service_s"], blind.loc[seen, "est_service_s"], rtol=1e-6
    )
    assert moved.sum() >= 50  # the refits moved what the gate projected


def test_retrying_impatient_clients_match_the_simulator():
    """One Retrier for both drivers: each attempt, its outcome, reason and finish agree, by
    (request, attempt)."""
    from qsim import records
    from qsim.clients import Patience, RetryPolicy

    retry = RetryPolicy(
        "exponential", delay_s=0.2, cap_s=2.0, jitter=1.0, max_attempts=4, timeout_s=1.5
    )
    trace = _trace(TIGHT, 2.0, seed=10, seconds=12, patience=Patience.parse("exponential:2.5"))
    config = ServerConfig(PRESETS["bounded"].with_overrides(max_queue=4), engine=TIGHT)
    gate, _ = run_gate(trace, None, 1, config=config, retry=retry)
    sim = records.validate(simulate(trace, config, retry=retry))
    key = ["first_request_id", "attempt"]
    gate, sim = gate.sort_values(key, ignore_index=True), sim.sort_values(key, ignore_index=True)
    assert gate[key].values.tolist() == sim[key].values.tolist() and (sim["attempt"] > 1).sum() >= 5
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    assert gate["reason"].fillna("-").tolist() == sim["reason"].fillna("-").tolist()
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-9)


# ---------------------------------------------------------------- the live pieces


def _gate_run(engine, config, jobs):
    async def go():
        loop = asyncio.get_running_loop()
        async with BatchGate(engine(loop), config, clock=loop.time) as gate:
            answers = await asyncio.gather(
                *(gate.submit(job) for job in jobs), return_exceptions=True
            )
            return answers, gate.stats()

    return on_virtual_clock(go)


def test_the_synthetic_engines_fail_every_fails_every_nth_request_to_join():
    config = gate_config(PRESETS["none"], engine=ENGINE)
    engine = lambda loop: SyntheticBatchEngine(STEP, clock=loop.time, faults=Faults(fail_every=3))  # noqa: E731
    answers, stats = _gate_run(
        engine, config, [Job("x" * 20, 8, prompt_tokens=20) for _ in range(9)]
    )
    failed = [i for i, a in enumerate(answers) if isinstance(a, EngineFailed)]
    assert failed == [2, 5, 8]  # the 3rd, 6th and 9th to join (a burst joins in arrival order)
    assert all(
        a.tokens == 8 and a.text == " tok" * 8 for i, a in enumerate(answers) if i not in failed
    )
    assert (
        stats["counts"]["error"] == 3
        and stats["counts"]["good"] == 6
        and stats["kv_blocks_used"] == 0
    )


def test_a_streamed_request_gets_each_token_at_the_end_of_its_step():
    from live.jobs import END

    config = gate_config(PRESETS["none"], engine=ENGINE)

    async def go():
        loop = asyncio.get_running_loop()
        async with BatchGate(
            SyntheticBatchEngine(STEP, clock=loop.time), config, clock=loop.time
        ) as gate:
            # a long prompt: two steps of prefill
            plain = gate.submit(Job("x" * 300, 3, prompt_tokens=300))
            streams = [
                gate.submit_streaming(Job("y" * 40, 6, ("tok tok tok tok tok",), prompt_tokens=40)),
                gate.submit_streaming(Job("z" * 20, 4, prompt_tokens=20)),
            ]

            async def read(streamed):
                pieces = []  # each piece, and when it came
                while (piece := await streamed.pieces.get()) is not END:
                    pieces.append((piece, loop.time()))
                return pieces, streamed.future.result()

            return await asyncio.gather(*map(read, streams)), await plain

    (cut, whole), plain = on_virtual_clock(go)
    assert plain.text == " tok" * 3
    pieces, answer = whole
    assert "".join(p for p, _ in pieces) == answer.text == " tok" * 4 and len(pieces) == 4
    # One token a step from the step that completed its prompt: the first at its first token.
    assert pieces[0][1] == pytest.approx(answer.started_at + answer.first_token_s, abs=1e-12)
    assert len({t for _, t in pieces}) == 4 and pieces[-1][1] <= answer.returned_at
    # a stop string cuts the text, not the work: the pieces joined are the cut text
    pieces, answer = cut
    assert "".join(p for p, _ in pieces) == answer.text == " " and answer.tokens == 6


def test_a_cut_timer_that_fires_early_waits_for_the_deadline():
    """uvloop's clock is libuv's, cached a loop turn: a timer set from it can fire before the gate's
    clock reaches the deadline. The cut waits on (freeing its blocks early would let the next
    request join a step before the simulator's core would)."""
    from live.gate_errors import DeadlineCut

    policy = PRESETS["none"].with_args({"cancel_at_deadline": True}).with_overrides(deadline_s=0.05)
    ahead = [0.002]  # how far the gate's clock reads ahead of the loop's

    async def go():
        loop = asyncio.get_running_loop()
        gate = BatchGate(
            SyntheticBatchEngine(STEP, clock=loop.time),
            gate_config(policy, engine=ENGINE),
            clock=lambda: loop.time() + ahead[0],
        )
        async with gate:
            # due at 0.052 on the gate's clock: the loop's 0.050
            cut = gate.submit(Job("x", 64, prompt_tokens=1))
            # the gate's clock falls back onto the loop's: the timer comes 2 ms early
            ahead[0] = 0.0
            with pytest.raises(DeadlineCut) as caught:
                await cut
            return caught.value.numbers, loop.time()

    numbers, seen = on_virtual_clock(go)
    assert numbers["at"] == pytest.approx(0.052, abs=1e-12) and seen >= 0.052 - 1e-12


def test_the_engine_is_told_each_chunk_of_a_prompt_from_where_it_starts():
    class Recording(SyntheticBatchEngine):
        def __init__(self, clock):
            super().__init__(STEP, clock=clock)
            self.chunks = []  # (prompt, start, tokens) of each step's chunks

        async def astep(self, work: StepWork):
            self.chunks += [(c.job.prompt, c.start, c.tokens) for c in work.prefill]
            return await super().astep(work)

    # 600 prompt tokens in steps of 256: three chunks; 4 KV blocks of 256 tokens hold one such
    # request, not two (the second to join is preempted, and computes its prompt again from its
    # start).
    engine = Batching(STEP, max_num_seqs=4, max_num_batched_tokens=256, kv_blocks=4, block_size=256)
    config = gate_config(PRESETS["none"].with_overrides(deadline_s=30.0), engine=engine)
    recording = []

    async def go():
        loop = asyncio.get_running_loop()
        recording.append(Recording(loop.time))
        async with BatchGate(recording[0], config, clock=loop.time) as gate:
            return await asyncio.gather(
                *(gate.submit(Job(name, 300, prompt_tokens=600)) for name in "ab")
            )

    answers = on_virtual_clock(go)
    assert [a.tokens for a in answers] == [300, 300]
    chunks = recording[0].chunks
    assert [c for c in chunks if c[0] == "a"][:3] == [
        ("a", 0, 256),
        ("a", 256, 256),
        ("a", 512, 88),
    ]
    b = [c for c in chunks if c[0] == "b"]
    assert [start for _, start, _ in b].count(0) >= 2  # b started over after its preemption
    assert all(start + tokens <= 600 + 300 for _, start, tokens in b)


def test_a_hung_step_holds_the_whole_batch_for_its_time():
    config = gate_config(PRESETS["none"], engine=ENGINE)
    engine = lambda loop: SyntheticBatchEngine(  # noqa: E731
        STEP, clock=loop.time, faults=Faults(hang_after=0, hang_s=2.0)
    )
    answers, _ = _gate_run(engine, config, [Job("x", 4, prompt_tokens=1) for _ in range(3)])
    # past the 1 s deadline: the hang
    assert all(a.outcome == "late" and a.returned_at > 2.0 for a in answers)


def test_a_step_that_raises_fails_the_requests_in_it_and_the_engine_goes_on():
    class Once(SyntheticBatchEngine):
        async def astep(self, work: StepWork):
            if self.steps == 0:
                self.steps += 1
                raise RuntimeError("a broken step")
            return await super().astep(work)

    config = gate_config(PRESETS["none"], engine=ENGINE)
    answers, stats = _gate_run(
        lambda loop: Once(STEP, clock=loop.time),
        config,
        [Job("x", 4, prompt_tokens=1) for _ in range(2)],
    )
    assert all(isinstance(a, EngineFailed) for a in answers)
    assert stats["counts"]["error"] == 2

    async def after():
        loop = asyncio.get_running_loop()
        async with BatchGate(Once(STEP, clock=loop.time), config, clock=loop.time) as gate:
            with pytest.raises(EngineFailed):
                await gate.submit(Job("x", 4, prompt_tokens=1))
            return await gate.submit(Job("x", 4, prompt_tokens=1))

    assert on_virtual_clock(after).outcome == "good"


def test_an_engine_with_a_blocking_step_runs_on_a_thread_of_its_own():
    import threading

    from live.batching import StepDone

    class Blocking(SyntheticBatchEngine):
        abilities = NO_ABILITIES  # a blocking step, not a coroutine: the gate runs it on a thread

        def __init__(self):
            super().__init__(STEP)
            self.threads = set()

        def step(self, work: StepWork) -> StepDone:
            self.threads.add(threading.current_thread().name)
            return StepDone(STEP.time(work.prefill_tokens, work.sampling, work.context))

    engine = Blocking()

    async def go():
        async with BatchGate(engine, gate_config(PRESETS["none"], engine=ENGINE)) as gate:
            return await asyncio.gather(
                *(gate.submit(Job("x" * 9, 5, prompt_tokens=9)) for _ in range(12))
            )

    answers = asyncio.run(go())
    # Answered (good or late: the real clock of a busy machine decides which), each after its 5
    # tokens.
    assert all(
        a.outcome in ("good", "late") and a.tokens == 5 and a.text == " tok" * 5 for a in answers
    )
    assert engine.threads == {"qlab-batch-engine"}


def test_a_refusal_keeps_the_cores_reason():
    from live.gate_errors import NeverInTime, Rejected

    # 512 tokens: far past the 2 s deadline at the gate's service line (8.5 ms a token), inside it
    # at 2.1 ms a step for the batch; the core projects the batch, and its refusal (a tighter
    # deadline) keeps its own reason.
    fast = StepModel(0.002, 0.0, 0.0001, 0.0)
    config = gate_config(
        PRESETS["predictive"], engine=Batching(fast, max_num_seqs=8, max_num_batched_tokens=256)
    )

    async def go():
        loop = asyncio.get_running_loop()
        async with BatchGate(
            SyntheticBatchEngine(fast, clock=loop.time), config, clock=loop.time
        ) as gate:
            first = gate.submit(Job("x", 512, prompt_tokens=1))
            with pytest.raises(Rejected) as refused:
                gate.submit(Job("x", 512, prompt_tokens=1, deadline_s=1.0))
            return await first, refused.value

    answer, refused = on_virtual_clock(go)
    assert answer.outcome == "good" and answer.tokens == 512
    assert (
        not isinstance(refused, NeverInTime) and refused.rejection.reason == "deadline_unreachable"
    )


def test_the_batching_gate_refuses_what_it_cannot_run():
    from live.engine import SyntheticEngine
    from live.gate import Gate

    with pytest.raises(ValueError, match="runs steps"):
        BatchGate(SyntheticEngine(), gate_config(PRESETS["none"], engine=ENGINE))
    with pytest.raises(ValueError, match="batching engine"):
        BatchGate(SyntheticBatchEngine(), gate_config(PRESETS["none"]))
    with pytest.raises(ValueError, match="runs steps"):
        Gate([SyntheticEngine()], gate_config(PRESETS["none"], engine=ENGINE))


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--step", "0.01,0,0,0"], "--step is a batching engine's: add --batching"),
        (["--batching", "--engines", "2"], "--batching runs one batching engine"),
        (["--batching", "--noise", "0.3", "--step", "0.01,0,0,0,0.2"], "--noise and --step's CV"),
        (["--batching", "--early-stops"], "--early-stops"),
        (["--batching", "--hang-after", "3"], "--hang-for"),
        (
            ["--batching", "--engine", "upstream", "--upstream-url", "http://127.0.0.1:9"],
            "cannot reach the upstream",
        ),
        (["--batching", "--stall-after", "3"], "stall"),
        (["--batching", "--step", "1,2"], "step model"),
        (
            ["--batching", "--max-num-seqs", "64", "--max-num-batched-tokens", "32"],
            "max_num_batched_tokens",
        ),
    ],
)
def test_qlab_serve_refuses_a_bad_batching_combination_in_one_line(capsys, argv, says):
    from experiments.cli import main

    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_noise_with_batching_is_the_step_models_cv():
    from live.serve_options import ServeOptions

    engine = ServeOptions(batching=True, noise=0.3, step="0.01,0,0.001,0").engine_model()
    assert engine.step == StepModel(0.01, 0.0, 0.001, 0.0, cv=0.3)
    assert ServeOptions(
        batching=True, max_num_seqs=4, max_num_batched_tokens=64
    ).engine_model() == Batching(max_num_seqs=4, max_num_batched_tokens=64)
    assert ServeOptions().engine_model() is None


def test_a_live_files_server_table_takes_the_batching_settings(tmp_path):
    from inputs.tomlfiles import ConfigError
    from live import live_config
    from live.serve_options import ServeOptions

    path = tmp_path / "live.toml"
    trace = "policies = ['bounded']\n[[trace]]\nname = 'a'\nseconds = 1\n"
    path.write_text("[server]\nbatching = true\nstep = '0.01,0,0.0002,0'\nkv_blocks = 40\n" + trace)
    server = live_config.load(path).server
    assert server == ServeOptions(batching=True, step="0.01,0,0.0002,0", kv_blocks=40)
    assert server.engine_model() == Batching(StepModel(0.01, 0.0, 0.0002, 0.0), kv_blocks=40)
    # a child server gets them
    assert "--batching" in server.argv() and "--kv-blocks" in server.argv()
    path.write_text("[server]\nbatching = true\nengines = 2\n" + trace)
    with pytest.raises(ConfigError, match="--batching runs one batching engine"):
        live_config.load(path)


@pytest.mark.slow  # a server process: a few seconds
def test_qlab_serve_batching_answers_over_http(tmp_path):
    import httpx

    from live.procs import serving
    from live.serve_options import ServeOptions

    options = ServeOptions(
        policy="bounded",
        max_queue=4,
        batching=True,
        step="0.02,0.0001,0.0005,0",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_blocks=16,
        block_size=8,
        port=0,
    )
    with serving([options], tmp_path, 60) as (server,):
        with httpx.Client(base_url=server.url, timeout=30) as client:

            async def burst():
                async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                    return await asyncio.gather(
                        *(
                            http.post(
                                "/v1/generate",
                                json={"prompt": "y" * (10 * i + 1), "max_new_tokens": 8},
                            )
                            for i in range(12)
                        )
                    )

            responses = asyncio.run(burst())
            model = client.get("/v1/models").json()["data"][0]["id"]
            with client.stream(
                "POST",
                "/v1/completions",
                json={"model": model, "prompt": "hello", "max_tokens": 5, "stream": True},
            ) as streamed:
                events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
            stats = client.get("/stats").json()
            metrics = client.get("/metrics").text
    assert {r.status_code for r in responses} <= {200, 503}
    answered = [r.json() for r in responses if r.status_code == 200]
    refused = [r.json()["error"] for r in responses if r.status_code == 503]
    assert len(answered) >= 4 and all(a["tokens"] == 8 for a in answered)
    assert all(e["type"] == "overloaded" for e in refused)
    assert streamed.status_code == 200 and events[-1] == "data: [DONE]"
    texts = [
        json.loads(e[6:])["choices"][0]["text"] for e in events[:-1] if json.loads(e[6:])["choices"]
    ]
    # a piece per token, each as its step ended
    assert "".join(texts) == " tok" * 5 and texts.count(" tok") == 5
    assert stats["submitted"] == 13 and sum(stats["counts"].values()) == 13
    assert stats["server_config"]["engine"]["kind"] == "batching" and stats["batching"]["steps"] > 0
    assert stats["engine"]["batching"] is True and stats["kv_blocks_used"] == 0
    assert "qlab_kv_blocks_used 0.0" in metrics and "qlab_kv_cache_usage 0.0" in metrics
    # qlab replay records the server's steps; qlab compare replays the run with them, request by
    # request.
    from analysis.compare import compare
    from live.loadgen import ReplayConfig, replay
    from qsim.runfile import batch_step_times

    with serving([options], tmp_path, 60) as (server,):
        run = replay(make_trace("poisson", load=3.0, seconds=5, seed=5), ReplayConfig(server.url))
    steps = batch_step_times(run)
    assert len(steps) > 50 and all(wait >= 0 and ran > 0 for wait, ran, _, _ in steps)
    summary = compare(run).summary
    assert summary["live_errors"] == 0 and summary["disagreement_rate"] <= 0.02
