"""The ``qlab live`` file: servers, optional calibration, probes and traces, read from TOML into
frozen dataclasses.

```toml
[server]                 # all optional; every option of `qlab serve` is a key (underscores for
                         dashes, e.g. # noise, stall_factor, fail_every) except policy, host, port,
                         log_level, # watch_stdin
engine = "synthetic"     # synthetic | gpt2
model = "random"         # gpt2 only: gpt2 | random | tiny | a local path
device = "auto"          # auto | cpu | cuda
engines = 1              # K engines behind each server's queue
speed = 1.0              # synthetic only: service times SPEED x the model
service_model = ""       # JSON from qlab calibrate (relative to this file); "" = the default line
fixed_estimate = false   # true: the gates do not track speed
policies = ["none", "bounded", "bounded-deadline", "predictive"]   # not a serve option: one server
per policy
                         # (presets or module:Class, as in --policy)
startup_timeout_s = 180  # not a serve option: how long a server may take to start

[policy_args.codel]      # optional: parameters of a policy in `policies` (its --policy-arg pairs)
codel_target_s = 0.2

[calibrate]              # optional: calibrate first (its own server, policy none); the fit is used
                         everywhere
rounds = 2
per_size = 12
# engine_metrics = "http://127.0.0.1:8000"  # a vLLM upstream: fit its steps to its own /metrics

[probe]                  # a speed probe before and after every run
requests = 5
max_new_tokens = 16

[replay]
timeout_s = 300
prompt_words = 16
# context_tokens = 1024  # optional, as qlab replay's --context-tokens: each prompt capped at it
# minus the request's
                         # new tokens (absent: each server's /healthz says, else no cap)
patience = "none"        # optional: how long each client waits from its first send
                         (qsim.clients.Patience: # exponential:MEAN_S, deterministic:SECONDS,
                         lognormal:MEAN_S:CV, column)
patience_until = "answer"  # the whole answer (start is the simulator's alone: a client cannot see
                           it)
api = "qlab"             # qlab (/v1/generate) or openai (streamed /v1/completions: the runs record
                         TTFT)

[retry]                  # optional: how clients send a refused request again
                         (qsim.clients.RetryPolicy's fields,
mode = "exponential"     # as qlab replay's --retry-* flags); none by default
jitter = 1.0
max_attempts = 3

[[trace]]                # one or more; nominal_load may be a list (one trace per value)
name = "poisson"
arrivals = "poisson"     # poisson | constant | gamma:CV | periodic:PERIOD_S, or burst:N |
                         periodic:N:PERIOD_S (no load)
nominal_load = [0.5, 1.0]  # arrival rate / the calibrated capacity of `engines` engines (the
                           summary
                         # adds effective_load = nominal x engine time / calibrated time); `load` is
                         # refused
# rate = [2.0, 4.0]      # or requests per second (synthetic arrivals; a list: one trace per value),
                         # turned into the nominal load that sends it once the server is calibrated
seconds = 40             # or requests = N (a burst needs neither)
seed = 1
# file = "trace.csv"     # a trace file instead (arrivals then unused); time_scale = 1.0. As qlab
# replay's --trace
                         # with --start/--seconds/--nominal-load: start = S and seconds = N take the
                         # requests arriving in [S, S+N) of the file, and nominal_load scales that
                         # window's times to that load (qsim.tracefiles.TraceWindow); requests, and
                         # nominal_load beside time_scale, are refused
```
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from inputs.clientflags import patience_from_table, retry_from_table
from inputs.policyflags import args_tables
from inputs.tomlfiles import ConfigError, no_unknown_keys, positive_value, read_toml, typed_value
from qsim import PRESETS
from qsim.clients import Patience, RetryPolicy
from qsim.policy import resolve
from qsim.tracefiles import TraceWindow, WindowNames
from qsim.arrivals import arrivals_take_load, check_load, parse_arrivals

from .replay_config import APIS
from .serve_options import ServeOptions
from .tokenizer import MIN_CONTEXT_TOKENS

#: The serve options (see :mod:`live.serve_options`), and two keys that are not: one server per
#: policy, and how long each may take to start.
SERVER_KEYS = {**ServeOptions.toml_kinds(), "policies": list, "startup_timeout_s": float}
CALIBRATE_KEYS = {"rounds": int, "per_size": int, "engine_metrics": str}
PROBE_KEYS = {"requests": int, "max_new_tokens": int}
REPLAY_KEYS = {
    "timeout_s": float,
    "prompt_words": int,
    "context_tokens": int,
    "patience": str,
    "patience_until": str,
    "api": str,
}
TRACE_KEYS = {
    "name": str,
    "arrivals": str,
    "nominal_load": (float, list),
    "seconds": float,
    "requests": int,
    "seed": int,
    "file": str,
    "time_scale": float,
    "start": float,
    "rate": (float, list),
}
#: A [[trace]]'s keys under the names a trace window's refusals use.
WINDOW_KEYS = WindowNames(
    trace="file",
    start="start",
    seconds="seconds",
    requests="requests",
    load="nominal_load",
    time_scale="time_scale",
)
#: Keys that were renamed: an old file is refused with the new name rather than run with another
#: meaning.
RENAMED_TRACE_KEYS = {
    "load": (
        "nominal_load",
        "a live trace's rate is relative to the calibrated "
        "capacity; "
        "`load` means utilisation at the simulated speed",
    )
}
SECTIONS = {"server", "calibrate", "probe", "replay", "trace", "policy_args", "retry"}
#: A trace's arrival window when it gives neither seconds nor requests (``qlab replay``'s default
#: too).
DEFAULT_SECONDS = 40.0
#: A trace's nominal load when it gives none and its arrivals take one (``qlab replay``'s default
#: too).
DEFAULT_NOMINAL_LOAD = 1.0


@dataclass(frozen=True)
class CalibrateConfig:
    rounds: int = 2
    per_size: int = 12
    # A batching upstream's own counters (vLLM's base URL), as qlab calibrate --engine-metrics.
    engine_metrics: str | None = None


@dataclass(frozen=True)
class ProbeConfig:
    requests: int = 5
    max_new_tokens: int = 16


@dataclass(frozen=True)
class ReplaySettings:
    timeout_s: float = 300.0
    prompt_words: int = 16
    # the model's context, as --context-tokens (None: each server's /healthz)
    context_tokens: int | None = None
    # a qsim.clients.Patience spec: how long each client waits from its first send
    patience: str = "none"
    patience_until: str = "answer"
    # as qlab replay's --api: qlab (/v1/generate) or openai (streamed /v1/completions)
    api: str = "qlab"

    @property
    def clients_patience(self) -> Patience | None:
        """The traces' patience (None: the trace's own, i.e. a trace file's patience_s column, if
        any)."""
        return (
            None if self.patience == "none" else Patience.parse(self.patience, self.patience_until)
        )


@dataclass(frozen=True)
class TraceSpec:
    """One trace of the experiment; exactly one of (arrivals with nominal_load) or file (with,
    optionally, a window: start, seconds and nominal_load, as qlab replay's --start, --seconds and
    --nominal-load beside --trace)."""

    name: str
    arrivals: str = "poisson"
    # arrival rate over the calibrated capacity (make_trace's load at speed 1)
    nominal_load: float = DEFAULT_NOMINAL_LOAD
    seconds: float | None = None
    requests: int | None = None
    seed: int = 1
    file: str | None = None
    time_scale: float = 1.0
    start: float | None = None
    file_load: bool = False  # a file's nominal_load was given: its window is scaled to it
    # requests per second in place of nominal_load (resolved_rate sets that)
    rate: float | None = None

    @property
    def load(self) -> float | None:
        """The nominal load the trace is built at: None for a burst of its own size, or a trace file
        whose rate is its own (no load)."""
        if self.file:
            return self.nominal_load if self.file_load else None
        return self.nominal_load if arrivals_take_load(self.arrivals) else None

    @property
    def window(self) -> TraceWindow | None:
        """A trace file's window (None: synthetic arrivals)."""
        if not self.file:
            return None
        return TraceWindow.asked(
            self.start,
            self.seconds,
            self.load,
            requests=self.requests,
            time_scale=self.time_scale,
            names=WINDOW_KEYS,
        )


