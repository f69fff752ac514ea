"""Hostile input: fuzz ``POST /v1/generate``, the caps at their edges, malformed trace files and
TOML configs.

The service is fuzzed in-process (the FastAPI app on an event loop of its own,
through httpx's ASGI transport, synthetic engine at 1/10,000 of the reference
time, so a request costs about a millisecond) and, more briefly, through a real
``qlab serve`` subprocess on loopback. Every answer must be a 200 or a 4xx/503
in the one error envelope, never a 500 and never a hang; afterwards the service
still serves and its /stats count exactly the requests that reached the gate.

Runs are deterministic (hypothesis derandomized, no example database).
``QLAB_FUZZ_EXAMPLES=2000`` fuzzes longer and ``QLAB_FUZZ_EXPLORE=1`` draws new examples
on each run; the defaults keep this file near 30 s.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import math
import os
import re
import socket
import threading
import tomllib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from experiments import config as sweep_config  # noqa: E402
from live import live_config  # noqa: E402
from live.engine import SyntheticEngine, apply_stop  # noqa: E402
from live.gate import Gate, gate_config  # noqa: E402
from live.procs import Server  # noqa: E402
from live.serve_options import ServeOptions  # noqa: E402
from live.http_api import Limits, create_app, request_model  # noqa: E402
from qsim import load_trace, make_trace, preset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = int(os.environ.get("QLAB_FUZZ_EXAMPLES", "150"))
# fresh random examples on each run, to hunt for new failures
EXPLORE = os.environ.get("QLAB_FUZZ_EXPLORE") == "1"
# no answer within this is a hung request: the synthetic engine here takes about a millisecond
HANG_S = 5.0


def fuzz(share: float = 1.0):
    """Deterministic in CI: the same examples on every run, nothing remembered between runs."""
    return settings(
        max_examples=max(10, int(EXAMPLES * share)),
        derandomize=not EXPLORE,
        database=None,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.large_base_example,
        ],
    )


# ================================================================== the answer's contract

ENVELOPE_KEYS = {"type", "reason", "code", "message", "numbers", "retry_after_s"}
# deadline_too_short: well-formed, but no queue could answer it in time (the gate counts it
# rejected).
INVALID_REASONS = {
    400: {"malformed_json", "deadline_too_short"},
    413: {"body_too_large"},
    415: {"unsupported_media_type"},
    422: {"invalid_field", "prompt_too_long"},
}
GATE_OUTCOME = {"overloaded": "rejected", "deadline_exceeded": "expired", "engine_error": "error"}


def check_answer(r: httpx.Response) -> dict:
    """The contract every answer keeps, whatever was sent; returns the parsed body."""
    assert r.status_code != 500, f"a 500 for bad input: {r.text[:500]}"
    assert r.status_code in (200, 503, *INVALID_REASONS), (
        f"unexpected status {r.status_code}: {r.text[:300]}"
    )
    body = r.json()
    if r.status_code == 200:
        assert set(body) == {
            "text",
            "tokens",
            "prompt_tokens",
            "cached_prompt_tokens",
            "outcome",
            "engine",
            "timings",
            "admission",
        }, body
        assert body["outcome"] in ("good", "late")
        return body
    assert set(body) == {"error"} and set(body["error"]) == ENVELOPE_KEYS, body
    e = body["error"]
    assert isinstance(e["message"], str) and e["message"].strip(), e
    assert isinstance(e["numbers"], dict) and all(
        v is None or isinstance(v, (int, float)) for v in e["numbers"].values()
    )
    if r.status_code == 503:
        assert e["type"] in ("overloaded", "deadline_exceeded"), e
        assert isinstance(e["retry_after_s"], int) and e["retry_after_s"] >= 1
        assert r.headers["retry-after"] == str(e["retry_after_s"])
    else:
        assert e["type"] == "invalid_request" and e["retry_after_s"] is None, e
        assert e["reason"] in INVALID_REASONS[r.status_code], e
    return body


def gate_outcome(r: httpx.Response) -> str | None:
    """What the gate counted for this answer (None: refused before the gate, a 4xx)."""
    if r.status_code == 200:
        return r.json()["outcome"]
    if r.json()["error"]["reason"] == "deadline_too_short":
        return "rejected"
    return GATE_OUTCOME.get(r.json()["error"]["type"])


class Tally:
    """Client-side counts of what reached the gate, to compare with /stats."""

    def __init__(self) -> None:
        self.outcomes: Counter = Counter()

    def add(self, r: httpx.Response) -> None:
        outcome = gate_outcome(r)
        if outcome is not None:
            self.outcomes[outcome] += 1


def assert_stats_match(stats: dict, tally: Tally, before: dict | None = None) -> None:
    """/stats counted exactly what the client saw, and nothing is left waiting or in service."""
    base = before or dict.fromkeys(stats["counts"], 0)
    delta = {k: stats["counts"][k] - base[k] for k in stats["counts"]}
    assert delta == {k: tally.outcomes.get(k, 0) for k in stats["counts"]}, (delta, tally.outcomes)
    assert stats["waiting"] == 0 and stats["in_service"] == 0, stats


# ================================================================== the service in-process


class InProcess:
    """The app and its gate on an event loop in a thread of their own.

    Hypothesis drives sync functions; each request is handed to the loop and
    waited for with a timeout, so a hung request fails the test instead of hanging it.
    The lifespan runs as under uvicorn (the gate's engine threads start and stop with it).
    """

    def __init__(self, gate: Gate, limits: Limits = Limits()) -> None:
        self.gate, self.limits = gate, limits
        self.tally = Tally()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fuzz-app", daemon=True)

    def __enter__(self) -> "InProcess":
        self._thread.start()
        self._call(self._open())
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._call(self._close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    async def _open(self) -> None:
        self.app = create_app(self.gate, self.limits)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        # raise_app_exceptions=False: an unhandled error must show as the 500 a client would get.
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://qlab.test")

    async def _close(self) -> None:
        await self.client.aclose()
        await self._lifespan.__aexit__(None, None, None)

    def _call(self, coro, timeout_s: float = HANG_S):
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout_s), self._loop)
        try:
            return future.result(timeout_s + 1)
        except (TimeoutError, asyncio.TimeoutError):
            raise AssertionError(f"no answer within {timeout_s} s: a hung request") from None

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        r = self._call(self.client.request(method, path, **kwargs))
        if path == "/v1/generate":
            check_answer(r)
            self.tally.add(r)
        return r

    def post(self, body: bytes, content_type: str | None = "application/json") -> httpx.Response:
        # Bytes: a header is Latin-1 on the wire, and httpx would refuse a str outside ASCII.
        headers = {} if content_type is None else {"content-type": content_type.encode("latin-1")}
        return self.request("POST", "/v1/generate", content=body, headers=headers)

    def stats(self) -> dict:
        return self._call(self.client.get("/stats")).json()

    def assert_still_serving(self) -> None:
        """A valid request succeeds after everything sent before, and /stats agree with the
        client."""
        r = self.post(json.dumps({"prompt": "still there?", "max_new_tokens": 3}).encode())
        assert r.status_code == 200 and r.json()["tokens"] == 3, r.text
        assert_stats_match(self.stats(), self.tally)


def fast_gate(policy: str = "predictive", engines=None) -> Gate:
    # Predictive with the fixed (calibrated) estimate: a deadline_ms below the estimate is refused
    # at arrival as never in time (400 deadline_too_short) by the same arithmetic on every run, so
    # those are part of the fuzz.
    engines = engines or [SyntheticEngine(speed=1e-4)]
    return Gate(engines, gate_config(preset(policy), fixed_estimate=True))


@pytest.fixture(scope="module")
def service():
    with InProcess(fast_gate()) as svc:
        yield svc


# ================================================================== strategies


def published_schema(svc: InProcess) -> dict:
    """The request body's JSON schema as the service publishes it.

    From its OpenAPI document when it serves one with the body's schema; until
    then (see test_service_publishes_its_openapi_document) from the service's own
    request model under the limits it reports in /stats, which is what that document
    would hold.
    """
    r = svc.request("GET", "/openapi.json")
    if r.status_code == 200:
        doc = r.json()
        body = doc["paths"]["/v1/generate"]["post"].get("requestBody")
        if body:
            schema = body["content"]["application/json"]["schema"]
            if "$ref" in schema:
                schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
            return schema
    return request_model(Limits(**svc.stats()["limits"])).model_json_schema()


KNOWN_KEYWORDS = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "anyOf",
    "items",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "title",
    "default",
    "description",
}
# Characters of 1 to 4 UTF-8 bytes: prompts near the character cap then cross the token (byte) cap
# or not.
WIDE_CHARS = ["a", "\u00e9", "\u20ac", "\U0001f600"]


def from_schema(schema: dict) -> st.SearchStrategy:
    """Instances of a JSON schema, for the keywords a pydantic model of flat fields emits.

    (hypothesis-jsonschema would do this, but its current release does not run on this
    hypothesis.) A keyword it does not know fails loudly rather than being ignored.
    """
    unknown = set(schema) - KNOWN_KEYWORDS
    if unknown:
        raise NotImplementedError(f"schema keywords {sorted(unknown)}: extend from_schema")
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    kind = schema["type"]
    if kind == "null":
        return st.none()
    if kind == "integer":  # JSON Schema's integer: 61 and 61.0 alike
        whole = st.integers(schema.get("minimum"), schema.get("maximum"))
        return whole | whole.map(float)
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength", 10_000)
        near_the_cap = st.tuples(
            st.integers(max(low, high - 64), high), st.sampled_from(WIDE_CHARS)
        )
        return st.text(min_size=low, max_size=min(high, 40)) | near_the_cap.map(
            lambda t: t[1] * t[0]
        )
    if kind == "array":
        return st.lists(
            from_schema(schema["items"]),
            min_size=schema.get("minItems", 0),
            max_size=schema.get("maxItems", 10),
        )
    if kind == "object":
        assert schema.get("additionalProperties") is False, (
            "an open object: fuzz its extra keys too"
        )
        props = {k: from_schema(v) for k, v in schema["properties"].items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    raise NotImplementedError(f"schema type {kind!r}")


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=20,
)
FIELDS = ("prompt", "max_new_tokens", "deadline_ms", "stop")


def _raw_number_body(digits: str) -> bytes:
    return b'{"prompt": "x", "max_new_tokens": ' + digits.encode() + b"}"


def _nested(depth: int, opener: str) -> bytes:
    close = {"[": "]", '{"a":': "}"}[opener]
    return (opener * depth + "1" + close * depth).encode()


junk_bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),  # any JSON value at all
    st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=6).map(
        lambda d: json.dumps(d).encode()
    ),  # right keys, any values
    st.binary(max_size=300),  # not JSON
    # unicode, even lone surrogates
    st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.from_regex(r"-?[0-9]{1,5000}(\.[0-9]{0,50})?([eE][+-]?[0-9]{1,6})?", fullmatch=True).map(
        _raw_number_body
    ),
    st.sampled_from(
        ["NaN", "Infinity", "-Infinity", "1e999", "-0", "0.0", "1E2", "true", "null"]
    ).map(_raw_number_body),
    st.tuples(st.integers(1, 5000), st.sampled_from(["[", '{"a":'])).map(lambda t: _nested(*t)),
    st.just(b'{"prompt": "x", "max_new_tokens": 1, "max_new_tokens": "many"}'),  # duplicate keys
    st.just(b'\xef\xbb\xbf{"prompt": "bom", "max_new_tokens": 1}'),  # a byte-order mark
)
content_types = st.one_of(
    st.sampled_from(
        [
            "application/json",
            "application/json; charset=utf-8",
            "APPLICATION/JSON",
            "application/problem+json",
            "application/json; charset=utf-16",
        ]
    ),
    st.sampled_from(
        [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/octet-stream",
            "",
            "*/*",
            "json",
            "application/jsonx",
            ";",
        ]
    ),
    st.text(
        st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
        max_size=30,
    ),
    st.none(),  # no header: JSON is assumed
)
ACCEPTED_MEDIA = re.compile(r"^(application/json|[^;]*\+json)$")


def is_json_media(content_type: str | None) -> bool:
    media = (
        (content_type if content_type is not None else "application/json")
        .split(";")[0]
        .strip()
        .lower()
    )
    return bool(ACCEPTED_MEDIA.match(media))


# Values that break one field of an otherwise valid body: wrong types, out of range, too long.
_not_a_string = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_fractional = st.floats(allow_nan=False).filter(lambda f: not f.is_integer())  # 61.0 is an integer
_not_an_int = st.one_of(
    st.booleans(),
    _fractional,
    st.text(max_size=10),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
BAD_VALUES = {
    "prompt": _not_a_string | st.integers(16_385, 20_000).map(lambda n: "p" * n),
    "max_new_tokens": st.none()
    | _not_an_int
    | st.integers(max_value=0)
    | st.integers(min_value=1025),
    "deadline_ms": _not_an_int | st.integers(max_value=0) | st.integers(min_value=600_001),
    "stop": st.one_of(
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False),
        st.just(""),
        st.text(min_size=65, max_size=80),
        st.lists(st.text(min_size=1, max_size=5), min_size=9, max_size=12),
        st.lists(
            st.just("") | st.integers() | st.none() | st.text(min_size=65, max_size=70),
            min_size=1,
            max_size=3,
        ),
    ),
}


# ================================================================== fuzzing the app in-process


def test_service_publishes_its_openapi_document(service):
    r = service.request("GET", "/openapi.json")
    assert r.status_code == 200
    op = r.json()["paths"]["/v1/generate"]["post"]
    assert "requestBody" in op


def test_a_trailing_slash_gets_the_envelope_too(service):
    r = service.request("POST", "/v1/generate/", json=_body())
    assert r.status_code == 404 and r.json()["error"]["reason"] == "not_found", (
        r.status_code,
        r.text,
    )


def test_bodies_valid_by_the_schema_are_answered(service):
    """Whatever the schema allows is admitted by the service (200, or a 503 from the policy), never
    refused as invalid, unless it passes a cap a JSON schema cannot state: prompt tokens, or body
    bytes."""
    schema = published_schema(service)
    stats = service.stats()
    limits, default_deadline_s = Limits(**stats["limits"]), stats["policy"]["deadline_s"]
    try:
        from jsonschema import Draft202012Validator

        validate = Draft202012Validator(schema).validate
    except ImportError:  # only the cross-check of the strategy itself is lost
        validate = lambda body: None  # noqa: E731

    @fuzz()
    @given(from_schema(schema), st.booleans())
    def run(body, ascii_only):
        validate(body)  # the strategy makes what the schema allows
        data = json.dumps(body, ensure_ascii=ascii_only).encode()
        r = service.post(data)
        if len(data) > limits.max_body_bytes:  # checked first, before parsing
            assert r.status_code == 413, r.text
            return
        # within the characters, past the tokens
        if len(body["prompt"].encode()) > limits.max_prompt_tokens:
            assert r.status_code == 422 and r.json()["error"]["reason"] == "prompt_too_long", r.text
            return
        assert r.status_code in (200, 400), r.text
        if r.status_code == 200:
            stop = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop")
            text = " tok" * int(body["max_new_tokens"])
            cut = apply_stop(text, stop)
            assert r.json()["tokens"] == body["max_new_tokens"]
            assert r.json()["text"] == (text if cut is None else cut)
        # predictive, fixed estimate, nothing queued: only a deadline shorter than the service is
        # refused,
        else:
            e = r.json()["error"]  # as one no queue could answer in time
            deadline_ms = body.get("deadline_ms")
            assert e["reason"] == "deadline_too_short" and "retry-after" not in r.headers
            assert e["numbers"]["deadline_s"] == (
                default_deadline_s if deadline_ms is None else deadline_ms / 1000
            )
            assert e["numbers"]["deadline_s"] < e["numbers"]["est_service_s"]

    run()
    service.assert_still_serving()


def test_one_bad_field_is_a_422_that_names_it(service):
    @fuzz()
    @given(st.sampled_from(FIELDS + ("missing", "unknown")), st.data())
    def run(field, data):
        body = {"prompt": "hi", "max_new_tokens": 2, "deadline_ms": 60_000, "stop": ["zz"]}
        if field == "missing":
            field = data.draw(st.sampled_from(["prompt", "max_new_tokens"]))
            del body[field]
        elif field == "unknown":
            field = data.draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in FIELDS))
            body[field] = data.draw(json_values)
        else:
            body[field] = data.draw(BAD_VALUES[field])
        r = service.post(json.dumps(body).encode())
        error = r.json().get("error", {})
        assert r.status_code == 422 and error["reason"] == "invalid_field", (body, r.text)
        assert field in error["message"], (field, error["message"])

    run()
    service.assert_still_serving()


def test_arbitrary_bytes_and_content_types_never_break_the_service(service):
    @fuzz(2.0)
    @given(junk_bodies, content_types)
    def run(body, content_type):
        r = service.post(body, content_type)  # check_answer: an envelope, never a 500, never a hang
        if not is_json_media(content_type):
            assert r.status_code == 415, (content_type, r.text)
        # reached the gate: it was well-formed
        elif r.status_code in (200, 503) or gate_outcome(r) is not None:
            sent = json.loads(body)
            assert isinstance(sent, dict) and isinstance(sent["prompt"], str), body
            new = sent["max_new_tokens"]
            assert type(new) in (int, float) and new == int(new) and 1 <= new <= 1024, body

    run()
    service.assert_still_serving()


def test_oversized_bodies_are_refused_declared_or_streamed(service):
    cap = Limits(**service.stats()["limits"]).max_body_bytes

    @fuzz(0.2)
    @given(st.integers(cap + 1, 4 * cap), st.booleans())
    def run(size, streamed):
        body = b'{"prompt": "' + b"a" * size + b'", "max_new_tokens": 1}'

        async def chunks():  # no Content-Length: the cap must hold while reading
            for i in range(0, len(body), 8192):
                yield body[i : i + 8192]

        r = service.request(
            "POST",
            "/v1/generate",
            content=chunks() if streamed else body,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 413 and r.json()["error"]["reason"] == "body_too_large"

    run()
    service.assert_still_serving()


# ================================================================== the caps at their edges
# tests/test_http_api.py checks values well outside each cap; these check its edge: the
# largest accepted value is served, the next one is a 4xx naming the field.


def _body(**fields) -> dict:
    # The longest deadline: the predictive gate admits even 1,024 tokens (8.7 s at the reference
    # speed).
    return {"prompt": "x", "max_new_tokens": 1, "deadline_ms": 600_000, **fields}


EDGES = {
    "max_new_tokens": (
        [_body(max_new_tokens=1), _body(max_new_tokens=1024)],
        [_body(max_new_tokens=1025)],
        "max_new_tokens",
    ),
    "deadline_ms": (
        [_body(deadline_ms=600_000)],
        [_body(deadline_ms=0), _body(deadline_ms=600_001)],
        "deadline_ms",
    ),
    "prompt chars": ([_body(prompt="a" * 16_384)], [_body(prompt="a" * 16_385)], "prompt"),
    # 2 bytes each
    "prompt tokens": ([_body(prompt="\u00e9" * 8_192)], [_body(prompt="\u00e9" * 8_193)], "prompt"),
    "stop count": ([_body(stop=["s"] * 8)], [_body(stop=["s"] * 9)], "stop"),
    "stop length": ([_body(stop="s" * 64)], [_body(stop="s" * 65), _body(stop=["s" * 65])], "stop"),
}


@pytest.mark.parametrize("cap", list(EDGES))
def test_each_cap_serves_its_edge_and_refuses_past_it(service, cap):
    ok, refused, field = EDGES[cap]
    for body in ok:
        r = service.post(json.dumps(body).encode())
        assert r.status_code == 200, r.text
    for body in refused:
        r = service.post(json.dumps(body).encode())
        assert r.status_code == 422 and r.json()["error"]["message"].startswith(field), r.text


def test_body_cap_edge_counts_bytes(service):
    cap = Limits(**service.stats()["limits"]).max_body_bytes
    base = json.dumps(_body()).encode()
    # JSON allows trailing whitespace: a valid body of exactly cap bytes
    exact = base + b" " * (cap - len(base))
    assert service.post(exact).status_code == 200
    r = service.post(exact + b" ")
    assert r.status_code == 413 and r.json()["error"]["reason"] == "body_too_large"


class _ShortContextEngine(SyntheticEngine):
    """An engine that can generate at most 32 tokens (as GPT-2's context limits it)."""

    max_new_tokens_limit = 32


def test_the_engines_own_limit_lowers_the_max_new_tokens_cap():
    with InProcess(fast_gate(engines=[_ShortContextEngine(speed=1e-4)])) as svc:
        assert svc.stats()["limits"]["max_new_tokens"] == 32
        assert svc.post(json.dumps(_body(max_new_tokens=32)).encode()).status_code == 200
        r = svc.post(json.dumps(_body(max_new_tokens=33)).encode())
        assert (
            r.status_code == 422
            and "max_new_tokens" in r.json()["error"]["message"]
            and "32" in r.json()["error"]["message"]
        )
        svc.assert_still_serving()


# ================================================================== through a real qlab serve


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real ``qlab serve`` (synthetic engine at 1/1000 of the reference time, predictive)."""
    log = tmp_path_factory.mktemp("fuzz-serve") / "serve.log"
    server = Server(ServeOptions(policy="predictive", speed=0.001, fixed_estimate=True), log)
    server.start(60)
    yield server
    server.stop()


def _raw_exchange(
    url: str, data: bytes, close_after_send: bool = False, until_closed: bool = False
) -> bytes:
    """Send raw bytes on a fresh connection; whatever comes back before the server closes (or HANG_S
    passes). until_closed: read on past a whole answer, until the server closes (an error if it does
    not, within HANG_S)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=HANG_S) as conn:
        conn.sendall(data)
        if close_after_send:
            return b""
        out = b""
        try:
            while chunk := conn.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and _complete(out) and not until_closed:
                    break
        except socket.timeout:
            raise AssertionError(f"no answer within {HANG_S} s to {data[:80]!r}") from None
        return out


def _complete(raw: bytes) -> bool:
    head, _, body = raw.partition(b"\r\n\r\n")
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return m is not None and len(body) >= int(m.group(1))


# Malformed HTTP is answered by the protocol before the app sees it (live/headcap.py: 400
# malformed_http in the envelope, the connection closed): quickly, at no cost to the service.
PROTOCOL_JUNK = {
    "bad chunk size": b"POST /v1/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
    b"application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    "negative length": b"POST /v1/generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: "
    b"-1\r\n\r\n",
    "absurd length": b"POST /v1/generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: "
    b"99999999999999999999\r\n\r\n",
    "length and chunked": b"POST /v1/generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "tls hello": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(32)),
}


@pytest.mark.slow
def test_fuzz_through_a_real_server(served):
    before = httpx.get(f"{served.url}/stats", timeout=HANG_S).json()
    tally = Tally()
    with httpx.Client(base_url=served.url, timeout=HANG_S) as client:

        @fuzz(0.4)
        @given(
            junk_bodies
            | st.builds(
                lambda d: json.dumps(d).encode(),
                st.fixed_dictionaries(
                    {"prompt": st.text(max_size=50), "max_new_tokens": st.integers(-5, 1100)},
                    optional={"deadline_ms": st.integers(-5, 700_000), "stop": st.text(max_size=3)},
                ),
            ),
            # h11 refuses to send edge spaces
            content_types.map(lambda c: c if c is None else c.strip(" \t")),
        )
        def run(body, content_type):
            headers = (
                {} if content_type is None else {"content-type": content_type.encode("latin-1")}
            )
            try:
                r = client.post("/v1/generate", content=body, headers=headers)
            except httpx.TimeoutException:
                raise AssertionError(f"no answer within {HANG_S} s: a hung request") from None
            check_answer(r)
            tally.add(r)

        run()
        for name, data in PROTOCOL_JUNK.items():
            answer = _raw_exchange(served.url, data)
            assert answer.startswith(b"HTTP/1.1 400 "), (name, answer[:200])
            error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
            assert error["reason"] == "malformed_http", (name, error)
        ok = client.post("/v1/generate", json={"prompt": "still there?", "max_new_tokens": 3})
        assert ok.status_code == 200
        tally.add(ok)
        assert_stats_match(client.get("/stats").json(), tally, before["counts"])


class _Wire(asyncio.Transport):
    """A connection's far end for a protocol fed in-process: what the server wrote, whether it
    closed."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self.closed = bytearray(), False

    def write(self, data: bytes) -> None:
        if not self.closed:  # as asyncio's transports: nothing goes out after close()
            self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default=None):
        ends = {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}
        return ends.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _protocol_answers(http: str, requests: list[bytes]) -> list[bytes]:
    """Each request's bytes fed to ``qlab serve``'s protocol for ``--http`` on a fresh connection,
    in-process (the app and its gate on this loop); what came back before it closed or answered."""
    import uvicorn
    from uvicorn.server import ServerState

    from live.headcap import http_options

    async def run() -> list[bytes]:
        app = create_app(fast_gate())
        options = http_options(http, head_timeout_s=HANG_S, body_timeout_s=HANG_S)
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_level="error",
            **{k: v for k, v in options.items() if k != "http"},
        )
        config.load()
        answers = []
        async with app.router.lifespan_context(app):
            for data in requests:
                protocol = options["http"](config=config, server_state=ServerState(), app_state={})
                wire = _Wire()
                protocol.connection_made(wire)
                protocol.data_received(data)
                for _ in range(int(HANG_S / 0.01)):
                    if wire.closed or _complete(bytes(wire.written)):
                        break
                    await asyncio.sleep(0.01)
                protocol.connection_lost(None)
                answers.append(bytes(wire.written))
        return answers

    return asyncio.run(run())


#: What h11 reads of PROTOCOL_JUNK (and the app answers): a length beside chunked is chunked (RFC
#: 9112 lets a server read it so), here an empty body; a length of 20 digits is a length, past the
#: body cap.
H11_READS = {
    "length and chunked": (400, "malformed_json"),
    "absurd length": (413, "body_too_large"),
}


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_malformed_http_is_a_400_in_the_envelope_and_the_service_keeps_serving(http):
    """What the parser refuses (uvicorn's send_400_response, live/headcap.py) is 400 malformed_http
    in the envelope, not uvicorn's plain text. h11 reads two requests (H11_READS) that httptools
    refuses: they reach the app, whose answer is the envelope too."""
    ok = b'{"prompt": "still there?", "max_new_tokens": 3}'
    good = (
        b"POST /v1/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(ok)).encode() + b"\r\n\r\n" + ok
    )
    # No WebSocket protocol: an upgrade is answered as the HTTP request it is (no plain 403).
    upgrade = (
        b"GET /v1/generate HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    answers = _protocol_answers(http, [*PROTOCOL_JUNK.values(), good, upgrade])
    for name, answer in zip([*PROTOCOL_JUNK, "good", "upgrade"], answers):
        head, _, body = answer.partition(b"\r\n\r\n")
        if name == "good":
            assert head.startswith(b"HTTP/1.1 200 ") and json.loads(body)["tokens"] == 3, answer
            continue
        if name == "upgrade":  # a GET of a POST route
            assert head.startswith(b"HTTP/1.1 405 "), answer[:300]
            assert json.loads(body)["error"]["reason"] == "method_not_allowed"
            continue
        status, reason = (H11_READS if http == "h11" else {}).get(name, (400, "malformed_http"))
        assert head.startswith(b"HTTP/1.1 %d " % status), (name, answer[:200])
        assert re.search(rb"(?im)^content-type: application/json", head), (name, head)
        assert json.loads(body)["error"]["reason"] == reason, (name, body)


def _padded_head(pad_bytes: int) -> bytes:
    return b"POST /v1/generate HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"a" * pad_bytes


def _bytes_taken_before_hang_up(url: str, limit: int) -> int:
    """Send an endless header, 64 KiB at a time, until the server hangs up (or ``limit`` bytes
    are sent)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=HANG_S) as conn:
        try:
            conn.sendall(_padded_head(0))
            while sent < limit:
                sent += conn.send(b"a" * 65536)
        except socket.timeout:
            raise AssertionError(
                f"the server neither read nor closed after {sent} bytes of header"
            ) from None
        except OSError:  # reset or broken pipe: the server hung up
            pass
    return sent


@pytest.mark.slow
@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_request_head_past_the_cap_is_refused_and_not_buffered(tmp_path, http):
    served = Server(
        ServeOptions(policy="predictive", speed=0.001, http=http), tmp_path / "serve.log"
    )
    served.start(60)
    try:
        # A head still incomplete after 66 KiB (nothing more is sent: the answer must come without
        # it). Then a whole head of 100 KB sent in one write (it ends within the read that passes
        # the cap). Both parsers' protocols (live/headcap.py) answer in the envelope.
        whole = _padded_head(100 * 1024) + (
            b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        )
        for sent in (_padded_head(66 * 1024), whole):
            answer = _raw_exchange(served.url, sent)
            head, _, body = answer.partition(b"\r\n\r\n")
            error = json.loads(body)["error"]
            assert int(head.split(b" ", 2)[1]) == 431, answer[:300]
            assert error["type"] == "invalid_request" and error["reason"] == "headers_too_large"
        # A stock httptools server takes all 64 MiB (and grows by more); a capped one hangs up
        # within a few MiB (what the kernel's socket buffers hold).
        assert _bytes_taken_before_hang_up(served.url, 64 << 20) < 16 << 20
        assert (
            httpx.post(f"{served.url}/v1/generate", json=_body(), timeout=HANG_S).status_code == 200
        )
    finally:
        served.stop()


@pytest.mark.slow
@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_heads_and_bodies_too_slow_are_408_and_the_connection_closed(tmp_path, http):
    """A slow client (a head or a body that stops coming) holds its connection only until its
    deadline (here 1 s each): then a 408 in the envelope, and the server closes the connection."""
    served = Server(
        ServeOptions(
            policy="predictive", speed=0.001, http=http, header_timeout=1.0, body_timeout=1.0
        ),
        tmp_path / "serve.log",
    )
    served.start(60)
    try:
        for sent, what in (
            (b"POST /v1/generate HTTP/1.1\r\nHost: localhost\r\nX-Slow: ", "head"),
            (b"", "head"),  # a connection that sends nothing at all
            (
                b"POST /v1/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                b"application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt": ',
                "body",
            ),
        ):
            answer = _raw_exchange(served.url, sent, until_closed=True)
            head, _, body = answer.partition(b"\r\n\r\n")
            error = json.loads(body)["error"]
            assert int(head.split(b" ", 2)[1]) == 408 and error["reason"] == "request_timeout", (
                answer[:300]
            )
            assert f"request {what} did not arrive within 1 s" in error["message"]
        assert (
            httpx.post(f"{served.url}/v1/generate", json=_body(), timeout=HANG_S).status_code == 200
        )
    finally:
        served.stop()


@pytest.mark.slow
def test_a_client_that_hangs_up_mid_body_is_not_a_server_error(tmp_path):
    server = Server(ServeOptions(policy="predictive", speed=0.001), tmp_path / "serve.log")
    server.start(60)
    try:
        truncated = (
            b"POST /v1/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
            b"application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        _raw_exchange(server.url, truncated, close_after_send=True)
        assert (
            httpx.post(f"{server.url}/v1/generate", json=_body(), timeout=HANG_S).status_code == 200
        )
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-2000:]


# ================================================================== malformed trace files

AZURE_LINES = (ROOT / "data" / "azure_llm_2023_code.csv").read_text().splitlines()[:12]


def _own_trace_csv(tmp_path: Path) -> bytes:
    """A qlab per-request trace with every optional column, as Trace.save writes it."""
    path = tmp_path / "own.csv"
    make_trace("poisson", load=1.0, requests=10, seed=3).save(path)
    return path.read_bytes()


def _minimal_csv() -> bytes:
    return (
        b"arrival_s,max_new_tokens,deadline_s,prompt_tokens\n"
        b"0.0,4,1.5,10\n0.2,16,,3\n0.5,64,2.0,0\n"
    )


BAD_CELLS = [
    "",
    " ",
    "-1",
    "0",
    "1.5",
    "nan",
    "inf",
    "-inf",
    "1e309",
    "0x10",
    "four",
    '"',
    '"unterminated',
    "\x00",
    "2023-13-45 25:61:00",
    "9999-12-31 23:59:59",
    "0001-01-01",
    "2023-11-16T18:17:04+05:00",
    "1e-400",
    "99999999999999999999999",
    "\u00e9",
    "1,2",
    "\t",
    "\r",
]


@st.composite
def mutated(draw, original: bytes, cells: list[str], separator: bytes):
    """A file broken the ways real files break: cut short, bytes flipped, cells replaced, columns
    added or lost."""
    data = original
    for _ in range(draw(st.integers(1, 3))):
        lines = data.split(b"\n")
        how = draw(
            st.sampled_from(
                [
                    "truncate",
                    "flip",
                    "insert",
                    "cell",
                    "extra column",
                    "drop column",
                    "drop line",
                    "duplicate line",
                    "blank line",
                    "crlf",
                ]
            )
        )
        if how == "truncate":
            data = data[: draw(st.integers(0, len(data)))]
        elif how == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1 :]
        elif how == "insert":
            i = draw(st.integers(0, len(data)))
            data = data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i:]
        elif how == "cell":
            k = draw(st.integers(0, len(lines) - 1))
            parts = lines[k].split(separator)
            j = draw(st.integers(0, len(parts) - 1))
            parts[j] = draw(st.sampled_from(cells) | st.text(max_size=6)).encode(
                "utf-8", "surrogatepass"
            )
            lines[k] = separator.join(parts)
            data = b"\n".join(lines)
        elif how == "extra column":
            k = draw(st.integers(0, len(lines) - 1))
            lines[k] += separator + draw(st.sampled_from([b"", b"7", b"extra"]))
            data = b"\n".join(lines)
        elif how == "drop column":
            j = draw(st.integers(0, 3))
            lines = [
                separator.join(p for i, p in enumerate(line.split(separator)) if i != j)
                for line in lines
            ]
            data = b"\n".join(lines)
        elif how in ("drop line", "duplicate line", "blank line") and lines:
            k = draw(st.integers(0, len(lines) - 1))
            lines[k : k + 1] = {
                "drop line": [],
                "duplicate line": [lines[k]] * 2,
                "blank line": [lines[k], b""],
            }[how]
            data = b"\n".join(lines)
        elif how == "crlf":
            data = data.replace(b"\n", b"\r\n")
    return data


