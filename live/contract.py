"""One typed contract: every body ``qlab serve`` takes or gives, as pydantic models (here, and in
the three ``live.contract_*`` modules beside this one).

The service builds its answers through these models, and every client in qlab (the
replayer's rows, ``qlab calibrate``, the benchmarks' lean client) reads answers through
them (``model_validate`` / ``model_validate_json``), so a field renamed here changes both
sides at once, and a test (tests/test_contract.py) fails instead of a column becoming NaN;
the same test scans the client modules for body keys named by string.

* qlab's own API, here: :class:`GenerateRequest` (``POST /v1/generate``; :func:`request_model`
  makes it with a server's :class:`~live.contract_fields.Limits`), :class:`GenerateResponse`, the
  error envelope :class:`ErrorEnvelope` (every answer that is not a 200), :class:`Stats`
  (``GET /stats``) and :class:`Health` (``GET /healthz``);
* the OpenAI-compatible API (:mod:`live.openai_api`), :mod:`live.contract_openai`'s:
  ``CompletionRequest``, ``ChatCompletionRequest`` (``request_models``), ``Completion``,
  ``ChatCompletion``, ``ChatCompletionChunk``, ``ModelList``;
* what the upstream engine (:mod:`live.upstream`) sends to and reads from any
  OpenAI-compatible server, :mod:`live.contract_clients`'s: ``UpstreamRequest``,
  ``UpstreamChunk``, ``ForeignError``, ``UpstreamModels``, read leniently (other servers differ);
* what a client reads of any server, qlab's or not, leniently: :class:`HealthFacts` (``/healthz``'s
  :class:`EngineFacts`, here), and :mod:`live.contract_clients`'s ``AnswerEvent`` (a streamed or
  whole OpenAI-compatible answer, read by ``qlab replay --api openai``; ``generate_of`` makes it
  ``/v1/generate``'s answer), ``read_answer`` and ``read_error``.

The field types every part shares, and a server's caps, are :mod:`live.contract_fields`'s.
Requests are strict (``"16"`` is not a number, unknown fields are refused; ``16.0`` is an
integer, as JSON Schema says: :func:`~live.contract_fields.integer`), and their schemas list
only the values served (:class:`~live.contract_fields.Only`). Answers are
lenient where a server may say more than qlab reads (``extra="allow"`` on the numbers and
``/stats``), so a newer server does not break an older client.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, StringConstraints

from qsim.records import CLIENT_ID_CHARS, PRIORITY_BOUND

from .contract_fields import (
    _OPEN,
    _STRICT,
    Limits,
    Num,
    integer,
    stops,
    token_ids,
    with_token_ids,
)


# ---------------------------------------------------------------------- POST /v1/generate


class GenerateRequest(BaseModel):
    """``POST /v1/generate``'s body without a server's caps (what a client builds); the server
    validates with :func:`request_model`'s subclass, which adds them."""

    model_config = _STRICT

    # Text, or token ids (an engine that takes them: live.token_prompts).
    prompt: str | token_ids()
    max_new_tokens: integer(ge=1)
    deadline_ms: integer(ge=1) | None = None
    stop: stops() | None = None
    # Whose per-client rate limit it counts against (also the x-client-id header; the body wins).
    client_id: (
        Annotated[str, StringConstraints(min_length=1, max_length=CLIENT_ID_CHARS)] | None
    ) = None
    # Higher first under a priority discipline (the policy's; FIFO ignores it).
    priority: integer(ge=-PRIORITY_BOUND, le=PRIORITY_BOUND) = 0

    def body(self) -> dict:
        """The JSON body: the fields given, defaults left out (the server applies its own)."""
        return self.model_dump(exclude_defaults=True)


# the caps' subclass below has the same name (its schema's title)
_GenerateRequest = GenerateRequest


def request_model(limits: Limits, token_id_vocab: int | None = None) -> type[GenerateRequest]:
    """The body schema with these caps, its prompt text or (where the engine takes them) token ids
    below ``token_id_vocab``. Strict: "16" is not a number and unknown fields are refused."""
    prompt_type = with_token_ids(
        Annotated[str, StringConstraints(max_length=limits.max_prompt_chars)], token_id_vocab
    )

    class GenerateRequest(_GenerateRequest):  # the same name in /openapi.json
        prompt: prompt_type
        max_new_tokens: integer(ge=1, le=limits.max_new_tokens)
        deadline_ms: integer(ge=1, le=limits.max_deadline_ms) | None = None
        stop: stops(limits.max_stops, limits.max_stop_chars) | None = None

    return GenerateRequest


