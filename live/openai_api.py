"""OpenAI-compatible endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET
/v1/models``.

The request and response bodies are pydantic models of :mod:`live.contract_openai`; the routes
are mounted by :func:`live.http_api.create_app` (:func:`mount`) beside ``/v1/generate``
and admit through the same ``gate.submit(Job(...))``: the same policy, deadlines,
per-client limits, counts and metrics. Every answer that is not a 200 is qlab's error
envelope (:func:`live.envelope.error_response`), whose ``message``, ``type`` and ``code``
are OpenAI's error object, so the openai SDK raises its usual exceptions on them.

What a request becomes (docs/http.md, "OpenAI-compatible API", says the same for users):

* new tokens: ``max_completion_tokens``, else ``max_tokens``, else the server's cap
  (``Limits.max_new_tokens``, lowered to the engine's own limit); both given and different: 400;
* the prompt: a completion's ``prompt`` (a string, or a list of exactly one string); a chat's
  ``messages`` joined by :func:`chat_prompt`, one line ``ROLE: TEXT`` per message (``ROLE (NAME):
  TEXT`` with a name) and a last line ``assistant:``;
* the deadline: the body's ``deadline_ms`` (a qlab extension), else the ``x-request-deadline-ms``
  header, else the policy's default;
* the client (per-client rate limits): the body's ``user``, else the ``x-client-id`` header;
* ``priority`` (a qlab extension) as on ``/v1/generate``; ``stop`` (a string or a list) is honoured;
* ``model`` must be the served model's id (:func:`served_model_id`, the one ``GET /v1/models``
  lists): any other is a 404 ``model_not_found``, as OpenAI and vLLM answer;
* sampling fields (temperature, top_p, penalties, seed, logit_bias, and a chat's store, metadata,
  service_tier, parallel_tool_calls) are accepted and ignored: the engines decode greedily;
* what cannot be honoured is a 400 ``unsupported_parameter`` naming it: ``n`` or ``best_of`` other
  than 1, a list of several prompts, a ``suffix`` other than ``""``, ``logprobs``,
  ``top_logprobs``, tools and functions, a ``response_format`` other than ``{"type": "text"}``;
  /openapi.json lists only the values served (:class:`live.contract_fields.Only`). Any other bad
  field is a 422, as on ``/v1/generate`` (strict); an integer field takes an integral float
  (``61.0``), as JSON Schema's integer and vLLM do.

Streaming (``stream: true``). The answer is passed through as the engine produces it
(:meth:`live.gate.Gate.submit_streaming`; an engine's ``emit``, :mod:`live.engine`): (chat) a role
chunk, then one chunk per piece of text as it arrives (the synthetic engine's tokens, GPT-2's
decoding steps, the upstream server's own chunks), then a last chunk with ``finish_reason`` and the
``qlab`` timings, (with ``stream_options.include_usage``) a chunk with ``usage``, then ``data:
[DONE]``. The response starts with the first piece: until then a refusal or a failure is a plain
JSON error with its status (never a stream), and an engine without ``emit`` streams its whole answer
at the end, as before. A failure after the first piece (an upstream that errors, times out or hangs
up mid-stream, an engine error, a stall, the server's graceful shutdown running out of time) ends
the stream with one event holding the error envelope its handler would have answered (``data:
{"error": {...}}``, on which the openai SDK raises ``APIError``), then ``data: [DONE]``. A cut at
the deadline after the first piece is not a failure but the gate stopping the answer: its last chunk
says ``finish_reason: "abort"`` (what vLLM and SGLang send for a request they abort; the openai SDK
passes it through) and, in ``qlab_stopped``, the status and error object the handler answers the cut
unstreamed (504 ``deadline_exceeded``, reason ``deadline_passed``, with its numbers), then ``data:
[DONE]``: a client keeps the text it got, and ``qlab replay --api openai`` records the outcome the
gate recorded. A client that hangs up mid-stream cancels the future, so the run's Cancel is set.

``finish_reason`` is ``stop`` when the engine generated fewer tokens than asked (a stop string
ended it), else ``length``: the engines never stop at end-of-text (an upstream server may: its
shorter answer then says ``stop`` too). The synthetic engine does all
the work even when a stop string cuts its text, so it says ``length`` unless it stops early of its
own (``--early-stops``), then ``stop``.

Every 200 carries ``qlab``: the gate's outcome (good or late), engine, queue and engine seconds,
the gate-clock times, and the admission numbers, as ``/v1/generate``'s ``timings`` and
``admission``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send


from .contract import STOPPED, Admission, ErrorEnvelope, Stopped
from .contract_fields import OWNER, Limits, unsupported  # noqa: F401
from .contract_openai import (
    CHAT_FIELDS,
    SAMPLING_FIELDS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionRequest,  # noqa: F401
    ModelCard,
    ModelList,
    PromptTokensDetails,
    QlabInfo,
    StreamOptions,  # noqa: F401
    TextPart,
    Usage,
    request_models,
)
from .envelope import (
    ADMITTING,
    ANY_ROUTE,
    InvalidRequest,
    answer_for,
    error_responses,
    json_response,
    parse_body,
    shutdown_response,
    stopped_by_shutdown,
)
from .engine import Asked, abilities_of
from .gate import Gate
from .gate_errors import DeadlineCut, Rejected
from .jobs import END, Answer, Job, StreamingJob
from .request_io import (
    header_parameters,
    outcome,
    read_body,
    request_deadline,
    until_disconnect,
    with_headers,
)
from .routes import CHAT, CLIENT_HEADER, COMPLETIONS, DEADLINE_HEADER, MODELS  # noqa: F401 - named here too
from .token_prompts import read_prompt


# The request and answer bodies are live.contract_openai's (imported above), with every other
# body.


# ---------------------------------------------------------------------- prompts and names


def served_model_id(info: dict) -> str:
    """The id a request's ``model`` must name: the engine's model, or the engine's name.

    synthetic -> "synthetic"; gpt2 with a hub name or path -> that name; gpt2's random-weight
    models -> "gpt2-random", "gpt2-tiny"; upstream -> the upstream's model.
    """
    engine, model = str(info.get("engine", "engine")), info.get("model")
    if not model:
        return engine
    return f"{engine}-{model}" if engine == "gpt2" and model in ("random", "tiny") else str(model)


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def chat_prompt(messages: list[ChatMessage]) -> str:
    """One line per message, ``ROLE: TEXT`` (``ROLE (NAME): TEXT``), then ``assistant:`` for the
    answer.

    A message's text parts are joined with newlines; so are the messages.
    """
    lines = [f"{m.role}{f' ({m.name})' if m.name else ''}: {_text(m.content)}" for m in messages]
    return "\n".join([*lines, "assistant:"])


def _check_supported(req) -> None:
    """400 unsupported_parameter for the first field set to a value this server cannot honour (the
    values it can are the fields' :class:`~live.contract_fields.Only`, which /openapi.json
    lists)."""
    found = unsupported(req)
    if found is not None:
        raise InvalidRequest(400, "unsupported_parameter", found[1])


def _asked(req) -> Asked:
    """What the request asks of its run beyond prompt, size and stop strings: min_tokens, a chat's
    messages as they came, and the sampling fields the client gave (for an upstream:
    SAMPLING_FIELDS, a chat's CHAT_FIELDS)."""
    chat = isinstance(req, ChatCompletionRequest)
    forwarded = req.model_dump(
        include=set(SAMPLING_FIELDS + (CHAT_FIELDS if chat else ())), exclude_unset=True
    )
    messages = tuple(m.model_dump(exclude_none=True) for m in req.messages) if chat else None
    if not forwarded and messages is None and not req.min_tokens:
        return _NOTHING_ASKED
    return Asked(req.min_tokens or 0, messages, tuple(forwarded.items()))


_NOTHING_ASKED = Asked()


def _completion_prompt(req) -> str | list[int]:
    """The prompt's text, or its token ids (live.token_prompts checks them against the engine)."""
    _check_supported(req)
    if isinstance(req.prompt, list) and all(isinstance(p, int) for p in req.prompt):
        if req.echo:
            raise InvalidRequest(
                400, "unsupported_parameter", "echo: a prompt of token ids is not echoed"
            )
        return req.prompt
    if isinstance(req.prompt, list):
        if len(req.prompt) != 1:  # as the schema says (minItems and maxItems 1)
            raise InvalidRequest(
                400,
                "unsupported_parameter",
                f"prompt: a batch of {len(req.prompt)} prompts is not supported: send one string",
            )
        return req.prompt[0]
    return req.prompt


def _chat_messages_prompt(req) -> str:
    _check_supported(req)
    return chat_prompt(req.messages)


def _new_tokens(req, default: Callable[[], int]) -> int:
    """The new tokens asked for: max_completion_tokens or max_tokens (400 when both differ), else
    ``default()``."""
    both = [
        v for v in (getattr(req, "max_completion_tokens", None), req.max_tokens) if v is not None
    ]
    if len(set(both)) > 1:
        raise InvalidRequest(
            400,
            "conflicting_parameters",
            f"max_completion_tokens {both[0]} and max_tokens {both[1]} differ: give one",
        )
    return both[0] if both else default()


# ---------------------------------------------------------------------- the routes


DONE_EVENT = "data: [DONE]\n\n"
#: One event of a stream, as /openapi.json says it (OpenAPI 3.1: a text/event-stream's schema is
#: each event's).
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": "a chunk (Completion, ChatCompletionChunk), an error envelope, or "
            "[DONE]",
        }
    },
}
SSE_HEADERS = {"Cache-Control": "no-cache"}


