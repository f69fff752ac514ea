"""``qlab replay --api openai``: the replayer's requests as streamed ``POST /v1/completions``.

The replayer (:mod:`live.loadgen`) builds qlab's ``/v1/generate`` bodies; for any
OpenAI-compatible server (a qlab gate, or a bare vLLM, SGLang, TGI, llama.cpp) each
becomes a completion request (:func:`completion_request`): ``model``, ``prompt``,
``max_tokens``, ``stream: true`` with usage; the deadline in the
``x-request-deadline-ms`` header (a header, so that a server that knows nothing of it
ignores it), the client as OpenAI's ``user``, a non-zero priority as ``priority``.

What comes back is read as it arrives (:func:`read_completion`): the time of the first
``data:`` event carrying text (time to the first token) and of ``data: [DONE]`` (the
answer's end). The events are then put back together as ``/v1/generate``'s answer
(:func:`answer_body`), so that :mod:`live.rows` makes the same row of them: a qlab
gate's last chunk carries ``qlab`` (its timings and admission numbers), which ``qlab
compare`` needs; a bare server's answer has only the text and the usage. Anything but
a 200 event stream is read whole as an error body: qlab's envelope is a superset of
OpenAI's error object, so a qlab gate's refusals keep their type and reason; a 503 or
429 from a server that is not a qlab gate is a refusal too (:func:`refusal_body`).
A stream that ends without ``[DONE]`` or carries an error event is an error. A qlab gate that
stopped a streamed answer (cut at its deadline after its first token) says so on its last chunk
(``qlab_stopped``: the status and error its handler answers the cut unstreamed, beside
``finish_reason: "abort"``): the answer is then read as that status and error body, so that its row
is the one ``/v1/generate`` gives the same cut (outcome ``cancelled``, its numbers), with the
stream's token times.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

import httpx

from .auth import client_headers
from .contract import GenerateRequest
from .contract_clients import (
    AnswerEvent,
    EventChoice,
    EventUsage,
    ForeignError,
    UpstreamModels,
    generate_of,
)
from .contract_openai import CompletionRequest, QlabInfo, StreamOptions
from .routes import COMPLETIONS, DEADLINE_HEADER, MODELS  # noqa: F401 (COMPLETIONS: loadgen reads it here)

#: Error types under which qlab's gate refuses or drops (live.rows reads them); a server that is
#: not a qlab gate has its own words for overload.
QLAB_REFUSALS = {503: ("overloaded", "deadline_exceeded"), 429: ("rate_limited",)}
DONE = "[DONE]"


def completion_request(body: dict, model: str) -> dict:
    """A ``/v1/generate`` body as keyword arguments of an ``httpx.Request`` to
    ``/v1/completions``, streamed."""
    # the contract's body: a misnamed key fails here
    asked = GenerateRequest.model_validate(body, strict=False)
    request = CompletionRequest(
        model=model,
        prompt=asked.prompt,
        max_tokens=asked.max_new_tokens,
        stop=asked.stop,
        stream=True,
        stream_options=StreamOptions(include_usage=True),
        priority=asked.priority,
        user=asked.client_id,
    )
    headers = {} if asked.deadline_ms is None else {DEADLINE_HEADER: str(asked.deadline_ms)}
    return {
        "json": request.model_dump(exclude_none=True, exclude_defaults=True),
        "headers": headers,
    }


def served_models(url: str, timeout_s: float = 10.0) -> list[str]:
    """The ids ``GET /v1/models`` lists; ValueError when the server lists none or cannot be
    asked."""
    try:
        response = httpx.get(url + MODELS, timeout=timeout_s, headers=client_headers())
        response.raise_for_status()
        ids = [card.id for card in UpstreamModels.model_validate_json(response.content).data]
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(
            f"{url}{MODELS}: cannot list the served models ({type(exc).__name__}); "
            "name one with --model"
        ) from None
    if not ids:
        raise ValueError(f"{url}{MODELS} lists no model")
    return ids


def choose_model(url: str, model: str | None, timeout_s: float = 10.0) -> str:
    """``model`` when the server serves it, else the first it lists (None); a model it does not list
    is refused before anything is sent, rather than every request failing with a 404. A server that
    cannot list its models is taken at its word for a named one."""
    try:
        ids = served_models(url, timeout_s)
    except ValueError:
        if model is not None:
            return model
        raise
    if model is None:
        return ids[0]
    if model not in ids:
        raise ValueError(
            f"{url} does not serve model {model!r}; it serves {', '.join(map(repr, ids[:5]))}"
        )
    return model


@dataclass(frozen=True)
class StreamReading:
    """One completion as the client read it. Times are the event loop's clock.

    body: a 200's answer as ``/v1/generate``'s, else the error body (None: not JSON); done_at: when
    ``data: [DONE]`` (or the whole error body) had arrived; first_token_at and last_token_at: when
    the first and the last event with text did (NaN: none did); pieces: the events with text; error:
    a broken stream (the attempt is then an error).
    """

    status: int
    body: Any
    retry_after: str | None
    done_at: float
    first_token_at: float = math.nan
    error: str | None = None
    last_token_at: float = math.nan
    pieces: int = 0


def refusal_body(status: int, body: Any) -> Any:
    """An error body in qlab's envelope: as it is when it is one, else OpenAI's (or vLLM's older
    top-level) error object put in it; a 503 or 429 typed as qlab's refusal (overloaded,
    rate_limited) when the server did not type it so, with no reason (the server did not give
    one)."""
    foreign = _foreign_error(body)
    # vLLM's older top level
    if foreign is not None and foreign.error is None and foreign.object == "error":
        body = {
            "error": foreign.model_dump(include={"message", "type", "code"}, exclude_unset=True)
        }
        foreign = _foreign_error(body)
    if status not in QLAB_REFUSALS:
        return body
    detail = None if foreign is None else foreign.error
    if detail is not None and detail.type in QLAB_REFUSALS[status]:
        return body
    if detail is None:
        message = str(body)[:200] if body is not None else ""
    else:
        message = str(detail.message or "")
    return {"error": {"message": message, "type": QLAB_REFUSALS[status][0], "reason": None}}


def _foreign_error(body: Any) -> ForeignError | None:
    """Any server's error body through :class:`live.contract_clients.ForeignError`; None when it
    is not one."""
    try:
        return ForeignError.model_validate(body) if isinstance(body, dict) else None
    except ValueError:
        return None


def answer_body(text: str, usage: EventUsage | None, qlab: QlabInfo | None) -> dict:
    """The streamed events as ``/v1/generate``'s answer (:func:`live.contract_clients.generate_of`):
    a qlab gate's ``qlab`` part gives the outcome, engine, timings and admission numbers; a bare
    server gives none (nulls, engine -1: unknown); tokens -1 where the server reported no usage."""
    tokens = usage.completion_tokens if usage is not None else None
    prompt = usage.prompt_tokens if usage is not None else None
    cached = usage.cached_tokens if usage is not None else None
    return generate_of(qlab, text, -1 if tokens is None else tokens, prompt, cached).model_dump()


def _text_of(event: AnswerEvent) -> str:
    """The text an event carries: a completion chunk's ``text``, or a chat chunk's
    ``delta.content``."""
    return "".join(_piece(choice) for choice in event.choices or ())


def _piece(choice: EventChoice) -> str:
    if choice.text is not None:
        return choice.text
    return (choice.delta.content or "") if choice.delta is not None else ""


def _event_of(body: Any) -> AnswerEvent | None:
    """A parsed event (or whole answer) through :class:`live.contract_clients.AnswerEvent`; None
    when it is not one."""
    try:
        return AnswerEvent.model_validate(body) if isinstance(body, dict) else None
    except ValueError:
        return None


async def read_completion(response: httpx.Response, clock=None) -> StreamReading:
    """Read one answer as it arrives (see the module): a 200 event stream event by event, anything
    else whole. clock: what times are read from (default: the running event loop's)."""
    now = clock or asyncio.get_running_loop().time
    if response.status_code != 200 or not response.headers.get("content-type", "").startswith(
        "text/event-stream"
    ):
        await response.aread()
        try:
            body = response.json()
        except ValueError:
            body = None
        whole = _event_of(body) if response.status_code == 200 else None
        if whole is not None and whole.choices is not None:
            # A server that ignored stream: true answered whole; no first token to time.
            return StreamReading(
                200, answer_body(_text_of(whole), whole.usage, whole.qlab), None, now()
            )
        return StreamReading(
            response.status_code,
            refusal_body(response.status_code, body),
            response.headers.get("retry-after"),
            now(),
        )
    first, last, done, pieces, usage, qlab, broken = (
        math.nan,
        math.nan,
        math.nan,
        [],
        None,
        None,
        None,
    )
    stopped = None
    # Read to the stream's end even after [DONE], so that the connection is clean to reuse.
    async for line in response.aiter_lines():
        if not line.startswith("data:") or broken or math.isfinite(done):
            continue
        data = line[5:].strip()
        if data == DONE:
            done = now()
            continue
        try:
            raw = json.loads(data)
        except ValueError:
            broken = f"an event that is not JSON: {data[:120]!r}"
            continue
        event = _event_of(raw)
        if event is None or event.error is not None:
            what = "an event that is not a completion chunk" if event is None else "an error event"
            broken = f"{what}: {str(raw)[:200]}"
            continue
        text = _text_of(event)
        if text:
            last = now()
            first = last if math.isnan(first) else first
            pieces.append(text)
        usage = event.usage or usage
        qlab = event.qlab or qlab
        stopped = event.qlab_stopped or stopped
    end = now()
    if broken or math.isnan(done):
        why = broken or f"the stream ended before data: {DONE}"
        return StreamReading(
            200,
            None,
            None,
            end,
            first,
            error=f"broken stream: {why}",
            last_token_at=last,
            pieces=len(pieces),
        )
    if stopped is not None:  # the gate stopped it: the row of the same stop unstreamed
        return StreamReading(
            stopped.status,
            {"error": stopped.error.model_dump(exclude_unset=True)},
            None,
            done,
            first,
            last_token_at=last,
            pieces=len(pieces),
        )
    return StreamReading(
        200,
        answer_body("".join(pieces), usage, qlab),
        None,
        done,
        first,
        last_token_at=last,
        pieces=len(pieces),
    )
