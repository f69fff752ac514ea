"""Sweeps: a grid of cells, each simulated once, written to a parquet dataset.

Layout of ``OUT``::

    manifest.json              config, its sha256, qlab version, seeds, cell count, and what load
                               means
    cells/<cell_id>.parquet    one file per cell: its per-request rows (qsim schema + cell columns);
                               the cell's summaries ride in the file's metadata
    summary.parquet            one row per cell: parameters, outcome counts, goodput, latency
    summary_by_class.parquet   one row per cell and size class
    summary_by_client.parquet  one row per cell and client, for cells with clients ([clients] sets)
    summary_by_priority.parquet  one row per cell and priority, for cells with more than one
    timeseries.parquet         one row per cell and second (analysis.metrics.over_time): offered
                               attempts, goodput; for sweeps with a retry or patience axis or surge
                               arrivals

Crash safety: every file is written under a temporary name and renamed into
place, so a file that exists is whole. Resuming: a cell whose file exists is
skipped. A changed config refuses to write into a folder holding another's cells, and so
does a folder written when a sweep's ``load`` was nominal (its manifest lacks ``load_meaning``).
Interrupting (Ctrl-C: SIGINT to the parent and its workers) stops handing out
cells and ends with KeyboardInterrupt, which ``qlab`` reports in one line with
exit status 130; nothing half-written is left. Pool workers ignore SIGINT (an
idle one would print a traceback): they finish the cells they hold, whose
results are dropped, so stopping takes up to one cell's time. A sweep killed outright
(SIGKILL) cleans nothing up: its pool workers end with it (see
:func:`experiments.sweep_workers.worker_start`). On a dask cluster the workers are the
cluster's, not the sweep's: when the sweep (a client) dies, its connection closes and the
scheduler drops its tasks at once; the workers stay, idle.
Determinism: a cell's rows depend only on the config and the cell, so any
executor and any number of workers give the same rows.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import math
import json
import os
import platform
from concurrent.futures import ProcessPoolExecutor, as_completed
import dataclasses
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from analysis import estimation, metrics
from inputs import run_axes
from inputs.atomic import atomic_write, clear_temporaries, parquet_bytes
from qsim import build_trace, simulate
from qsim.config import ServerConfig
from qsim.engines import OneAtATime
from qsim.routers import parse_router
from qsim.arrivals import parse_arrivals
from qsim.mixes import Prompts, blended_means, used_mean_s

from .config import ConfigError, SweepConfig
from .config_grid import parse_speed_schedule, parse_used, shared_prefix
from .sweep_workers import worker_start

META_KEY = b"qlab.cell"

#: What a sweep's ``load`` is, recorded in the manifest. Before this field existed a sweep's load
#: was nominal (arrival rate over the *calibrated* capacity, so load 1 at speed 2.25 was 2.25x
#: utilisation); such a folder's cells with speed != 1 are of another workload and are not resumed.
LOAD_MEANING = "utilisation-at-simulated-speed"


class _CellAxes:
    """What a cell is beyond its fields: its id, and its axes by group."""

    @property
    def id(self) -> str:
        # A cell without clients, retries, patience (or any optional axis) keeps the id it had
        # before those axes existed (its file is resumed).
        fields = {k: v for k, v in asdict(self).items() if not (k in OPTIONAL_AXES and v is None)}
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def group(self, name: str):
        """The cell's axes of group ``name`` (inputs.run_axes.GROUPS: "batching", "fleet", ...)."""
        return run_axes.group(self, name)


#: One point of the grid and one seed: every axis of inputs.run_axes, flat, in its CELL_ORDER (a
#: cell's id hashes its fields by name, so the order is its columns', not its id's).
Cell = dataclasses.make_dataclass(
    "Cell",
    run_axes.cell_fields(),
    bases=(_CellAxes,),
    frozen=True,
    namespace={"__module__": __name__, "__doc__": "One point of the grid and one seed."},
)

#: Cell fields whose axis a sweep may lack: a cell without them has its old id, and its rows and
#: summary carry their column only when the sweep has the axis (clients' always).
OPTIONAL_AXES = tuple(name for name, axis in run_axes.AXES.items() if axis.optional)
#: The axes of what the controller knows: a sweep with any of them gets the estimation columns
#: (analysis.estimation).
ESTIMATION_AXES = tuple(name for name, axis in run_axes.AXES.items() if axis.estimation)
#: The arrow type of each axis's column where a cell has None (a TOML type's).
_ARROW = {str: pa.large_string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}