@dataclass(frozen=True)
class LiveConfig:
    server: ServeOptions  # every server's options but its policy
    calibrate: CalibrateConfig | None
    probe: ProbeConfig
    replay: ReplaySettings
    traces: tuple[TraceSpec, ...]
    policies: tuple[str, ...] = tuple(PRESETS)  # one server each
    startup_timeout_s: float = 180.0
    source: str = ""
    policy_args: dict = field(default_factory=dict)  # policy -> its parameters ([policy_args.NAME])
    # [retry]: how the clients send a refused request again (None: never)
    retry: RetryPolicy | None = None

    def serve_options(self, policy: str, **changes) -> ServeOptions:
        """The options of the server for ``policy``: the [server] table's, that policy and its
        parameters."""
        pairs = ",".join(f"{k}={v}" for k, v in self.policy_args.get(policy, {}).items())
        return replace(self.server, policy=policy, policy_arg=pairs, **changes)


def _fail(where: str, message: str):
    raise ConfigError(f"{where}: {message}")


def _table(path: str, data: dict, name: str, keys: dict) -> dict:
    table = data.get(name, {})
    if not isinstance(table, dict):
        _fail(f"{path}: [{name}]", "must be a table")
    no_unknown_keys(f"{path}: [{name}]", table, keys)
    return {k: typed_value(f"{path}: {name}.{k}", v, keys[k]) for k, v in table.items()}


