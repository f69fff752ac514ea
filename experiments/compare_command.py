"""``qlab compare``: a live run replayed in the simulator request by request
(:mod:`analysis.compare`), or with ``--predict`` predicted from its arrivals alone
(:mod:`analysis.prediction`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from inputs.argtypes import non_negative, positive_int
from inputs.atomic import write_parquet
from qsim import records
from qsim.service import LoadTerms


def cmd_compare(args) -> int:
    from analysis.compare import compare, figure
    from analysis.diagnosis import describe_first_divergence
    from analysis.prediction import predict
    from analysis.replay_inputs import RULES

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


def register(subparsers) -> None:
    _compare_parser(subparsers)