def _swept(config: SweepConfig) -> set[str]:
    """The sweep's axes: its grid's, and policy_args where a grid policy has a list of a
    parameter's values."""
    variants = any(None not in config.policy_variants(name) for name in config.grid["policy"])
    return set(config.grid) | ({"policy_args"} if variants else set())


def _params(config: SweepConfig, cell: Cell) -> dict:
    """The cell's parameters as its rows and summary carry them: each optional axis but clients
    (always carried) only in sweeps with that axis, so an older sweep's columns are unchanged."""
    swept = _swept(config)
    return {k: v for k, v in asdict(cell).items() if _carried(k) or k in swept}


def _carried(name: str) -> bool:
    """Whether every sweep's rows carry the axis's column (not an optional one's, but clients')."""
    axis = run_axes.AXES[name]
    return not axis.optional or axis.in_every_row


def arrivals_of(config: SweepConfig, cell: Cell) -> str:
    """The cell's arrival process: the grid's arrivals axis, else [sweep] arrivals."""
    return cell.arrivals if cell.arrivals is not None else config.arrivals


def _surge(config: SweepConfig, cell: Cell) -> tuple[float, float] | None:
    """(start_s, end_s) of the cell's surge of arrivals, or None (other arrivals, or a trace
    file)."""
    if cell.trace is not None:
        return None
    kind, numbers = parse_arrivals(arrivals_of(config, cell))
    return (numbers[0], numbers[0] + numbers[1]) if kind == "surge" else None


def _keeps_over_time(config: SweepConfig) -> bool:
    """Whether cells keep their time series: sweeps of surges, retries or impatient clients,
    which change in time."""
    return (
        "retry" in config.grid
        or "patience" in config.grid
        or any(parse_arrivals(a)[0] == "surge" for a in config.arrival_processes)
    )


def cells(config: SweepConfig) -> list[Cell]:
    """Every cell of the grid, in a fixed order (seeds innermost); a policy with lists in its
    [policy_args] has a cell for each combination of their values (beside it, in the policy axis's
    place)."""
    policies = [
        (name, label) for name in config.grid["policy"] for label in config.policy_variants(name)
    ]
    # policy_args rides with its policy (a (name, label) pair); every other axis in CELL_ORDER
    axes = {name: _values(config, name) for name in run_axes.CELL_ORDER if name != "policy_args"}
    axes["policy"] = policies
    out = []
    for combo in itertools.product(*axes.values()):
        fields = dict(zip(axes, combo))
        fields["policy"], fields["policy_args"] = fields["policy"]
        out.append(Cell(**fields))
    return out


def _values(config: SweepConfig, name: str) -> tuple:
    """An axis's values in the cells: the grid's (its "none" sentinel None), else its default
    (None where it needs an axis that the grid lacks); a seed's, [sweep]'s seeds."""
    if name == "seed":
        return tuple(range(config.first_seed, config.first_seed + config.seeds))
    axis = run_axes.AXES[name]
    if axis.needs is not None and axis.needs not in config.grid:
        return (None,)
    return tuple(None if v == axis.none else v for v in config.grid.get(name, axis.default))


def _engine(config: SweepConfig, cell: Cell):
    """The cell's batching engine (its step model times the cell's speed), or None: engines one
    at a time."""
    engine = config.engine(**asdict(cell.group("batching")))
    if engine is None or cell.speed == 1.0:
        return engine
    step = engine.step
    return dataclasses.replace(
        engine,
        step=dataclasses.replace(
            step,
            b0=step.b0 * cell.speed,
            b1=step.b1 * cell.speed,
            b2=step.b2 * cell.speed,
            b3=step.b3 * cell.speed,
        ),
    )


def all_engines(cell: Cell) -> int:
    """The engines of the cell's whole fleet (its server's, times its replicas): a fleet's load is
    each replica's, so its arrivals are those of one server with all of them."""
    return cell.engines * (cell.replicas or 1)


def fleet_of(cell: Cell) -> dict:
    """simulate's fleet options for the cell ({}: one server)."""
    fleet = cell.group("fleet")
    if fleet.replicas is None:
        return {}
    return {
        "replicas": fleet.replicas,
        "router": parse_router(fleet.router or "round_robin"),
        **({} if fleet.admission_at is None else {"admission_at": fleet.admission_at}),
    }


def capacity_rps(config: SweepConfig, cell: Cell) -> float:
    """Requests per second at load 1 of the cell (its whole fleet): load x this is its rate."""
    batch = _capacity(config, cell)
    if batch is not None:
        return batch[0]
    return all_engines(cell) / (cell.speed * _mean_times(config, cell)[0])


