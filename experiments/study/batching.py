"""A batching engine (experiments/batching.toml) and hypothesis H5."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.metrics import estimate, paired_difference
from analysis.styles import policy_order

from .blocks import Figure, Table, Text, Verdict, not_run, png
from .section import Context
from .sweeps import BATCHING_FILE, summaries, sweep_section, sweep_table


#: Rules that know the batch and the memory, and the baselines H5 holds them against (a count bound
#: and the engine's own caps); the others in the sweep are shown beside them.
KNOWING = ("predictive", "predictive-kv")
BASELINES = ("bounded", "vllm-caps")


def hypothesis_5(summary: pd.DataFrame) -> tuple[Verdict, pd.DataFrame]:
    """H5: on a batching engine, admission that knows the batch and the memory keeps goodput beyond
    capacity where a count bound and the engine's own caps do not."""
    claim = (
        "on a batching engine, an admission rule that knows the batch and the memory "
        "(predictive, predictive-kv) "
        "keeps goodput beyond capacity where a count bound (bounded) and the engine's own "
        "caps (vllm-caps) do not"
    )
    present = set(summary["policy"])
    missing = [p for p in (*KNOWING, *BASELINES) if p not in present]
    over = sorted(v for v in summary["load"].unique() if v > 1)
    if missing or not over:
        why = (
            f"the sweep lacks {', '.join(missing)}"
            if missing
            else ("the sweep has no load beyond capacity")
        )
        return Verdict("H5", claim, None, why), pd.DataFrame()
    rows, ok, evidence = [], True, []
    for load in over:
        for knowing in KNOWING:
            row = {
                "load": load,
                "policy": knowing,
                "goodput (requests/s)": str(
                    estimate(summary, "goodput_rps", policy=knowing, load=load)
                ),
            }
            for base in (*BASELINES, *sorted(present - set(KNOWING) - set(BASELINES) - {"none"})):
                d = paired_difference(
                    summary,
                    "goodput_rps",
                    {"policy": knowing, "load": load},
                    {"policy": base, "load": load},
                )
                if base in BASELINES:
                    ok &= d.low > 0
                row[f"minus {base}"] = str(d)
            rows.append(row)
    top = over[-1]
    at = {"load": top}
    capacity = float(summary["capacity_rps"].iloc[0])
    admitted = summary.assign(
        late_of_answered=summary["late"] / (summary["good"] + summary["late"])
    )
    evidence.append(
        f"at load {top:g} (capacity {capacity:.3g} requests/s) goodput is "
        + ", ".join(
            f"{p} {estimate(summary, 'goodput_rps', policy=p, **at)}"
            for p in policy_order(summary["policy"].unique())
        )
    )
    predictive = {"policy": "predictive", **at}
    evidence.append(
        "predictive minus "
        + ", ".join(
            f"{b} {paired_difference(summary, 'goodput_rps', predictive, {'policy': b, **at})}"
            for b in BASELINES
        )
        + " requests/s, paired by seed"
    )
    by_memory = paired_difference(
        summary, "goodput_rps", {"policy": "predictive-kv", **at}, predictive
    )
    evidence.append(
        f"predictive-kv minus predictive {by_memory}"
        ": what admitting by memory adds to the time projection here"
    )
    tokens = ", ".join(
        f"{p} {estimate(summary, 'good_tokens_per_s', policy=p, **at)}"
        for p in (*KNOWING, *BASELINES, "llm-d-shed")
        if p in present
    )
    evidence.append(
        "in good tokens/s (what a request goodput can hide: refusing the long "
        f"requests raises it) {tokens}"
    )
    late = estimate(admitted, "late_of_answered", policy="predictive", **at)
    evidence.append(
        f"of what predictive answered at load {top:g}, {late} "
        "missed an objective (the projection is an estimate: it cannot see what "
        "arrives after it decides)"
    )
    return Verdict("H5", claim, ok, "; ".join(evidence)), pd.DataFrame(rows)


def _report(ctx: Context, folder: Path) -> list:
    from analysis import plots

    tables = summaries(folder)
    if tables is None:
        return not_run(folder)
    summary = tables[0]
    verdict, table = hypothesis_5(summary)
    slo = summary["ttft_slo_s"].dropna().unique() if "ttft_slo_s" in summary else []
    objective = f" with its first token within {slo[0]:g} s" if len(slo) else ""
    return [
        Text(
            "One batching engine (experiments/batching.toml: vLLM's limits, chunked prefill, KV "
            "memory in blocks) "
            f"at loads {', '.join(f'{v:g}' for v in sorted(summary['load'].unique()))} of its "
            "saturated throughput; "
            f"{summary['seed'].nunique()} seeds of {summary['duration_s'].max():g} simulated "
            "seconds. A request is "
            f"good when answered within its deadline{objective} (DistServe's goodput). "
            "Differences are paired by "
            "seed."
        ),
        verdict,
        Table(
            table,
            "H5: goodput beyond capacity, and each rule that knows the batch minus the others",
        ),
        Figure(
            "batching_goodput_vs_refused",
            png(plots.goodput_vs_refused(summary)),
            "goodput against the share refused, one point per load",
        ),
        Figure("batching_goodput", png(plots.goodput(summary)), "goodput against load"),
        sweep_table(summary, "the batching sweep: mean over seeds ± 95 % CI half-width"),
    ]


SECTION = sweep_section("batching", "A batching engine: H5", BATCHING_FILE, _report)
