"""Configuration files: TOML read and checked, with errors that name the file and the line or
key."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any


def read_toml(path: str | Path) -> dict:
    """A TOML file's tables; ValueError naming the file (and line) when it cannot be read or
    parsed."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:  # TOML is UTF-8; say where, as for any other syntax error
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"{path}: not valid TOML: not UTF-8 text ({exc.reason} at line {line})"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None


# -------------------------------------------------------------- checking a config's values


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the key."""


def typed_value(where: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    """One TOML value of ``kind`` (a type or a tuple of them): an int is a fine float; a bool is
    not a number."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ConfigError(
            f"{where}: expected {' or '.join(k.__name__ for k in kinds)}, "
            f"got {type(value).__name__} {value!r}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: must be finite, got {value!r}")
    return value


def no_unknown_keys(where: str, table: dict, known, what: str = "key") -> None:
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(
            f"{where}: unknown {what} {unknown[0]!r}; expected one of {', '.join(sorted(known))}"
        )


def positive_value(where: str, value, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{where}: must be {'>= 0' if zero_ok else '> 0'}, got {value!r}")
