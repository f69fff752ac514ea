"""``qlab serve --engine upstream``: the gate in front of an OpenAI-compatible server
(live/upstream.py).

The upstream is the synthetic engine behind the same API, started as a process:
``qlab serve --engine synthetic --policy none`` (a gate with no admission limit). Two pairs run:

* ``ok``: an upstream on the reference line (4 tokens: 35 ms), and a ``predictive`` gate in front
  of it with two engines: answers through the openai SDK, streaming, calibration, and a client that
  hangs up mid-run (the upstream must see it leave and count it cancelled);
* ``faulty``: an upstream whose run 3 hangs 5 s and every 4th run fails (``--hang-after 2
  --hang-for 5 --fail-every 4``; runs 1 and 2 are the gate's start-up probes of its two routes), and
  a gate with a 2 s ``--upstream-timeout`` (a 35 ms answer fits it many times over): 504, then 502,
  then 200, in that order, so one test drives it.

What the engine does with a stream (usage or not, errors in it, broken off, cancelled) is
checked in-process against a scripted HTTP server, byte by byte.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import socket
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from experiments.cli import main  # noqa: E402
from live.calibrate import CalibrationConfig, calibrate  # noqa: E402
from live.engine import Asked, Cancel, UpstreamError, UpstreamTimeout  # noqa: E402
from live.gate import Gate, gate_config  # noqa: E402
from live.gate_errors import UpstreamTimedOut  # noqa: E402
from live.jobs import Job  # noqa: E402
from live.procs import Server  # noqa: E402
from live.serve_options import ServeOptions, check_upstream_url  # noqa: E402
from live.upstream import (  # noqa: E402
    API_KEY_ENV,
    FRESH_S,
    UpstreamEngine,
    UpstreamHealth,
    UpstreamRoutes,
    UpstreamSpec,
    api_key,
    probe_routes,
    resolve_model,
)
from qsim import preset  # noqa: E402
from qsim.config import StallRule  # noqa: E402
from fake_http import listening, read_request  # noqa: E402

MODEL = "synthetic"  # the upstream's model, which the gate serves under the same name
UPSTREAMS = {
    "ok": ServeOptions(policy="none", engines=2),
    "faulty": ServeOptions(policy="none", hang_after=2, hang_for=5.0, fail_every=4),
}


@contextmanager
def _started(named: dict[str, ServeOptions], log_dir) -> Iterator[dict[str, str]]:
    """Start every server at once, yield their URLs by name, always stop them."""
    with ExitStack() as stack:
        servers = {}
        for name, options in named.items():
            servers[name] = server = Server(options, log_dir / f"{name}.log")
            stack.callback(server.stop)
            server.spawn()
        yield {name: server.wait_ready(60) for name, server in servers.items()}


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    """{"ok": (gate, upstream), "faulty": (gate, upstream)}."""
    logs = tmp_path_factory.mktemp("upstream-logs")
    with _started({f"up-{k}": v for k, v in UPSTREAMS.items()}, logs) as up:
        gates = {
            "ok": ServeOptions(
                policy="predictive",
                deadline=600.0,
                engine="upstream",
                engines=2,
                upstream_url=up["up-ok"],
            ),
            "faulty": ServeOptions(
                policy="none", engine="upstream", upstream_url=up["up-faulty"], upstream_timeout=2.0
            ),
        }
        with _started({f"gate-{k}": v for k, v in gates.items()}, logs) as gate:
            yield {k: (gate[f"gate-{k}"], up[f"up-{k}"]) for k in gates}


def sdk(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=10).json()


def until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait for something that must happen (the bound only keeps a broken build from hanging)."""
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.02)


def metrics(url: str) -> dict:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


# ================================================================== through real servers