def load_of(config: SweepConfig, cell: Cell) -> float | None:
    """The cell's load: the grid's, or its rate over its capacity_rps (the rate at load 1)."""
    return cell.load if cell.rate is None else cell.rate / capacity_rps(config, cell)


def _mean_times(config: SweepConfig, cell: Cell) -> tuple[float, float]:
    """The mean true service seconds at speed 1 and mean new tokens that the cell's load counts."""
    mix, clients = config.mixes[cell.mix], config.clients.get(cell.clients, ())
    mean_s, mean_tokens = blended_means(mix, clients, config.service)
    if cell.used is not None:  # capacity in the work requests actually do, as the load counts it
        mean_s = used_mean_s(mix, clients, config.service, parse_used(cell.used))
    if config.mean_service_s is not None:  # exponential or deterministic service of a given mean
        mean_s = config.mean_service_s
        mean_tokens = float(config.service.tokens_for(mean_s))
    return mean_s, mean_tokens


def _capacity(config: SweepConfig, cell: Cell) -> tuple[float, float] | None:
    """A batching cell's saturated throughput (requests/s, tokens/s) for its mix and prompts, its
    whole fleet's (each replica one engine); None otherwise."""
    engine = _engine(config, cell)
    if engine is None:
        return None
    _, mean_tokens = blended_means(
        config.mixes[cell.mix], config.clients.get(cell.clients, ()), config.service
    )
    rps = engine.capacity_rps(Prompts.parse(config.prompts).mean(), mean_tokens) * (
        cell.replicas or 1
    )
    return rps, rps * mean_tokens


# ------------------------------------------------------------------ one cell


@dataclass(frozen=True)
class CellResult:
    cell_id: str
    summary: dict
    by_class: list[dict]
    parquet: bytes  # the cell's file, encoded in the worker so the parent only writes bytes


def _trace(config: SweepConfig, cell: Cell):
    # A sweep's load is make_trace's: utilisation at the simulated speed (lambda = load * K / E[true
    # S]), so load 1 at speed 2.25 arrives 2.25x more slowly than load 1 at speed 1 (the study's
    # definition). A batching engine's load is of its saturated throughput (Batching.capacity_rps;
    # its speed is in its steps).
    capacity = _capacity(config, cell)
    options = {} if capacity is None or cell.trace is not None else {"capacity_rps": capacity[0]}
    if config.prompts != "none" and cell.trace is None:
        options["prompts"] = Prompts.parse(config.prompts)
    shared = shared_prefix(cell.system_prompt or config.system_prompt, cell.turns or config.turns)
    if shared is not None and cell.trace is None:  # a trace file's prompts are its own
        options["prefixes"] = shared
    return build_trace(
        None if cell.trace is None else config.trace_path(cell.trace),
        time_scale=cell.time_scale or 1.0,
        arrivals=arrivals_of(config, cell),
        load=load_of(config, cell),
        service=config.service_dist,
        mean_service_s=config.mean_service_s,
        engines=all_engines(cell),
        speed=cell.speed,
        seconds=config.duration_s,
        seed=cell.seed,
        mix=config.mixes[cell.mix],
        model=config.service,
        noise_cv=config.noise_cv,
        clients=config.clients.get(cell.clients, ()),
        patience=config.patience(cell.patience),
        used=None if cell.used is None else parse_used(cell.used),
        **options,
    )


def _policy(config: SweepConfig, cell: Cell):
    """The cell's policy: the grid's, with the bound, deadline, estimator and cutting at the
    deadline that the grid sets."""
    axes = cell.group("admission")
    policy = config.policy(axes.policy, axes.policy_args).with_overrides(
        max_queue=axes.max_queue, deadline_s=axes.deadline_s
    )
    # The Policy's own fields that the group sets (not fixed_estimate: the server's, nor those
    # naming the policy); the bound and deadline are with_overrides'.
    own = {f.name for f in dataclasses.fields(policy)} - {"name", "max_queue", "deadline_s"}
    changes = {k: v for k, v in asdict(axes).items() if k in own and v is not None}
    return dataclasses.replace(policy, **changes) if changes else policy


