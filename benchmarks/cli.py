"""The command line the live benchmarks share: ``--quick`` for a short smoke run, ``--json`` for
the figures."""

from __future__ import annotations

import argparse
import json
import math
from typing import Callable

import numpy as np


def _plain(value):
    """numpy numbers as Python's, and NaN (a figure with no sample) as JSON's null."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    return None if isinstance(value, float) and math.isnan(value) else value


def to_json(results: dict) -> str:
    return json.dumps(_plain(results), indent=2, default=str)


def bench_main(
    doc: str, run: Callable, report: Callable[[dict], None], quick, full, argv=None
) -> int:
    """Parse ``--quick`` and ``--json``, run with ``quick`` or ``full`` sizes, print the report
    or the JSON."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = run(quick if args.quick else full)
    if args.json:
        print(to_json(results))
    else:
        report(results)
    return 0