@pytest.mark.slow
def test_completion_and_chat_through_the_gate(urls):
    gate, _ = urls["ok"]
    client = sdk(gate)
    # the upstream's model, asked for at start-up
    assert [m.id for m in client.models.list()] == [MODEL]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5)
    assert (
        r.choices[0].text == " tok" * 5
        and r.usage.completion_tokens == 5
        and r.choices[0].finish_reason == "length"
    )
    qlab = r.to_dict()["qlab"]
    assert (
        qlab["outcome"] == "good"
        and 0 < qlab["first_token_s"] <= qlab["engine_s"] <= qlab["total_s"]
    )
    # forwarded upstream
    stopped = client.completions.create(model=MODEL, prompt="x", max_tokens=3, stop="k t")
    assert stopped.choices[0].text == " to"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content == " tok" * 4 and chat.usage.completion_tokens == 4
    body = httpx.post(
        f"{gate}/v1/generate", json={"prompt": "x", "max_new_tokens": 3}, timeout=30
    ).json()
    assert (
        body["tokens"] == 3 and 0 < body["timings"]["first_token_s"] <= body["timings"]["engine_s"]
    )
    health = httpx.get(f"{gate}/healthz", timeout=10).json()
    assert health["engine"] == {
        "engine": "upstream",
        "url": urls["ok"][1],
        "model": MODEL,
        "timeout_s": 60.0,
        "tokenizer": "bytes",
        "routes": {"completions": True, "chat": True, "continuous_usage": True},
    }
    assert health["engines"] == 2 and health["ready"] is True and health["not_ready"] == []


@pytest.mark.slow
def test_a_streamed_chat_through_the_gate(urls):
    gate, _ = urls["ok"]
    stream = sdk(gate).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " tok" * 6
    assert chunks[-1].usage.completion_tokens == 6


@pytest.mark.slow
def test_calibrate_an_upstream_backed_gate(urls):
    gate, _ = urls["ok"]
    cal = calibrate(
        CalibrationConfig(gate, rounds=1, per_size=2, sizes=(1, 8), deadline_ms=600_000)
    )
    (only,) = cal.rounds
    assert only.tokens == (1, 8, 1, 8) and all(s > 0 for s in only.engine_s)


def _hang_up_once_upstream_runs(gate: str, upstream: str, tokens: int) -> None:
    """Send a request on a raw socket and close it once the upstream is running it."""
    body = json.dumps({"prompt": "x", "max_new_tokens": tokens, "deadline_ms": 600_000}).encode()
    host, port = gate.removeprefix("http://").split(":")
    running = stats(upstream)["in_service"]
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/generate HTTP/1.1\r\nhost: localhost\r\ncontent-type: "
            b"application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        until(lambda: stats(upstream)["in_service"] > running)


@pytest.mark.slow
def test_a_client_hanging_up_cancels_the_upstream_request(urls):
    gate, upstream = urls["ok"]
    before_gate, before_up = stats(gate), stats(upstream)
    _hang_up_once_upstream_runs(gate, upstream, 1000)  # 8.5 s upstream unless cancelled
    # The upstream saw its client (the gate's engine) leave: cancelled, and its engine stopped.
    until(
        lambda: (
            stats(upstream)["cancelled"] == before_up["cancelled"] + 1
            and stats(upstream)["in_service"] == 0
        )
    )
    until(lambda: stats(gate)["in_service"] == 0)
    after_gate, after_up = stats(gate), stats(upstream)
    left = {**before_up["counts"], "abandoned": before_up["counts"]["abandoned"] + 1}
    assert after_up["counts"] == left  # it never finished: its client (the gate) left
    assert after_gate["cancelled"] == before_gate["cancelled"] + 1
    assert after_gate["counts"] == {
        **before_gate["counts"],
        "abandoned": before_gate["counts"]["abandoned"] + 1,
    }
    # a cut-short time teaches nothing
    assert after_gate["speed_factor"] == before_gate["speed_factor"]
    assert (
        sdk(gate).completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text
        == " tok" * 2
    )


def _error(exc: "openai.APIStatusError", status: int, reason: str) -> dict:
    assert exc.status_code == status and exc.code == reason
    error = exc.response.json()["error"]
    assert error["type"] == "engine_error" and error["reason"] == reason
    return error


