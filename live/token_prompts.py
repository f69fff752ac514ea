"""A request's prompt as the routes read it: text, or token ids (``prompt: [int, ...]``, the form
OpenAI's schema and vLLM take) on ``POST /v1/generate`` and ``POST /v1/completions``.

Token ids go to an engine that declares their vocabulary (``Abilities.token_id_vocab``: the
synthetic batching engine, whose prefix cache hashes them, ``qlab serve --batching
--prefix-caching``), each within its vocabulary; the prompt's tokens are then the ids' number. A
server whose engine counts text only refuses them (400 unsupported_parameter) rather than counting
them wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass

from .contract_fields import Limits
from .engine import abilities_of
from .envelope import InvalidRequest


@dataclass(frozen=True)
class Prompt:
    """What a Job takes of the prompt: its text ("" for token ids), its tokens (the engine's count
    of the text, or the ids' number) and its ids (None: text)."""

    text: str
    tokens: int
    ids: tuple[int, ...] | None = None


def read_prompt(given: str | list[int], engine, limits: Limits) -> Prompt:
    """The prompt, checked: token ids against ``engine`` (:func:`token_ids`), either against the
    server's cap on a prompt's tokens (422 prompt_too_long)."""
    if isinstance(given, str):
        prompt = Prompt(given, engine.count_tokens(given))
    else:
        ids = token_ids(given, engine)
        prompt = Prompt("", len(ids), ids)
    if prompt.tokens > limits.max_prompt_tokens:
        raise InvalidRequest(
            422,
            "prompt_too_long",
            f"prompt: {prompt.tokens} tokens; the limit is {limits.max_prompt_tokens}",
        )
    return prompt


def token_ids(given: list[int], engine) -> tuple[int, ...]:
    """``given`` as the prompt's ids: 400 unsupported_parameter where the engine takes no token
    ids, 422 invalid_prompt where the list is empty or an id is outside the engine's vocabulary
    (a negative or non-integral one never gets here: the body's schema refuses it, 422)."""
    vocab = abilities_of(engine).token_id_vocab
    if vocab is None:
        raise InvalidRequest(
            400,
            "unsupported_parameter",
            "prompt: token ids are taken by an engine that hashes them (qlab serve --batching, "
            "the synthetic engine); send text",
        )
    if not given:
        raise InvalidRequest(422, "invalid_prompt", "prompt: an empty list of token ids")
    outside = next((i for i in given if not 0 <= i < vocab), None)
    if outside is not None:
        raise InvalidRequest(
            422,
            "invalid_prompt",
            f"prompt: token id {outside} is outside the engine's vocabulary [0, {vocab})",
        )
    return tuple(given)
