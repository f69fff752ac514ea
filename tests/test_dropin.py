"""A drop-in gate (issue 23): what OpenAI-compatible clients send is accepted, a request no queue
could answer in time is a 400 and not overload, and a request without max_tokens gets one that fits
its deadline.

The service runs in-process (FastAPI's TestClient), synthetic engine at 1/10,000 of the reference
time, policy ``predictive`` with the calibrated (fixed) estimate: the reference line, 1 ms + 8.5 ms
per new token, so the 2 s default deadline holds at most 235 new tokens (1.9985 s).
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from live.auth import load_keys
from live.contract_fields import Limits
from live.engine import WORD, Asked, Faults, SyntheticEngine
from live.gate import Gate, gate_config
from live.gate_errors import Rejected, ShuttingDown
from live.jobs import Job
from live.http_api import create_app
from live.serve_options import ServeOptions
from qsim import preset
from qsim.config import StallRule
from qsim.mixes import UsedShare
from virtual_time import SimEngine, VirtualLoop

MODEL = "synthetic"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
FITS_2S = 235  # new tokens whose reference estimate fits 2 s


def serve(policy: str = "predictive", limits: Limits = Limits()) -> TestClient:
    gate = Gate([SyntheticEngine(speed=1e-4)], gate_config(preset(policy), fixed_estimate=True))
    return TestClient(create_app(gate, limits))


@pytest.fixture(scope="module")
def client():
    with serve() as c:
        yield c


def on_a_virtual_clock(coroutine):
    """Run the coroutine on tests/virtual_time.py's loop, whose clock jumps to the next timer."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


def tok(n: int) -> str:
    return WORD * n


def events(response) -> list[dict]:
    lines = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---------------------------------------------------------------------- what clients send is
# accepted

#: A value of each vendor field the benchmark clients (and vLLM's own) send.
VENDOR = {
    "ignore_eos": True,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "length_penalty": 1.0,
    "min_tokens": 2,
    "stop_token_ids": [50256],
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": 512,
    "add_special_tokens": False,
    "return_tokens_as_token_ids": False,
    "request_id": "r-1",
    "use_beam_search": False,
}
CHAT_VENDOR = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template_kwargs": {"x": 1},
    "chat_template": "{{ messages }}",
    "reasoning_effort": "low",
}


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
        ("/v1/chat/completions", {**CHAT, **CHAT_VENDOR}),
    ],
)
def test_vendor_fields_are_accepted(client, route, body):
    r = client.post(
        route, json={**body, **VENDOR, "max_tokens": 4, "temperature": 0, "top_p": 1, "seed": 1}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", -2),
        ("top_k", "5"),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("ignore_eos", "yes"),
        ("min_tokens", -1),
        ("stop_token_ids", ["x"]),
        ("request_id", 7),
    ],
)
def test_a_malformed_vendor_value_is_a_422_naming_it(client, field, value):
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, field: value})
    error = r.json()["error"]
    assert (
        r.status_code == 422 and error["reason"] == "invalid_field" and field in error["message"]
    ), r.text


def test_an_unknown_field_is_still_a_422(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "ignore_eoss": True})
    assert r.status_code == 422 and "ignore_eoss" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "fields, name",
    [({"use_beam_search": True}, "use_beam_search"), ({"prompt_logprobs": 1}, "prompt_logprobs")],
)
def test_vendor_fields_asking_what_cannot_be_done_are_400s(client, fields, name):
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **fields}
    )
    error = r.json()["error"]
    assert (
        r.status_code == 400
        and error["reason"] == "unsupported_parameter"
        and name in error["message"]
    )


def test_min_tokens_past_max_tokens_is_a_400(client):
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "min_tokens": 3}
    )
    assert r.status_code == 400 and r.json()["error"]["reason"] == "conflicting_parameters"


@pytest.mark.parametrize("min_tokens, text", [(0, ""), (1, tok(1)), (3, tok(3)), (5, tok(5))])
def test_min_tokens_holds_off_a_stop_string(client, min_tokens, text):
    """The synthetic engine's text is " tok" per token: the stop string " tok" ends it at once,
    unless min_tokens says how many tokens must come out first (as vLLM's min_tokens does)."""
    r = client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "x",
            "max_tokens": 5,
            "stop": " tok",
            "min_tokens": min_tokens,
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text


