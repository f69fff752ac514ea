"""``qlab replay``, ``qlab calibrate``, ``qlab compare`` and ``qlab live``: the load side of the
live harness, and what it measures (analysis); here, above both, so that :mod:`live` never imports
:mod:`analysis`.

Each command takes the parsed args and returns an exit status; bad input is a
ValueError, which the ``qlab`` entry point prints as one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import httpx
import pandas as pd

from inputs import clientflags
from inputs.argtypes import count, non_negative, positive, positive_int, renamed
from inputs.atomic import write_parquet
from qsim import ServiceModel, build_trace, records
from qsim.service import LoadTerms
from qsim.records import OUTCOMES
from qsim.runfile import SPEED_PROBES
from qsim.arrivals import ARRIVALS, arrivals_take_load
from qsim.workload import dataset_rows, load_at_rate

from live.contract import Stats
from live.live_config import DEFAULT_NOMINAL_LOAD, DEFAULT_SECONDS

from .jsonout import json_ready
from .simflags import add_dataset_flags, add_trace_flags, dataset_from_args, trace_window


def _model(path: str | None) -> ServiceModel:
    return ServiceModel.load(path) if path else ServiceModel()


def _server_engines(url: str) -> int:
    """Engines behind the server, from /stats: a trace's load is per engine."""
    try:
        return Stats.model_validate_json(
            httpx.get(f"{url.rstrip('/')}/stats", timeout=10.0).content
        ).engines
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(f"{url}: cannot read /stats: {exc}") from None


# ------------------------------------------------------------------ replay


def _trace(args, patience=None):
    model = _model(args.service_model)
    if args.rate is not None:  # the nominal load that sends that rate; reported as one from here on
        args.nominal_load = _load_at_rate(args, model, patience)
    load = _nominal_load(args)
    # what a trace file cannot take, refused before asking the server
    window = trace_window(args, load, "--nominal-load")
    # A trace file at its own rate needs no engine count; scaled to a nominal load, it is per engine
    # as synthetic arrivals are.
    engines = 1 if args.trace and load is None else args.engines or _server_engines(args.url)
    # A nominal load is relative to the calibrated capacity: make_trace at speed 1 (the
    # calibration).
    dataset = dataset_from_args(args)
    trace = build_trace(
        args.trace,
        time_scale=args.time_scale,
        arrivals=args.arrivals,
        load=load,
        engines=engines,
        seconds=args.seconds,
        requests=args.requests,
        default_seconds=DEFAULT_SECONDS,
        seed=args.seed,
        model=model,
        patience=patience,
        window=window,
        dataset=dataset,
    )
    return trace, _given(dataset, trace, args.seed)


def _load_at_rate(args, model, patience) -> float:
    """--rate R as the nominal load at which the same synthetic arrivals send R requests per second
    (over the calibrated capacity of the engines, as --nominal-load is)."""
    if args.trace or args.nominal_load is not None:
        raise ValueError(
            "--rate sets synthetic arrivals' rate; give --rate or --nominal-load "
            "(with --trace: --nominal-load or --time-scale)"
        )
    engines = args.engines or _server_engines(args.url)
    seconds = args.seconds if args.seconds or args.requests else DEFAULT_SECONDS
    return load_at_rate(
        args.rate,
        arrivals=args.arrivals,
        engines=engines,
        seconds=seconds,
        requests=args.requests,
        seed=args.seed,
        model=model,
        patience=patience,
        dataset=dataset_from_args(args),
    )


def _given(dataset, trace, seed: int):
    """The dataset's prompt texts of the trace's requests: the rows ``qlab simulate --dataset`` with
    the same seed takes (None: no dataset)."""
    if dataset is None:
        return None
    from live.replay_bodies import GivenPrompts

    rows = dataset_rows(dataset, len(trace), seed)
    return GivenPrompts(tuple(dataset.requests[i].prompt for i in rows), dataset.counting)


def _clients(args):
    """The patience and retry flags, checked before anything is asked of the server."""
    patience, retry = clientflags.from_args(args)
    if patience is not None and patience.until == "start":
        raise ValueError(
            "--patience-until start is simulator-only: over plain HTTP a client "
            "cannot see its request "
            "start (use answer, the default)"
        )
    return patience, retry


def _nominal_load(args) -> float | None:
    """--nominal-load, 1 where it is left out and the arrivals take a load; None for a trace file or
    a burst of its own size without one (a burst given one is refused by build_trace: the load would
    be ignored)."""
    if args.nominal_load is not None or args.trace or not arrivals_take_load(args.arrivals):
        return args.nominal_load
    return DEFAULT_NOMINAL_LOAD


def _print_effective_load(args, frame: pd.DataFrame) -> None:
    """The nominal load beside the effective one: nominal x total engine time over total calibrated
    time of the served (the median ratio of one request's times beside it)."""
    nominal = _nominal_load(args)
    if nominal is None:
        return  # a trace file at its own rate, or a burst, has no nominal load of its own
    from analysis.replay import engine_time_ratio, measured_speed

    ratio = engine_time_ratio(frame)
    if math.isfinite(ratio):  # NaN when nothing was served
        print(
            f"nominal load {nominal:g} x engine time / calibrated time {ratio:.3f} = effective "
            "load "
            f"{nominal * ratio:.3g} (median ratio of one request's {measured_speed(frame):.3f})"
        )
    else:
        print(
            f"nominal load {nominal:g}; effective load unknown (nothing was served to measure "
            "the speed)"
        )