def _event(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


class EventStream(Response):
    """A server-sent event stream, sent as the route's generator yields each event.

    Not Starlette's StreamingResponse: that one runs each stream in an anyio task group with a task
    of its own listening for the client to leave, about 0.4 ms per stream on two cores
    (benchmarks/bench_openai.py, docs/benchmarks.md), while the route already watches for that
    (``until_disconnect`` cancels the future, which ends the events). A Response all the same, so
    that FastAPI's routing passes it on as it is."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        self.events, self.status_code, self.background = events, 200, None
        # no body: no content-length, the stream ends with the connection's chunks
        self.init_headers(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            try:
                # after a client left, the server's send drops what comes
                async for event in self.events:
                    await send(
                        {"type": "http.response.body", "body": event.encode(), "more_body": True}
                    )
            # the server's shutdown timed out: the stream ends as a failure does
            except asyncio.CancelledError:
                stopped_by_shutdown()
                await send(
                    {
                        "type": "http.response.body",
                        "body": SHUTDOWN_EVENT.encode(),
                        "more_body": True,
                    }
                )
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # its own finally stops the watch, and so the run, if we stopped early
            await self.events.aclose()


def _sse(events: list[BaseModel]) -> Response:
    body = "".join(_event(e) for e in events) + DONE_EVENT
    return Response(body, media_type="text/event-stream", headers=SSE_HEADERS)


def _as_event(response: Response) -> str:
    """An error answer's envelope as one event: the openai SDK raises APIError on a data event
    with an ``error`` key."""
    return f"data: {bytes(response.body).decode()}\n\n"


async def _error_event(request: Request, exc: Exception) -> str:
    """The envelope its handler answers a request that fails before streaming, as one event."""
    return _as_event(await answer_for(request, exc))


async def _stopped(request: Request, exc: Exception) -> Stopped:
    """Why the gate stopped a streamed answer: the status and error its handler answers ``exc``
    unstreamed."""
    response = await answer_for(request, exc)
    return Stopped(
        status=response.status_code,
        error=ErrorEnvelope.model_validate_json(bytes(response.body)).error,
    )


#: A stream's end when the server's shutdown cancels it (:func:`live.envelope.shutdown_response`).
SHUTDOWN_EVENT = _as_event(shutdown_response()) + DONE_EVENT


def _json(body: BaseModel) -> Response:
    # model_dump_json writes a non-finite number as null, which JSON needs.
    return json_response(body.model_dump_json())


@dataclass(frozen=True)
class _Admitted:
    """What one admitted request produced."""

    answer: Answer
    job: Job
    total_s: float

    @property
    def finish_reason(self) -> str:
        return "stop" if self.answer.tokens < self.job.max_new_tokens else "length"

    @property
    def usage(self) -> Usage:
        prompt = self.answer.prompt_tokens  # the gate settled it (Gate._resolve)
        cached = self.answer.cached_prompt_tokens
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=self.answer.tokens,
            total_tokens=prompt + self.answer.tokens,
            prompt_tokens_details=None
            if cached is None
            else PromptTokensDetails(cached_tokens=cached),
        )

    @property
    def qlab(self) -> QlabInfo:
        a = self.answer
        return QlabInfo(
            outcome=a.outcome,
            engine=a.engine,
            queue_s=a.queue_s,
            engine_s=a.engine_s,
            total_s=self.total_s,
            est_service_s=a.arrival.seen.est_service_s,
            started_at=a.started_at,
            returned_at=a.returned_at,
            admission=Admission.model_validate(a.arrival.numbers()),
            first_token_s=a.first_token_s,
            ttft_slo_s=self.job.ttft_slo_s,
            tpot_slo_s=self.job.tpot_slo_s,
        )


@dataclass(frozen=True)
class _Shape:
    """A streamed answer's events: those before the text (chat's role chunk), one for a piece of
    text (the first piece after ``prefix``: an echoed prompt), those after it (finish_reason, qlab,
    usage), and the last one of an answer the gate stopped (finish_reason abort, and why:
    :class:`~live.contract.Stopped`)."""

    lead: tuple[BaseModel, ...]
    piece: Callable[[str], BaseModel]
    tail: Callable[[_Admitted], list[BaseModel]]
    stopped: Callable[[Stopped], BaseModel]
    prefix: str = ""


def _completion_shape(head: dict, include_usage: bool, prefix: str) -> _Shape:
    def piece(text: str) -> BaseModel:
        return Completion(**head, choices=[CompletionChoice(text=text, finish_reason=None)])

    def tail(run: _Admitted) -> list[BaseModel]:
        last = Completion(
            **head,
            choices=[CompletionChoice(text="", finish_reason=run.finish_reason)],
            qlab=run.qlab,
        )
        return [last, *([Completion(**head, choices=[], usage=run.usage)] if include_usage else [])]

    def stopped(why: Stopped) -> BaseModel:
        return Completion(
            **head, choices=[CompletionChoice(text="", finish_reason=STOPPED)], qlab_stopped=why
        )

    return _Shape((), piece, tail, stopped, prefix)


def _chat_shape(head: dict, include_usage: bool) -> _Shape:
    def piece(text: str) -> BaseModel:
        return ChatCompletionChunk(**head, choices=[ChatChunkChoice(delta=ChatDelta(content=text))])

    def tail(run: _Admitted) -> list[BaseModel]:
        done = ChatChunkChoice(delta=ChatDelta(), finish_reason=run.finish_reason)
        last = ChatCompletionChunk(**head, choices=[done], qlab=run.qlab)
        return [
            last,
            *([ChatCompletionChunk(**head, choices=[], usage=run.usage)] if include_usage else []),
        ]

    def stopped(why: Stopped) -> BaseModel:
        return ChatCompletionChunk(
            **head,
            choices=[ChatChunkChoice(delta=ChatDelta(), finish_reason=STOPPED)],
            qlab_stopped=why,
        )

    role = ChatCompletionChunk(
        **head, choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]
    )
    return _Shape((role,), piece, tail, stopped)


def _include_usage(req) -> bool:
    return req.stream_options is not None and bool(req.stream_options.include_usage)


@dataclass(frozen=True)
class _Routes:
    gate: Gate
    limits: Limits
    model_id: str
    created: int
    completion_schema: type[BaseModel]
    chat_schema: type[BaseModel]

    async def _run(self, request: Request, req, prompt: str, t0: float) -> _Admitted | None:
        """Admit and run; None when the client left first. Refusals and failures raise to their
        handlers."""
        job = self._job(request, req, prompt)
        answer = await outcome(self._admit(self.gate.submit, job, t0), request)
        if answer is None:
            return None
        return _Admitted(answer, job, self.gate.clock() - t0)

    def _admit(self, submit, job: Job, t0: float):
        try:
            return submit(job)
        except Rejected:  # refused at arrival (NeverInTime too)
            self.gate.timings.refusal.observe(self.gate.clock() - t0)
            raise

    async def _stream(
        self, request: Request, req, prompt: str, t0: float, make_shape: Callable[[], _Shape]
    ) -> Response:
        """Admit, then stream the pieces as the engine produces them. Until the first piece, a
        refusal or failure raises to its handler (a plain JSON error); after it, a failure is the
        stream's last event."""
        job = self._job(request, req, prompt)
        streamed = self._admit(self.gate.submit_streaming, job, t0)
        shape = make_shape()
        # A client that hangs up cancels the future (the run's Cancel is set), which ends the pieces
        # (END).
        watch = asyncio.ensure_future(until_disconnect(request))
        watch.add_done_callback(lambda _: streamed.future.cancel())
        try:
            first = await streamed.pieces.get()
        except BaseException:
            watch.cancel()
            raise
        if first is not END:
            return EventStream(self._events(request, streamed, watch, first, shape, job, t0))
        # done before any piece: an engine without emit, a failure, or the client left
        watch.cancel()
        if streamed.future.cancelled():
            return Response(status_code=499)
        run = _Admitted(streamed.future.result(), job, self.gate.clock() - t0)
        return _sse([*shape.lead, shape.piece(shape.prefix + run.answer.text), *shape.tail(run)])

    async def _events(
        self,
        request: Request,
        streamed: StreamingJob,
        watch: asyncio.Future,
        first: str,
        shape: _Shape,
        job: Job,
        t0: float,
    ) -> AsyncIterator[str]:
        # Events ready together go out in one write (the lead with the first piece, the tail with
        # [DONE]): each write is a wake-up for the client, and for a gate in front of this one, a
        # read.
        try:
            lead = "".join(_event(event) for event in shape.lead)
            piece, prefix = first, shape.prefix
            while piece is not END:
                yield lead + _event(shape.piece(prefix + piece))
                piece, prefix, lead = await streamed.pieces.get(), "", ""
            future = streamed.future
            if future.cancelled():
                return  # the client left (or the server is shutting down): nobody reads on
            # stopped by the gate: a partial answer, said so
            if isinstance(future.exception(), DeadlineCut):
                yield (
                    _event(shape.stopped(await _stopped(request, future.exception()))) + DONE_EVENT
                )
            elif future.exception() is not None:
                yield await _error_event(request, future.exception()) + DONE_EVENT
            else:
                run = _Admitted(future.result(), job, self.gate.clock() - t0)
                yield "".join(_event(event) for event in shape.tail(run)) + DONE_EVENT
        finally:
            watch.cancel()  # and so the future: a stream closed early stops its run

    def _job(self, request: Request, req, prompt: str | list[int]) -> Job:
        if req.model != self.model_id:
            raise InvalidRequest(
                404,
                "model_not_found",
                f"model {req.model[:80]!r} is not served "
                "here; "
                f"this server serves {self.model_id!r} "
                f"(GET {MODELS})",
            )
        if isinstance(prompt, str) and len(prompt) > self.limits.max_prompt_chars:
            raise InvalidRequest(
                422,
                "prompt_too_long",
                f"prompt: {len(prompt)} characters; the limit is {self.limits.max_prompt_chars}",
            )
        read = read_prompt(prompt, self.gate.engines[0], self.limits)
        tokens = read.tokens
        deadline = request_deadline(req.deadline_ms, request, self.limits.max_deadline_ms)
        max_new = _new_tokens(req, lambda: self._default_new_tokens(deadline, tokens))
        if req.min_tokens is not None and req.min_tokens > max_new:
            raise InvalidRequest(
                400,
                "conflicting_parameters",
                f"min_tokens {req.min_tokens} is more than the {max_new} new tokens asked for",
            )
        job = Job(
            read.text,
            max_new,
            tuple(req.stop or ()),
            deadline,
            req.user,
            req.priority,
            tokens,
            asked=_asked(req),
            prompt_ids=read.ids,
        )
        return with_headers(job, request, self.limits.max_deadline_ms)

    def _default_new_tokens(self, deadline_s: float | None, prompt_tokens: int) -> int:
        """A request that names no max_tokens: the server's --default-max-tokens, else the most
        whose estimate at the speed the gate tracks fits its deadline (at least 1, at most the cap):
        never the cap a deadline cannot hold, nor, on a machine running slow, a size that admission
        would then refuse (503) on an idle gate."""
        if self.limits.default_max_tokens is not None:
            return self.limits.default_max_tokens
        fits = self.gate.fitting_tokens(deadline_s, prompt_tokens, self.gate.tracker.factor)
        return max(1, min(self.limits.max_new_tokens, fits))

    async def completions(self, request: Request) -> Response:
        t0 = self.gate.clock()
        req = parse_body(
            self.completion_schema, await read_body(request, self.limits.max_body_bytes)
        )
        prompt = _completion_prompt(req)
        if req.stream:
            return await self._stream(
                request,
                req,
                prompt,
                t0,
                lambda: _completion_shape(
                    self._head("cmpl"), _include_usage(req), prompt if req.echo else ""
                ),
            )
        run = await self._run(request, req, prompt, t0)
        if run is None:
            return Response(status_code=499)  # nobody is listening; the status is only for logs
        text = prompt + run.answer.text if req.echo else run.answer.text
        return _json(
            Completion(
                **self._head("cmpl"),
                choices=[CompletionChoice(text=text, finish_reason=run.finish_reason)],
                usage=run.usage,
                qlab=run.qlab,
            )
        )

    async def chat(self, request: Request) -> Response:
        t0 = self.gate.clock()
        req = parse_body(self.chat_schema, await read_body(request, self.limits.max_body_bytes))
        prompt = _chat_messages_prompt(req)
        if req.stream:
            return await self._stream(
                request,
                req,
                prompt,
                t0,
                lambda: _chat_shape(self._head("chatcmpl"), _include_usage(req)),
            )
        run = await self._run(request, req, prompt, t0)
        if run is None:
            return Response(status_code=499)
        return _json(
            ChatCompletion(
                **self._head("chatcmpl"),
                choices=[
                    ChatChoice(
                        message=AssistantMessage(content=run.answer.text),
                        finish_reason=run.finish_reason,
                    )
                ],
                usage=run.usage,
                qlab=run.qlab,
            )
        )

    def _head(self, kind: str) -> dict:
        """An answer's id, time and model, made once it is admitted: a refusal needs none (uuid4
        reads the system's randomness, a cost every refusal under overload would pay)."""
        return dict(id=f"{kind}-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_id)

    def card(self) -> ModelCard:
        return ModelCard(id=self.model_id, created=self.created)


def _inline(schema: dict) -> dict:
    """The JSON schema with its ``$defs`` put in place of each ``$ref``: the OpenAPI document has
    no ``$defs``."""
    defs = schema.get("$defs", {})

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(defs[node["$ref"].rsplit("/", 1)[1]])
            return {k: walk(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


def _body_spec(schema: type[BaseModel], limits: Limits) -> dict:
    body = {"schema": _inline(schema.model_json_schema())}
    return {
        "parameters": header_parameters(limits.max_deadline_ms),
        "requestBody": {"required": True, "content": {"application/json": body}},
    }


def mount(
    app: FastAPI,
    gate: Gate,
    limits: Limits,
    name_model: bool = True,
) -> dict[str, Callable[[Request], Awaitable[Response]]]:
    """Add the OpenAI-compatible routes to ``app`` (its exception handlers answer their errors);
    returns the POST routes' functions by path, for the direct path of
    :class:`live.http_api.GateService`. name_model: the body schemas name the model served (else any
    name validates, and the route answers another 404 model_not_found)."""
    model_id = served_model_id(gate.engines[0].info())
    completion_schema, chat_schema = request_models(
        limits,
        model_id if name_model else None,
        abilities_of(gate.engines[0]).token_id_vocab,
    )
    routes = _Routes(gate, limits, model_id, int(time.time()), completion_schema, chat_schema)
    # The routes read the raw body (to cap its size before parsing): state the schemas for
    # /openapi.json.
    stream = {"text/event-stream": {"schema": SSE_EVENT}}
    errors = error_responses(*ADMITTING, 404)
    app.post(
        COMPLETIONS,
        openapi_extra=_body_spec(completion_schema, limits),
        responses={200: {"model": Completion, "content": stream}, **errors},
    )(routes.completions)
    app.post(
        CHAT,
        openapi_extra=_body_spec(chat_schema, limits),
        responses={200: {"model": ChatCompletion, "content": stream}, **errors},
    )(routes.chat)

    @app.get(MODELS, responses=error_responses(*ANY_ROUTE))
    async def models() -> ModelList:
        return ModelList(data=[routes.card()])

    @app.get(MODELS + "/{model_id:path}", responses=error_responses(*ANY_ROUTE, 404, 422))
    async def model(model_id: str) -> ModelCard:
        if model_id != routes.model_id:
            raise InvalidRequest(
                404,
                "model_not_found",
                f"model {model_id[:80]!r} is not served here; this server serves "
                f"{routes.model_id!r}",
            )
        return routes.card()

    return {COMPLETIONS: routes.completions, CHAT: routes.chat}