TRACE_PLACE = re.compile(
    r"\b(line|row) \d+|unrecognised trace columns|the file is empty|has no "
    r"requests"
)


def assert_trace_error_names_the_place(exc: ValueError, path: Path) -> None:
    text = str(exc)
    assert str(path) in text, text
    assert TRACE_PLACE.search(text), f"the error does not say where: {text}"
    assert "\n" not in text, text


def test_mutated_trace_files_load_or_fail_naming_the_line(tmp_path):
    bases = [
        ("azure.csv", "\n".join(AZURE_LINES).encode() + b"\n"),
        ("own.csv", _own_trace_csv(tmp_path)),
        ("minimal.csv", _minimal_csv()),
    ]

    @fuzz(1.5)
    @given(
        st.sampled_from(bases).flatmap(
            lambda b: st.tuples(st.just(b[0]), mutated(b[1], BAD_CELLS, b","))
        )
    )
    def run(case):
        name, data = case
        path = tmp_path / f"mutated-{name}"
        path.write_bytes(data)
        try:
            trace = load_trace(path)
        except ValueError as exc:  # anything else fails the test with its own traceback
            assert_trace_error_names_the_place(exc, path)
            return
        assert (
            len(trace) > 0
            and np.isfinite(trace.arrival_s).all()
            and (np.diff(trace.arrival_s) >= 0).all()
        )
        assert (trace.max_new_tokens >= 1).all() and (trace.prompt_tokens >= 0).all()
        assert np.isfinite(trace.est_service_s).all() and np.isfinite(trace.true_service_s).all()

    run()


