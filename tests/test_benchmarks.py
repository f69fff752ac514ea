"""The benchmark scripts must keep running (their figures are printed, never asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_qsim_quick_runs_and_reports_every_implementation():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/bench_qsim.py", "--quick", "--json"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    text = json.dumps(data)
    for needle in ("qlab", "plain SimPy"):
        assert needle in text