def test_an_early_stopping_engine_runs_at_least_min_tokens():
    engine = SyntheticEngine(speed=1e-4, early_stops=UsedShare())
    assert {engine.run("x", 64, asked=Asked(min_tokens=64)).tokens for _ in range(20)} == {64}
    assert min(engine.run("x", 64).tokens for _ in range(50)) < 64  # without it, most stop early


@pytest.mark.parametrize(
    "route, body",
    [("/v1/completions", {"model": MODEL, "prompt": "hi"}), ("/v1/chat/completions", CHAT)],
)
def test_a_stream_with_usage_options_as_guidellm_sends_them(client, route, body):
    """stream_options.continuous_usage_stats (vLLM's) is accepted; include_usage adds OpenAI's usage
    chunk: no choices, the usage, after the last choice and before [DONE]; every other chunk's usage
    is null."""
    r = client.post(
        route,
        json={
            **body,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    assert r.status_code == 200, r.text
    chunks = events(r)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None and c["choices"] for c in chunks[:-1])


def test_the_slo_headers_set_the_requests_objectives(client):
    r = client.post(
        "/v1/chat/completions",
        json={**CHAT, "max_tokens": 2},
        headers={"x-slo-ttft-ms": "500", "x-slo-tpot-ms": "12.5"},
    )
    qlab = r.json()["qlab"]
    assert (qlab["ttft_slo_s"], qlab["tpot_slo_s"]) == (0.5, 0.0125)
    plain = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).json()["qlab"]
    assert (plain["ttft_slo_s"], plain["tpot_slo_s"]) == (None, None)


@pytest.mark.parametrize("value", ["0", "-3", "soon", "nan", "inf", "600001", "1" * 30])
def test_a_bad_slo_header_is_a_422_naming_it(client, value):
    for route, body in (
        ("/v1/chat/completions", {**CHAT, "max_tokens": 2}),
        ("/v1/generate", {"prompt": "x", "max_new_tokens": 2}),
    ):
        r = client.post(route, json=body, headers={"x-slo-tpot-ms": value})
        error = r.json()["error"]
        assert (
            r.status_code == 422
            and error["reason"] == "invalid_field"
            and "x-slo-tpot-ms" in error["message"]
        )


# ---------------------------------------------------------------------- never in time is not
# overload


def test_a_chat_without_max_tokens_gets_what_fits_its_deadline(client):
    """Not the 1,024-token cap, which the 2 s deadline cannot hold (a 503 on an idle gate,
    before)."""
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == FITS_2S
    shorter = client.post(
        "/v1/chat/completions", json=CHAT, headers={"x-request-deadline-ms": "1000"}
    )
    assert shorter.json()["usage"]["completion_tokens"] == 117  # 0.9955 s
    assert (
        client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).json()["usage"][
            "completion_tokens"
        ]
        == FITS_2S
    )


def test_the_default_max_tokens_is_a_serve_option():
    with serve(limits=Limits(default_max_tokens=50)) as c:
        assert c.post("/v1/chat/completions", json=CHAT).json()["usage"]["completion_tokens"] == 50
        assert c.get("/stats").json()["limits"]["default_max_tokens"] == 50
    with serve(limits=Limits(max_new_tokens=30, default_max_tokens=50)) as c:  # never past the cap
        assert c.post("/v1/chat/completions", json=CHAT).json()["usage"]["completion_tokens"] == 30


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/chat/completions", {**CHAT, "max_tokens": 300}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 300}),
        ("/v1/generate", {"prompt": "x", "max_new_tokens": 300}),
    ],
)
def test_a_request_no_queue_could_answer_in_time_is_a_400_without_retry_after(client, route, body):
    before = client.get("/stats").json()
    r = client.post(route, json=body)
    error = r.json()["error"]
    assert (
        r.status_code == 400 and "retry-after" not in r.headers and error["retry_after_s"] is None
    )
    assert (
        error["type"] == "invalid_request"
        and error["code"] == error["reason"] == "deadline_too_short"
    )
    assert error["numbers"]["fit_new_tokens"] == FITS_2S and error["numbers"]["deadline_s"] == 2.0
    assert (
        f"at most {FITS_2S} new tokens fit" in error["message"]
        and "at least 2551 ms" in error["message"]
    )
    after = client.get("/stats").json()
    assert (
        after["rejected_by_reason"]["deadline_too_short"]
        - before["rejected_by_reason"]["deadline_too_short"]
        == 1
    )
    assert (
        after["submitted"] - before["submitted"] == 1
        and after["counts"]["rejected"] - before["counts"]["rejected"] == 1
    )


