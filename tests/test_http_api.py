"""The service end to end: a real `qlab serve` subprocess on loopback with the synthetic engine.

Synthetic service time is the reference line, 1 ms + 8.5 ms/token: 64 tokens take 0.545 s.
"""

import asyncio
import json
import select
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from experiments.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUTCOME_OF = {"overloaded": "rejected", "deadline_exceeded": "expired", "engine_error": "error"}


def start_server(log_path: Path, *flags: str, timeout_s: float = 60.0):
    """Start `qlab serve --port 0` and read its URL from the first stdout line."""
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "experiments",
            "serve",
            "--engine",
            "synthetic",
            "--port",
            "0",
            *flags,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("qlab serve: listening on http://127.0.0.1:"):
        proc.kill()
        raise AssertionError(f"server did not start: {line!r}; log: {log_path.read_text()}")
    return proc, line.split("listening on ")[1].strip()


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    proc, address = start_server(
        tmp_path_factory.mktemp("serve") / "serve.log",
        "--policy",
        "bounded-deadline",
        "--max-queue",
        "2",
    )
    yield address
    stop_server(proc)


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats").json()


def client_outcome(response) -> str:
    if response.status_code == 200:
        return response.json()["outcome"]
    return OUTCOME_OF[response.json()["error"]["type"]]


def assert_envelope(response, status: int, type_: str, reason: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"type", "reason", "code", "message", "numbers", "retry_after_s"}
    assert error["type"] == type_ and error["message"]
    if reason is not None:
        assert error["reason"] == reason, error
    return error


async def _post_all(url: str, bodies: list[dict]) -> list:
    # One connection per request (no pool limit): the client must never make a request wait.
    async with httpx.AsyncClient(
        base_url=url, timeout=10, limits=httpx.Limits(max_connections=None)
    ) as client:
        return await asyncio.gather(*(client.post("/v1/generate", json=b) for b in bodies))


@pytest.mark.slow
def test_burst_gives_both_overload_envelopes_and_matching_stats(url):
    before = stats(url)
    # One runs (0.545 s), two wait, one is refused (queue full); at 0.545 s neither waiting
    # one can finish by 0.8 s, so both are dropped at the front.
    responses = asyncio.run(
        _post_all(
            url, [{"prompt": f"p{i}", "max_new_tokens": 64, "deadline_ms": 800} for i in range(4)]
        )
    )
    outcomes = sorted(client_outcome(r) for r in responses)
    assert outcomes == ["expired", "expired", "good", "rejected"]
    for r in responses:
        if r.status_code == 503:
            error = r.json()["error"]
            assert error["type"] in ("overloaded", "deadline_exceeded")
            assert int(r.headers["Retry-After"]) == error["retry_after_s"] >= 1
            reason = "queue_full" if error["type"] == "overloaded" else "cannot_finish"
            assert_envelope(r, 503, error["type"], reason)
            assert {"est_service_s", "queued", "queued_work_s", "deadline_s"} <= set(
                error["numbers"]
            )
    after = stats(url)
    delta = {k: after["counts"][k] - before["counts"][k] for k in after["counts"]}
    assert delta == {
        o: outcomes.count(o)
        for o in ("good", "late", "rejected", "expired", "error", "abandoned", "cancelled")
    }
    assert after["waiting"] == 0 and after["in_service"] == 0


