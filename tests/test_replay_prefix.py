"""``qlab replay`` against a prefix-caching batching server (``qlab serve --batching
--prefix-caching``), then ``qlab compare``: end to end over HTTP, on the virtual clock.

The replayer sends each prompt as token ids rendered from the trace's segments (a shared system
prompt, a conversation's turns: qsim.prefix.render_ids) and keeps the segments in the run file
(prompt_segments); the replay gives them to the simulator as the trace's tokens, so its prefix
cache shares what the gate's did: no disagreement, the same cached prompt tokens per request.
The server is the real app (live.http_api.create_app) around a real gate, reached in-process
through httpx's ASGI transport on the loop's virtual clock: no wall-clock slack anywhere.
"""

import asyncio

import httpx
import numpy as np
import pandas as pd
import pytest

from analysis.compare import compare
from analysis.replay import simulate_run
from live import loadgen_clients
from live.batching import SyntheticBatchEngine
from live.gate import BatchGate, Gate
from live.http_api import create_app
from live.lanes import Lanes
from live.loadgen import ReplayConfig, replay_async
from qsim import PRESETS
from qsim.config import ServerConfig
from qsim.fleet import FleetSpec
from qsim.prefix import SEGMENTS
from qsim.routers import make_router
from test_gate_prefix import SHARED, _engine, _trace
from virtual_time import on_virtual_clock


async def _at(loop, when: float) -> None:
    """Until ``when`` exactly: the replayer's own wait ends in a spin of sleep(0), during which a
    virtual clock, never idle, would not move."""
    if when > loop.time():
        due = loop.create_future()
        loop.call_at(when, due.set_result, None)
        await due


async def _within(loop, task, until: float) -> bool:
    if not task.done() and until > loop.time():
        await asyncio.wait(
            {task, asyncio.ensure_future(_at(loop, until))}, return_when="FIRST_COMPLETED"
        )
    return task.done()


def _served_replay(monkeypatch, trace, config, fleet=None, api="qlab"):
    """The run file of ``trace`` replayed against an in-process gate of ``config`` (``fleet``:
    replicas of it behind their router)."""
    transports = []
    # the model named: the replayer asks /v1/models with a client of its own, not its lanes
    model = "synthetic" if api == "openai" else None
    monkeypatch.setattr(Lanes, "_new", lambda self: transports[0])
    monkeypatch.setattr(loadgen_clients, "_until", _at)
    monkeypatch.setattr(loadgen_clients, "_within", _within)

    async def go():
        clock = asyncio.get_running_loop().time
        replicas = 1 if fleet is None else fleet.replicas
        engines = [
            SyntheticBatchEngine(config.engine.step, seed=config.seed, clock=clock, replica=r)
            for r in range(replicas)
        ]
        gate = (
            BatchGate(engines[0], config, clock=clock)
            if fleet is None
            else Gate(engines, config, clock=clock, fleet=fleet)
        )
        app = create_app(gate)
        transports.append(httpx.ASGITransport(app=app, raise_app_exceptions=False))
        async with app.router.lifespan_context(app):
            return await replay_async(trace, ReplayConfig("http://gate.test", api=api, model=model))

    return on_virtual_clock(go)


def _agrees(run):
    summary = compare(run).summary
    assert summary["live_errors"] == 0 and summary["disagreements"] == 0, summary
    # Nor did any request part: the same queue at each arrival (the speed factor too, which a
    # batching gate's estimate does not carry as calibrated_est_s x factor).
    assert np.isnan(summary["first_divergence_s"]) and summary["cascade_disagreements"] == 0
    sim = simulate_run(run).set_index("request_id")
    live = run.set_index("request_id")
    answered = live["outcome"].isin(["good", "late"])
    pd.testing.assert_series_equal(
        live.loc[answered, "cached_prompt_tokens"],
        sim.loc[answered[answered].index, "cached_prompt_tokens"],
        check_names=False,
    )
    return live[answered]


@pytest.mark.parametrize("shared", SHARED)
def test_a_replayed_prefix_cached_run_compares_with_no_disagreement(monkeypatch, shared):
    config = ServerConfig(PRESETS["predictive"], engine=_engine(), seed=3)
    run = _served_replay(monkeypatch, _trace(SHARED[shared], 1.3, seed=3, seconds=6), config)
    assert run[SEGMENTS].notna().all()
    answered = _agrees(run)
    assert len(answered) > 40 and (answered["cached_prompt_tokens"] > 0).sum() > 20
    # Without the segments the replay gives every prompt its own tokens, and disagrees.
    blind = run.drop(columns=[SEGMENTS])
    assert (simulate_run(blind)["cached_prompt_tokens"].fillna(0) == 0).all()