def test_not_even_one_token_fitting_says_so(client):
    r = client.post("/v1/generate", json={"prompt": "x", "max_new_tokens": 4, "deadline_ms": 5})
    error = r.json()["error"]
    assert (
        r.status_code == 400
        and error["numbers"]["fit_new_tokens"] == 0
        and ("not even 1 new token") in error["message"]
    )


def test_a_policy_that_admits_late_answers_admits_it():
    """Only a policy that refuses for the deadline refuses: under ``none`` the request runs."""
    with serve("none") as c:
        r = c.post("/v1/generate", json={"prompt": "x", "max_new_tokens": 300})
        assert r.status_code == 200 and r.json()["tokens"] == 300


# ---------------------------------------------------------------------- health as orchestrators
# expect


class _Unready(SyntheticEngine):
    """An engine whose dependency is away (live.engine.Checked), as an upstream engine's server
    can be."""

    async def readiness(self) -> str | None:
        return "the upstream is away"


def test_liveness_and_readiness(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"ready": True}
    health = client.get("/healthz").json()
    assert health["status"] == "ok" and health["ready"] is True and health["not_ready"] == []
    gate = Gate([_Unready(speed=1e-4)], gate_config(preset("predictive"), fixed_estimate=True))
    with TestClient(create_app(gate)) as unready:
        r = unready.get("/ready")
        error = r.json()["error"]
        assert (
            r.status_code == 503
            and error["reason"] == "not_ready"
            and "the upstream is away" in error["message"]
        )
        assert r.headers["retry-after"] == "1"
        health = unready.get("/healthz")
        assert health.status_code == 200 and health.json()["ready"] is False  # alive, but not ready
        assert health.json()["not_ready"] == ["the upstream is away"]
        assert unready.get("/health").status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        "/health",
        "/ready",
        "/healthz",
        "/stats",
        "/metrics",
        "/v1/models",
        "/v1/models/synthetic",
        "/openapi.json",
    ],
)
def test_head_on_every_get_route(client, path):
    assert client.head(path).status_code == 200


@pytest.mark.parametrize("path", ["/v1/generate", "/v1/completions", "/v1/chat/completions"])
def test_head_on_a_post_route_is_a_405(client, path):
    assert client.head(path).status_code == 405


# ---------------------------------------------------------------------- the speed tracker resists
# outliers


def _after_a_pause(max_step: float) -> tuple[object, float]:
    """On a virtual clock, through a real gate (predictive, 2 s deadline, reference line): one
    180-token request whose run pauses to 9.19 s (6 x its 1.531 s estimate, as an upstream that
    stalled), then another 180-token request. What happens to the second, and the speed factor
    between them."""
    true_s = [9.186, 1.531]

    async def go():
        loop = asyncio.get_running_loop()
        # the pause is no stall here
        config = gate_config(preset("predictive"), stall=StallRule(10.0, 60.0))
        worker = lambda k, engine, deliver: SimEngine(k, true_s, None, deliver)  # noqa: E731
        gate = Gate([None], config, clock=loop.time, worker=worker)
        gate.queue.tracker.max_step = max_step
        async with gate:
            await gate.submit(Job("0", 180, deadline_s=60.0))
            factor = gate.tracker.factor
            try:
                return await gate.submit(Job("1", 180)), factor
            except Rejected as refused:
                return refused, factor

    return on_a_virtual_clock(go())


