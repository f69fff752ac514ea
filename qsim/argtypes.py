"""Number types for the ``qlab`` command line, one set for every subcommand.

They live in qsim because it is the one package every other imports (live may
not import experiments). argparse calls each with the flag's text; a bad value
raises ArgumentTypeError, reported as one line: ``argument --load: value must
be > 0, got '-1'``.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable


def number(kind: type, low: float | None = None, strict: bool = True) -> Callable[[str], int | float]:
    """A parser of ``kind`` (int or float) that is finite and above ``low`` (or at least ``low`` if not strict)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"value must be a {kind.__name__}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"value must be finite, got {text!r}")
        if low is not None and (value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(f"value must be {'>' if strict else '>='} {low}, got {text!r}")
        return value

    return parse


positive = number(float, 0)
non_negative = number(float, 0, strict=False)
positive_int = number(int, 0)
count = number(int, 0, strict=False)


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: the system picks a free one)."""
    value = count(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {text!r}")
    return value
