"""``qlab replay``, ``qlab calibrate``, ``qlab compare`` and ``qlab live``: the load side of the live harness.

Each command takes the parsed args and returns an exit status; bad input is a
ValueError, which the ``qlab`` entry point prints as one line (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pandas as pd

from qsim import ServiceModel, load_trace, make_trace, records
from qsim.argtypes import count, positive, positive_int
from qsim.files import write_parquet
from qsim.records import OUTCOMES


def _model(path: str | None) -> ServiceModel:
    return ServiceModel.load(path) if path else ServiceModel()


def _server_engines(url: str) -> int:
    """Engines behind the server, from /stats: a trace's load is per engine."""
    try:
        return int(httpx.get(f"{url.rstrip('/')}/stats", timeout=10.0).json().get("engines", 1))
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise ValueError(f"{url}: cannot read /stats: {exc}") from None


# ------------------------------------------------------------------ replay


def _trace(args):
    model = _model(args.service_model)
    if args.trace:
        return load_trace(args.trace, args.time_scale, model=model, seed=args.seed)
    from .runner import trace_length

    engines = args.engines or _server_engines(args.url)
    return make_trace(args.arrivals, load=args.load, engines=engines, seed=args.seed, model=model,
                      **trace_length(args.arrivals, args.seconds, args.requests))


def _print_outcomes(frame: pd.DataFrame) -> None:
    counts = frame["outcome"].value_counts().reindex(list(OUTCOMES), fill_value=0)
    print("  ".join(f"{o} {n}" for o, n in counts.items()))
    errors = frame["error"].dropna()
    if len(errors):
        print(f"{len(errors)} errors, first: {errors.iloc[0]}")


def cmd_replay(args) -> int:
    from .loadgen import ReplayConfig, lateness, replay

    trace = _trace(args)
    if len(trace) == 0:
        raise ValueError("the trace has no requests")
    cfg = ReplayConfig(args.url.rstrip("/"), timeout_s=args.timeout, prompt_words=args.prompt_words,
                       max_prompt_words=args.max_prompt_words, late_warn_s=args.late_warn_ms / 1e3)
    print(f"replaying {len(trace)} requests ({trace.name}, {trace.duration_s:g} s) against {cfg.url}", flush=True)
    frame = replay(trace, cfg)
    write_parquet(frame, args.out)  # whole or not at all, even if the replay is killed while writing
    late = lateness(frame)
    _print_outcomes(frame)
    print(f"send lateness: p50 {late['p50_s'] * 1e3:.2f} ms, p99 {late['p99_s'] * 1e3:.2f} ms, "
          f"max {late['max_s'] * 1e3:.2f} ms")
    print(f"wrote {len(frame)} rows to {args.out}")
    return 0


def _replay_parser(sub) -> None:
    p = sub.add_parser("replay", help="open-loop replay of a trace against a live server",
                       description="Send every request of a qsim trace at its scheduled time (open loop) to a "
                                   "qlab serve and record one row per request.")
    p.set_defaults(func=cmd_replay)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", help="a trace file (Azure LLM CSV or qlab .csv/.parquet) instead of a synthetic one")
    p.add_argument("--time-scale", type=positive, default=1.0, help="multiply the trace file's arrival times")
    p.add_argument("--arrivals", default="poisson", help="poisson | constant | gamma:CV | burst:N | periodic:N:PERIOD_S")
    p.add_argument("--load", type=positive, default=1.0, help="nominal load, relative to the calibrated capacity")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=positive, help="arrival window (default 40)")
    length.add_argument("--requests", type=positive_int, help="number of requests instead of a window")
    p.add_argument("--engines", type=positive_int, help="engines the load is spread over (default: the server's)")
    p.add_argument("--seed", type=count, default=1)
    p.add_argument("--service-model", help="calibration JSON: estimates and the load are relative to it")
    p.add_argument("--timeout", type=positive, default=300.0, help="seconds one request may take end to end")
    p.add_argument("--prompt-words", type=positive_int, default=16, help="prompt length where the trace has none")
    p.add_argument("--max-prompt-words", type=positive_int, default=64, help="cap on prompt length")
    p.add_argument("--late-warn-ms", type=positive, default=5.0, help="warn when the p99 send lateness passes this")
    p.add_argument("--out", required=True, help="the run's .parquet file")


# ------------------------------------------------------------------ calibrate


