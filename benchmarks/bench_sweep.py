"""Wall time of the full reference sweep, and what the sweep machinery costs.

Runs ``experiments/reference.toml`` (4 policies x 10 loads x 2 speeds x 20 seeds of
600 s: 1,600 cells, about 9 million requests) with ``--workers`` local processes
into a temporary folder, and prints wall time, requests simulated per second per
worker, and -- measured in the same run as a baseline -- the rate of bare
``qsim.simulate`` calls on the same cells in this process, so the ratio shows what
writing parquet, summarising and scheduling cost. Target: under 60 s with 2
workers on a 2-core machine.

    python benchmarks/bench_sweep.py                 # the full reference sweep, 2 workers
    python benchmarks/bench_sweep.py --seeds 2       # a tenth of it
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from experiments import config, sweep
from qsim import preset, simulate

ROOT = Path(__file__).resolve().parents[1]


def baseline_rate(cfg: config.SweepConfig, sample: list[sweep.Cell]) -> float:
    """Requests per second of bare simulate() calls (trace generation excluded) on sample cells."""
    requests, seconds = 0, 0.0
    for cell in sample:
        trace = sweep._trace(cfg, cell)
        began = time.perf_counter()
        simulate(trace, preset(cell.policy), cell.engines)
        seconds += time.perf_counter() - began
        requests += len(trace)
    return requests / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "experiments" / "reference.toml"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seeds", type=int, help="override the number of seeds (smaller runs)")
    args = ap.parse_args()
    cfg = config.load(args.config)
    if args.seeds:
        cfg = dataclasses.replace(cfg, seeds=args.seeds)
    every = sweep.cells(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        summary = sweep.run(cfg, Path(tmp) / "sweep", workers=args.workers, quiet=True)
        wall = time.perf_counter() - began
    requests = int(summary["requests"].sum())
    per_worker = requests / wall / args.workers
    base = baseline_rate(cfg, every[:: max(1, len(every) // 40)])
    print(f"sweep {cfg.name}: {len(every)} cells, {requests:,} requests, {args.workers} workers")
    print(
        f"wall time: {wall:.1f} s (target < 60 s for the reference sweep with 2 workers on 2 cores)"
    )
    print(f"requests simulated per second per worker: {per_worker:,.0f}")
    print(f"baseline, bare simulate() in this process: {base:,.0f} requests/s")
    print(f"sweep rate per worker / bare simulate: {per_worker / base:.2f}")


if __name__ == "__main__":
    main()