def _server(path: str, data: dict) -> tuple[ServeOptions, dict]:
    """The [server] table: the serve options, and the keys that are not serve options
    (LiveConfig's fields)."""
    s = _table(path, data, "server", SERVER_KEYS)
    extra = {k: s.pop(k) for k in ("policies", "startup_timeout_s") if k in s}
    if "policies" in extra:
        policies = tuple(
            typed_value(f"{path}: server.policies[{i}]", p, str)
            for i, p in enumerate(extra["policies"])
        )
        if not policies or len(set(policies)) != len(policies):
            _fail(f"{path}: server.policies", f"need distinct policies, got {list(policies)}")
        for i, p in enumerate(policies):
            try:
                resolve(p)
            except ValueError as exc:
                _fail(f"{path}: server.policies[{i}]", str(exc))
        extra["policies"] = policies
    if "startup_timeout_s" in extra:
        positive_value(f"{path}: server.startup_timeout_s", extra["startup_timeout_s"])
    options = ServeOptions.from_table(f"{path}: server", s)
    if options.service_model and not (Path(path).parent / options.service_model).is_file():
        _fail(
            f"{path}: server.service_model",
            f"no such file {options.service_model!r} (relative to the config file)",
        )
    return options, extra


def _rates(where: str, t: dict) -> list[float]:
    """A [[trace]]'s rate (requests per second), taken out of ``t``: a list of them, or none."""
    if "rate" not in t:
        return []
    rates = t.pop("rate")
    rates = rates if isinstance(rates, list) else [rates]
    if not rates:
        _fail(f"{where}.rate", "empty list")
    rates = [typed_value(f"{where}.rate", v, float) for v in rates]
    for v in rates:
        positive_value(f"{where}.rate", v)
    if "nominal_load" in t or "file" in t:
        _fail(
            f"{where}.rate",
            "a rate sets synthetic arrivals' rate: give rate or nominal_load, and no file",
        )
    return rates


def _traces(path: str, data: dict) -> tuple[TraceSpec, ...]:
    entries = data.get("trace")
    if not isinstance(entries, list) or not entries:
        _fail(path, "needs at least one [[trace]]")
    out: list[TraceSpec] = []
    for i, entry in enumerate(entries):
        where = f"{path}: trace[{i}]"
        for old, (new, why) in RENAMED_TRACE_KEYS.items():
            if isinstance(entry, dict) and old in entry:
                _fail(f"{where}.{old}", f"renamed {new} ({why})")
        t = _table(path, {f"trace[{i}]": entry}, f"trace[{i}]", TRACE_KEYS)
        name = t.pop("name", None) or _fail(where, "needs a name")
        rates = _rates(where, t)
        given = "nominal_load" in t
        loads = t.pop("nominal_load", DEFAULT_NOMINAL_LOAD)
        loads = (
            [typed_value(f"{where}.nominal_load", v, float) for v in loads]
            if isinstance(loads, list)
            else [loads]
        )
        if not loads:
            _fail(f"{where}.nominal_load", "empty list")
        for key in ("seconds", "requests", "time_scale"):
            if key in t:
                positive_value(f"{where}.{key}", t[key])
        for v in loads:
            positive_value(f"{where}.nominal_load", v)
        positive_value(f"{where}.seed", t.get("seed", 0), zero_ok=True)
        if "start" in t:
            positive_value(f"{where}.start", t["start"], zero_ok=True)
        if "file" in t:
            if not (Path(path).parent / t["file"]).is_file():
                _fail(
                    f"{where}.file",
                    f"no such trace file {t['file']!r} (relative to the config file)",
                )
            t["file_load"] = given
            try:
                # what a trace file cannot take
                TraceSpec(name=name, nominal_load=loads[0], **t).window
            except ValueError as exc:
                _fail(where, str(exc))
        elif "start" in t:
            _fail(f"{where}.start", "a window's start applies to a trace file (file = ...)")
        else:
            try:
                kind, _ = parse_arrivals(t.get("arrivals", "poisson"))
            except ValueError as exc:
                _fail(f"{where}.arrivals", str(exc))
            try:  # a burst of its own size would ignore a load
                check_load(t.get("arrivals", "poisson"), loads[0] if given else None)
            except ValueError as exc:
                _fail(f"{where}.nominal_load", str(exc))
            if kind != "burst" and ("seconds" in t) == ("requests" in t):
                _fail(where, "give exactly one of seconds and requests")
        if rates:
            out.extend(
                TraceSpec(name=f"{name}-rate{r:g}" if len(rates) > 1 else name, rate=r, **t)
                for r in rates
            )
            continue
        for nominal in loads:
            suffix = f"-nominal{nominal:g}" if len(loads) > 1 else ""
            out.append(TraceSpec(name=f"{name}{suffix}", nominal_load=nominal, **t))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        _fail(path, f"trace names must be distinct, got {names}")
    return tuple(out)