@pytest.mark.parametrize("shared", SHARED)
def test_a_replayed_prefix_routed_fleet_compares_with_no_disagreement(monkeypatch, shared):
    config = ServerConfig(PRESETS["predictive"], engine=_engine(kv_blocks=120), seed=4)
    fleet = FleetSpec(3, make_router("prefix"))
    run = _served_replay(monkeypatch, _trace(SHARED[shared], 3.5, seed=4, seconds=6), config, fleet)
    answered = _agrees(run)
    assert sorted(answered["replica"].unique()) == [0, 1, 2]
    assert (answered["cached_prompt_tokens"] > 0).sum() > 20


def test_the_openai_api_sends_token_ids_and_compares_alike(monkeypatch):
    config = ServerConfig(PRESETS["predictive"], engine=_engine(), seed=3)
    trace = _trace(SHARED["conversations"], 1.3, seed=3, seconds=4)
    run = _served_replay(monkeypatch, trace, config, api="openai")
    assert (_agrees(run)["cached_prompt_tokens"] > 0).any()


def test_a_run_file_without_segments_replays_as_before(monkeypatch):
    """A plain trace against a server that takes token ids: each prompt its own (what the
    simulator makes of such a trace), so nothing is cached, and the column says so."""
    config = ServerConfig(PRESETS["predictive"], engine=_engine(), seed=3)
    from qsim import make_trace
    from test_gate_prefix import PROMPTS

    trace = make_trace("poisson", "mix", load=1.0, seconds=4, seed=2, prompts=PROMPTS)
    run = _served_replay(monkeypatch, trace, config)
    assert run[SEGMENTS].notna().all()
    answered = _agrees(run)
    assert (answered["cached_prompt_tokens"] == 0).all()
    old = run.drop(columns=[SEGMENTS])  # an older run file
    assert compare(old).summary["disagreements"] == 0
    assert np.array_equal(simulate_run(old)["outcome"], simulate_run(run)["outcome"])


@pytest.mark.parametrize(
    "route, body, status, reason",
    [
        ("/v1/generate", {"prompt": [5, "x"]}, 422, "invalid_field"),
        ("/v1/generate", {"prompt": [5, -1]}, 422, "invalid_field"),
        ("/v1/generate", {"prompt": []}, 422, "invalid_field"),
        # the vocabulary is in that server's published schema: an id past it is a field's error
        ("/v1/generate", {"prompt": [5, 50257]}, 422, "invalid_field"),
        ("/v1/completions", {"prompt": [5, 50257]}, 422, "invalid_field"),
        ("/v1/completions", {"prompt": [5, 6], "echo": True}, 400, "unsupported_parameter"),
        ("/v1/generate", {"prompt": [1] * 20000}, 422, "prompt_too_long"),
    ],
)
def test_a_bad_token_id_prompt_is_a_4xx_in_the_envelope(route, body, status, reason):
    answer = _posted(route, body, SyntheticBatchEngine)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["reason"] == reason, error


def test_token_ids_are_counted_as_the_prompt_and_refused_by_an_engine_that_takes_none():
    answer = _posted("/v1/completions", {"prompt": [7] * 40}, SyntheticBatchEngine)
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 40
    from live.engine import SyntheticEngine

    # its schema takes text only (test_a_servers_schema_says_whether_it_takes_token_ids)
    refused = _posted("/v1/generate", {"prompt": [7] * 40}, SyntheticEngine)
    assert refused.status_code == 422 and refused.json()["error"]["reason"] == "invalid_field"


def _posted(route, body, kind):
    """One POST to an in-process gate of one engine of ``kind`` (batching: a prefix cache)."""
    size = {"max_new_tokens": 4} if route == "/v1/generate" else {"model": "synthetic"}

    async def go():
        clock = asyncio.get_running_loop().time
        if kind is SyntheticBatchEngine:
            config = ServerConfig(PRESETS["none"], engine=_engine(), seed=3)
            gate = BatchGate(SyntheticBatchEngine(config.engine.step, clock=clock), config, clock)
        else:
            from live.gate import gate_config

            gate = Gate([kind()], gate_config(PRESETS["none"]), clock=clock)
        app = create_app(gate)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://q.test") as client:
                return await client.post(route, json={**size, **body})

    return on_virtual_clock(go)


def test_a_servers_schema_says_whether_it_takes_token_ids():
    """A server publishes token-id prompts only where its engine takes them, bounded by its
    vocabulary: a body its document allows is never refused for carrying ids."""
    from live.contract import request_model
    from live.contract_fields import Limits
    from live.contract_openai import request_models

    def prompt_of(model) -> dict:
        return model.model_json_schema()["properties"]["prompt"]

    assert "anyOf" not in prompt_of(request_model(Limits())), "text only"
    ids = [t for t in prompt_of(request_model(Limits(), 50257))["anyOf"] if t["type"] == "array"]
    assert [t["items"]["maximum"] for t in ids] == [50256] and ids[0]["minItems"] == 1
    text_only = prompt_of(request_models(Limits())[0])["anyOf"]
    assert all(t.get("items", {}).get("type") != "integer" for t in text_only)
    with_ids = prompt_of(request_models(Limits(), None, 50257)[0])["anyOf"]
    assert any(t.get("items", {}).get("maximum") == 50256 for t in with_ids)
