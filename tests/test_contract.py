"""One typed contract (live/contract.py and the live/contract_*.py beside it): every route's JSON
is its model's, a renamed field fails here instead of becoming NaN in a run file, and no client
module reads a body key by string.

The service runs in-process (FastAPI's TestClient, synthetic engine at 1/10,000 of the reference
time).
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from pydantic import BaseModel

from live import contract, contract_clients, contract_openai
from live.server_facts import ServerFacts, server_facts
from live.contract import (
    ErrorEnvelope,
    GenerateRequest,
    GenerateResponse,
    Health,
    Stats,
)
from live.contract_clients import read_answer, read_error
from live.contract_fields import Limits, num
from live.contract_openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Completion,
    ModelList,
)
from live.admin import operator_key
from live.auth import load_keys
from live.engine import Faults, SyntheticEngine
from live.gate import Gate, gate_config
from live.http_api import create_app
from live.openai_replay import completion_request, read_completion, refusal_body
from live.rows import Exchange, _row, classify, server_info
from live.routes import DEADLINE_HEADER
from qsim import preset

ROOT = Path(__file__).resolve().parents[1]
OK = GenerateRequest(prompt="hello", max_new_tokens=4).body()
# Its estimate on an idle engine passes its deadline: no queue could answer it in time (400
# deadline_too_short).
UNREACHABLE = GenerateRequest(prompt="late", max_new_tokens=4, deadline_ms=1).body()
CHAT = ChatCompletionRequest(
    model="synthetic", messages=[ChatMessage(role="user", content="hi")], max_tokens=3
)


def serve(faults: Faults = Faults()) -> TestClient:
    gate = Gate(
        [SyntheticEngine(speed=1e-4, faults=faults)],
        gate_config(preset("predictive"), fixed_estimate=True),
    )
    return TestClient(create_app(gate))


@pytest.fixture(scope="module")
def client():
    with serve() as c:
        yield c


def keys(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields)


def validated(model: type[BaseModel], response) -> BaseModel:
    """The body through its model; its JSON keys exactly the model's fields (nothing the model
    does not name)."""
    parsed = model.model_validate_json(response.content)
    assert set(response.json()) <= keys(model), (model.__name__, set(response.json()) - keys(model))
    return parsed


def stream_events(response) -> list[dict]:
    lines = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---------------------------------------------------------------------- (a) every route's JSON is
# its model's


def test_generate_answer_is_the_contracts_with_every_field(client):
    r = client.post("/v1/generate", json=OK)
    assert r.status_code == 200
    answer = validated(GenerateResponse, r)
    body = r.json()
    assert set(body) == keys(GenerateResponse)
    assert set(body["timings"]) == keys(contract.Timings)
    # Admission: what the gate's arrival reports, every number a declared field (none an untyped
    # extra).
    assert set(body["admission"]) == keys(contract.Admission) and not answer.admission.model_extra


@pytest.mark.parametrize(
    "request_body, status, type_",
    [
        (UNREACHABLE, 400, "invalid_request"),
        ({"prompt": "x", "max_new_tokens": "4"}, 422, "invalid_request"),
    ],
)
def test_error_answers_are_the_envelope(client, request_body, status, type_):
    r = client.post("/v1/generate", json=request_body)
    assert r.status_code == status
    envelope = validated(ErrorEnvelope, r)
    assert set(r.json()["error"]) == keys(contract.ErrorDetail) and envelope.error.type == type_
    numbers = envelope.error.numbers
    assert not numbers.model_extra, f"numbers the contract does not declare: {numbers.model_extra}"
    if status == 400:  # never in time: no Retry-After, and what would fit
        assert envelope.error.reason == "deadline_too_short" and "retry-after" not in r.headers
        assert numbers.fit_new_tokens == 0 and numbers.deadline_s == pytest.approx(0.001)


def test_an_engine_failure_and_an_unknown_route_are_the_envelope(client):
    with serve(Faults(fail_every=1)) as failing:  # every run raises: engine_error
        failed = failing.post("/v1/generate", json=OK)
    assert failed.status_code == 500
    envelope = validated(ErrorEnvelope, failed)
    assert envelope.error.type == "engine_error" and not envelope.error.numbers.model_extra
    assert envelope.error.numbers.engine == 0 and envelope.error.numbers.started_at is not None
    missing = client.get("/v2/nothing")
    assert (
        missing.status_code == 404 and validated(ErrorEnvelope, missing).error.reason == "not_found"
    )


def test_stats_and_health_are_their_models_exactly(client):
    stats = client.get("/stats")
    parsed = validated(Stats, stats)
    # upstream_counters: only a gate in front of a vLLM says them (tests/test_upstream_counters.py);
    # fleet: only a fleet gate (tests/test_gate_fleet.py).
    assert set(stats.json()) == keys(Stats) - {"upstream_counters", "fleet"}, (
        "a /stats key the contract's Stats does not name, or one it lost"
    )
    assert parsed.service_model is not None and not parsed.service_model.model_extra
    assert parsed.engines == 1 and math.isfinite(num(parsed.clock))
    health = client.get("/healthz")
    assert set(health.json()) == keys(Health) and validated(Health, health).status == "ok"


def test_openai_routes_are_their_models(client):
    models = validated(ModelList, client.get("/v1/models"))
    assert [m.id for m in models.data] == ["synthetic"]
    chat = client.post("/v1/chat/completions", json=CHAT.body())
    done = validated(ChatCompletion, chat)
    assert done.qlab is not None and set(chat.json()["qlab"]) == keys(contract_openai.QlabInfo)
    completion = client.post(
        "/v1/completions", json={"model": "synthetic", "prompt": "hi", "max_tokens": 2}
    )
    assert validated(Completion, completion).usage.completion_tokens == 2
    streamed = client.post(
        "/v1/chat/completions", json=CHAT.model_copy(update={"stream": True}).body()
    )
    chunks = [ChatCompletionChunk.model_validate(e) for e in stream_events(streamed)]
    assert chunks[-1].qlab is not None and chunks[-1].qlab.outcome in ("good", "late")
    refused = client.post(
        "/v1/chat/completions", json=CHAT.model_copy(update={"deadline_ms": 1}).body()
    )
    assert (
        refused.status_code == 400
        and validated(ErrorEnvelope, refused).error.reason == "deadline_too_short"
    )


# ---------------------------------------------------------------------- (b) a renamed field fails,
# never a NaN

#: The wire format as docs/http.md states it: changing a model's field name changes these, and fails
#: here.
WIRE = {
    "answer": {
        "text",
        "tokens",
        "prompt_tokens",
        "cached_prompt_tokens",
        "outcome",
        "engine",
        "timings",
        "admission",
    },
    "timings": {
        "queue_s",
        "engine_s",
        "total_s",
        "est_service_s",
        "started_at",
        "returned_at",
        "first_token_s",
    },
    "admission": {
        "arrived_at",
        "est_service_s",
        "deadline_s",
        "queued",
        "queued_work_s",
        "speed_factor",
        "in_service_s",
        "idle",
    },
    "error": {"type", "reason", "code", "message", "numbers", "retry_after_s"},
}


def test_the_wire_keys_are_the_documented_ones(client):
    body = client.post("/v1/generate", json=OK).json()
    assert (set(body), set(body["timings"]), set(body["admission"])) == (
        WIRE["answer"],
        WIRE["timings"],
        WIRE["admission"],
    )
    assert set(client.post("/v1/generate", json=UNREACHABLE).json()["error"]) == WIRE["error"]


def test_rows_read_an_answer_and_a_refusal_without_a_nan(client):
    answer = client.post("/v1/generate", json=OK)
    row = _row(Exchange(0.0, 0.0, 0.01, 200, answer.json()), 2.0, 0.1, 0.0)
    assert row["outcome"] in ("good", "late") and row["tokens"] == 4 and row["engine"] == 0
    for column in (
        "est",
        "engine_s",
        "queue_s",
        "total_s",
        "queued_work",
        "received",
        "speed_factor",
        "started",
        "returned",
        "reported",
    ):
        assert math.isfinite(row[column]), column
    assert row["queued"] >= 0
    refusal = client.post("/v1/generate", json=UNREACHABLE)
    row = _row(Exchange(0.0, 0.0, 0.01, 400, refusal.json()), 2.0, 0.1, 0.0)
    assert (row["outcome"], row["reason"]) == ("rejected", "deadline_too_short") and row[
        "retry_after"
    ] == -1
    for column in ("est", "queued_work", "received", "speed_factor", "waited"):
        assert math.isfinite(row[column]), column


def test_the_run_file_holds_the_engines_count_of_the_prompt(client):
    """An answer's prompt_tokens (an upstream's own count, e.g. vLLM's) reaches the row; an answer
    without it (a server that does not count) leaves the row's count missing, not 0."""
    from live.contract_clients import EventUsage
    from live.openai_replay import answer_body

    body = client.post("/v1/generate", json=OK).json()
    assert body["prompt_tokens"] == 5  # the synthetic engine does not count: the gate's bytes
    said = _row(Exchange(0.0, 0.0, 0.01, 200, {**body, "prompt_tokens": 4}), 2.0, 0.1, 0.0)
    silent = {k: v for k, v in body.items() if k != "prompt_tokens"}
    assert said["answered_prompt"] == 4
    assert _row(Exchange(0.0, 0.0, 0.01, 200, silent), 2.0, 0.1, 0.0)["answered_prompt"] == -1
    streamed = answer_body("hi", EventUsage(prompt_tokens=4, completion_tokens=2), None)
    assert (streamed["prompt_tokens"], streamed["tokens"]) == (4, 2)


