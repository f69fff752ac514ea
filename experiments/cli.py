"""The ``qlab`` command: one entry point, one subcommand per job.

Bad input is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import select
import signal
import sys
from dataclasses import dataclass

import pandas as pd

from analysis import metrics
from analysis.filesummary import FileSummary
from inputs import clientflags
from inputs.argtypes import (
    count,
    number,
    positive,
    positive_int,
    replica_down,
    replica_drain,
    replica_kv_blocks,
    replica_speeds,
)
from inputs.atomic import sigterm_interrupts, write_parquet
from inputs.policyflags import from_options, policy_spec
from qsim import PRESETS, ServiceModel, build_trace, simulate
from qsim.config import ServerConfig
from qsim.arrivals import arrivals_take_load
from qsim.mixes import REFERENCE_MIX
from qsim.workload import DEFAULT_LOAD, load_at_rate
from qsim.fleet import FleetSpec
from qsim.records import OUTCOMES
from qsim.routers import ROUTERS, make_router, parse_weights
from qsim.service import SpeedSchedule, parse_schedule
from qsim.stream import CHUNK, RecordWriter, stream_run
from qsim.tracefiles import build_chunks

from . import engineflags
from .config_grid import parse_used
from .jsonout import json_ready as _json_ready
from .simflags import (
    add_admission_at,
    add_dataset_flags,
    add_trace_flags,
    add_workload_options,
    dataset_from_args,
    trace_window,
)


class UsageError(Exception):
    """Bad input from the command line: reported in one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print the whole usage first
        raise UsageError(f"{self.prog}: error: {message}")


# ------------------------------------------------------------------ theory


