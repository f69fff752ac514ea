"""The contract's client side (:mod:`live.contract`): how qlab's clients (the replayer, ``qlab
calibrate``, the benchmarks' lean client) read an answer or an error of a qlab gate
(:func:`read_answer`, :func:`read_error`) or of any OpenAI-compatible server
(:class:`AnswerEvent`, read leniently), and what the upstream engine (:mod:`live.upstream`)
sends to any OpenAI-compatible server and reads back (:class:`UpstreamRequest`,
:class:`UpstreamChunk`, :class:`ForeignError`, :class:`UpstreamModels`; other servers differ).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel

from .contract import Admission, ErrorDetail, ErrorEnvelope, GenerateResponse, Stopped, Timings
from .contract_fields import _OPEN
from .contract_openai import (
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    ModelCard,
    ModelList,
    QlabInfo,
    Usage,
)


# ---------------------------------------------------------------------- reading answers (the
# clients' side)


def read_answer(body: Any) -> GenerateResponse | None:
    """A 200's answer by the contract (a parsed JSON body): /v1/generate's, or an OpenAI-compatible
    (chat) completion's, whose ``qlab`` part has the same timings and admission numbers; None when
    it is neither."""
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


def generate_of(
    q: QlabInfo | None,
    text: str,
    tokens: int,
    prompt_tokens: int | None = None,
    cached_prompt_tokens: int | None = None,
) -> GenerateResponse:
    """An OpenAI-compatible answer as ``/v1/generate``'s: a qlab gate's ``qlab`` part gives the
    outcome, engine, timings and admission numbers; without one (a server that is not a qlab gate)
    they are unknown: nulls, engine -1, and outcome good, which nothing reads (a client judges an
    answer by the latency it measured)."""
    if q is None:
        return GenerateResponse(
            text=text,
            tokens=tokens,
            outcome="good",
            engine=-1,
            admission=Admission(),
            prompt_tokens=prompt_tokens,
            timings=Timings(
                queue_s=None,
                engine_s=None,
                total_s=None,
                est_service_s=None,
                started_at=None,
                returned_at=None,
            ),
        )
    return GenerateResponse(
        text=text,
        tokens=tokens,
        outcome=q.outcome,
        engine=q.engine,
        admission=q.admission,
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached_prompt_tokens,
        timings=Timings(
            queue_s=q.queue_s,
            engine_s=q.engine_s,
            total_s=q.total_s,
            est_service_s=q.est_service_s,
            started_at=q.started_at,
            returned_at=q.returned_at,
            first_token_s=q.first_token_s,
        ),
    )


class EventUsage(BaseModel):
    """An answer's usage as any server reports it (qlab's is :class:`Usage`), read leniently."""

    model_config = _OPEN

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    # OpenAI's (and vLLM's) prompt_tokens_details: cached_tokens, the prefix cache's share
    prompt_tokens_details: dict | None = None

    @property
    def cached_tokens(self) -> int | None:
        cached = (self.prompt_tokens_details or {}).get("cached_tokens")
        return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


class EventDelta(BaseModel):
    model_config = _OPEN

    content: str | None = None


class EventChoice(BaseModel):
    """A choice of a completion (its ``text``) or of a chat chunk (its ``delta``), read
    leniently."""

    model_config = _OPEN

    text: str | None = None
    delta: EventDelta | None = None


class AnswerEvent(BaseModel):
    """One ``data:`` event of any OpenAI-compatible server's streamed answer, or its whole answer,
    as the replayer reads it (:mod:`live.openai_replay`); qlab's :class:`Completion` and
    :class:`ChatCompletionChunk` are such events. Lenient (other servers say more, or less);
    ``qlab``: a qlab gate's part; ``qlab_stopped``: a qlab gate's word that it stopped the answer
    (:class:`Stopped`); ``error``: an error event (its content is not read)."""

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


# ---------------------------------------------------------------------- to and from an upstream
# server


class UpstreamRequest(BaseModel):
    """What the upstream engine sends to a completions route: what the gate decided (the model, the
    size, the stop strings, a stream with its usage), and the sampling fields the client gave,
    unchanged (extra keys: the upstream's defaults apply to what the client did not give)."""

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
    """A chunk's choice, read leniently: servers have finish reasons of their own (vLLM's "abort");
    a chat chunk's text is its ``delta.content``."""

    text: str = ""
    delta: UpstreamDelta | None = None
    # a whole chat completion's (an upstream that did not stream)
    message: UpstreamDelta | None = None
    finish_reason: str | None = None
    logprobs: Any = None

    @property
    def piece(self) -> str:
        """The text this choice adds: a completion's ``text``, a chat chunk's ``delta.content``, or
        a whole chat completion's ``message.content``."""
        said = self.delta if self.delta is not None else self.message
        return self.text or (said.content or "" if said is not None else "")


class UpstreamChunk(Completion):
    """One event of the upstream's stream: a completion chunk (qlab's own, read leniently) or a
    chat chunk."""

    object: str = "text_completion"
    choices: list[UpstreamChoice] = []
    usage: EventUsage | None = None
    qlab: Any = None


class ForeignErrorDetail(BaseModel):
    """Any server's error object, read leniently (qlab's :class:`ErrorDetail` is one: its other
    keys are kept)."""

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
