"""Token-by-token streaming through the gate (live/gate.py ``submit_streaming``,
live/openai_api.py).

* a real ``qlab serve`` with the synthetic engine (1/1000 of the reference time): a streamed answer
  comes in several chunks whose text joined is the non-streamed answer, through httpx and the openai
  SDK;
* a gate in front of a scripted upstream that sends two chunks and then hangs up: the client gets
  the two chunks, then an error event (the SDK raises), and the gate's one engine serves the next
  request;
* a cut at the deadline mid-stream, in virtual time (tests/virtual_time.py): the gate's real route,
  driven as an ASGI app on a loop whose clock jumps, with a worker that emits pieces at given
  seconds; exact.
"""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from test_upstream import _chunk, _plain, _sse, scripted  # noqa: E402
from virtual_time import LoopWorker, VirtualLoop  # noqa: E402

from live.engine import Cancel, EngineResult, SyntheticEngine  # noqa: E402
from live.gate import Gate, gate_config  # noqa: E402
from live.http_api import create_app  # noqa: E402
from live.openai_api import CHAT, COMPLETIONS  # noqa: E402
from live.procs import serving  # noqa: E402
from live.serve_options import ServeOptions  # noqa: E402
from qsim import Policy  # noqa: E402

MODEL = "synthetic"


def events(url: str, path: str, body: dict) -> list[dict | str]:
    """The stream's data events, parsed (``[DONE]`` kept as the string)."""
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def texts(chunks: list, chat: bool) -> list[str]:
    key = (
        (lambda c: c["choices"][0]["delta"].get("content"))
        if chat
        else (lambda c: c["choices"][0]["text"])
    )
    return [key(c) for c in chunks if isinstance(c, dict) and c.get("choices") and key(c)]


# ================================================================== the synthetic engine, a real
# server


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    options = ServeOptions(policy="none", speed=0.001)
    with serving([options], tmp_path_factory.mktemp("stream-logs"), 60) as (server,):
        yield server.url


@pytest.mark.slow
@pytest.mark.parametrize(
    "body", [{"prompt": "Hi", "max_tokens": 6}, {"prompt": "Hi", "max_tokens": 5, "echo": True}]
)
def test_a_streamed_completion_is_the_answer_in_pieces(url, body):
    plain = httpx.post(url + COMPLETIONS, json={"model": MODEL, **body}, timeout=30).json()
    streamed = events(url, COMPLETIONS, {"model": MODEL, "stream": True, **body})
    assert streamed[-1] == "[DONE]"
    pieces = texts(streamed, chat=False)
    assert len(pieces) > 1 and "".join(pieces) == plain["choices"][0]["text"]
    last = streamed[-2]
    assert last["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert last["qlab"]["outcome"] == "good"


@pytest.mark.slow
def test_the_sdk_reads_a_streamed_chat_chunk_by_chunk(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "Hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(content) == 8 and "".join(content) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8


# ================================================================== an upstream that dies
# mid-stream


def _upstream(conn, body: bytes) -> None:
    """The models list for start-up; a prompt (or a chat's messages) with "die" in it: two chunks,
    then it hangs up; with "broken": a 500."""
    if not body:
        reply = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(reply), reply)
        )
        return
    sent = json.loads(body)
    prompt = sent.get("prompt") or json.dumps(sent.get("messages"))
    if "broken" in prompt:
        conn.sendall(_plain("500 Internal Server Error", b'{"error": {"message": "boom"}}'))
        return
    dies = "die" in prompt
    conn.sendall(_sse(_chunk("Hel"), _chunk("lo"), done=not dies))


@pytest.mark.slow
def test_an_upstream_that_dies_mid_stream_ends_the_stream_with_an_error(tmp_path):
    with scripted(_upstream) as upstream:
        gate = ServeOptions(
            policy="none", engine="upstream", engines=1, upstream_url=upstream, upstream_model="m"
        )
        with serving([gate], tmp_path, 60) as (server,):
            streamed = events(
                server.url, COMPLETIONS, {"model": "m", "prompt": "die", "stream": True}
            )
            assert texts(streamed, chat=False) == ["Hel", "lo"]
            error = streamed[-2]["error"]
            assert streamed[-1] == "[DONE]" and (error["type"], error["code"]) == (
                "engine_error",
                "upstream_error",
            )
            client = openai.OpenAI(
                base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30
            )
            seen = []
            with pytest.raises(openai.APIError, match="broke|ended|failed"):
                for chunk in client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "die"}], stream=True
                ):
                    seen.append(chunk.choices[0].delta.content)
            assert "".join(c or "" for c in seen) == "Hello"
            # Failed before its first piece: a plain JSON error, not a stream.
            early = httpx.post(
                server.url + COMPLETIONS,
                json={"model": "m", "prompt": "broken", "stream": True},
                timeout=30,
            )
            assert early.status_code == 502 and early.json()["error"]["code"] == "upstream_error"
            assert "boom" in early.json()["error"]["message"]
            # The one engine is free again: the next request is served.
            answer = client.completions.create(model="m", prompt="fine", max_tokens=2)
            assert answer.choices[0].text == "Hello"
            assert httpx.get(server.url + "/stats", timeout=10).json()["counts"]["error"] == 3


