"""The replayer's prompts (the trace's length, capped at the context) and ``qlab replay --api
openai``.

Against real servers: a ``qlab serve`` gate (synthetic engine, bounded: one engine and 8 waiting),
and a scripted OpenAI-compatible server that is not a qlab gate (no /stats), as a bare vLLM would
be.
"""

from __future__ import annotations

import json
import socket
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pandas as pd
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from experiments.cli import main  # noqa: E402
from live.server_facts import ServerFacts  # noqa: E402
from live.loadgen import ReplayConfig, replay  # noqa: E402
from live.replay_bodies import CANNOT_FIT, payloads, plan_prompts  # noqa: E402
from live.openai_api import DEADLINE_HEADER  # noqa: E402
from live.openai_replay import refusal_body  # noqa: E402
from live.procs import serving  # noqa: E402
from live.serve_options import ServeOptions  # noqa: E402
from live.tokenizer import words_prompt  # noqa: E402
from qsim import from_arrays, records  # noqa: E402
from fake_http import listening, read_request  # noqa: E402


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    with serving([ServeOptions(policy="bounded")], tmp_path_factory.mktemp("logs"), 60) as (
        server,
    ):
        yield server.url


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats").json()


def _with_prompts(trace, prompts):
    return type(trace)(**{**trace.__dict__, "prompt_tokens": np.asarray(prompts, dtype=np.int64)})


# ================================================================== prompt lengths


DEFAULT = len(words_prompt(16))  # the default prompt, in bytes: the synthetic engine's tokens


def test_prompts_are_capped_at_the_context_and_unfit_requests_are_counted():
    trace = _with_prompts(from_arrays(np.arange(5) * 0.1, [10, 10, 20, 40, 64]), [0, 25, 35, 10, 5])
    plan = plan_prompts(trace, ReplayConfig("http://x", context_tokens=40), ServerFacts("bytes"))
    # room: 30, 30, 20, 0, -24 prompt tokens beside the new ones
    assert plan.tokens.tolist() == [30, 25, 20, 0, 0]
    assert plan.capped.tolist() == [True, False, True, False, False]
    assert plan.unfit.tolist() == [False, False, False, True, True]
    assert plan.meta() == {
        "context_tokens": 40,
        "prompt_tokenizer": "bytes",
        "prompts_capped": 2,
        "prompts_cannot_fit": 2,
    }
    bodies = payloads(trace, ReplayConfig("http://x"), plan)
    assert bodies[3] is None and bodies[4] is None
    assert [len(b["prompt"]) for b in bodies[:3]] == [30, 25, 20]  # bytes: one token each
    # No context: the trace's own lengths, the default where it has none, nothing capped.
    free = plan_prompts(trace, ReplayConfig("http://x"), ServerFacts("bytes"))
    assert (
        free.tokens.tolist() == [DEFAULT, 25, 35, 10, 5]
        and not free.capped.any()
        and not free.unfit.any()
    )
    # The gate's own prompt cap counts as a cap too.
    long = _with_prompts(trace, [20_000, 0, 0, 0, 0])
    capped = plan_prompts(
        long, ReplayConfig("http://x"), ServerFacts("bytes", max_prompt_tokens=16_384)
    )
    assert capped.tokens[0] == 16_384 and capped.capped.tolist() == [
        True,
        False,
        False,
        False,
        False,
    ]


def test_the_default_prompt_is_the_same_text_as_before():
    trace = from_arrays([0.0, 0.1], [4, 8])
    for tokenizer in ("bytes", "GPT2TokenizerFast", None):
        bodies = payloads(
            trace,
            ReplayConfig("http://x"),
            plan_prompts(trace, ReplayConfig("http://x"), ServerFacts(tokenizer)),
        )
        assert [b["prompt"] for b in bodies] == [words_prompt(16)] * 2


