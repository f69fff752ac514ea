"""Tokens as the upstream counts them (live/upstream.py, live/upstream_batch.py).

A loaded vLLM writes what several engine steps made in one streamed chunk, and a token whose text
is not yet whole in a chunk with no text; its ``usage`` (asked for in every chunk with
``continuous_usage_stats``) says the truth. These tests feed such streams to the reading and to
the batching forwarder, and check that the tokens recorded, the tokens the batching core counts
and the prompt tokens a client is told are the upstream's.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("httpx")

from live.contract_clients import UpstreamChunk
from live.upstream import ChunkRead, UpstreamRoutes, _Reading
from live.upstream_batch import StepLearner, Timeline, _Forward, gaps_of
from live.jobs import Job
from qsim.engines import StepModel


def _vllm_chunk(text: str | None, so_far: int, prompt: int = 4) -> UpstreamChunk:
    """A chunk as vLLM streams it with continuous_usage_stats: the tokens so far in its usage;
    text None: the usage-only chunk at the end (no choices)."""
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": None}]
    return UpstreamChunk.model_validate(
        {
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": so_far,
                "total_tokens": prompt + so_far,
                "prompt_tokens_details": None,
            },
        }
    )


#: Five tokens in four text chunks: two in one chunk, then one with no text of its own.
VLLM_STREAM = [("ab", 1), ("cd", 3), ("", 4), ("e", 5), (None, 5)]


def _read(stream, max_tokens: int = 9) -> tuple[_Reading, list[ChunkRead], list[str]]:
    reading, counted, emitted = _Reading(0.0, max_tokens), [], []
    for text, so_far in stream:
        reading.add(_vllm_chunk(text, so_far), emitted.append, counted.append)
    return reading, counted, emitted


def test_a_chunks_tokens_are_the_rise_of_its_usage_not_one_a_chunk():
    reading, counted, emitted = _read(VLLM_STREAM)
    result = reading.result()
    assert (result.text, result.tokens, result.prompt_tokens) == ("abcde", 5, 4)
    assert [(c.text, c.tokens) for c in counted] == [("ab", 1), ("cd", 2), ("", 1), ("e", 1)]
    assert emitted == ["ab", "cd", "e"]  # a client streams text: a chunk with none sends nothing


def test_an_upstream_that_says_more_than_was_asked_is_cut_at_max_tokens_in_tokens():
    reading, counted, _ = _read(VLLM_STREAM, max_tokens=2)
    assert (reading.result().text, reading.result().tokens) == ("abcd", 2)
    assert [c.tokens for c in counted] == [1, 1]  # the two-token chunk counts what was left: 1


def test_without_continuous_usage_a_text_chunk_is_a_token_and_the_last_usage_the_total():
    reading = _Reading(0.0, 9)
    for text in ("a", "", "b"):
        reading.add(
            UpstreamChunk.model_validate(
                {
                    "id": "c",
                    "created": 1,
                    "model": "m",
                    "choices": [{"text": text, "finish_reason": None}],
                }
            )
        )
    assert reading.tokens == 2
    reading.add(
        _vllm_chunk(None, 3, prompt=11)
    )  # the usage at the end: three, by the upstream's count
    assert (reading.result().tokens, reading.result().prompt_tokens) == (3, 11)


def test_the_batching_forwarder_follows_the_upstream_token_by_token():
    """A two-token chunk is two tokens for the core's steps (its text, then an empty piece), a token
    without text is an empty piece; the prompt's count is the upstream's."""

    async def go():
        forward = _Forward(Job("p", 5, prompt_tokens=1), Timeline(1))
        _, counted, _ = _read(VLLM_STREAM)
        for at, chunk in enumerate(counted):
            forward.counted(chunk, float(at))
        forward.task = asyncio.get_running_loop().create_future()
        forward.task.set_result(None)  # the stream is over: next() then answers None
        return [(await forward.next(), forward.gap) for _ in range(6)], forward

    pieces, forward = asyncio.run(go())
    # Chunks at 0, 1, 2, 3: the second's two tokens share its time; the fourth token has no text.
    assert pieces == [("ab", None), ("cd", 1.0), ("", 0.0), ("", 1.0), ("e", 1.0), (None, 1.0)]
    assert (forward.taken, forward.prompt_tokens, "".join(forward.text)) == (5, 4, "abcde")


def test_a_chunk_of_several_tokens_counts_as_that_many_steps_of_its_answer():
    learner = StepLearner(StepModel())
    alone = learner.started(3)
    for at, tokens in ((0.0, 1), (0.01, 1), (0.03, 2), (0.06, 3)):
        learner.chunk(alone, at, tokens)
    learner.ended(alone, 7)
    gaps = gaps_of(list(learner.timelines))
    assert gaps.seconds.round(6).tolist() == [0.01, 0.01, 0.01]
    # Its mean context over each chunk's steps: prompt 3, tokens before, then (k + 1) / 2.
    assert gaps.context.tolist() == [3 + 1 + 1, 3 + 2 + 1.5, 3 + 4 + 2]
    learner.ended(alone, 9)  # usage says more than the chunks counted: tokens the gate cannot place
    assert not alone.counted and len(gaps_of(list(learner.timelines))) == 0


def test_forwarded_requests_ask_for_usage_in_every_chunk_where_the_upstream_takes_it():
    assert UpstreamRoutes(continuous_usage=True).stream_options == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }
    assert UpstreamRoutes().stream_options == {"include_usage": True}


@pytest.mark.slow  # a scripted HTTP server on a thread
def test_the_probe_finds_whether_the_upstream_takes_continuous_usage():
    from test_upstream import _plain, recording

    from live.upstream import UpstreamSpec, probe_routes

    def strict(path, body):  # OpenAI's own API refuses stream options it does not know
        if "continuous_usage_stats" in json.dumps(body):
            return _plain("400 Bad Request", b'{"error": {"message": "unknown stream option"}}')
        return _plain("200 OK", b"{}")

    with recording(strict) as (url, seen):
        routes = probe_routes(UpstreamSpec(url), "m")
    assert (routes.completions, routes.chat, routes.continuous_usage) == (True, True, False)
    assert len(seen) == 4  # each route asked twice: with the option, then without
    with recording(lambda path, body: _plain("200 OK", b"{}")) as (url, seen):
        assert probe_routes(UpstreamSpec(url), "m").continuous_usage
    assert all(s.body["stream_options"]["continuous_usage_stats"] for s in seen)


@pytest.mark.slow  # a scripted HTTP server on a thread
def test_a_batching_gate_records_the_upstreams_tokens_and_tells_its_prompt_count():
    """An upstream writing two tokens a chunk (a loaded vLLM): every answer has all its tokens, as
    the upstream's usage says, and the prompt tokens are the upstream's (4), not the gate's
    count."""
    from test_upstream import _sse, scripted

    from live.gate import BatchGate
    from live.gate import gate_config
    from live.upstream import UpstreamEngine, UpstreamSpec
    from live.upstream_batch import UpstreamBatchEngine
    from qsim import PRESETS
    from qsim.config import Batching

    def respond(conn, body):
        chunks = [_vllm_chunk("xy", 2 * (i + 1)).model_dump(exclude_none=True) for i in range(3)]
        conn.sendall(_sse(*chunks, _vllm_chunk(None, 6).model_dump(exclude_none=True)))

    async def go(url):
        forwarder = UpstreamEngine(
            UpstreamSpec(url, "m", 10.0), "m", UpstreamRoutes(continuous_usage=True)
        )
        engine = UpstreamBatchEngine(forwarder, 4, StepLearner(StepModel()))
        config = gate_config(PRESETS["none"], engine=Batching(StepModel(), max_num_seqs=4))
        async with BatchGate(engine, config) as gate:
            jobs = [Job("a long prompt of many bytes", 6, prompt_tokens=27) for _ in range(3)]
            return await asyncio.gather(*(gate.submit(job) for job in jobs)), gate.stats()

    with scripted(respond) as url:
        answers, stats = asyncio.run(go(url))
    assert [(a.tokens, a.text, a.prompt_tokens) for a in answers] == [(6, "xyxyxy", 4)] * 3
    assert stats["answered_tokens"] == {"prompt": 12, "generated": 18}


def test_text_that_came_without_a_token_goes_with_the_next_token():
    async def go():
        forward = _Forward(Job("p", 5), Timeline(1))
        for at, chunk in enumerate([ChunkRead("z", 0, None), ChunkRead("w", 1, 2)]):
            forward.counted(chunk, float(at))
        return await forward.next(), forward

    piece, forward = asyncio.run(go())
    assert (piece, forward.taken, forward.prompt_tokens, "".join(forward.text)) == (
        "zw",
        1,
        2,
        "zw",
    )


@pytest.mark.slow  # a scripted HTTP server on a thread
@pytest.mark.parametrize(
    "route_body",
    [
        {
            "object": "text_completion",
            "choices": [{"index": 0, "text": "Hello", "finish_reason": "length"}],
        },
        {
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello"},
                    "finish_reason": "length",
                }
            ],
        },
    ],
)
def test_an_upstream_that_ignores_stream_true_is_read_whole(route_body):
    from test_upstream import _engine, scripted

    body = {
        "id": "c",
        "created": 1,
        "model": "m",
        **route_body,
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }

    def respond(conn, _):
        payload = json.dumps(body).encode()
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(payload), payload)
        )

    pieces = []
    with scripted(respond) as url:
        result = _engine(url).run("p", 9, emit=pieces.append)
    assert (result.text, result.tokens, result.prompt_tokens, pieces) == ("Hello", 5, 3, ["Hello"])
