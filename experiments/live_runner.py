"""``qlab live``: every trace under every policy, against resident live servers, each run compared
with the simulator (:mod:`analysis.compare`): an experiment, above both :mod:`live` and
:mod:`analysis`.

One ``qlab serve`` per policy runs for the whole experiment (started together,
so a model loads once per server, and a policy's server is already warm when
its turn comes). Traces run one after another; within trace i the policies go
in an order rotated by i, so no policy always runs first on a fresh machine or
last on a tired one. A speed probe before and after each run measures the
machine; the summary reports each run's effective load (nominal x total engine time over total
calibrated time of the served, ``speed_in_run``; the median ratio of one request's beside it,
``speed_in_run_median``).

Layout of OUT::

    live.json                         the experiment's config: a re-run must be of the same one
    calibration.json                  when the file asks to calibrate first
    runs/<trace>__<policy>.parquet    one row per request (``qlab replay``'s columns)
    summary.parquet                   one row per run
    logs/serve-<policy>.log           what each server said

Interruptions. Every file is written under a temporary name and renamed into
place (:mod:`inputs.atomic`), so a run's file exists only whole. Running the same
command again skips the runs whose files exist (their summary rows are
recomputed from the files), reuses the calibration, and starts servers only for
the policies that still have runs to do. SIGINT and SIGTERM end the run in
progress unwritten and stop the servers on the way out; a SIGKILL cannot be
caught, but the servers (``--watch-stdin``, see :mod:`live.procs`) stop when
the kernel closes their stdin pipe.
"""

from __future__ import annotations

import contextlib

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import pandas as pd

from analysis import compare, metrics
from analysis.replay_inputs import engine_time_ratio
from inputs.atomic import atomic_write, clear_temporaries, sigterm_interrupts, write_parquet
from qsim import ServiceModel, Trace, build_trace
from qsim.workload import load_at_rate

from live.calibrate import CalibrationConfig, calibrate, probe
from live.calibration_report import describe, describe_terms, report
from live.engine_steps import counted
from live.live_config import DEFAULT_SECONDS, LiveConfig, TraceSpec
from live.loadgen import ReplayConfig, lateness, replay
from live.procs import serving


def rotated(items: tuple[str, ...], k: int) -> list[str]:
    """``items`` starting at position k mod len: trace k's policy order."""
    k %= len(items)
    return list(items[k:] + items[:k])


def resolved_rate(spec: TraceSpec, model: ServiceModel, engines: int, patience=None) -> TraceSpec:
    """A [[trace]] given as a rate, with the nominal load at which its arrivals send that rate over
    the calibrated capacity (``qlab replay --rate``'s rule); any other as it is."""
    if spec.rate is None:
        return spec
    load = load_at_rate(
        spec.rate,
        arrivals=spec.arrivals,
        engines=engines,
        seconds=spec.seconds,
        requests=spec.requests,
        seed=spec.seed,
        model=model,
        patience=patience,
    )
    return replace(spec, nominal_load=load)


def trace_for(
    spec: TraceSpec, model: ServiceModel, engines: int, base: Path, patience=None
) -> Trace:
    """A [[trace]] entry's trace (a file's path is relative to the config file's folder), its
    clients' patience drawn from ``patience`` ([replay] patience; None: a trace file's own column,
    if any)."""
    # A nominal load is relative to the calibrated capacity: make_trace's load at speed 1 (the
    # calibration). A trace file's start, seconds and nominal_load are its window (qlab replay's
    # --start, --seconds and --nominal-load beside --trace: one rule, qsim.tracefiles.TraceWindow).
    if spec.file:
        return build_trace(
            base / spec.file,
            time_scale=spec.time_scale,
            engines=engines,
            seed=spec.seed,
            model=model,
            patience=patience,
            window=spec.window,
        )
    return build_trace(
        None,
        arrivals=spec.arrivals,
        load=spec.load,
        engines=engines,
        seconds=spec.seconds,
        requests=spec.requests,
        default_seconds=DEFAULT_SECONDS,
        seed=spec.seed,
        model=model,
        patience=patience,
    )


def run_calibration(cfg: LiveConfig, out: Path, log: Callable[[str], None]) -> str:
    """Calibrate on a server of its own (policy none: nothing refused) and return the JSON's path.

    A calibration already in OUT (an interrupted experiment being resumed) is reused: the
    finished runs' nominal loads are relative to it.
    """
    path = out / "calibration.json"
    if path.is_file():
        log(f"resuming: using the calibration in {path}")
        return str(path)
    options = replace(cfg.server, policy="none", service_model="")
    with serving([options], out / "logs", cfg.startup_timeout_s, prefix="calibrate") as (server,):
        result = calibrate(
            CalibrationConfig(
                server.url,
                cfg.calibrate.rounds,
                cfg.calibrate.per_size,
                prompt_words=cfg.replay.prompt_words,
                engine_metrics=cfg.calibrate.engine_metrics,
            ),
            progress=lambda step: log(f"calibration {report(step)}"),
        )
    result.save(path)
    log(describe(result.overall, "calibration, all rounds"))
    log(f"calibration {describe_terms(result)}")
    return str(path)


