"""The live sections' runs: each cell against its own ``qlab serve``, and its rows read back.

A cell is one run: its seconds of Poisson arrivals at its load and seed, the ``qlab serve`` options
of its server, and how long after that server's start its run begins (``lead_s``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from inputs.atomic import write_parquet

from .section import Context, read_json
from .sweeps import summaries


def _trace(cell: dict):
    from qsim import make_trace
    from qsim.mixes import UsedShare

    # The load counts the work actually done where runs stop early, as the simulated sweep's (used =
    # "study").
    return make_trace(
        "poisson",
        load=cell["load"],
        seconds=cell["seconds"],
        seed=cell["seed"],
        used=UsedShare() if cell["early_stops"] else None,
    )


def _run_cells(ctx: Context, folder: Path, cells: list[dict]) -> None:
    """Each cell against its own `qlab serve`, started together, the runs one after another; a cell
    whose run file exists is kept (resuming)."""
    from contextlib import ExitStack

    from live.loadgen import ReplayConfig, replay
    from live.procs import Server
    from live.serve_options import ServeOptions

    runs = folder / "runs"
    runs.mkdir(exist_ok=True)
    todo = [cell for cell in cells if not (runs / f"{cell['name']}.parquet").is_file()]
    (folder / "logs").mkdir(exist_ok=True)
    with ExitStack() as stack:
        servers = []
        for cell in todo:
            server = Server(
                ServeOptions(**cell["options"], port=0), folder / "logs" / f"{cell['name']}.log"
            )
            stack.callback(server.stop)
            server.spawn()
            servers.append(server)
        for cell, server in zip(todo, servers):
            server.wait_ready(180)
            _wait_lead(server.url, cell["lead_s"])
            began = time.perf_counter()
            run = replay(_trace(cell), ReplayConfig(server.url))
            write_parquet(run, runs / f"{cell['name']}.parquet")
            ctx.log(
                f"  {folder.name}: {cell['name']}: {len(run)} requests in "
                f"{time.perf_counter() - began:.1f} s"
            )


def _wait_lead(url: str, lead_s: float) -> None:
    """Wait until the server's engine has run for lead_s (its schedule_started_at in /stats is on
    this machine's monotonic clock); at once if it has, or if the engine does not say."""
    import httpx

    if lead_s <= 0:
        return
    started = (httpx.get(f"{url}/stats", timeout=10).json().get("engine") or {}).get(
        "schedule_started_at"
    )
    if isinstance(started, (int, float)):
        time.sleep(max(0.0, min(lead_s, started + lead_s - time.monotonic())))


def cells_run(cells: Callable[[Context], dict]) -> Callable[[Context, Path], None]:
    """A section's run: the cells ``cells(ctx)`` gives, each against its own server."""

    def run(ctx: Context, folder: Path) -> None:
        _run_cells(ctx, folder, cells(ctx)["cells"])

    return run


def _cell_row(cell: dict, run: pd.DataFrame) -> dict:
    """One live run: its outcomes, goodput, engine seconds and its per-request disagreement with
    the simulator."""
    from analysis import compare, metrics

    versus = compare.compare(run).summary
    row = metrics.summary(run, cell["seconds"])
    # A cut run reports no engine time: it held its engine from its start until the gate cut it.
    engine = run["engine_s"].to_numpy(dtype=float, na_value=np.nan).copy()
    cut = run["outcome"].eq("cancelled").to_numpy()
    engine[cut] = (run["server_finish_s"] - run["engine_started_s"]).to_numpy(
        dtype=float, na_value=np.nan
    )[cut]
    return {
        "requests": len(run),
        "good": int(run["outcome"].eq("good").sum()),
        "late": int(run["outcome"].eq("late").sum()),
        "cancelled": int(run["outcome"].eq("cancelled").sum()),
        "refused": int(run["outcome"].isin(["rejected", "expired"]).sum()),
        "error": int(run["outcome"].eq("error").sum()),
        "goodput_rps": row["goodput_rps"],
        "engine_s_per_s": float(np.nansum(engine)) / cell["seconds"],
        "sim_disagreements": int(versus["disagreements"]),
        "sim_disagreement_rate": versus["disagreement_rate"],
        "sim_rule_disagreements": int(versus["rule_disagreements"]),
        "sim_timing_disagreements": int(versus["timing_disagreements"]),
        "judged": len(run) - int(versus["live_errors"]),
    }


def cell_rows(folder: Path, cells: list[dict]) -> list[tuple[dict, pd.DataFrame, dict]]:
    """Each cell whose run file exists: the cell, its run, and its row (:func:`_cell_row`)."""
    out = []
    for cell in cells:
        path = folder / "runs" / f"{cell['name']}.parquet"
        if path.is_file():
            run = pd.read_parquet(path)
            out.append((cell, run, _cell_row(cell, run)))
    return out


def cells_of(folder: Path) -> list[dict]:
    """The cells of the section's inputs, as it last started."""
    return ((read_json(folder / "inputs.json") or {}).get("inputs") or {}).get("cells", [])


def sim_summary(folder: Path, name: str) -> pd.DataFrame | None:
    """The summary of simulated section NAME beside this one; None where it has not run."""
    tables = summaries(folder.parent / name)
    return None if tables is None else tables[0]
