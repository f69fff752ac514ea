"""Golden records: seeded qsim runs whose every row is fixed: a change that moves one fails.

Each run in :data:`RUNS` is a small JSON-able description (a policy preset or a discipline, an
engine model, the clients' behaviour, a trace kind); :func:`simulate_case` builds and simulates
it. ``tests/data/golden.json`` holds, per run, a digest of the whole frame and one per column
(and a few plain values: rows, outcome counts), so that a failure names the run and the columns
that moved.

Regenerate after a change that is *meant* to move rows (and say why in its commit message)::

    python tests/test_golden.py --write

Floats are digested by their exact ``repr`` (the shortest string that reads back as the same
double), not rounded: runs are deterministic on one machine and numpy (same seed, same rows),
and rounding would hide the last-bit change that a reordered sum makes, which is what this test
is here to catch. Where another platform's libm gives other last bits, regenerate there: the
column digests say which differ.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from qsim import Batching, ServerConfig, StepModel, make_trace, simulate
from qsim.clients import Patience, RetryPolicy
from qsim.policy import PRESETS, resolve
from qsim.tracefiles import TraceWindow, build_trace
from qsim.arrivals import arrivals_take_load
from qsim.mixes import Client, Prompts, UsedShare

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "data" / "golden.json"
AZURE = ROOT / "data" / "azure_llm_2023_code.csv"
#: The columns the digests cover: the record schema's when the golden file was written. A column
#: added since (cached_prompt_tokens) has tests of its own, and leaves these digests comparable.
GOLDEN_COLUMNS = (
    "request_id",
    "first_request_id",
    "attempt",
    "arrival_s",
    "size_class",
    "max_new_tokens",
    "est_service_s",
    "true_service_s",
    "deadline_s",
    "priority",
    "client_id",
    "outcome",
    "reason",
    "start_s",
    "finish_s",
    "latency_s",
    "queued_at_arrival",
    "queued_work_at_arrival_s",
    "in_service_work_at_arrival_s",
    "idle_at_arrival",
    "retry_after_s",
    "engine",
    "ttft_s",
    "tpot_s",
    "output_tokens",
    "preemptions",
    "kv_blocks_peak",
    "ttft_slo_s",
    "tpot_slo_s",
)
TENANTS = (Client("a", 0.5, 1), Client("b", 0.3, 0), Client("c", 0.2, -1))
#: A batching engine with little memory: requests are preempted at these loads.
SMALL_KV = {
    "kind": "batching",
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
    "kv_blocks": 60,
    "step": [0.004, 2e-5, 3e-4, 1e-6, 0.0],
}


def _case(policy: str, seed: int, load: float | None = 1.5, requests: int = 500, **rest) -> dict:
    return {"policy": policy, "seed": seed, "load": load, "requests": requests, **rest}


def _one_at_a_time_runs() -> dict[str, dict]:
    """One per policy preset on K engines one at a time, the disciplines no preset has, clients
    that leave (patience to the answer, to the start), that send again, and arrival processes."""
    runs = {
        f"preset-{name}": _case(
            name,
            k,
            1.4,
            400,
            engines=1 + k % 3,
            clients=name in ("predictive-fair", "predictive-priority"),
        )
        for k, name in enumerate(PRESETS)
    }
    for discipline in ("lifo", "priority", "edf", "sjf"):
        runs[f"discipline-{discipline}"] = _case(
            "bounded", 40, 1.6, 400, engines=2, clients=True, args={"discipline": discipline}
        )
    runs["patience-answer"] = _case("none", 11, engines=2, patience=["exponential:1.0", "answer"])
    runs["patience-start"] = _case(
        "bounded", 12, engines=3, patience=["lognormal:0.8:0.5", "start"]
    )
    runs["retries-exponential"] = _case(
        "bounded", 14, 2.0, engines=2, retry={"mode": "exponential", "delay_s": 0.2, "jitter": 1.0}
    )
    runs["retries-timeout"] = _case(
        "predictive", 15, 1.5, 400, retry={"mode": "fixed", "delay_s": 0.5, "timeout_s": 1.5}
    )
    kinds = ("burst:300", "surge:2:3:4.0", "gamma:3", "periodic:40:1.0")
    for seed, kind in enumerate(kinds, 17):
        runs[f"arrivals-{kind}"] = _case(
            "bounded-deadline", seed, 1.2, 400, engines=2, arrivals=kind
        )
    runs["azure-one-at-a-time"] = _case(
        "predictive", 21, 1.3, None, engines=4, trace="azure", seconds=60.0
    )
    return runs


def _batching_runs() -> dict[str, dict]:
    """A batching engine with KV memory and preemption, under the presets made for it and others;
    with noise and without chunked prefill; cutting at the deadline; impatient and retrying
    clients; and on the Azure trace's prompts."""
    runs = {
        f"batch-{name}": _case(
            name,
            7,
            2.0,
            600,
            engine=SMALL_KV,
            prompts="uniform:0:200",
            clients=name == "llm-d-shed",
        )
        for name in (
            "none",
            "predictive",
            "predictive-kv",
            "vllm-caps",
            "llm-d-shed",
            "bounded-deadline",
        )
    }
    noisy = {**SMALL_KV, "chunked_prefill": False, "step": [0.004, 2e-5, 3e-4, 1e-6, 0.5]}
    runs["batch-unchunked-noisy"] = _case("predictive", 8, engine=noisy, prompts="lognormal:64:0.8")
    runs["batch-cut-at-deadline"] = _case(
        "none",
        9,
        3.0,
        engine=SMALL_KV,
        prompts="fixed:64",
        args={"cancel_at_deadline": True, "deadline_s": 1.0},
    )
    runs["batch-patience"] = _case(
        "none",
        13,
        2.0,
        engine=SMALL_KV,
        prompts="uniform:0:100",
        patience=["exponential:0.5", "answer"],
        used=True,
    )
    runs["batch-retries"] = _case(
        "vllm-caps",
        16,
        3.0,
        engine=SMALL_KV,
        prompts="fixed:32",
        args={"max_queue": 8},
        retry={"mode": "immediate", "max_attempts": 2},
    )
    # The file's own rate is 2.6 requests a second: twenty times that keeps a batch at work.
    azure_engine = {
        "kind": "batching",
        "max_num_seqs": 32,
        "kv_blocks": 2000,
        "step": [0.01, 5e-6, 2e-4, 5e-8, 0.0],
    }
    runs["azure-batching"] = _case(
        "predictive-kv",
        22,
        None,
        None,
        trace="azure",
        seconds=12.0,
        time_scale=0.05,
        engine=azure_engine,
    )
    return runs