def run_cell(config: SweepConfig, cell: Cell) -> CellResult:
    """Simulate one cell: its rows as parquet bytes, and its summaries."""
    policy = _policy(config, cell)
    trace = _trace(config, cell)
    schedule = (
        None
        if cell.speed_schedule is None
        else parse_speed_schedule(cell.speed_schedule, cell.speed)
    )
    fixed = config.fixed_estimate if cell.fixed_estimate is None else cell.fixed_estimate
    engine = _engine(config, cell)
    # engines one at a time, slowing each other by the calibrated concurrency term (if any)
    if engine is None:
        engine = OneAtATime(cell.engines, config.concurrency)
    server = ServerConfig(policy, engine, config.service, fixed_estimate=fixed, seed=cell.seed)
    frame = simulate(
        trace,
        server,
        retry=config.retries.get(cell.retry),
        speed_schedule=schedule,
        **fleet_of(cell),
    )
    mean_s, mean_tokens = _mean_times(config, cell)
    engines = all_engines(cell)
    # The effective bound and deadline (the preset's unless the grid overrides them).
    params = {
        "cell_id": cell.id,
        **_params(config, cell),
        "max_queue": policy.max_queue,
        "deadline_s": policy.deadline_s,
    }
    seconds = metrics.run_duration(frame, trace.duration_s)
    summary = {
        **params,
        **metrics.summary(frame, trace.duration_s),
        "duration_s": seconds,
        "offered_load": float(trace.true_service_s.sum() / (seconds * engines)),
        "capacity_rps": capacity_rps(config, cell),
        "capacity_tokens_per_s": engines * mean_tokens / (cell.speed * mean_s),
    }
    if cell.replicas is not None:  # how evenly the router spread the work
        summary.update(metrics.fleet_balance(metrics.by_replica(frame, cell.replicas)))
    batch_capacity = _capacity(config, cell)
    # a batching engine: what it can serve saturated, and what it did
    if batch_capacity is not None:
        summary.update(
            capacity_rps=batch_capacity[0],
            capacity_tokens_per_s=batch_capacity[1],
            offered_load=float(len(trace) / seconds / batch_capacity[0]),
            preempted_share=float(frame["preemptions"].fillna(0).gt(0).mean()),
            kv_blocks_peak_p99=float(frame["kv_blocks_peak"].dropna().quantile(0.99))
            if frame["kv_blocks_peak"].notna().any()
            else math.nan,
        )
    # what the estimates got wrong, and what cutting saved
    if any(axis in config.grid for axis in ESTIMATION_AXES):
        change = None if schedule is None or not schedule.steps else schedule.steps[0][0]
        summary.update(estimation.cell_summary(frame, engines, change_s=change))
    # every cell of a retry sweep has the end-to-end view, its no-retry baseline too
    if "retry" in config.grid:
        summary.update(metrics.retry_summary(frame, seconds))
    over_time = None
    if _keeps_over_time(config):
        series = metrics.over_time(frame, until_s=seconds)
        over_time = {k: series[k].tolist() for k in series.columns}
        surge = _surge(config, cell)
        if surge is not None:
            summary.update(metrics.recovery(series, *surge))

    def _grouped(column: str, table: pd.DataFrame) -> list[dict]:  # one JSON-ready row per group
        return [
            {**params, column: None if pd.isna(label) else label, **row}
            for label, row in zip(table.index, table.to_dict(orient="records"))
        ]

    by_class = _grouped("size_class", metrics.by_class(frame, trace.duration_s))
    groups = {}
    # By client where the rows have more than one (those naming none count as one, <NA>), with
    # Jain's index across the named; by priority where they have more than one priority.
    if frame["client_id"].nunique(dropna=False) > 1:
        clients = metrics.by_client(frame, trace.duration_s)
        groups["by_client"] = _grouped("client_id", clients)
        summary.update(metrics.client_fairness(clients))
    if frame["priority"].nunique() > 1:
        groups["by_priority"] = _grouped("priority", metrics.by_priority(frame, trace.duration_s))
    # Rows keep their own per-request deadline_s.
    columns = {k: v for k, v in params.items() if k != "deadline_s"}
    rows = frame.assign(**columns)
    table = pa.Table.from_pandas(rows, preserve_index=False)
    # A parameter that is None in this cell (no client set, no queue bound) would be a column of
    # arrow type null, which a dataset of the cells cannot read beside another cell's typed one
    # (cast to null is unsupported): give it its axis's type. The values (all null) are unchanged.
    for name in columns.keys() & run_axes.AXES.keys():
        i = table.schema.get_field_index(name)
        if pa.types.is_null(table.schema.field(i).type):
            kind = _ARROW[run_axes.AXES[name].toml_type]
            table = table.set_column(i, pa.field(name, kind), table.column(i).cast(kind))
    if over_time is not None:
        groups["over_time"] = over_time
    meta = json.dumps({"summary": summary, "by_class": by_class, **groups}).encode()
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY: meta})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return CellResult(cell.id, summary, by_class, buffer.getvalue())


