"""The upstream engine in front of a batching server (live/upstream_batch.py).

* the step learner on chunk times drawn from a known step model (a simulated batching server,
  seeded: exact and fast): the bursts are read as its steps and the fit lands on its coefficients;
* the core's hook for a request an engine ends early (qsim.batch.BatchQueue.finish);
* slow: a real ``qlab serve --batching`` (the synthetic batching engine, a known ``--step``) as the
  upstream of a ``qlab serve --engine upstream --batching`` gate, over real HTTP: the gate reads the
  upstream's batch limit, forwards up to it, learns the step model, and plans with it (``/stats``).
  The precise recovery measured on this machine is in docs/live.md; here, its structure and loose
  bounds.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from live.upstream_batch import StepLearner, Timeline, gaps_of
from qsim import Policy, ServerConfig
from qsim.batch import BatchQueue
from qsim.engines import Batching, StepModel
from qsim.entry import Work

TRUE = StepModel(b0=0.02, b1=0.0001, b2=0.002, b3=0.0)


def _served(
    model: StepModel,
    seed: int,
    requests: int = 300,
    seats: int = 8,
    rate: float = 6.0,
    jitter_s: float = 0.0005,
    hold: float = 0.0,
) -> list[Timeline]:
    """The chunk times a batching server with this step model gives its answers: Poisson arrivals
    joining at step boundaries (at most ``seats`` running), each step as long as the model says (x a
    gamma draw of CV 0.05), its tokens read by the gate up to ``jitter_s`` after its end; prompts of
    20 to 200 tokens, 4 to 64 new tokens. ``hold``: the chance that a step's tokens are not written
    at its end but with the next step's, as a loaded vLLM's API server writes several steps' tokens
    in one chunk (the batch's last step is always written)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, requests))
    prompts = rng.integers(20, 200, requests)
    outs = rng.choice([4, 16, 64], requests)
    timelines = [Timeline(int(p)) for p in prompts]
    made, held = np.zeros(requests, int), np.zeros(requests, int)
    now, nxt, running, line = 0.0, 0, [], []
    while nxt < requests or running or line:
        while nxt < requests and arrivals[nxt] <= now:
            line.append(nxt)
            nxt += 1
        if not running and not line:
            now = arrivals[nxt]
            continue
        joining = []
        while line and len(running) + len(joining) < seats:
            joining.append(line.pop(0))
        batch = running + joining
        context = sum(prompts[i] + made[i] + 1 for i in batch)
        step = model.time(
            float(prompts[joining].sum()) if joining else 0.0, len(batch), float(context)
        )
        now += step * rng.gamma(400.0, 1 / 400.0)
        made[batch] += 1
        held[batch] += 1
        running = [i for i in batch if made[i] < outs[i]]
        if not (hold and running and rng.random() < hold):
            for i in np.flatnonzero(held):
                timelines[i].times.append(now + rng.uniform(0, jitter_s))
                timelines[i].tokens.append(int(held[i]))
            held[:] = 0
    return timelines


def test_the_learner_reads_a_batching_servers_steps_off_its_chunk_times():
    timelines = _served(TRUE, seed=3)
    gaps = gaps_of(timelines)
    assert len(gaps) > 1000 and set(np.unique(gaps.seqs)) == set(range(1, 9))
    learner = StepLearner(StepModel(), refit_every=1)
    learner.timelines.extend(timelines)
    learner._since_fit = 1
    fitted = learner.checkpoint()
    assert fitted is not None and learner.refits == 1 and learner.model is fitted
    # Seeded: the same draws every run, so these bounds hold or fail the same way everywhere.
    assert fitted.b0 == pytest.approx(TRUE.b0, rel=0.05)
    assert fitted.b1 == pytest.approx(TRUE.b1, rel=0.15)
    assert fitted.b2 == pytest.approx(TRUE.b2, rel=0.15)
    assert fitted.b3 < 2e-6 and 0 < fitted.cv < 0.2


def test_the_learner_reads_chunks_of_several_steps_tokens_as_those_steps():
    # Half the steps' tokens come with the next step's (a loaded vLLM's API server): each chunk of k
    # tokens stands for k steps, and the fit still lands on the server's coefficients.
    timelines = _served(TRUE, seed=3, hold=0.5)
    assert max(max(t.tokens) for t in timelines) >= 3
    learner = StepLearner(StepModel(), refit_every=1)
    learner.timelines.extend(timelines)
    learner._since_fit = 1
    fitted = learner.checkpoint()
    assert fitted is not None and len(gaps_of(timelines)) > 500
    assert fitted.b0 == pytest.approx(TRUE.b0, rel=0.1)
    assert fitted.b1 == pytest.approx(TRUE.b1, rel=0.3)
    assert fitted.b2 == pytest.approx(TRUE.b2, rel=0.2)
    assert fitted.b3 < 5e-6


def test_gaps_that_span_more_than_a_step_or_an_idle_server_are_left_out():
    # One answer alone, a step every 10 ms, then a pause of 1 s (a hang), then a step: the pause is
    # no step.
    alone = Timeline(10, [0.01, 0.02, 0.03, 1.03, 1.04])
    assert sorted(gaps_of([alone]).seconds.round(6).tolist()) == [0.01, 0.01, 0.01]
    # A burst after an idle server (nobody had a chunk in the burst before it) is no step either.
    after_idle = [Timeline(10, [0.01, 0.02]), Timeline(10, [2.0, 2.01])]
    assert sorted(gaps_of(after_idle).seconds.round(6).tolist()) == [0.01, 0.01]
    # An answer whose usage said more tokens than it had chunks (several tokens a chunk) is not read
    # at all.
    learner = StepLearner(StepModel())
    timeline = learner.started(10)
    for t in (0.0, 0.01, 0.02):
        learner.chunk(timeline, t)
    learner.ended(timeline, tokens=6)
    assert len(gaps_of(list(learner.timelines))) == 0


def test_no_fit_replaces_the_model_before_two_batch_sizes_are_seen():
    learner = StepLearner(StepModel(), refit_every=2, min_gaps=2)
    timeline = learner.started(5)
    for t in np.arange(1, 40) * 0.01:
        learner.chunk(timeline, float(t))
    assert learner.checkpoint() is None and learner.model == StepModel()
    assert "1 batch size(s)" in learner.info()["kept"]


def test_the_core_finishes_a_request_its_engine_ended_early():
    engine = Batching(
        StepModel(0.01, 0.0, 0.001, 0.0), max_num_seqs=4, kv_blocks=100, block_size=16
    )
    ended, steps = [], []
    config = ServerConfig(policy=Policy(name="none"), engine=engine)
    queue = BatchQueue(
        config,
        step=lambda plan, now: steps.append(plan),
        drop=lambda *a: None,
        end=lambda req, now, outcome, reason, stats: ended.append(
            (req, now, outcome, stats.tokens)
        ),
        members=True,
    )
    for name in ("a", "b"):
        assert queue.arrive(name, 0.0, 0.1, work=Work(10, 20, None)) is None
    now = 0.0
    for _ in range(3):  # a prompt step, then two decode steps
        now += steps[-1].model_s
        queue.step_done(now)
    assert queue.finish("a", now, 3) is True and ended == [("a", now, "good", 3)]
    queue.audit()  # its blocks are free, the batch's aggregates hold
    assert queue.in_service == 1 and queue.finish("a", now, 3) is False
    while queue.plan is not None:
        now += queue.plan.model_s
        queue.step_done(now)
    assert ended[-1][0] == "b" and ended[-1][3] == 10 and math.isfinite(now)


@pytest.mark.slow
@pytest.mark.alone  # the learner times a real server's steps: another test beside it blurs them
def test_a_gate_in_front_of_a_batching_qlab_serve_learns_its_step_model(tmp_path):
    """Real processes, real HTTP: the upstream is ``qlab serve --batching --step
    0.02,0.0001,0.002,0`` with 8 seats; the gate, ``--engine upstream --batching`` under predictive,
    is told neither (it reads the seats from the upstream's /stats and starts from the default step
    model)."""
    httpx = pytest.importorskip("httpx")
    from live.loadgen import ReplayConfig, replay
    from live.procs import serving
    from live.serve_options import ServeOptions
    from qsim import from_arrays

    upstream = ServeOptions(
        policy="none", batching=True, step="0.02,0.0001,0.002,0", max_num_seqs=8
    )
    with serving([upstream], tmp_path / "up") as (up,):
        gate_options = ServeOptions(
            policy="predictive", engine="upstream", upstream_url=up.url, batching=True
        )
        with serving([gate_options], tmp_path / "gate") as (gate,):
            rng = np.random.default_rng(5)
            trace = from_arrays(
                np.cumsum(rng.exponential(1 / 5.0, 100)),
                rng.choice([4, 16, 64], 100),
                deadline_s=[30.0] * 100,
            )
            frame = replay(trace, ReplayConfig(gate.url))
            stats = httpx.get(gate.url + "/stats", timeout=10).json()
            up_stats = httpx.get(up.url + "/stats", timeout=10).json()
    # each ended, none failed
    assert len(frame) == 100 and set(frame["outcome"]) <= {"good", "late"}
    engine, in_use = stats["engine"], stats["server_config"]["engine"]
    # the upstream's own limit, read from it
    assert engine["max_num_seqs"] == in_use["max_num_seqs"] == 8
    # every request went up (and 2 probes)
    assert up_stats["counts"]["good"] + up_stats["counts"]["late"] >= 100
    learned = engine["learned"]
    assert learned["refits"] >= 1 and learned["kept"] is None
    assert in_use["step"] == learned["step"]  # the gate plans with what it learned
    step = learned["step"]
    # Loose: a busy 2-core machine adds its own milliseconds to every step it reads (docs/live.md
    # has the measured).
    assert 0.5 * 0.02 < step["b0"] < 2 * 0.02 and 0.25 * 0.002 < step["b2"] < 4 * 0.002
    assert step["b1"] < 10 * 0.0001 and step["b3"] < 1e-4


@pytest.mark.slow  # a scripted HTTP server on a thread
def test_answers_the_upstream_ends_early_finish_and_one_that_fails_mid_stream_fails_alone():
    import asyncio

    from test_upstream import _chunk, _sse, scripted

    from live.gate import BatchGate
    from live.gate import gate_config
    from live.gate_errors import UpstreamFailed
    from live.jobs import Job
    from live.upstream import UpstreamEngine, UpstreamSpec
    from live.upstream_batch import UpstreamBatchEngine
    from qsim import PRESETS

    def respond(conn, body):
        prompt = json.loads(body)["prompt"]
        if prompt == "short":  # end of text after 3 of its 6 tokens
            conn.sendall(_sse(*(_chunk("a") for _ in range(3)), _chunk("", usage=3)))
        elif prompt == "bad":  # two tokens, then the upstream fails
            conn.sendall(
                _sse(
                    _chunk("b"),
                    _chunk("b"),
                    {"error": {"message": "boom", "type": "server_error"}},
                    done=False,
                )
            )
        else:
            conn.sendall(_sse(*(_chunk("c") for _ in range(6)), _chunk("", usage=6)))

    async def go(url):
        forwarder = UpstreamEngine(UpstreamSpec(url, "m", 10.0), "m")
        engine = UpstreamBatchEngine(forwarder, 4, StepLearner(StepModel()))
        config = gate_config(PRESETS["none"], engine=Batching(StepModel(), max_num_seqs=4))
        async with BatchGate(engine, config) as gate:
            jobs = [Job(p, 6, prompt_tokens=len(p)) for p in ("short", "full", "bad")]
            answers = await asyncio.gather(
                *(gate.submit(job) for job in jobs), return_exceptions=True
            )
            return answers, gate.stats()

    with scripted(respond) as url:
        (short, full, bad), stats = asyncio.run(go(url))
    # finished at its last chunk
    assert (short.text, short.tokens, short.outcome) == ("aaa", 3, "good")
    assert (full.text, full.tokens) == ("cccccc", 6)
    assert isinstance(bad, UpstreamFailed) and "boom" in str(bad)
    assert (
        stats["counts"]["good"] == 2 and stats["counts"]["error"] == 1 and stats["in_service"] == 0
    )


@pytest.mark.slow  # a scripted HTTP server on a thread
def test_a_client_that_leaves_closes_its_upstream_stream_though_the_batch_goes_idle():
    import asyncio
    import threading

    from test_upstream import _chunk, scripted

    from live.gate import BatchGate
    from live.gate import gate_config
    from live.jobs import Job
    from live.upstream import UpstreamEngine, UpstreamSpec
    from live.upstream_batch import UpstreamBatchEngine
    from qsim import PRESETS

    sent, closed = threading.Event(), threading.Event()

    def respond(conn, body):  # one token, then nothing more until the gate hangs up
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        conn.sendall(head + f"data: {json.dumps(_chunk('a'))}\n\n".encode())
        sent.set()
        if conn.recv(1) == b"":
            closed.set()

    async def go(url):
        forwarder = UpstreamEngine(UpstreamSpec(url, "m", 30.0), "m")
        engine = UpstreamBatchEngine(forwarder, 4, StepLearner(StepModel()))
        config = gate_config(PRESETS["none"], engine=Batching(StepModel(), max_num_seqs=4))
        async with BatchGate(engine, config) as gate:
            future = gate.submit(Job("p", 8, prompt_tokens=1))
            await asyncio.get_running_loop().run_in_executor(None, sent.wait, 30)
            future.cancel()  # the client leaves; nothing else runs, so no step follows
            left = await asyncio.get_running_loop().run_in_executor(None, closed.wait, 30)
            return left, gate.stats()

    with scripted(respond) as url:
        left, stats = asyncio.run(go(url))
    assert left and stats["counts"]["abandoned"] == 1 and stats["in_service"] == 0


def _later(timelines: list[Timeline], offset_s: float) -> list[Timeline]:
    return [Timeline(t.prompt, [x + offset_s for x in t.times], t.tokens) for t in timelines]


def _feed(learner: StepLearner, model: StepModel, batches: range) -> list[StepModel | None]:
    """Each batch: a fresh stretch of the server's answers (after the ones before), then a
    checkpoint."""
    fitted = []
    for k in batches:
        learner.timelines.extend(_later(_served(model, seed=10 + k, requests=120), 1000.0 * k))
        learner._since_fit = learner.refit_every
        fitted.append(learner.checkpoint())
    return fitted


def test_the_learner_settles_inside_its_intervals_and_starts_again_when_the_server_drifts():
    learner = StepLearner(StepModel(), window=1500)
    fitted = _feed(learner, TRUE, range(6))
    # Seeded: the same draws every run. It fits until two fits in a row sit inside the intervals of
    # the one before, then stops: later checkpoints fit nothing.
    assert learner.converged and fitted[-1] is None and 2 <= learner.refits <= 5
    info = learner.info()
    assert info["converged"] and info["drifts"] == 0
    for name in ("b0", "b1", "b2"):
        low, high = info["intervals"][name]
        assert low <= getattr(TRUE, name) <= high, (name, low, high)
    refits = learner.refits
    # The server slows to twice its step: the settled model is now off by half, and the fits begin
    # again. (So slow, the server's 8 seats are full nearly always: its b0 and b2 cannot be told
    # apart, but a full batch's step can.)
    slow = StepModel(b0=2 * TRUE.b0, b1=2 * TRUE.b1, b2=2 * TRUE.b2)
    _feed(learner, slow, range(6, 10))
    assert learner.drifts == 1 and learner.refits > refits
    full = (0.0, 8, 8 * 150.0)
    assert learner.model.time(*full) == pytest.approx(slow.time(*full), rel=0.05)


def test_a_fit_is_inside_another_where_each_coefficient_is_within_its_interval():
    from live.upstream_batch import inside
    from qsim.engines import StepFit

    fit = StepFit(
        StepModel(b0=0.02, b1=0.0001, b2=0.002),
        0.05,
        0.2,
        0.05,
        100,
        0.95,
        (0.001, 1e-5, 1e-4, float("nan")),
    )
    assert inside(StepModel(b0=0.0215, b1=0.0001, b2=0.002), fit)
    assert not inside(StepModel(b0=0.0225, b1=0.0001, b2=0.002), fit)  # 2.5 standard errors off
    # a term it could not tell
    assert not inside(StepModel(b0=0.02, b1=0.0001, b2=0.002, b3=1e-6), fit)
