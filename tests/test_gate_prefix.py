"""The batching gate with a prefix cache (``qlab serve --batching --prefix-caching``) and the
simulator with one: request by request, they agree.

Each request's prompt goes to the gate as token ids (a shared prompt's segments as seeded runs of
ids, as the vLLM check renders them; a conversation's turn carrying the ids of the answer before
it, as the synthetic engine generates them: qsim.prefix.answer_ids), and the gate's core hashes
their full blocks (qsim.prefix.TokenIds); the simulator runs the same trace with its tokens as
keys (qsim.prefix.Tokens). Outcome, start, finish, replica and cached prompt tokens agree, and so
do the prefix cache's counters.
"""

import numpy as np
import pytest

from benchmarks.vllm_check import _token_ids
from qsim import PRESETS, make_trace, simulate
from qsim.config import ServerConfig
from qsim.engines import Batching, StepModel
from qsim.fleet import FleetSpec
from qsim.mixes import Prompts, SharedPrefix
from qsim.prefix import TokenIds, answer_ids
from qsim.routers import make_router
from virtual_time import run_gate

STEP = StepModel(0.01, 0.0001, 0.0002, 0.000001)
PROMPTS = Prompts.parse("uniform:10:120")


def _engine(prefix_caching=True, kv_blocks=None):
    return Batching(
        STEP,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        kv_blocks=kv_blocks,
        block_size=16,
        prefix_caching=prefix_caching,
    )


def _trace(shared: SharedPrefix, load: float, seed: int, seconds: float = 15.0):
    return make_trace(
        "poisson",
        "mix",
        load=load,
        engines=1,
        seconds=seconds,
        seed=seed,
        prompts=PROMPTS,
        capacity_rps=_engine().capacity_rps(PROMPTS.mean() + shared.system_tokens, 28.0),
        prefixes=shared,
    )


def _ids(trace) -> list[tuple]:
    """Each request's prompt as token ids: a key's run seeded, an answer's the ids the synthetic
    engine generated for it (every request runs to its limit)."""
    answers: dict[int, list[int]] = {}
    out = []
    for i in range(len(trace.arrival_s)):
        ids = tuple(_token_ids(trace, i, answers, 50257, 7))
        assert len(ids) == trace.prompt_tokens[i]
        n = int(trace.max_new_tokens[i])
        answers[trace.tokens[i].answer] = list(answer_ids(TokenIds.of(ids).answer, 0, n))
        out.append(ids)
    return out


def _agree(trace, config, fleet=None):
    gate, stats = run_gate(trace, None, 1, config=config, fleet=fleet, prompt_ids=_ids(trace))
    extra = {} if fleet is None else dict(replicas=fleet.replicas, router=fleet.router)
    sim = simulate(trace, config, **extra)
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-9)
    joined = sim["start_s"].notna().to_numpy()
    np.testing.assert_allclose(
        gate.loc[joined, "start_s"], sim.loc[joined, "start_s"], rtol=0, atol=1e-9
    )
    if fleet is not None:
        assert gate.loc[joined, "replica"].tolist() == sim.loc[joined, "replica"].tolist()
    answered = sim["outcome"].isin(["good", "late"]).to_numpy()
    np.testing.assert_array_equal(
        gate.loc[answered, "cached"], sim.loc[answered, "cached_prompt_tokens"].astype(int)
    )
    for key in ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_evictions"):
        assert stats[key] == sim.attrs[key], key
    assert stats["server_config"]["engine"]["prefix_caching"] is True
    return sim, stats


SHARED = {
    "system prompt": SharedPrefix(96, 0.8),
    "conversations": SharedPrefix(32, 0.5, turns=4, conversations=6),
}


@pytest.mark.parametrize("shared", SHARED)
def test_a_prefix_caching_gate_matches_the_simulator_request_by_request(shared):
    config = ServerConfig(PRESETS["predictive"], engine=_engine(), seed=3)
    sim, stats = _agree(_trace(SHARED[shared], 1.3, seed=3), config)
    assert len(sim) > 150 and stats["prefix_cache_hits"] > 0.2 * stats["prefix_cache_queries"]
    assert (sim["cached_prompt_tokens"] > 0).sum() > 50