def cmd_calibrate(args) -> int:
    from .calibrate import CalibrationConfig, calibrate, describe

    cfg = CalibrationConfig(args.url.rstrip("/"), rounds=args.rounds, per_size=args.per_size,
                            prompt_words=args.prompt_words, deadline_ms=args.deadline_ms)
    print(f"calibrating {cfg.url}: {cfg.rounds} round(s) of {cfg.per_size} x {list(cfg.sizes)} new tokens, "
          "one request at a time", flush=True)
    try:
        result = calibrate(cfg, progress=lambda r: print(describe(r, f"round {r.round}"), flush=True))
    except httpx.HTTPError as exc:
        raise ValueError(f"{cfg.url}: {type(exc).__name__}: {exc}") from None
    print(describe(result.overall, "all rounds"))
    result.save(args.out)
    print(f"wrote {args.out}")
    return 0


def _calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fit the service-time line on a live server",
                       description="Send requests of 1, 2, 4, ... 64 new tokens one at a time, in rounds, fit "
                                   "S = intercept + per_token * tokens and report the error of the line.")
    p.set_defaults(func=cmd_calibrate)
    p.add_argument("--url", required=True)
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--per-size", type=positive_int, default=12, help="requests of each size per round")
    p.add_argument("--prompt-words", type=positive_int, default=16)
    p.add_argument("--deadline-ms", type=positive_int, help="deadline sent with each request (default: the server's)")
    p.add_argument("--out", required=True, help="JSON that serve and simulate read with --service-model")


# ------------------------------------------------------------------ compare


def cmd_compare(args) -> int:
    from analysis.compare import compare, figure

    try:
        run = pd.read_parquet(args.run)
    except Exception as exc:  # pyarrow raises several types for a missing or bad file
        raise ValueError(f"{args.run}: cannot read parquet: {exc}") from None
    records.validate(run)
    result = compare(run)
    out = Path(args.out) if args.out else Path(args.run).with_suffix("")
    out.mkdir(parents=True, exist_ok=True)
    result.joined.to_parquet(out / "compare.parquet", index=False)
    figure(result, out / "compare.png")
    s = result.summary
    if args.json:
        print(json.dumps({"summary": s, "confusion": result.confusion.to_dict(orient="index")}, indent=2))
        return 0
    print(f"{args.run}: {int(s['requests'])} requests, simulated with the service's engine times "
          f"(speed factor {s['measured_speed']:.3f})")
    print("outcomes, live (rows) x simulator (columns):")
    print(result.confusion.to_string())
    print(f"disagreements: {int(s['disagreements'])} of {int(s['requests'] - s['live_errors'])} "
          f"({s['disagreement_rate']:.1%}); live errors left out: {int(s['live_errors'])}")
    print(f"latency error (sim - live) of the {int(s['both_answered'])} both answered: |error| p50 "
          f"{s['latency_abs_error_p50_s'] * 1e3:.1f} ms, p90 {s['latency_abs_error_p90_s'] * 1e3:.1f} ms, "
          f"p99 {s['latency_abs_error_p99_s'] * 1e3:.1f} ms; mean signed {s['latency_error_mean_s'] * 1e3:+.1f} ms")
    print(f"wrote {out / 'compare.parquet'} and {out / 'compare.png'}")
    return 0


def _compare_parser(sub) -> None:
    p = sub.add_parser("compare", help="replay a live run's arrivals in the simulator, request by request",
                       description="Simulate a live run's actual arrivals with the engine times the service "
                                   "measured; report the outcome confusion matrix and latency error.")
    p.set_defaults(func=cmd_compare)
    p.add_argument("run", help="a run .parquet from qlab replay or qlab live")
    p.add_argument("--out", help="folder for compare.parquet and compare.png (default: next to the run)")
    p.add_argument("--json", action="store_true")


# ------------------------------------------------------------------ live


def cmd_live(args) -> int:
    from . import live_config, runner

    cfg = live_config.load(args.config)
    summary = runner.run(cfg, args.out, log=lambda line: print(line, flush=True))
    cols = ["trace", "policy", "effective_load", "good", "late", "rejected", "expired", "error", "goodput_rps",
            "good_tokens_per_s", "sim_disagreement_rate"]
    print(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {len(summary)} runs to {Path(args.out) / 'runs'} and {Path(args.out) / 'summary.parquet'}")
    return 0 if summary["error"].sum() == 0 else 1


def _live_parser(sub) -> None:
    p = sub.add_parser("live", help="run every trace under every policy against live servers",
                       description="Start one qlab serve per policy, replay every trace under every policy "
                                   "(order rotated), probe speed before and after each run, write parquet.")
    p.set_defaults(func=cmd_live)
    p.add_argument("config", help="the experiment's TOML file (see experiments/live.toml)")
    p.add_argument("--out", required=True, help="output folder")


def register(subparsers) -> None:
    _replay_parser(subparsers)
    _calibrate_parser(subparsers)
    _compare_parser(subparsers)
    _live_parser(subparsers)