def cmd_theory(args) -> int:
    from analysis.validation import TOO_WIDE, check, shown, standard_scenarios, tally
    from inputs.progress import progress_bar

    scenarios = standard_scenarios(args.scale)
    # A minute or two of silence otherwise: one tick per replication, on a terminal's stderr only.
    with progress_bar(
        len(scenarios) * args.replications, unit="run", desc="theory", quiet=args.quiet or args.json
    ) as bar:
        table = check(
            scenarios,
            replications=args.replications,
            seed=args.seed,
            level=args.level,
            workers=args.workers,
            on_each=lambda: bar.update(1),
        )
    counts = tally(table)
    if args.json:
        print(json.dumps(_json_ready(table.to_dict(orient="records")), indent=2))
    else:
        attrs = table.attrs
        print(
            f"closed forms against qsim: {attrs['replications']} replications from seed "
            f"{attrs['seed']}, "
            f"{attrs['level']:.0%} simultaneous intervals ({attrs['level_each']:.4f} each, "
            f"Bonferroni over {len(table)})"
        )
        print(shown(table).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        judged = counts["pass"] + counts["fail"]
        wide = (
            f"; {counts['too wide']} too wide to judge (half-width over {TOO_WIDE:.0%} of the "
            "value: "
            "run longer with --scale or more --replications)"
            if counts["too wide"]
            else ""
        )
        print(f"{counts['pass']} of {judged} judged rows inside their interval{wide}")
    return 1 if counts["fail"] or (args.strict and counts["too wide"]) else 0


# ------------------------------------------------------------------ simulate


@dataclass(frozen=True)
class _SeedRun:
    seed: int
    frame: pd.DataFrame | None  # None: streamed to --out, summarised from the file (stats)
    duration_s: float
    stats: FileSummary | None = None
    rows: int = 0

    def summary(self) -> dict:
        return self.stats.summary() if self.stats else metrics.summary(self.frame, self.duration_s)

    def by_class(self) -> pd.DataFrame:
        if self.stats:
            return self.stats.by_class()
        return metrics.by_class(self.frame, self.duration_s)

    def by_replica(self, replicas: int) -> pd.DataFrame:
        if self.stats:
            return self.stats.by_replica(replicas)
        return metrics.by_replica(self.frame, replicas)

    def timed(self) -> bool:
        """Whether the run has token times to show (a batching engine's, or TTFT objectives)."""
        if self.stats:
            return self.stats.timed
        frame = self.frame
        return bool(frame["kv_blocks_peak"].notna().any() or frame["ttft_slo_s"].notna().any())


def _describe(args, policy, engine, fleet: FleetSpec | None = None) -> str:
    bound = "" if policy.max_queue is None else f", max queue {policy.max_queue}"
    # A process that brings its own rate (a burst) has no load to state.
    rate = "" if args.rate is None else f"{args.rate:g} requests/s, "
    at = (
        f" at {rate}load {DEFAULT_LOAD if args.load is None else args.load:g}"
        if not args.trace and arrivals_take_load(args.arrivals)
        else ""
    )
    what = (
        f"trace {args.trace} ({_window(args)})"
        if args.trace
        else f"{args.arrivals} arrivals{at}, "
        + ("lengths from --dataset, " if args.dataset else f"{args.service} service, ")
        + (f"{args.seconds:g} s" if args.seconds else f"{args.requests} requests")
    )
    seeds = (
        f"seed {args.seed}"
        if args.seeds == 1
        else (f"seeds {args.seed}..{args.seed + args.seeds - 1}")
    )
    speeds = (
        ""
        if fleet is None or fleet.speeds is None
        else f" (speeds {','.join(f'{v:g}' for v in fleet.speeds)})"
    )
    if fleet is not None and fleet.kv_blocks is not None:
        speeds += f", KV blocks {','.join(map(str, fleet.kv_blocks))}"
    if fleet is not None and fleet.down:
        speeds += "".join(f", replica {r} down {a:g}-{b:g} s" for r, a, b in fleet.down)
    if fleet is not None and fleet.drain:
        speeds += "".join(f", replica {r} draining {a:g}-{b:g} s" for r, a, b in fleet.drain)
    gate = "" if fleet is None or fleet.admission == "replica" else ", admitted at the gate,"
    replicas = (
        ""
        if fleet is None
        else f"{fleet.replicas} replicas{speeds} behind {_router_words(fleet)}{gate} of "
    )
    return (
        f"policy {policy.name}{bound}, deadline {policy.deadline_s:g} s, {replicas}"
        f"{engineflags.describe(engine)}, speed {args.speed:g}, {what}, {seeds}"
    )


def _router_words(fleet: FleetSpec) -> str:
    """The router by name, with its parameters (a router is a dataclass of them)."""
    router = fleet.router
    params = ", ".join(
        f"{f.name} {getattr(router, f.name)}"
        for f in dataclasses.fields(router)
        if getattr(router, f.name) is not None
    )  # None: the router's default
    return f"router {router.name}" + (f" ({params})" if params else "")


def _fleet_from_args(args, config: ServerConfig) -> FleetSpec | None:
    """The fleet --replicas and --router ask for (None: one server), checked against the server."""
    if args.replicas == 1:
        given = [
            flag
            for flag, value in (
                ("--router", args.router),
                ("--router-d", args.router_d),
                ("--router-weights", args.router_weights),
                ("--replica-speeds", args.replica_speeds),
                ("--replica-down", args.replica_down or None),
                ("--replica-drain", args.replica_drain or None),
                ("--replica-kv-blocks", args.replica_kv_blocks),
                ("--admission-at", args.admission_at),
            )
            if value is not None
        ]
        if given:
            raise UsageError(
                f"qlab simulate: error: {', '.join(given)}: a fleet's options, for --replicas N > 1"
            )
        return None
    try:
        weights = None if args.router_weights is None else parse_weights(args.router_weights)
        router = make_router(args.router or "round_robin", args.router_d, weights)
        fleet = FleetSpec(
            args.replicas,
            router,
            speeds=replica_speeds(args.replica_speeds),
            down=tuple(map(replica_down, args.replica_down or ())),
            admission=args.admission_at or "replica",
            drain=tuple(map(replica_drain, args.replica_drain or ())),
            kv_blocks=replica_kv_blocks(args.replica_kv_blocks),
        )
        fleet.check(config)
    except ValueError as exc:
        raise UsageError(f"qlab simulate: error: {exc}") from None
    return fleet


def _balance_across_seeds(runs: list["_SeedRun"], fleet: FleetSpec) -> pd.DataFrame:
    return metrics.across_seeds(
        pd.DataFrame([metrics.fleet_balance(r.by_replica(fleet.replicas)) for r in runs])
    )


def _print_fleet(runs: list["_SeedRun"], fleet: FleetSpec) -> None:
    """Per replica (one run), the load imbalance and Jain's index over replicas."""
    if len(runs) == 1:
        table = runs[0].by_replica(fleet.replicas)
        balance = metrics.fleet_balance(table)
        print(f"\nby replica ({_router_words(fleet)}):")
        print(_fmt(table))
        print(
            f"load imbalance (busiest replica's busy seconds over the mean): "
            f"{balance['load_imbalance']:.3f}; Jain's index over replicas: "
            f"{balance['jain_replicas']:.4f}"
        )
        return
    ci = _balance_across_seeds(runs, fleet)
    print(f"\nfleet balance ({_router_words(fleet)}), mean and 95 % CI over seeds:")
    print(_fmt(ci))


def _window(args) -> str:
    """The part of the trace file a run takes, and at what rate, in words."""
    part = ("" if args.seconds is None else f"{args.seconds:g} s from ") + (
        "the start" if args.start is None else f"{args.start:g} s"
    )
    rate = (
        f"time scale {args.time_scale:g}"
        if args.load is None
        else (f"scaled to load {args.load:g}")
    )
    return rate if args.start is None and args.seconds is None else f"{part}, {rate}"


def _fmt(table: pd.DataFrame) -> str:
    return table.to_string(float_format=lambda v: f"{v:.4g}")


def _print_single(run: _SeedRun) -> None:
    s = run.summary()
    n = max(s["requests"], 1)
    shown = [o for o in OUTCOMES if o in ("good", "late", "rejected", "expired") or s[o]]
    counts = pd.DataFrame({"count": [int(s[o]) for o in shown]}, index=shown)
    counts["share"] = counts["count"] / n
    print(_fmt(counts))
    print(f"share in time (good): {s['share_good']:.3f}")
    print(f"goodput: {s['goodput_rps']:.3f} requests/s, {s['good_tokens_per_s']:.1f} good tokens/s")
    if "attempts_per_request" in s:
        print(
            f"retries: {s['attempts_per_request']:.3f} attempts per request; end to end (from "
            "the first send) "
            f"{s['share_good_e2e']:.3f} in time, goodput {s['goodput_e2e_rps']:.3f} requests/s; "
            f"Retry-After adherence {s['retry_after_adherence']:.3f}"
        )
    print(
        f"latency of the answered: p50 {s['latency_p50_s']:.3f} s, p99 {s['latency_p99_s']:.3f} s"
    )
    if "prefix_cache_hit_rate" in s:
        hits, queries = s["prefix_cache_hits"], s["prefix_cache_queries"]
        print(
            f"prefix cache: {hits:.0f} of {queries:.0f} prompt "
            f"tokens looked up were cached (hit rate {s['prefix_cache_hit_rate']:.3f})"
        )
    if run.timed():
        print(
            f"time to first token: p50 {s['ttft_p50_s']:.3f} s, p99 {s['ttft_p99_s']:.3f} s; "
            "time per output "
            f"token: p50 {s['tpot_p50_s']:.4f} s, p99 {s['tpot_p99_s']:.4f} s"
        )
    cls = run.by_class()
    cols = [
        "requests",
        "good",
        "late",
        "rejected",
        "expired",
        "share_good",
        "goodput_rps",
        "good_tokens_per_s",
        "latency_p50_s",
        "latency_p99_s",
    ]
    print("\nby size class (max_new_tokens up to):")
    print(_fmt(cls[cols]))


SEED_METRICS = [
    "good",
    "late",
    "rejected",
    "expired",
    "share_good",
    "goodput_rps",
    "good_tokens_per_s",
    "latency_p50_s",
    "latency_p99_s",
]


RETRY_METRICS = [
    "attempts_per_request",
    "share_good_e2e",
    "goodput_e2e_rps",
    "retry_after_adherence",
]


def _seed_tables(runs: list[_SeedRun]) -> tuple[pd.DataFrame, pd.DataFrame]:
    overall = pd.DataFrame([r.summary() for r in runs])
    shown = SEED_METRICS + [
        m for m in ("abandoned", "error", *RETRY_METRICS) if m in overall and overall[m].any()
    ]
    per_class = pd.concat([r.by_class().assign(seed=r.seed) for r in runs]).reset_index()
    ci = metrics.across_seeds(overall[shown])
    by_class = {
        cls: metrics.across_seeds(part[SEED_METRICS])
        for cls, part in per_class.groupby("size_class", sort=False)
    }
    stacked = pd.concat(by_class, names=["size_class", "metric"])
    order = sorted(by_class, key=metrics._class_key)
    return ci, stacked.loc[order]


def _print_seeds(runs: list[_SeedRun]) -> None:
    ci, by_class = _seed_tables(runs)
    print(f"mean and 95 % confidence interval over {len(runs)} seeds:")
    print(_fmt(ci))
    wide = by_class["mean"].unstack("metric")[SEED_METRICS]
    half = ((by_class["ci_high"] - by_class["ci_low"]) / 2).unstack("metric")[SEED_METRICS]
    print("\nby size class, mean over seeds:")
    print(_fmt(wide))
    print("\nby size class, 95 % CI half-width:")
    print(_fmt(half))


def cmd_simulate(args) -> int:
    policy = from_options(args.policy, args.policy_arg, args.max_queue, args.deadline)
    if args.trace and args.trace_conflicts:
        raise UsageError(
            "qlab simulate: error: --trace replaces "
            f"{', '.join(args.trace_conflicts)}; give one or the other"
        )
    if args.time_scale != 1.0 and not args.trace:
        raise UsageError("qlab simulate: error: --time-scale applies only with --trace")
    if args.rate is not None and (args.load is not None or args.trace):
        with_trace = " (with --trace: --load or --time-scale)" if args.trace else ""
        raise UsageError(
            "qlab simulate: error: --rate sets synthetic arrivals' rate; give "
            f"--rate or --load{with_trace}"
        )
    window = trace_window(args, args.load, "--load")
    if not args.trace and args.seconds is None and args.requests is None:
        args.seconds = 600.0
    model = ServiceModel.load(args.service_model) if args.service_model else ServiceModel()
    patience, retry = clientflags.from_args(args)
    engineflags.calibrated_defaults(args)
    engine = engineflags.engine_from_args(args)
    policy = engineflags.with_objectives(policy, args)
    dataset = dataset_from_args(args)
    options = engineflags.trace_options(args, engine, REFERENCE_MIX, model, dataset)
    # The speed schedule's factors are over the calibration; the trace's own speed is where it
    # starts.
    schedule = (
        None
        if args.speed_schedule is None
        else SpeedSchedule(args.speed, parse_schedule(args.speed_schedule))
    )

    def workload(seed: int) -> dict:
        return dict(
            window=window,
            time_scale=args.time_scale,
            arrivals=args.arrivals,
            service=args.service,
            load=args.load,
            engines=args.engines * args.replicas,
            speed=args.speed,
            seconds=args.seconds,
            requests=args.requests,
            seed=seed,
            model=model,
            mean_service_s=args.mean_service,
            noise_cv=args.noise,
            patience=patience,
            used=None if args.used is None else parse_used(args.used),
            **options,
        )

    def server(seed: int) -> ServerConfig:
        return ServerConfig(policy, engine, model, fixed_estimate=args.fixed_estimate, seed=seed)

    if args.rate is not None:  # the load at which the same workload sends that rate
        options_at = {
            k: v for k, v in workload(args.seed).items() if k not in ("window", "time_scale")
        }
        try:
            args.load = load_at_rate(args.rate, **options_at)
        except ValueError as exc:
            raise UsageError(f"qlab simulate: error: --rate: {exc}") from None
    fleet = _fleet_from_args(args, server(args.seed))
    if fleet is not None and "capacity_rps" in options:  # the load is each batching replica's
        options["capacity_rps"] *= fleet.replicas
    seeds = range(args.seed, args.seed + args.seeds)
    # What does not stream runs whole: retries, a prefix cache, shared prefixes (qsim.stream).
    whole = (
        (retry is not None and retry.retries)
        or "prefixes" in options
        or getattr(engine, "prefix_caching", False)
    )
    if args.out and not whole:
        runs = _streamed_runs(args, seeds, workload, server, schedule, fleet)
    else:
        runs = []
        for seed in seeds:
            trace = build_trace(args.trace, **workload(seed))
            frame = simulate(
                trace,
                server(seed),
                retry=retry,
                speed_schedule=schedule,
                **(
                    {}
                    if fleet is None
                    else dict(
                        replicas=fleet.replicas,
                        router=fleet.router,
                        replica_speeds=fleet.speeds,
                        replica_down=fleet.down,
                        admission_at=fleet.admission,
                        replica_drain=fleet.drain,
                        replica_kv_blocks=fleet.kv_blocks,
                    )
                ),
            )
            runs.append(_SeedRun(seed, frame, trace.duration_s))
        if args.out:
            rows = pd.concat(
                [r.frame.assign(seed=r.seed, policy=policy.name) for r in runs], ignore_index=True
            )
            write_parquet(rows, args.out)  # whole or not at all: an interrupt leaves no half file
    if args.json:
        out = {
            "config": {k: v for k, v in vars(args).items() if k not in ("func", "trace_conflicts")},
            "policy": policy.__dict__,
        }
        if dataset is not None:
            out["dataset"] = dataset.summary()
        if len(runs) == 1:
            run = runs[0]
            out["summary"] = run.summary()
            out["by_class"] = run.by_class().to_dict(orient="index")
            if fleet is not None:
                table = run.by_replica(fleet.replicas)
                out["fleet"] = {
                    "router": fleet.router.name,
                    **metrics.fleet_balance(table),
                    "by_replica": table.to_dict(orient="index"),
                }
        else:
            ci, by_class = _seed_tables(runs)
            out["seeds"] = [r.seed for r in runs]
            out["summary"] = ci.to_dict(orient="index")
            out["by_class"] = {
                cls: part.droplevel(0).to_dict(orient="index")
                for cls, part in by_class.groupby(level=0, sort=False)
            }
            if fleet is not None:
                out["fleet"] = {
                    "router": fleet.router.name,
                    **_balance_across_seeds(runs, fleet).to_dict(orient="index"),
                }
        print(json.dumps(_json_ready(out), indent=2))
        return 0
    print(_describe(args, policy, engine, fleet))
    if dataset is not None:
        print(dataset.describe())
    if len(runs) == 1:
        _print_single(runs[0])
    else:
        _print_seeds(runs)
    if fleet is not None:
        _print_fleet(runs, fleet)
    if args.out:
        print(
            f"\nwrote {sum(r.rows if r.frame is None else len(r.frame) for r in runs)} rows "
            f"to {args.out}"
        )
    return 0


def _streamed_runs(
    args, seeds, workload, server, schedule, fleet: FleetSpec | None
) -> list[_SeedRun]:
    """Each seed's run streamed to ``--out`` as it goes (qsim.stream: its records never sit in
    memory all at once), then summarised from the file a row group at a time
    (analysis.filesummary): reading the records back whole took more memory than the run."""
    finished = []
    with RecordWriter(args.out) as writer:
        for seed in seeds:
            config = server(seed)
            info = stream_run(
                build_chunks(CHUNK, args.trace, **workload(seed)),
                writer,
                config,
                speed_schedule=schedule,
                fleet=fleet,
                columns={"seed": seed, "policy": config.policy.name},
            )
            finished.append((seed, info.duration_s, info.rows))
    return [
        _SeedRun(seed, None, duration_s, FileSummary(args.out, seed, duration_s), rows)
        for seed, duration_s, rows in finished
    ]


def router_name(text: str) -> str:
    """A built-in router's name (qsim.routers.ROUTERS), as argparse checks a type."""
    if text not in ROUTERS:
        raise argparse.ArgumentTypeError(
            f"unknown router {text!r}; choose one of {', '.join(ROUTERS)}"
        )
    return text


def _simulate_parser(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a policy on a seeded workload or a trace file",
        description="Simulate one admission policy in front of K engines and print "
        "outcomes, "
        "goodput and latency, by size class too.",
    )
    p.set_defaults(func=cmd_simulate)
    p.add_argument(
        "--policy",
        type=policy_spec,
        default="none",
        metavar="POLICY",
        help=f"a preset ({', '.join(PRESETS)}) or module:Class, a qsim.policy.Policy of your own",
    )
    p.add_argument(
        "--load",
        type=positive,
        help="utilisation at the simulated speed: lambda = LOAD * K / E[true S] "
        f"(default {DEFAULT_LOAD:g}; "
        "burst:N and periodic:N:PERIOD_S take none; with --trace: the file's "
        "rate, scaled to it)",
    )
    p.add_argument(
        "--rate",
        type=positive,
        metavar="R",
        help="arrivals at R requests per second in place of --load: load = R over "
        "the rate at load 1, i.e. R x SPEED x E[true S] / (K x replicas) "
        "(docs/simulate.md)",
    )
    length = p.add_mutually_exclusive_group()
    length.add_argument(
        "--seconds",
        type=positive,
        help="arrival window (default 600; with "
        "--trace: the file's "
        "whole length, or N seconds of it from "
        "--start)",
    )
    length.add_argument(
        "--requests", type=positive_int, help="number of requests instead of a window"
    )
    add_trace_flags(p, load_flag="--load")
    add_dataset_flags(p, "each request's prompt and output lengths from its rows")
    add_workload_options(p)
    p.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="replicas of the server (each --engines K, its own line and admission) "
        "behind --router; the load is each replica's (default 1: one server)",
    )
    p.add_argument(
        "--router",
        type=router_name,
        metavar="NAME",
        help=f"which replica an arrival goes to: {', '.join(ROUTERS)} (default "
        "round_robin; central: one shared line in front of every replica, "
        "each request bound where it starts)",
    )
    p.add_argument(
        "--router-d",
        type=positive_int,
        metavar="D",
        help="power_of_d's choices (default 2); least_ttft's (default all)",
    )
    p.add_argument(
        "--router-weights",
        metavar="NAME=W,...",
        help="weighted's weights of its scores prefix, queue and kv "
        "(default prefix=2,queue=1,kv=1)",
    )
    p.add_argument(
        "--replica-speeds",
        metavar="S,S,...",
        help="each replica's speed over the server's, one per replica (e.g. 1,1,0.5: "
        "the third takes twice as long); the load counts speed 1 for all",
    )
    p.add_argument(
        "--replica-down",
        action="append",
        metavar="R:FROM:TO",
        help="replica R fails at FROM s and is back at TO s (repeatable): what runs "
        "and waits there ends in error, the router sends nothing there meanwhile",
    )
    p.add_argument(
        "--replica-drain",
        action="append",
        metavar="R:FROM:TO",
        help="replica R drains from FROM s to TO s (repeatable): the router sends nothing "
        "there meanwhile, what it holds (running and waiting) runs to its end",
    )
    p.add_argument(
        "--replica-kv-blocks",
        metavar="B,B,...",
        help="each batching replica's KV memory in blocks, one per replica (e.g. 800,800,400: "
        "the third holds half as many tokens); the load counts --kv-blocks for all",
    )
    add_admission_at(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--out",
        help="write every request's record to this .parquet file, in row "
        "groups as the run "
        "goes (in memory first with --retry)",
    )
    engineflags.add_flags(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="qlab",
        description="Admission control in front of LLM engines: simulate, check, compare.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser(
        "theory",
        help="check the simulator against every closed form",
        description="Simulate M/M/1, M/M/1/K, M/M/c, M/M/c/c, M/M/c/K, M/D/1, "
        "M/G/1, priority, "
        "impatient-client and batching-engine cases and compare each "
        "with its closed form "
        "inside a confidence interval. A row whose interval's "
        "half-width exceeds 25 %% of the "
        "value is too wide to judge, neither pass nor fail. Exit 1 "
        "when a judged row fails.",
    )
    t.set_defaults(func=cmd_theory)
    t.add_argument(
        "--json",
        action="store_true",
        help="print a list of {case, quantity, theory, "
        "sim_mean, ci_low, "
        "ci_high, control, rel_half_width, inside, "
        "verdict}",
    )
    t.add_argument(
        "--strict", action="store_true", help="exit 1 also when a row is too wide to judge"
    )
    t.add_argument("--quiet", action="store_true", help="no progress bar on a terminal")
    t.add_argument("--replications", type=number(int, 1), default=10)
    t.add_argument("--seed", type=count, default=1)
    t.add_argument("--level", type=positive, default=0.95, help="simultaneous confidence level")
    t.add_argument("--scale", type=positive, default=1.0, help="multiply every run's length")
    t.add_argument("--workers", type=positive_int, help="processes (default: all cores)")
    _simulate_parser(sub)
    for register in _command_modules():
        register(sub)
    return parser