def test_one_paused_run_moves_the_speed_factor_a_bounded_step():
    answer, factor = _after_a_pause(max_step=0.25)
    assert factor == pytest.approx(1.25)  # 1 + at most 25 %
    assert answer.outcome == "good" and answer.arrival.seen.est_service_s == pytest.approx(
        1.531 * 1.25
    )
    # Unbounded (the EWMA alone): the same pause doubles the factor, and the next request is
    # refused.
    refused, unbounded = _after_a_pause(max_step=1e9)
    assert unbounded == pytest.approx(1 + 0.2 * (9.186 / 1.531 - 1))
    assert isinstance(refused, Rejected) and refused.rejection.reason == "deadline_unreachable"


# ---------------------------------------------------------------------- /openapi.json is the
# contract


def test_the_openapi_document_gives_every_status_with_the_envelope(client):
    doc = client.get("/openapi.json").json()
    envelope = "#/components/schemas/ErrorEnvelope"
    assert set(doc["components"]["schemas"]["ErrorEnvelope"]["properties"]) == {"error"}
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            errors = {int(s): r for s, r in op["responses"].items() if int(s) >= 400}
            # Any route: a head too slow, a Host it does not answer to, a head too large.
            assert {408, 421, 431} <= set(errors), (method, path)
            for status, response in errors.items():
                assert response["content"]["application/json"]["schema"]["$ref"] == envelope, (
                    method,
                    path,
                    status,
                )
                assert response["description"], (method, path, status)
    admitting = {400, 401, 408, 413, 415, 421, 422, 429, 431, 500, 502, 503, 504}
    assert set(map(int, doc["paths"]["/v1/generate"]["post"]["responses"])) == {200, *admitting}
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert set(map(int, doc["paths"][path]["post"]["responses"])) == {200, 404, *admitting}
    assert set(map(int, doc["paths"]["/ready"]["get"]["responses"])) == {200, 408, 421, 431, 503}


def test_every_status_a_route_gave_is_in_its_document():
    """What the routes answer (the bad requests, a failing engine, a client over its rate) is
    documented."""
    gate = Gate(
        [SyntheticEngine(speed=1e-4, faults=Faults(fail_every=2))],
        gate_config(preset("predictive").with_args({"client_rate": 0.001}), fixed_estimate=True),
    )
    sends = [
        ("post", "/v1/generate", dict(json={"prompt": "x", "max_new_tokens": 2})),
        # run 2 raises: 500
        ("post", "/v1/generate", dict(json={"prompt": "x", "max_new_tokens": 2})),
        ("post", "/v1/generate", dict(content=b"{", headers={"content-type": "application/json"})),
        # deadline_too_short
        ("post", "/v1/generate", dict(json={"prompt": "x", "max_new_tokens": 300})),
        ("post", "/v1/generate", dict(json={"prompt": "x", "max_new_tokens": "2"})),
        (
            "post",
            "/v1/generate",
            dict(content=b"x" * 70_000, headers={"content-type": "application/json"}),
        ),
        ("post", "/v1/generate", dict(content=b"x", headers={"content-type": "text/plain"})),
        ("post", "/v1/chat/completions", dict(json={**CHAT, "max_tokens": 2, "user": "u"})),
        ("post", "/v1/chat/completions", dict(json={**CHAT, "max_tokens": 2, "user": "u"})),  # 429
        ("post", "/v1/chat/completions", dict(json={**CHAT, "model": "other"})),
        ("post", "/v1/completions", dict(json={"model": MODEL, "prompt": "x", "n": 2})),
        ("get", "/v1/models/other", {}),
    ]
    seen = set()
    with TestClient(create_app(gate)) as c:
        doc = c.get("/openapi.json").json()
        for method, path, kwargs in sends:
            status = getattr(c, method)(path, **kwargs).status_code
            seen.add(status)
            route = "/v1/models/{model_id}" if path.startswith("/v1/models/") else path
            assert str(status) in doc["paths"][route][method]["responses"], (method, path, status)
    assert {200, 400, 404, 413, 415, 422, 429, 500} <= seen


