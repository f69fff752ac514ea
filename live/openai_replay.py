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
A stream that ends without ``[DONE]`` or carries an error event is an error.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

import httpx

from .openai_api import COMPLETIONS, DEADLINE_HEADER, MODELS

#: Error types under which qlab's gate refuses or drops (live.rows reads them); a server that is
#: not a qlab gate has its own words for overload.
QLAB_REFUSALS = {503: ("overloaded", "deadline_exceeded"), 429: ("rate_limited",)}
DONE = "[DONE]"


def completion_request(body: dict, model: str) -> dict:
    """A ``/v1/generate`` body as keyword arguments of an ``httpx.Request`` to ``/v1/completions``, streamed."""
    payload: dict[str, Any] = {"model": model, "prompt": body["prompt"], "max_tokens": body["max_new_tokens"],
                               "stream": True, "stream_options": {"include_usage": True}}
    if "priority" in body:
        payload["priority"] = body["priority"]
    if "client_id" in body:
        payload["user"] = body["client_id"]
    headers = {DEADLINE_HEADER: str(body["deadline_ms"])} if "deadline_ms" in body else {}
    return {"json": payload, "headers": headers}


def served_models(url: str, timeout_s: float = 10.0) -> list[str]:
    """The ids ``GET /v1/models`` lists; ValueError when the server lists none or cannot be asked."""
    try:
        response = httpx.get(url + MODELS, timeout=timeout_s)
        response.raise_for_status()
        ids = [str(card["id"]) for card in response.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{url}{MODELS}: cannot list the served models ({type(exc).__name__}); "
                         "name one with --model") from None
    if not ids:
        raise ValueError(f"{url}{MODELS} lists no model")
    return ids


def choose_model(url: str, model: str | None, timeout_s: float = 10.0) -> str:
    """``model`` when the server serves it, else the first it lists (None); a model it does not list is refused
    before anything is sent, rather than every request failing with a 404. A server that cannot list its
    models is taken at its word for a named one."""
    try:
        ids = served_models(url, timeout_s)
    except ValueError:
        if model is not None:
            return model
        raise
    if model is None:
        return ids[0]
    if model not in ids:
        raise ValueError(f"{url} does not serve model {model!r}; it serves {', '.join(map(repr, ids[:5]))}")
    return model


@dataclass(frozen=True)
class Streamed:
    """One completion as the client read it. Times are the event loop's clock.

    body: a 200's answer as ``/v1/generate``'s, else the error body (None: not JSON); done_at: when
    ``data: [DONE]`` (or the whole error body) had arrived; first_token_at: when the first event with
    text did (NaN: none did); error: a broken stream (the attempt is then an error).
    """

    status: int
    body: Any
    retry_after: str | None
    done_at: float
    first_token_at: float = math.nan
    error: str | None = None


def refusal_body(status: int, body: Any) -> Any:
    """An error body in qlab's envelope: as it is when it is one, else OpenAI's (or vLLM's older top-level)
    error object put in it; a 503 or 429 typed as qlab's refusal (overloaded, rate_limited) when the server
    did not type it so, with no reason (the server did not give one)."""
    if isinstance(body, dict) and body.get("object") == "error" and "error" not in body:
        body = {"error": {k: body[k] for k in ("message", "type", "code") if k in body}}
    error = body.get("error") if isinstance(body, dict) else None
    if status in QLAB_REFUSALS:
        error = dict(error) if isinstance(error, dict) else {"message": str(body)[:200] if body is not None else ""}
        if error.get("type") not in QLAB_REFUSALS[status]:
            error = {"message": str(error.get("message") or ""), "type": QLAB_REFUSALS[status][0], "reason": None}
        return {"error": error}
    return body


def answer_body(text: str, usage: dict | None, qlab: dict | None) -> dict:
    """The streamed events as ``/v1/generate``'s answer: a qlab gate's ``qlab`` part gives the outcome, engine,
    timings and admission numbers; a bare server gives none (nulls, engine -1: unknown, and outcome good, which
    nothing reads: the row is judged by the latency the client measured, as every answer is)."""
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    q = qlab if isinstance(qlab, dict) else {}
    timings = {k: q.get(k) for k in ("queue_s", "engine_s", "total_s", "est_service_s", "started_at",
                                     "returned_at", "first_token_s")}
    return {"text": text, "tokens": tokens if isinstance(tokens, int) else -1, "outcome": q.get("outcome", "good"),
            "engine": q.get("engine", -1), "timings": timings,
            "admission": q.get("admission") if isinstance(q.get("admission"), dict) else {}}


def _text_of(event: dict) -> str:
    """The text an event carries: a completion chunk's ``text``, or a chat chunk's ``delta.content``."""
    out = []
    for choice in event.get("choices") or ():
        if isinstance(choice, dict):
            delta = choice.get("delta")
            piece = choice.get("text") if "text" in choice else delta.get("content") if isinstance(delta, dict) else None
            out.append(piece if isinstance(piece, str) else "")
    return "".join(out)


async def read_completion(response: httpx.Response, clock=None) -> Streamed:
    """Read one answer as it arrives (see the module): a 200 event stream event by event, anything else whole.
    clock: what times are read from (default: the running event loop's)."""
    now = clock or asyncio.get_running_loop().time
    if response.status_code != 200 or not response.headers.get("content-type", "").startswith("text/event-stream"):
        await response.aread()
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code == 200 and isinstance(body, dict) and "choices" in body:
            # A server that ignored stream: true answered whole; no first token to time.
            return Streamed(200, answer_body(_text_of(body), body.get("usage"), body.get("qlab")), None, now())
        return Streamed(response.status_code, refusal_body(response.status_code, body),
                        response.headers.get("retry-after"), now())
    first, done, pieces, usage, qlab, broken = math.nan, math.nan, [], None, None, None
    # Read to the stream's end even after [DONE], so that the connection is clean to reuse.
    async for line in response.aiter_lines():
        if not line.startswith("data:") or broken or math.isfinite(done):
            continue
        data = line[5:].strip()
        if data == DONE:
            done = now()
            continue
        try:
            event = json.loads(data)
        except ValueError:
            broken = f"an event that is not JSON: {data[:120]!r}"
            continue
        if not isinstance(event, dict) or "error" in event:
            broken = f"an error event: {str(event)[:200]}"
            continue
        text = _text_of(event)
        if text and math.isnan(first):
            first = now()
        pieces.append(text)
        usage = event.get("usage") or usage
        qlab = event.get("qlab") or qlab
    end = now()
    if broken or math.isnan(done):
        why = broken or f"the stream ended before data: {DONE}"
        return Streamed(200, None, None, end, first, error=f"broken stream: {why}")
    return Streamed(200, answer_body("".join(pieces), usage, qlab), None, done, first)