@pytest.mark.parametrize(
    "cells, message",
    [
        (
            "0.0,99999999999999999999",
            "line 2: bad max_new_tokens",
        ),  # would wrap to a negative int64
        ("0.0,1e20", "line 2: bad max_new_tokens"),
        ("0.0,inf", "line 2: bad max_new_tokens"),
        ("inf,4", "line 2: bad arrival_s"),
        ("1e999,4", "line 2: bad arrival_s"),
    ],
)
def test_trace_numbers_no_request_can_have_are_refused(tmp_path, cells, message):
    path = tmp_path / "big.csv"
    path.write_text(f"arrival_s,max_new_tokens\n{cells}\n")
    with pytest.raises(ValueError, match=message):
        load_trace(path)


# ================================================================== malformed TOML configs

SWEEP_TOML = """
[sweep]
duration_s = 40
seeds = 2
first_seed = 1
arrivals = "poisson"
noise_cv = 0.1
fixed_estimate = false
[service]
intercept_s = 0.001
per_token_s = 0.0085
[mixes.short]
sizes = [4, 16]
probs = [0.5, 0.5]
[grid]
policy = ["none", "bounded"]
load = [0.5, 1.5]
speed = [1.0]
engines = [1, 2]
deadline_s = [2.0]
max_queue = [8]
mix = ["short"]
"""