@pytest.mark.slow
def test_upstream_timeout_then_failure_then_the_gate_serves_on(urls):
    # after the 2 probes, upstream run 3 hangs 5 s, runs 4, 8, ... fail; the gate waits 2 s
    gate, upstream = urls["faulty"]
    client = sdk(gate)
    with pytest.raises(openai.InternalServerError) as timeout:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    assert "sent nothing for 2 s" in _error(timeout.value, 504, "upstream_timeout")["message"]
    # the hang ends; the upstream counted its client gone
    until(lambda: stats(upstream)["in_service"] == 0)
    assert stats(upstream)["cancelled"] == 1
    # streaming too: a plain JSON error, not a stream
    with pytest.raises(openai.InternalServerError) as failure:
        list(client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True))
    message = _error(failure.value, 502, "upstream_error")["message"]
    assert "HTTP 500" in message and "injected failure on run 4" in message
    assert stats(gate)["speed_factor"] == 1.0  # neither failure taught the tracker anything
    assert (
        client.completions.create(model=MODEL, prompt="x", max_tokens=4).choices[0].text
        == " tok" * 4
    )
    samples = metrics(gate)
    assert samples[("qlab_upstream_errors_total", ())] == 2
    assert (
        samples[("qlab_requests_total", (("outcome", "error"), ("reason", "upstream_error")))] == 1
    )
    assert (
        samples[("qlab_requests_total", (("outcome", "error"), ("reason", "upstream_timeout")))]
        == 1
    )
    after = stats(gate)
    assert after["counts"]["error"] == 2 and after["counts"]["good"] + after["counts"]["late"] == 1
    assert httpx.get(f"{gate}/healthz", timeout=10).json()["status"] == "ok"


# ================================================================== the command line


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--upstream-url", "http://127.0.0.1:8001"],
            "--upstream-url: only with --engine upstream",
        ),
        (["--engine", "upstream"], "--engine upstream needs --upstream-url URL"),
        (["--engine", "upstream", "--upstream-url", "ftp://x"], "must be http://HOST[:PORT]"),
        (
            ["--engine", "gpt2", "--upstream-timeout", "3"],
            "--upstream-timeout: only with --engine upstream",
        ),
        (
            [
                "--engine",
                "upstream",
                "--upstream-url",
                "http://127.0.0.1:1",
                "--upstream-timeout",
                "0",
            ],
            "must be > 0",
        ),
    ],
)
def test_bad_upstream_options_are_one_line_and_exit_2(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


def _closed_port() -> int:
    """A loopback port nothing listens on (bound for a moment, never listening: connections are
    refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_upstream_is_one_line_and_exit_2(capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["serve", "--engine", "upstream", "--upstream-url", url, "--port", "0"]) == 2
    (err,) = capsys.readouterr().err.splitlines()
    assert err.startswith(
        f"qlab: error: --upstream-url {url}: cannot reach the upstream (ConnectError"
    ), err


def test_upstream_options_in_a_server_table_and_a_childs_argv():
    options = ServeOptions(
        engine="upstream",
        engines=3,
        upstream_url="http://h:1",
        upstream_model="m",
        upstream_timeout=5.0,
    )
    assert options.argv()[4:] == [
        "--engine",
        "upstream",
        "--engines",
        "3",
        "--upstream-url",
        "http://h:1",
        "--upstream-model",
        "m",
        "--upstream-timeout",
        "5.0",
    ]
    assert (
        ServeOptions.from_table(
            "t", {"engine": "upstream", "upstream_url": "http://h:1"}
        ).upstream_url
        == "http://h:1"
    )
    from inputs.tomlfiles import ConfigError

    with pytest.raises(ConfigError, match=r"t.upstream_url: required with engine = 'upstream'"):
        ServeOptions.from_table("t", {"engine": "upstream"})
    # an OpenAI base URL is taken too
    assert check_upstream_url("http://h:8001/v1/") == "http://h:8001"


# ================================================================== the engine against a scripted
# server


@contextmanager
def scripted(respond: Callable[[socket.socket, bytes], None]) -> Iterator[str]:
    """A server that answers each connection's one request with ``respond(conn, request_body)``."""
    with listening(lambda conn: respond(conn, read_request(conn)[2])) as url:
        yield url


def _sse(*events: dict | str, done: bool = True, status: str = "200 OK") -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        + "".join(lines)
        + ("data: [DONE]\n\n" if done else "")
    ).encode()


