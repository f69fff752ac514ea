"""``qlab replay --import FILE``: another benchmark client's per-request results as a qlab run file.

A run made with guidellm, inference-perf or aiperf against a qlab gate becomes the run file ``qlab
replay`` would have written (:func:`live.rows.to_frame`, the same rows and columns), so ``qlab
compare --predict`` can say whether the simulator would have predicted it, and analysis.latency
reports its TTFT, ITL, TPOT and goodput by qlab's definitions. Each tool's file says, per request,
when it was sent and when its answer ended, its status, the first and last token's times, its
tokens and its prompt; the gate's configuration comes from its ``/stats`` (``--stats FILE``, saved
at the run's end, or ``--url`` of the gate still running). What a file does not say is missing, as
in a replay against a server that is not a qlab gate: the gate's own timings (NaN) unless the
answer carried them (inference-perf keeps the whole stream, and with it qlab's ``qlab`` part).

The files (as their tools write them):

* guidellm: ``--output kind=json``: ``benchmarks[].requests`` ``successful``, ``errored`` and
  ``incomplete``, each with ``request_args`` (the body), ``info.timings`` (``request_start``,
  ``first_token_iteration``, ``last_token_iteration``, ``request_end``; Unix seconds),
  ``output_metrics.text_tokens`` and ``info.error``;
* inference-perf: ``per_request_lifecycle_metrics.json``: ``start_time``, ``end_time``, ``request``
  (the body), ``response`` (the whole stream), ``info.response_metrics`` (``chunk_times``, else
  ``output_token_times``; ``response_chunks``, the text chunks; ``server_usage``) and ``error``;
* aiperf: ``profile_export.jsonl``: per line ``metadata`` (``request_start_ns``, ``request_end_ns``,
  ``was_cancelled``), ``metrics`` (``time_to_first_token``, ``inter_chunk_latency``,
  ``usage_completion_tokens``, ...) and ``error``; its ``inputs.json``, beside it, holds the bodies.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from qsim.service import ServiceModel
from qsim.trace import from_arrays

from .contract_clients import AnswerEvent, EventUsage
from .openai_replay import answer_body, refusal_body
from .rows import Exchange, ServerInfo, to_frame

TOOLS = ("guidellm", "inference-perf", "aiperf")


@dataclass(frozen=True)
class Sent:
    """One request of a tool's file, on its clock (seconds): what qlab's replayer would have
    recorded of it."""

    sent_s: float
    done_s: float
    status: int | None  # None: no answer (the transport failed, or the tool cut it off)
    body: Any  # an answer as /v1/generate's, or the error body
    max_new_tokens: int
    prompt_tokens: int
    first_token_s: float = math.nan
    last_token_s: float = math.nan
    pieces: int = 0
    error: str | None = None
    left: str | None = None  # the tool cut it off at its end (abandoned)
    ttft_slo_s: float = math.nan
    tpot_slo_s: float = math.nan


def _new_tokens(body: dict) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        if isinstance(body.get(key), int):
            return body[key]
    return -1


def _prompt_bytes(body: dict) -> int:
    """The prompt's length as the gate counts it (one token per UTF-8 byte): a prompt, or a
    chat's text parts."""
    if isinstance(body.get("prompt"), str):
        return len(body["prompt"].encode())
    parts = []
    for message in body.get("messages") or ():
        content = message.get("content")
        parts += (
            [content]
            if isinstance(content, str)
            else [p.get("text", "") for p in content or () if isinstance(p, dict)]
        )
    return len("\n".join(parts).encode())


def _status_in(text: str | None) -> int | None:
    match = re.search(r"\b([45]\d\d)\b", text or "")
    return int(match.group(1)) if match else None


def _envelope_in(text: str | None) -> Any:
    """The JSON error body a tool's error message carries (qlab's envelope), else None."""
    start = (text or "").find("{")
    if start < 0:
        return None
    try:
        return json.JSONDecoder().raw_decode(text[start:])[0]
    except ValueError:
        return None


def _answer(text: str, tokens: int | None) -> dict:
    return answer_body(
        text, EventUsage(completion_tokens=tokens) if tokens is not None else None, None
    )


# ---------------------------------------------------------------------- guidellm


