"""``qlab replay``: an open-loop replay of a trace against a live server (:mod:`live.loadgen`), or
another tool's results imported as a run file; what the run's text and ``--json`` say of it. Here,
above both live and analysis, so that :mod:`live` never imports :mod:`analysis`.

Each command takes the parsed args and returns an exit status; bad input is a
ValueError, which the ``qlab`` entry point prints as one line (exit 2).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pandas as pd

from inputs import clientflags
from inputs.argtypes import count, positive, positive_int, renamed
from inputs.atomic import write_parquet
from qsim import ServiceModel, build_trace, records
from qsim.records import OUTCOMES
from qsim.runfile import SPEED_PROBES
from qsim.arrivals import ARRIVALS, arrivals_take_load
from qsim.workload import dataset_rows, load_at_rate

from live.contract import Stats
from live.live_config import DEFAULT_NOMINAL_LOAD, DEFAULT_SECONDS

from .jsonout import json_ready, saying
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
    from analysis.replay_inputs import engine_time_ratio, measured_speed

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
    from analysis.replay_inputs import engine_time_ratio, measured_speed

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
    from live.loadgen_clients import check_patience

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
    say = saying(args.json)
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


def register(subparsers) -> None:
    _replay_parser(subparsers)
