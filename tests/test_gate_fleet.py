"""The live gate as a router (live.fleet_gate) agrees with the simulator's fleet, request by request.

Both drive one :class:`qsim.fleet.Fleet` with the same routers (qsim.routers) and the same
random stream (qsim.fleet.ROUTER_STREAM); the gate runs on a virtual clock (tests/virtual_time.py).
"""

import numpy as np
import pytest

from qsim import PRESETS, make_trace, simulate
from qsim.config import ServerConfig
from qsim.fleet import FleetSpec
from qsim.routers import make_router
from virtual_time import run_gate

ROUTERS = ["random", "round_robin", "jsq", "least_work", "power_of_d", "central"]


def _agree(trace, policy, engines: int, router: str, replicas: int = 3):
    spec = FleetSpec(replicas, make_router(router))
    gate, stats = run_gate(trace, policy, engines, fleet=spec)
    sim = simulate(trace, ServerConfig(policy, engines), replicas=replicas, router=spec.router)
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    assert gate["reason"].fillna("-").tolist() == sim["reason"].fillna("-").tolist()
    assert gate["replica"].tolist() == sim["replica"].fillna(-1).tolist()
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(gate["engine"], sim["engine"].fillna(-1))
    seen = gate["queued"].ge(0).to_numpy()
    np.testing.assert_array_equal(gate.loc[seen, "queued"], sim.loc[seen, "queued_at_arrival"])
    counts = sim["outcome"].value_counts()
    assert {k: v for k, v in stats["counts"].items() if v} == {k: int(v) for k, v in counts.items()}
    assert stats["waiting"] == 0 and stats["in_service"] == 0
    return sim, stats


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("policy", ["predictive", "bounded"])
def test_a_fleet_gate_matches_the_simulators_fleet_exactly(router, policy):
    trace = make_trace("poisson", "mix", load=1.4, engines=6, seconds=10, seed=3, noise_cv=0.3)
    sim, stats = _agree(trace, PRESETS[policy], 2, router)
    assert len(sim) > 200
    if router != "central":  # a central queue binds where an engine frees, and says so per row too
        assert sorted(sim["replica"].unique()) == [0, 1, 2]
        assert [r["up"] for r in stats["replicas"]] == [True] * 3
    assert stats["router"] == router and len(stats["replicas"]) == (1 if router == "central" else 3)


def test_a_fleet_of_one_engine_replicas_under_overload():
    trace = make_trace("poisson", "mix", load=2.0, engines=4, seconds=10, seed=11, noise_cv=0.3)
    sim, _ = _agree(trace, PRESETS["predictive"], 1, "power_of_d", replicas=4)
    assert sim["outcome"].eq("rejected").sum() > 20
