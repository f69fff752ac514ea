"""qsim: a SimPy model of admission control in front of K LLM engines.

Pure: no HTTP, no torch. The live harness and analysis reuse its policy
function, service model, traces and record schema.
"""

from .model import simulate
from .policy import PRESETS, Policy, Rejection, cannot_finish, decide, preset, retry_after
from .records import ANSWERED, OUTCOMES, SCHEMA
from .service import ServiceModel, SpeedTracker, fit
from .workload import REFERENCE_MIX, Mix, Trace, from_arrays, load_trace, make_trace

__all__ = [
    "ANSWERED", "OUTCOMES", "PRESETS", "REFERENCE_MIX", "SCHEMA", "Mix", "Policy", "Rejection",
    "ServiceModel", "SpeedTracker", "Trace", "cannot_finish", "decide", "fit", "load_trace",
    "from_arrays", "make_trace", "preset", "retry_after", "simulate",
]