def _probe(args) -> float:
    """With ``--probe N``: the machine's speed over the server's own calibration, from N requests
    sent one at a time (:func:`live.calibrate.probe`); NaN without it."""
    if not args.probe:
        return math.nan
    from live.calibrate import probe
    from live.rows import server_info

    url = args.url.rstrip("/")
    try:
        model = server_info(httpx.get(f"{url}/stats", timeout=10.0).json()).config.model
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(
            f"--probe: cannot read {url}/stats (it needs a qlab gate): {exc}"
        ) from None
    return probe(url, model, args.probe, prompt_words=args.prompt_words)


def _print_outcomes(frame: pd.DataFrame) -> None:
    counts = frame["outcome"].value_counts().reindex(list(OUTCOMES), fill_value=0)
    print("  ".join(f"{o} {n}" for o, n in counts.items()))
    errors = frame["error"].dropna()
    if len(errors):
        print(f"{len(errors)} errors, first: {errors.iloc[0]}")


def _print_retries(frame: pd.DataFrame, duration_s: float) -> None:
    """End to end (from each request's first send), when clients retried or gave up."""
    from analysis.metrics import end_to_end, retry_summary

    if not (frame["attempt"].gt(1).any() or frame["outcome"].eq("abandoned").any()):
        return
    e2e = end_to_end(frame)
    counts = e2e["outcome"].value_counts().reindex(list(OUTCOMES), fill_value=0)
    print(f"end to end, {len(e2e)} requests: " + "  ".join(f"{o} {n}" for o, n in counts.items()))
    if frame["attempt"].gt(1).any():
        s = retry_summary(frame, duration_s or None)
        print(
            f"retries: {s['attempts_per_request']:.3f} attempts per request; end to end (from "
            "the first send) "
            f"{s['share_good_e2e']:.3f} in time, goodput {s['goodput_e2e_rps']:.3f} requests/s; "
            f"Retry-After adherence {s['retry_after_adherence']:.3f}"
        )


def _print_prompts(frame: pd.DataFrame, trace) -> None:
    """Prompt lengths sent, and the counts the context capped or kept from being sent (also on
    stderr), where the trace gave the lengths or the context changed one; time to the first token
    where it was measured."""
    meta = frame.attrs.get("qlab_run", {})
    sent = frame.loc[frame["prompt_tokens"] > 0, "prompt_tokens"]
    touched = meta.get("prompts_capped", 0) or meta.get("prompts_cannot_fit", 0)
    if len(sent) and (touched or (trace.prompt_tokens > 0).any()):
        print(
            f"prompts: {int(sent.median())} tokens median, {int(sent.max())} max; capped to the "
            "context "
            f"({meta.get('context_tokens') or 'none known'}): {meta.get('prompts_capped', 0)}, "
            "not sent "
            f"(cannot fit): {meta.get('prompts_cannot_fit', 0)}"
        )


def _print_latency(frame: pd.DataFrame, seconds: float) -> None:
    """TTFT, ITL, TPOT and E2E of the answered, and goodput, by analysis.latency's definitions
    (docs/metrics.md)."""
    from analysis.latency import summary

    s = summary(frame, seconds)
    parts = [
        f"{name} p50 {s[f'{key}_p50_s'] * 1e3:.1f} ms, p99 {s[f'{key}_p99_s'] * 1e3:.1f} ms"
        for key, name in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2e", "E2E"))
        if math.isfinite(s[f"{key}_p50_s"])
    ]
    if parts:
        print("latency (docs/metrics.md): " + "; ".join(parts))
    objectives = ["the deadline"] + [
        f"{name} <= {frame[col].dropna().iloc[0] * 1e3:g} ms"
        for col, name in (("ttft_slo_s", "TTFT"), ("tpot_slo_s", "TPOT"))
        if col in frame.columns and frame[col].notna().any()
    ]
    print(
        f"goodput: {int(s['good'])} answered meeting {', '.join(objectives)}; "
        f"{s['goodput_rps']:.3f} requests/s"
    )


def _outcome_counts(frame: pd.DataFrame) -> dict[str, int]:
    counts = frame["outcome"].value_counts().reindex(list(OUTCOMES), fill_value=0)
    return {o: int(n) for o, n in counts.items()}


def _run_facts(frame: pd.DataFrame, seconds: float, out: str) -> dict:
    """What every run's text says, for --json: outcomes, errors, latency and goodput, the file."""
    from analysis.latency import summary

    errors = frame["error"].dropna()
    return {
        "outcomes": _outcome_counts(frame),
        "errors": int(len(errors)),
        "first_error": str(errors.iloc[0]) if len(errors) else None,
        "latency": summary(frame, seconds),
        "rows": int(len(frame)),
        "out": str(out),
    }


