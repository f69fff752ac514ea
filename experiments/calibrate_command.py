"""``qlab calibrate``: fit the service model on a live server (:mod:`live.calibrate`), save it, and
hand it to the gate with ``--apply``.
"""

from __future__ import annotations

import argparse
import json

import httpx

from inputs.argtypes import positive_int

from .jsonout import json_ready, saying


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
    say = saying(args.json)
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


def register(subparsers) -> None:
    _calibrate_parser(subparsers)