# ================================================================== a cut at the deadline, in
# virtual time


class _Emitter(LoopWorker):
    """A gate worker on the loop's clock: emits "a" at 0.1 s and "b" at 0.2 s, hands back at 10 s
    unless cut."""

    def __init__(self, k: int, engine, deliver) -> None:
        super().__init__(k, deliver)

    def give(self, ticket) -> None:
        loop = asyncio.get_running_loop()
        handles = [
            loop.call_later(0.1, ticket.emit, "a"),
            loop.call_later(0.2, ticket.emit, "b"),
            loop.call_later(10.0, self.deliver, self.k, ticket, EngineResult("ab", 2, 10.0)),
        ]

        def stop() -> None:  # cut: it stops at once, as an engine that listens to its Cancel does
            for handle in handles:
                handle.cancel()
            loop.call_soon(
                self.deliver, self.k, ticket, EngineResult("ab", 2, loop.time(), stopped=True)
            )

        assert isinstance(ticket.cancel, Cancel)
        ticket.cancel.when_set(stop)


async def _post(
    app, path: str, body: dict, leave_after: int | None = None
) -> tuple[int, list[str]]:
    """One request through the app's direct route; its status and the body's data lines.
    leave_after: the client hangs up once it has that many pieces of the body (None: it never
    does)."""
    sent, left = [], asyncio.Event()
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if request:
            return request.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if (
            leave_after is not None
            and sum(m["type"] == "http.response.body" for m in sent) >= leave_after
        ):
            left.set()

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "scheme": "http",
        "server": ("test", 80),
        "client": ("test", 1),
        "http_version": "1.1",
        "root_path": "",
    }
    await app.direct_posts[path](scope, receive, send)
    body_text = b"".join(
        m.get("body", b"") for m in sent if m["type"] == "http.response.body"
    ).decode()
    if (b"content-type", b"application/json") in sent[0]["headers"]:
        return sent[0]["status"], [body_text]  # not a stream: the body, whole
    return sent[0]["status"], [
        line[6:] for line in body_text.split("\n") if line.startswith("data: ")
    ]


def _in_virtual_time(
    body: dict, leave_after: int | None = None, shutdown_at: float | None = None
) -> tuple[int, list[str], dict, float]:
    """One streamed chat through a cutting gate on a virtual clock: status, data lines, stats, the
    loop's end time. shutdown_at: the request's task is cancelled then, as uvicorn cancels what runs
    past its graceful shutdown."""
    loop = VirtualLoop()

    async def go():
        policy = Policy(name="cut", deadline_s=60.0, cancel_at_deadline=True)
        gate = Gate([SyntheticEngine()], gate_config(policy), clock=loop.time, worker=_Emitter)
        app = create_app(gate)
        gate.start()
        try:
            task = asyncio.ensure_future(_post(app, CHAT, body, leave_after))
            if shutdown_at is not None:
                loop.call_at(shutdown_at, task.cancel)
            status, lines = await task  # the task answers its cancellation: it ends, not cancelled
            assert not task.cancelled() and task.cancelling() == 0
            # virtual: the hand-back of a stopped run, a few loop turns on
            await asyncio.sleep(0.01)
            return status, lines, gate.stats(), loop.time()
        finally:
            gate.close()

    try:
        return loop.run_until_complete(go())
    finally:
        loop.close()


CHAT_BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "x"}],
    "max_tokens": 4,
    "stream": True,
}


def test_a_cut_at_the_deadline_mid_stream_ends_with_finish_reason_abort_and_why():
    status, lines, stats, _ = _in_virtual_time({**CHAT_BODY, "deadline_ms": 1000})
    assert status == 200 and lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert texts(chunks[:-1], chat=True) == ["a", "b"]
    last = chunks[-1]
    # not a failure: a stop
    assert "error" not in last and last["choices"][0]["finish_reason"] == "abort"
    # Why, as the handler answers the same cut unstreamed: 504 deadline_exceeded, with its numbers.
    stopped = last["qlab_stopped"]
    assert stopped["status"] == 504
    assert (stopped["error"]["type"], stopped["error"]["code"]) == (
        "deadline_exceeded",
        "deadline_passed",
    )
    # virtual seconds: exact up to rounding
    assert stopped["error"]["numbers"]["running_s"] == pytest.approx(1.0)
    assert stats["counts"]["cancelled"] == 1


