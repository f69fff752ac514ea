"""A property-testing kit for qsim and what you build on it: hypothesis strategies and invariant
checkers.

Needs hypothesis, which qsim itself never imports: ``pip install 'qlab[testing]'``. docs/testing.md
shows a new discipline and a new policy tested with it in ten lines.

Every name of the kit is importable from here (``from qsim.testing import runs, check_records``);
its parts say what each holds:

* :mod:`qsim.testing.simulations`: strategies for simulations (policies, engines, workloads, and
  :class:`SimRun`, all three together) and :func:`check_records`, every records invariant of one;
* :mod:`qsim.testing.record_checks`: the checkers on the simulator's records, and
  :class:`InvariantBroken`, what every checker raises;
* :mod:`qsim.testing.queue_core`: the queue core driven through any interleaving of events (a
  hypothesis state machine), with the order each discipline promises.
"""

try:
    import hypothesis  # noqa: F401
except ImportError as exc:  # qsim runs without hypothesis; only this kit needs it
    raise ImportError(
        "qsim.testing needs hypothesis: pip install 'qlab[testing]' (or hypothesis itself)"
    ) from exc

from .queue_core import (
    DECLARED,
    DISCIPLINES,
    DisciplineCase,
    adaptive,
    by_arrival,
    check_queue_core,
    least_served,
    newest_first,
    preset_policies,
    queue_machine,
)
from .record_checks import (
    InvariantBroken,
    audited_batches,
    check_at_most_k_in_service,
    check_at_most_seats_in_batch,
    check_conservation,
    check_kv_blocks,
    check_one_outcome_each,
    check_order,
    check_queue_bound,
    check_work_conserving,
    records_order,
)
from .simulations import (
    ARRIVALS,
    PROMPTS,
    EngineSettings,
    SimRun,
    Workload,
    batching_engines,
    check_records,
    engine_settings,
    policies,
    runs,
    step_models,
    traces,
    workloads,
)

__all__ = [
    "ARRIVALS",
    "DECLARED",
    "DISCIPLINES",
    "PROMPTS",
    "DisciplineCase",
    "EngineSettings",
    "InvariantBroken",
    "SimRun",
    "Workload",
    "adaptive",
    "audited_batches",
    "batching_engines",
    "by_arrival",
    "check_at_most_k_in_service",
    "check_at_most_seats_in_batch",
    "check_conservation",
    "check_kv_blocks",
    "check_one_outcome_each",
    "check_order",
    "check_queue_bound",
    "check_queue_core",
    "check_records",
    "check_work_conserving",
    "engine_settings",
    "least_served",
    "newest_first",
    "policies",
    "preset_policies",
    "queue_machine",
    "records_order",
    "runs",
    "step_models",
    "traces",
    "workloads",
]
