"""A sweep TOML's named tables and its [service] (:mod:`experiments.config`): [mixes.NAME],
[clients.SET], [retry.NAME], each checked and built into qsim's objects, and [service]'s line
inline or from a ``qlab calibrate`` file (:class:`CalibrationFile`)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from inputs.clientflags import retry_from_table
from inputs.run_axes import AXES
from inputs.tomlfiles import ConfigError, no_unknown_keys, positive_value, typed_value
from qsim import REFERENCE_MIX, Mix, ServiceModel
from qsim.clients import RetryPolicy
from qsim.service import LoadTerms
from qsim.mixes import Client, check_clients


def _key(name: str) -> str:
    """A TOML key as it would be written: bare when it can be, else quoted (so an error stays one
    line)."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


CLIENT_KEYS = {"share": float, "priority": int, "mix": str}
#: The client set of a cell whose requests name no client.
NO_CLIENTS = AXES["clients"].none
#: The retry policy of a cell whose clients never send a request again.
NO_RETRY = AXES["retry"].none


#: [service]'s inline keys: the calibrated line and the engines' concurrency term (else ``file``: a
#: calibration's).
SERVICE_KEYS = {
    "intercept_s": float,
    "per_token_s": float,
    "per_prompt_token_s": float,
    "concurrency": float,
}


@dataclass(frozen=True)
class CalibrationFile:
    """[service] file: a ``qlab calibrate`` JSON as read once, when the config is (so every
    executor's cells get the same terms): its line (:meth:`qsim.ServiceModel.load`) and what it
    measured under load (:meth:`qsim.service.LoadTerms.load`)."""

    file: str
    model: ServiceModel
    terms: LoadTerms

    @classmethod
    def read(cls, where: str, file: Path) -> "CalibrationFile":
        try:
            return cls(str(file), ServiceModel.load(file), LoadTerms.load(file))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def record(self) -> dict[str, Any]:
        """The file and its terms, as the manifest records them."""
        step = self.terms.step
        return {
            "file": self.file,
            "model": asdict(self.model),
            "load": {"concurrency": self.terms.concurrency, "noise_cv": self.terms.noise_cv},
            "step": None if step is None else asdict(step),
        }


def _client_dict(c: Client) -> dict:
    mix = None if c.mix is None else {"sizes": list(c.mix.sizes), "probs": list(c.mix.probs)}
    return {"name": c.name, "share": c.share, "priority": c.priority, "mix": mix}


def _named(
    path: str, table: Any, section: str, what: str, builtin: tuple[str, str], build
) -> dict[str, Any]:
    """[SECTION.NAME] tables, each built by ``build(where, spec)``; ``builtin``: the name of the
    axis's built-in value, which no table may take, and what it is."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [{section}] must be a table of named {what}")
    out = {}
    for name, spec in table.items():
        where = f"{path}: {section}.{_key(name)}"
        if name == builtin[0]:
            raise ConfigError(
                f"{where}: {builtin[0]!r} is the built-in {builtin[1]}; choose another name"
            )
        out[name] = build(where, spec)
    return out


def _client_set(where: str, members: Any, mixes: dict[str, Mix]) -> tuple[Client, ...]:
    """One [clients.SET] table: each key a client, each value its share, priority and mix name."""
    if not isinstance(members, dict) or not members:
        raise ConfigError(f"{where}: expected a table of clients, e.g. heavy = {{ share = 0.8 }}")
    built = []
    for name, spec in members.items():
        here = f"{where}.{_key(name)}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{here}: expected a table with share (and optionally priority, mix)")
        no_unknown_keys(here, spec, CLIENT_KEYS)
        if "share" not in spec:
            raise ConfigError(f"{here}: share is required")
        v = {k: typed_value(f"{here}.{k}", x, CLIENT_KEYS[k]) for k, x in spec.items()}
        if "mix" in v and v["mix"] not in mixes:
            raise ConfigError(
                f"{here}.mix: unknown mix {v['mix']!r}; define it under [mixes.{_key(v['mix'])}]"
            )
        try:
            built.append(
                Client(
                    name, v["share"], v.get("priority", 0), mixes[v["mix"]] if "mix" in v else None
                )
            )
        except ValueError as exc:
            raise ConfigError(f"{here}: {exc}") from None
    try:
        check_clients(tuple(built))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return tuple(built)


def _clients(path: str, table: Any, mixes: dict[str, Mix]) -> dict[str, tuple[Client, ...]]:
    """[clients.SET] tables."""
    return _named(
        path,
        table,
        "clients",
        "client sets",
        (NO_CLIENTS, "set of no clients"),
        lambda where, spec: _client_set(where, spec, mixes),
    )


def _retries(path: str, table: Any) -> dict[str, RetryPolicy]:
    """[retry.NAME] tables: each a RetryPolicy's fields, checked as ``qlab simulate``'s --retry-*
    flags are."""
    return _named(
        path, table, "retry", "retry policies", (NO_RETRY, "policy of no retries"), retry_from_table
    )


def _mixes(path: str, table: Any) -> dict[str, Mix]:
    mixes = {"reference": REFERENCE_MIX}
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [mixes] must be a table of named mixes")
    for name, spec in table.items():
        where = f"{path}: mixes.{_key(name)}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: expected a table with sizes and probs")
        no_unknown_keys(where, spec, {"sizes", "probs"})
        for key in ("sizes", "probs"):
            if not isinstance(spec.get(key, []), list):
                raise ConfigError(
                    f"{where}.{key}: expected a list, got {type(spec[key]).__name__} {spec[key]!r}"
                )
        try:
            sizes = tuple(typed_value(f"{where}.sizes", s, int) for s in spec.get("sizes", []))
            probs = tuple(typed_value(f"{where}.probs", p, float) for p in spec.get("probs", []))
            mixes[name] = Mix(sizes, probs)
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return mixes


def _service(path: str, table: Any) -> tuple[ServiceModel, float, CalibrationFile | None]:
    """[service]: the line and the concurrency term inline, or ``file``, a calibration (from the
    sweep file's folder)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [service] must be a table")
    no_unknown_keys(f"{path}: [service]", table, {*SERVICE_KEYS, "file"})
    if "file" in table:
        inline = sorted(set(table) - {"file"})
        if inline:
            raise ConfigError(
                f"{path}: service.file and service.{inline[0]} exclude each other: "
                "the calibration "
                "file holds the line and its load terms; give the file or the keys"
            )
        file = typed_value(f"{path}: service.file", table["file"], str)
        calibration = CalibrationFile.read(f"{path}: service.file", Path(path).parent / file)
        return calibration.model, calibration.terms.concurrency, calibration
    values = {k: typed_value(f"{path}: service.{k}", v, SERVICE_KEYS[k]) for k, v in table.items()}
    concurrency = values.pop("concurrency", 0.0)
    positive_value(f"{path}: service.concurrency", concurrency, zero_ok=True)
    try:
        return ServiceModel(**values), concurrency, None
    except ValueError as exc:
        raise ConfigError(f"{path}: [service]: {exc}") from None