LIVE_TOML = (
    (ROOT / "experiments" / "live.toml").read_text()
    + """
[calibrate]
rounds = 2
per_size = 4
"""
)

TOML_PLACE = re.compile(
    r"\b(sweep|service|mixes|grid|server|calibrate|probe|replay|trace)\b|unknown (key|section) '"
    r"|line \d+|end of document"
)


def _toml_value(value) -> str:
    """A TOML literal; tables are inline so that a whole document is `key = value` lines."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return (
            "nan"
            if math.isnan(value)
            else ("inf" if value > 0 else "-inf")
            if math.isinf(value)
            else repr(value)
        )
    if isinstance(value, str):  # JSON's escapes are TOML's, but TOML also wants DEL escaped
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(f"{_toml_value(str(k))} = {_toml_value(v)}" for k, v in value.items())
            + "}"
        )
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    raise TypeError(type(value))


def to_toml(doc: dict) -> str:
    return "".join(f"{_toml_value(str(k))} = {_toml_value(v)}\n" for k, v in doc.items())


toml_scalars = st.one_of(
    st.booleans(),
    st.integers(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(
        ["none", "bounded", "predictive", "burst:5", "gamma:0", "poisson", "gpt2", "cuda", "x.csv"]
    ),
    st.dates(),
    st.datetimes(),
    st.times(),
)
toml_values = st.recursive(
    toml_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(min_size=1, max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def _paths(node, prefix=()):
    """Every key path into a parsed TOML document (list items included)."""
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, child in items:
        yield prefix + (key,)
        yield from _paths(child, prefix + (key,))


@st.composite
def mutated_doc(draw, base: dict):
    """The document with 1-3 edits: a value replaced, a key removed, renamed (a typo) or added."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        how = draw(st.sampled_from(["replace", "replace", "remove", "rename", "add"]))
        if how == "replace":
            parent[key] = draw(toml_values)
        elif how == "remove":
            del parent[key]
        elif how == "rename" and isinstance(key, str):
            parent[key + draw(st.sampled_from(["s", "_", "x"]))] = parent.pop(key)
        elif how == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=10))] = draw(toml_values)
    return doc