def parse(data: dict, path: str = "<live>") -> LiveConfig:
    """Check a parsed TOML document and build the config; ValueError names the file and key."""
    no_unknown_keys(path, data, SECTIONS, what="section")
    calibrate = (
        CalibrateConfig(**_table(path, data, "calibrate", CALIBRATE_KEYS))
        if "calibrate" in data
        else None
    )
    probe = ProbeConfig(**_table(path, data, "probe", PROBE_KEYS))
    replay = ReplaySettings(**_table(path, data, "replay", REPLAY_KEYS))
    for where, cfg in (("calibrate", calibrate), ("probe", probe), ("replay", replay)):
        for key, value in (vars(cfg) if cfg else {}).items():
            if not isinstance(value, str) and value is not None:  # None: an optional key left out
                positive_value(f"{path}: {where}.{key}", value)
    if replay.context_tokens is not None and replay.context_tokens < MIN_CONTEXT_TOKENS:
        # Refused here, before any server starts, as ReplayConfig would refuse it at the first run.
        _fail(
            f"{path}: replay.context_tokens",
            f"must be >= {MIN_CONTEXT_TOKENS} (a prompt token "
            "and a new one), "
            f"got {replay.context_tokens}",
        )
    if replay.api not in APIS:
        _fail(f"{path}: replay.api", f"must be one of {', '.join(APIS)}, got {replay.api!r}")
    server, extra = _server(path, data)
    try:
        extra["policy_args"] = args_tables(
            data.get("policy_args", {}), extra.get("policies", LiveConfig.policies)
        )
    except ValueError as exc:
        _fail(path, str(exc))
    traces = _traces(path, data)
    _clients(path, data, replay, traces)
    if "retry" in data:
        extra["retry"] = retry_from_table(f"{path}: retry", data["retry"])
    return LiveConfig(server, calibrate, probe, replay, traces, **extra, source=path)


def _clients(path: str, data: dict, replay: ReplaySettings, traces: tuple[TraceSpec, ...]) -> None:
    """The [replay] patience: a spec the simulator reads too, waiting for the answer (a live client
    cannot see its request start), and 'column' only where every trace is a file (its patience_s
    column)."""
    where = f"{path}: replay.patience"
    if "patience_until" in data.get("replay", {}) and replay.patience == "none":
        _fail(f"{where}_until", "needs replay.patience")
    if replay.patience == "none":
        return
    patience = patience_from_table(where, replay.patience, replay.patience_until)
    if patience.until == "start":
        _fail(
            f"{where}_until",
            "start is simulator-only: over plain HTTP a client cannot see its "
            "request start; "
            "use answer",
        )
    if patience.kind == "column" and any(t.file is None for t in traces):
        _fail(
            where,
            "'column' reads a trace file's patience_s column; every [[trace]] then needs a file",
        )


def load(path: str | Path) -> LiveConfig:
    return parse(read_toml(path), str(path))