def _renamed(body: dict, path: tuple[str, ...]) -> dict:
    body = json.loads(json.dumps(body))
    holder = body
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1] + "_renamed"] = holder.pop(path[-1])
    return body


# prompt_tokens is optional: a server that does not count the prompt's tokens answers without it;
# cached_prompt_tokens too: a server without a prefix cache (or older) says none.
@pytest.mark.parametrize(
    "path",
    [(k,) for k in sorted(WIRE["answer"] - {"prompt_tokens", "cached_prompt_tokens"})]
    + [("timings", k) for k in sorted(WIRE["timings"] - {"first_token_s"})],
)
def test_a_renamed_answer_field_is_an_error_not_a_nan(client, path):
    """The client reads through the model: a body whose field changed name is not an answer at
    all."""
    body = client.post("/v1/generate", json=OK).json()
    assert read_answer(body) is not None
    mutated = _renamed(body, path)
    assert read_answer(mutated) is None
    outcome, _, error = classify(Exchange(0.0, 0.0, 0.01, 200, mutated), 2.0)
    assert outcome == "error" and "HTTP 200" in error


def test_a_renamed_error_type_is_not_a_refusal():
    body = {"error": {"type": "overloaded", "reason": "queue_full", "retry_after_s": 1}}
    assert read_error(body).type == "overloaded"
    assert read_error(_renamed(body, ("error", "type"))) is None


