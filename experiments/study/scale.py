"""How big the study is: the reference sizes (:data:`FULL`) or a reduced study (:data:`QUICK`)."""

from __future__ import annotations

from dataclasses import dataclass

#: The reference study's four policies: the burst's, the capacity search's, the live pass's at full
#: scale.
POLICIES = ("none", "bounded", "bounded-deadline", "predictive")


@dataclass(frozen=True)
class Scale:
    """How big the study is. None: each experiment file's own value (the reference sizes)."""

    name: str
    seeds: int | None = None  # seeds of every sweep (at most; a file with fewer keeps its own)
    duration_s: float | None = None  # simulated seconds of every sweep (at most)
    loads: tuple[float, ...] | None = None  # the reference sweep's loads
    theory_replications: int = 10
    theory_scale: float = 1.0
    live_policies: tuple[str, ...] = POLICIES
    live_loads: tuple[float, ...] = (1.0, 2.0)
    live_seconds: float = 40.0
    live_stale_seconds: float = 60.0  # each live stale-estimator run (the machine slows a third in)
    # live cutting at the deadline, off and on
    live_cut_policies: tuple[str, ...] = ("none", "predictive")
    live_cut_loads: tuple[float, ...] = (1.5, 3.0)
    live_cut_seconds: float = 40.0
    # The batching sweep (H5) on its own scale: its cells are several times the reference sweep's
    # work.
    batching_seeds: int | None = None
    batching_duration_s: float | None = None
    batching_loads: tuple[float, ...] | None = None
    capacity_tolerance: float = 0.02  # the capacity search's brackets, as a share of their load
    # seeds of the model-only prediction of each live run (qlab compare --predict)
    predict_seeds: int = 20


FULL = Scale("full")
# Theory in the quick study: 10 replications of a tenth of the length. At the Bonferroni level
# (about 0.9987 each) the Student-t quantile with 4 degrees of freedom is 1.75 times that with 9, so
# 5 replications twice as long would give intervals 1.75 times wider for the same time. At this size
# the heavy-traffic waits (M/M/1 at rho 0.8 and 0.95, M/M/c at 0.9 and 0.95, the P-K rows, Erlang
# A's) are too wide to judge and the report says so; judging them all would take runs about 4 times
# as long (docs/study.md).
QUICK = Scale(
    "quick",
    seeds=5,
    duration_s=300.0,
    loads=(0.5, 0.9, 1.3, 2.0, 3.0),
    theory_replications=10,
    theory_scale=0.1,
    live_policies=("bounded-deadline", "predictive"),
    live_loads=(2.0,),
    live_seconds=20.0,
    live_stale_seconds=10.0,
    live_cut_policies=("predictive",),
    live_cut_loads=(1.5,),
    live_cut_seconds=10.0,
    batching_seeds=4,
    batching_duration_s=60.0,
    batching_loads=(0.5, 1.3, 3.0),
    capacity_tolerance=0.02,
    predict_seeds=3,
)
