"""One typed contract: every body ``qlab serve`` takes or gives, as pydantic models.

The service builds its answers through these models, and every client in qlab (the
replayer's rows, ``qlab calibrate``, the benchmarks' lean client) reads answers through
them (``model_validate`` / ``model_validate_json``), so a field renamed here changes both
sides at once, and a test (tests/test_contract.py) fails instead of a column becoming NaN;
the same test scans the client modules for body keys named by string.

* qlab's own API: :class:`GenerateRequest` (``POST /v1/generate``; :func:`request_model`
  makes it with a server's :class:`Limits`), :class:`GenerateResponse`, the error envelope
  :class:`ErrorEnvelope` (every answer that is not a 200), :class:`Stats` (``GET /stats``)
  and :class:`Health` (``GET /healthz``);
* the OpenAI-compatible API (:mod:`live.openai_api`): :class:`CompletionRequest`,
  :class:`ChatCompletionRequest` (:func:`request_models`), :class:`Completion`,
  :class:`ChatCompletion`, :class:`ChatCompletionChunk`, :class:`ModelList`;
* what the upstream engine (:mod:`live.upstream`) sends to and reads from any
  OpenAI-compatible server: :class:`UpstreamRequest`, :class:`UpstreamChunk`,
  :class:`ForeignError`, :class:`UpstreamModels`, read leniently (other servers differ);
* what a client reads of any server, qlab's or not, leniently: :class:`HealthFacts` (``/healthz``'s
  :class:`EngineFacts`), :class:`AnswerEvent` (a streamed or whole OpenAI-compatible answer, read by
  ``qlab replay --api openai``; :func:`generate_of` makes it ``/v1/generate``'s answer).

Requests are strict (``"16"`` is not a number, unknown fields are refused; ``16.0`` is an
integer, as JSON Schema says: :func:`integer`), and their schemas list only the values served
(:class:`Only`). Answers are
lenient where a server may say more than qlab reads (``extra="allow"`` on the numbers and
``/stats``), so a newer server does not break an older client.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from qsim.records import CLIENT_ID_CHARS, PRIORITY_BOUND

_STRICT = ConfigDict(extra="forbid", strict=True)
_OPEN = ConfigDict(extra="allow")
#: A number as the gate reports it: an int stays an int on the wire, non-finite floats go out as null.
Num = float | int | None
OWNER = "qlab"


@dataclass(frozen=True)
class Limits:
    """Caps on one request; the engine's own limit on new tokens also applies."""

    max_new_tokens: int = 1024
    max_deadline_ms: int = 600_000
    max_prompt_chars: int = 16_384
    max_prompt_tokens: int = 16_384
    max_body_bytes: int = 64 * 1024
    max_stops: int = 8
    max_stop_chars: int = 64
    # An OpenAI request that names no max_tokens gets this many (None: the most whose calibrated estimate fits
    # its deadline, at most max_new_tokens; live.gate.Gate.fitting_tokens).
    default_max_tokens: int | None = None


def num(value: Num) -> float:
    """A reported number as a float; NaN where the server said null or nothing."""
    return math.nan if value is None else float(value)


