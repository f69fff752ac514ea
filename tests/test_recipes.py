"""docs/architecture.md's recipes followed once each, as a contributor would: a rule of one's
own (a frozen ``qsim.rules.Rule`` in a policy's ``make_rules``) and a discipline registered by
name in ``qsim.disciplines.DISCIPLINES``. Each runs in the simulator with the records' invariants
held (the test kit), and the gate, on a virtual clock, decides and orders as the simulator does."""

from dataclasses import dataclass

import numpy as np
import pytest

from qsim import make_trace, simulate
from qsim.disciplines import DISCIPLINES, Keyed
from qsim.policy import Policy, Rejection
from qsim.rules import Rule, View
from qsim.testing import EngineSettings, SimRun, check_records


@dataclass(frozen=True)
class WorkPerEngine(Rule):
    """The recipe's rule: refuse ``busy`` when the work queued per engine passes ``max_s``."""

    max_s: float

    def check(self, view: View) -> Rejection | None:
        per_engine = view.queued_work_s / view.engines
        if view.idle <= 0 and per_engine > self.max_s:
            return Rejection("busy", {"per_engine_s": per_engine}, None)
        return None


@dataclass(frozen=True)
class Bounded(Policy):
    """The recipe's policy: the preset's rules and one more part."""

    max_s: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.max_s >= 0:
            raise ValueError(f"max_s must be >= 0, got {self.max_s}")

    def make_rules(self) -> tuple:
        return (*super().make_rules(), WorkPerEngine(self.max_s))


class LargestFirst(Keyed):
    """The recipe's discipline: the largest estimated request first."""

    def key(self, entry) -> tuple:
        return (-entry.base_s,)


def _gate_equals_simulator(trace, policy, engines=2):
    from virtual_time import run_gate

    sim = simulate(trace, policy, engines)
    gate, _ = run_gate(trace, policy, engines)
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    assert gate["reason"].fillna("").tolist() == sim["reason"].fillna("").tolist()
    np.testing.assert_allclose(gate["start_s"], sim["start_s"], rtol=0, atol=1e-12)
    return sim


def test_a_rule_of_ones_own_following_the_recipe():
    policy = Bounded("bounded-work", max_s=0.5)
    assert policy.rules[-1] == WorkPerEngine(0.5)
    trace = make_trace("poisson", "mix", load=2.0, engines=2, seconds=20, seed=4, noise_cv=0.2)
    sim = _gate_equals_simulator(trace, policy)
    check_records(sim, SimRun(policy, EngineSettings(count=2)), trace)
    busy = sim["reason"].fillna("").eq("busy")
    assert 0.1 < busy.mean() < 0.9  # it decides, and not always the same way
    assert not simulate(trace, Policy("none"), 2)["reason"].fillna("").eq("busy").any()
    with pytest.raises(ValueError, match="max_s must be >= 0"):
        Bounded("x", max_s=-1.0)


def test_a_discipline_registered_by_name_following_the_recipe(monkeypatch):
    monkeypatch.setitem(DISCIPLINES, "largest-first", LargestFirst)
    policy = Policy("largest", discipline="largest-first")
    trace = make_trace("poisson", "mix", load=1.5, engines=2, seconds=20, seed=6, noise_cv=0.2)
    sim = _gate_equals_simulator(trace, policy)
    check_records(sim, SimRun(policy, EngineSettings(count=2)), trace)
    # Among those that waited, each start took the largest waiting then: starts in the order of
    # the estimate, largest first, wherever two waited together.
    sim = sim.assign(base_s=trace.est_service_s[sim["request_id"]])
    waited = sim[sim["start_s"] > sim["arrival_s"] + 1e-9].sort_values("start_s")
    fifo = simulate(trace, Policy("fifo"), 2)
    assert not sim["start_s"].equals(fifo["start_s"])
    together = 0
    for (_, a), (_, b) in zip(waited.iterrows(), waited.iloc[1:].iterrows()):
        if b["arrival_s"] < a["start_s"]:  # b waited when a started
            assert a["base_s"] >= b["base_s"]
            together += 1
    assert together > 20
