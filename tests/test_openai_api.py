"""The OpenAI-compatible endpoints (live/openai_api.py) through a real ``qlab serve``, with the
official ``openai`` SDK as the client, and fuzzed from /openapi.json as /v1/generate is
(tests/test_fuzz.py).

The server: synthetic engine at 1/1000 of the reference time (1,024 tokens take about 9 ms), policy
``predictive`` with the calibrated (fixed) estimate and a 600 s default deadline, so only a request
with a deadline shorter than its estimate is refused (as never answerable in time,
``deadline_too_short``, by the same arithmetic every time), and a per-client limit of one request
per 1,000 s (``client_rate=0.001``): a client id's first request passes, its second is a 429.
Requests without a client id are not limited.
"""

from __future__ import annotations

import json
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from live.openai_api import DEADLINE_HEADER  # noqa: E402
from live.procs import serving  # noqa: E402
from live.serve_options import ServeOptions  # noqa: E402

pytestmark = pytest.mark.slow  # every test here asks a real `qlab serve` (the url fixture)
MODEL = "synthetic"  # the synthetic engine's model id (live.openai_api.served_model_id)
GATED = {
    "overloaded": "rejected",
    "rate_limited": "rejected",
    "deadline_exceeded": "expired",
    "engine_error": "error",
}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    options = ServeOptions(
        policy="predictive",
        policy_arg="client_rate=0.001",
        deadline=600.0,
        speed=0.001,
        fixed_estimate=True,
    )
    with serving([options], tmp_path_factory.mktemp("openai-logs"), 60) as (server,):
        yield server.url


def sdk(url: str, max_retries: int = 0, **kwargs) -> "openai.OpenAI":
    return openai.OpenAI(
        base_url=url + "/v1", api_key="x", max_retries=max_retries, timeout=30, **kwargs
    )


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=10).json()


def tok(n: int) -> str:
    """What the synthetic engine answers for n tokens."""
    return " tok" * n


# ================================================================== the SDK's calls


def test_models_lists_the_one_served_model(url):
    client = sdk(url)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "qlab"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found"


def test_a_completion(url):
    client = sdk(url)
    # Sampling fields are accepted and ignored.
    r = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=5,
        temperature=0.7,
        top_p=0.9,
        seed=3,
        frequency_penalty=0.5,
        presence_penalty=0.1,
        logit_bias={"50256": -100},
    )
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.index == 0 and choice.text == tok(5) and choice.finish_reason == "length"
    # byte tokens
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 5, 10)
    qlab = r.to_dict()["qlab"]
    assert qlab["outcome"] == "good" and qlab["engine"] == 0
    assert qlab["queue_s"] >= 0 and 0 <= qlab["engine_s"] <= qlab["total_s"]
    assert qlab["started_at"] <= qlab["returned_at"] and qlab["admission"]["deadline_s"] == 600.0


def test_a_completion_honours_stop_echo_and_a_one_prompt_list(url):
    client = sdk(url)
    assert (
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, stop="k t").choices[0].text
        == " to"
    )
    assert client.completions.create(model=MODEL, prompt=["x"], max_tokens=2, echo=True).choices[
        0
    ].text == "x" + tok(2)


def test_max_tokens_defaults_to_the_servers_cap(url):
    cap = stats(url)["limits"]["max_new_tokens"]
    r = sdk(url).completions.create(model=MODEL, prompt="x")
    assert r.usage.completion_tokens == cap and r.choices[0].text == tok(cap)


def test_a_chat_completion(url):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "Go"},
    ]
    r = sdk(url).chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=4, temperature=0
    )
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert (
        choice.message.role == "assistant"
        and choice.message.content == tok(4)
        and choice.finish_reason == "length"
    )
    # docs/http.md says so
    prompt = "system: Be brief.\nuser (ann): Hi\nassistant: Hello\nuser: Go\nassistant:"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 4)
    assert r.to_dict()["qlab"]["outcome"] == "good"


