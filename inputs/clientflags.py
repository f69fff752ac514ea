"""The client options (patience and retries) of ``qlab simulate`` and ``qlab replay``, and their
TOML tables.

One list, :data:`RETRY_FLAGS`, names each :class:`qsim.clients.RetryPolicy` field's flag and help;
the flags, the TOML tables and the checks are all made from it and from the dataclass, so a new
setting is written once. A setting that makes no sense is one ValueError before anything runs (the
commands turn it into one line on stderr and exit 2).
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from qsim.clients import PATIENCE, PATIENCE_UNTIL, RETRY_AFTER, RETRY_MODES, Patience, RetryPolicy

from .tomlfiles import ConfigError, no_unknown_keys, typed_value

#: RetryPolicy field -> (flag, help).
RETRY_FLAGS: dict[str, tuple[str, str]] = {
    "mode": (
        "--retry",
        "how clients send a refused request (503, 429) again: "
        f"{' | '.join(RETRY_MODES)} (default none)",
    ),
    "delay_s": (
        "--retry-delay",
        "seconds before a fixed retry; the first delay of an exponential one (default 1)",
    ),
    "cap_s": ("--retry-cap", "the most seconds an exponential backoff waits (default 30)"),
    "jitter": (
        "--retry-jitter",
        "0..1: each delay d becomes a uniform in [d (1 - J), d]; 1 is full jitter (default 0)",
    ),
    "retry_after": (
        "--retry-after",
        f"{' | '.join(RETRY_AFTER)} the server's Retry-After (default honour)",
    ),
    "retry_after_jitter": (
        "--retry-after-jitter",
        "honoured Retry-After R becomes a uniform in [R, R (1 + J)] (default 0)",
    ),
    "max_attempts": (
        "--retry-max-attempts",
        "attempts per request, the first included (default 3)",
    ),
    "budget": (
        "--retry-budget",
        "retries at most this share (0..1) of recent first tries (default: no budget)",
    ),
    "budget_window_s": (
        "--retry-budget-window",
        "seconds of first tries the budget counts (default 10)",
    ),
    "budget_min_per_s": (
        "--retry-budget-min-per-s",
        "retries per second the budget always allows (default 0)",
    ),
    "on_connection_errors": (
        "--retry-connection-errors",
        "retry an attempt that got no answer (default yes)",
    ),
    "timeout_s": (
        "--retry-timeout",
        "seconds an attempt waits for its answer before the client "
        "hangs up and "
        "retries (default: no limit)",
    ),
}
_FIELDS = {f.name: f for f in fields(RetryPolicy)}
assert set(RETRY_FLAGS) == set(_FIELDS), "every RetryPolicy field has its flag"


def _kind(name: str) -> tuple[type, ...]:
    """The TOML types of a field, from its default (None: a float that may be left out)."""
    default = _FIELDS[name].default
    if default is None:
        return (float,)
    return (type(default),)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The patience and retry flags, in a group of their own."""
    group = parser.add_argument_group("clients: patience and retries")
    group.add_argument(
        "--patience",
        metavar="SPEC",
        help="how long each client waits from its first send: "
        f"{' | '.join(PATIENCE)} (default none)",
    )
    group.add_argument(
        "--patience-until",
        choices=PATIENCE_UNTIL,
        help="what the patience waits for: the whole answer, or its start (default answer)",
    )
    for name, (flag, help_) in RETRY_FLAGS.items():
        kind = _kind(name)[0]
        if kind is bool:
            group.add_argument(
                flag,
                dest=f"retry_{name}",
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_,
            )
        elif kind is str:
            choices = RETRY_MODES if name == "mode" else RETRY_AFTER
            group.add_argument(
                flag, dest=f"retry_{name}", choices=choices, default=None, help=help_
            )
        else:
            group.add_argument(
                flag,
                dest=f"retry_{name}",
                type=_number(kind),
                default=None,
                metavar="N",
                help=help_,
            )


def _number(kind: type):
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"value must be a {kind.__name__}, got {text!r}"
            ) from None

    return parse


def from_args(args: argparse.Namespace) -> tuple[Patience | None, RetryPolicy | None]:
    """The patience (None: the trace's own) and retry policy (None: never) the flags describe."""
    patience = None
    if args.patience is not None:
        patience = Patience.parse(args.patience, args.patience_until or "answer")
    elif args.patience_until is not None:
        raise ValueError("--patience-until needs --patience")
    return patience, _retry(retry_table(args), lambda name: RETRY_FLAGS[name][0])


def retry_table(args: argparse.Namespace) -> dict:
    """The retry flags given, as a retry table (RetryPolicy's field -> value): what
    :func:`retry_from_table` reads."""
    return {
        name: getattr(args, f"retry_{name}")
        for name in RETRY_FLAGS
        if getattr(args, f"retry_{name}") is not None
    }


def _retry(given: dict, label) -> RetryPolicy | None:
    if not given:
        return None
    if given.get("mode", "none") == "none" and set(given) - {"mode"}:
        raise ValueError(
            f"{label(sorted(set(given) - {'mode'})[0])} needs a retry mode "
            f"({label('mode')} "
            f"{' | '.join(m for m in RETRY_MODES if m != 'none')})"
        )
    return RetryPolicy.from_table(given)


def retry_from_table(where: str, table) -> RetryPolicy:
    """A config file's retry table (keys: RetryPolicy's fields); ConfigError naming ``where``."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table of retry settings")
    no_unknown_keys(where, table, RETRY_FLAGS, "retry setting")
    values = {
        k: typed_value(f"{where}.{k}", v, _kind(k) if k != "max_attempts" else (int,))
        for k, v in table.items()
    }
    try:
        return _retry(values, lambda name: f"{where}.{name}") or RetryPolicy()
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def patience_from_table(where: str, spec, until="answer") -> Patience:
    """A config file's patience: a spec string (see :data:`qsim.clients.PATIENCE`) and what it
    waits for."""
    spec = typed_value(where, spec, str)
    until = typed_value(f"{where}_until", until, str)
    try:
        return Patience.parse(spec, until)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
