"""The ``qlab live`` file: servers, optional calibration, probes and traces, read from TOML into frozen dataclasses.

```toml
[server]                 # all optional
engine = "synthetic"     # synthetic | gpt2
model = "random"         # gpt2 only: gpt2 | random | tiny | a local path
device = "auto"          # auto | cpu | cuda
engines = 1              # K engines behind each server's queue
speed = 1.0              # synthetic only: service times SPEED x the model
service_model = ""       # JSON from qlab calibrate (relative to this file); "" = the default line
fixed_estimate = false   # true: the gates do not track speed
policies = ["none", "bounded", "bounded-deadline", "predictive"]
startup_timeout_s = 180

[calibrate]              # optional: calibrate first (its own server, policy none); the fit is used everywhere
rounds = 2
per_size = 12

[probe]                  # a speed probe before and after every run
requests = 5
max_new_tokens = 16

[replay]
timeout_s = 300
prompt_words = 16

[[trace]]                # one or more; load may be a list (one trace per load)
name = "poisson"
arrivals = "poisson"     # poisson | constant | gamma:CV | burst:N | periodic:N:PERIOD_S
load = [0.5, 1.0]        # nominal: relative to the calibrated capacity of `engines` engines
seconds = 40             # or requests = N (a burst needs neither)
seed = 1
# file = "trace.csv"     # a trace file instead (arrivals/load/seconds then unused); time_scale = 1.0
```
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qsim import PRESETS
from qsim.files import ConfigError, no_unknown_keys, positive_value, read_toml, typed_value
from qsim.workload import parse_arrivals

SERVER_KEYS = {"engine": str, "model": str, "device": str, "engines": int, "speed": float, "service_model": str,
               "fixed_estimate": bool, "policies": list, "startup_timeout_s": float}
CALIBRATE_KEYS = {"rounds": int, "per_size": int}
PROBE_KEYS = {"requests": int, "max_new_tokens": int}
REPLAY_KEYS = {"timeout_s": float, "prompt_words": int}
TRACE_KEYS = {"name": str, "arrivals": str, "load": (float, list), "seconds": float, "requests": int, "seed": int,
              "file": str, "time_scale": float}
SECTIONS = {"server", "calibrate", "probe", "replay", "trace"}


@dataclass(frozen=True)
class ServerConfig:
    engine: str = "synthetic"
    model: str = "random"
    device: str = "auto"
    engines: int = 1
    speed: float = 1.0
    service_model: str = ""
    fixed_estimate: bool = False
    policies: tuple[str, ...] = tuple(PRESETS)
    startup_timeout_s: float = 180.0


@dataclass(frozen=True)
class CalibrateConfig:
    rounds: int = 2
    per_size: int = 12


@dataclass(frozen=True)
class ProbeConfig:
    requests: int = 5
    max_new_tokens: int = 16


@dataclass(frozen=True)
class ReplaySettings:
    timeout_s: float = 300.0
    prompt_words: int = 16


@dataclass(frozen=True)
class TraceSpec:
    """One trace of the experiment; exactly one of (arrivals with load) or file."""

    name: str
    arrivals: str = "poisson"
    load: float = 1.0
    seconds: float | None = None
    requests: int | None = None
    seed: int = 1
    file: str | None = None
    time_scale: float = 1.0


@dataclass(frozen=True)
class LiveConfig:
    server: ServerConfig
    calibrate: CalibrateConfig | None
    probe: ProbeConfig
    replay: ReplaySettings
    traces: tuple[TraceSpec, ...]
    source: str = ""


def _fail(where: str, message: str):
    raise ConfigError(f"{where}: {message}")


def _table(path: str, data: dict, name: str, keys: dict) -> dict:
    table = data.get(name, {})
    if not isinstance(table, dict):
        _fail(f"{path}: [{name}]", "must be a table")
    no_unknown_keys(f"{path}: [{name}]", table, keys)
    return {k: typed_value(f"{path}: {name}.{k}", v, keys[k]) for k, v in table.items()}


def _server(path: str, data: dict) -> ServerConfig:
    s = _table(path, data, "server", SERVER_KEYS)
    if "policies" in s:
        policies = tuple(typed_value(f"{path}: server.policies[{i}]", p, str) for i, p in enumerate(s["policies"]))
        bad = [p for p in policies if p not in PRESETS]
        if bad or not policies or len(set(policies)) != len(policies):
            _fail(f"{path}: server.policies", f"need distinct names from {', '.join(PRESETS)}, got {list(policies)}")
        s["policies"] = policies
    cfg = ServerConfig(**s)
    if cfg.engine not in ("synthetic", "gpt2"):
        _fail(f"{path}: server.engine", f"must be synthetic or gpt2, got {cfg.engine!r}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        _fail(f"{path}: server.device", f"must be auto, cpu or cuda, got {cfg.device!r}")
    for key in ("engines", "speed", "startup_timeout_s"):
        positive_value(f"{path}: server.{key}", getattr(cfg, key))
    if cfg.service_model and not (Path(path).parent / cfg.service_model).is_file():
        _fail(f"{path}: server.service_model", f"no such file {cfg.service_model!r} (relative to the config file)")
    return cfg


def _traces(path: str, data: dict) -> tuple[TraceSpec, ...]:
    entries = data.get("trace")
    if not isinstance(entries, list) or not entries:
        _fail(path, "needs at least one [[trace]]")
    out: list[TraceSpec] = []
    for i, entry in enumerate(entries):
        t = _table(path, {f"trace[{i}]": entry}, f"trace[{i}]", TRACE_KEYS)
        where = f"{path}: trace[{i}]"
        name = t.pop("name", None) or _fail(where, "needs a name")
        loads = t.pop("load", 1.0)
        loads = [typed_value(f"{where}.load", v, float) for v in loads] if isinstance(loads, list) else [loads]
        if not loads:
            _fail(f"{where}.load", "empty list")
        for key in ("seconds", "requests", "time_scale"):
            if key in t:
                positive_value(f"{where}.{key}", t[key])
        for v in loads:
            positive_value(f"{where}.load", v)
        positive_value(f"{where}.seed", t.get("seed", 0), zero_ok=True)
        if "file" in t:
            if not (Path(path).parent / t["file"]).is_file():
                _fail(f"{where}.file", f"no such trace file {t['file']!r} (relative to the config file)")
        else:
            try:
                kind, _ = parse_arrivals(t.get("arrivals", "poisson"))
            except ValueError as exc:
                _fail(f"{where}.arrivals", str(exc))
            if kind != "burst" and ("seconds" in t) == ("requests" in t):
                _fail(where, "give exactly one of seconds and requests")
        for load in loads:
            suffix = f"-load{load:g}" if len(loads) > 1 else ""
            out.append(TraceSpec(name=f"{name}{suffix}", load=load, **t))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        _fail(path, f"trace names must be distinct, got {names}")
    return tuple(out)


def parse(data: dict, path: str = "<live>") -> LiveConfig:
    """Check a parsed TOML document and build the config; ValueError names the file and key."""
    no_unknown_keys(path, data, SECTIONS, what="section")
    calibrate = CalibrateConfig(**_table(path, data, "calibrate", CALIBRATE_KEYS)) if "calibrate" in data else None
    probe = ProbeConfig(**_table(path, data, "probe", PROBE_KEYS))
    replay = ReplaySettings(**_table(path, data, "replay", REPLAY_KEYS))
    for where, cfg in (("calibrate", calibrate), ("probe", probe), ("replay", replay)):
        for key, value in (vars(cfg) if cfg else {}).items():
            positive_value(f"{path}: {where}.{key}", value)
    return LiveConfig(_server(path, data), calibrate, probe, replay, _traces(path, data), source=path)


def load(path: str | Path) -> LiveConfig:
    return parse(read_toml(path), str(path))