def test_the_openai_sdk_reads_a_cut_stream_to_its_end_and_the_replayer_records_the_gates_outcome():
    """The openai SDK (the client the replay stands for) takes finish_reason abort without raising;
    the replayer's reading of the same events is the row /v1/generate's 504 gives (outcome
    cancelled)."""
    from openai import Stream
    from openai.types.chat import ChatCompletionChunk

    from live.openai_replay import read_completion
    from live.rows import Exchange, classify

    _, lines, _, _ = _in_virtual_time({**CHAT_BODY, "deadline_ms": 1000})
    body = "".join(f"data: {line}\n\n" for line in lines).encode()
    response = httpx.Response(
        200,
        headers={"content-type": "text/event-stream"},
        content=body,
        request=httpx.Request("POST", "http://gate" + CHAT),
    )
    client = openai.OpenAI(api_key="unused", base_url="http://gate/v1")
    chunks = list(Stream(cast_to=ChatCompletionChunk, response=response, client=client))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ab"
    assert chunks[-1].choices[0].finish_reason == "abort"

    async def read():
        again = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)
        times = iter(range(100))
        return await read_completion(again, clock=lambda: float(next(times)))

    streamed = asyncio.run(read())
    assert streamed.error is None and streamed.status == 504 and streamed.pieces == 2
    exchange = Exchange(0.0, 0.0, streamed.done_at, streamed.status, streamed.body)
    assert classify(exchange, 60.0) == ("cancelled", "deadline_passed", None)


def test_a_synthetic_run_emits_each_token_and_stops_on_cancel():
    pieces, cancel = [], Cancel()
    result = SyntheticEngine().run("p", 5, None, cancel=None, emit=pieces.append)
    assert (
        pieces == [" tok"] * 5
        and result.text == "".join(pieces)
        and result.first_token_s is not None
    )
    cancel.set()
    stopped = SyntheticEngine().run("p", 5, None, cancel=cancel, emit=pieces.append)
    assert stopped.stopped and stopped.tokens == 0 and len(pieces) == 5
    cut = []
    assert SyntheticEngine().run("p", 3, ["k t"], emit=cut.append).text == "".join(cut) == " to"


@pytest.mark.slow  # GPT-2: torch and transformers, 7 s of CPU to import
def test_gpt2_emits_each_decoding_step_and_holds_back_a_stop_string():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_live_gpt2 import _IdTokenizer, tiny_spec

    from live.gpt2 import GPT2Engine

    base = GPT2Engine(tiny_spec())
    # every token visible as '<id>'
    engine = GPT2Engine(tiny_spec(), loaded=(base.net, _IdTokenizer(), "cpu"))
    pieces: list[str] = []
    full = engine.run("stream me", 6, emit=pieces.append)
    assert len(pieces) == 6 and "".join(pieces) == full.text == engine.run("stream me", 6).text
    stop = pieces[3]  # the fourth token's text: the stream must end before it, as the answer does
    cut: list[str] = []
    result = engine.run("stream me", 6, [stop], emit=cut.append)
    assert "".join(cut) == result.text == full.text[: full.text.index(stop)]


def test_a_client_leaving_mid_stream_cancels_its_run():
    # It hangs up once it has the role chunk and "a" (one body message: events ready together go out
    # together).
    status, lines, stats, ended = _in_virtual_time(CHAT_BODY, leave_after=1)
    assert (
        status == 200
        and "[DONE]" not in lines
        and texts([json.loads(x) for x in lines], chat=True) == ["a"]
    )
    # the engine stopped (its Cancel), and is free
    assert stats["cancelled"] == 1 and stats["in_service"] == 0
    # long before the run's own end at 10 s (virtual): it was stopped, not waited for
    assert ended < 10.0


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_still_running_when_the_shutdown_times_out_is_answered_503(stream):
    # Cancelled at 0.15 s (virtual): a stream has had "a", so it ends with the error as its last
    # event; an answer not begun is a 503 in the envelope, not uvicorn's bare 500. Either way the
    # run is stopped.
    status, lines, stats, ended = _in_virtual_time(
        {**CHAT_BODY, "stream": stream}, shutdown_at=0.15
    )
    if stream:
        assert status == 200 and lines[-1] == "[DONE]"
        assert texts([json.loads(x) for x in lines[:-2]], chat=True) == ["a"]
        error = json.loads(lines[-2])["error"]
    else:
        assert status == 503 and len(lines) == 1
        error = json.loads(lines[0])["error"]
    assert (error["type"], error["code"], error["retry_after_s"]) == (
        "unavailable",
        "shutting_down",
        1,
    )
    assert stats["in_service"] == 0 and ended < 10.0  # its engine was told to stop
