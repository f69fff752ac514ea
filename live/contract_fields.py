"""The contract's building blocks (:mod:`live.contract`): the field types its bodies share
(:data:`Num`, :func:`integer`, :func:`stops`), what /openapi.json states beyond a type
(:class:`Published`, :class:`Only`, and :func:`unsupported`, the route's check of an
:class:`Only`), a server's caps on one request (:class:`Limits`), and the two model
configurations (strict requests, lenient answers).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

_STRICT = ConfigDict(extra="forbid", strict=True)
_OPEN = ConfigDict(extra="allow")
#: A number as the gate reports it: an int stays an int on the wire, non-finite floats go out as
#: null.
Num = float | int | None
OWNER = "qlab"


@dataclass(frozen=True)
class Limits:
    """Caps on one request; the engine's own limit on new tokens also applies."""

    max_new_tokens: int = 1024
    max_deadline_ms: int = 600_000
    max_prompt_chars: int = 16_384
    max_prompt_tokens: int = 16_384
    max_body_bytes: int = 64 * 1024
    max_stops: int = 8
    max_stop_chars: int = 64
    # An OpenAI request that names no max_tokens gets this many (None: the most whose calibrated
    # estimate fits its deadline, at most max_new_tokens; live.gate.Gate.fitting_tokens).
    default_max_tokens: int | None = None


def num(value: Num) -> float:
    """A reported number as a float; NaN where the server said null or nothing."""
    return math.nan if value is None else float(value)


def _integral(value):
    # JSON Schema's integer is any number without a fractional part (61.0 is one, and OpenAI's API
    # and vLLM take it): such a float is read as its int. Strict all the same: "61", 61.5 and true
    # stay refused.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds: int) -> Any:
    """An integer field's type, within pydantic's bounds (ge, le), that takes an integral float as
    its int."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


def token_ids(vocab: int | None = None) -> Any:
    """A prompt given as token ids: a list of at least one integer >= 0, below ``vocab`` where an
    engine's vocabulary is known (live.token_prompts)."""
    return Annotated[
        list[integer(ge=0, le=None if vocab is None else vocab - 1)], Field(min_length=1)
    ]


def with_token_ids(text: Any, vocab: int | None) -> Any:
    """A server's prompt type: ``text``, or token ids below ``vocab`` too where its engine takes
    them (None: it takes none, and its published schema says so)."""
    return text if vocab is None else text | token_ids(vocab)


def _stop_list(value):
    # One stop string may come bare; a union type would make the error messages name its branches.
    return [value] if isinstance(value, str) else value


def stops(max_items: int | None = None, max_chars: int | None = None) -> Any:
    """``stop``'s type: a list of strings, or one string read as a list of one; the schema says
    both (OpenAI's does)."""
    text = Annotated[str, StringConstraints(min_length=1, max_length=max_chars)]
    many = Annotated[list[text], Field(max_length=max_items)]
    return Annotated[many, BeforeValidator(_stop_list, json_schema_input_type=text | many)]


class Published:
    """Constraints /openapi.json states beyond a field's type, which the route checks itself
    (where it answers better than a 422: a 400 naming what is not supported, a 404 for a model
    not served)."""

    def __init__(self, **schema: Any) -> None:
        self.schema = schema

    def __get_pydantic_json_schema__(self, core_schema, handler) -> dict:
        return {**handler(core_schema), **self.schema}


class Only:
    """A field of OpenAI's of whose values the server honours only ``values`` (and null, leaving it
    out): /openapi.json lists just those, and the route refuses any other with 400
    ``unsupported_parameter`` saying ``why`` (:func:`unsupported`), as OpenAI-compatible servers
    refuse what they cannot do."""

    def __init__(self, *values: Any, why: str) -> None:
        self.values, self.why = values, why

    def __get_pydantic_json_schema__(self, core_schema, handler) -> dict:
        return {"enum": [*self.values, None]}


def unsupported(req: BaseModel) -> tuple[str, str] | None:
    """The first field given a value its :class:`Only` does not list: (its name, the message);
    None: none."""
    for name, only in _only_fields(type(req)):
        value = getattr(req, name)
        if value is not None and value not in only.values:
            return name, f"{name}: {only.why}, not {json.dumps(value)[:80]}"
    return None


@functools.cache
def _only_fields(model: type[BaseModel]) -> tuple[tuple[str, Only], ...]:
    return tuple(
        (name, m)
        for name, field in model.model_fields.items()
        for m in field.metadata
        if isinstance(m, Only)
    )