@pytest.mark.parametrize("shared", SHARED)
def test_a_prefix_routed_fleet_with_caches_matches_the_simulators(shared):
    config = ServerConfig(PRESETS["predictive"], engine=_engine(kv_blocks=120), seed=4)
    spec = FleetSpec(3, make_router("prefix"))
    sim, stats = _agree(_trace(SHARED[shared], 3.5, seed=4), config, spec)
    assert sorted(sim["replica"].dropna().unique()) == [0, 1, 2]
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_evictions"] > 0
    # The router read the caches: without them it routes otherwise.
    blind = simulate(
        _trace(SHARED[shared], 3.5, seed=4),
        config.replace(engine=_engine(prefix_caching=False, kv_blocks=120)),
        replicas=3,
        router=spec.router,
    )
    assert blind["replica"].tolist() != sim["replica"].tolist()


def test_without_prefix_caching_nothing_is_cached():
    config = ServerConfig(PRESETS["predictive"], engine=_engine(prefix_caching=False), seed=3)
    trace = _trace(SHARED["system prompt"], 1.3, seed=3, seconds=5)
    gate, stats = run_gate(trace, None, 1, config=config, prompt_ids=_ids(trace))
    assert (gate["cached"] == -1).all() and "prefix_cache_queries" not in stats


def test_an_answer_says_its_cached_prompt_tokens_and_the_run_file_keeps_them():
    """/v1/generate's answer (live.http_api) carries cached_prompt_tokens; live.rows.to_frame
    writes them, <NA> where an answer says none."""
    from live.http_api import _answer_body
    from live.jobs import Answer, Arrival
    from live.rows import Exchange, ServerInfo, to_frame
    from qsim.admission import Seen

    trace = make_trace("poisson", requests=2, load=1.0, seed=2)
    arrival = Arrival(0.0, 5.0, Seen(0.1, 0, 0.0, 1.0))
    exchanges = []
    for i, cached in enumerate([48, None]):
        answer = Answer("x", 3, "good", 0.0, 0.1, 0.1, 0, arrival, 0.0, 0.1, 0.05, 60, None, cached)
        body = _answer_body(answer, 0.1).model_dump(mode="json")
        assert body["cached_prompt_tokens"] == cached
        exchanges.append(Exchange(float(i), float(i), i + 0.2, 200, body, first=i))
    info = ServerInfo(ServerConfig(PRESETS["none"]))
    run = to_frame(trace, exchanges, info, np.full(2, 16))
    assert run["cached_prompt_tokens"].iloc[0] == 48 and run["cached_prompt_tokens"].isna().iloc[1]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--prefix-caching"], "--prefix-caching is a batching engine's: add --batching"),
        (["--batching", "--prefix-caching", "--engine", "gpt2"], "--prefix-caching"),
    ],
)
def test_qlab_serve_refuses_prefix_caching_it_cannot_run_in_one_line(capsys, argv, says):
    from experiments.cli import main

    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_a_batching_gate_refuses_prefix_caching_without_token_ids():
    from live.batching import StepWork, StepDone
    from live.gate import BatchGate
    from virtual_time import on_virtual_clock

    class Blind:  # a batching engine that says no token ids
        max_new_tokens_limit = None

        def step(self, work: StepWork) -> StepDone:
            return StepDone(0.0)

        def text(self, key, job, tokens):
            return ""

        def count_tokens(self, text):
            return len(text)

        def warmup(self):
            pass

        def info(self):
            return {}

    async def main():
        with pytest.raises(ValueError, match="prefix caching needs an engine"):
            BatchGate(Blind(), ServerConfig(PRESETS["none"], engine=_engine()))

    on_virtual_clock(main)


def test_openai_usage_says_the_cached_prompt_tokens_as_openai_and_vllm_do():
    """/v1/completions' and chat's ``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field,
    vLLM's too): the answer's cached prompt tokens; null without a prefix cache."""
    from live.contract_openai import Usage
    from live.jobs import Answer, Arrival, Job
    from live.openai_api import _Admitted
    from qsim.admission import Seen

    arrival = Arrival(0.0, 5.0, Seen(0.1, 0, 0.0, 1.0))
    said = []
    for cached in (48, None):
        answer = Answer("x", 3, "good", 0.0, 0.1, 0.1, 0, arrival, 0.0, 0.1, 0.05, 60, None, cached)
        usage = _Admitted(answer, Job("p" * 60, 3, prompt_tokens=60), 0.1).usage
        said.append(Usage.model_validate_json(usage.model_dump_json()).model_dump())
    assert said[0] == {
        "prompt_tokens": 60,
        "completion_tokens": 3,
        "total_tokens": 63,
        "prompt_tokens_details": {"cached_tokens": 48},
    }
    assert said[1]["prompt_tokens_details"] is None