def _replay_facts(args, frame: pd.DataFrame, trace, cfg) -> dict:
    """--json's document: the facts the text of a replay prints, by the same functions."""
    from analysis.metrics import end_to_end, retry_summary
    from analysis.replay import engine_time_ratio, measured_speed

    from live.loadgen import lateness

    meta = frame.attrs.get("qlab_run", {})
    sent = frame.loc[frame["prompt_tokens"] > 0, "prompt_tokens"]
    nominal = _nominal_load(args)
    ratio = engine_time_ratio(frame)
    retried = bool(frame["attempt"].gt(1).any())
    facts = {
        "url": cfg.url,
        "api": cfg.api,
        "trace": trace.name,
        "requests": len(trace),
        "duration_s": trace.duration_s,
        "load": {
            "nominal": nominal,
            "engine_time_ratio": ratio,
            "effective": None if nominal is None else nominal * ratio,
            "median_ratio": measured_speed(frame),
        },
        "send_lateness": lateness(frame),
        "retry_send_lateness": lateness(frame, retries=True) if retried else None,
        "prompts": {
            "median_tokens": float(sent.median()) if len(sent) else None,
            "max_tokens": int(sent.max()) if len(sent) else None,
            "context_tokens": meta.get("context_tokens"),
            "capped": int(meta.get("prompts_capped", 0)),
            "cannot_fit": int(meta.get("prompts_cannot_fit", 0)),
        },
        "end_to_end": None,
    }
    if retried or frame["outcome"].eq("abandoned").any():
        e2e = end_to_end(frame)
        facts["end_to_end"] = {
            "requests": len(e2e),
            "outcomes": _outcome_counts(e2e),
            **(retry_summary(frame, trace.duration_s or None) if retried else {}),
        }
    if args.probe:
        facts["speed_probe"] = {
            "requests": args.probe,
            "before": float(frame[SPEED_PROBES[0]].iloc[0]),
            "after": float(frame[SPEED_PROBES[1]].iloc[0]),
        }
    return {**facts, **_run_facts(frame, trace.duration_s or frame["finish_s"].max(), args.out)}


def _objectives(args):
    from live.replay_config import Objectives

    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        return None
    return Objectives(
        None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
        None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3,
    )


def _import(args) -> int:
    """``qlab replay --import FILE``: another tool's per-request results as a run file
    (live.imports)."""
    from analysis.latency import judged

    from live.imports import read_tool_file, to_run
    from live.rows import server_info

    if args.stats:
        try:
            stats = json.loads(Path(args.stats).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"--stats {args.stats}: cannot read the gate's /stats JSON ({type(exc).__name__})"
            ) from None
    elif args.url:
        stats = httpx.get(f"{args.url.rstrip('/')}/stats", timeout=10.0).json()
    else:
        raise ValueError(
            "--import needs the gate's configuration: --stats FILE (its /stats, saved) or --url URL"
        )
    info = server_info(Stats.model_validate(stats))
    tool, sent = read_tool_file(args.import_file)
    frame = to_run(sent, info, info.config.model, f"{tool}:{Path(args.import_file).name}")
    objectives = _objectives(args)
    if objectives is not None:
        frame = objectives.columns(frame)
    frame = records.validate(judged(frame))
    write_parquet(frame, args.out)
    if args.json:
        facts = {
            "imported": tool,
            "file": str(args.import_file),
            "requests": len(frame),
            **_run_facts(frame, frame.attrs["qlab_run"]["duration_s"], args.out),
        }
        print(json.dumps(json_ready(facts), indent=2))
        return 0
    print(f"imported {len(frame)} requests of {tool} ({args.import_file})")
    _print_outcomes(frame)
    _print_latency(frame, frame.attrs["qlab_run"]["duration_s"])
    print(f"wrote {len(frame)} rows to {args.out}")
    return 0


def cmd_replay(args) -> int:
    from analysis.latency import judged

    from live.loadgen import ReplayConfig, lateness, replay
    from live.replay_clients import check_patience

    if args.import_file:
        return _import(args)
    if not args.url:
        raise ValueError("qlab replay needs --url (or --import FILE)")
    patience, retry = _clients(args)
    cfg = ReplayConfig(
        args.url.rstrip("/"),
        timeout_s=args.timeout,
        prompt_words=args.prompt_words,
        context_tokens=args.context_tokens,
        late_warn_s=args.late_warn_ms / 1e3,
        retry=retry,
        api=args.api,
        model=args.model,
        slo=_objectives(args),
    )
    trace, given = _trace(args, patience)
    if len(trace) == 0:
        raise ValueError("the trace has no requests")
    check_patience(trace)
    api = "" if cfg.api == "qlab" else " (OpenAI-compatible /v1/completions, streamed)"
    say = _saying(args.json)
    say(
        f"replaying {len(trace)} requests ({trace.name}, {trace.duration_s:g} s) against "
        f"{cfg.url}{api}"
    )
    before = _probe(args)
    if given is not None:
        say(
            f"prompts: the texts of {args.dataset} ({len(set(given.texts))} distinct), max_tokens "
            f"their answers' lengths ({given.counting})"
        )
    with _replay_bar(trace, cfg, quiet=args.quiet or args.json) as bar:
        # TTFT and TPOT where it streamed, judged by every objective
        frame = records.validate(judged(replay(trace, cfg, given, bar)))
    if args.probe:  # the columns qlab live writes: what qlab compare --predict runs the model at
        frame[SPEED_PROBES[0]], frame[SPEED_PROBES[1]] = before, _probe(args)
        say(
            f"speed probe ({args.probe} requests, one at a time): {before:.3f} before, "
            f"{float(frame[SPEED_PROBES[1]].iloc[0]):.3f} after"
        )
    # whole or not at all, even if the replay is killed while writing
    write_parquet(frame, args.out)
    if args.json:
        print(json.dumps(json_ready(_replay_facts(args, frame, trace, cfg)), indent=2))
        return 0
    late = lateness(frame)
    _print_outcomes(frame)
    _print_retries(frame, trace.duration_s)
    _print_effective_load(args, frame)
    print(
        f"send lateness: p50 {late['p50_s'] * 1e3:.2f} ms, p99 {late['p99_s'] * 1e3:.2f} ms, "
        f"max {late['max_s'] * 1e3:.2f} ms"
    )
    _print_prompts(frame, trace)
    if frame["attempt"].gt(1).any():
        late = lateness(frame, retries=True)
        print(
            f"retry send lateness: p50 {late['p50_s'] * 1e3:.2f} ms, p99 "
            f"{late['p99_s'] * 1e3:.2f} ms, "
            f"max {late['max_s'] * 1e3:.2f} ms"
        )
    _print_latency(frame, trace.duration_s or frame["finish_s"].max())
    print(f"wrote {len(frame)} rows to {args.out}")
    return 0