def _integral(value):
    # JSON Schema's integer is any number without a fractional part (61.0 is one, and OpenAI's API
    # and vLLM take it): such a float is read as its int. Strict all the same: "61", 61.5 and true
    # stay refused.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds: int) -> Any:
    """An integer field's type, within pydantic's bounds (ge, le), that takes an integral float as
    its int."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


def _stop_list(value):
    # One stop string may come bare; a union type would make the error messages name its branches.
    return [value] if isinstance(value, str) else value


def stops(max_items: int | None = None, max_chars: int | None = None) -> Any:
    """``stop``'s type: a list of strings, or one string read as a list of one; the schema says
    both (OpenAI's does)."""
    text = Annotated[str, StringConstraints(min_length=1, max_length=max_chars)]
    many = Annotated[list[text], Field(max_length=max_items)]
    return Annotated[many, BeforeValidator(_stop_list, json_schema_input_type=text | many)]


class Published:
    """Constraints /openapi.json states beyond a field's type, which the route checks itself
    (where it answers better than a 422: a 400 naming what is not supported, a 404 for a model
    not served)."""

    def __init__(self, **schema: Any) -> None:
        self.schema = schema

    def __get_pydantic_json_schema__(self, core_schema, handler) -> dict:
        return {**handler(core_schema), **self.schema}


class Only:
    """A field of OpenAI's of whose values the server honours only ``values`` (and null, leaving it
    out): /openapi.json lists just those, and the route refuses any other with 400
    ``unsupported_parameter`` saying ``why`` (:func:`unsupported`), as OpenAI-compatible servers
    refuse what they cannot do."""

    def __init__(self, *values: Any, why: str) -> None:
        self.values, self.why = values, why

    def __get_pydantic_json_schema__(self, core_schema, handler) -> dict:
        return {"enum": [*self.values, None]}


def unsupported(req: BaseModel) -> tuple[str, str] | None:
    """The first field given a value its :class:`Only` does not list: (its name, the message);
    None: none."""
    for name, only in _only_fields(type(req)):
        value = getattr(req, name)
        if value is not None and value not in only.values:
            return name, f"{name}: {only.why}, not {json.dumps(value)[:80]}"
    return None


@functools.cache
def _only_fields(model: type[BaseModel]) -> tuple[tuple[str, Only], ...]:
    return tuple((name, m) for name, field in model.model_fields.items() for m in field.metadata
                 if isinstance(m, Only))


# ---------------------------------------------------------------------- POST /v1/generate


class GenerateRequest(BaseModel):
    """``POST /v1/generate``'s body without a server's caps (what a client builds); the server
    validates with :func:`request_model`'s subclass, which adds them."""

    model_config = _STRICT

    prompt: str
    max_new_tokens: integer(ge=1)
    deadline_ms: integer(ge=1) | None = None
    stop: stops() | None = None
    # Whose per-client rate limit it counts against (also the x-client-id header; the body wins).
    client_id: Annotated[str, StringConstraints(min_length=1, max_length=CLIENT_ID_CHARS)] | None = None
    # Higher first under a priority discipline (the policy's; FIFO ignores it).
    priority: integer(ge=-PRIORITY_BOUND, le=PRIORITY_BOUND) = 0

    def body(self) -> dict:
        """The JSON body: the fields given, defaults left out (the server applies its own)."""
        return self.model_dump(exclude_defaults=True)


_GenerateRequest = GenerateRequest  # the caps' subclass below has the same name (its schema's title)


def request_model(limits: Limits) -> type[GenerateRequest]:
    """The body schema with these caps. Strict: "16" is not a number and unknown fields are refused."""
    class GenerateRequest(_GenerateRequest):  # the same name in /openapi.json
        prompt: Annotated[str, StringConstraints(max_length=limits.max_prompt_chars)]
        max_new_tokens: integer(ge=1, le=limits.max_new_tokens)
        deadline_ms: integer(ge=1, le=limits.max_deadline_ms) | None = None
        stop: stops(limits.max_stops, limits.max_stop_chars) | None = None

    return GenerateRequest


class Admission(BaseModel):
    """What the gate saw when the request arrived (``admission`` of an answer; the start of an error's ``numbers``).

    arrived_at: the gate's clock; a client maps it onto its own to learn the gate's arrival order.
    """

    model_config = _OPEN

    arrived_at: Num = None
    est_service_s: Num = None
    deadline_s: Num = None
    queued: Num = None
    queued_work_s: Num = None
    speed_factor: Num = None
    in_service_s: Num = None  # estimated work left in service (0 with an engine idle)
    idle: Num = None  # engines free


class Numbers(Admission):
    """An error's ``numbers``: the arrival's, and whichever of these the refusal or failure had.

    Only the keys the server gave are sent (:func:`error_json` dumps with ``exclude_unset``).
    """

    wait_s: Num = None  # estimated wait at arrival (refusals)
    priority: Num = None
    max_queue: Num = None
    max_queued_seconds: Num = None
    client_rate: Num = None
    client_burst: Num = None
    tokens: Num = None  # the client's token bucket
    waited_s: Num = None  # dropped at the front after this wait
    left_s: Num = None
    engine: Num = None
    running_s: Num = None  # a stalled engine's run so far
    stall_after_s: Num = None
    stalled_engines: Num = None
    started_at: Num = None  # gate clock: the engine took it
    returned_at: Num = None  # gate clock: the failure came back
    engine_s: Num = None  # a failed run's own time
    at: Num = None  # gate clock: when the gate gave up on it, or cut it
    fit_new_tokens: Num = None  # deadline_too_short: the most new tokens whose estimate fits the deadline
    replica: Num = None  # a fleet's replica that decided on it (qlab serve --replicas)


class Timings(BaseModel):
    """An answer's seconds. started_at / returned_at are the gate's clock: the engine counted busy in between.
    first_token_s: the engine's own time to its first token (null for an engine that does not see it)."""

    queue_s: Num
    engine_s: Num
    total_s: Num
    est_service_s: Num
    started_at: Num
    returned_at: Num
    first_token_s: Num = None


class GenerateResponse(BaseModel):
    """A 200 of ``POST /v1/generate``."""

    text: str
    tokens: int
    outcome: Literal["good", "late"]
    engine: int
    timings: Timings
    admission: Admission
    # The prompt's tokens as the engine counted them (an upstream's usage; the gate's own count
    # where the engine does not say). None: a server that did not say.
    prompt_tokens: int | None = None


# ---------------------------------------------------------------------- the error envelope


class ErrorDetail(BaseModel):
    """qlab's error object: OpenAI's (``message``, ``type``, ``code``) and more.

    code repeats reason (OpenAI's name for it, so the openai SDK reads qlab's errors); numbers: what the
    gate knew (see :class:`Numbers`); retry_after_s: also the Retry-After header, on a 503 or 429.
    """

    type: str
    reason: str | None = None
    code: str | None = None
    message: str = ""
    numbers: Numbers = Numbers()
    retry_after_s: int | None = None


class ErrorEnvelope(BaseModel):
    """Every answer that is not a 200: ``{"error": {...}}``."""

    error: ErrorDetail


#: A streamed answer's finish_reason when the server stopped it before its end (vLLM's and SGLang's word for a
#: request they abort; the openai SDK passes any finish_reason through).
STOPPED = "abort"


class Stopped(BaseModel):
    """Why the gate stopped a streamed answer after its first piece, on its last chunk (``qlab_stopped``, beside
    finish_reason :data:`STOPPED`): the status and the error object its handler answers the same stop unstreamed
    (a cut at the deadline: 504 ``deadline_exceeded``, with its numbers). Not ``error``: the openai SDK raises on
    an event with an ``error`` key, and an answer the gate cut is a partial answer, not a failure."""

    status: int
    error: ErrorDetail


def error_json(type_: str, reason: str, message: str, numbers: dict | None = None,
               retry_after_s: int | None = None) -> str:
    """The envelope's JSON (non-finite numbers as null: JSON has neither NaN nor infinity)."""
    detail = {"type": type_, "reason": reason, "code": reason, "message": message, "numbers": numbers or {},
              "retry_after_s": retry_after_s}
    return ErrorEnvelope.model_validate({"error": detail}).model_dump_json(exclude_unset=True)  # one validation


# ---------------------------------------------------------------------- GET /stats and GET /healthz


class ServiceModelBody(BaseModel):
    """The server's calibration (qsim.ServiceModel's fields)."""

    model_config = _OPEN

    intercept_s: float
    per_token_s: float
    per_prompt_token_s: float = 0.0


class StallRuleBody(BaseModel):
    model_config = _OPEN

    factor: Num = None
    floor_s: Num = None


class EngineFacts(BaseModel):
    """An engine's description as a client reads it of any server's /healthz or /stats: every field
    optional (a server that is not qlab's, or an engine written elsewhere, may say none of them)."""

    model_config = _OPEN

    engine: str | None = None
    model: str | None = None  # gpt2's model name, or the upstream's model
    tokenizer: str | None = None  # the tokenizer its prompts are counted with
    context: int | None = None  # gpt2: the model's context, in tokens
    # The synthetic engine's speed now and its schedule of [seconds, speed] steps, whose seconds began at
    # schedule_started_at (the gate's clock): a run file puts the schedule on its own clock with it.
    speed: float | None = None
    schedule: list[tuple[float, float]] | None = None
    schedule_started_at: Num = None
    # A batching upstream engine's learner: the step model it learned, its fit and refits (live.upstream_batch).
    learned: dict[str, Any] | None = None


class EngineInfo(EngineFacts):
    """An engine's description of itself (``engine.info()``), in /stats and /healthz; each engine says more."""

    engine: str


class HealthFacts(BaseModel):
    """What a client reads of any server's ``GET /healthz`` (:class:`Health` is qlab's): its engine, if it says."""

    model_config = _OPEN

    engine: EngineFacts | None = None


class LimitsBody(BaseModel):
    """The server's :class:`Limits` in /stats."""

    model_config = _OPEN

    max_new_tokens: int | None = None
    max_deadline_ms: int | None = None
    max_prompt_chars: int | None = None
    max_prompt_tokens: int | None = None
    max_body_bytes: int | None = None
    max_stops: int | None = None
    max_stop_chars: int | None = None
    default_max_tokens: int | None = None


class UpstreamCountersBody(BaseModel):
    """``/stats`` ``upstream_counters``: what the upstream counted itself, read from its Prometheus
    ``/metrics`` (vLLM's counters, each summed over its labels; a fleet's upstreams summed), beside
    the gate's own counts. Only a gate in front of a vLLM-like upstream has it."""

    model_config = _OPEN

    finished_requests: int  # vllm:request_success_total, whatever the reason they finished
    prompt_tokens: int  # vllm:prompt_tokens_total
    generation_tokens: int  # vllm:generation_tokens_total
    preemptions: int  # vllm:num_preemptions_total: requests it put back to wait, KV cache full
    # The gate's clock when it was read: at this /stats, unless that read failed and an older
    # reading stands (live.upstream.UpstreamCounters); a fleet's, the oldest of its upstreams'.
    read_at: float


class Stats(BaseModel):
    """``GET /stats``: the gate's queue, counts and configuration. The defaults are what a client
    assumes of a server that does not say (one engine, a tracking estimate, speed 1); the server
    dumps with ``exclude_unset``, so the body holds what the gate said and no more."""

    model_config = _OPEN

    clock: Num = None  # the gate's clock (monotonic seconds) at this reading
    waiting: int = 0
    in_service: int = 0
    stalled: int = 0
    queued_work_s: Num = None
    speed_factor: Num = 1.0
    engines: int = 1
    fixed_estimate: bool = False
    policy: str | dict[str, Any] | None = None  # a preset's name or qsim.Policy's fields
    service_model: ServiceModelBody | None = None
    # A learning estimator's used share of the limit now, per size class (empty: none learned yet).
    estimator_shares: dict[str, float] = {}
    stall_rule: StallRuleBody | None = None
    tracker_weight: Num = None
    counts: dict[str, int] = {}
    rejected_by_reason: dict[str, int] = {}
    cancelled: int = 0
    submitted: int = 0
    # The answered requests' prompt and generated tokens, the prompt by the engine's count (an upstream's).
    answered_tokens: dict[str, int] = {}
    limits: LimitsBody = LimitsBody()
    engine: EngineInfo | None = None  # as in /healthz
    upstream_counters: UpstreamCountersBody | None = None
    server_config: dict[str, Any] | None = None  # qsim.config.ServerConfig's fields: what a replay simulates
    fleet: dict[str, Any] | None = None  # a fleet gate's qsim.fleet.FleetSpec fields (None: one server)


class StalledEngine(BaseModel):
    engine: int
    running_s: Num
    stall_after_s: Num
    est_service_s: Num


class Health(BaseModel):
    """``GET /healthz``: "ok", or "degraded" while an engine is stalled (still a 200: the process answers);
    ready: whether it can answer now (``GET /ready``'s verdict), and not_ready: why not (the upstream
    unreachable or failing, every engine stalled)."""

    status: Literal["ok", "degraded"]
    stalled: list[StalledEngine]
    engines: int
    engine: EngineInfo
    policy: str
    ready: bool = True
    not_ready: list[str] = []


class Liveness(BaseModel):
    """``GET /health``: the process answers."""

    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    """``GET /ready`` when ready (otherwise a 503 in the envelope, reason ``not_ready``)."""

    ready: Literal[True] = True


LIVE = Liveness().model_dump_json()
READY = Readiness().model_dump_json()


# ---------------------------------------------------------------------- OpenAI-compatible requests


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    # vLLM's: usage in every chunk. Accepted; qlab's own server sends usage once, at the end.
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    """A part of a message's content; only text parts exist here (no images, audio or files)."""

    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = None


_NewTokens = integer(ge=1) | None
_ModelName = Annotated[str, StringConstraints(min_length=1, max_length=256)]


_NO_LOGPROBS = "log probabilities are not returned by this server"
_NO_TOOLS = "tool and function calls are not supported"
_NO_BEAMS = "the engines decode greedily; beam search is not supported"
_ONE_PROMPT = Published(minItems=1, maxItems=1)
# The cross-field rules a JSON schema cannot state, said in the fields' descriptions.
_MAX_TOKENS_RULE = "with max_tokens, the same number (else 400 conflicting_parameters)"
_MIN_TOKENS_RULE = "at most the new tokens asked for (else 400 conflicting_parameters)"


class _Common(BaseModel):
    model_config = _STRICT

    model: _ModelName
    stop: stops() | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[integer() | None, Only(1, why="only 1 choice per request is supported")] = None
    # OpenAI's end-user id: whose per-client limit it counts against (else the x-client-id header).
    user: Annotated[str, StringConstraints(min_length=1, max_length=CLIENT_ID_CHARS)] | None = None
    # qlab's extensions (the openai SDK sends them with extra_body).
    deadline_ms: integer(ge=1) | None = None
    priority: integer(ge=-PRIORITY_BOUND, le=PRIORITY_BOUND) = 0
    # Accepted and ignored: the engines decode greedily.
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: integer() | None = None
    logit_bias: dict[str, float] | None = None
    # Vendor fields: the sampling parameters vLLM (and the benchmark clients written for it) send. Typed, so a
    # malformed value is a 422; min_tokens, ignore_eos and top_k are honoured (live.openai_api), the rest
    # ignored; all go on to an upstream as given (SAMPLING_FIELDS). use_beam_search and prompt_logprobs are
    # refused when they ask for something.
    top_k: integer(ge=-1) | None = None  # -1 and 0: every token, as vLLM reads them
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    length_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[integer(ge=0) | None, Field(description=_MIN_TOKENS_RULE)] = None
    stop_token_ids: list[integer()] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: integer(ge=-1) | None = None
    add_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    request_id: Annotated[str, StringConstraints(max_length=256)] | None = None
    use_beam_search: Annotated[bool | None, Only(False, why=_NO_BEAMS)] = None
    prompt_logprobs: Annotated[integer() | None, Only(why=_NO_LOGPROBS)] = None

    def body(self) -> dict:
        """The JSON body: the fields given, defaults left out."""
        return self.model_dump(exclude_defaults=True)


#: The fields of a request that go on to an upstream server as the client gave them (where it gave them):
#: OpenAI's sampling fields and the vendor ones above. The others are the gate's (the model, size, stop strings,
#: streaming, the client, qlab's extensions) or refused when they ask for something.
SAMPLING_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "seed", "logit_bias", "top_k",
                   "min_p", "repetition_penalty", "length_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
                   "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                   "truncate_prompt_tokens", "add_special_tokens", "return_tokens_as_token_ids", "request_id")
#: A chat's own fields that go on to an upstream's chat route likewise.
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
               "reasoning_effort")


