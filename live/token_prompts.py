"""A request's prompt as the routes read it: text, or token ids (``prompt: [int, ...]``, the form
OpenAI's schema and vLLM take) on ``POST /v1/generate`` and ``POST /v1/completions``.

Token ids go to an engine that declares their vocabulary (``Abilities.token_id_vocab``: the
synthetic batching engine, whose prefix cache hashes them, ``qlab serve --batching
--prefix-caching``), each within its vocabulary; the prompt's tokens are then the ids' number.
Each server's published schema says so (:func:`live.contract_fields.with_token_ids`): a server
whose engine counts text only takes text (a list of ids is a 422 invalid_field there).
"""

from __future__ import annotations

from dataclasses import dataclass

from .contract_fields import Limits
from .envelope import InvalidRequest


@dataclass(frozen=True)
class Prompt:
    """What a Job takes of the prompt: its text ("" for token ids), its tokens (the engine's count
    of the text, or the ids' number) and its ids (None: text)."""

    text: str
    tokens: int
    ids: tuple[int, ...] | None = None


def read_prompt(given: str | list[int], engine, limits: Limits) -> Prompt:
    """The prompt, checked against the server's cap on a prompt's tokens (422 prompt_too_long).
    Token ids come already bounded: the server's schema takes them only where ``engine`` declares
    their vocabulary, and only below it (live.contract_fields.with_token_ids)."""
    if isinstance(given, str):
        prompt = Prompt(given, engine.count_tokens(given))
    else:
        prompt = Prompt("", len(given), tuple(given))
    if prompt.tokens > limits.max_prompt_tokens:
        raise InvalidRequest(
            422,
            "prompt_too_long",
            f"prompt: {prompt.tokens} tokens; the limit is {limits.max_prompt_tokens}",
        )
    return prompt