def _runs() -> dict[str, dict]:
    return {**_one_at_a_time_runs(), **_batching_runs()}


RUNS = _runs()


def _engine(raw):
    if not isinstance(raw, dict):
        return raw
    fields = {k: v for k, v in raw.items() if k not in ("kind", "step")}
    return Batching(StepModel(*raw["step"]), **fields)


def _trace(case: dict, config: ServerConfig):
    patience = None if "patience" not in case else Patience.parse(*case["patience"])
    used = UsedShare() if case.get("used") else None
    options = {"seed": case["seed"], "patience": patience, "used": used}
    if case.get("trace") == "azure":
        window = TraceWindow(None, case["seconds"], case["load"])
        return build_trace(
            AZURE,
            time_scale=case.get("time_scale", 1.0),
            window=window,
            engines=config.engines,
            **options,
        )
    prompts = Prompts.parse(case.get("prompts", "none"))
    arrivals = case.get("arrivals", "poisson")
    # A burst's size sets its own rate: it takes no load.
    load = case["load"] if arrivals_take_load(arrivals) else None
    extra = {}
    if config.batching:  # a batching engine's load is of its saturated throughput (as sweeps)
        extra["capacity_rps"] = config.engine.capacity_rps(prompts.mean(), 20.0)
    clients = TENANTS if case.get("clients") else ()
    return make_trace(
        arrivals,
        load=load,
        engines=config.engines,
        requests=case["requests"],
        prompts=prompts,
        clients=clients,
        **options,
        **extra,
    )