class CompletionRequest(_Common):
    """``POST /v1/completions`` without a server's caps (see :func:`request_models`)."""

    # A list: of exactly one prompt (the route refuses a batch with 400 unsupported_parameter).
    prompt: str | Annotated[list[str], _ONE_PROMPT]
    max_tokens: _NewTokens = None
    echo: bool = False
    best_of: Annotated[integer() | None, Only(1, why="only 1 is supported")] = None
    logprobs: Annotated[integer() | None, Only(why=_NO_LOGPROBS)] = None
    # "": no suffix, the completion as without one.
    suffix: Annotated[str | None, Only("", why="insertion after a suffix is not supported")] = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions`` without a server's caps (see :func:`request_models`)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: _NewTokens = None
    max_completion_tokens: Annotated[_NewTokens, Field(description=_MAX_TOKENS_RULE)] = None
    # Refused when they ask for something (live.openai_api).
    logprobs: Annotated[bool | None, Only(False, why=_NO_LOGPROBS)] = None
    top_logprobs: Annotated[integer() | None, Only(why=_NO_LOGPROBS)] = None
    tools: Annotated[list[dict[str, Any]] | None, Only([], why=_NO_TOOLS)] = None
    tool_choice: Annotated[str | dict[str, Any] | None, Only("none", why=_NO_TOOLS)] = None
    functions: Annotated[list[dict[str, Any]] | None, Only([], why=_NO_TOOLS)] = None
    function_call: Annotated[str | dict[str, Any] | None, Only("none", why=_NO_TOOLS)] = None
    response_format: Annotated[dict[str, Any] | None,
                               Only({"type": "text"}, why="only text answers")] = None
    # Accepted and ignored.
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # Vendor (vLLM's chat template controls) and OpenAI's reasoning effort: ignored here, forwarded to an
    # upstream's chat route (CHAT_FIELDS).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None