def _plain(status: str, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (status.encode(), len(body), body)


def _chunk(text: str, usage: int | None = None) -> dict:
    choices = (
        [{"index": 0, "text": text, "finish_reason": None, "stop_reason": None}]
        if usage is None
        else []
    )
    chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": choices}
    return (
        {
            **chunk,
            "usage": {"prompt_tokens": 1, "completion_tokens": usage, "total_tokens": usage + 1},
        }
        if usage is not None
        else chunk
    )


def _engine(url: str, timeout_s: float = 10.0) -> UpstreamEngine:
    return UpstreamEngine(UpstreamSpec(url, "m", timeout_s), "m")


@pytest.mark.slow
def test_the_engine_reads_text_usage_and_the_first_token_from_the_stream():
    seen = []

    def respond(conn, body):
        seen.append(json.loads(body))
        conn.sendall(_sse(_chunk("Hel"), _chunk("lo"), _chunk("", usage=7)))

    with scripted(respond) as url:
        result = _engine(url).run("p", 9, ["x"])
    # tokens: the upstream's usage
    assert (result.text, result.tokens, result.stopped) == ("Hello", 7, False)
    assert 0 < result.first_token_s <= result.engine_s
    assert seen == [
        {
            "model": "m",
            "prompt": "p",
            "max_tokens": 9,
            "stop": ["x"],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ]


@pytest.mark.slow
def test_without_usage_the_chunks_are_counted():
    with scripted(lambda conn, _: conn.sendall(_sse(_chunk("a"), _chunk(""), _chunk("b")))) as url:
        assert _engine(url).run("p", 5).tokens == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "answer, message",
    [
        # the upstream went away mid-stream
        (_sse(_chunk("a"), done=False), "ended before data: [DONE]"),
        (
            b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\ndata: {"id": ',
            "ClientPayloadError",
        ),
        (
            _sse(_chunk("a"), {"error": {"message": "out of memory"}}),
            "failed mid-stream: out of memory",
        ),
        (_sse("not json"), "not a completion chunk"),
        (
            _plain("500 Internal Server Error", b'{"error": {"message": "boom!!"}}'),
            "answered HTTP 500: boom!!",
        ),
        (_plain("400 Bad Request", b"nope"), "answered HTTP 400: nope"),
    ],
)
def test_upstream_failures_are_upstream_errors(answer, message):
    with scripted(lambda conn, _: conn.sendall(answer)) as url:
        with pytest.raises(UpstreamError, match=re.escape(message)) as caught:
            _engine(url).run("p", 5)
    assert type(caught.value) is UpstreamError


def _holding(left: threading.Event, asked: threading.Event | None = None):
    """Answers nothing; sets ``asked`` once the request is in, ``left`` when the client closes
    its side."""

    def respond(conn, _):
        if asked is not None:
            asked.set()
        conn.settimeout(30)
        try:
            left.set() if conn.recv(1) == b"" else None
        except OSError:
            left.set()

    return respond


@pytest.mark.slow
def test_silence_past_the_timeout_is_an_upstream_timeout():
    left = threading.Event()
    with scripted(_holding(left)) as url:
        with pytest.raises(UpstreamTimeout, match="sent nothing for 0.3 s"):
            _engine(url, timeout_s=0.3).run("p", 5)
        assert left.wait(10)  # and the engine hung up


@pytest.mark.slow
def test_a_cancel_shuts_the_connection_while_the_engine_waits():
    left, asked, cancel, box = threading.Event(), threading.Event(), Cancel(), []
    with scripted(_holding(left, asked)) as url:
        engine = _engine(url)
        runner = threading.Thread(target=lambda: box.append(engine.run("p", 5, cancel=cancel)))
        runner.start()
        assert asked.wait(10)  # the request is in: the engine waits for its answer (or is about to)
        cancel.set()
        runner.join(10)
        assert left.wait(10)  # the upstream saw its client leave
    assert box and box[0].stopped and box[0].tokens == 0


def test_an_unreachable_engine_call_is_an_upstream_error():
    with pytest.raises(UpstreamError, match="ClientConnectorError"):
        _engine(f"http://127.0.0.1:{_closed_port()}").run("p", 5)


@pytest.mark.slow
def test_the_model_is_asked_for_at_start_up():
    def models(data):
        return lambda conn, _: conn.sendall(
            _plain("200 OK", json.dumps({"object": "list", "data": data}).encode())
        )

    with scripted(
        models(
            [
                {"id": "llama", "object": "model", "created": 1, "owned_by": "vllm", "root": "x"},
                {"id": "other"},
            ]
        )
    ) as url:
        assert resolve_model(UpstreamSpec(url)) == "llama"
        assert resolve_model(UpstreamSpec(url, "mine")) == "mine"
    with scripted(models([])) as url:
        with pytest.raises(ValueError, match="lists no model; name one with --upstream-model"):
            resolve_model(UpstreamSpec(url))


# ================================================================== chats stay chats, keys,
# overruns, readiness


@dataclass(frozen=True)
class Seen:
    """One request a scripted upstream received."""

    path: str
    headers: dict
    body: dict | None


@contextmanager
def recording(answer: Callable[[str, dict | None], bytes]) -> Iterator[tuple[str, list[Seen]]]:
    """A scripted upstream answering ``answer(path, body)``; yields its URL and what it received."""
    seen: list[Seen] = []

    def handle(conn):
        line, headers, body = read_request(conn)
        seen.append(Seen(line.split()[1], headers, json.loads(body) if body else None))
        conn.sendall(answer(seen[-1].path, seen[-1].body))

    with listening(handle) as url:
        yield url, seen


def _chat_chunk(text: str) -> dict:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }


def _streams(path: str, _body) -> bytes:
    """A streamed answer in the shape of the route asked: chat chunks or completion chunks."""
    if path == "/v1/chat/completions":
        return _sse(_chat_chunk("Hel"), _chat_chunk("lo"), _chunk("", usage=2))
    return _sse(_chunk("Hel"), _chunk("lo"), _chunk("", usage=2))


MESSAGES = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
)
SAMPLING = (
    ("temperature", 0.0),
    ("top_k", 5),
    ("ignore_eos", True),
    ("add_generation_prompt", True),
)


