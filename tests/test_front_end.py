"""The front end in front of a batching engine (qsim.engines.FrontEnd): one FIFO core that takes
each request in and streams each step's tokens, checked by hand, against the M/D/1 queue's
closed form, against its bottleneck's throughput, and on random cases with the books audited."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from qsim import Batching, ServerConfig, StepModel, from_arrays, make_trace, records, simulate
from qsim import testing
from qsim.engines import FrontEnd, engine_fields, engine_from_fields
from qsim.policy import PRESETS, resolve
from qsim.testing import EngineSettings, SimRun
from qsim.mixes import UsedShare


def trace_of(arrival, prompt, out):
    trace = from_arrays(np.asarray(arrival, float), np.asarray(out))
    return dataclasses.replace(
        trace,
        prompt_tokens=np.asarray(prompt, dtype=np.int64),
        tokens_generated=np.asarray(out, dtype=np.int64),
    )


def run(trace, front_end, policy=PRESETS["none"], **engine):
    config = ServerConfig(policy, Batching(front_end=front_end, **engine))
    return records.validate(simulate(trace, config))


@pytest.fixture
def audited():
    with testing.audited_batches():
        yield


def test_intake_delays_the_engine_and_each_step_streams_after_its_tokens(audited):
    fe = FrontEnd(request_s=0.1, token_s=0.01)
    row = run(trace_of([0.0], [0], [3]), fe, step=StepModel(0.01, 0, 0, 0)).iloc[0]
    # In at 0.1; steps end 0.11, 0.12, 0.13; each streamed 0.01 after the front end is free.
    assert row["start_s"] == 0.0
    assert row["ttft_s"] == pytest.approx(0.12)
    assert row["finish_s"] == pytest.approx(0.14)
    assert row["output_tokens"] == 3


def test_each_steps_outputs_cost_a_step_and_a_token_each(audited):
    fe = FrontEnd(token_s=0.01, step_s=0.02)
    df = run(trace_of([0.0, 0.0], [0, 0], [2, 2]), fe, step=StepModel(0.1, 0, 0, 0))
    # Two steps of both, ending 0.1 and 0.2; each streamed in 0.02 + 2 x 0.01 after its end.
    assert df["ttft_s"].tolist() == pytest.approx([0.14, 0.14])
    assert df["finish_s"].tolist() == pytest.approx([0.24, 0.24])


def test_a_seat_is_held_until_the_last_token_is_streamed(audited):
    fe = FrontEnd(request_s=0.0, token_s=0.05)
    df = run(
        trace_of([0.0, 0.0], [0, 0], [1, 1]), fe, step=StepModel(0.01, 0, 0, 0), max_num_seqs=1
    )
    # The first's one step ends at 0.01 and its token reaches the client at 0.06: the second's
    # seat frees then, its step ends at 0.07 and its token is streamed by 0.12.
    assert df["finish_s"].tolist() == pytest.approx([0.06, 0.12])
    assert df["start_s"].tolist() == pytest.approx([0.0, 0.06])


def test_no_front_end_and_an_idle_one_of_no_cost_give_the_same_rows():
    trace = make_trace(load=3.0, seconds=30, seed=3)
    step = StepModel(0.01, 1e-5, 2e-4, 0)
    plain = simulate(trace, ServerConfig(PRESETS["predictive"], Batching(step, max_num_seqs=8)))
    free = simulate(
        trace,
        ServerConfig(PRESETS["predictive"], Batching(step, max_num_seqs=8, front_end=FrontEnd())),
    )
    assert plain.equals(free)


def _md1_waits(seed, rate, service, n=20_000):
    trace = trace_of(
        np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n)),
        np.zeros(n, int),
        np.ones(n, int),
    )
    df = run(trace, FrontEnd(request_s=service), step=StepModel(1e-7, 0, 0, 0), max_num_seqs=256)
    return float((df["ttft_s"] - service).mean())


def test_intake_alone_is_an_md1_queue_its_mean_wait_pollaczek_khinchine():
    rate, service = 7.0, 0.1  # rho 0.7
    rho = rate * service
    expected = rho * service / (2 * (1 - rho))  # M/D/1: 0.1167 s
    waits = np.array([_md1_waits(seed, rate, service) for seed in range(8)])
    half = stats.t.ppf(0.995, len(waits) - 1) * waits.std(ddof=1) / np.sqrt(len(waits))
    assert half < 0.08 * expected  # narrow enough to fail (M/M/1 would say twice as long)
    assert abs(waits.mean() - expected) < half + 1e-6  # the steps' 1e-7 s each


def test_under_overload_tokens_reach_clients_at_the_front_ends_pace():
    token_s = 0.002  # 500 tokens a second at most, where the engine alone would do 8 x 100 / 0.1
    n = 400
    trace = trace_of(np.linspace(0, 1, n), np.zeros(n, int), np.full(n, 20))
    df = run(trace, FrontEnd(token_s=token_s), step=StepModel(0.001, 0, 0, 0), max_num_seqs=8)
    assert (df["outcome"] != "rejected").all()
    tokens = df["output_tokens"].sum()
    span = df["finish_s"].max() - df["ttft_s"].add(df["arrival_s"]).min()
    assert tokens / span == pytest.approx(1 / token_s, rel=0.01)


def test_the_front_end_is_in_the_engine_fields_and_read_back():
    engine = Batching(front_end=FrontEnd(request_s=0.002, token_s=1e-4))
    fields = engine_fields(engine)
    assert fields["front_end"] == {"request_s": 0.002, "token_s": 1e-4, "step_s": 0.0}
    assert engine_from_fields(fields) == engine
    assert "front_end" not in engine_fields(Batching())
    with pytest.raises(ValueError, match="token_s"):
        FrontEnd(token_s=-1.0)
    with pytest.raises(ValueError, match="front_end"):
        engine_from_fields({"kind": "batching", "front_end": {"request": 1}})


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 10_000),
    load=st.sampled_from([0.5, 3.0, 15.0]),
    seqs=st.sampled_from([1, 4, 32]),
    blocks=st.sampled_from([None, 8, 400]),
    name=st.sampled_from(["none", "bounded", "predictive", "bounded-deadline"]),
    cut=st.booleans(),
    patient=st.booleans(),
    fe=st.sampled_from([(0.0, 0.0), (0.01, 0.0), (0.0, 0.002), (0.02, 0.001)]),
)
def test_every_request_ends_once_with_a_front_end(
    audited, seed, load, seqs, blocks, name, cut, patient, fe
):
    trace = make_trace(load=load, seconds=6, seed=seed, used=UsedShare(), clients=())
    rng = np.random.default_rng(seed)
    trace = dataclasses.replace(trace, prompt_tokens=rng.integers(0, 120, len(trace)))
    patience = None if patient else np.where(rng.random(len(trace)) < 0.3, 0.2, np.inf)
    policy = resolve(name, {"cancel_at_deadline": cut})
    engine = Batching(
        StepModel(0.005, 2e-5, 3e-4, 1e-6),
        max_num_seqs=seqs,
        max_num_batched_tokens=max(64, seqs),
        kv_blocks=blocks,
        front_end=FrontEnd(*fe),
    )
    df = records.validate(
        simulate(trace, ServerConfig(policy, engine, seed=seed), cancel_after_s=patience)
    )
    testing.check_records(df, SimRun(policy, EngineSettings(batching=engine)), trace)
    answered = df["outcome"].isin(["good", "late"])
    assert (
        df.loc[answered, "output_tokens"] == trace.tokens_generated[df.loc[answered, "request_id"]]
    ).all()
    assert (df.loc[df["start_s"].notna(), "ttft_s"].dropna() >= 0).all()


# ---------------------------------------------------------------- where a front end is given


def test_simulate_takes_a_front_end_from_the_flag_or_a_calibration(capsys, tmp_path):
    import json

    from experiments import cli

    args = ["simulate", "--batching", "--seconds", "10", "--load", "0.5", "--json"]
    assert cli.main(args) == 0
    plain = json.loads(capsys.readouterr().out)["summary"]
    assert cli.main([*args, "--front-end", "0.01,0.002"]) == 0
    slowed = json.loads(capsys.readouterr().out)["summary"]
    assert slowed["latency_p50_s"] > plain["latency_p50_s"]
    calibration = tmp_path / "cal.json"
    calibration.write_text(
        json.dumps(
            {
                "model": {"intercept_s": 0.01, "per_token_s": 0.01},
                "front_end": {"request_s": 0.01, "token_s": 0.002},
            }
        )
    )
    assert cli.main([*args, "--front-end", str(calibration)]) == 0
    assert json.loads(capsys.readouterr().out)["summary"] == slowed


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--front-end", "0.01,0.002"], "--front-end is a batching engine's: add --batching"),
        (["--batching", "--front-end", "0.01"], "give REQUEST_S,TOKEN_S"),
        (["--batching", "--front-end", "1,2,3,4"], "give REQUEST_S,TOKEN_S"),
        (["--batching", "--front-end=-1,0"], "request_s must be a number >= 0"),
    ],
)
def test_bad_front_ends_are_one_line_and_exit_2(capsys, bad, message):
    from experiments import cli

    with pytest.raises(SystemExit) as exit_:
        raise SystemExit(cli.main(["simulate", "--seconds", "5", *bad]))
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and message in err and len(err.splitlines()) == 1


def test_a_sweep_reads_the_front_end_in_its_batching_table(tmp_path):
    from experiments import config

    path = tmp_path / "s.toml"
    text = (
        "[sweep]\nduration_s = 5\nseeds = 1\n[batching]\nmax_num_seqs = 8\n"
        'front_end = {request_s = 0.002, token_s = 0.0004}\n[grid]\npolicy = ["none"]\n'
        "load = [0.5]\n"
    )
    path.write_text(text)
    assert config.load(path).batching.front_end == FrontEnd(0.002, 0.0004)
    path.write_text(text.replace("request_s = 0.002", "request = 0.002"))
    with pytest.raises(config.ConfigError, match="front_end takes request_s, token_s and step_s"):
        config.load(path)


def test_a_calibration_front_end_is_a_load_term_and_the_prediction_takes_it():
    from qsim.service import LoadTerms

    terms = LoadTerms.from_calibration(
        {"step": {"b0": 0.005}, "front_end": {"request_s": 0.003, "token_s": 0.0005}}
    )
    assert terms.front_end == FrontEnd(0.003, 0.0005)
    assert LoadTerms.from_calibration({"step": {"b0": 0.005}}).front_end is None
    with pytest.raises(ValueError, match="bad calibrated front end"):
        LoadTerms.from_calibration({"front_end": {"request_s": -1, "token_s": 0}})
    with_step = {"request_s": 0.003, "token_s": 0.0, "step_s": 2e-4}
    assert LoadTerms.from_calibration({"front_end": with_step}).front_end == FrontEnd(**with_step)