# ------------------------------------------------------------------ files


def _version() -> str:
    try:
        return metadata.version("qlab")
    except metadata.PackageNotFoundError:  # running from a checkout that is not installed
        return "unknown"


def manifest(config: SweepConfig, n_cells: int) -> dict:
    return {
        "config": config.canonical(),
        "config_sha256": config.digest,
        "source": config.source,
        "qlab_version": _version(),
        "python": platform.python_version(),
        "seeds": list(range(config.first_seed, config.first_seed + config.seeds)),
        "cells": n_cells,
        "load_meaning": LOAD_MEANING,
        # [service] file: the calibration the cells' line, load terms (and step model) came from.
        **({"calibration": config.calibration.record()} if config.calibration is not None else {}),
    }


def old_load_meaning(out: Path, manifest: dict) -> str | None:
    """Why a folder's ``load`` column means something else than this version's, or None if it
    does not."""
    meaning = manifest.get("load_meaning")
    if meaning == LOAD_MEANING:
        return None
    was = "nominal (of the calibrated capacity)" if meaning is None else repr(meaning)
    return (
        f"{out} was written when a sweep's load was {was}; it is now utilisation at the "
        "simulated speed "
        "(lambda = load * K / E[true S]), so its cells with speed != 1 had another arrival "
        "rate"
    )


def prepare(config: SweepConfig, out: Path, n_cells: int) -> None:
    """Create OUT, or check that it holds this very config; clear temporaries of a killed run."""
    claim(out, manifest(config, n_cells))