# ---------------------------------------------------------------------- the readers of /stats,
# /healthz, OpenAI answers


def test_server_info_reads_what_the_gate_says_of_itself():
    """What compare replays the run with comes from /stats through the contract: each field as
    the gate has it."""
    engine = SyntheticEngine(speed=1e-4, schedule=((20.0, 2.2e-4),))
    gate = Gate(
        [engine], gate_config(preset("predictive"), fixed_estimate=True, tracker_weight=0.3)
    )
    with TestClient(create_app(gate)) as c:
        info = server_info(c.get("/stats").json())
    # the whole configuration, as the gate holds it (speed factor 1 at start)
    assert info.config == gate.config
    assert (info.config.fixed_estimate, info.config.tracker_weight, info.config.stall) == (
        True,
        0.3,
        gate.config.stall,
    )
    assert info.speed_schedule == engine.speed and info.schedule_zero == engine._started
    with pytest.raises(ValueError, match="which policy"):
        server_info({"engines": 1})


def test_server_facts_read_a_gate_and_say_nothing_of_a_foreign_server(client):
    facts = server_facts(client.get("/healthz").json(), client.get("/stats").json())
    assert facts == ServerFacts(
        "bytes", None, Limits().max_prompt_tokens, Limits().max_prompt_chars
    )
    # Pages of a server that is not a qlab gate (or none): nothing known, nothing refused.
    assert server_facts({"status": "up", "engine": "vllm"}, {"waiting": "many"}) == ServerFacts()
    assert server_facts({"engine": {"tokenizer": "t", "context": 0}}, None) == ServerFacts("t")


