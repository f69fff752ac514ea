"""Redraw the README's figures in docs/figures from the sweeps they are of.

    .venv/bin/python docs/figures/regenerate.py [--runs runs] [--workers N]

runs (or resumes) experiments/{policies,retries,estimation,stale,cancellation,batching}.toml into
RUNS/NAME (about 30 minutes on 2 cores the first time, nothing after), then writes
policies.png (every policy without clients, analysis.plots.policy_comparison),
policies_by_client.png (three policies with two tenants, analysis.plots.by_client) and the
figures `qlab plot` draws of the others (retries, recovery, estimation, stale, cancellation,
goodput_vs_refused of the batching sweep).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from analysis import plots
from experiments.cli import main as qlab

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: Sweep name -> the figures of `qlab plot` kept from it.
PLOTTED = {
    "retries": ("retries", "recovery"),
    "estimation": ("estimation",),
    "stale": ("stale",),
    "cancellation": ("cancellation",),
    "batching": ("goodput_vs_refused",),
}
TENANT_POLICIES = ["predictive", "predictive-priority", "predictive-fair"]
DPI = 110


def _run(args: list[str]) -> None:
    if qlab(args) != 0:
        raise SystemExit(f"qlab {' '.join(args)} failed")


def _policies(folder: Path) -> None:
    summary = pd.read_parquet(folder / "summary.parquet")
    by_class = pd.read_parquet(folder / "summary_by_class.parquet")
    by_client = pd.read_parquet(folder / "summary_by_client.parquet")
    alone = summary["clients"].isna()
    fig = plots.policy_comparison(summary[alone], by_class[by_class["clients"].isna()])
    fig.savefig(HERE / "policies.png", dpi=DPI)
    tenants = summary[~alone & summary["policy"].isin(TENANT_POLICIES)]
    fig = plots.by_client(by_client[by_client["policy"].isin(TENANT_POLICIES)], tenants)
    fig.savefig(HERE / "policies_by_client.png", dpi=DPI)
    plt.close("all")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs", type=Path, default=ROOT / "runs", help="where the sweeps are (default: runs)"
    )
    parser.add_argument("--workers", help="local processes of each sweep (default: all cores)")
    args = parser.parse_args(argv)
    for name in ("policies", *PLOTTED):
        _run(
            [
                "sweep",
                str(ROOT / "experiments" / f"{name}.toml"),
                "--out",
                str(args.runs / name),
                "--quiet",
                *(["--workers", args.workers] if args.workers else []),
            ]
        )
    _policies(args.runs / "policies")
    with tempfile.TemporaryDirectory() as tmp:
        for name, figures in PLOTTED.items():
            _run(["plot", str(args.runs / name), "--out", f"{tmp}/{name}"])
            for figure in figures:
                shutil.copyfile(f"{tmp}/{name}/{figure}.png", HERE / f"{figure}.png")
    print(f"wrote {2 + sum(map(len, PLOTTED.values()))} figures to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