def _saying(as_json: bool):
    """print, flushed (a line said before minutes of work), or nothing: --json's stdout is one
    document."""
    return (lambda line: None) if as_json else (lambda line: print(line, flush=True))


def _replay_bar(trace, cfg, *, quiet: bool):
    """Attempts answered (of the trace's requests; a count alone when retries can add more), on
    stderr."""
    from inputs.progress import progress_bar

    total = None if cfg.retry is not None and cfg.retry.retries else len(trace)
    return progress_bar(total, unit="req", desc="answered", quiet=quiet)


def _replay_parser(sub) -> None:
    p = sub.add_parser(
        "replay",
        help="open-loop replay of a trace against a live server",
        description="Send every request of a qsim trace at its scheduled time (open "
        "loop) to a "
        "qlab serve and record one row per request.",
    )
    p.set_defaults(func=cmd_replay)
    p.add_argument(
        "--url",
        help="the server, e.g. http://127.0.0.1:8000 (with --import: the gate "
        "it ran against, "
        "for its configuration)",
    )
    p.add_argument(
        "--import",
        dest="import_file",
        metavar="FILE",
        help="no replay: read a guidellm (--output kind=json), inference-perf "
        "(per_request_lifecycle_metrics.json) or aiperf (profile_export.jsonl) "
        "result file into a run "
        "file, for qlab compare --predict (the gate's configuration from --stats "
        "or --url)",
    )
    p.add_argument("--stats", help="--import: the gate's GET /stats, saved as JSON")
    p.add_argument(
        "--slo-ttft-ms",
        type=positive,
        help="an objective for the time to the first "
        "token: sent as "
        "x-slo-ttft-ms and judged in goodput "
        "(docs/metrics.md)",
    )
    p.add_argument(
        "--slo-tpot-ms",
        type=positive,
        help="an objective for the time per output "
        "token after the "
        "first: sent as x-slo-tpot-ms and "
        "judged in goodput",
    )
    add_trace_flags(p, load_flag="--nominal-load")
    add_dataset_flags(
        p,
        "sends its rows' prompt texts, max_tokens their answers' lengths (the "
        "rows qlab simulate --dataset takes at the same --seed)",
    )
    p.add_argument("--arrivals", default="poisson", help=" | ".join(ARRIVALS))
    p.add_argument(
        "--nominal-load",
        type=positive,
        help="arrival rate over the calibrated capacity of the engines (the run reports "
        "the effective "
        "load: nominal x its engine time over the calibrated time; default "
        f"{DEFAULT_NOMINAL_LOAD:g}; "
        "burst:N and periodic:N:PERIOD_S take none; with --trace: the file's "
        "rate, scaled to it)",
    )
    p.add_argument(
        "--rate",
        type=positive,
        metavar="R",
        help="arrivals at R requests per second in place of --nominal-load (the "
        "nominal load that sends R, at the calibrated capacity of the engines)",
    )
    p.add_argument(
        "--load",
        action=renamed(
            "--nominal-load",
            "a replay's rate is relative to the "
            "calibrated "
            "capacity, not the utilisation at the machine's "
            "unknown speed",
        ),
    )
    length = p.add_mutually_exclusive_group()
    length.add_argument(
        "--seconds",
        type=positive,
        help="arrival window (default 40; with "
        "--trace: the file's whole "
        "length, or N seconds of it from "
        "--start)",
    )
    length.add_argument(
        "--requests", type=positive_int, help="number of requests instead of a window"
    )
    p.add_argument(
        "--engines",
        type=positive_int,
        help="engines the load is spread over (default: the server's)",
    )
    p.add_argument("--seed", type=count, default=1)
    p.add_argument(
        "--service-model",
        help="calibration JSON: estimates and the nominal load are relative to it",
    )
    p.add_argument(
        "--timeout", type=positive, default=300.0, help="seconds one request may take end to end"
    )
    p.add_argument(
        "--prompt-words",
        type=positive_int,
        default=16,
        help="where the trace has no prompt lengths, a prompt of this many words (each "
        "one GPT-2 token)",
    )
    p.add_argument(
        "--context-tokens",
        type=positive_int,
        help="the model's context: each prompt is capped at it minus the request's new "
        "tokens (counted "
        "and reported), a request whose new tokens fill it is not sent (default: "
        "the server's "
        "/healthz says, as GPT-2's 1024; else no cap)",
    )
    p.add_argument(
        "--max-prompt-words",
        action=renamed(
            "--context-tokens",
            "prompts are the trace's length, capped at the context minus the request's new tokens",
        ),
    )
    p.add_argument(
        "--api",
        choices=("qlab", "openai"),
        default="qlab",
        help="qlab: POST /v1/generate (default); openai: POST /v1/completions, "
        "streamed, on any "
        "OpenAI-compatible server (a qlab gate or e.g. vLLM), recording the time "
        "to the first token",
    )
    p.add_argument(
        "--model",
        help="--api openai: the model to ask for (default: the first GET /v1/models lists)",
    )
    p.add_argument(
        "--probe",
        type=count,
        default=0,
        metavar="N",
        help="send N requests one at a time before the replay and after it to measure "
        "the machine's speed "
        "over the server's calibration; recorded as speed_before and speed_after, "
        "which qlab compare "
        "--predict runs the model at (default 0: no probe; a qlab gate only)",
    )
    p.add_argument(
        "--late-warn-ms",
        type=positive,
        default=5.0,
        help="warn when the p99 send lateness passes this",
    )
    p.add_argument("--out", required=True, help="the run's .parquet file")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document instead of the text: the run's outcomes, "
        "lateness, "
        "latency and goodput, loads, prompts, and the file written (NaN as null)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar on a terminal")
    clientflags.add_flags(p)


