"""qsim: a SimPy model of admission control in front of K LLM engines — simulation only.

It owns the queue cores (``queue`` for engines one at a time, ``batch`` for a batching
engine, ``fleet``, ``routers`` and ``batch_fleet`` for replicas), their admission (``admission``,
``rules``, ``estimators``, ``disciplines``) and engines (``engines``, ``service``: the service-time
line and speed tracker), the SimPy driver (``model``'s ``simulate``, ``driver``), the policies and
their one decision function (``policy``), traces (``trace``) and seeded workloads (``workload``,
drawn from ``mixes`` at the times of ``arrivals``), trace files and the one way to build a trace
from options (``tracefiles``), the clients' patience and retries (``clients``), the per-request
record schema (``records``) and run files (``runfile``), and the closed forms it is checked
against (``theory``).
Its property-testing kit is :mod:`qsim.testing` (hypothesis strategies and
invariant checkers; it needs the ``testing`` extra, and nothing else in qsim
imports it).

Pure: no HTTP, no torch, no command line or config files (argparse and TOML are
:mod:`inputs`'s, the layer above, which builds qsim's objects from flags and tables). The bottom
layer: it imports no other qlab package. The live harness and analysis reuse its policy
function, service model, traces and record schema.
"""

from .config import ServerConfig, StallRule
from .engines import Batching, OneAtATime, StepModel
from .model import simulate
from .outcomes import Outcome, Reason
from .policy import PRESETS, Policy, Rejection, cannot_finish, decide, preset, retry_after
from .records import ANSWERED, OUTCOMES, SCHEMA
from .service import ServiceModel, SpeedTracker, fit
from .tracefiles import build_trace, load_trace
from .mixes import REFERENCE_MIX, Client, Mix
from .trace import Trace, from_arrays
from .workload import make_trace

__all__ = [
    "ANSWERED",
    "OUTCOMES",
    "PRESETS",
    "REFERENCE_MIX",
    "SCHEMA",
    "Batching",
    "Client",
    "Mix",
    "OneAtATime",
    "Outcome",
    "Policy",
    "Reason",
    "Rejection",
    "ServerConfig",
    "ServiceModel",
    "SpeedTracker",
    "StallRule",
    "StepModel",
    "Trace",
    "build_trace",
    "cannot_finish",
    "decide",
    "fit",
    "load_trace",
    "from_arrays",
    "make_trace",
    "preset",
    "retry_after",
    "simulate",
]