_CompletionRequest, _ChatCompletionRequest = CompletionRequest, ChatCompletionRequest


def request_models(limits: Limits, model_id: str | None = None,
                   ) -> tuple[type[CompletionRequest], type[ChatCompletionRequest]]:
    """(CompletionRequest, ChatCompletionRequest) with these caps, and the model served (None: any
    name validates; the route compares). Strict: unknown fields are refused."""
    stop_type = stops(limits.max_stops, limits.max_stop_chars) | None
    prompt_text = Annotated[str, StringConstraints(max_length=limits.max_prompt_chars)]
    new_tokens = integer(ge=1, le=limits.max_new_tokens) | None
    deadline_type = integer(ge=1, le=limits.max_deadline_ms) | None
    # The one model served: the schema says so (the route answers any other 404 model_not_found).
    served = _ModelName if model_id is None else Annotated[_ModelName, Published(enum=[model_id])]

    class CompletionRequest(_CompletionRequest):
        model: served
        stop: stop_type = None
        deadline_ms: deadline_type = None
        prompt: prompt_text | Annotated[list[prompt_text], _ONE_PROMPT]
        max_tokens: new_tokens = None

    class ChatCompletionRequest(_ChatCompletionRequest):
        model: served
        stop: stop_type = None
        deadline_ms: deadline_type = None
        max_tokens: new_tokens = None
        max_completion_tokens: Annotated[new_tokens, Field(description=_MAX_TOKENS_RULE)] = None

    return CompletionRequest, ChatCompletionRequest