def claim(out: Path, written: dict) -> None:
    """Create OUT with the manifest ``written``, or check that its manifest has the same
    ``config_sha256`` (the digest of what decides the cells' rows); clear temporaries of a killed
    run."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "cells").mkdir(exist_ok=True)
    path = out / "manifest.json"
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise ConfigError(f"{path}: not a qlab sweep manifest; choose another --out") from None
        if not isinstance(old, dict):
            raise ConfigError(f"{path}: not a qlab sweep manifest; choose another --out")
        why = old_load_meaning(out, old)
        if why:
            raise ConfigError(f"{why}: re-run this config into a new --out (or remove that folder)")
        if old.get("config_sha256") != written["config_sha256"]:
            raise ConfigError(
                f"{out} holds cells of another sweep config (sha256 "
                f"{str(old.get('config_sha256'))[:12]}, "
                f"this one {written['config_sha256'][:12]}); choose another --out or remove that "
                "folder"
            )
    else:
        atomic_write(path, (json.dumps(written, indent=2) + "\n").encode())
    clear_temporaries(out / "cells")
    clear_temporaries(out)


def finished(out: Path) -> set[str]:
    return {p.stem for p in (out / "cells").glob("*.parquet")}


def read_cell_meta(path: Path) -> dict:
    return json.loads(pq.read_schema(path).metadata[META_KEY])


def write_summaries(out: Path, wanted: Iterable[str]) -> pd.DataFrame:
    """Gather the summaries of the wanted cells from their files' metadata into the tables.

    summary.parquet and summary_by_class.parquet always; summary_by_client.parquet and
    summary_by_priority.parquet when some cell has more than one client or priority (a cell
    written before those tables existed has none).
    """
    metas = [read_cell_meta(out / "cells" / f"{cid}.parquet") for cid in wanted]
    summary = pd.DataFrame([m["summary"] for m in metas])
    by_class = pd.DataFrame([row for m in metas for row in m["by_class"]])
    atomic_write(out / "summary.parquet", parquet_bytes(summary))
    atomic_write(out / "summary_by_class.parquet", parquet_bytes(by_class))
    for key, column, dtype in (
        ("by_client", "client_id", "string"),
        ("by_priority", "priority", "int64"),
    ):
        grouped = pd.DataFrame([row for m in metas for row in m.get(key, ())])
        if len(grouped):
            atomic_write(
                out / f"summary_{key}.parquet", parquet_bytes(grouped.astype({column: dtype}))
            )
    # Each cell's seconds, beside its parameters (those of the summary before its metrics: cell_id
    # .. deadline_s).
    series = [
        pd.DataFrame(m["over_time"]).assign(**_cell_columns(m["summary"]))
        for m in metas
        if "over_time" in m
    ]
    if series:
        atomic_write(
            out / "timeseries.parquet", parquet_bytes(pd.concat(series, ignore_index=True))
        )
    return summary


#: The summary's columns that are a cell's parameters (those before its metrics: cell_id ..
#: deadline_s).
PARAMETERS = ("cell_id", *run_axes.CELL_ORDER)


def _cell_columns(summary: dict) -> dict:
    return {k: summary[k] for k in PARAMETERS if k in summary}


def metric_names(summary: dict) -> list[str]:
    """A cell summary's metrics: its numbers that are not the cell's parameters (what an
    objective may name)."""
    return [
        k
        for k, v in summary.items()
        if k not in PARAMETERS and isinstance(v, (int, float)) and not isinstance(v, bool)
    ]


# ------------------------------------------------------------------ executors


#: Runs cells and yields their results as they finish (in any order).
Runner = Callable[[list[Cell]], Iterator[CellResult]]


@contextlib.contextmanager
def _local(config: SweepConfig, workers: int) -> Iterator[Runner]:
    if workers <= 1:
        yield lambda todo: (run_cell(config, cell) for cell in todo)
        return
    with ProcessPoolExecutor(
        max_workers=workers, initializer=worker_start, initargs=(os.getpid(),)
    ) as pool:

        def results(todo: list[Cell]) -> Iterator[CellResult]:
            futures = [pool.submit(run_cell, config, cell) for cell in todo]
            try:
                for future in as_completed(futures):
                    yield future.result()
            finally:
                for future in futures:
                    future.cancel()

        yield results


@contextlib.contextmanager
def _dask(config: SweepConfig, scheduler: str) -> Iterator[Runner]:
    try:
        from distributed import Client, as_completed as dask_completed
    except ImportError:
        raise ConfigError(
            "--scheduler needs dask.distributed: pip install 'qlab[cluster]'"
        ) from None
    try:
        client = Client(scheduler, timeout="10s")
    except (OSError, TimeoutError) as exc:
        raise ConfigError(f"cannot reach the dask scheduler at {scheduler}: {exc}") from None
    with client:

        def results(todo: list[Cell]) -> Iterator[CellResult]:
            futures = client.map(run_cell, [config] * len(todo), todo, pure=False)
            try:
                for future in dask_completed(futures):
                    yield future.result()
            finally:
                client.cancel(futures)

        yield results


def executor(config: SweepConfig, *, workers: int | None = None, scheduler: str | None = None):
    """A context holding local processes (``workers``, default all cores) or a dask client
    (``scheduler``), and giving a :data:`Runner` of ``config``'s cells: one pool or client for every
    batch of cells it is given."""
    return _dask(config, scheduler) if scheduler else _local(config, workers or os.cpu_count() or 1)


def store(
    out: Path, runner: Runner, todo: list[Cell], on_each: Callable[[], object] = lambda: None
) -> None:
    """Run ``todo`` and write each cell's file into OUT as it finishes (atomically: a file that
    exists is whole)."""
    for result in runner(todo):
        atomic_write(out / "cells" / f"{result.cell_id}.parquet", result.parquet)
        on_each()


def _progress(total: int, initial: int, quiet: bool):
    from inputs.progress import progress_bar

    return progress_bar(total, initial=initial, unit="cell", quiet=quiet)


def run(
    config: SweepConfig,
    out: str | Path,
    *,
    workers: int | None = None,
    scheduler: str | None = None,
    quiet: bool = False,
) -> pd.DataFrame:
    """Run every unfinished cell of ``config`` into ``out`` and return the summary (one row per
    cell)."""
    out = Path(out)
    every = cells(config)
    prepare(config, out, len(every))
    done = finished(out)
    todo = [c for c in every if c.id not in done]
    with (
        executor(config, workers=workers, scheduler=scheduler) as runner,
        _progress(len(every), len(every) - len(todo), quiet) as bar,
    ):
        store(out, runner, todo, lambda: bar.update(1))
    summary = write_summaries(out, [c.id for c in every])
    summary.attrs.update(ran=len(todo), skipped=len(every) - len(todo))
    return summary


def load_rows(out: str | Path, **equal) -> pd.DataFrame:
    """Per-request rows of a sweep, optionally only where column == value (e.g. policy="none")."""
    filters = [(k, "=", v) for k, v in equal.items()] or None
    return pd.read_parquet(Path(out) / "cells", filters=filters)