def summary_row(
    frame: pd.DataFrame,
    trace: Trace,
    spec: TraceSpec,
    policy: str,
    position: int,
    speeds: tuple[float, float],
) -> dict:
    """One run: what ran, how fast the machine was, outcomes and goodput, send lateness,
    agreement with qsim."""
    versus = compare.compare(frame).summary
    in_run = engine_time_ratio(frame)  # the effective load's: engine time over calibrated time
    probes = [s for s in speeds if math.isfinite(s)]
    speed = in_run if math.isfinite(in_run) else (sum(probes) / len(probes) if probes else math.nan)
    late = lateness(frame)
    # A burst or a trace file has no utilisation of its own: its load is not a number to report.
    nominal = math.nan if spec.load is None else spec.load
    return {
        "trace": spec.name,
        "policy": policy,
        "position": position,
        "arrivals": spec.file or spec.arrivals,
        "nominal_load": nominal,
        "rate_rps": math.nan if spec.rate is None else spec.rate,
        "speed_before": speeds[0],
        "speed_in_run": in_run,
        "speed_after": speeds[1],
        "speed_in_run_median": versus["measured_speed"],
        "effective_load": nominal * speed,
        **metrics.summary(frame, trace.duration_s or None),
        "send_lateness_p99_s": late["p99_s"],
        "send_lateness_max_s": late["max_s"],
        "retry_send_lateness_p99_s": lateness(frame, retries=True)["p99_s"],
        "sim_disagreements": versus["disagreements"],
        "sim_disagreement_rate": versus["disagreement_rate"],
        # Why they began (analysis.diagnosis.CAUSES): a rule difference is a bug, timing a coin
        # flip.
        "sim_rule_disagreements": versus["rule_disagreements"],
        "sim_timing_disagreements": versus["timing_disagreements"],
        "sim_e2e_disagreement_rate": versus.get("e2e_disagreement_rate", math.nan),
        "sim_latency_abs_error_p50_s": versus["latency_abs_error_p50_s"],
        "sim_latency_abs_error_p99_s": versus["latency_abs_error_p99_s"],
    }


@dataclass(frozen=True)
class _TraceRun:
    """One trace under one policy, at its place in the rotated order."""

    spec: TraceSpec
    trace: Trace
    policy: str
    position: int

    def path(self, out: Path) -> Path:
        return out / "runs" / f"{self.spec.name}__{self.policy}.parquet"


def plan(cfg: LiveConfig, traces: list[tuple[TraceSpec, Trace]]) -> list[_TraceRun]:
    """Every run in the order it goes: trace by trace, policies rotated by the trace's index."""
    return [
        _TraceRun(spec, trace, policy, position)
        for k, (spec, trace) in enumerate(traces)
        for position, policy in enumerate(rotated(cfg.policies, k))
    ]


def check_folder(cfg: LiveConfig, out: Path) -> None:
    """Record the config in OUT, or refuse a folder holding another config's runs (they would not
    resume it)."""
    path = out / "live.json"
    # tuples -> lists
    mine = json.loads(json.dumps({k: v for k, v in asdict(cfg).items() if k != "source"}))
    try:
        theirs = json.loads(path.read_text()).get("config") if path.is_file() else None
    except (json.JSONDecodeError, AttributeError):
        theirs = None
    if theirs == mine:
        return
    if any((out / "runs").glob("*.parquet")):
        raise ValueError(
            f"{out} holds runs of another live config (see {path}); choose another "
            "--out or remove "
            "that folder"
        )
    # No run was written under the old config (it failed to start): its calibration is not this
    # one's.
    (out / "calibration.json").unlink(missing_ok=True)
    atomic_write(
        path, (json.dumps({"config": mine, "source": cfg.source}, indent=2) + "\n").encode()
    )