# ---------------------------------------------------------------------- OpenAI-compatible answers


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class QlabInfo(BaseModel):
    """The gate's view of the request: /v1/generate's ``timings`` and ``admission``, and the outcome."""

    outcome: Literal["good", "late"]
    engine: int
    queue_s: float
    engine_s: float
    total_s: float
    est_service_s: float
    started_at: float  # gate clock: an engine took it
    returned_at: float  # gate clock: the engine handed it back
    admission: Admission
    first_token_s: float | None = None  # the engine's own time to its first token, where it sees it
    # The request's objectives (the x-slo-ttft-ms and x-slo-tpot-ms headers), seconds; null: none given.
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: None = None


class _AnswerHead(BaseModel):
    """The fields every OpenAI answer object begins with; each kind names its ``object``."""

    id: str
    object: str
    created: int
    model: str


class Completion(_AnswerHead):
    """A completion, and (object the same, as OpenAI's) each chunk of a streamed one."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    qlab: QlabInfo | None = None
    qlab_stopped: Stopped | None = None  # the gate stopped it after its first piece (finish_reason abort)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(_AnswerHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    qlab: QlabInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length", "abort"] | None = None
    logprobs: None = None


class ChatCompletionChunk(_AnswerHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    qlab: QlabInfo | None = None
    qlab_stopped: Stopped | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = OWNER


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------- reading answers (the clients' side)


def read_answer(body: Any) -> GenerateResponse | None:
    """A 200's answer by the contract (a parsed JSON body): /v1/generate's, or an OpenAI-compatible (chat)
    completion's, whose ``qlab`` part has the same timings and admission numbers; None when it is neither."""
    try:
        return GenerateResponse.model_validate(body)
    except ValueError:
        pass
    for model in (ChatCompletion, Completion):
        try:
            done = model.model_validate(body)
        except ValueError:
            continue
        return _as_generate(done.qlab, done.usage, done.choices)
    return None


