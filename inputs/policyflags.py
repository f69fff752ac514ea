"""The policy's options: ``--policy`` and ``--policy-arg`` of ``qlab simulate``, ``qlab serve`` and
``qlab capacity``, and a config file's ``[policy_args]`` table (sweeps and ``qlab live``).

What a policy is and how a name resolves to one are :mod:`qsim.policy`'s
(:func:`~qsim.policy.resolve`, :meth:`~qsim.policy.Policy.with_args`); here is only how a command
line or a TOML file names one, so that qsim reads neither.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from qsim.policy import Policy, resolve


def policy_spec(text: str) -> str:
    """argparse type of ``--policy``: a name :func:`~qsim.policy.resolve` knows (the text itself is
    kept)."""
    try:
        resolve(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def parse_args(pairs) -> dict[str, str]:
    """``["k=v", ...]`` (``--policy-arg``, repeatable; a pair may also hold several,
    comma-separated) -> dict."""
    out: dict[str, str] = {}
    for pair in pairs or ():
        for item in filter(None, (p.strip() for p in str(pair).split(","))):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"policy argument {item!r}: expected KEY=VALUE")
            out[key.strip()] = value.strip()
    return out


def from_options(
    spec: str, pairs=(), max_queue: int | None = None, deadline_s: float | None = None
) -> Policy:
    """The policy a command line names: ``--policy``, its ``--policy-arg`` pairs, then the
    ``--max-queue`` and ``--deadline`` overrides (the same for ``qlab simulate`` and
    ``qlab serve``)."""
    policy = resolve(spec, parse_args(pairs))
    return policy.with_overrides(max_queue=max_queue, deadline_s=deadline_s)


def args_tables(table: Any, policies) -> dict[str, dict]:
    """A config file's ``[policy_args]``: for each of ``policies`` that has one, a table of its
    parameters.

    ValueError naming the table (``policy_args.NAME: ...``) when a name is not among
    ``policies`` or a parameter is one the policy does not have or of the wrong type (sweeps and
    ``qlab live`` read it alike).
    """
    if not isinstance(table, dict):
        raise ValueError("[policy_args] must be a table of policies")
    out = {}
    for name, args in table.items():
        bare = name.replace("-", "").replace("_", "").isalnum()
        where = f"policy_args.{name if bare else json.dumps(name)}"
        if name not in policies:
            raise ValueError(
                f"{where}: {name!r} is not one of the file's policies ({', '.join(policies)})"
            )
        if not isinstance(args, dict):
            raise ValueError(f"{where}: expected a table of the policy's parameters")
        try:
            resolve(name, args)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        out[name] = dict(args)
    return out