@pytest.mark.slow
def test_request_without_deadline_is_valid_and_timed(url):
    r = httpx.post(f"{url}/v1/generate", json={"prompt": "hello", "max_new_tokens": 4}, timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["outcome"] == "good" and body["tokens"] == 4 and body["text"] == " tok" * 4
    assert body["admission"]["deadline_s"] == 2.0 and body["engine"] == 0
    t = body["timings"]
    assert t["queue_s"] >= 0 and t["engine_s"] > 0.03 and t["total_s"] >= t["engine_s"]
    assert t["est_service_s"] > 0


@pytest.mark.slow
def test_stop_may_be_one_string_or_a_list(url):
    for stop in ("tok tok", ["zzz", "tok tok"]):
        r = httpx.post(
            f"{url}/v1/generate",
            json={"prompt": "x", "max_new_tokens": 3, "stop": stop},
            timeout=10,
        )
        assert r.status_code == 200 and r.json()["text"] == " "


BIG = "a" * 70_000
BAD = {
    "malformed json": (
        {
            "content": b'{"prompt": "x", "max_new_tokens":',
            "headers": {"content-type": "application/json"},
        },
        400,
        "malformed_json",
    ),
    "not an object": ({"json": [1, 2]}, 422, "invalid_field"),
    "missing field": ({"json": {"prompt": "x"}}, 422, "invalid_field"),
    "prompt not a string": ({"json": {"prompt": 5, "max_new_tokens": 4}}, 422, "invalid_field"),
    "tokens as a string": ({"json": {"prompt": "x", "max_new_tokens": "4"}}, 422, "invalid_field"),
    "tokens as a bool": ({"json": {"prompt": "x", "max_new_tokens": True}}, 422, "invalid_field"),
    "tokens 0": ({"json": {"prompt": "x", "max_new_tokens": 0}}, 422, "invalid_field"),
    "tokens huge": ({"json": {"prompt": "x", "max_new_tokens": 5000}}, 422, "invalid_field"),
    "deadline negative": (
        {"json": {"prompt": "x", "max_new_tokens": 4, "deadline_ms": -5}},
        422,
        "invalid_field",
    ),
    "deadline huge": (
        {"json": {"prompt": "x", "max_new_tokens": 4, "deadline_ms": 10**12}},
        422,
        "invalid_field",
    ),
    "deadline a float": (
        {"json": {"prompt": "x", "max_new_tokens": 4, "deadline_ms": 1.5}},
        422,
        "invalid_field",
    ),
    "empty stop": (
        {"json": {"prompt": "x", "max_new_tokens": 4, "stop": ""}},
        422,
        "invalid_field",
    ),
    "unknown field": (
        {"json": {"prompt": "x", "max_new_tokens": 4, "temperature": 0.7}},
        422,
        "invalid_field",
    ),
    "prompt too many chars": (
        {"json": {"prompt": "a" * 20_000, "max_new_tokens": 4}},
        422,
        "invalid_field",
    ),
    "prompt too many tokens": (
        {"json": {"prompt": "\u00e9" * 9_000, "max_new_tokens": 4}},
        422,
        "prompt_too_long",
    ),
    "body too large": (
        {
            "content": json.dumps({"prompt": BIG, "max_new_tokens": 4}).encode(),
            "headers": {"content-type": "application/json"},
        },
        413,
        "body_too_large",
    ),
    "wrong media type": (
        {"content": b"prompt=x", "headers": {"content-type": "text/plain"}},
        415,
        "unsupported_media_type",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_an_envelope_and_the_service_keeps_serving(url, case):
    kwargs, status, reason = BAD[case]
    error = assert_envelope(
        httpx.post(f"{url}/v1/generate", timeout=10, **kwargs), status, "invalid_request", reason
    )
    assert error["retry_after_s"] is None
    ok = httpx.post(f"{url}/v1/generate", json={"prompt": "x", "max_new_tokens": 1}, timeout=10)
    assert ok.status_code == 200


@pytest.mark.slow
def test_streamed_body_over_the_cap_is_refused_while_reading(url):
    async def chunks():
        for _ in range(80):
            yield b"a" * 1024

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            return await client.post(
                "/v1/generate", content=chunks(), headers={"content-type": "application/json"}
            )

    assert_envelope(asyncio.run(go()), 413, "invalid_request", "body_too_large")


@pytest.mark.slow
def test_unknown_route_and_method_get_envelopes(url):
    assert_envelope(httpx.get(f"{url}/v2/nothing"), 404, "invalid_request", "not_found")
    r = httpx.get(f"{url}/v1/generate")
    assert_envelope(r, 405, "invalid_request", "method_not_allowed")
    assert "POST" in r.headers["allow"]


@pytest.mark.slow
def test_health_routes_and_head_as_orchestrators_send_them(url):
    # liveness (guidellm's start-up check)
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{url}/ready").json() == {"ready": True}
    for path in (
        "/health",
        "/ready",
        "/healthz",
        "/stats",
        "/metrics",
        "/v1/models",
        "/openapi.json",
    ):
        got, head = httpx.get(f"{url}{path}"), httpx.head(f"{url}{path}")
        # the server leaves the body out
        assert head.status_code == 200 and head.content == b"", path
        assert head.headers["content-type"] == got.headers["content-type"], path
    assert httpx.head(f"{url}/v1/generate").status_code == 405


@pytest.mark.slow
def test_healthz_and_stats_shape(url):
    health = httpx.get(f"{url}/healthz").json()
    assert health["status"] == "ok" and health["engine"]["engine"] == "synthetic"
    s = stats(url)
    assert set(s["counts"]) == {
        "good",
        "late",
        "rejected",
        "expired",
        "error",
        "abandoned",
        "cancelled",
    }
    assert s["policy"]["name"] == "bounded-deadline" and s["policy"]["max_queue"] == 2
    assert s["engines"] == 1 and s["fixed_estimate"] is False and s["speed_factor"] > 0
    assert s["service_model"] == {
        "intercept_s": 0.001,
        "per_token_s": 0.0085,
        "per_prompt_token_s": 0.0,
    }


@pytest.mark.slow
def test_client_disconnect_while_waiting_leaves_the_queue(url):
    before = stats(url)

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            running = asyncio.ensure_future(
                client.post("/v1/generate", json={"prompt": "a", "max_new_tokens": 64})
            )
            # the first holds the engine
            while (await client.get("/stats")).json()["in_service"] == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(httpx.TimeoutException):
                await client.post(
                    "/v1/generate", json={"prompt": "b", "max_new_tokens": 64}, timeout=0.15
                )
            seen = None
            for _ in range(40):  # the server notices the hang-up within a few milliseconds
                seen = (await client.get("/stats")).json()
                if seen["cancelled"] > before["cancelled"]:
                    break
                await asyncio.sleep(0.01)
            return seen, await running

    during, first = asyncio.run(go())
    assert during["cancelled"] == before["cancelled"] + 1
    assert during["waiting"] == 0 and during["in_service"] == 1 and during["queued_work_s"] == 0
    assert first.status_code == 200


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--engine", "gpt2", "--speed", "2"],
        ["serve", "--engine", "synthetic", "--model", "tiny"],
        ["serve", "--port", "70000"],
        ["serve", "--engines", "0"],
        ["serve", "--speed-schedule", "10-2"],
        ["serve", "--service-model", "/nonexistent/model.json"],
    ],
)
def test_bad_serve_arguments_are_one_line_and_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err


@pytest.mark.slow
def test_torch_is_not_imported_for_the_synthetic_engine():
    code = (
        "import sys; from experiments.cli import build_parser; from live import http_api, "
        "gate, engine; "
        "build_parser(); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# ---------------------------------------------------------------------- the direct path


def _in_process_answers(direct: bool, requests: list[dict], submit=None) -> list[tuple]:
    """Send ``requests`` in order to a fresh in-process app; (status, Retry-After, body without
    timings) each."""
    from live.engine import Faults, SyntheticEngine
    from live.gate import Gate, gate_config
    from live.http_api import create_app
    from qsim import preset

    engine = SyntheticEngine(speed=1e-4, faults=Faults(fail_every=3))  # runs 3, 6, ... raise
    gate = Gate([engine], gate_config(preset("predictive"), fixed_estimate=True))
    if submit is not None:
        gate.submit = submit
    app = create_app(gate, direct=direct)
    assert (app.direct is not None) == direct

    def comparable(r) -> tuple:
        body = r.json()
        body.pop("timings", None)
        for numbers in (body.get("admission"), body.get("error", {}).get("numbers")):
            if numbers:  # the arrival's clock reading differs between runs
                numbers.pop("arrived_at", None)
        # a refusal's message quotes the measured wait; its numbers are checked apart
        if "error" in body:
            body["error"]["message"] = bool(body["error"]["message"])
            body["error"]["numbers"] = sorted(body["error"]["numbers"])
        return r.status_code, r.headers.get("retry-after"), body

    async def go() -> list[tuple]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://qlab.test"
            ) as client:
                return [comparable(await client.post("/v1/generate", **r)) for r in requests]

    return asyncio.run(go())


def test_direct_path_answers_as_fastapi_routing_does():
    """The shortcut past FastAPI's routing changes how fast POST /v1/generate answers, not what
    it answers."""
    ok = {"json": {"prompt": "hello", "max_new_tokens": 4}}
    requests = [
        ok,
        ok,
        ok,  # the third run fails: engine_error
        # never in time: deadline_too_short
        {"json": {"prompt": "late", "max_new_tokens": 4, "deadline_ms": 1}},
        {"content": b"{not json", "headers": {"content-type": "application/json"}},
        {"json": {"prompt": "x", "max_new_tokens": "4"}},
        {"json": {"prompt": "x" * 20_000, "max_new_tokens": 1}},
        {"content": b"x" * (70 * 1024), "headers": {"content-type": "application/json"}},
        {"content": b"prompt=x", "headers": {"content-type": "text/plain"}},
        ok,
    ]
    direct, routed = _in_process_answers(True, requests), _in_process_answers(False, requests)
    assert direct == routed
    statuses = [status for status, _, _ in direct]
    assert statuses == [200, 200, 500, 400, 400, 422, 422, 413, 415, 200], direct


def test_direct_path_turns_an_unexpected_error_into_the_envelope(caplog):
    def broken_submit(job):
        raise RuntimeError("a bug in the gate")

    requests = [{"json": {"prompt": "x", "max_new_tokens": 1}}]
    with caplog.at_level("ERROR", logger="live.http_api"):
        [(status, _, body)] = _in_process_answers(True, requests, submit=broken_submit)
    assert (
        status == 500
        and body["error"]["type"] == "internal_error"
        and body["error"]["reason"] == "unexpected"
    )
    assert "a bug in the gate" in caplog.text  # the traceback is logged, as Starlette would log it
    assert _in_process_answers(False, requests, submit=broken_submit) == [(status, None, body)]


@pytest.mark.slow
def test_a_client_over_its_rate_gets_429_rate_limited_apart_from_503_overloaded(tmp_path):
    # One engine, bound 0 (the Erlang loss system: busy means refused), each client 1 request/s in
    # bursts of 2. The first run hangs 30 s (deaf to its client leaving, as a wedged engine), so the
    # engine stays busy.
    proc, address = start_server(
        tmp_path / "serve.log",
        "--policy",
        "bounded",
        "--max-queue",
        "0",
        "--policy-arg",
        "client_rate=1",
        "--policy-arg",
        "client_burst=2",
        "--speed",
        "20",
        "--hang-after",
        "0",
        "--hang-for",
        "30",
    )
    try:
        body = {"prompt": "x", "max_new_tokens": 64}  # 64 tokens x 20: about 11 s on the engine
        httpx.post(f"{address}/v1/generate", json={**body, "client_id": "a"}, timeout=0.5)
    except httpx.ReadTimeout:  # the first runs; its answer is not awaited
        pass
    try:
        busy = httpx.post(f"{address}/v1/generate", json={**body, "client_id": "a"}, timeout=10)
        limited = httpx.post(
            f"{address}/v1/generate", json=body, headers={"x-client-id": "a"}, timeout=10
        )
        other = httpx.post(f"{address}/v1/generate", json={**body, "client_id": "b"}, timeout=10)
        assert busy.status_code == 503 and busy.json()["error"]["type"] == "overloaded"
        assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1
        error = limited.json()["error"]
        assert (error["type"], error["reason"]) == ("rate_limited", "rate_limited")
        assert (
            "over its limit of 1 requests/s" in error["message"]
            and error["numbers"]["client_rate"] == 1
        )
        # b has its own bucket: refused for the busy engine, not for a's rate
        assert other.status_code == 503
        seen = stats(address)
        assert (
            seen["rejected_by_reason"]["rate_limited"] == 1 and seen["policy"]["client_rate"] == 1.0
        )
        too_long = httpx.post(
            f"{address}/v1/generate", json=body, headers={"x-client-id": "c" * 129}, timeout=10
        )
        assert too_long.status_code == 422 and "x-client-id" in too_long.json()["error"]["message"]
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_priority_is_an_integer_field_with_bounds(url):
    ok = httpx.post(
        f"{url}/v1/generate", json={"prompt": "x", "max_new_tokens": 1, "priority": -2}, timeout=10
    )
    assert ok.status_code in (200, 503)  # admitted or refused, never a 4xx for a valid priority
    for bad in (5000, "high", 1.5):
        r = httpx.post(
            f"{url}/v1/generate",
            json={"prompt": "x", "max_new_tokens": 1, "priority": bad},
            timeout=10,
        )
        assert (
            r.status_code == 422
            and r.json()["error"]["reason"] == "invalid_field"
            and "priority" in r.json()["error"]["message"]
        )


@pytest.mark.slow
def test_sigterm_answers_the_waiting_at_once_and_logs_no_error(tmp_path):
    """The one engine runs an 8.5 s request; a second waits. SIGTERM: the waiting one is answered at
    once (it was never started), the running one when the 5 s of graceful shutdown run out (it was);
    the log holds no ERROR line."""
    log = tmp_path / "serve.log"
    proc, url = start_server(log, "--policy", "none", "--log-level", "info")
    try:
        with httpx.Client(base_url=url, timeout=30) as client:

            async def go():
                async with httpx.AsyncClient(base_url=url, timeout=30) as a:
                    running = asyncio.ensure_future(
                        a.post("/v1/generate", json={"prompt": "x", "max_new_tokens": 1000})
                    )
                    while client.get("/stats").json()["in_service"] == 0:
                        await asyncio.sleep(0.01)
                    waiting = asyncio.ensure_future(
                        a.post("/v1/generate", json={"prompt": "x", "max_new_tokens": 4})
                    )
                    while client.get("/stats").json()["waiting"] == 0:
                        await asyncio.sleep(0.01)
                    proc.terminate()
                    first = await asyncio.wait(
                        [running, waiting], return_when=asyncio.FIRST_COMPLETED
                    )
                    return [t is waiting for t in first[0]], await waiting, await running

            firsts, waited, ran = asyncio.run(go())
    finally:
        stop_server(proc)
    # the waiting one was answered first, not held to the end of the graceful shutdown
    assert firsts == [True]
    for r, said in ((waited, "did not start this request"), (ran, "stopped this request")):
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert (
            r.json()["error"]["reason"] == "shutting_down" and said in r.json()["error"]["message"]
        )
    text = log.read_text()
    assert "Cancel 1 running task(s)" in text and "ERROR" not in text, text


@pytest.mark.slow
def test_tls_and_a_key_as_an_openai_compatible_server_has_them(tmp_path, monkeypatch):
    """--ssl-certfile/--ssl-keyfile (uvicorn's TLS) and a key from QLAB_API_KEY, through a real
    server."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate with")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("QLAB_API_KEY", "sk-test-key")
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "experiments",
            "serve",
            "--port",
            "0",
            "--host",
            "127.0.0.1",
            "--ssl-certfile",
            str(cert),
            "--ssl-keyfile",
            str(key),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("qlab serve: listening on https://127.0.0.1:"), line
        url = line.split("listening on ")[1].strip()
        body = {"prompt": "x", "max_new_tokens": 2}
        with httpx.Client(
            base_url=url, verify=ssl.create_default_context(cafile=str(cert)), timeout=30
        ) as client:
            assert client.post("/v1/generate", json=body).status_code == 401
            ok = client.post(
                "/v1/generate", json=body, headers={"authorization": "Bearer sk-test-key"}
            )
            assert ok.status_code == 200 and ok.json()["tokens"] == 2
            assert client.get("/health").status_code == 200
    finally:
        stop_server(proc)
        log.close()
    assert "sk-test-key" not in (tmp_path / "serve.log").read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--auth-stats"], "--auth-stats: only with --api-key"),
        (["--ssl-certfile", "x.pem"], "--ssl-certfile: only with --ssl-keyfile"),
        (
            ["--ssl-certfile", "nope.pem", "--ssl-keyfile", "nope.key"],
            "not a usable certificate and key",
        ),
        (["--api-key-file", "nope.txt"], "--api-key-file nope.txt: cannot read it"),
    ],
)
def test_bad_key_and_tls_options_are_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("QLAB_API_KEY", raising=False)
    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