def _guidellm(data: dict) -> list[Sent]:
    out = []
    for bench in data["benchmarks"]:
        for kind in ("successful", "errored", "incomplete"):
            for r in bench["requests"].get(kind) or ():
                t = r["info"]["timings"]
                body = _guidellm_body(r)
                start = t.get("request_start") or t.get("resolve_start")
                end = t.get("request_end") or t.get("resolve_end") or start
                tokens = (r.get("output_metrics") or {}).get("text_tokens")
                prompt = _prompt_bytes(body) or int(
                    (r.get("input_metrics") or {}).get("text_tokens") or 0
                )
                common = dict(
                    sent_s=start, done_s=end, max_new_tokens=_new_tokens(body), prompt_tokens=prompt
                )
                if kind == "successful":
                    first = t.get("first_token_iteration") or math.nan
                    last = t.get("last_token_iteration") or math.nan
                    out.append(
                        Sent(
                            status=200,
                            body=_answer(r.get("output") or "", tokens),
                            first_token_s=first,
                            last_token_s=last,
                            pieces=int(t.get("token_iterations") or 0),
                            **common,
                        )
                    )
                elif kind == "errored":
                    error = r["info"].get("error") or ""
                    status = _status_in(error)
                    envelope = _envelope_in(error)
                    out.append(
                        Sent(
                            status=status,
                            body=refusal_body(status, envelope) if status else None,
                            error=None if status else error[:300],
                            **common,
                        )
                    )
                else:
                    out.append(Sent(status=None, body=None, left="client_left", **common))
    return out


def _guidellm_body(r: dict) -> dict:
    args = r.get("request_args")
    args = json.loads(args) if isinstance(args, str) else (args or {})
    return args.get("body") or {}


# ---------------------------------------------------------------------- inference-perf


def _inference_perf(data: list) -> list[Sent]:
    out = []
    for r in data:
        body = (
            json.loads(r["request"])
            if isinstance(r.get("request"), str)
            else (r.get("request") or {})
        )
        common = dict(
            sent_s=r["start_time"],
            done_s=r["end_time"],
            max_new_tokens=_new_tokens(body),
            prompt_tokens=_prompt_bytes(body),
        )
        error = r.get("error")
        if error:
            message = error.get("error_msg") if isinstance(error, dict) else str(error)
            status = _status_in(error.get("error_type") if isinstance(error, dict) else message)
            out.append(
                Sent(
                    status=status,
                    body=refusal_body(status, _envelope_in(message)) if status else None,
                    error=None if status else str(message)[:300],
                    **common,
                )
            )
            continue
        metrics = (r.get("info") or {}).get("response_metrics") or {}
        # The whole stream where it kept it (with a qlab gate's last chunk, its qlab part), else its
        # text chunks.
        raw = (
            [line[5:].strip() for line in r["response"].splitlines() if line.startswith("data:")]
            if isinstance(r.get("response"), str)
            else metrics.get("response_chunks") or ()
        )
        chunks = [c for c in map(_event, raw) if c is not None]
        qlab = next((c.qlab for c in reversed(chunks) if c.qlab is not None), None)
        usage = (metrics.get("server_usage") or {}).get("completion_tokens")
        text = "".join(
            (
                "".join(
                    ch.text or (ch.delta.content if ch.delta else "") or ""
                    for ch in c.choices or ()
                )
            )
            for c in chunks
        )
        times = metrics.get("chunk_times") or metrics.get("output_token_times") or []
        answer = answer_body(
            text, EventUsage(completion_tokens=usage) if usage is not None else None, qlab
        )
        out.append(
            Sent(
                status=200,
                body=answer,
                first_token_s=times[0] if times else math.nan,
                last_token_s=times[-1] if times else math.nan,
                pieces=len(times),
                **common,
            )
        )
    return out


def _event(raw: str) -> AnswerEvent | None:
    try:
        return AnswerEvent.model_validate_json(raw)
    except ValueError:
        return None


# ---------------------------------------------------------------------- aiperf


def _aiperf(lines: list[dict], inputs: dict[str, dict]) -> list[Sent]:
    out = []
    for r in lines:
        meta, metrics = r.get("metadata") or {}, r.get("metrics") or {}
        body = inputs.get(meta.get("x_correlation_id"), inputs.get(meta.get("conversation_id"), {}))
        start = meta["request_start_ns"] / 1e9
        end = (meta.get("request_end_ns") or meta["request_start_ns"]) / 1e9
        common = dict(
            sent_s=start,
            done_s=end,
            max_new_tokens=_new_tokens(body),
            prompt_tokens=_prompt_bytes(body),
        )
        if meta.get("was_cancelled"):
            out.append(Sent(status=None, body=None, left="client_left", **common))
            continue
        error = r.get("error")
        if error:
            status = error.get("code") if isinstance(error, dict) else _status_in(str(error))
            message = error.get("message") if isinstance(error, dict) else str(error)
            out.append(
                Sent(
                    status=status,
                    body=refusal_body(status, _envelope_in(message)) if status else None,
                    error=None if status else str(message)[:300],
                    **common,
                )
            )
            continue

        def value(name: str, metrics=metrics):
            return (metrics.get(name) or {}).get("value")

        ttft_ms = value("time_to_first_token")
        gaps = value("inter_chunk_latency") or []
        first = start + ttft_ms / 1e3 if ttft_ms is not None else math.nan
        tokens = value("usage_completion_tokens")
        out.append(
            Sent(
                status=200,
                body=_answer("", None if tokens is None else int(tokens)),
                first_token_s=first,
                last_token_s=first + sum(gaps) / 1e3,
                pieces=len(gaps) + 1,
                **common,
            )
        )
    return out