def toml_files(text: str):
    """Structured edits (written back as TOML) or damage to the text itself."""
    base = tomllib.loads(text)
    structured = mutated_doc(base).map(lambda d: to_toml(d).encode())
    damaged = mutated(
        text.encode(), ["=", "[", "]]", '"', "'''", "\x00", "nan", "-", "1979-05-27"], b"="
    )
    return structured | damaged


def assert_config_error_names_the_key(exc: ValueError, path: Path) -> None:
    text = str(exc)
    assert text.startswith(f"{path}: "), text
    assert TOML_PLACE.search(text[len(str(path)) + 2 :]), f"the error does not say where: {text}"
    assert "\n" not in text, text


@pytest.mark.parametrize("kind", ["sweep", "live"])
def test_mutated_toml_configs_load_or_fail_naming_the_key(tmp_path, kind):
    text, load = (
        (SWEEP_TOML, sweep_config.load) if kind == "sweep" else (LIVE_TOML, live_config.load)
    )
    path = tmp_path / f"{kind}.toml"
    path.write_text(text)
    load(path)  # the unbroken file is valid

    @fuzz(1.5)
    @given(toml_files(text))
    def run(data):
        path.write_bytes(data)
        try:
            load(path)
        # ConfigError is one; anything else fails the test with its traceback
        except ValueError as exc:
            if kind == "sweep":
                assert isinstance(exc, sweep_config.ConfigError), repr(exc)
            assert_config_error_names_the_key(exc, path)

    run()