def _as_generate(q: QlabInfo | None, usage: Usage | None, choices: list) -> GenerateResponse | None:
    if q is None or usage is None or not choices:
        return None
    choice = choices[0]
    text = choice.message.content if isinstance(choice, ChatChoice) else choice.text
    return generate_of(q, text, usage.completion_tokens)


def generate_of(q: QlabInfo | None, text: str, tokens: int, prompt_tokens: int | None = None) -> GenerateResponse:
    """An OpenAI-compatible answer as ``/v1/generate``'s: a qlab gate's ``qlab`` part gives the outcome, engine,
    timings and admission numbers; without one (a server that is not a qlab gate) they are unknown: nulls,
    engine -1, and outcome good, which nothing reads (a client judges an answer by the latency it measured)."""
    if q is None:
        return GenerateResponse(text=text, tokens=tokens, outcome="good", engine=-1, admission=Admission(),
                                prompt_tokens=prompt_tokens,
                                timings=Timings(queue_s=None, engine_s=None, total_s=None, est_service_s=None,
                                                started_at=None, returned_at=None))
    return GenerateResponse(text=text, tokens=tokens, outcome=q.outcome, engine=q.engine, admission=q.admission,
                            prompt_tokens=prompt_tokens,
                            timings=Timings(queue_s=q.queue_s, engine_s=q.engine_s, total_s=q.total_s,
                                            est_service_s=q.est_service_s, started_at=q.started_at,
                                            returned_at=q.returned_at, first_token_s=q.first_token_s))


