"""How much memory does a long simulation take when its records stream to parquet? Flat, whatever
its length.

Target (issue 21, section 5): records stream to parquet in row groups as a run goes; a run of 2
million requests, which took 1.69 GB in memory (0.84 KB a request), stays under 300 MB at its peak,
and flat up to 20 million. The workload keeps its queue bounded: the ``predictive`` policy at load
1.3 on the reference mix (Poisson arrivals, one engine, seed 1). Each figure is one child process's
peak resident memory (``getrusage``'s ru_maxrss, imports included: pandas, pyarrow, scipy and simpy
alone take about 200 MB), with its process time:

* stream: ``qsim.stream.simulate_to_parquet`` on ``TracePlan.chunks`` (what ``qlab simulate --out``
  runs), at each size: flat when the largest size's peak is within 10 % of the smallest's;
* in memory: ``simulate`` on ``make_trace``'s whole trace, then ``DataFrame.to_parquet`` (what
  ``--out`` ran before), at the target's size, for the ratio;
* cli: ``qlab simulate --requests N --out F`` in-process (``experiments.cli.main``), the
  summary it prints included (issue 32, item 8: it read every record back, 670-740 MB at 2
  million), at the target's size: the same target, under 300 MB.

    PYTHONPATH=. python benchmarks/bench_memory.py            # stream at 200,000 and 2 million, in
    memory at 2 million PYTHONPATH=. python benchmarks/bench_memory.py --full     # and stream at 20
    million (an hour or more on one core) PYTHONPATH=. python benchmarks/bench_memory.py --quick
    # 20,000 and 100,000 (a smoke test) PYTHONPATH=. python benchmarks/bench_memory.py --cli-only #
    qlab simulate --out alone, 2 million PYTHONPATH=. python benchmarks/bench_memory.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_MB = 300.0  # peak at the target's size
TARGET_REQUESTS = 2_000_000
FLAT = 0.10  # the largest size's peak at most this much above the smallest's
BEFORE = {"peak_mb": 1690.0, "requests": 2_000_000}  # issue 21's figure for the in-memory run
#: Issue 32, item 8: qlab simulate --out at 2 million, its summary from every record read back.
CLI_BEFORE_MB = (670.0, 740.0)
WORKLOAD = dict(arrivals="poisson", load=1.3, seed=1)
POLICY = "predictive"
ROOT = Path(__file__).resolve().parents[1]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(mode: str, requests: int, out: str) -> dict:
    """One run in this process: its peak memory, its time and what it wrote."""
    import pyarrow.parquet as pq

    from qsim import PRESETS, make_trace, simulate
    from qsim.stream import CHUNK, simulate_to_parquet
    from qsim.workload import plan_trace

    imports_mb = _peak_mb()
    start, cpu = time.perf_counter(), time.process_time()
    if mode == "stream":
        info = simulate_to_parquet(
            plan_trace(requests=requests, **WORKLOAD).chunks(CHUNK), out, PRESETS[POLICY]
        )
        written = {
            "rows": info.rows,
            "row_groups": pq.ParquetFile(out).num_row_groups,
            "slots": info.slots,
        }
    elif mode == "cli":
        written = _cli(requests, out)
    else:
        frame = simulate(make_trace(requests=requests, **WORKLOAD), PRESETS[POLICY])
        frame.to_parquet(out, index=False)
        written = {"rows": len(frame), "row_groups": None, "slots": requests}
    return {
        "mode": mode,
        "requests": requests,
        "peak_mb": _peak_mb(),
        "imports_mb": imports_mb,
        "seconds": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu,
        **written,
    }


def _cli(requests: int, out: str) -> dict:
    """``qlab simulate --out`` as a user runs it, its printed summary swallowed."""
    import contextlib
    import io

    import pyarrow.parquet as pq

    from experiments.cli import main

    argv = [
        "simulate",
        "--policy",
        POLICY,
        "--arrivals",
        WORKLOAD["arrivals"],
        "--load",
        str(WORKLOAD["load"]),
        "--seed",
        str(WORKLOAD["seed"]),
        "--requests",
        str(requests),
        "--out",
        out,
    ]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        if main(argv) != 0:
            raise RuntimeError("qlab simulate failed")
    meta = pq.ParquetFile(out).metadata
    return {
        "rows": meta.num_rows,
        "row_groups": meta.num_row_groups,
        "slots": None,
        "printed_lines": printed.getvalue().count("\n"),
    }


def measure(mode: str, requests: int) -> dict:
    """:func:`child` in a fresh process, so that each peak is its own."""
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                mode,
                str(requests),
                os.path.join(folder, "records.parquet"),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"the {mode} run of {requests:,} requests failed:\n{proc.stderr}")
    row = json.loads(proc.stdout)
    row["kb_per_request"] = row["peak_mb"] * 1024 / requests
    row["kb_per_request_above_imports"] = (row["peak_mb"] - row["imports_mb"]) * 1024 / requests
    row["cpu_us_per_request"] = row["cpu_s"] * 1e6 / requests
    return row


def verdicts(rows: list[dict]) -> dict:
    cli = [r for r in rows if r["mode"] == "cli"]
    cli_verdict = (
        None
        if not cli
        else {
            "requests": cli[0]["requests"],
            "peak_mb": cli[0]["peak_mb"],
            "target_mb": TARGET_MB,
            "before_mb": CLI_BEFORE_MB,
            "verdict": "PASS" if cli[0]["peak_mb"] < TARGET_MB else "MISS",
        }
    )
    if not any(r["mode"] == "stream" for r in rows):
        return {"cli": cli_verdict}
    streamed = sorted((r for r in rows if r["mode"] == "stream"), key=lambda r: r["requests"])
    at_target = max(streamed, key=lambda r: (r["requests"] <= TARGET_REQUESTS, r["requests"]))
    smallest, largest = streamed[0], streamed[-1]
    growth = largest["peak_mb"] / smallest["peak_mb"] - 1
    memory = [r for r in rows if r["mode"] == "memory" and r["requests"] == at_target["requests"]]
    return {
        "cli": cli_verdict,
        "peak": {
            "requests": at_target["requests"],
            "peak_mb": at_target["peak_mb"],
            "target_mb": TARGET_MB,
            "target_requests": TARGET_REQUESTS,
            "verdict": "PASS" if at_target["peak_mb"] < TARGET_MB else "MISS",
        },
        "flat": {
            "from": smallest["requests"],
            "to": largest["requests"],
            "growth": growth,
            "target": FLAT,
            "verdict": "PASS" if len(streamed) > 1 and growth <= FLAT else "MISS",
        },
        "ratio": None
        if not memory
        else {
            "requests": at_target["requests"],
            "in_memory_over_stream": memory[0]["peak_mb"] / at_target["peak_mb"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="20,000 and 100,000 requests")
    size.add_argument("--full", action="store_true", help="stream 20 million requests too")
    size.add_argument(
        "--cli-only", action="store_true", help="qlab simulate --out alone, at 2 million"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--child", nargs=3, metavar=("MODE", "REQUESTS", "OUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.child:
        mode, requests, out = args.child
        print(json.dumps(child(mode, int(requests), out)))
        return 0
    sizes = (
        [20_000, 100_000]
        if args.quick
        else [200_000, TARGET_REQUESTS] + ([20_000_000] if args.full else [])
    )
    at = max(n for n in sizes if n <= TARGET_REQUESTS)
    if args.cli_only:
        rows = [measure("cli", TARGET_REQUESTS)]
        result = {
            "policy": POLICY,
            "workload": WORKLOAD,
            "rows": rows,
            "cli": verdicts(rows)["cli"],
        }
    else:
        rows = [measure("stream", n) for n in sizes] + [measure("memory", at), measure("cli", at)]
        result = {
            "policy": POLICY,
            "workload": WORKLOAD,
            "before": BEFORE,
            "rows": rows,
            **verdicts(rows),
        }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"peak memory of one run (a process each, imports included: {rows[0]['imports_mb']:.0f} "
        "MB), "
        f"{POLICY} at load {WORKLOAD['load']}, Poisson, the reference mix"
    )
    for r in rows:
        what = {
            "stream": "stream to parquet",
            "memory": "in memory, then to_parquet",
            "cli": "qlab simulate --out",
        }[r["mode"]]
        print(
            f"  {what:<27} {r['requests']:>11,} requests  peak {r['peak_mb']:6.0f} MB  "
            f"{r['kb_per_request']:6.3f} KB "
            f"a request ({r['kb_per_request_above_imports']:.3f} above the imports)  "
            f"{r['cpu_s']:7.1f} s of CPU "
            f"({r['cpu_us_per_request']:.1f} us a request)"
        )
    cli = result["cli"]
    print(
        f"qlab simulate --out at {cli['requests']:,} requests, its summary included: "
        f"{cli['peak_mb']:.0f} MB, target < {TARGET_MB:g} MB (before: "
        f"{CLI_BEFORE_MB[0]:.0f}-{CLI_BEFORE_MB[1]:.0f} MB at 2,000,000): {cli['verdict']}"
    )
    if args.cli_only:
        return 0
    peak, flat, ratio = result["peak"], result["flat"], result["ratio"]
    print(
        f"peak at {peak['requests']:,} requests: {peak['peak_mb']:.0f} MB, target < "
        f"{TARGET_MB:g} MB at "
        f"{TARGET_REQUESTS:,}: {peak['verdict']}"
        + ("" if peak["requests"] == TARGET_REQUESTS else " (a smaller run than the target's)")
    )
    print(
        f"flat from {flat['from']:,} to {flat['to']:,} requests: {flat['growth']:+.1%}, "
        f"target at most {FLAT:+.0%}: {flat['verdict']}"
    )
    if ratio:
        print(
            f"in memory at {ratio['requests']:,} requests: {ratio['in_memory_over_stream']:.1f}x "
            "the streamed "
            f"run's peak (issue 21 measured {BEFORE['peak_mb']:,.0f} MB at "
            f"{BEFORE['requests']:,})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