@pytest.mark.slow
def test_a_chat_goes_to_the_chat_route_with_its_messages_and_the_clients_sampling_fields():
    with recording(_streams) as (url, seen):
        result = _engine(url).run(
            "system: Be brief.\nuser: Hi\nassistant:",
            9,
            ["x"],
            asked=Asked(messages=MESSAGES, sampling=SAMPLING),
        )
    assert (result.text, result.tokens) == ("Hello", 2)
    assert seen == [
        Seen(
            "/v1/chat/completions",
            seen[0].headers,
            {
                "model": "m",
                "messages": list(MESSAGES),
                "max_tokens": 9,
                "stop": ["x"],
                "stream": True,
                "stream_options": {"include_usage": True},
                "temperature": 0.0,
                "top_k": 5,
                "ignore_eos": True,
                "add_generation_prompt": True,
            },
        )
    ]
    assert "authorization" not in seen[0].headers  # no key given: none sent


@pytest.mark.slow
def test_a_prompt_goes_to_completions_without_a_chats_own_fields():
    with recording(_streams) as (url, seen):
        assert _engine(url).run("p", 3, asked=Asked(sampling=SAMPLING)).text == "Hello"
    assert seen[0].path == "/v1/completions" and seen[0].body == {
        "model": "m",
        "prompt": "p",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "top_k": 5,
        "ignore_eos": True,
    }


