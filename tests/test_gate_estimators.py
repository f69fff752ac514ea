"""The gate side of the estimators, of cutting at the deadline and of the prompt term.

On the virtual clock (tests/virtual_time.py) the gate and the simulator are two drivers of one
queue core, so they must agree request by request: a learned estimator learning from the tokens
each run generated, runs cut at their deadline (outcome cancelled, the engine freed at once),
a speed change with a tracked and a fixed (stale) estimate, and estimates with a prompt term.
Then the live pieces: the oracle refused, a run cut at its deadline over HTTP (a 504 in the
envelope, the synthetic engine stopped, the service serving on), GPT-2's generated tokens, and
``qlab compare`` on live runs of real servers with each of these.
"""

import dataclasses

import numpy as np
import pytest

from live.engine import Abilities, EngineResult
from live.gate import CUT_LEAD_S
from qsim import PRESETS, ServiceModel, make_trace, simulate
from qsim.config import ServerConfig
from qsim.mixes import UsedShare
from qsim.workload import lognormal_noise
from virtual_time import LoopWorker, run_gate

MODEL = ServiceModel(intercept_s=0.002, per_token_s=0.004, per_prompt_token_s=0.0002)


def _agree(trace, policy, engines, model=ServiceModel()):
    """Outcome, reason, start, finish, engine, queue seen and estimate agree exactly; counts
    match /stats."""
    gate, stats = run_gate(trace, policy, engines, model=model)
    sim = simulate(trace, ServerConfig(policy, engines, model=model))
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    assert gate["reason"].fillna("-").tolist() == sim["reason"].fillna("-").tolist()
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(gate["start_s"], sim["start_s"], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(gate["engine"], sim["engine"].fillna(-1))
    np.testing.assert_array_equal(gate["queued"], sim["queued_at_arrival"].astype(int))
    np.testing.assert_allclose(
        gate["queued_work_s"], sim["queued_work_at_arrival_s"], rtol=0, atol=1e-12
    )
    np.testing.assert_allclose(gate["est_service_s"], sim["est_service_s"], rtol=0, atol=1e-12)
    counts = sim["outcome"].value_counts()
    assert {k: v for k, v in stats["counts"].items() if v} == {k: int(v) for k, v in counts.items()}
    assert stats["waiting"] == 0 and stats["in_service"] == 0 and stats["cancelled"] == 0
    return sim, stats


@pytest.mark.parametrize("quantile", [None, 0.9])
def test_a_learned_estimator_matches_the_simulator_exactly(quantile):
    # Early stops (the study's used share): the estimator learns from the tokens each run generated.
    trace = make_trace(
        "poisson", "mix", load=1.5, engines=2, seconds=15, seed=3, noise_cv=0.2, used=UsedShare()
    )
    assert (trace.tokens_generated < trace.max_new_tokens).mean() > 0.5
    policy = PRESETS["predictive"].with_args(
        {"estimator": "learned", "estimator_quantile": quantile}
    )
    sim, stats = _agree(trace, policy, 2)
    # It learned: estimates fell well below the limit's, and /stats reports the shares it learned
    # per size class.
    assert np.median(sim["est_service_s"].to_numpy() / trace.est_service_s) < (
        0.6 if quantile is None else 0.9
    )
    assert set(stats["estimator_shares"]) == {"4", "16", "64"}
    shares = stats["estimator_shares"].values()
    assert all(0 < share <= 1 for share in shares) and min(shares) < (
        0.5 if quantile is None else 1.0
    )
    assert (
        stats["policy"]["estimator"] == "learned"
        and stats["policy"]["estimator_quantile"] == quantile
    )
    limit = simulate(trace, PRESETS["predictive"], 2)
    assert sim["outcome"].eq("good").sum() > limit["outcome"].eq("good").sum()


@pytest.mark.parametrize(
    "policy,engines", [("bounded-deadline", 2), ("none", 1), ("predictive", 2)]
)
def test_cutting_at_the_deadline_matches_the_simulator_exactly(policy, engines):
    # Noisy runs and a deadline of 0.6 s: some runs pass it in service and are cut there, freeing
    # the engine.
    trace = make_trace(
        "poisson", "mix", load=1.3, engines=engines, seconds=15, seed=4, noise_cv=0.5
    )
    cut = PRESETS[policy].with_args({"cancel_at_deadline": True}).with_overrides(deadline_s=0.6)
    sim, stats = _agree(trace, cut, engines)
    cancelled = sim[sim["outcome"].eq("cancelled")]
    assert len(cancelled) >= 3 and cancelled["reason"].eq("deadline_passed").all()
    # Cut exactly at arrival + deadline, after starting in time.
    np.testing.assert_allclose(
        cancelled["finish_s"], cancelled["arrival_s"] + 0.6, rtol=0, atol=1e-12
    )
    assert (cancelled["start_s"] < cancelled["finish_s"]).all()
    assert stats["policy"]["cancel_at_deadline"] is True
    # Nothing answered late: every run that would pass its deadline was cut.
    assert not sim["outcome"].eq("late").any()


@pytest.mark.parametrize("policy", ["bounded-deadline", "predictive"])
@pytest.mark.parametrize("fixed", [False, True])
def test_a_stale_estimate_under_a_speed_change_matches_the_simulator_exactly(policy, fixed):
    from qsim.service import SpeedSchedule

    # The machine turns 2.2x slower at 5 s: the tracker follows it, the fixed estimate goes stale.
    trace = make_trace("poisson", "mix", load=0.8, engines=2, seconds=12, seed=8, noise_cv=0.2)
    schedule = SpeedSchedule(1.0, ((5.0, 2.2),))
    gate, stats = run_gate(trace, PRESETS[policy], 2, fixed_estimate=fixed, speed_schedule=schedule)
    sim = simulate(
        trace, ServerConfig(PRESETS[policy], 2, fixed_estimate=fixed), speed_schedule=schedule
    )
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(gate["est_service_s"], sim["est_service_s"], rtol=0, atol=1e-12)
    assert (stats["speed_factor"] == 1.0) == fixed and (fixed or stats["speed_factor"] > 1.8)
    # load 0.8 x 2.2: the policy must refuse or drop some after the change
    after = sim["arrival_s"].gt(5.0)
    assert sim.loc[after, "outcome"].isin(["rejected", "expired", "late"]).sum() > 5


def _with_prompts(trace, model: ServiceModel, seed: int):
    """The trace with prompts of 0 to 2,000 tokens, estimates and true times including their
    prefill."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 2000, len(trace))
    est = model.estimate(trace.max_new_tokens, prompt)
    true = est * lognormal_noise(rng, len(trace), 0.2)
    return dataclasses.replace(trace, prompt_tokens=prompt, est_service_s=est, true_service_s=true)


@pytest.mark.parametrize("estimator", ["limit", "learned"])
def test_prompt_tokens_in_the_estimate_match_the_simulator_exactly(estimator):
    trace = make_trace(
        "poisson",
        "mix",
        load=1.4,
        engines=2,
        seconds=15,
        seed=6,
        model=MODEL,
        used=UsedShare() if estimator == "learned" else None,
    )
    trace = _with_prompts(trace, MODEL, 6)
    sim, _ = _agree(
        trace, PRESETS["predictive"].with_args({"estimator": estimator}), 2, model=MODEL
    )
    # the estimate is the line with its prompt term, times the speed factor
    if estimator == "limit":
        factor = sim["est_service_s"] / trace.est_service_s
        assert factor.iloc[0] == 1.0
        no_prompt = MODEL.estimate(trace.max_new_tokens)
        # the prompt term is a large share of the work
        assert (trace.est_service_s - no_prompt).max() > 0.3
    assert sim["outcome"].isin(["good", "rejected", "expired", "late"]).all()


def test_the_oracle_is_refused_for_a_live_gate():
    from live.gate import gate_config
    from live.serve_options import ServeOptions

    oracle = PRESETS["predictive"].with_args({"estimator": "oracle"})
    with pytest.raises(
        ValueError, match="oracle is simulator-only: a live gate cannot know how many tokens"
    ):
        gate_config(oracle)
    with pytest.raises(ValueError, match="oracle is simulator-only"):
        ServeOptions(policy="predictive", policy_arg="estimator=oracle").make_policy()
    learned = ServeOptions(
        policy="predictive", policy_arg="estimator=learned,cancel_at_deadline=true"
    ).make_policy()
    assert learned.estimator == "learned" and learned.cancel_at_deadline


def test_qlab_serve_refuses_the_oracle_in_one_line(capsys):
    from experiments.cli import main

    assert (
        main(["serve", "--policy", "predictive", "--policy-arg", "estimator=oracle", "--port", "0"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "oracle is simulator-only" in err[0]


# ---------------------------------------------------------------- over HTTP, in real time


def test_a_run_cut_at_its_deadline_gets_504_and_frees_its_engine():
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from live.engine import SyntheticEngine
    from live.gate import Gate, gate_config
    from live.http_api import create_app

    # A 10,000-byte prompt costs 50 s through the prompt term; the deadline is 0.2 s: only a cut
    # ends it in time.
    model = ServiceModel(intercept_s=0.001, per_token_s=0.001, per_prompt_token_s=0.005)
    policy = PRESETS["none"].with_args({"cancel_at_deadline": True})
    gate = Gate([SyntheticEngine(model)], gate_config(policy, model=model))
    with TestClient(create_app(gate)) as client:
        for path, body in (
            ("/v1/generate", {"prompt": "x" * 10_000, "max_new_tokens": 4, "deadline_ms": 200}),
            (
                "/v1/completions",
                {"model": "synthetic", "prompt": "x" * 10_000, "max_tokens": 4, "deadline_ms": 200},
            ),
        ):
            if path == "/v1/completions":
                body["model"] = client.get("/v1/models").json()["data"][0]["id"]
            response = client.post(path, json=body)
            assert response.status_code == 504, response.text
            error = response.json()["error"]
            assert (error["type"], error["reason"], error["code"]) == (
                "deadline_exceeded",
                "deadline_passed",
                "deadline_passed",
            )
            numbers = error["numbers"]
            # The estimate counted the prompt (the engine's tokenizer: bytes), times the tracker's
            # factor.
            assert numbers["est_service_s"] == pytest.approx(
                float(model.estimate(4, 10_000)) * numbers["speed_factor"]
            )
            assert (
                numbers["running_s"] >= 0
                and numbers["at"] >= numbers["started_at"] >= numbers["arrived_at"]
            )
            # The synthetic engine stopped its 50 s wait: the engine is free again, and serves the
            # next request in time (behind a run that went on it would wait 50 s, ten times its
            # deadline).
            answer = client.post(
                "/v1/generate", json={"prompt": "hi", "max_new_tokens": 2, "deadline_ms": 5000}
            )
            assert answer.status_code == 200 and answer.json()["outcome"] == "good"
        stats = client.get("/stats").json()
        assert (
            stats["counts"]["cancelled"] == 2
            and stats["counts"]["good"] == 2
            and stats["cancelled"] == 0
        )
        assert stats["in_service"] == 0 and stats["waiting"] == 0
        assert stats["submitted"] == sum(stats["counts"].values())
        assert stats["policy"]["cancel_at_deadline"] is True
        assert stats["service_model"]["per_prompt_token_s"] == 0.005
        metrics = {
            (s.labels.get("outcome"), s.labels.get("reason")): s.value
            for family in text_string_to_metric_families(client.get("/metrics").text)
            for s in family.samples
            if s.name == "qlab_requests_total"
        }
        assert metrics[("cancelled", "deadline_passed")] == 2 and metrics[("cancelled", "")] == 0


def test_the_synthetic_engines_early_stops_are_seeded_draws_of_the_used_share():
    from live.engine import SyntheticEngine

    # microseconds: the draws, not the sleeps, are tested
    fast = ServiceModel(intercept_s=0.0, per_token_s=1e-6)
    engines = [SyntheticEngine(fast, seed=7, early_stops=UsedShare()) for _ in range(2)]
    runs = [[engine.run("p", 64) for _ in range(40)] for engine in engines]
    tokens = [[r.tokens for r in one] for one in runs]
    assert tokens[0] == tokens[1]  # same seed, same runs
    assert (
        all(1 <= t <= 64 for t in tokens[0])
        and np.median(tokens[0]) < 20
        and len(set(tokens[0])) > 5
    )
    assert all(r.text == " tok" * r.tokens and not r.stopped for r in runs[0])
    # off: the limit, always
    assert [SyntheticEngine(fast).run("p", 64).tokens for _ in range(3)] == [64] * 3


@pytest.mark.slow  # GPT-2: torch and transformers, 7 s of CPU to import
def test_the_gate_learns_the_tokens_gpt2_generated_and_gpt2_stops_when_cut():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import asyncio

    from live.engine import Cancel
    from live.gate import Gate, gate_config
    from live.jobs import Job
    from live.gpt2 import GPT2Engine, GPT2Spec

    engine = GPT2Engine(GPT2Spec("tiny", "cpu", seed=0, threads=1))
    first = engine.run("stop here", 16).text[:1]  # greedy: every run of this prompt starts with it
    early = engine.run("stop here", 16, [first], cancel=Cancel())  # a Cancel given but never set
    assert 1 <= early.tokens < 16 and not early.stopped
    told = Cancel()
    told.set()
    cut = engine.run("stop here", 16, cancel=told)
    assert cut.stopped and cut.tokens == 0

    async def go():
        policy = PRESETS["none"].with_args({"estimator": "learned"})
        async with Gate([engine], gate_config(policy)) as gate:
            answers = [await gate.submit(Job("stop here", 16, (first,))) for _ in range(3)]
            return answers, gate.stats()

    answers, stats = asyncio.run(go())
    assert [a.tokens for a in answers] == [early.tokens] * 3
    assert stats["estimator_shares"] == {"16": early.tokens / 16}


# ---------------------------------------------------------------- qlab compare on live runs of real
# servers


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("httpx")
    from live.procs import serving
    from live.serve_options import ServeOptions

    model_file = tmp_path_factory.mktemp("model") / "model.json"
    PROMPTED.save(model_file)
    options = {
        # Speed x2.2 from 7 s after the server started: a stale calibration the tracker follows.
        "schedule": ServeOptions(policy="bounded-deadline", speed_schedule="7:2.2", port=0),
        # Early stops (the study's used share), learned from what the engine generated; a prompt
        # term.
        "learned": ServeOptions(
            policy="predictive",
            policy_arg="estimator=learned",
            early_stops=True,
            service_model=str(model_file),
            port=0,
        ),
        # Noisy runs, every one admitted, cut at a deadline of 0.3 s.
        "cut": ServeOptions(
            policy="none", policy_arg="cancel_at_deadline=true", deadline=0.3, noise=0.5, port=0
        ),
    }
    with serving(list(options.values()), tmp_path_factory.mktemp("logs"), 60) as started:
        yield dict(zip(options, (s.url for s in started)))


PROMPTED = ServiceModel(intercept_s=0.001, per_token_s=0.0085, per_prompt_token_s=0.0002)


def _replayed(url, load: float):
    from analysis.compare import compare
    from analysis.replay_inputs import run_setup
    from live.loadgen import ReplayConfig, replay
    from qsim.runfile import speed_schedule

    run = replay(make_trace("poisson", load=load, seconds=6, seed=5), ReplayConfig(url))
    return run, (run_setup(run), speed_schedule(run)), compare(run).summary


@pytest.mark.slow
def test_a_speed_schedule_is_in_the_run_file_on_the_runs_clock(servers):
    from analysis.prediction import predict

    run, (setup, schedule), s = _replayed(servers["schedule"], 2.0)
    assert schedule is not None and not setup.fixed_estimate
    # The schedule on the run's clock says how slow each served run was: engine time over its
    # calibrated estimate is the speed at its start (away from the step itself, a hand-off from the
    # engine's start). Runs of 16 tokens or more: a few ms of a loaded machine's sleep overhead is
    # far from a factor 2.2.
    served = run[run["outcome"].isin(["good", "late"]) & run["max_new_tokens"].ge(16)]
    starts = served["engine_started_s"].to_numpy(float)
    near = np.zeros(len(served), dtype=bool)
    for t, _ in schedule.steps:
        near |= np.abs(starts - t) < 0.05
    speed = np.array([schedule.at(t) for t in starts])
    ratio = (served["engine_s"] / served["calibrated_est_s"]).to_numpy(float)
    assert (np.abs(np.log(ratio / speed))[~near] < np.log(1.3)).all(), (ratio, speed)
    assert set(speed) <= {1.0, 2.2} and len(served) >= 10
    # Request by request, the replay agrees (it replays the held times, which carry the change), and
    # the prediction draws its times through the schedule.
    assert s["live_errors"] == 0 and s["disagreement_rate"] <= 0.02
    table = predict(run, seeds=2).table
    assert np.isfinite(table.loc["share_good", "sim_mean"])


@pytest.mark.slow
def test_a_learned_estimator_is_replayed_request_by_request(servers):
    run, (setup, _), s = _replayed(servers["learned"], 3.0)
    # /stats' model, from_fields
    assert setup.policy.estimator == "learned" and setup.model == PROMPTED
    # The calibrated estimate counts the prompt as sent, in the server's tokens.
    assert run["prompt_tokens"].gt(0).all()
    np.testing.assert_allclose(
        run["calibrated_est_s"], PROMPTED.estimate(run["max_new_tokens"], run["prompt_tokens"])
    )
    # The engine stopped early and the gate learned it: estimates well below the limit's.
    assert (run["tokens"] < run["max_new_tokens"]).mean() > 0.5
    assert (run["est_service_s"] / run["calibrated_est_s"]).median() < 0.6
    assert s["live_errors"] == 0 and s["disagreement_rate"] <= 0.02


@pytest.mark.slow
def test_runs_cut_at_the_deadline_are_replayed_request_by_request(servers):
    run, (setup, _), s = _replayed(servers["cut"], 1.3)
    assert setup.policy.cancel_at_deadline
    cut = run[run["outcome"].eq("cancelled")]
    assert (
        len(cut) >= 5
        and cut["http_status"].eq(504).all()
        and cut["reason"].eq("deadline_passed").all()
    )
    assert cut["start_s"].notna().all()
    assert s["replayed_cut"] == len(cut) and s["sim_cancelled"] >= 5
    assert s["live_errors"] == 0 and s["disagreement_rate"] <= 0.02


class _SlowToStop(LoopWorker):
    """A gate worker on the virtual clock that runs one request at a time, each for ``run_s``, and
    takes ``stop_s`` to stop a cut run (as an engine between two decoding steps): a request given
    meanwhile waits."""

    run_s, stop_s = 1.0, 0.25

    def __init__(self, k: int, engine, deliver) -> None:
        super().__init__(k, deliver)
        self.busy_until, self.starts = 0.0, []

    def give(self, ticket) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        begin = max(loop.time(), self.busy_until)
        self.starts.append(begin)
        self.busy_until = begin + self.run_s
        handle = loop.call_at(
            self.busy_until, self.deliver, self.k, ticket, EngineResult("", 1, self.run_s)
        )

        def stopping() -> None:
            handle.cancel()
            self.busy_until = loop.time() + self.stop_s
            loop.call_at(
                self.busy_until,
                self.deliver,
                self.k,
                ticket,
                EngineResult("", 0, self.busy_until - begin, stopped=True),
            )

        ticket.cancel.when_set(stopping)


def _cut_then_serve(clock_offset_s: float = 0.0, second_deadline_s: float = 5.0):
    """Two 1 s requests on one engine: the first cut at its 0.6 s deadline, the second (given
    second_deadline_s) behind it. The gate's clock is the loop's plus clock_offset_s (not 0: the
    clocks differ, as time.monotonic and uvloop's millisecond one do, so the gate sets its cut
    timers early and waits on to each deadline). Returns each request's answer or DeadlineCut
    numbers (with ``seen_at``: the gate-clock time its client saw the cut)."""
    import asyncio

    from live.gate import Gate, gate_config
    from live.gate_errors import DeadlineCut
    from live.jobs import Job
    from virtual_time import VirtualLoop

    policy = PRESETS["none"].with_args({"cancel_at_deadline": True}).with_overrides(deadline_s=0.6)
    workers = []

    def worker(k, engine, deliver):
        workers.append(_SlowToStop(k, engine, deliver))
        return workers[-1]

    async def go():
        loop = asyncio.get_running_loop()
        gate = Gate(
            [None], gate_config(policy), clock=lambda: loop.time() + clock_offset_s, worker=worker
        )
        async with gate:
            ends = []
            for future in (
                gate.submit(Job("a", 1)),
                gate.submit(Job("b", 1, deadline_s=second_deadline_s)),
            ):
                try:
                    ends.append(await future)
                except DeadlineCut as cut:
                    ends.append({**cut.numbers, "seen_at": gate.clock()})
            await asyncio.sleep(1.0)  # any run still stopping
            return ends, gate.stats(), workers[0].starts

    loop = VirtualLoop()
    try:
        return loop.run_until_complete(go())
    finally:
        loop.close()


def test_a_cut_frees_the_engine_for_the_core_at_once_as_in_the_simulator():
    (cut, answer), stats, starts = _cut_then_serve()
    assert cut["at"] == pytest.approx(0.6)
    # The second request started, for the core, at the cut, as the simulator starts it; its engine
    # ran it once the cut run had stopped (0.25 s later), so the stopping is in its time, where a
    # replay of it sees it.
    assert answer.started_at == pytest.approx(0.6) and starts == [0.0, pytest.approx(0.85)]
    assert answer.returned_at == pytest.approx(1.85) and answer.outcome == "good"
    # The cut run's late hand-back ended nothing more: one cancelled, one good, the engine idle.
    assert (
        stats["counts"]["cancelled"] == 1
        and stats["counts"]["good"] == 1
        and stats["counts"]["error"] == 0
    )
    assert stats["in_service"] == 0 and stats["submitted"] == 2


def test_a_cut_timer_set_early_waits_for_the_deadline():
    ends, stats, _ = _cut_then_serve(clock_offset_s=100.0, second_deadline_s=0.9)
    assert len(ends) == 2 and stats["counts"]["cancelled"] == 2
    for numbers in ends:
        # Never before its deadline, and placed at the deadline itself (nothing else happened in
        # between), where the simulator cuts: not the moment the loop came round to it. The timer
        # went off 2 ms early (CUT_LEAD_S); the cut waited on, so its client saw it no earlier than
        # the deadline (to the rounding of the two clocks' offset; without the wait it would see it
        # CUT_LEAD_S early).
        assert numbers["at"] == numbers["arrived_at"] + numbers["deadline_s"]
        assert numbers["at"] - 1e-9 <= numbers["seen_at"] < numbers["at"] + CUT_LEAD_S / 2


def test_an_arrival_read_after_a_deadline_meets_the_queue_with_that_run_cut():
    """The loop comes round late: an arrival's clock reads past a running request's deadline before
    the cut timer fired. The core hears of the cut first, placed at the deadline, as the simulator
    orders them."""
    import asyncio

    from live.gate import Gate, gate_config
    from live.gate_errors import DeadlineCut
    from live.jobs import Job
    from virtual_time import VirtualLoop

    policy = PRESETS["none"].with_args({"cancel_at_deadline": True}).with_overrides(deadline_s=0.6)
    late = {"by": 0.0}  # how far the gate's clock reads ahead of the loop's timers

    async def go():
        loop = asyncio.get_running_loop()
        gate = Gate(
            [None],
            gate_config(policy),
            clock=lambda: loop.time() + 100.0 + late["by"],
            worker=lambda k, engine, deliver: _SlowToStop(k, engine, deliver),
        )
        async with gate:
            a, b = gate.submit(Job("a", 1)), gate.submit(Job("b", 1, deadline_s=5.0))
            await asyncio.sleep(0.5975)  # before the cut timer (set CUT_LEAD_S early) goes off
            late["by"] = 0.003  # the clock now reads 0.6005 s after a's arrival: past its deadline
            c = gate.submit(Job("c", 1, deadline_s=5.0))
            late["by"] = 0.0
            cut = await asyncio.gather(a, return_exceptions=True)
            answers = await asyncio.gather(b, c)
            return cut[0], answers, gate.stats()

    loop = VirtualLoop()
    try:
        cut, (b, c), stats = loop.run_until_complete(go())
    finally:
        loop.close()
    assert isinstance(cut, DeadlineCut) and cut.numbers["at"] == pytest.approx(100.6, abs=1e-9)
    assert b.started_at == pytest.approx(100.6, abs=1e-9)  # its start, for the core, at the cut
    # c met b running and nothing waiting (without the cut first: a running, b waiting, 1 queued).
    assert c.arrival.seen.queued == 0 and c.arrival.at == pytest.approx(100.6005)
    assert stats["counts"]["cancelled"] == 1 and stats["counts"]["good"] == 2


def test_a_coroutine_engine_starts_the_next_run_only_once_the_cut_one_has_stopped():
    import asyncio

    from live.gate import Gate, gate_config
    from live.gate_errors import DeadlineCut
    from live.jobs import Job
    from virtual_time import VirtualLoop

    class SlowToStop:  # a coroutine engine: 1 s a run, 0.25 s to stop once cancelled
        max_new_tokens_limit = None
        abilities = Abilities(coroutine=True)

        def __init__(self):
            self.spans = []  # (prompt, began, ended) per run, on the loop's clock

        async def arun(self, prompt, max_new_tokens, stop=None):
            loop = asyncio.get_running_loop()
            began = loop.time()
            try:
                await asyncio.sleep(1.0)
            except asyncio.CancelledError:
                await asyncio.sleep(0.25)
                self.spans.append((prompt, began, loop.time()))
                raise
            self.spans.append((prompt, began, loop.time()))
            return EngineResult("", 1, 1.0)

        def count_tokens(self, text):
            return 1

        def info(self):
            return {"engine": "slow-to-stop"}

    policy = PRESETS["none"].with_args({"cancel_at_deadline": True}).with_overrides(deadline_s=0.6)

    async def go():
        loop, engine = asyncio.get_running_loop(), SlowToStop()
        async with Gate([engine], gate_config(policy), clock=loop.time) as gate:
            first, second = gate.submit(Job("a", 1)), gate.submit(Job("b", 1, deadline_s=5.0))
            with pytest.raises(DeadlineCut):
                await first
            return engine.spans, await second

    loop = VirtualLoop()
    try:
        spans, answer = loop.run_until_complete(go())
    finally:
        loop.close()
    assert spans == [
        ("a", 0.0, pytest.approx(0.85)),
        ("b", pytest.approx(0.85), pytest.approx(1.85)),
    ]
    # for the core: at the cut
    assert answer.started_at == pytest.approx(0.6) and answer.outcome == "good"
