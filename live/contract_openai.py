"""The OpenAI-compatible API's bodies (:mod:`live.openai_api`), part of the contract
(:mod:`live.contract`): the requests of ``POST /v1/completions`` and
``POST /v1/chat/completions`` (strict; :func:`request_models` adds a server's caps), the fields
that go on to an upstream as the client gave them, and the answers: completions, chat
completions, their streamed chunks, and the model list.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from qsim.records import CLIENT_ID_CHARS, PRIORITY_BOUND

from .contract import Admission, Stopped
from .contract_fields import (
    _STRICT,
    OWNER,
    Limits,
    Only,
    Published,
    integer,
    stops,
    token_ids,
    with_token_ids,
)


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
    # Vendor fields: the sampling parameters vLLM (and the benchmark clients written for it) send.
    # Typed, so a malformed value is a 422; min_tokens, ignore_eos and top_k are honoured
    # (live.openai_api), the rest ignored; all go on to an upstream as given (SAMPLING_FIELDS).
    # use_beam_search and prompt_logprobs are refused when they ask for something.
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


#: The fields of a request that go on to an upstream server as the client gave them (where it gave
#: them): OpenAI's sampling fields and the vendor ones above. The others are the gate's (the model,
#: size, stop strings, streaming, the client, qlab's extensions) or refused when they ask for
#: something.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "logit_bias",
    "top_k",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "add_special_tokens",
    "return_tokens_as_token_ids",
    "request_id",
)
#: A chat's own fields that go on to an upstream's chat route likewise.
CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "reasoning_effort",
)


class CompletionRequest(_Common):
    """``POST /v1/completions`` without a server's caps (see :func:`request_models`)."""

    # A list: of exactly one prompt (the route refuses a batch with 400 unsupported_parameter), or
    # token ids (an engine that takes them: live.token_prompts).
    prompt: str | Annotated[list[str], _ONE_PROMPT] | token_ids()
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
    response_format: Annotated[
        dict[str, Any] | None, Only({"type": "text"}, why="only text answers")
    ] = None
    # Accepted and ignored.
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # Vendor (vLLM's chat template controls) and OpenAI's reasoning effort: ignored here, forwarded
    # to an upstream's chat route (CHAT_FIELDS).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None


_CompletionRequest, _ChatCompletionRequest = CompletionRequest, ChatCompletionRequest


def request_models(
    limits: Limits,
    model_id: str | None = None,
    token_id_vocab: int | None = None,
) -> tuple[type[CompletionRequest], type[ChatCompletionRequest]]:
    """(CompletionRequest, ChatCompletionRequest) with these caps, and the model served (None: any
    name validates; the route compares); a completion's prompt may be token ids below
    ``token_id_vocab`` (None: the engine takes none). Strict: unknown fields are refused."""
    stop_type = stops(limits.max_stops, limits.max_stop_chars) | None
    prompt_text = Annotated[str, StringConstraints(max_length=limits.max_prompt_chars)]
    new_tokens = integer(ge=1, le=limits.max_new_tokens) | None
    prompt_type = with_token_ids(
        prompt_text | Annotated[list[prompt_text], _ONE_PROMPT], token_id_vocab
    )
    deadline_type = integer(ge=1, le=limits.max_deadline_ms) | None
    # The one model served: the schema says so (the route answers any other 404 model_not_found).
    served = _ModelName if model_id is None else Annotated[_ModelName, Published(enum=[model_id])]

    class CompletionRequest(_CompletionRequest):
        model: served
        stop: stop_type = None
        deadline_ms: deadline_type = None
        prompt: prompt_type
        max_tokens: new_tokens = None

    class ChatCompletionRequest(_ChatCompletionRequest):
        model: served
        stop: stop_type = None
        deadline_ms: deadline_type = None
        max_tokens: new_tokens = None
        max_completion_tokens: Annotated[new_tokens, Field(description=_MAX_TOKENS_RULE)] = None

    return CompletionRequest, ChatCompletionRequest


# ---------------------------------------------------------------------- OpenAI-compatible answers


class PromptTokensDetails(BaseModel):
    """OpenAI's ``usage.prompt_tokens_details`` (vLLM's too): of the prompt, the tokens the
    engine's prefix cache held."""

    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # None (null, as vLLM without its prompt-token details): no prefix cache (qlab serve
    # --prefix-caching fills it)
    prompt_tokens_details: PromptTokensDetails | None = None


class QlabInfo(BaseModel):
    """The gate's view of the request: /v1/generate's ``timings`` and ``admission``, and the
    outcome."""

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
    # The request's objectives (the x-slo-ttft-ms and x-slo-tpot-ms headers), seconds; null: none
    # given.
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
    # the gate stopped it after its first piece (finish_reason abort)
    qlab_stopped: Stopped | None = None


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