def test_max_tokens_and_max_completion_tokens_are_one_field(url):
    client = sdk(url)
    one = [{"role": "user", "content": "x"}]
    assert (
        client.chat.completions.create(
            model=MODEL, messages=one, max_tokens=3
        ).usage.completion_tokens
        == 3
    )
    same = client.chat.completions.create(
        model=MODEL, messages=one, max_tokens=2, max_completion_tokens=2
    )
    assert same.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=one, max_tokens=2, max_completion_tokens=3
        )
    assert caught.value.code == "conflicting_parameters"


@pytest.mark.parametrize("usage", [False, True])
def test_a_streamed_chat(url, usage):
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    stream = sdk(url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        stream=True,
        **extra,
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == tok(6)
    assert [c.choices[0].finish_reason for c in with_choices] == [None] * (
        len(with_choices) - 1
    ) + ["length"]
    assert with_choices[-1].to_dict()["qlab"]["outcome"] == "good"
    if usage:  # the usage chunk comes last, without choices
        assert chunks[-1] is not with_choices[-1] and chunks[-1].usage.completion_tokens == 6
    else:
        assert chunks[-1] is with_choices[-1]


def test_a_streamed_completion(url):
    chunks = list(sdk(url).completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == tok(3)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_the_stream_is_server_sent_events_ending_done(url):
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        timeout=10,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "stream": True,
        },
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    # The role chunk, one chunk per token as the synthetic engine produces it, the chunk with
    # finish_reason.
    assert [json.loads(line[6:])["object"] for line in lines[:-1]] == ["chat.completion.chunk"] * 4


# ================================================================== refusals the SDK sees


@pytest.fixture(scope="module")
def busy_url(tmp_path_factory):
    """A gate whose one engine hangs on its first run for the rest of the module (the synthetic
    engine's fault injection; the stall rule set past it) and that queues nothing (bounded,
    max_queue 0): once that run holds the engine, every request is refused 503 queue_full with
    Retry-After, by the same rule every time."""
    options = ServeOptions(
        policy="bounded", max_queue=0, hang_after=0, hang_for=600.0, stall_after=600.0
    )
    with serving([options], tmp_path_factory.mktemp("openai-busy"), 60) as (server,):
        hold = threading.Thread(
            target=lambda: _quietly(
                httpx.post,
                f"{server.url}/v1/generate",
                timeout=600,
                json={"prompt": "x", "max_new_tokens": 1},
            ),
            daemon=True,
        )
        hold.start()
        # until the engine holds that run (polled, not slept on: a busy machine may be slow)
        for _ in range(3000):
            if stats(server.url)["in_service"] == 1:
                break
        else:
            raise AssertionError("the engine never took the run that holds it")
        yield server.url


def _quietly(call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except httpx.HTTPError:  # the server went away at the module's end
        pass


@pytest.mark.parametrize("how", ["header", "body"])
def test_a_503_carries_retry_after_and_the_sdk_retries_it(busy_url, how):
    """The one engine is busy and nothing may wait: refused at arrival every time, so the SDK
    tries 3 times."""
    url = busy_url
    sent = []
    http_client = openai.DefaultHttpxClient(
        event_hooks={"request": [lambda request: sent.append(request.url.path)]}
    )
    client = sdk(url, max_retries=2, http_client=http_client)
    deadline = (
        {"extra_headers": {DEADLINE_HEADER: "5000"}}
        if how == "header"
        else {"extra_body": {"deadline_ms": 5000}}
    )
    before = stats(url)
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=64, **deadline
        )
    after = stats(url)
    error = caught.value
    assert error.status_code == 503 and int(error.response.headers["retry-after"]) >= 1
    assert error.code == "queue_full" and error.type == "overloaded"
    assert error.body["retry_after_s"] == int(error.response.headers["retry-after"])
    assert error.body["numbers"]["deadline_s"] == 5.0 and error.body["numbers"]["max_queue"] == 0
    assert sent == ["/v1/chat/completions"] * 3
    assert after["submitted"] - before["submitted"] == 3
    assert after["counts"]["rejected"] - before["counts"]["rejected"] == 3
    assert (
        after["rejected_by_reason"]["queue_full"] - before["rejected_by_reason"]["queue_full"] == 3
    )


def test_a_request_never_answerable_in_time_is_a_400_the_sdk_does_not_retry(url):
    """Its estimate on an idle engine passes its deadline: no queue could answer it in time. Not
    overload: a 400 without Retry-After that says what would fit, counted as refused at arrival, and
    not retried."""
    sent = []
    http_client = openai.DefaultHttpxClient(
        event_hooks={"request": [lambda request: sent.append(request.url.path)]}
    )
    before = stats(url)
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(url, max_retries=2, http_client=http_client).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=64,
            extra_headers={DEADLINE_HEADER: "100"},
        )
    after = stats(url)
    error = caught.value
    assert (
        error.code == "deadline_too_short"
        and error.type == "invalid_request"
        and sent == ["/v1/chat/completions"]
    )
    assert "retry-after" not in error.response.headers and error.body["retry_after_s"] is None
    # 64 tokens take 0.545 s by the reference line: 11 fit 100 ms (0.0945 s).
    assert (
        error.body["numbers"]["fit_new_tokens"] == 11
        and "at most 11 new tokens fit" in error.message
    )
    assert "a deadline of at least 545 ms" in error.message
    assert (
        after["rejected_by_reason"]["deadline_too_short"]
        - before["rejected_by_reason"]["deadline_too_short"]
        == 1
    )
    assert after["counts"]["rejected"] - before["counts"]["rejected"] == 1


