"""``qlab live``: every trace under every policy, against resident live servers.

One ``qlab serve`` per policy runs for the whole experiment (started together,
so a model loads once per server, and a policy's server is already warm when
its turn comes). Traces run one after another; within trace i the policies go
in an order rotated by i, so no policy always runs first on a fresh machine or
last on a tired one. A speed probe before and after each run measures the
machine; the summary reports each run's effective load (nominal x measured speed).

Layout of OUT::

    calibration.json                  when the file asks to calibrate first
    runs/<trace>__<policy>.parquet    one row per request (``qlab replay``'s columns)
    summary.parquet                   one row per run
    logs/serve-<policy>.log           what each server said
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pandas as pd

from analysis import compare, metrics
from qsim import ServiceModel, Trace, load_trace, make_trace

from .calibrate import CalibrationConfig, calibrate, describe, probe
from .live_config import LiveConfig, TraceSpec
from .loadgen import ReplayConfig, lateness, replay
from .procs import ServeOptions, serving


def rotated(items: tuple[str, ...], k: int) -> list[str]:
    """``items`` starting at position k mod len: trace k's policy order."""
    k %= len(items)
    return list(items[k:] + items[:k])


def build_trace(spec: TraceSpec, model: ServiceModel, engines: int, base: Path) -> Trace:
    if spec.file:
        return load_trace(base / spec.file, spec.time_scale, model=model, seed=spec.seed)
    return make_trace(spec.arrivals, load=spec.load, engines=engines, seed=spec.seed, model=model,
                      **trace_length(spec.arrivals, spec.seconds, spec.requests))


def trace_length(arrivals: str, seconds: float | None, requests: int | None, default_s: float = 40.0) -> dict:
    """make_trace's length arguments; a burst's length is its size."""
    if arrivals.startswith("burst:"):
        return {"requests": int(float(arrivals.split(":")[1]))}
    return {"requests": requests} if requests else {"seconds": seconds or default_s}


def server_options(cfg: LiveConfig, service_model: str) -> list[ServeOptions]:
    s = cfg.server
    return [ServeOptions(policy=p, engine=s.engine, model=s.model, device=s.device, engines=s.engines, speed=s.speed,
                         service_model=service_model, fixed_estimate=s.fixed_estimate) for p in s.policies]


def run_calibration(cfg: LiveConfig, out: Path, log: Callable[[str], None]) -> str:
    """Calibrate on a server of its own (policy none: nothing refused) and return the JSON's path."""
    options = replace(server_options(cfg, "")[0], policy="none")
    with serving([options], out / "logs", cfg.server.startup_timeout_s, prefix="calibrate") as (server,):
        result = calibrate(CalibrationConfig(server.url, cfg.calibrate.rounds, cfg.calibrate.per_size,
                                             prompt_words=cfg.replay.prompt_words),
                           progress=lambda r: log(describe(r, f"calibration round {r.round}")))
    path = out / "calibration.json"
    result.save(path)
    log(describe(result.overall, "calibration, all rounds"))
    return str(path)


def summary_row(frame: pd.DataFrame, trace: Trace, spec: TraceSpec, policy: str, position: int,
                speeds: tuple[float, float]) -> dict:
    """One run: what ran, how fast the machine was, outcomes and goodput, send lateness, agreement with qsim."""
    versus = compare.compare(frame).summary
    in_run = versus["measured_speed"]
    probes = [s for s in speeds if math.isfinite(s)]
    speed = in_run if math.isfinite(in_run) else (sum(probes) / len(probes) if probes else math.nan)
    late = lateness(frame)
    # A burst or a trace file has no utilisation of its own: its load is not a number to report.
    nominal = math.nan if spec.file or spec.arrivals.startswith("burst:") else spec.load
    return {
        "trace": spec.name, "policy": policy, "position": position, "arrivals": spec.file or spec.arrivals,
        "nominal_load": nominal, "speed_before": speeds[0], "speed_in_run": in_run,
        "speed_after": speeds[1], "effective_load": nominal * speed,
        **metrics.summary(frame, trace.duration_s or None),
        "send_lateness_p99_s": late["p99_s"], "send_lateness_max_s": late["max_s"],
        "sim_disagreements": versus["disagreements"], "sim_disagreement_rate": versus["disagreement_rate"],
        "sim_latency_abs_error_p50_s": versus["latency_abs_error_p50_s"],
        "sim_latency_abs_error_p99_s": versus["latency_abs_error_p99_s"],
    }


def run(cfg: LiveConfig, out: str | Path, log: Callable[[str], None] = print) -> pd.DataFrame:
    """Run the experiment; write the runs and the summary under ``out``; return the summary."""
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    base = Path(cfg.source).parent
    model_path = str(base / cfg.server.service_model) if cfg.server.service_model else ""
    if cfg.calibrate:
        model_path = run_calibration(cfg, out, log)
    model = ServiceModel.load(model_path) if model_path else ServiceModel()
    traces = [(spec, build_trace(spec, model, cfg.server.engines, base)) for spec in cfg.traces]
    rows = []
    with serving(server_options(cfg, model_path), out / "logs", cfg.server.startup_timeout_s) as servers:
        url = {s.options.policy: s.url for s in servers}
        for k, (spec, trace) in enumerate(traces):
            for position, policy in enumerate(rotated(cfg.server.policies, k)):
                log(f"{spec.name} ({len(trace)} requests) under {policy} at {url[policy]}")
                frame, speeds = _one_run(cfg, model, url[policy], trace)
                frame.to_parquet(out / "runs" / f"{spec.name}__{policy}.parquet", index=False)
                rows.append(summary_row(frame, trace, spec, policy, position, speeds))
                _log_row(log, rows[-1])
    summary = pd.DataFrame(rows)
    summary.to_parquet(out / "summary.parquet", index=False)
    return summary


def _one_run(cfg: LiveConfig, model: ServiceModel, url: str, trace: Trace) -> tuple[pd.DataFrame, tuple[float, float]]:
    p = cfg.probe
    before = probe(url, model, p.requests, p.max_new_tokens, cfg.replay.prompt_words)
    frame = replay(trace, ReplayConfig(url, timeout_s=cfg.replay.timeout_s, prompt_words=cfg.replay.prompt_words))
    after = probe(url, model, p.requests, p.max_new_tokens, cfg.replay.prompt_words)
    frame["speed_before"], frame["speed_after"] = before, after
    return frame, (before, after)


def _log_row(log: Callable[[str], None], row: dict) -> None:
    log(f"  speed {row['speed_before']:.3f} -> {row['speed_after']:.3f} (in run {row['speed_in_run']:.3f}), "
        f"effective load {row['effective_load']:.2f}; good {row['good']:.0f} late {row['late']:.0f} "
        f"rejected {row['rejected']:.0f} expired {row['expired']:.0f} error {row['error']:.0f}; "
        f"sim disagrees on {row['sim_disagreements']:.0f} ({row['sim_disagreement_rate']:.1%})")
