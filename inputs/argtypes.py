"""Number types for the ``qlab`` command line, one set for every subcommand.

argparse calls each with the flag's text; a bad value raises
ArgumentTypeError, reported as one line: ``argument --load: value must be > 0,
got '-1'``. A :class:`Number` also checks a value read from a config file
(:meth:`Number.out_of_range`), so a flag and its TOML key share one bound.
"""

from __future__ import annotations

import argparse
import math


class Number:
    """A parser of ``kind`` (int or float) that is finite and above ``low`` (or at least ``low``
    if not strict)."""

    def __init__(self, kind: type, low: float | None = None, strict: bool = True) -> None:
        self.kind, self.low, self.strict = kind, low, strict

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"value must be a {self.kind.__name__}, got {text!r}"
            ) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"value must be finite, got {text!r}")
        if self.out_of_range(value):
            raise argparse.ArgumentTypeError(f"value {self.out_of_range(value)}, got {text!r}")
        return value

    def out_of_range(self, value: int | float) -> str | None:
        """'must be > 0' when ``value`` is past the bound, else None."""
        if self.low is not None and (value <= self.low if self.strict else value < self.low):
            return f"must be {'>' if self.strict else '>='} {self.low:g}"
        return None


def number(kind: type, low: float | None = None, strict: bool = True) -> Number:
    return Number(kind, low, strict)


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


def renamed(new: str, why: str = "") -> type[argparse.Action]:
    """The action of a flag that was renamed: giving it is refused in one line that names ``new``.

    Hidden from --help; takes an optional value so that ``--old 1.5`` and ``--old`` both get the
    message rather than a generic complaint about the value.
    """

    class Renamed(argparse.Action):
        def __init__(self, option_strings, dest, **kwargs):
            super().__init__(
                option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS
            )

        def __call__(self, parser, namespace, values, option_string=None):
            raise argparse.ArgumentError(self, f"renamed {new}" + (f": {why}" if why else ""))

    return Renamed


def replica_speeds(text: str | None) -> tuple | None:
    """--replica-speeds 1,1,0.5 as numbers (qsim.fleet.FleetSpec checks them; None: not given)."""
    return _per_replica(text, "--replica-speeds", float, "numbers, e.g. 1,1,0.5")


def replica_kv_blocks(text: str | None) -> tuple | None:
    """--replica-kv-blocks 800,800,400 as whole numbers (qsim.fleet.FleetSpec checks them; None:
    not given)."""
    return _per_replica(text, "--replica-kv-blocks", int, "whole numbers, e.g. 800,800,400")


def _per_replica(text: str | None, flag: str, kind: type, expected: str) -> tuple | None:
    """One value of ``kind`` per replica, comma-separated (None: not given)."""
    if text is None:
        return None
    try:
        return tuple(kind(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"bad {flag} {text!r}: expected {expected}") from None


def replica_down(text: str, flag: str = "--replica-down") -> tuple:
    """--replica-down R:FROM:TO as (replica, from_s, to_s) (qsim.fleet.FleetSpec checks them)."""
    try:
        r, down_s, up_s = text.split(":")
        return int(r), float(down_s), float(up_s)
    except ValueError:
        raise ValueError(
            f"bad {flag} {text!r}: expected REPLICA:FROM_S:TO_S, e.g. 1:100:200"
        ) from None


def replica_drain(text: str) -> tuple:
    """--replica-drain R:FROM:TO, the same window as :func:`replica_down`'s."""
    return replica_down(text, "--replica-drain")


def replica_downs(text: str | None) -> tuple:
    """--replica-down given once or more (kept joined by commas), each as :func:`replica_down`
    (none: not given)."""
    return () if text is None else tuple(map(replica_down, text.split(",")))


def replica_drains(text: str | None) -> tuple:
    """--replica-drain given once or more (kept joined by commas), each as :func:`replica_drain`
    (none: not given)."""
    return () if text is None else tuple(map(replica_drain, text.split(",")))