@pytest.mark.slow
def test_a_replay_caps_counts_and_keeps_one_row_per_request(gate, tmp_path, capsys):
    path = tmp_path / "trace.csv"
    pd.DataFrame(
        {
            "arrival_s": np.arange(6) * 0.15,
            "max_new_tokens": [10, 10, 20, 40, 64, 4],
            "prompt_tokens": [0, 25, 35, 10, 5, 2048],
        }
    ).to_csv(path, index=False)
    before = stats(gate)["submitted"]
    out = tmp_path / "run.parquet"
    assert (
        main(
            [
                "replay",
                "--url",
                gate,
                "--trace",
                str(path),
                "--context-tokens",
                "40",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    said = capsys.readouterr()
    assert (
        "qlab replay: 3 of 6 prompts capped" in said.err
        and ("qlab replay: 2 of 6 requests not sent") in said.err
    )
    assert "capped to the context (40): 3, not sent (cannot fit): 2" in said.out
    rows = records.validate(pd.read_parquet(out))
    assert list(rows["request_id"]) == list(range(6))
    assert rows["prompt_tokens"].tolist() == [30, 25, 20, 0, 0, 36]
    assert rows["prompt_capped"].tolist() == [True, False, True, False, False, True]
    unsent = rows[rows["reason"] == CANNOT_FIT]
    assert unsent["request_id"].tolist() == [3, 4] and (unsent["outcome"] == "error").all()
    assert unsent["http_status"].isna().all() and unsent["send_lateness_s"].isna().all()
    assert set(rows.drop(unsent.index)["outcome"]) == {"good"}
    assert stats(gate)["submitted"] - before == 4  # the unfit two never reached the gate
    meta = pd.read_parquet(out).attrs["qlab_run"]
    assert (meta["prompts_capped"], meta["prompts_cannot_fit"], meta["context_tokens"]) == (
        3,
        2,
        40,
    )


@pytest.mark.slow
def test_gpt2_s_context_comes_from_the_server(tmp_path):
    """GPT-2 (tiny, random weights, CPU) says its context of 1,024 in /healthz: no flag needed."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    trace = _with_prompts(
        from_arrays([0.0, 0.3, 0.6, 0.9], [8, 100, 1024, 4], deadline_s=[60.0] * 4),
        [2048, 1000, 10, 300],
    )
    options = ServeOptions(engine="gpt2", model="tiny", device="cpu", threads=1, policy="none")
    with serving([options], tmp_path, 120) as (server,):
        frame = replay(trace, ReplayConfig(server.url, api="openai"))
    rows = records.validate(frame)
    assert frame.attrs["qlab_run"]["context_tokens"] == 1024
    assert rows["prompt_tokens"].tolist() == [1016, 924, 0, 300] and rows[
        "prompt_capped"
    ].tolist() == [True, True, False, False]
    assert (
        rows["outcome"].tolist() == ["good", "good", "error", "good"]
        and rows.loc[2, "reason"] == CANNOT_FIT
    )
    assert (rows.loc[[0, 1, 3], "tokens"] == rows.loc[[0, 1, 3], "max_new_tokens"]).all()


def test_the_old_cap_flag_names_the_new_one(capsys):
    assert (
        main(
            [
                "replay",
                "--url",
                "http://127.0.0.1:9",
                "--max-prompt-words",
                "64",
                "--out",
                "x.parquet",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "argument --max-prompt-words: renamed --context-tokens" in err and err.count("\n") == 1


# ================================================================== --api openai against a qlab
# gate


@pytest.mark.slow
def test_openai_replay_of_a_qlab_gate_matches_its_stats_and_compares(gate, tmp_path, capsys):
    trace = from_arrays(
        np.r_[np.zeros(12), 1.8 + np.arange(3) * 0.2], [16] * 12 + [4, 8, 4], name="burst"
    )
    before = stats(gate)["counts"]
    frame = replay(trace, ReplayConfig(gate, api="openai"))
    after = stats(gate)["counts"]
    out = tmp_path / "openai.parquet"
    frame.to_parquet(out, index=False)
    rows = records.validate(pd.read_parquet(out))
    assert len(rows) == len(trace) and list(rows["request_id"]) == list(range(len(trace)))
    assert (rows["api"] == "openai").all() and rows["qlab_gate"].all()
    counts = rows["outcome"].value_counts()
    assert counts.get("rejected", 0) == 12 - 9  # 1 in service + 8 waiting
    for outcome in ("good", "late", "rejected", "error"):
        assert after[outcome] - before[outcome] == counts.get(outcome, 0), outcome
    answered = rows[rows["outcome"].isin(["good", "late"])]
    assert (answered["http_status"] == 200).all() and (
        answered["tokens"] == answered["max_new_tokens"]
    ).all()
    assert (answered["ttft_s"] > 0).all() and (answered["ttft_s"] <= answered["latency_s"]).all()
    # What compare needs of the gate came through the stream's qlab part.
    assert (
        answered[["engine_s", "queue_s", "engine_started_s", "engine_returned_s"]]
        .notna()
        .all()
        .all()
    )
    refused = rows[rows["outcome"] == "rejected"]
    assert (refused["http_status"] == 503).all() and set(refused["reason"]) == {"queue_full"}
    assert (refused["retry_after_s"] >= 1).all() and refused["ttft_s"].isna().all()
    assert main(["compare", str(out), "--out", str(tmp_path / "cmp"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["requests"] == len(trace) and summary["live_errors"] == 0


@pytest.mark.slow
def test_openai_clients_hang_up_on_a_stream_and_the_gate_hears_it(gate):
    """Patience works on a streamed request as on /v1/generate: the hang-up closes the
    connection."""
    trace = from_arrays(np.zeros(4), [64] * 4, deadline_s=[60.0] * 4)  # 0.545 s each, one engine
    trace = type(trace)(**{**trace.__dict__, "patience_s": np.full(4, 0.3)})
    before = stats(gate)
    rows = records.validate(replay(trace, ReplayConfig(gate, api="openai")))
    assert rows["outcome"].tolist() == ["abandoned"] * 4 and set(rows["reason"]) == {"client_left"}
    assert rows["ttft_s"].isna().all()
    deadline = time.monotonic() + 10  # the gate hears each hang-up as the connection closes
    while stats(gate)["cancelled"] - before["cancelled"] < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = stats(gate)
    assert (
        after["cancelled"] - before["cancelled"] == 4
        and after["counts"]["good"] == before["counts"]["good"]
    )


@pytest.mark.slow
def test_a_model_the_server_does_not_serve_is_refused_before_sending(gate, tmp_path, capsys):
    before = stats(gate)["submitted"]
    assert (
        main(
            [
                "replay",
                "--url",
                gate,
                "--api",
                "openai",
                "--model",
                "gpt-4",
                "--arrivals",
                "burst:3",
                "--out",
                str(tmp_path / "x.parquet"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "does not serve model 'gpt-4'; it serves 'synthetic'" in err and err.count("\n") == 1
    assert stats(gate)["submitted"] == before and not (tmp_path / "x.parquet").exists()


def test_api_flags_are_checked(capsys):
    with pytest.raises(ValueError, match="api must be one of qlab, openai"):
        ReplayConfig("http://x", api="grpc")
    with pytest.raises(ValueError, match="only with api openai"):
        ReplayConfig("http://x", model="m")
    assert (
        main(["replay", "--url", "http://127.0.0.1:9", "--api", "soap", "--out", "x.parquet"]) == 2
    )
    assert "argument --api: invalid choice" in capsys.readouterr().err


# ================================================================== --api openai against a server
# that is not a gate


def _sse_head() -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


def _chunk(text: str) -> bytes:
    return (
        b"data: "
        + json.dumps(
            {
                "id": "c",
                "object": "text_completion",
                "created": 1,
                "model": "llama",
                "choices": [{"index": 0, "text": text, "finish_reason": None}],
            }
        ).encode()
        + b"\n\n"
    )


def _plain(status: str, body: dict, extra: str = "") -> bytes:
    raw = json.dumps(body).encode()
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: "
        f"{len(raw)}\r\n{extra}"
        f"connection: close\r\n\r\n"
    ).encode() + raw


#: How the bare server answers, by max_tokens: 13 overloaded, 14 a bad request, 15 a stream broken
#: off; any other a stream whose second token comes GAP_S after the first.
GAP_S = 0.05


def _bare(conn: socket.socket, seen: list) -> None:
    line, headers, body = read_request(conn)
    if line.startswith("GET /v1/models"):
        conn.sendall(
            _plain("200 OK", {"object": "list", "data": [{"id": "llama", "object": "model"}]})
        )
        return
    if not line.startswith("POST /v1/completions"):
        conn.sendall(_plain("404 Not Found", {"detail": "Not Found"}))
        return
    req = json.loads(body)
    seen.append((req, headers))
    n = req["max_tokens"]
    if n == 13:
        conn.sendall(
            _plain(
                "503 Service Unavailable",
                {"object": "error", "message": "busy", "type": "Overloaded", "code": 503},
                "retry-after: 3\r\n",
            )
        )
    elif n == 14:
        conn.sendall(
            _plain(
                "400 Bad Request",
                {
                    "error": {
                        "message": "max_tokens too large",
                        "type": "BadRequestError",
                        "code": 400,
                    }
                },
            )
        )
    elif n == 15:
        conn.sendall(_sse_head() + _chunk("half"))
    else:
        conn.sendall(_sse_head() + _chunk("Hel"))
        time.sleep(GAP_S)
        usage = {
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": "llama",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3},
        }
        conn.sendall(
            _chunk("lo") + b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"
        )


@contextmanager
def bare_server() -> Iterator[tuple[str, list]]:
    """An OpenAI-compatible server that is not a qlab gate: one request per connection, no
    /stats."""
    seen: list = []
    with listening(lambda conn: _bare(conn, seen)) as url:
        yield url, seen


@pytest.mark.slow
def test_openai_replay_of_a_bare_server_records_first_token_refusals_and_errors(tmp_path, capsys):
    trace = from_arrays(
        [0.0, 0.05, 0.1, 0.15, 0.2],
        [4, 13, 14, 15, 8],
        deadline_s=[5.0, 5.0, 5.0, 5.0, np.nan],
        client_id=["a", None, None, None, None],
    )
    with bare_server() as (url, seen):
        frame = replay(trace, ReplayConfig(url, api="openai"))
    rows = records.validate(frame)
    assert rows["outcome"].tolist() == ["good", "rejected", "error", "error", "good"]
    assert not rows["qlab_gate"].any() and rows["engine"].isna().all()
    assert rows.loc[1, "retry_after_s"] == 3 and rows.loc[1, "http_status"] == 503
    assert "400" in rows.loc[2, "error"] and "max_tokens too large" in rows.loc[2, "error"]
    assert "broken stream" in rows.loc[3, "error"]
    good = rows[rows["outcome"] == "good"]
    assert (good["tokens"] == good["max_new_tokens"]).all()  # from the usage chunk
    assert (good["ttft_s"] > 0).all() and (good["ttft_s"] < good["latency_s"]).all()
    bodies = {req["max_tokens"]: (req, headers) for req, headers in seen}
    req, headers = bodies[4]
    assert (req["model"], req["stream"], req["user"], headers[DEADLINE_HEADER]) == (
        "llama",
        True,
        "a",
        "5000",
    )
    assert DEADLINE_HEADER not in bodies[8][1] and "user" not in bodies[8][0]
    out = tmp_path / "bare.parquet"
    frame.to_parquet(out, index=False)
    capsys.readouterr()  # the replay's own warnings, if any
    assert main(["compare", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not a qlab gate" in err and err.count("\n") == 1


class _Scripted:
    """A streamed answer whose lines arrive at given times of a fake clock (no wall clock
    involved)."""

    status_code = 200
    headers = {"content-type": "text/event-stream"}

    def __init__(self, timed_lines):
        self.timed_lines, self.now = timed_lines, 0.0

    async def aiter_lines(self):
        for at, line in self.timed_lines:
            self.now = at
            yield line


def _event(text: str | None = None, **extra) -> str:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": None}]
    return "data: " + json.dumps(
        {
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": choices,
            **extra,
        }
    )


QLAB = {
    "outcome": "good",
    "engine": 1,
    "queue_s": 0.1,
    "engine_s": 0.3,
    "total_s": 0.41,
    "est_service_s": 0.29,
    "started_at": 10.1,
    "returned_at": 10.4,
    "admission": {"arrived_at": 10.0, "queued": 2},
}


def test_the_first_token_is_the_first_event_with_text_and_the_end_is_done():
    import asyncio

    from live.openai_replay import read_completion
    from live.rows import Exchange, classify

    answer = _Scripted(
        [
            (1.0, ": keep-alive"),
            (2.0, _event("")),
            (3.0, _event("Hel")),
            (4.0, ""),
            (5.0, _event("lo")),
            (6.0, _event("", qlab=QLAB)),
            (7.0, _event(usage={"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4})),
            (8.0, "data: [DONE]"),
            (9.0, ""),
        ]
    )
    got = asyncio.run(read_completion(answer, clock=lambda: answer.now))
    assert (got.first_token_at, got.done_at, got.error) == (3.0, 8.0, None)
    assert got.body["text"] == "Hello" and got.body["tokens"] == 2 and got.body["engine"] == 1
    assert got.body["timings"]["started_at"] == 10.1 and got.body["admission"]["queued"] == 2
    assert classify(Exchange(0, 0, 8.0, 200, got.body), 10.0) == ("good", None, None)
    broken = _Scripted(
        [(1.0, _event("a")), (2.0, 'data: {"error": {"message": "boom"}}'), (3.0, "data: [DONE]")]
    )
    got = asyncio.run(read_completion(broken, clock=lambda: broken.now))
    assert got.body is None and "error event" in got.error and got.first_token_at == 1.0
    cut = _Scripted([(1.0, _event("a"))])
    assert (
        "ended before data: [DONE]"
        in asyncio.run(read_completion(cut, clock=lambda: cut.now)).error
    )
    whole = httpx.Response(
        200,
        json={
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": "Hi", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        },
    )
    got = asyncio.run(read_completion(whole, clock=lambda: 5.0))  # a server that does not stream
    assert (got.body["text"], got.body["tokens"], got.done_at, got.error) == ("Hi", 1, 5.0, None)
    assert np.isnan(got.first_token_at)


def test_refusals_of_a_server_that_is_not_a_gate_read_as_refusals():
    assert refusal_body(
        503, {"error": {"message": "x", "type": "overloaded", "reason": "queue_full"}}
    ) == {
        "error": {"message": "x", "type": "overloaded", "reason": "queue_full"}
    }  # qlab's envelope: as it is
    assert (
        refusal_body(429, {"error": {"message": "slow down", "type": "requests"}})["error"]["type"]
        == "rate_limited"
    )
    assert refusal_body(503, None)["error"]["type"] == "overloaded"
    assert refusal_body(
        400, {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}
    ) == {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}