def run(
    cfg: LiveConfig,
    out: str | Path,
    log: Callable[[str], None] = print,
    bar: Callable | None = None,
) -> pd.DataFrame:
    """Run the experiment's runs not yet written; write them and the summary under ``out``;
    return the summary. ``bar(total, initial)``: a progress bar (a context manager with update)
    over the runs, the done ones counted from the start."""
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    check_folder(cfg, out)
    clear_temporaries(out / "runs")
    base = Path(cfg.source).parent
    with sigterm_interrupts():
        model_path = str(base / cfg.server.service_model) if cfg.server.service_model else ""
        if cfg.calibrate:
            model_path = run_calibration(cfg, out, log)
        model = ServiceModel.load(model_path) if model_path else ServiceModel()
        patience = cfg.replay.clients_patience
        engines = cfg.server.engines
        specs = [resolved_rate(spec, model, engines, patience) for spec in cfg.traces]
        runs = plan(
            cfg, [(spec, trace_for(spec, model, engines, base, patience)) for spec in specs]
        )
        rows = {r.path(out): _row_from_file(r, r.path(out)) for r in runs if r.path(out).is_file()}
        todo = [r for r in runs if r.path(out) not in rows]
        if rows:
            log(
                f"resuming: {len(rows)} of {len(runs)} runs already in {out / 'runs'}; running "
                f"the other {len(todo)}"
            )
        if todo:
            with bar(len(runs), len(rows)) if bar else contextlib.nullcontext() as shown:
                tick = shown.update if shown is not None else lambda n: None
                rows.update(_run_all(cfg, model, model_path, todo, out, log, tick))
    summary = pd.DataFrame([rows[r.path(out)] for r in runs])
    write_parquet(summary, out / "summary.parquet")
    return summary


def _run_all(
    cfg: LiveConfig,
    model: ServiceModel,
    model_path: str,
    todo: list[_TraceRun],
    out: Path,
    log: Callable[[str], None],
    tick: Callable[[int], object] = lambda n: None,
) -> dict[Path, dict]:
    """Start a server for each policy that has runs to do, run them in order, write each run's
    file whole."""
    needed = {r.policy for r in todo}
    options = [cfg.serve_options(p, service_model=model_path) for p in cfg.policies if p in needed]
    rows = {}
    with serving(options, out / "logs", cfg.startup_timeout_s) as servers:
        url = {s.options.policy: s.url for s in servers}
        for r in todo:
            log(f"{r.spec.name} ({len(r.trace)} requests) under {r.policy} at {url[r.policy]}")
            frame, speeds = _one_run(cfg, model, url[r.policy], r.trace)
            write_parquet(frame, r.path(out))
            rows[r.path(out)] = summary_row(frame, r.trace, r.spec, r.policy, r.position, speeds)
            _log_row(log, rows[r.path(out)])
            tick(1)
    return rows


def _row_from_file(r: _TraceRun, path: Path) -> dict:
    """The summary row of a run written by an earlier, interrupted attempt."""
    frame = pd.read_parquet(path)
    speeds = (float(frame["speed_before"].iloc[0]), float(frame["speed_after"].iloc[0]))
    return summary_row(frame, r.trace, r.spec, r.policy, r.position, speeds)


def _one_run(
    cfg: LiveConfig, model: ServiceModel, url: str, trace: Trace
) -> tuple[pd.DataFrame, tuple[float, float]]:
    p = cfg.probe
    before = probe(url, model, p.requests, p.max_new_tokens, cfg.replay.prompt_words)

    def run() -> pd.DataFrame:
        return replay(
            trace,
            ReplayConfig(
                url,
                timeout_s=cfg.replay.timeout_s,
                prompt_words=cfg.replay.prompt_words,
                context_tokens=cfg.replay.context_tokens,
                retry=cfg.retry,
                api=cfg.replay.api,
            ),
        )

    engine = cfg.calibrate.engine_metrics if cfg.calibrate is not None else None
    if engine is None:
        frame = run()
    else:  # the engine's own steps during the run: its speed then, beside the probes around it
        frame, phase = counted(engine, 0, 0, run)
        frame["engine_step_s"], frame["engine_seqs_a_step"] = phase.step_s, phase.seqs
        frame["engine_prefill_a_step"] = phase.prefill
    after = probe(url, model, p.requests, p.max_new_tokens, cfg.replay.prompt_words)
    frame["speed_before"], frame["speed_after"] = before, after
    return frame, (before, after)


def _log_row(log: Callable[[str], None], row: dict) -> None:
    log(
        f"  speed {row['speed_before']:.3f} -> {row['speed_after']:.3f} (in run "
        f"{row['speed_in_run']:.3f}), "
        f"nominal load {row['nominal_load']:.2f}, effective load {row['effective_load']:.2f}; "
        f"good {row['good']:.0f} late {row['late']:.0f} "
        f"rejected {row['rejected']:.0f} expired {row['expired']:.0f} error {row['error']:.0f}; "
        f"sim disagrees on {row['sim_disagreements']:.0f} ({row['sim_disagreement_rate']:.1%}; "
        "rule "
        f"{row['sim_rule_disagreements']:.0f}, timing {row['sim_timing_disagreements']:.0f})"
    )
