"""The live sections' checks on their runs: the per-request disagreement with the simulator, its
cause, and the model-only prediction of each run (``qlab compare`` and its ``--predict``)."""

from __future__ import annotations

import math

import pandas as pd

from .blocks import Verdict

#: The columns a live run's model-only prediction adds beside its per-request replay (metric:
#: column).
PREDICTION_COLUMNS = {
    "share_good": "predicted share in time, rel. error",
    "goodput_rps": "predicted goodput, rel. error",
    "latency_p99_s": "predicted p99 latency, rel. error",
}


def prediction(run: pd.DataFrame, seeds: int) -> dict:
    """A live run's model-only prediction (``qlab compare --predict``: its arrivals and the
    calibrated model alone), as report columns: the relative error of each judged metric, and
    whether all are within their targets."""
    from analysis.prediction import predict

    judged = predict(run, seeds=seeds)
    return {
        **{
            column: float(judged.table.loc[m, "relative_error"])
            for m, column in PREDICTION_COLUMNS.items()
        },
        "prediction": judged.verdict(),
    }


def prediction_verdict(rows: list[dict], seeds: int) -> Verdict:
    """Whether the model alone predicted every live run within the targets, with the worst error
    of each metric."""
    from analysis.prediction import PREDICTION_TARGETS

    judged = [r for r in rows if r.get("prediction") in ("PASS", "MISS")]
    worst = (
        "; ".join(
            f"{column.split(',')[0]} worst {max(abs(r[column]) for r in judged):.1%} "
            f"(target {PREDICTION_TARGETS[m]:.0%})"
            for m, column in PREDICTION_COLUMNS.items()
        )
        if judged
        else ""
    )
    passed = sum(r["prediction"] == "PASS" for r in judged)
    return Verdict(
        "check",
        "the simulator predicts each live run from its arrivals and the "
        "calibrated model alone "
        "(share in time and goodput within 5 %, p99 latency within 10 %)",
        None if not judged else passed == len(judged),
        f"{passed} of {len(judged)} runs within every target over {seeds} seeds of the "
        "model's noise" + (f"; {worst}" if worst else "") + " (the per-request replay, exact by "
        "construction, cannot tell "
        "whether the model is right; this can)",
    )


def disagreement(rows: list[dict]) -> list[Verdict]:
    """The runs' disagreement with the simulator, all together, against 5 %, and its cause."""
    wrong, judged = sum(r["sim_disagreements"] for r in rows), sum(r["judged"] for r in rows)
    share = wrong / judged if judged else math.nan
    return [
        Verdict(
            "check",
            "the simulator and the service agree request by request",
            None if not judged else bool(share <= 0.05),
            f"{wrong} of {judged} requests disagree ({share:.1%}; judged against 5 %)",
        ),
        *rule_verdict(rows),
    ]


#: Per live run, its disagreements with the simulator by cause (analysis.diagnosis.CAUSES).
CAUSE_COLUMNS = ("sim_rule_disagreements", "sim_timing_disagreements")


def rule_verdict(rows: list[dict]) -> list[Verdict]:
    """Whether the gate decided by the simulator's rule wherever they disagree: a rule difference is
    a bug, a timing one a coin flip of the machine (none where the runs predate the causes)."""
    if not rows or any(c not in r for r in rows for c in CAUSE_COLUMNS):
        return []
    rule, timing = (int(sum(r[c] for r in rows)) for c in CAUSE_COLUMNS)
    return [
        Verdict(
            "check",
            "where they disagree, it is timing, not the rule",
            bool(rule == 0),
            f"disagreements by cause: rule {rule} (the gate's decision is not "
            "qsim.policy.decide's on the "
            f"numbers it decided on: a bug), timing {timing} (the queues met differed, or "
            "they parted after "
            "admission); the rest unknown",
        )
    ]