def _aiperf_inputs(path: Path) -> dict[str, dict]:
    """aiperf's inputs.json: each session's request payloads, by session id."""
    inputs = path.parent / "inputs.json"
    if not inputs.exists():
        return {}
    data = json.loads(inputs.read_text())
    by_session = {}
    for session in data.get("data", ()):
        payloads = session.get("payloads") or []
        if payloads:
            by_session[session.get("session_id")] = payloads[0]
    return by_session


# ---------------------------------------------------------------------- reading a file


def read_tool_file(path: str | Path) -> tuple[str, list[Sent]]:
    """(the tool, its requests) of a result file; ValueError (one line) when it is none of the
    three."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({type(exc).__name__})") from None
    try:
        if path.suffix == ".jsonl":
            lines = [json.loads(line) for line in text.splitlines() if line.strip()]
            if lines and "metadata" in lines[0] and "metrics" in lines[0]:
                return "aiperf", _aiperf(lines, _aiperf_inputs(path))
        data = json.loads(text)
        if isinstance(data, dict) and "benchmarks" in data:
            return "guidellm", _guidellm(data)
        if (
            isinstance(data, list)
            and data
            and {"start_time", "end_time", "request"} <= set(data[0])
        ):
            return "inference-perf", _inference_perf(data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{path}: not a result file qlab reads ({type(exc).__name__}: {exc})"
        ) from None
    raise ValueError(
        f"{path}: not a result file qlab reads: guidellm's --output kind=json, "
        "inference-perf's "
        "per_request_lifecycle_metrics.json or aiperf's profile_export.jsonl"
    )


def to_run(sent: list[Sent], info: ServerInfo, model: ServiceModel, name: str) -> pd.DataFrame:
    """The requests as qlab's run file (:func:`live.rows.to_frame`), in their send order, on a clock
    whose 0 is the first send. A request whose body the tool did not keep (guidellm's errored ones)
    is given the size most of those it kept asked for."""
    sizes = [s.max_new_tokens for s in sent if s.max_new_tokens > 0]
    usual = max(set(sizes), key=sizes.count) if sizes else -1
    sent = sorted(
        (
            s if s.max_new_tokens > 0 else replace(s, max_new_tokens=usual)
            for s in sent
            if math.isfinite(s.sent_s)
        ),
        key=lambda s: s.sent_s,
    )
    sent = [s for s in sent if s.max_new_tokens > 0]
    if not sent:
        raise ValueError("the file holds no request qlab can read")
    zero = sent[0].sent_s
    at = np.array([s.sent_s - zero for s in sent])
    trace = from_arrays(at, [s.max_new_tokens for s in sent], model=model, name=name)
    exchanges = [
        Exchange(
            t,
            t,
            s.done_s - zero,
            s.status,
            s.body,
            None,
            s.error,
            left=s.left,
            first_token_s=s.first_token_s - zero,
            last_token_s=s.last_token_s - zero,
            pieces=s.pieces,
        )
        for t, s in zip(at, sent)
    ]
    frame = to_frame(trace, exchanges, info, [s.prompt_tokens for s in sent])
    frame["ttft_s"] = np.array([e.first_token_s - e.sent_s for e in exchanges], dtype=float)
    frame["last_token_s"] = np.array([e.last_token_s - e.sent_s for e in exchanges], dtype=float)
    frame["pieces"] = np.array([e.pieces for e in exchanges], dtype=np.int64)
    frame["ttft_slo_s"] = np.array([s.ttft_slo_s for s in sent], dtype=float)
    frame["tpot_slo_s"] = np.array([s.tpot_slo_s for s in sent], dtype=float)
    frame.attrs["qlab_run"] = {"imported": name, "duration_s": float(at.max()) if at.size else 0.0}
    return frame


#: What each tool's reader is (for tests and the docs).
READERS: dict[str, Callable] = {
    "guidellm": _guidellm,
    "inference-perf": _inference_perf,
    "aiperf": _aiperf,
}