def test_where_the_upstream_serves_one_route_every_request_goes_there():
    spec = UpstreamSpec("http://127.0.0.1:1", "m")
    completions_only = UpstreamEngine(spec, "m", UpstreamRoutes(True, False, ("chat: HTTP 404",)))
    chat_only = UpstreamEngine(spec, "m", UpstreamRoutes(False, True, ("completions: HTTP 404",)))
    flattened = completions_only.request(
        "user: Hi\nassistant:", 4, None, Asked(messages=MESSAGES, sampling=SAMPLING)
    )
    assert flattened.route == "/v1/completions" and flattened.prompt == "user: Hi\nassistant:"
    assert "add_generation_prompt" not in json.loads(flattened.wire())
    one_message = chat_only.request("p", 4, None, Asked())
    assert one_message.route == "/v1/chat/completions" and one_message.messages == [
        {"role": "user", "content": "p"}
    ]
    assert (
        "only" in completions_only.routes.says() and "flattened" in completions_only.routes.says()
    )
    assert "one user message" in chat_only.routes.says()


def _routes_answering(chat: str, completions: str):
    def answer(path, _body):
        status = chat if path == "/v1/chat/completions" else completions
        if path == "/v1/models":
            return _plain("200 OK", json.dumps({"object": "list", "data": [{"id": "m"}]}).encode())
        return _plain(status, b'{"error": {"message": "route says ' + status.encode() + b'"}}')

    return answer


@pytest.mark.slow
@pytest.mark.parametrize(
    "chat, completions, served",
    [
        ("200 OK", "200 OK", (True, True)),
        ("404 Not Found", "200 OK", (True, False)),  # a base model's server: no chat route
        ("200 OK", "404 Not Found", (False, True)),  # a chat-only server
        ("503 Service Unavailable", "429 Too Many Requests", (True, True)),  # busy is there
    ],
)
def test_the_start_up_probe_finds_the_routes(chat, completions, served):
    with recording(_routes_answering(chat, completions)) as (url, seen):
        routes = probe_routes(UpstreamSpec(url), "m")
    assert (routes.completions, routes.chat) == served
    assert all(s.body["max_tokens"] == 1 and s.body["model"] == "m" for s in seen)  # one token each
    assert {s.path for s in seen} == {"/v1/completions", "/v1/chat/completions"}
    assert all(("HTTP 404" in line and "route says 404" in line) for line in routes.why_not)


