"""``qlab capacity``'s command line: the options into a search (:mod:`experiments.capacity`) or,
with ``--rate``, a sizing search (:mod:`experiments.sizing`), and their tables printed. Apart from
both so that neither search imports the other's command."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path


from analysis.objectives import parse_objectives, written
from inputs import clientflags
from inputs.argtypes import positive, positive_int
from inputs.policyflags import parse_args, policy_spec
from qsim import PRESETS
from qsim.engines import Batching, OneAtATime
from qsim.routers import ROUTERS, router_spec

from . import engineflags, sizing
from .capacity import Bounds, Search, run, search_config, table
from .config import SweepConfig
from .jsonout import json_ready
from .simflags import add_admission_at, add_workload_options


def _batching_table(args) -> dict | None:
    """The [batching] table of ``--batching`` and its options (``qlab simulate``'s), or None:
    engines one at a time. Its step model only where --step gives one: else the --service-model
    calibration's (the sweep's rule), else the default. ValueError for an option of a batching
    engine without --batching (or --concurrency with it)."""
    engine = engineflags.engine_from_args(args)
    if not isinstance(engine, Batching):
        return None
    settings = {k: v for k, v in asdict(engine).items() if k != "step" and v is not None}
    return {**(asdict(engine.step) if args.step is not None else {}), **settings}


def _service_table(args) -> dict | None:
    """The [service] table: ``file``, the --service-model calibration (its line, concurrency term
    and noise, as a sweep's [service] file), or --concurrency inline; ValueError for both."""
    if args.service_model and args.concurrency is not None:
        raise ValueError(
            "--concurrency with --service-model: the calibration's concurrency term "
            "is the search's "
            "(a sweep's [service] file); give one"
        )
    if args.service_model:
        return {"file": str(Path(args.service_model).resolve())}
    return {"concurrency": args.concurrency} if args.concurrency else None


def config_from_args(args) -> SweepConfig:
    """The search's config from ``qlab capacity``'s options (the workload options are ``qlab
    simulate``'s)."""
    if args.mean_service is not None and args.service == "mix":
        raise ValueError(
            "--mean-service applies to exponential and deterministic service, not to the mix"
        )
    if args.seeds < 2:
        raise ValueError("--seeds must be at least 2: the interval is across seeds")
    # --noise where given; else the calibration's (a [service] file's noise), else none.
    settings = {
        "fixed_estimate": args.fixed_estimate,
        **({"noise_cv": args.noise} if args.noise is not None else {}),
    }
    if args.service != "mix":
        settings.update(
            service_dist=args.service,
            **({"mean_service_s": args.mean_service} if args.mean_service is not None else {}),
        )
    batching = _batching_table(args)
    if args.prompts is not None:
        settings["prompts"] = args.prompts.spec
    # A batching sweep runs one engine per cell (its table says so); its step model times the speed.
    grid = {"speed": [args.speed], **({} if batching else {"engines": [args.engines]})}
    for key, value in (
        ("deadline_s", args.deadline),
        ("max_queue", args.max_queue),
        ("used", args.used),
        ("speed_schedule", args.speed_schedule),
        ("patience", args.patience),
        ("ttft_slo_s", args.ttft_slo),
        ("tpot_slo_s", args.tpot_slo),
    ):
        if value is not None:
            grid[key] = [value]
    clientflags.from_args(args)  # the patience and retry flags, checked as simulate checks them
    if args.patience_until is not None:
        settings["patience_until"] = args.patience_until
    grid.update(_fleet_grid(args))
    pairs = parse_args(args.policy_arg)
    return search_config(
        args.policy,
        args.arrivals or ["poisson"],
        seconds=args.seconds,
        seeds=args.seeds,
        first_seed=args.seed,
        sweep_settings=settings,
        grid=grid,
        policy_args={p: dict(pairs) for p in args.policy} if pairs else None,
        service=_service_table(args),
        retry=clientflags.retry_table(args) or None,
        batching=batching,
    )


def _fleet_grid(args) -> dict:
    """The fleet axes of --replicas, --router (repeated: an axis), --router-d and --admission-at;
    a sizing search (--rate) holds one replica as a placeholder, its counts the points searched.
    ValueError for a router or an admission place without a fleet, and for --replicas beside
    --rate."""
    grid = _fleet_axes(args)
    if args.admission_at is not None:
        if not grid:
            raise ValueError(
                "--admission-at is where a fleet admits: give --replicas N > 1 (or "
                "--rate R, the replicas searched)"
            )
        grid["admission_at"] = [args.admission_at]
    return grid


def _fleet_axes(args) -> dict:
    """_fleet_grid's replicas and routers."""
    if args.rate is not None and args.replicas is not None:
        raise ValueError(
            "--rate searches the fewest replicas; give --replicas N (a fleet's "
            "capacity) or --rate R (the replicas at a rate), not both"
        )
    if args.router_d is not None and "power_of_d" not in (args.router or []):
        raise ValueError("--router-d is power_of_d's choices: give --router power_of_d")
    routers = [
        router_spec(r, args.router_d if r == "power_of_d" else None) for r in args.router or []
    ]
    if args.rate is not None:
        return {"replicas": [1], "router": routers or ["round_robin"]}
    if (args.replicas or 1) == 1:
        if routers:
            raise ValueError(
                "--router routes between --replicas N > 1 (or, with --rate, the replicas searched)"
            )
        return {}
    return {"replicas": [args.replicas], "router": routers or ["round_robin"]}


def _bounds(args) -> Bounds:
    """The load search's bounds (each option's default where not given); a sizing search (--rate)
    searches replicas, so it takes none of them."""
    given = {
        k: v
        for k, v in (
            ("start", args.start),
            ("min_load", args.min_load),
            ("max_load", args.max_load),
            ("tolerance", args.tolerance),
        )
        if v is not None
    }
    if args.rate is not None and given:
        flag = "--" + next(iter(given)).replace("_", "-")
        raise ValueError(
            f"{flag} bounds a search over load; --rate searches replicas (--max-replicas)"
        )
    if args.rate is None and args.max_replicas is not None:
        raise ValueError("--max-replicas bounds a sizing search: give --rate R")
    return Bounds(**given)


def _header(cfg: SweepConfig, each: bool = False) -> str:
    """The cells' arrivals, engines (and fleet, or ``each`` replica's) and speed, in words."""
    engine = cfg.engine() or OneAtATime(cfg.grid["engines"][0], cfg.concurrency)
    replicas = cfg.grid.get("replicas", (1,))[0]
    fleet = "each replica " if each else f"{replicas} replicas of " if replicas > 1 else ""
    return (
        f"{', '.join(cfg.arrival_processes)} arrivals, {fleet}{engineflags.describe(engine)}, "
        f"speed {cfg.grid['speed'][0]:g}"
    )


def cmd_capacity(args) -> int:
    began = time.perf_counter()
    bounds = _bounds(args)
    if args.rate is not None:
        return _cmd_sizing(args, began)
    spec = Search(config_from_args(args), parse_objectives(args.objective), bounds)
    show = not args.quiet and not args.json and sys.stderr.isatty()
    outcome = run(
        spec,
        args.out,
        workers=args.workers,
        scheduler=args.scheduler,
        log=lambda line: show and print(f"qlab capacity: {line}", file=sys.stderr, flush=True),
    )
    if args.json:
        print(json.dumps(json_ready([r.record() for r in outcome.results]), indent=2))
        return 0
    cfg = spec.config
    print(
        f"capacity: the highest load at which {written(spec.objective)} holds for the mean of "
        f"{cfg.seeds} seeds of "
        f"{cfg.duration_s:g} s; {_header(cfg)}"
    )
    print(table(outcome.results, spec.bounds).to_string(index=False))
    print(
        "95 % interval: from the last load met surely to the first failed surely, by the seeds' "
        "t-intervals "
        f"(docs/capacity.md); brackets within {spec.bounds.tolerance:.0%}"
    )
    print(
        f"{outcome.ran} cells run ({outcome.reused} already done) in "
        f"{time.perf_counter() - began:.1f} s "
        f"-> {args.out}"
    )
    return 0


def _cmd_sizing(args, began: float) -> int:
    """--rate: the fewest replicas meeting the objective at the rate, per policy and router."""
    spec = sizing.Sizing(
        config_from_args(args),
        parse_objectives(args.objective),
        rate_rps=args.rate,
        max_replicas=args.max_replicas or sizing.MAX_REPLICAS,
    )
    show = not args.quiet and not args.json and sys.stderr.isatty()
    outcome = sizing.run(
        spec,
        args.out,
        workers=args.workers,
        scheduler=args.scheduler,
        log=lambda line: show and print(f"qlab capacity: {line}", file=sys.stderr, flush=True),
    )
    if args.json:
        print(json.dumps(json_ready([a.record(spec.rate_rps) for a in outcome.answers]), indent=2))
        return 0
    cfg = spec.config
    print(
        f"sizing: the fewest replicas at which {written(spec.objective)} holds for the mean of "
        f"{cfg.seeds} seeds of {cfg.duration_s:g} s at {spec.rate_rps:g} requests/s; "
        f"{_header(cfg, each=True)}"
    )
    print(sizing.table(outcome.answers, spec).to_string(index=False))
    print(
        "95 % interval: from the fewest replicas not failed surely to the fewest met surely, "
        "by the seeds' t-intervals (docs/capacity.md); load each: each replica's load at the "
        "answer"
    )
    print(
        f"{outcome.ran} cells run ({outcome.reused} already done) in "
        f"{time.perf_counter() - began:.1f} s -> {args.out}"
    )
    return 0


def _router_name(text: str) -> str:
    from .cli import router_name  # simulate's check of a router's name, where it lives

    return router_name(text)


def register(sub) -> None:
    p = sub.add_parser(
        "capacity",
        help="the highest load at which each policy meets an objective",
        description="Search each policy's capacity: the highest load at which an "
        "objective over a run's "
        "summary (e.g. 'share_good>=0.9') holds for the mean of the "
        "seeds, by bracketing "
        "and bisection over load with the same seeds at every load, and "
        "its 95 % interval. "
        "The cells run are written as a sweep dataset (qlab summary, "
        "qlab plot); re-running "
        "resumes.",
    )
    p.set_defaults(func=cmd_capacity)
    p.add_argument(
        "--policy",
        action="append",
        required=True,
        type=policy_spec,
        metavar="POLICY",
        help=f"a preset ({', '.join(PRESETS)}) or module:Class (repeat for several)",
    )
    p.add_argument(
        "--objective",
        required=True,
        help="METRIC>=NUMBER (or <=, >, <) over a cell summary's metrics, several "
        "joined with 'and', "
        "e.g. 'share_good>=0.9' or 'share_good>=0.9 and latency_p99_s<=2'",
    )
    p.add_argument(
        "--seconds",
        type=positive,
        default=300.0,
        help="simulated seconds of arrivals per run (default 300)",
    )
    p.add_argument("--start", type=positive, help="the first load tried (default 1)")
    p.add_argument("--min-load", type=positive, help="the lowest load tried (default 0.01)")
    p.add_argument("--max-load", type=positive, help="the highest load tried (default 10)")
    p.add_argument(
        "--tolerance",
        type=positive,
        help="stop when each crossing's bracket is narrower than this share of its "
        "load (default 0.02)",
    )
    p.add_argument(
        "--replicas",
        type=positive_int,
        metavar="N",
        help="the capacity of a fleet: N replicas of the server behind --router "
        "(the load each replica's)",
    )
    p.add_argument(
        "--router",
        action="append",
        type=_router_name,
        metavar="NAME",
        help=f"{', '.join(ROUTERS)} (repeat for several; default round_robin)",
    )
    p.add_argument(
        "--router-d", type=positive_int, metavar="D", help="power_of_d's choices (default 2)"
    )
    add_admission_at(p)
    p.add_argument(
        "--rate",
        type=positive,
        metavar="R",
        help="sizing: the fewest replicas that meet the objective at R requests per "
        "second, for each policy and router (in place of a search over load)",
    )
    p.add_argument(
        "--max-replicas",
        type=positive_int,
        metavar="N",
        help="--rate: the most replicas tried (default 64)",
    )
    add_workload_options(p, seeds=10, several_arrivals=True)
    engineflags.add_flags(p)
    p.add_argument(
        "--out",
        required=True,
        help="output folder: a sweep dataset (created; resumed if it holds this search)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print a list of {policy, arrivals, load, ci_low, ci_high, fails_at, "
        "rate_rps, loads_tried}",
    )
    p.add_argument("--workers", type=positive_int, help="local processes (default: all cores)")
    p.add_argument(
        "--scheduler", help="run on an existing dask.distributed cluster, e.g. tcp://HOST:8786"
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on a terminal")
