"""Does the simulator replay a real server request by request? ``qlab compare`` on four live runs.

Each scenario starts its own ``qlab serve --engine synthetic`` (a fresh server: its speed
tracker starts at 1), replays a seeded trace against it open loop, exactly as ``qlab replay``
builds it (``build_trace`` at the calibrated reference line), and compares:

1. ``predictive``, nominal load 2, 30 s (seed 11): the overload case;
2. ``bounded-deadline``, nominal load 2, 30 s;
3. ``predictive`` on a noisy, failing engine (``--noise 0.3 --fail-every 7``), load 1.3, 40 s;
4. ``predictive``, a burst of 30 at once.

Printed per scenario: disagreements among the requests the service handled (target < 0.5 %),
independent vs cascade, by cause (rule or timing) and the first divergence, refusal reasons, engine
failures replayed, the latency error of requests both answered (from the simulator's own starts and
holds), and the prediction's error (``qlab compare --predict``: arrivals only, model times).
Figures are printed, never asserted.

    PYTHONPATH=. python benchmarks/compare_live.py            # ~3 minutes
    PYTHONPATH=. python benchmarks/compare_live.py --quick    # 10 s runs
    PYTHONPATH=. python benchmarks/compare_live.py --json --out /tmp/cmp   # keep the run files
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.compare import compare
from analysis.prediction import predict
from live.loadgen import ReplayConfig, lateness, replay
from live.procs import serving
from live.serve_options import ServeOptions
from qsim import ServiceModel, build_trace


@dataclass(frozen=True)
class Scenario:
    name: str
    policy: str
    arrivals: str = "poisson"
    load: float | None = 2.0  # None: a burst, whose size sets its rate
    seconds: float | None = 30.0
    requests: int | None = None
    noise: float = 0.0
    fail_every: int = 0
    seed: int = 11


SCENARIOS = (
    Scenario("predictive-load2", "predictive"),
    Scenario("bounded-deadline-load2", "bounded-deadline"),
    Scenario(
        "noisy-failing-load1.3", "predictive", load=1.3, seconds=40.0, noise=0.3, fail_every=7
    ),
    Scenario("burst30", "predictive", arrivals="burst:30", load=None, seconds=None, requests=30),
)


def run_one(sc: Scenario, logs: Path, quick: bool, out: Path | None, seeds: int) -> dict:
    seconds = None if sc.seconds is None else (10.0 if quick else sc.seconds)
    trace = build_trace(
        None,
        arrivals=sc.arrivals,
        load=sc.load,
        engines=1,
        seconds=seconds,
        requests=sc.requests,
        default_seconds=40.0,
        seed=sc.seed,
        model=ServiceModel(),
    )
    options = ServeOptions(policy=sc.policy, noise=sc.noise, fail_every=sc.fail_every, seed=sc.seed)
    with serving([options], logs, 120, prefix=sc.name) as (server,):
        run = replay(trace, ReplayConfig(server.url))
    if out is not None:
        run.to_parquet(out / f"{sc.name}.parquet", index=False)
    s = compare(run).summary
    pred = predict(run, seeds=seeds).table  # the noise and the speed as the run file records them
    late = lateness(run)
    return {
        "scenario": sc.name,
        **{
            k: s[k]
            for k in (
                "requests",
                "disagreements",
                "disagreement_rate",
                "independent_disagreements",
                "cascade_disagreements",
                "rule_disagreements",
                "timing_disagreements",
                "unknown_cause_disagreements",
                "first_divergence_s",
                "both_refused",
                "reasons_agree",
                "engine_failures",
                "failure_disagreements",
                "live_errors",
                "both_answered",
                "latency_abs_error_p50_s",
                "latency_abs_error_p99_s",
                "replayed_estimate",
                "live_good",
                "live_late",
                "live_rejected",
                "live_expired",
            )
        },
        "send_lateness_p99_s": late["p99_s"],
        **{
            f"predict_{m}_{c}": float(pred.loc[m, c])
            for m in pred.index
            for c in ("live", "sim_mean", "ci_low", "ci_high", "relative_error")
        },
    }


def describe(r: dict) -> str:
    first = "none" if math.isnan(r["first_divergence_s"]) else f"{r['first_divergence_s']:.2f} s"
    handled = r["requests"] - r["live_errors"]
    lines = [
        f"{r['scenario']}: {r['requests']:.0f} requests (good {r['live_good']:.0f}, late "
        f"{r['live_late']:.0f}, "
        f"rejected {r['live_rejected']:.0f}, expired {r['live_expired']:.0f}, errors "
        f"{r['live_errors']:.0f}); "
        f"send lateness p99 {r['send_lateness_p99_s'] * 1e3:.2f} ms",
        f"  disagreements {r['disagreements']:.0f} of {handled:.0f} non-error "
        f"({r['disagreement_rate']:.2%}): "
        f"independent {r['independent_disagreements']:.0f}, cascade "
        f"{r['cascade_disagreements']:.0f}; by cause "
        f"rule {r['rule_disagreements']:.0f}, timing {r['timing_disagreements']:.0f}, unknown "
        f"{r['unknown_cause_disagreements']:.0f}; first divergence {first}",
        f"  refusal reasons agree {r['reasons_agree']:.0f}/{r['both_refused']:.0f}; engine "
        "failures "
        f"{r['engine_failures']:.0f} ({r['failure_disagreements']:.0f} disagree); never started, "
        "replayed with the "
        f"estimate at arrival: {r['replayed_estimate']:.0f}",
        f"  latency |error| of {r['both_answered']:.0f} both answered: p50 "
        f"{r['latency_abs_error_p50_s'] * 1e3:.3f} ms, "
        f"p99 {r['latency_abs_error_p99_s'] * 1e3:.3f} ms",
    ]
    pred = "  predicted (arrivals only):"
    for m in ("share_good", "goodput_rps", "latency_p50_s", "latency_p99_s"):
        pred += (
            f" {m} live {r[f'predict_{m}_live']:.3g} sim {r[f'predict_{m}_sim_mean']:.3g} "
            f"[{r[f'predict_{m}_ci_low']:.3g}, {r[f'predict_{m}_ci_high']:.3g}] "
            f"({r[f'predict_{m}_relative_error']:+.1%});"
        )
    return "\n".join(lines + [pred])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 s runs instead of 30-40 s")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", help="comma-separated scenario names")
    ap.add_argument("--seeds", type=int, default=20, help="seeds of the prediction")
    ap.add_argument("--out", help="folder to keep the run files in")
    args = ap.parse_args(argv)
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only.split(",")]
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for sc in chosen:
            rows.append(run_one(sc, Path(logs), args.quick, out, args.seeds))
            if not args.json:
                print(describe(rows[-1]), flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
