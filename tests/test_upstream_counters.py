"""The upstream's own counters in ``/stats`` (live/upstream.py ``UpstreamCounters``,
live/vllm_metrics.py): what a vLLM upstream counted itself (requests, tokens, preemptions), read
from its ``/metrics`` when /stats asks; nothing from an upstream without vLLM's counters, and a
failing read never fails /stats or the serving.

The upstream is a fake vLLM on a scripted server (tests/fake_http.py): it streams a token a chunk,
counts as vLLM counts, and writes its counters with prometheus-client, as vLLM does. The gate runs
in-process (its app through httpx's ASGI transport); the replay's run file is checked against a
``qlab serve`` process in front of the fake.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Iterator

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("aiohttp")
pytest.importorskip("fastapi")

from prometheus_client import (  # noqa: E402
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from live import upstream  # noqa: E402
from live.contract import Stats  # noqa: E402
from live.engine import CountsUpstream, SyntheticEngine  # noqa: E402
from live.gate import Gate, gate_config  # noqa: E402
from live.http_api import create_app, upstream_counters  # noqa: E402
from live.replay_server import counted_upstream  # noqa: E402
from live.upstream import UpstreamCounters, UpstreamEngine, UpstreamSpec  # noqa: E402
from live.vllm_metrics import upstream_counters as parsed  # noqa: E402
from qsim import preset  # noqa: E402
from fake_http import listening, read_request  # noqa: E402

#: The prompt's tokens, as the fake counts every prompt.
PROMPT = 3


def vllm_metrics(requests: int, prompt: int, generated: int, preemptions: int) -> bytes:
    """/metrics as vLLM writes it (prometheus-client, its names and labels): requests by why they
    finished, a _created sample beside each counter, gauges and a histogram among them."""
    registry, labels = CollectorRegistry(), ("model_name", "engine")
    success = Counter("vllm:request_success", "", (*labels, "finished_reason"), registry=registry)
    success.labels("m", "0", "length").inc(requests - requests // 3)
    success.labels("m", "0", "stop").inc(requests // 3)
    success.labels("m", "0", "abort")
    for name, value in (
        ("prompt_tokens", prompt),
        ("generation_tokens", generated),
        ("num_preemptions", preemptions),
    ):
        Counter(f"vllm:{name}", "", labels, registry=registry).labels("m", "0").inc(value)
    Gauge("vllm:num_requests_running", "", labels, registry=registry).labels("m", "0").set(2)
    steps = Histogram("vllm:iteration_tokens_total", "", labels, registry=registry)
    steps.labels("m", "0").observe(5)
    return generate_latest(registry)


def test_vllms_counters_are_read_summed_over_their_labels():
    assert parsed(vllm_metrics(7, 21, 40, 2).decode()) == {
        "finished_requests": 7,
        "prompt_tokens": 21,
        "generation_tokens": 40,
        "preemptions": 2,
    }


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>not found</body></html>",  # not Prometheus' text
        'vllm:request_success_total{x="1} 2',  # broken
        "",  # nothing at all
        'qlab_requests_total{outcome="good",reason=""} 4.0\n',  # another qlab gate's
        "vllm:request_success_total 1\nvllm:prompt_tokens_total 1\nvllm:generation_tokens_total "
        "1\n",
        "vllm:request_success_total 1\nvllm:prompt_tokens_total 1\nvllm:generation_tokens_total "
        "NaN\n"
        "vllm:num_preemptions_total 0\n",
    ],
)
def test_text_that_is_not_vllms_counters_gives_none(text):
    assert parsed(text) is None


# ---------------------------------------------------------------------- a fake vLLM


@dataclass
class FakeVllm:
    """What the fake vLLM counted, and how it answers ``/metrics``: vLLM's text, else ``metrics``
    (a whole answer: status line, headers and body), else silence for ``hang_s``."""

    requests: int = 0
    prompt: int = 0
    generated: int = 0
    preemptions: int = 0
    metrics: bytes | None = None
    hang_s: float = 0.0
    paths: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, conn: socket.socket) -> None:
        line, _, body = read_request(conn)
        path = line.split()[1]
        self.paths.append(path)
        if path == "/metrics":
            self._metrics(conn)
        elif path == "/v1/models":
            conn.sendall(_answer("200 OK", b'{"object": "list", "data": [{"id": "m"}]}'))
        else:
            conn.sendall(self._stream(path, json.loads(body)))

    def _metrics(self, conn: socket.socket) -> None:
        if self.hang_s:
            time.sleep(self.hang_s)
            return
        with self.lock:
            said = vllm_metrics(self.requests, self.prompt, self.generated, self.preemptions)
        conn.sendall(self.metrics or _answer("200 OK", said, "text/plain; version=0.0.4"))

    def _stream(self, path: str, body: dict) -> bytes:
        """A token a chunk, counted (as vLLM counts) before the answer ends."""
        tokens = body["max_tokens"]
        chat = path == "/v1/chat/completions"
        chunks = [_chat_chunk("x") if chat else _chunk("x") for _ in range(tokens)]
        usage = {
            "prompt_tokens": PROMPT,
            "completion_tokens": tokens,
            "total_tokens": PROMPT + tokens,
        }
        chunks.append({**_chunk(""), "choices": [], "usage": usage})
        with self.lock:
            self.requests, self.prompt = self.requests + 1, self.prompt + PROMPT
            self.generated += tokens
        events = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        return (head + events).encode()


def _answer(status: str, body: bytes, kind: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"connection: close\r\n\r\n" + body


def _chunk(text: str) -> dict:
    return {
        "id": "c",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": None}],
    }


def _chat_chunk(text: str) -> dict:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }


@contextmanager
def fake_vllm(fake: FakeVllm | None = None) -> Iterator[tuple[str, FakeVllm]]:
    fake = fake or FakeVllm()
    with listening(fake.handle) as url:
        yield url, fake


def _gate(url: str) -> Gate:
    """A gate of two engines in front of ``url``, sharing its counters (as make_engines does)."""
    spec = UpstreamSpec(url, "m", 10.0)
    health, counters = upstream.UpstreamHealth(spec), UpstreamCounters(spec)
    engines = [UpstreamEngine(spec, "m", health=health, counters=counters) for _ in range(2)]
    return Gate(engines, gate_config(preset("none")))


async def _client_of(app):
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://qlab.test", timeout=30)


def _served(url: str, script):
    """``script(client)`` against an in-process gate in front of ``url``; what it returns."""
    app = create_app(_gate(url))

    async def go():
        async with app.router.lifespan_context(app):
            async with await _client_of(app) as client:
                return await script(client)

    return asyncio.run(go())


COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 4}


@pytest.mark.slow  # a scripted HTTP server on a thread
def test_stats_carries_vllms_own_counters_and_they_move_with_vllms():
    async def script(client):
        first = (await client.get("/stats")).json()
        fake.preemptions += 2  # inside vLLM: the gate's own counts cannot see it
        answer = await client.post("/v1/completions", json=COMPLETION)
        second = (await client.get("/stats")).json()
        page = (await client.get("/stats", params={"steps_since": 0})).json()
        return first, answer, second, page

    with fake_vllm(FakeVllm(requests=10, prompt=30, generated=40)) as (url, fake):
        first, answer, second, page = _served(url, script)
    read = first["upstream_counters"]
    assert read == {
        "finished_requests": 10,
        "prompt_tokens": 30,
        "generation_tokens": 40,
        "preemptions": 0,
        "read_at": read["read_at"],
    }
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    again = second["upstream_counters"]
    moved = {
        k: again[k] - read[k]
        for k in ("finished_requests", "prompt_tokens", "generation_tokens", "preemptions")
    }
    assert moved == {
        "finished_requests": 1,
        "prompt_tokens": PROMPT,
        "generation_tokens": 4,
        "preemptions": 2,
    }
    # Each reading at its own /stats, before the gate's clock there: the two engines read it once.
    assert read["read_at"] <= first["clock"] < again["read_at"]
    assert fake.paths.count("/metrics") == 2  # a page of steps waits on no upstream
    assert "upstream_counters" not in page


@pytest.mark.slow  # a scripted HTTP server on a thread
@pytest.mark.parametrize(
    "metrics",
    [
        _answer("404 Not Found", b'{"detail": "Not Found"}'),  # no /metrics
        _answer("200 OK", b"<html>a page for every path</html>", "text/html"),  # garbage
        # A qlab gate's:
        _answer("200 OK", b'qlab_requests_total{outcome="good",reason=""} 4.0\n', "text/plain"),
        b"HTTP/1.1 200 OK\r\ncontent-length: 900\r\n\r\nvllm:request",  # cut off
    ],
    ids=["404", "html", "other-counters", "cut-off"],
)
def test_an_upstream_without_vllms_counters_gives_none_and_the_gate_serves_on(metrics):
    async def script(client):
        stats = [await client.get("/stats") for _ in range(2)]
        answer = await client.post("/v1/completions", json=COMPLETION)
        return stats, answer

    with fake_vllm(FakeVllm(metrics=metrics)) as (url, fake):
        stats, answer = _served(url, script)
    assert [s.status_code for s in stats] == [200, 200]
    assert all(
        "upstream_counters" not in s.json() and s.json()["engine"]["engine"] == "upstream"
        for s in stats
    )
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "xxxx"
    assert fake.paths.count("/metrics") == 1  # after a failed read it is left alone a while


@pytest.mark.slow  # a scripted HTTP server on a thread
def test_a_hung_metrics_keeps_stats_fast_and_the_last_reading_stands(monkeypatch):
    monkeypatch.setattr(upstream, "COUNTERS_TIMEOUT_S", 0.2)
    monkeypatch.setattr(upstream, "COUNTERS_RETRY_S", 0.0)

    async def script(client):
        read = (await client.get("/stats")).json()
        fake.hang_s = 3.0  # /metrics hangs from now on
        t0 = time.perf_counter()
        hung = (await client.get("/stats")).json()
        return read, hung, time.perf_counter() - t0

    with fake_vllm(FakeVllm(requests=5)) as (url, fake):
        read, hung, seconds = _served(url, script)
    assert seconds < 2.0  # bounded by the read's timeout, not the upstream
    assert hung["upstream_counters"] == read["upstream_counters"]  # read_at says how old it is
    assert hung["upstream_counters"]["read_at"] < hung["clock"]


def test_an_unreachable_upstream_gives_no_counters():
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        reader = UpstreamCounters(UpstreamSpec(url))

        async def go():
            try:
                return await reader.reading(time.monotonic)
            finally:
                await reader.aclose()

        assert asyncio.run(go()) is None


# ---------------------------------------------------------------------- what /stats sums


@dataclass
class Reader:
    """A counter reader that says what it is told (None: nothing), counting the asks."""

    said: dict | None
    asked: int = 0

    async def reading(self, clock) -> dict | None:
        self.asked += 1
        return self.said


def _reading(requests: int, read_at: float) -> dict:
    return {
        "finished_requests": requests,
        "prompt_tokens": 10 * requests,
        "generation_tokens": 20 * requests,
        "preemptions": requests // 2,
        "read_at": read_at,
    }


def test_each_upstream_is_read_once_and_a_fleets_are_summed():
    one, other = Reader(_reading(4, 7.0)), Reader(_reading(6, 5.0))
    engines = [SimpleNamespace(counters=r) for r in (one, one, other, other)] + [object()]
    assert all(isinstance(e, CountsUpstream) for e in engines[:4])
    gate = SimpleNamespace(engines=engines, clock=time.monotonic)
    assert asyncio.run(upstream_counters(gate)) == {
        "finished_requests": 10,
        "prompt_tokens": 100,
        "generation_tokens": 200,
        "preemptions": 5,
        "read_at": 5.0,
    }
    assert (one.asked, other.asked) == (1, 1)
    other.said = None  # one upstream gives none: a sum without it would be wrong
    assert asyncio.run(upstream_counters(gate)) is None
    bare = SimpleNamespace(engines=[object()], clock=time.monotonic)
    assert asyncio.run(upstream_counters(bare)) is None


class CountingSynthetic(SyntheticEngine):
    """The synthetic engine, as if in front of a vLLM (its counters said by a :class:`Reader`)."""

    def __init__(self, reader: Reader) -> None:
        super().__init__(speed=1e-4)
        self.counters = reader


def test_stats_says_the_counters_where_the_engine_reads_them_and_nothing_where_it_cannot():
    reader = Reader(_reading(3, 1.5))
    app = create_app(Gate([CountingSynthetic(reader)], gate_config(preset("none"))))

    async def go():
        async with app.router.lifespan_context(app):
            async with await _client_of(app) as client:
                said = (await client.get("/stats")).json()
                reader.said = None
                return said, await client.get("/stats")

    said, none = asyncio.run(go())
    assert said["upstream_counters"] == _reading(3, 1.5) and set(said) == set(
        Stats.model_fields
    ) - {"fleet"}
    assert none.status_code == 200 and "upstream_counters" not in none.json()


def test_a_batching_upstream_engine_reads_its_forwarders_counters():
    from live.upstream_batch import StepLearner, UpstreamBatchEngine
    from qsim.engines import StepModel

    forwarder = UpstreamEngine(UpstreamSpec("http://127.0.0.1:9"), "m")
    engine = UpstreamBatchEngine(forwarder, 4, StepLearner(StepModel()))
    assert isinstance(engine, CountsUpstream) and engine.counters is forwarder.counters


# ---------------------------------------------------------------------- the run file


def test_the_run_metadata_has_the_counters_at_start_and_end_on_both_clocks():
    start = {"upstream_counters": _reading(2, 100.0)}
    end = {"upstream_counters": _reading(5, 130.0)}
    said = counted_upstream(start, end, zero=101.0)
    assert said == {
        "start": {**_reading(2, 100.0), "read_s": -1.0},
        "end": {**_reading(5, 130.0), "read_s": 29.0},
    }
    assert counted_upstream(start, None, 101.0) is None  # /stats failed at the end
    assert counted_upstream(start, {"clock": 1.0}, 101.0) is None


@pytest.mark.slow  # a qlab serve process, and the fake on a thread
def test_a_replay_through_a_gate_in_front_of_vllm_records_what_vllm_counted(tmp_path):
    from live.loadgen import ReplayConfig, replay
    from live.procs import serving
    from live.serve_options import ServeOptions
    from qsim import from_arrays

    trace = from_arrays([0.0, 0.05, 0.1, 0.15], [3, 5, 2, 4], name="four")
    with fake_vllm(FakeVllm(preemptions=1)) as (url, fake):
        options = ServeOptions(policy="none", engine="upstream", upstream_url=url)
        with serving([options], tmp_path, 60) as (gate,):
            frame = replay(trace, ReplayConfig(gate.url))
    counted = frame.attrs["qlab_run"]["upstream_counters"]
    moved = {
        k: counted["end"][k] - counted["start"][k]
        for k in ("finished_requests", "generation_tokens")
    }
    assert (
        moved == {"finished_requests": 4, "generation_tokens": 14}
        and counted["end"]["preemptions"] == 1
    )
    assert counted["start"]["read_s"] < 0 < counted["end"]["read_s"]
    assert frame["outcome"].eq("good").all()