# ---------------------------------------------------------------------- keys


KEY_FILE = """# key        client
sk-tenant-a  tenant-a
sk-tenant-b  tenant-b
sk-anyone
"""


@pytest.fixture()
def keyed(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(KEY_FILE)
    gate = Gate(
        [SyntheticEngine(speed=1e-4)],
        gate_config(preset("predictive").with_args({"client_rate": 0.001}), fixed_estimate=True),
    )
    with TestClient(create_app(gate, keys=load_keys("sk-admin", str(path)))) as c:
        yield c


def _bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        _bearer("sk-wrong"),
        {"authorization": "sk-tenant-a"},
        {"authorization": "Basic c2stdGVuYW50LWE="},
        _bearer(""),
    ],
)
def test_a_guarded_route_without_a_valid_key_is_a_401(keyed, headers):
    for method, path, body in (
        ("post", "/v1/chat/completions", {**CHAT, "max_tokens": 2}),
        ("post", "/v1/generate", {"prompt": "x", "max_new_tokens": 2}),
        ("get", "/v1/models", None),
    ):
        r = getattr(keyed, method)(path, headers=headers, **({"json": body} if body else {}))
        error = r.json()["error"]
        assert (
            r.status_code == 401
            and error["reason"] == "unauthorized"
            and r.headers["www-authenticate"] == "Bearer"
        )
        assert "sk-" not in r.text  # no key in the answer
    assert keyed.get("/stats").json()["submitted"] == 0  # refused before the gate


def test_each_key_is_let_in_and_names_its_client(keyed):
    import openai

    for key in ("sk-admin", "sk-tenant-a", "sk-anyone"):
        sdk = openai.OpenAI(
            base_url="http://testserver/v1", api_key=key, http_client=keyed, max_retries=0
        )
        assert (
            sdk.chat.completions.create(
                model=MODEL, messages=CHAT["messages"], max_tokens=2
            ).usage.completion_tokens
            == 2
        )
    # tenant-a's key is tenant-a, whatever the body says: its one request per 1,000 s is spent
    # (client_rate).
    r = keyed.post(
        "/v1/chat/completions",
        json={**CHAT, "max_tokens": 2, "user": "someone-else"},
        headers=_bearer("sk-tenant-a"),
    )
    assert r.status_code == 429 and r.json()["error"]["reason"] == "rate_limited"
    assert (
        keyed.post(
            "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, headers=_bearer("sk-tenant-b")
        ).status_code
        == 200
    )
    # A key that names no client leaves the request's own: the body's user, then x-client-id.
    assert (
        keyed.post(
            "/v1/chat/completions",
            json={**CHAT, "max_tokens": 2, "user": "u1"},
            headers=_bearer("sk-anyone"),
        ).status_code
        == 200
    )
    # open unless --auth-stats
    for path in ("/health", "/ready", "/openapi.json", "/stats", "/healthz", "/metrics"):
        assert keyed.get(path).status_code == 200, path


def test_auth_stats_puts_stats_and_metrics_behind_the_key():
    gate = Gate(
        [SyntheticEngine(speed=1e-4)], gate_config(preset("predictive"), fixed_estimate=True)
    )
    with TestClient(create_app(gate, keys=load_keys("sk-admin", None, guard_stats=True))) as c:
        for path in ("/stats", "/healthz", "/metrics"):
            assert (
                c.get(path).status_code == 401
                and c.get(path, headers=_bearer("sk-admin")).status_code == 200
            )
        for path in ("/health", "/ready", "/openapi.json"):
            assert c.get(path).status_code == 200