def test_a_refused_stream_is_a_json_error_not_a_stream(url):
    r = httpx.post(
        f"{url}/v1/completions",
        headers={DEADLINE_HEADER: "1"},
        timeout=10,
        json={"model": MODEL, "prompt": "x", "max_tokens": 64, "stream": True},
    )
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert (
        error["code"] == error["reason"] == "deadline_too_short" and "retry-after" not in r.headers
    )
    with pytest.raises(openai.BadRequestError):
        list(
            sdk(url).completions.create(
                model=MODEL,
                prompt="x",
                max_tokens=64,
                stream=True,
                extra_headers={DEADLINE_HEADER: "1"},
            )
        )


@pytest.mark.parametrize("how", ["user", "header"])
def test_a_client_over_its_rate_gets_a_429(url, how):
    client = sdk(url)
    who = {"user": "client-u"} if how == "user" else {"extra_headers": {"x-client-id": "client-h"}}
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, **who)
    assert client.chat.completions.create(**ask).choices[0].message.content == tok(2)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(**ask)
    error = caught.value
    assert (
        error.status_code == 429 and error.code == "rate_limited" and error.type == "rate_limited"
    )
    assert int(error.response.headers["retry-after"]) == error.body["retry_after_s"] >= 1
    # Another client, and a request naming none, pass.
    assert (
        client.chat.completions.create(**{**ask, "user": f"other-{how}"}).usage.completion_tokens
        == 2
    )
    assert client.chat.completions.create(
        model=MODEL, messages=ask["messages"], max_tokens=2
    ).choices