# ================================================================== the same through the CLI


CLI_CASES = {
    "trace: not UTF-8": ("trace", b"arrival_s,max_new_tokens\n0.0,4\n0.5,\xff\xfe\n", "line 3"),
    "trace: extra field": ("trace", b"arrival_s,max_new_tokens\n0.0,4\n0.5,4,9\n", "line 3"),
    "trace: cut mid-line": (
        "trace",
        b"arrival_s,max_new_tokens,deadline_s\n0.0,4,1\n0.5,",
        "line 3",
    ),
    "sweep: not UTF-8": ("sweep", b"[grid]\npolicy = ['none']\nload = [1.0]\n# \xff\n", "line 4"),
    "sweep: bad value": (
        "sweep",
        b"[grid]\npolicy = ['none']\nload = [1.0]\nengines = [0]\n",
        "grid.engines[0]",
    ),
    "live: cut short": (
        "live",
        LIVE_TOML.encode()[: LIVE_TOML.index("seconds = 40") + 9],
        "end of document",
    ),
    "live: bad value": (
        "live",
        LIVE_TOML.replace("requests = 5", "requests = -5").encode(),
        "probe.requests",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_malformed_files_through_the_cli_are_one_line_exit_2(tmp_path, case, capsys):
    """In this process, as the console script runs main (tests/test_cli.py keeps one case in a
    process of its own: no traceback there either)."""
    from experiments.cli import main

    kind, data, needle = CLI_CASES[case]
    path = tmp_path / ("bad.csv" if kind == "trace" else "bad.toml")
    path.write_bytes(data)
    argv = {
        "trace": ["simulate", "--trace", str(path)],
        "sweep": ["sweep", str(path), "--out", str(tmp_path / "o")],
        "live": ["live", str(path), "--out", str(tmp_path / "o")],
    }[kind]
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "Traceback" not in err and str(path) in lines[0] and needle in lines[0], lines
    assert not (tmp_path / "o").exists()