def simulate_case(case: dict) -> pd.DataFrame:
    """The records of one golden run (a fresh trace and server each time)."""
    policy = resolve(case["policy"], case.get("args"))
    engine = _engine(case.get("engine", case.get("engines", 1)))
    config = ServerConfig(policy, engine, seed=case["seed"])
    trace = _trace(case, config)
    retry = RetryPolicy(**case["retry"]) if "retry" in case else None
    return simulate(trace, config, retry=retry)


def _cell(value) -> str:
    """One value as digested: floats by exact repr (see the module), missing values as NA."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "NA"
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    return repr(str(value))


def column_digest(series: pd.Series) -> str:
    text = "\n".join(_cell(v) for v in series.astype(object).tolist())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def summarise(frame: pd.DataFrame) -> dict:
    """What the golden file holds for one run: the frame's digest, each column's, and plain values
    for a reader."""
    columns = {c: column_digest(frame[c]) for c in GOLDEN_COLUMNS}
    whole = hashlib.sha256(json.dumps(columns, sort_keys=True).encode()).hexdigest()[:16]
    outcomes = {str(k): int(v) for k, v in frame["outcome"].value_counts().sort_index().items()}
    return {
        "digest": whole,
        "rows": len(frame),
        "outcomes": outcomes,
        "finish_s_sum": repr(float(np.nansum(frame["finish_s"].to_numpy(float)))),
        "columns": columns,
    }


def _golden() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("name", list(RUNS))
def test_golden_records(name):
    golden = _golden()
    assert name in golden, f"run {name} has no golden record: python tests/test_golden.py --write"
    want, got = golden[name], summarise(simulate_case(RUNS[name]))
    if got["digest"] == want["digest"]:
        return
    moved = [c for c in GOLDEN_COLUMNS if got["columns"][c] != want["columns"].get(c)]
    raise AssertionError(
        f"golden run {name}: columns {', '.join(moved)} changed (rows {want['rows']} -> "
        f"{got['rows']}, outcomes {want['outcomes']} -> {got['outcomes']}, sum of finish_s "
        f"{want['finish_s_sum']} -> {got['finish_s_sum']})"
    )


def test_the_golden_file_holds_exactly_these_runs():
    assert sorted(_golden()) == sorted(RUNS), "regenerate with python tests/test_golden.py --write"


def test_the_runs_cover_what_they_claim():
    """A run list that lost its preemptions, retries or impatient clients fixes nothing of them."""
    frames = {
        name: simulate_case(RUNS[name])
        for name in ("batch-none", "retries-exponential", "patience-answer", "azure-batching")
    }
    assert (frames["batch-none"]["preemptions"].fillna(0) > 0).any()
    assert (frames["retries-exponential"]["attempt"] > 1).any()
    assert frames["patience-answer"]["outcome"].eq("abandoned").any()
    assert frames["azure-batching"]["outcome"].isin(["good", "late"]).sum() > 50
    assert (frames["azure-batching"]["preemptions"].fillna(0) > 0).any()
    assert simulate_case(RUNS["batch-cut-at-deadline"])["outcome"].eq("cancelled").any()
    assert set(PRESETS) <= {c["policy"] for c in RUNS.values()}


def write() -> None:
    """Regenerate tests/data/golden.json from the runs as the code stands."""
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    out = {name: summarise(simulate_case(case)) for name, case in RUNS.items()}
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(out)} golden runs to {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        print("usage: python tests/test_golden.py --write", file=sys.stderr)
        sys.exit(2)
    write()