BAD = {
    "n": (openai.BadRequestError, "unsupported_parameter", dict(n=2)),
    "tools": (
        openai.BadRequestError,
        "unsupported_parameter",
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ),
    "logprobs": (openai.BadRequestError, "unsupported_parameter", dict(logprobs=True)),
    "json mode": (
        openai.BadRequestError,
        "unsupported_parameter",
        dict(response_format={"type": "json_object"}),
    ),
    "unknown field": (
        openai.UnprocessableEntityError,
        "invalid_field",
        dict(extra_body={"bogus": 1}),
    ),
    "max_tokens 0": (openai.UnprocessableEntityError, "invalid_field", dict(max_tokens=0)),
    "max_tokens past the cap": (
        openai.UnprocessableEntityError,
        "invalid_field",
        dict(max_tokens=1025),
    ),
    "an image": (
        openai.UnprocessableEntityError,
        "invalid_field",
        dict(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
    ),
    "deadline header": (
        openai.UnprocessableEntityError,
        "invalid_field",
        dict(extra_headers={DEADLINE_HEADER: "soon"}),
    ),
    "unknown model": (openai.NotFoundError, "model_not_found", dict(model="gpt-4o")),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_request_is_the_sdks_error_naming_it(url, case):
    error_type, code, fields = BAD[case]
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        **fields,
    }
    before = stats(url)["submitted"]
    with pytest.raises(error_type) as caught:
        sdk(url, max_retries=2).chat.completions.create(**ask)
    assert (
        caught.value.code == code
        and caught.value.type == "invalid_request"
        and caught.value.message
    )
    assert stats(url)["submitted"] == before  # refused before the gate, and not retried


def test_completion_fields_it_cannot_honour_are_400s(url):
    client = sdk(url)
    for fields in (
        dict(n=3),
        dict(best_of=2),
        dict(logprobs=2),
        dict(suffix="end"),
        dict(prompt=["a", "b"]),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**{"model": MODEL, "prompt": "x", "max_tokens": 2, **fields})
        assert (
            caught.value.code == "unsupported_parameter"
            and next(iter(fields)) in caught.value.message
        )


def test_malformed_json_is_a_400_in_the_envelope(url):
    r = httpx.post(
        f"{url}/v1/chat/completions",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
    )
    error = r.json()["error"]
    assert (
        r.status_code == 400
        and error["code"] == error["reason"] == "malformed_json"
        and error["message"]
    )


# ================================================================== fuzzed from /openapi.json

ROUTES = ("/v1/completions", "/v1/chat/completions")
INVALID = {
    400: {
        "malformed_json",
        "unsupported_parameter",
        "conflicting_parameters",
        "deadline_too_short",
    },
    404: {"model_not_found"},
    413: {"body_too_large"},
    415: {"unsupported_media_type"},
    422: {"invalid_field", "prompt_too_long"},
}
SETTINGS = settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
    ],
)
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
    "enum",
    "const",
    "exclusiveMinimum",
}
WIDE_CHARS = ["a", "\u00e9", "\u20ac", "\U0001f600"]
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def from_schema(schema: dict) -> st.SearchStrategy:
    """Instances of the JSON schemas pydantic emits for these bodies (tests/test_fuzz.py's, with
    more keywords)."""
    unknown = set(schema) - KNOWN_KEYWORDS
    if unknown:
        raise NotImplementedError(f"schema keywords {sorted(unknown)}: extend from_schema")
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema["type"]
    low, high = schema.get("minimum"), schema.get("maximum")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":  # JSON Schema's integer: 61 and 61.0 alike
        whole = st.integers(None if low is None else int(low), None if high is None else int(high))
        return whole | whole.map(float)
    if kind == "number":
        if "exclusiveMinimum" in schema:  # repetition_penalty: above 0
            return st.floats(
                schema["exclusiveMinimum"],
                high,
                exclude_min=True,
                allow_nan=False,
                allow_infinity=False,
            )
        return st.floats(low, high, allow_nan=False, allow_infinity=False) | st.integers(
            None if low is None else int(low), None if high is None else int(high)
        )
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
            max_size=min(schema.get("maxItems", 4), 4),
        )
    if kind == "object":
        extra = schema.get("additionalProperties", True)
        if "properties" not in schema:  # a map: logit_bias, metadata, a tool
            values = json_values if extra is True else from_schema(extra)
            return st.dictionaries(st.text(max_size=8), values, max_size=3)
        assert extra is False, "an open object with named fields: fuzz its extra keys too"
        props = {k: from_schema(v) for k, v in schema["properties"].items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    raise NotImplementedError(f"schema type {kind!r}")


def published(url: str, route: str) -> dict:
    doc = httpx.get(f"{url}/openapi.json", timeout=10).json()
    schema = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "$ref" not in json.dumps(schema), "the body's schema is self-contained"
    return schema


#: What a body the schema allows may still be refused for (400): what no JSON schema states, a
#: deadline shorter than the request's estimate or two fields that disagree (the descriptions say).
NOT_IN_ANY_SCHEMA = {"deadline_too_short", "conflicting_parameters"}


def check_answer(r: httpx.Response, stream: bool) -> str | None:
    """Never a 500; a 200 in OpenAI's shape or qlab's envelope; returns what the gate counted
    (None: nothing)."""
    assert r.status_code != 500, f"a 500: {r.text[:500]}"
    assert r.status_code in (200, 429, 503, *INVALID), (
        f"unexpected status {r.status_code}: {r.text[:300]}"
    )
    if r.status_code == 200:
        if stream:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in r.text.split("\n\n") if line]
            assert events[-1] == "[DONE]"
            last = [json.loads(e) for e in events[:-1] if json.loads(e)["choices"]][-1]
        else:
            last = r.json()
            usage = last["usage"]
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert last["model"] == MODEL and last["choices"][0]["finish_reason"] in ("stop", "length")
        return last["qlab"]["outcome"]
    body = r.json()
    assert set(body) == {"error"}, body
    e = body["error"]
    assert (
        {"message", "type", "code"} <= set(e) and e["code"] == e["reason"] and e["message"].strip()
    ), e
    if r.status_code in (429, 503):
        assert r.headers["retry-after"] == str(e["retry_after_s"]) and e["retry_after_s"] >= 1
        return GATED[e["type"]]
    assert e["type"] == "invalid_request" and e["reason"] in INVALID[r.status_code], (
        r.status_code,
        e,
    )
    # never in time: the gate refused it
    return "rejected" if e["reason"] == "deadline_too_short" else None