class EventUsage(BaseModel):
    """An answer's usage as any server reports it (qlab's is :class:`Usage`), read leniently."""

    model_config = _OPEN

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None


class EventDelta(BaseModel):
    model_config = _OPEN

    content: str | None = None


class EventChoice(BaseModel):
    """A choice of a completion (its ``text``) or of a chat chunk (its ``delta``), read leniently."""

    model_config = _OPEN

    text: str | None = None
    delta: EventDelta | None = None


class AnswerEvent(BaseModel):
    """One ``data:`` event of any OpenAI-compatible server's streamed answer, or its whole answer, as the
    replayer reads it (:mod:`live.openai_replay`); qlab's :class:`Completion` and :class:`ChatCompletionChunk`
    are such events. Lenient (other servers say more, or less); ``qlab``: a qlab gate's part; ``qlab_stopped``: a
    qlab gate's word that it stopped the answer (:class:`Stopped`); ``error``: an error event (its content is not
    read)."""

    model_config = _OPEN

    choices: list[EventChoice] | None = None
    usage: EventUsage | None = None
    qlab: QlabInfo | None = None
    qlab_stopped: Stopped | None = None
    error: Any = None


def read_error(body: Any) -> ErrorDetail | None:
    """The envelope's error object (a parsed JSON body); None when the body is not an envelope."""
    try:
        return ErrorEnvelope.model_validate(body).error
    except ValueError:
        return None


