"""The exact requests the benchmark clients send, replayed: every one is served.

tests/data/clients/TOOL.json holds the first requests guidellm, inference-perf and aiperf sent to
``qlab serve`` (method, path, headers, body; recorded by ``RECORD=tests/data/clients bash
benchmarks/clients_check.sh``, which runs the tools themselves; they are not run here). Each is sent
again, headers and all, to the service in-process (synthetic engine at 1/10,000 of the reference
time, policy ``predictive``), and must be answered 200 with its answer in full: a stream of OpenAI
chunks ending ``data: [DONE]``, with the usage chunk the tool asked for, or a whole completion.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from live.engine import SyntheticEngine
from live.gate import Gate, gate_config
from live.http_api import create_app
from qsim import preset

RECORDED = Path(__file__).resolve().parent / "data" / "clients"
TOOLS = ("guidellm", "inference-perf", "aiperf")


def _requests(tool: str) -> list[dict]:
    return json.loads((RECORDED / f"{tool}.json").read_text())["requests"]


CASES = [(tool, i) for tool in TOOLS for i in range(len(_requests(tool)))]


@pytest.fixture(scope="module")
def client():
    gate = Gate(
        [SyntheticEngine(speed=1e-4)], gate_config(preset("predictive"), fixed_estimate=True)
    )
    with TestClient(create_app(gate)) as c:
        yield c


def test_each_tool_left_requests_to_replay():
    for tool in TOOLS:
        sent = _requests(tool)
        assert sent and all(r["method"] == "POST" and r["body"] for r in sent), tool


@pytest.mark.parametrize("tool, i", CASES, ids=[f"{t}-{i}" for t, i in CASES])
def test_every_recorded_request_is_served(client, tool, i):
    sent = _requests(tool)[i]
    r = client.request(
        sent["method"], sent["path"], headers=sent["headers"], content=json.dumps(sent["body"])
    )
    assert r.status_code == 200, r.text
    body = sent["body"]
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    if body.get("stream"):
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        if (body.get("stream_options") or {}).get("include_usage"):
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == asked
    else:
        assert r.json()["usage"]["completion_tokens"] == asked
    if "x-slo-ttft-ms" in sent["headers"]:  # inference-perf's objectives reach the answer
        last = chunks[-2] if body.get("stream") else r.json()
        assert last["qlab"]["ttft_slo_s"] == float(sent["headers"]["x-slo-ttft-ms"]) / 1000