def assert_gate_counted(url: str, before: dict, seen: dict) -> None:
    after = stats(url)
    delta = {k: after["counts"][k] - before["counts"][k] for k in after["counts"]}
    assert delta == {k: seen.get(k, 0) for k in delta}, (delta, seen)
    assert after["waiting"] == 0 and after["in_service"] == 0


@pytest.mark.parametrize("route", ROUTES)
def test_bodies_valid_by_the_published_schema_are_never_refused_as_invalid(url, route):
    schema = published(url, route)
    before, seen = stats(url), {}
    with httpx.Client(base_url=url, timeout=10) as client:

        @SETTINGS
        @given(from_schema(schema))  # the one model served, and the values served of each field
        def run(body):
            r = client.post(
                route,
                content=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            outcome = check_answer(r, body.get("stream") is True)
            if outcome is not None:
                seen[outcome] = seen.get(outcome, 0) + 1
            # a cap the schema cannot state: the prompt's tokens, or a chat's joined prompt
            if r.status_code == 422:
                assert r.json()["error"]["reason"] == "prompt_too_long", r.text
            refused = r.status_code in (400, 404)
            assert not refused or r.json()["error"]["reason"] in NOT_IN_ANY_SCHEMA, r.text

        run()
    assert_gate_counted(url, before, seen)


FIELDS = (
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stream",
    "n",
    "user",
    "deadline_ms",
    "stream_options",
    "tools",
    "echo",
)
junk_bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=6).map(
        lambda d: json.dumps({"model": MODEL, **d}).encode()
    ),
    st.binary(max_size=200),
    st.text(max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass")),
)


@pytest.mark.parametrize("route", ROUTES)
def test_junk_never_breaks_the_endpoints(url, route):
    before, seen = stats(url), {}
    with httpx.Client(base_url=url, timeout=10) as client:

        @SETTINGS
        @given(
            junk_bodies,
            st.sampled_from([None, "1", "600000", "0", "-5", "x", "99999999999999999999"]),
        )
        def run(body, deadline):
            headers = {
                "content-type": "application/json",
                **({DEADLINE_HEADER: deadline} if deadline else {}),
            }
            r = client.post(route, content=body, headers=headers)
            try:
                stream = json.loads(body).get("stream") is True
            except (ValueError, AttributeError):
                stream = False
            outcome = check_answer(r, stream)
            if outcome is not None:
                seen[outcome] = seen.get(outcome, 0) + 1

        run()
    assert_gate_counted(url, before, seen)


def test_the_openapi_document_publishes_the_new_routes(url):
    doc = httpx.get(f"{url}/openapi.json", timeout=10).json()
    for route in ROUTES:
        assert doc["paths"][route]["post"]["requestBody"]["required"] is True
    assert "get" in doc["paths"]["/v1/models"]
