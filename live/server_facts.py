"""What a server says that its requests depend on (:class:`ServerFacts`): the tokenizer and the
engine's context (``GET /healthz``), the gate's caps on a prompt, its engines or batching engine
(``GET /stats``). Read leniently: a page that is not there, or not a qlab gate's, says nothing. The
calibrator (:mod:`live.calibrate`) and the replayer (:mod:`live.loadgen`) build prompts from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from qsim.engines import Batching, engine_from_fields

from .contract import EngineFacts, HealthFacts, Stats
from .tokenizer import ByteTokenizer, max_tokens_within, words_prompt

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ServerFacts:
    """What the server says that prompts depend on: its tokenizer's name, the engine's context
    (None: no limit of its own) and the gate's caps on a prompt (tokens, characters; None: not
    said); and its engines, which the load phase fills, or its batching engine (None: engines one at
    a time, or not said)."""

    tokenizer: str | None = None
    context: int | None = None
    max_prompt_tokens: int | None = None
    max_prompt_chars: int | None = None
    engines: int = 1
    batching: Batching | None = None
    # The vocabulary of token-id prompts, where the engine takes them (live.token_prompts); None:
    # text only.
    token_id_vocab: int | None = None

    def longest_prompt(self, new_tokens: int) -> float:
        """The most prompt tokens a request of ``new_tokens`` new tokens may bring (inf: no
        limit)."""
        caps = [float("inf")]
        if self.context is not None:
            caps.append(self.context - new_tokens)
        if self.max_prompt_tokens is not None:
            caps.append(self.max_prompt_tokens)
        if self.max_prompt_chars is not None:
            caps.append(max_tokens_within(self.max_prompt_chars, self.tokenizer))
        return min(caps)


def _positive_int(value) -> int | None:
    return (
        int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
    )


def server_facts(health: Any, stats: Any) -> ServerFacts:
    """Read ``GET /healthz``'s engine (tokenizer, context) and ``GET /stats``'s limits (parsed
    bodies, through
    :class:`live.contract.HealthFacts` and :class:`~live.contract.Stats`); a page that is not one
    (None: not there, or not a qlab gate's) says nothing."""
    engine = lenient(HealthFacts, health).engine or EngineFacts()
    said = lenient(Stats, stats)
    limits = said.limits
    return ServerFacts(
        engine.tokenizer,
        _positive_int(engine.context),
        _positive_int(limits.max_prompt_tokens),
        _positive_int(limits.max_prompt_chars),
        _positive_int(said.engines) or 1,
        _batching(said.server_config),
        _positive_int(engine.token_id_vocab),
    )


def _batching(server_config: dict | None) -> Batching | None:
    """The batching engine a gate's server config names (None: engines one at a time, or no config
    said); its engine alone is read (a policy of the server's own need not be known here)."""
    if server_config is None or "engine" not in server_config:
        return None
    try:
        engine = engine_from_fields(server_config["engine"])
    except ValueError:
        return None
    return engine if isinstance(engine, Batching) else None


def lenient(model: type[M], body: Any) -> M:
    """``body`` through ``model``; the model's defaults (nothing said) when it is not one."""
    try:
        return model() if body is None else model.model_validate(body)
    except ValueError:
        return model()


def read_facts(http: httpx.Client) -> ServerFacts:
    """:func:`server_facts` of the server behind ``http`` (a page that is not there says
    nothing)."""
    pages = []
    for path in ("/healthz", "/stats"):
        try:
            response = http.get(path)
            pages.append(response.json() if response.status_code == 200 else None)
        except (httpx.HTTPError, ValueError):
            pages.append(None)
    return server_facts(*pages)


def default_prompt_tokens(facts: ServerFacts, prompt_words: int) -> int:
    """How many of the server's tokens the replayer's default prompt of ``prompt_words`` words
    is."""
    text = words_prompt(prompt_words)
    return len(text.encode()) if facts.tokenizer == ByteTokenizer.name else prompt_words