class Admission(BaseModel):
    """What the gate saw when the request arrived (``admission`` of an answer; the start of an
    error's ``numbers``).

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
    # deadline_too_short: the most new tokens whose estimate fits the deadline
    fit_new_tokens: Num = None
    replica: Num = None  # a fleet's replica that decided on it (qlab serve --replicas)


class Timings(BaseModel):
    """An answer's seconds. started_at / returned_at are the gate's clock: the engine counted busy
    in between. first_token_s: the engine's own time to its first token (null for an engine that
    does not see it)."""

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
    # Of the prompt, the tokens the prefix cache held when it was first scheduled (vLLM's
    # num_cached_tokens; qlab serve --prefix-caching). None: no prefix cache.
    cached_prompt_tokens: int | None = None


# ---------------------------------------------------------------------- the error envelope


class ErrorDetail(BaseModel):
    """qlab's error object: OpenAI's (``message``, ``type``, ``code``) and more.

    code repeats reason (OpenAI's name for it, so the openai SDK reads qlab's errors); numbers: what
    the gate knew (see :class:`Numbers`); retry_after_s: also the Retry-After header, on a 503 or
    429.
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


#: A streamed answer's finish_reason when the server stopped it before its end (vLLM's and SGLang's
#: word for a request they abort; the openai SDK passes any finish_reason through).
STOPPED = "abort"


class Stopped(BaseModel):
    """Why the gate stopped a streamed answer after its first piece, on its last chunk
    (``qlab_stopped``, beside finish_reason :data:`STOPPED`): the status and the error object its
    handler answers the same stop unstreamed (a cut at the deadline: 504 ``deadline_exceeded``, with
    its numbers). Not ``error``: the openai SDK raises on an event with an ``error`` key, and an
    answer the gate cut is a partial answer, not a failure."""

    status: int
    error: ErrorDetail


def error_json(
    type_: str,
    reason: str,
    message: str,
    numbers: dict | None = None,
    retry_after_s: int | None = None,
) -> str:
    """The envelope's JSON (non-finite numbers as null: JSON has neither NaN nor infinity)."""
    detail = {
        "type": type_,
        "reason": reason,
        "code": reason,
        "message": message,
        "numbers": numbers or {},
        "retry_after_s": retry_after_s,
    }
    # one validation
    return ErrorEnvelope.model_validate({"error": detail}).model_dump_json(exclude_unset=True)


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
    # An engine that takes prompts as token ids says from which vocabulary (live.token_prompts);
    # None: text prompts only.
    token_id_vocab: int | None = None
    # The synthetic engine's speed now and its schedule of [seconds, speed] steps, whose seconds
    # began at schedule_started_at (the gate's clock): a run file puts the schedule on its own clock
    # with it.
    speed: float | None = None
    schedule: list[tuple[float, float]] | None = None
    schedule_started_at: Num = None
    # A batching upstream engine's learner: the step model it learned, its fit and refits
    # (live.upstream_batch).
    learned: dict[str, Any] | None = None


class EngineInfo(EngineFacts):
    """An engine's description of itself (``engine.info()``), in /stats and /healthz; each engine
    says more."""

    engine: str


class HealthFacts(BaseModel):
    """What a client reads of any server's ``GET /healthz`` (:class:`Health` is qlab's): its
    engine, if it says."""

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
    # The answered requests' prompt and generated tokens, the prompt by the engine's count (an
    # upstream's).
    answered_tokens: dict[str, int] = {}
    limits: LimitsBody = LimitsBody()
    engine: EngineInfo | None = None  # as in /healthz
    upstream_counters: UpstreamCountersBody | None = None
    # qsim.config.ServerConfig's fields: what a replay simulates
    server_config: dict[str, Any] | None = None
    # a fleet gate's qsim.fleet.FleetSpec fields (None: one server)
    fleet: dict[str, Any] | None = None


class StalledEngine(BaseModel):
    engine: int
    running_s: Num
    stall_after_s: Num
    est_service_s: Num


class Health(BaseModel):
    """``GET /healthz``: "ok", or "degraded" while an engine is stalled (still a 200: the process
    answers); ready: whether it can answer now (``GET /ready``'s verdict), and not_ready: why not
    (the upstream unreachable or failing, every engine stalled)."""

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