def test_the_openai_replayer_reads_a_gates_stream_as_its_whole_answer(client):
    """A streamed completion of a qlab gate, read event by event, is the same answer as the whole
    one."""
    request = completion_request(OK, "synthetic")
    assert (
        request["json"]
        == {
            "model": "synthetic",
            "prompt": "hello",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        and request["headers"] == {}
    )
    got = asyncio.run(read_completion(client.post("/v1/completions", **request), clock=lambda: 1.0))
    whole = read_answer(
        client.post("/v1/completions", json={**request["json"], "stream": False}).json()
    )
    answer = read_answer(got.body)
    assert got.error is None and (answer.text, answer.tokens, answer.outcome) == (
        whole.text,
        4,
        whole.outcome,
    )
    assert all(math.isfinite(num(v)) for k, v in answer.timings if k != "first_token_s")
    assert math.isfinite(num(answer.admission.arrived_at))
    refused = client.post(
        "/v1/completions",
        json={**request["json"], "stream": False},
        headers=completion_request(UNREACHABLE, "synthetic")["headers"],
    )
    assert (
        read_error(refusal_body(refused.status_code, refused.json())).reason == "deadline_too_short"
    )


# ---------------------------------------------------------------------- (c) no body key by string

#: Modules that read answers: each must read them through live.contract.
SCANNED = [
    "live/rows.py",
    "live/loadgen.py",
    "live/replay_server.py",
    "live/loadgen_clients.py",
    "live/lanes.py",
    "live/calibrate.py",
    "live/server_facts.py",
    "live/step_pages.py",
    "experiments/replay_command.py",
    "experiments/calibrate_command.py",
    "live/openai_replay.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("*.py")),
]
#: Names that hold a parsed body wherever they appear (parameters and results of the readers).
BODY_NAMES = {
    "body",
    "payload",
    "stats",
    "health",
    "answer",
    "error",
    "numbers",
    "timings",
    "seen",
    "mapping",
    "chunk",
    "event",
    "response_body",
    "choice",
    "delta",
    "card",
    "usage",
    "qlab",
    "limits",
}
#: Functions still reading a body by key, each a known debt (it must still have a hit to stay here).
#: None left.
PENDING: set[tuple[str, str]] = set()


def _fields(model: type[BaseModel], seen: set) -> set[str]:
    if model in seen:
        return set()
    seen.add(model)
    names = set(model.model_fields)
    for info in model.model_fields.values():
        for arg in _types(info.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                names |= _fields(arg, seen)
    return names


def _types(annotation) -> list:
    args = getattr(annotation, "__args__", None) or ()
    return [annotation, *[t for a in args for t in _types(a)]]


#: The modules that hold the contract's body models (live.contract_fields holds none).
CONTRACT = (contract, contract_openai, contract_clients)


def contract_fields() -> set[str]:
    """Every field name of every body model of the contract's modules."""
    models = [
        v
        for module in CONTRACT
        for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, BaseModel) and v.__module__ == module.__name__
    ]
    seen: set = set()
    return set().union(*(_fields(m, seen) for m in models))


class _Scan(ast.NodeVisitor):
    """String-keyed reads of a parsed body: ``b["k"]``, ``b.get("k")`` and ``number(b, "k")`` with
    ``k`` a contract field, where ``b`` is a body: a ``.json()`` / ``get_json()`` / ``json.loads()``
    result, an ``.body`` or ``.payload`` attribute, a name in BODY_NAMES or assigned from a body, or
    a part of one (chained reads)."""

    def __init__(self, fields: set[str]) -> None:
        self.fields, self.hits, self.function, self.bodies = fields, [], "<module>", set()

    def visit_FunctionDef(self, node) -> None:
        outer = (self.function, self.bodies)
        self.function, self.bodies = node.name, set()
        self.generic_visit(node)
        self.function, self.bodies = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def is_body(self, node) -> bool:
        if isinstance(node, ast.Await):
            return self.is_body(node.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("json", "get_json", "loads"):
                return True
            return node.func.attr == "get" and self.is_body(node.func.value)
        if isinstance(node, ast.Attribute):
            return node.attr in ("body", "payload")
        if isinstance(node, ast.Name):
            return node.id in BODY_NAMES or node.id in self.bodies
        if isinstance(node, ast.Subscript):
            return self.is_body(node.value)
        if isinstance(node, ast.BoolOp):
            return any(self.is_body(v) for v in node.values)
        return False

    def visit_Assign(self, node) -> None:
        if self.is_body(node.value):
            self.bodies |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        self.generic_visit(node)

    def _hit(self, node, key) -> None:
        if isinstance(key, ast.Constant) and key.value in self.fields:
            self.hits.append((self.function, node.lineno, key.value))

    def visit_Subscript(self, node) -> None:
        if isinstance(node.ctx, ast.Load) and self.is_body(node.value):
            self._hit(node, node.slice)
        self.generic_visit(node)

    def visit_Call(self, node) -> None:
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "get"
            and node.args
            and self.is_body(func.value)
        ):
            self._hit(node, node.args[0])
        if isinstance(func, ast.Name) and func.id == "number" and len(node.args) == 2:
            self._hit(node, node.args[1])
        self.generic_visit(node)


def scan(source: str) -> list[tuple[str, int, str]]:
    visitor = _Scan(contract_fields())
    visitor.visit(ast.parse(source))
    return visitor.hits


def test_the_scan_finds_the_readings_it_forbids():
    """The scanner would have caught what the clients did before the contract."""
    before = """
def _engine_seconds(http, body):
    response = http.post("/v1/generate", json=body)
    return float(response.json()["timings"]["engine_s"])

def _row(ex):
    body = ex.body if isinstance(ex.body, dict) else {}
    timings = body.get("timings") or {}
    seen = body.get("admission") or {}
    return number(timings, "queue_s"), seen.get("queued")

async def state(lean):
    stats = await lean.get_json("/stats")
    return stats["waiting"]
"""
    found = {(f, k) for f, _, k in scan(before)}
    assert found == {
        ("_engine_seconds", "timings"),
        ("_engine_seconds", "engine_s"),
        ("_row", "timings"),
        ("_row", "admission"),
        ("_row", "queue_s"),
        ("_row", "queued"),
        ("state", "waiting"),
    }
    # Not bodies: a frame's columns, a dict the module builds itself.
    assert scan('def f(frame, rows):\n    return frame["outcome"], rows["engine_s"]\n') == []


def test_no_client_module_reads_a_body_key_by_string():
    offending, pending_hit = [], set()
    for name in SCANNED:
        for function, line, key in scan((ROOT / name).read_text()):
            if (name, function) in PENDING:
                pending_hit.add((name, function))
            else:
                offending.append(
                    f"{name}:{line} in {function}: {key!r} (read it through live.contract)"
                )
    assert not offending, "\n".join(offending)
    assert pending_hit == PENDING, f"converted, so take them off PENDING: {PENDING - pending_hit}"


# ---------------------------------------------------------------------- the direct path of the
# OpenAI routes


def _openai_answers(direct: bool) -> list[tuple]:
    """The same OpenAI-compatible requests to a fresh app; (status, Retry-After, body less its
    ids, clocks)."""
    gate = Gate(
        [SyntheticEngine(speed=1e-4, faults=Faults(fail_every=3))],
        gate_config(preset("predictive"), fixed_estimate=True),
    )
    app = create_app(gate, direct=direct)
    assert bool(app.direct_posts) == direct
    requests = [
        ("/v1/chat/completions", CHAT.body()),
        ("/v1/completions", {"model": "synthetic", "prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", CHAT.body()),  # the third run raises: engine_error
        # refused
        ("/v1/chat/completions", CHAT.model_copy(update={"deadline_ms": 1}).body()),
        ("/v1/chat/completions", {**CHAT.body(), "n": 2}),  # unsupported_parameter
        ("/v1/completions", {"model": "other", "prompt": "hi"}),  # model_not_found
        ("/v1/chat/completions", CHAT.model_copy(update={"stream": True}).body()),
    ]

    def comparable(r) -> tuple:
        if r.headers["content-type"].startswith("text/event-stream"):
            chunks = [ChatCompletionChunk.model_validate(e) for e in stream_events(r)]
            return (
                r.status_code,
                None,
                [c.model_dump(exclude={"id", "created", "qlab"}) for c in chunks],
            )
        answer, error = read_answer(r.json()), read_error(r.json())
        if answer is not None:
            return r.status_code, None, (answer.text, answer.tokens, answer.outcome, answer.engine)
        return (
            r.status_code,
            r.headers.get("retry-after"),
            (error.type, error.reason, sorted(error.numbers.model_fields_set)),
        )

    with TestClient(app) as c:
        return [comparable(c.post(path, json=body)) for path, body in requests]


def test_the_openai_routes_answer_the_same_on_the_direct_path():
    direct, routed = _openai_answers(True), _openai_answers(False)
    assert direct == routed
    assert [status for status, _, _ in direct] == [200, 200, 500, 400, 400, 404, 200]


# ---------------------------------------------------------- (c) /openapi.json and the server agree

COMPLETION = {"model": "synthetic", "prompt": "hi", "max_tokens": 2}


def _published(client, path: str) -> dict:
    operation = client.get("/openapi.json").json()["paths"][path]["post"]
    return operation["requestBody"]["content"]["application/json"]["schema"]["properties"]


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/generate", OK, "max_new_tokens"),
        ("/v1/generate", OK, "deadline_ms"),
        ("/v1/generate", OK, "priority"),
        ("/v1/completions", COMPLETION, "max_tokens"),
        ("/v1/completions", COMPLETION, "seed"),
        ("/v1/completions", COMPLETION, "top_k"),
        ("/v1/chat/completions", CHAT.body(), "max_completion_tokens"),
        ("/v1/chat/completions", CHAT.body(), "stop_token_ids"),
    ],
)
def test_an_integer_field_takes_an_integral_float_as_json_schema_and_vllm_do(
    client, path, body, field
):
    """61.0 is an integer by JSON Schema (what /openapi.json says), and vLLM takes it; 61.5 and
    "61" are not."""
    value = {
        "max_new_tokens": 3,
        "deadline_ms": 60_000,
        "priority": 1,
        "max_tokens": 3,
        "seed": 7,
        "top_k": 5,
        "max_completion_tokens": 3,
        "stop_token_ids": [5],
    }[field]
    as_float = [float(v) for v in value] if isinstance(value, list) else float(value)
    whole = client.post(path, json={**body, field: as_float})
    exact = client.post(path, json={**body, field: value})
    assert whole.status_code == exact.status_code == 200, whole.text
    assert read_answer(whole.json()).tokens == read_answer(exact.json()).tokens
    schema = _published(client, path)[field]
    assert "integer" in json.dumps(schema), schema
    for bad in (value[0] + 0.5 if isinstance(value, list) else value + 0.5, str(value), True):
        bad = [bad] if isinstance(value, list) else bad
        refused = client.post(path, json={**body, field: bad})
        error = read_error(refused.json())
        assert refused.status_code == 422 and error.reason == "invalid_field", bad
        assert field in error.message


