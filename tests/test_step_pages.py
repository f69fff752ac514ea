"""/stats' step log in pages (issue 32, section 3), and a replay that keeps its rows when the step
log cannot be read (section 1).

The gate runs in-process (FastAPI's TestClient); its step log is filled with synthetic steps, so no
step is run.
"""

import asyncio
import math
from dataclasses import astuple

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from live import replay_server, step_pages  # noqa: E402
from live.batching import STEP_PAGE, SyntheticBatchEngine  # noqa: E402
from live.gate import BatchGate, Gate, gate_config  # noqa: E402
from live.http_api import create_app  # noqa: E402
from live.lanes import Lanes  # noqa: E402
from live.replay_config import ReplayConfig  # noqa: E402
from qsim import PRESETS  # noqa: E402
from qsim.engines import Batching, StepModel  # noqa: E402
from qsim.runfile import LoggedStep  # noqa: E402

ENGINE = Batching(
    StepModel(0.01, 0.0001, 0.0002, 0.000001), max_num_seqs=8, max_num_batched_tokens=256
)


def _gate(steps: int, ties: int = 1) -> Gate:
    """A batching gate whose log holds ``steps`` synthetic steps, ``ties`` of them at a time woken
    at the same instant (step i woken at i // ties, so a page boundary can fall inside a tie)."""
    gate = BatchGate(SyntheticBatchEngine(ENGINE.step), gate_config(PRESETS["none"], engine=ENGINE))
    for i in range(steps):
        woken = float(i // ties)
        gate.driver.log_step(LoggedStep(woken, woken, woken + 0.5, 0.5, 0.5, i, 1, 10))
    return gate


def _all_pages(client: TestClient, since: float, limit: int) -> tuple[list, int]:
    """Every step from ``since``, following the cursor; and how many pages that took."""
    answer = client.get("/stats", params={"steps_since": since, "steps_limit": limit}).json()
    steps, pages = list(answer["step_log"]), 1
    while answer["step_log_next"] is not None:
        query = {"steps_from": answer["step_log_next"], "steps_limit": limit}
        answer = client.get("/stats", params=query).json()
        steps += answer["step_log"]
        pages += 1
    return steps, pages


def test_a_full_step_log_comes_in_bounded_pages_that_never_repeat_or_skip_a_step():
    with TestClient(create_app(_gate(12_345, ties=3))) as client:
        first = client.get("/stats", params={"steps_since": 0}).json()
        steps, pages = _all_pages(client, 0.0, 1_000)
        # A tie of three woken at 2000 s: none lost, none twice.
        later, _ = _all_pages(client, 2_000.0, 7)
    assert len(first["step_log"]) == STEP_PAGE and first["step_log_next"] == STEP_PAGE
    assert [s[5] for s in steps] == list(range(12_345)) and pages == 13
    assert [s[5] for s in later] == list(range(6_000, 12_345))


def test_a_cursor_older_than_the_log_starts_at_its_oldest_step():
    gate = _gate(10)
    for _ in range(4):  # the log forgets its oldest: as a full deque does
        gate.driver.step_log.popleft()
    with TestClient(create_app(gate)) as client:
        answer = client.get("/stats", params={"steps_from": 1}).json()
        done = client.get("/stats", params={"steps_from": 10}).json()
    assert [s[5] for s in answer["step_log"]] == [4, 5, 6, 7, 8, 9]
    assert answer["step_log_next"] is None
    assert done["step_log"] == [] and done["step_log_next"] is None


@pytest.mark.parametrize(
    "query",
    [
        {"steps_since": "nan"},
        {"steps_since": "NaN"},
        {"steps_since": "inf"},
        {"steps_since": "-Infinity"},
        {"steps_since": "soon"},
        {"steps_since": 0, "steps_limit": 0},
        {"steps_since": 0, "steps_limit": STEP_PAGE + 1},
        {"steps_from": -1},
    ],
)
def test_a_bad_step_query_is_a_422_in_the_envelope_and_the_gate_keeps_serving(query):
    with TestClient(create_app(_gate(3))) as client:
        bad = client.get("/stats", params=query)
        after = client.get("/stats", params={"steps_since": 0})
    assert bad.status_code == 422
    error = bad.json()["error"]
    assert (error["type"], error["reason"]) == ("invalid_request", "invalid_field")
    assert after.status_code == 200 and len(after.json()["step_log"]) == 3


def test_stats_without_a_step_query_holds_no_step_log():
    with TestClient(create_app(_gate(3))) as client:
        answer = client.get("/stats").json()
    assert "step_log" not in answer and "step_log_next" not in answer


def test_the_calibrator_and_the_replayer_read_every_page():
    gate = _gate(STEP_PAGE * 2 + 17)
    # Step models the gate took after steps 3 and STEP_PAGE + 5 (a learner's refits): the replayer
    # counts each from the run's first step, across pages.
    gate.driver.step_models += [(4, StepModel(0.02)), (STEP_PAGE + 6, StepModel(0.03, cv=0.1))]
    with TestClient(create_app(gate)) as client:
        read = step_pages.fetch_steps(client, 0.0)

        def forward(request: httpx.Request) -> httpx.Response:  # the replayer's lanes, in-process
            answer = client.get(request.url.path, params=request.url.params)
            return httpx.Response(
                answer.status_code, content=answer.content, headers=answer.headers
            )

        replayed = asyncio.run(
            _with_lanes(forward, lambda lanes: replay_server.fetch_steps(lanes, 0.0))
        )
    assert [s.prefill_tokens for s in read] == list(range(STEP_PAGE * 2 + 17))
    assert [s[5] for s in replayed.steps] == list(range(STEP_PAGE * 2 + 17))
    assert replayed.models == [[at, *astuple(model)] for at, model in gate.driver.step_models]


async def _with_lanes(handler, use):
    """``use(lanes)`` on the replayer's :class:`live.lanes.Lanes` whose every lane is httpx's
    MockTransport of ``handler``."""
    lanes = Lanes(ReplayConfig("http://gate.test"))
    lanes._new = lambda: httpx.MockTransport(handler)
    async with lanes:
        return await use(lanes)


def _died(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("All connection attempts failed", request=request)


@pytest.mark.parametrize(
    "handler, said",
    [
        (_died, "ConnectError"),
        (lambda r: httpx.Response(500, json={"error": {}}), "HTTP 500"),
        (lambda r: httpx.Response(200, content=b"<html>"), "JSONDecodeError"),
        (lambda r: httpx.Response(200, json=[1, 2]), "no step log"),
        (
            lambda r: httpx.Response(200, json={"step_log": [], "step_log_next": 0}),
            "more than 1000 pages",
        ),
    ],
)
def test_a_step_log_that_cannot_be_read_is_a_warning_not_an_exception(handler, said):
    steps, why = asyncio.run(_with_lanes(handler, lambda lanes: replay_server.step_log(lanes, 0.0)))
    assert steps is None and said in why and why.startswith("the gate's step log was not read")


def test_a_readable_step_log_has_no_warning():
    page = {"step_log": [[0.0, 0.0, 1.0, 1.0, 1.0, 5, 1, 10]], "step_log_next": None}
    steps, why = asyncio.run(
        _with_lanes(
            lambda r: httpx.Response(200, json=page),
            lambda lanes: replay_server.step_log(lanes, -math.inf),
        )
    )
    assert steps.steps == page["step_log"] and steps.models == [] and why is None