# ---------------------------------------------------------------------- to and from an upstream server


class UpstreamRequest(BaseModel):
    """What the upstream engine sends to a completions route: what the gate decided (the model, the size, the stop
    strings, a stream with its usage), and the sampling fields the client gave, unchanged (extra keys: the
    upstream's defaults apply to what the client did not give)."""

    model_config = _OPEN
    route: ClassVar[str] = "/v1/completions"  # where it goes (live.routes.COMPLETIONS)

    model: str
    prompt: str
    max_tokens: int
    stop: list[str] | None = None
    stream: bool = True
    # A dict, not this contract's StreamOptions: the keys sent are those the upstream takes
    # (live.upstream.probe_routes: vLLM's continuous_usage_stats where it is accepted).
    stream_options: dict[str, bool] = {"include_usage": True}

    def wire(self) -> bytes:
        """The JSON sent: what is None left out, so the upstream's defaults apply."""
        return self.model_dump_json(exclude_none=True, exclude_defaults=False).encode()


class UpstreamChatRequest(UpstreamRequest):
    """The same to a chat route: the client's messages as they came, in place of a prompt."""

    route: ClassVar[str] = "/v1/chat/completions"  # live.routes.CHAT

    prompt: None = None
    messages: list[dict[str, Any]]


class UpstreamDelta(BaseModel):
    model_config = _OPEN

    content: str | None = None


class UpstreamChoice(CompletionChoice):
    """A chunk's choice, read leniently: servers have finish reasons of their own (vLLM's "abort"); a chat
    chunk's text is its ``delta.content``."""

    text: str = ""
    delta: UpstreamDelta | None = None
    message: UpstreamDelta | None = None  # a whole chat completion's (an upstream that did not stream)
    finish_reason: str | None = None
    logprobs: Any = None

    @property
    def piece(self) -> str:
        """The text this choice adds: a completion's ``text``, a chat chunk's ``delta.content``, or a whole chat
        completion's ``message.content``."""
        said = self.delta if self.delta is not None else self.message
        return self.text or (said.content or "" if said is not None else "")


class UpstreamChunk(Completion):
    """One event of the upstream's stream: a completion chunk (qlab's own, read leniently) or a chat chunk."""

    object: str = "text_completion"
    choices: list[UpstreamChoice] = []
    usage: EventUsage | None = None
    qlab: Any = None


class ForeignErrorDetail(BaseModel):
    """Any server's error object, read leniently (qlab's :class:`ErrorDetail` is one: its other keys are kept)."""

    model_config = _OPEN

    message: str | None = ""
    type: str | None = None
    code: str | int | None = None


class ForeignError(BaseModel):
    """OpenAI's (and qlab's) ``{"error": {"message"}}``, or an older vLLM's top-level error
    (``object: "error"``, ``message``, ``type``, ``code``)."""

    model_config = _OPEN

    error: ForeignErrorDetail | None = None
    object: str | None = None
    message: str | None = None
    type: str | None = None
    code: str | int | None = None

    @property
    def text(self) -> str | None:
        return self.error.message if self.error is not None else self.message


class UpstreamCard(ModelCard):
    created: int | None = None
    object: str = "model"
    owned_by: str | None = None


class UpstreamModels(ModelList):
    object: str = "list"
    data: list[UpstreamCard]