# ------------------------------------------------------------------ calibrate


def _lengths(text: str) -> tuple[int, ...]:
    """'16,256,768' -> (16, 256, 768): prompt lengths, each a whole number >= 1."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"prompt lengths must be >= 1, got {text!r}")
    return values


def _in_flight(text: str) -> tuple[int, ...]:
    """'2,4' -> (2, 4); 'none' -> (): requests in flight at once, each >= 2."""
    if text.strip().lower() == "none":
        return ()
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas or none, got {text!r}"
        ) from None
    if min(values) < 2:
        raise argparse.ArgumentTypeError(
            f"requests in flight must be >= 2 (one at a time is the rounds'), got {text!r}"
        )
    return values


def cmd_calibrate(args) -> int:
    from live.admin import send_calibration, sending_key
    from live.calibrate import CalibrationConfig, calibrate
    from live.calibration_report import describe, describe_terms

    if args.apply:
        sending_key()  # a missing key said before the calibration's minutes, not after
    cfg = CalibrationConfig(
        args.url.rstrip("/"),
        rounds=args.rounds,
        per_size=args.per_size,
        prompt_words=args.prompt_words,
        deadline_ms=args.deadline_ms,
        prompt_tokens=args.prompt_tokens,
        levels=args.in_flight,
        load_per_size=args.load_per_size,
        engine_metrics=args.engine_metrics,
    )
    prompts = (
        "" if cfg.prompt_tokens is None else (f" with prompts of {list(cfg.prompt_tokens)} tokens")
    )
    if cfg.levels is None:
        load = (
            f"; then {cfg.load_per_size} x the sizes with 2, 4, ... in flight, up to the "
            "server's engines (a "
            "batching server's seats)"
        )
    else:
        load = (
            (
                f"; then {cfg.load_per_size} x the sizes with {', '.join(map(str, cfg.levels))} "
                "in flight"
            )
            if cfg.levels
            else ""
        )
    say = _saying(args.json)
    say(
        f"calibrating {cfg.url}: {cfg.rounds} round(s) of {cfg.per_size} x {list(cfg.sizes)} new "
        f"tokens{prompts}, "
        f"one request at a time{load}"
    )
    from inputs.progress import progress_bar

    # A count of the steps done (their number depends on the server's engines): minutes of work.
    try:
        with progress_bar(
            None, unit="step", desc="calibrate", quiet=args.quiet or args.json
        ) as bar:
            result = calibrate(cfg, progress=_ticking(_step_reports(args), bar))
    except httpx.HTTPError as exc:
        raise ValueError(f"{cfg.url}: {type(exc).__name__}: {exc}") from None
    if args.json:
        result.save(args.out)
        taken = send_calibration(cfg.url, result.as_dict()) if args.apply else None
        print(json.dumps(json_ready(_calibration_facts(cfg, result, args.out, taken)), indent=2))
        return 0
    print(describe(result.overall, "all rounds"))
    print(describe_terms(result))
    lengths = sorted({p for r in result.rounds for p in r.prompt_tokens})
    print(
        f"prompt lengths measured: {lengths} tokens ({result.tokenizer or 'tokenizer not said'})"
        + ("; one length: no prompt term fitted" if len(lengths) < 2 else "")
    )
    result.save(args.out)
    print(f"wrote {args.out}")
    if args.apply:
        taken = send_calibration(cfg.url, result.as_dict())
        print(f"the gate plans with it now: {taken['service_model']}")
    return 0


def _ticking(report, bar):
    """Each step reported (``report``: None, nothing to say) and counted on the bar."""

    def each(step) -> None:
        if report is not None:
            report(step)
        bar.update(1)

    return each


def _step_reports(args):
    """Each step's line as it ends: on stdout with the text, on stderr beside --json (still minutes
    of work to follow), none with --quiet."""
    import sys

    from live.calibration_report import report

    if args.quiet:
        return None
    stream = sys.stderr if args.json else sys.stdout
    return lambda step: print(report(step), file=stream, flush=True)


def _calibration_facts(cfg, result, out: str, taken: dict | None) -> dict:
    """--json's document: the fit the text describes (the saved file's, less its raw points), the
    prompt lengths measured, the file written, and what the gate took with --apply (None
    without)."""
    saved = result.as_dict()
    points = ("tokens", "prompt_tokens", "engine_s", "busy")
    rounds = [{k: v for k, v in r.items() if k not in points} for r in saved["rounds"]]
    load = saved["load"]
    if load is not None:
        load = {
            **load,
            "levels": [{k: v for k, v in lv.items() if k not in points} for lv in load["levels"]],
        }
    lengths = sorted({p for r in result.rounds for p in r.prompt_tokens})
    return {
        "url": cfg.url,
        **{k: saved[k] for k in ("model", "median_rel_error", "worst_rel_error", "n")},
        "prompt_tokenizer": result.tokenizer,
        "prompt_lengths": lengths,
        "rounds": rounds,
        "load": load,
        "step": saved.get("step"),
        "step_fit": saved.get("step_fit"),
        "out": str(out),
        "applied": None if taken is None else taken.get("service_model"),
    }


def _calibrate_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="fit the service-time line on a live server",
        description="Send requests of 1, 2, 4, ... 64 new tokens with prompts of "
        "several lengths, "
        "one at a time, in rounds; fit S = intercept + per_prompt_token "
        "* prompt tokens "
        "+ per_token * new tokens and report the error of the fit on "
        "one request. Then "
        "send them with 2, 4, ... requests in flight (up to the "
        "server's engines) and fit "
        "the slowdown per other busy engine and the noise (CV) around "
        "the model; against a "
        "batching server (qlab serve --batching), up to its "
        "max_num_seqs, and fit the step "
        "model to the steps it ran (its /stats step log).",
    )
    p.set_defaults(func=cmd_calibrate)
    p.add_argument("--url", required=True)
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument(
        "--per-size", type=positive_int, default=12, help="requests of each size per round"
    )
    p.add_argument(
        "--prompt-words",
        type=positive_int,
        default=16,
        help="the shortest prompt: the replayer's default one, of this many words",
    )
    p.add_argument(
        "--prompt-tokens",
        type=_lengths,
        metavar="N,N,...",
        help="prompt lengths in the server's tokens (default: the --prompt-words "
        "prompt, 256 and 768, "
        "those that fit the context beside 64 new tokens); one length fits no "
        "prompt term",
    )
    p.add_argument(
        "--deadline-ms",
        type=positive_int,
        help="deadline sent with each request (default: the calibrator's own timeout, "
        "120 s: "
        "a predictive gate must not refuse its own calibration for the deadline)",
    )
    p.add_argument(
        "--in-flight",
        type=_in_flight,
        metavar="N,N,...|none",
        help="requests in flight at once under load, each >= 2 and at most the server's "
        "engines, or a "
        "batching server's max_num_seqs (default: 2, 4, ... and that count; none: "
        "one at a time "
        "only); fits the concurrency term and the noise under load, or the step "
        "model",
    )
    p.add_argument(
        "--apply",
        action="store_true",
        help="hand the calibration to the running gate (PUT /admin/calibration, with "
        "the operator's key "
        "in QLAB_ADMIN_KEY): it plans with it at once, without a restart",
    )
    p.add_argument(
        "--load-per-size",
        type=positive_int,
        default=4,
        help="under load: requests of each size per in-flight level (default 4; against "
        "a batching server "
        "at least the level's requests in flight)",
    )
    p.add_argument(
        "--engine-metrics",
        metavar="URL",
        help="a batching gate's engine, where it counts its own steps (vLLM's base URL: "
        "its "
        "/metrics): the step model is fitted to the engine's steps, each phase in "
        "two "
        "halves, and judged on the held-out halves",
    )
    p.add_argument(
        "--out",
        required=True,
        help="JSON that serve, simulate and compare read with --service-model",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document instead of the text: the fit, the rounds' and "
        "load levels' "
        "summaries, the file written (each step's line goes to stderr), NaN as "
        "null",
    )
    p.add_argument(
        "--quiet", action="store_true", help="no line per round or load level as it ends"
    )


# ------------------------------------------------------------------ compare


def cmd_compare(args) -> int:
    from analysis.compare import compare, figure
    from analysis.diagnosis import describe_first_divergence
    from analysis.prediction import predict
    from analysis.replay import RULES

    try:
        run = pd.read_parquet(args.run)
    except Exception as exc:  # pyarrow raises several types for a missing or bad file
        raise ValueError(f"{args.run}: cannot read parquet: {exc}") from None
    run = records.validate(records.with_optional(run))
    if "qlab_gate" in run.columns and not run["qlab_gate"].all():
        raise ValueError(
            f"{args.run}: replayed against a server that is not a qlab gate (it has "
            "no /stats): qlab "
            "compare needs what a qlab gate reports of each request; replay through "
            "`qlab serve`"
        )
    if args.service_model and not args.predict:
        raise ValueError(
            "--service-model is --predict's: the per-request replay runs with what the gate knew"
        )
    if args.predict:
        terms = LoadTerms.load(args.service_model) if args.service_model else None
        return _print_prediction(
            args, predict(run, seeds=args.seeds, noise_cv=args.noise_cv, terms=terms)
        )
    result = compare(run)
    out = Path(args.out) if args.out else Path(args.run).with_suffix("")
    out.mkdir(parents=True, exist_ok=True)
    write_parquet(result.joined, out / "compare.parquet")  # whole or not at all (SIGINT, SIGTERM)
    if result.requests is not None:
        write_parquet(result.requests, out / "requests.parquet")
    figure(result, out / "compare.png")
    s = result.summary
    if args.json:
        print(
            json.dumps(
                {
                    "summary": s,
                    "confusion": result.confusion.to_dict(orient="index"),
                    "reasons": result.reasons.to_dict(orient="index"),
                    "first_divergence": result.first_divergence,
                },
                indent=2,
            )
        )
        return 0
    if result.requests is None:
        print(
            f"{args.run}: {int(s['requests'])} requests replayed in the simulator with what the "
            "gate knew of each"
        )
    else:
        print(
            f"{args.run}: {int(s['requests_e2e'])} requests ({int(s['live_attempts'])} attempts) "
            "replayed in the "
            "simulator with what the gate knew of each, and the run's patience and retry policy"
        )
    for rule, text in RULES.items():
        if s[f"replayed_{rule}"]:
            print(f"  {int(s[f'replayed_{rule}'])} engine times: {text}")
    print("outcomes, live (rows) x simulator (columns):")
    print(result.confusion.to_string())
    print(
        f"disagreements: {int(s['disagreements'])} of {int(s['requests'] - s['live_errors'])} "
        f"({s['disagreement_rate']:.1%}); live errors left out: {int(s['live_errors'])} (engine "
        "failures among "
        f"them replayed as failures: {int(s['engine_failures'])}, "
        f"{int(s['failure_disagreements'])} disagree)"
    )
    first = (
        "no divergence"
        if math.isnan(s["first_divergence_s"])
        else f"first divergence at {s['first_divergence_s']:.3f} s (gate arrival, run clock)"
    )
    print(
        f"  independent (same queue at arrival): {int(s['independent_disagreements'])}, cascade: "
        f"{int(s['cascade_disagreements'])}; {first}"
    )
    print(
        f"  by cause: rule {int(s['rule_disagreements'])} (a decision qsim.policy.decide would "
        "not give on the "
        f"numbers it was made on: a bug), timing {int(s['timing_disagreements'])} (the queues "
        "met differed, or "
        f"they parted after admission), unknown {int(s['unknown_cause_disagreements'])}"
    )
    if result.first_divergence is not None:
        print(f"  first divergence: {describe_first_divergence(result.first_divergence)}")
    print(
        f"refusal reasons of the {int(s['both_refused'])} both refused: "
        f"{int(s['reasons_agree'])} agree, "
        f"{int(s['reasons_disagree'])} differ"
    )
    if s["reasons_disagree"]:
        print(result.reasons.to_string())
    print(
        "latency error (sim - live, from the simulator's own start and hold) of the "
        f"{int(s['both_answered'])} "
        f"both answered: |error| p50 {s['latency_abs_error_p50_s'] * 1e3:.2f} ms, p90 "
        f"{s['latency_abs_error_p90_s'] * 1e3:.2f} ms, p99 "
        f"{s['latency_abs_error_p99_s'] * 1e3:.2f} ms; "
        f"mean signed {s['latency_error_mean_s'] * 1e3:+.2f} ms"
    )
    if result.requests is not None:
        print(
            f"end to end, per request (from its first send): {int(s['e2e_disagreements'])} of "
            f"{int(s['requests_e2e'])} disagree ({s['e2e_disagreement_rate']:.1%}): outcome "
            f"{int(s['e2e_outcome_disagreements'])}, attempt count "
            f"{int(s['attempt_count_disagreements'])}; attempts "
            f"live {int(s['live_attempts'])}, sim {int(s['sim_attempts'])}; abandoned live "
            f"{int(s['live_abandoned_e2e'])}, sim {int(s['sim_abandoned_e2e'])}"
        )
        print(
            f"wrote {out / 'compare.parquet'}, {out / 'requests.parquet'} and {out / 'compare.png'}"
        )
        return 0
    print(f"wrote {out / 'compare.parquet'} and {out / 'compare.png'}")
    return 0


def _print_prediction(args, result) -> int:
    table = result.table
    if args.json:
        print(
            json.dumps(
                {
                    "speed": result.speed,
                    "speed_source": result.speed_source,
                    "noise_cv": result.noise_cv,
                    "noise_source": result.noise_source,
                    "concurrency": result.concurrency,
                    "seeds": len(result.per_seed),
                    "metrics": table.to_dict(orient="index"),
                },
                indent=2,
            )
        )
        return 0
    print(
        f"{args.run}: predicted from its arrivals alone, service times from the calibrated model "
        "at speed "
        f"{result.speed:.3f} ({result.speed_source}) x lognormal noise CV {result.noise_cv:g} "
        f"({result.noise_source}), {len(result.per_seed)} seeds"
        + (
            f"; each run x (1 + {result.concurrency:g} x (busy engines - 1))"
            if result.concurrency > 0
            else ""
        )
    )
    print(
        "95 % interval: Student-t of the mean across seeds; seeds 2.5-97.5 %: where one run "
        "would land"
    )
    shown = table[
        [
            "live",
            "sim_mean",
            "ci_low",
            "ci_high",
            "seeds_p2_5",
            "seeds_p97_5",
            "error",
            "relative_error",
        ]
    ]
    print(shown.to_string(float_format=lambda v: f"{v:.4g}"))
    return 0


def _compare_parser(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="replay a live run's arrivals in the simulator, request by request",
        description="Replay a live run in the simulator with what the gate knew of "
        "each request "
        "(engine hold and engine time, failures, the server's stall "
        "rule, tracker "
        "weight and starting speed factor); report the outcome "
        "confusion matrix, "
        "independent and cascade disagreements, refusal reasons and "
        "latency error. "
        "--predict instead asks whether the simulator would have "
        "predicted the run.",
    )
    p.set_defaults(func=cmd_compare)
    p.add_argument("run", help="a run .parquet from qlab replay or qlab live")
    p.add_argument(
        "--out", help="folder for compare.parquet and compare.png (default: next to the run)"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--predict",
        action="store_true",
        help="simulate only the arrivals, service times from the calibrated model at "
        "the speed probed "
        "before the run, over --seeds seeds of noise; report share in time, "
        "goodput and p50/p99 "
        "latency against the run's, with 95 %% intervals",
    )
    p.add_argument(
        "--seeds", type=positive_int, default=20, help="--predict: seeds of the model's noise"
    )
    p.add_argument(
        "--noise-cv",
        type=non_negative,
        help="--predict: CV of the lognormal noise on modelled service times (default: "
        "the server's "
        "noise setting, recorded in the run file's engine_info; else the CV "
        "calibrated under load; "
        "0.1 where neither says)",
    )
    p.add_argument(
        "--service-model",
        metavar="CALIBRATION.json",
        help="--predict: the concurrency term and noise CV of this qlab calibrate JSON "
        "in place of the "
        "run file's (for a run from a server that did not load them)",
    )


# ------------------------------------------------------------------ live


LIVE_COLUMNS = [
    "trace",
    "policy",
    "effective_load",
    "good",
    "late",
    "rejected",
    "expired",
    "error",
    "goodput_rps",
    "good_tokens_per_s",
    "sim_disagreement_rate",
]


def cmd_live(args) -> int:
    from live import live_config

    from . import live_runner

    cfg = live_config.load(args.config)
    summary = live_runner.run(cfg, args.out, log=_live_log(args), bar=_live_bar(args))
    runs, table = Path(args.out) / "runs", Path(args.out) / "summary.parquet"
    if args.json:  # every column of the summary, one object a run
        print(
            json.dumps(
                json_ready(
                    {
                        "runs": summary.to_dict(orient="records"),
                        "rows": str(runs),
                        "summary": str(table),
                    }
                ),
                indent=2,
            )
        )
    else:
        print(summary[LIVE_COLUMNS].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        print(f"wrote {len(summary)} runs to {runs} and {table}")
    return 0 if summary["error"].sum() == 0 else 1


def _live_bar(args):
    """A bar over the runs (minutes each), on a terminal's stderr only; none with --quiet,
    --json."""
    from inputs.progress import progress_bar

    return lambda total, initial: progress_bar(
        total, unit="run", desc="live", initial=initial, quiet=args.quiet or args.json
    )


def _live_log(args):
    """Each run's lines as it goes: on stdout with the text, on stderr beside --json (stdout is one
    document), none with --quiet."""
    import sys

    if args.quiet:
        return lambda line: None
    stream = sys.stderr if args.json else sys.stdout
    return lambda line: print(line, file=stream, flush=True)


def _live_parser(sub) -> None:
    p = sub.add_parser(
        "live",
        help="run every trace under every policy against live servers",
        description="Start one qlab serve per policy, replay every trace under "
        "every policy "
        "(order rotated), probe speed before and after each run, write "
        "parquet.",
    )
    p.set_defaults(func=cmd_live)
    p.add_argument("config", help="the experiment's TOML file (see experiments/live.toml)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document instead of the table: every run's summary "
        "row, NaN as null (the lines as it goes on stderr)",
    )
    p.add_argument("--quiet", action="store_true", help="no line per run as it goes")


def register(subparsers) -> None:
    _replay_parser(subparsers)
    _calibrate_parser(subparsers)
    _compare_parser(subparsers)
    _live_parser(subparsers)