@pytest.mark.parametrize(
    "path, body",
    [("/v1/generate", OK), ("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT.body())],
)
def test_stop_is_a_string_or_an_array_in_the_schema_as_the_server_takes_it(client, path, body):
    kinds = {branch["type"] for branch in _published(client, path)["stop"]["anyOf"]}
    assert kinds == {"string", "array", "null"}
    for stop in ("tok", ["tok"]):
        r = client.post(path, json={**body, "stop": stop})
        assert r.status_code == 200 and read_answer(r.json()).text == " ", r.text  # cut there
    for bad in ("", 5, "s" * 65, ["a"] * 9):
        refused = client.post(path, json={**body, "stop": bad})
        assert refused.status_code == 422 and "stop" in read_error(refused.json()).message, bad


#: Each field of which the server honours only some values: one it honours, one it refuses (400).
ONLY = {
    "/v1/completions": {
        "n": (1, 2),
        "best_of": (1, 3),
        "logprobs": (None, 2),
        "suffix": ("", "end"),
        "use_beam_search": (False, True),
        "prompt_logprobs": (None, 1),
    },
    "/v1/chat/completions": {
        "logprobs": (False, True),
        "top_logprobs": (None, 2),
        "tools": ([], [{"x": 1}]),
        "tool_choice": ("none", "auto"),
        "functions": ([], [{"x": 1}]),
        "function_call": ("none", "auto"),
        "response_format": ({"type": "text"}, {}),
    },
}


@pytest.mark.parametrize("path, field", [(p, f) for p, fields in ONLY.items() for f in fields])
def test_a_field_served_in_part_lists_in_the_schema_just_what_is_served(client, path, field):
    """``suffix: ""`` (no suffix) is served; ``response_format: {}`` is refused; the schema says
    both."""
    served, refused = ONLY[path][field]
    body = COMPLETION if path == "/v1/completions" else CHAT.body()
    schema = _published(client, path)[field]
    assert served in schema["enum"] and None in schema["enum"], schema
    assert refused not in schema["enum"], schema
    assert client.post(path, json={**body, field: served}).status_code == 200
    r = client.post(path, json={**body, field: refused})
    error = read_error(r.json())
    assert r.status_code == 400 and error.reason == "unsupported_parameter"
    assert field in error.message
    assert client.post(path, json={**body, field: None}).status_code == 200


def test_the_schema_names_the_one_model_served_and_a_batch_of_one_prompt(client):
    completion = _published(client, "/v1/completions")
    assert completion["model"]["enum"] == ["synthetic"]
    assert _published(client, "/v1/chat/completions")["model"]["enum"] == ["synthetic"]
    batch = next(b for b in completion["prompt"]["anyOf"] if b["type"] == "array")
    assert (batch["minItems"], batch["maxItems"]) == (1, 1)
    assert client.post("/v1/completions", json={**COMPLETION, "prompt": ["hi"]}).status_code == 200
    two = client.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"]})
    assert two.status_code == 400 and read_error(two.json()).reason == "unsupported_parameter"


def _security(keys=None, operator=None) -> dict:
    gate = Gate(
        [SyntheticEngine(speed=1e-4)], gate_config(preset("predictive"), fixed_estimate=True)
    )
    with TestClient(create_app(gate, keys=keys, operator=operator)) as c:
        return c.get("/openapi.json").json()


def test_the_schema_declares_the_bearer_keys_the_gate_enforces():
    open_doc = _security()
    assert "securitySchemes" not in open_doc["components"]
    assert not any("security" in op for item in open_doc["paths"].values() for op in item.values())
    doc = _security(load_keys("k", None), operator_key("op"))
    schemes = doc["components"]["securitySchemes"]
    assert schemes["apiKey"] == {**schemes["apiKey"], "type": "http", "scheme": "bearer"}
    assert schemes["operatorKey"] == {**schemes["operatorKey"], "type": "http", "scheme": "bearer"}
    security = {
        path: op.get("security") for path, item in doc["paths"].items() for op in item.values()
    }
    keyed = {p for p, s in security.items() if s == [{"apiKey": []}]}
    assert keyed == {p for p in security if p.startswith("/v1/")}
    assert security["/admin/calibration"] == [{"operatorKey": []}]
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert "enum" not in body["schema"]["properties"]["model"]  # /v1/models wants a key: it says
    assert security["/stats"] is security["/ready"] is None  # open without --auth-stats, as served
    guarded = _security(load_keys("k", None, guard_stats=True))["paths"]
    assert all(
        guarded[p]["get"]["security"] == [{"apiKey": []}]
        for p in ("/stats", "/healthz", "/metrics")
    )


@pytest.mark.parametrize(
    "path, body",
    [("/v1/generate", OK), ("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT.body())],
)
def test_every_admitting_route_honours_the_deadline_header_the_same_way(client, path, body):
    short = client.post(path, json=body, headers={DEADLINE_HEADER: "1"})
    error = read_error(short.json())
    assert short.status_code == 400 and error.reason == "deadline_too_short"
    assert error.numbers.deadline_s == pytest.approx(0.001)
    bad = client.post(path, json=body, headers={DEADLINE_HEADER: "soon"})
    assert bad.status_code == 422 and DEADLINE_HEADER in read_error(bad.json()).message
    body_wins = client.post(
        path, json={**body, "deadline_ms": 60_000}, headers={DEADLINE_HEADER: "1"}
    )
    assert body_wins.status_code == 200, body_wins.text
    operation = client.get("/openapi.json").json()["paths"][path]["post"]
    declared = {p["name"]: p["schema"] for p in operation["parameters"] if p["in"] == "header"}
    assert declared[DEADLINE_HEADER] == {"type": "integer", "minimum": 1, "maximum": 600_000}