@pytest.mark.slow
def test_an_upstream_serving_neither_route_is_one_line_at_start_up(capsys):
    with recording(_routes_answering("404 Not Found", "405 Method Not Allowed")) as (url, _):
        assert main(["serve", "--engine", "upstream", "--upstream-url", url, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        len(err.strip().splitlines()) == 1
        and ("serves neither /v1/completions nor /v1/chat/completions") in err
    )


@pytest.mark.slow
def test_an_overrun_is_cut_to_max_tokens():
    """Asked for 2, the upstream sends 3 chunks and says 3 tokens: the answer is the first 2, and
    says 2."""
    answer = _sse(_chunk("a"), _chunk("b"), _chunk("c"), _chunk("", usage=3))
    pieces = []
    with scripted(lambda conn, _: conn.sendall(answer)) as url:
        result = _engine(url).run("p", 2, emit=pieces.append)
    assert (result.text, result.tokens, pieces) == ("ab", 2, ["a", "b"])


@pytest.mark.slow
def test_the_key_goes_to_the_upstream_and_is_never_shown(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    assert api_key(None) == "sk-from-env" and api_key("sk-flag") == "sk-flag"
    spec = UpstreamSpec("http://127.0.0.1:1", "m", api_key="sk-secret")
    assert "sk-secret" not in repr(spec)
    with recording(_streams) as (url, seen):
        UpstreamEngine(UpstreamSpec(url, "m", api_key="sk-secret"), "m").run("p", 2)
        probe_routes(UpstreamSpec(url, api_key="sk-secret"), "m")
    assert [s.headers["authorization"] for s in seen] == ["Bearer sk-secret"] * 3
    argv = ServeOptions(
        engine="upstream", upstream_url="http://h:1", upstream_api_key="sk-secret"
    ).argv()
    assert "sk-secret" not in " ".join(argv)  # a child reads it from its environment


@pytest.mark.slow
def test_the_urls_user_info_goes_as_basic_auth_unless_a_key_is_given():
    """Issue 32: user:password@ in --upstream-url is sent as basic auth (never in the URL connected
    to or shown); with a key too, the one Authorization header is the key's (before, both went and
    the upstream said 401)."""
    basic = "Basic " + base64.b64encode(b"user:p@ss").decode()
    with recording(_streams) as (url, seen):
        creds = url.replace("http://", "http://user:p%40ss@")
        UpstreamEngine(UpstreamSpec(creds, "m"), "m").run("p", 2)
        probe_routes(UpstreamSpec(creds), "m")
        UpstreamEngine(UpstreamSpec(creds, "m", api_key="sk-secret"), "m").run("p", 2)
    assert [s.headers.get("authorization") for s in seen] == [basic] * 3 + ["Bearer sk-secret"]


@pytest.mark.slow
def test_an_upstream_that_wants_a_key_is_told_at_start_up():
    with recording(
        lambda path, _: _plain("401 Unauthorized", b'{"error": {"message": "no key"}}')
    ) as (url, _):
        with pytest.raises(
            ValueError, match="wants a key .--upstream-api-key, or QLAB_UPSTREAM_API_KEY"
        ):
            resolve_model(UpstreamSpec(url))


@pytest.mark.slow
def test_readiness_follows_what_the_runs_and_a_probe_said():
    clock = [100.0]
    health = UpstreamHealth(
        UpstreamSpec(f"http://127.0.0.1:{_closed_port()}"), clock=lambda: clock[0]
    )

    async def problem():
        try:
            return await health.problem()
        finally:
            await health.aclose()

    health.learned("the upstream answered HTTP 500: boom")
    assert asyncio.run(problem()) == "the upstream answered HTTP 500: boom"  # fresh: no probe
    health.learned(None)
    assert asyncio.run(problem()) is None
    clock[0] += FRESH_S + 1  # nothing learned lately: the probe finds nobody there
    assert "cannot reach the upstream" in asyncio.run(problem())
    with recording(lambda path, _: _plain("200 OK", b'{"object": "list", "data": []}')) as (
        url,
        seen,
    ):
        health = UpstreamHealth(UpstreamSpec(url), clock=lambda: clock[0])
        assert asyncio.run(problem()) is None and [s.path for s in seen] == ["/v1/models"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "status, failing",
    [
        ("500 Internal Server Error", True),
        ("404 Not Found", True),
        ("400 Bad Request", False),
        ("503 Service Unavailable", False),
    ],
)
def test_a_run_tells_readiness_whether_the_upstream_is_failing(status, failing):
    with scripted(lambda conn, _: conn.sendall(_plain(status, b"{}"))) as url:
        engine = _engine(url)
        with pytest.raises(UpstreamError):
            engine.run("p", 2)
    assert (engine.health.last_problem is not None) == failing


@pytest.mark.slow
def test_a_hung_upstream_is_a_504_whatever_the_stall_rule():
    """The stall rule (here 0.05 s) would end the run long before the upstream's timeout (0.5 s):
    the engine bounds its own runs, so the answer is the upstream's timeout, not engine_stalled."""
    left = threading.Event()

    async def go():
        config = gate_config(preset("none"), stall=StallRule(1.0, 0.05), watch_interval_s=0.01)
        async with Gate([_engine(url, timeout_s=0.5)], config) as gate:
            future = gate.submit(Job("p", 2))
            with pytest.raises(UpstreamTimedOut):
                await future
            return gate.stats()

    with scripted(_holding(left)) as url:
        stats_after = asyncio.run(go())
    assert stats_after["counts"]["error"] == 1 and stats_after["stalled"] == 0