def _command_modules():
    """Subcommands that live beside the code they drive: each module has register(subparsers).

    A registered command's function takes the parsed args and returns an exit status;
    a ValueError or OSError it raises becomes one line on stderr and exit status 2.
    """
    import importlib

    found = []
    for name in (
        "experiments.commands",
        "live.commands",
        "experiments.replay_command",
        "experiments.calibrate_command",
        "experiments.compare_command",
        "experiments.live_command",
        "experiments.study.runner",
        "experiments.capacity_cli",
    ):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a missing dependency inside the module is a real error
                raise
            continue
        found.append(module.register)
    return found


def _stdout_closed() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has gone: poll reports an error or
    hang-up on it."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() here (Windows), or stdout is no file
        return False


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "level", 0.5) >= 1:
            raise UsageError("qlab theory: error: --level must be below 1")
        # SIGTERM as SIGINT: a writing command (simulate --out, replay --out, sweep) removes its
        # temporary file on the way out instead of leaving a hidden .partial or .tmp-PID behind
        # ("interrupted", exit 130). A server (own_signals) stops on SIGTERM its own way:
        # gracefully, then dying by the signal, which a service manager counts as a clean stop.
        own = getattr(args, "own_signals", False)
        with contextlib.nullcontext() if own else sigterm_interrupts():
            return args.func(args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
    except BrokenPipeError as exc:  # before OSError, of which it is one
        if not _stdout_closed():
            print(f"qlab: error: {exc}", file=sys.stderr)
            return 2
        # `qlab ... | head`: the reader has gone, which is no error of ours. Point stdout at
        # /dev/null so that the interpreter's last flush at exit finds nowhere to fail either, and
        # exit as SIGPIPE would have.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (ValueError, OSError) as exc:
        print(f"qlab: error: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        # An interrupt inside asyncio.run (qlab replay) can leave a task whose cancellation raised
        # destroyed at exit, which asyncio reports with a traceback: noise after a stop on purpose.
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        print("qlab: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