def test_keys_are_compared_in_constant_time_and_never_shown(monkeypatch, tmp_path, caplog):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    keys = load_keys("sk-admin", None)
    monkeypatch.setenv("QLAB_API_KEY", "sk-env")
    assert load_keys(None, None).holder(b"Bearer sk-env") is not None  # the environment's key
    assert (
        keys.holder(b"Bearer sk-admin") is not None
        and keys.holder(b"bearer  sk-admin ") is not None
    )
    # every comparison through compare_digest
    assert keys.holder(b"Bearer sk-admi") is None and len(calls) == 4
    assert "sk-admin" not in repr(keys)
    bad = tmp_path / "keys.txt"
    bad.write_text("sk-secret-1 a b\n")
    with pytest.raises(ValueError, match=r"keys.txt:1: a line is KEY or KEY CLIENT_ID") as caught:
        load_keys(None, str(bad))
    assert "sk-secret" not in str(caught.value)
    with pytest.raises(ValueError, match="--auth-stats: only with"):
        monkeypatch.delenv("QLAB_API_KEY")
        load_keys(None, None, guard_stats=True)
    options = ServeOptions(api_key="sk-admin", api_key_file=str(bad))
    assert "sk-admin" not in repr(options) and "sk-admin" not in " ".join(options.argv())


# ---------------------------------------------------------------------- the small ones


def test_a_stop_answers_the_waiting_at_once_and_refuses_new_ones():
    """Gate.drain (what SIGTERM does): the waiting are answered now (error, shutting_down), a new
    request is refused before the gate decides on it, and the running one goes on to its answer."""
    true_s = [1.0, 1.0, 1.0]

    async def go():
        loop = asyncio.get_running_loop()
        worker = lambda k, engine, deliver: SimEngine(k, true_s, None, deliver)  # noqa: E731
        async with Gate(
            [None], gate_config(preset("none")), clock=loop.time, worker=worker
        ) as gate:
            running, waiting = gate.submit(Job("0", 4)), gate.submit(Job("1", 4))
            assert gate.in_service == 1 and gate.waiting == 1
            gate.drain()
            with pytest.raises(ShuttingDown):
                await waiting
            stopped_at = loop.time()
            with pytest.raises(ShuttingDown):
                gate.submit(Job("2", 4))
            answer = await running
            return stopped_at, answer, gate.stats()

    stopped_at, answer, stats = on_a_virtual_clock(go())
    assert stopped_at == 0.0 and answer.outcome == "good" and answer.returned_at == 1.0
    assert (
        stats["counts"]["error"] == 1 and stats["counts"]["good"] == 1 and stats["submitted"] == 2
    )
    assert stats["submitted"] == sum(stats["counts"].values())


def test_a_client_that_hangs_up_is_in_counts():
    async def go():
        loop = asyncio.get_running_loop()
        worker = lambda k, engine, deliver: SimEngine(k, [1.0, 1.0], None, deliver)  # noqa: E731
        async with Gate(
            [None], gate_config(preset("none")), clock=loop.time, worker=worker
        ) as gate:
            running, waiting = gate.submit(Job("0", 4)), gate.submit(Job("1", 4))
            waiting.cancel()  # its client left
            await running
            return gate.stats()

    stats = on_a_virtual_clock(go())
    assert stats["counts"]["abandoned"] == stats["cancelled"] == 1 and stats["counts"]["good"] == 1
    assert stats["submitted"] == sum(stats["counts"].values())  # every request once, in counts


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate"])
def test_an_encoded_body_is_a_415(client, encoding):
    r = client.post(
        "/v1/completions",
        content=b"\x1f\x8b...",
        headers={"content-type": "application/json", "content-encoding": encoding},
    )
    error = r.json()["error"]
    assert (
        r.status_code == 415
        and error["reason"] == "unsupported_media_type"
        and encoding in error["message"]
    )


def test_without_max_tokens_a_request_gets_what_fits_at_the_speed_the_gate_tracks():
    """The tracker saw the machine run 2x slow: the default is what fits then, and is admitted on an
    idle gate (it was the calibrated speed's 235 tokens, which predictive refused with a 503)."""
    gate = Gate([SyntheticEngine(speed=1e-4)], gate_config(preset("predictive")))
    gate.tracker.factor = 2.0
    with TestClient(create_app(gate)) as c:
        answer = c.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200, answer.text
        assert (
            answer.json()["usage"]["completion_tokens"]
            == gate.fitting_tokens(None, 0, 2.0)
            < FITS_2S
        )
