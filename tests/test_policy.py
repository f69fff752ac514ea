import math
from dataclasses import dataclass

import pytest

from inputs.policyflags import from_options
from qsim.policy import (
    TIME_TOLERANCE_S,
    PRESETS,
    Policy,
    Rejection,
    cannot_finish,
    decide,
    on_time,
    preset,
    retry_after,
)
from qsim.policy import SHEDDABLE, View, check_plugin, resolve
from qsim.rules import (
    KvAdmission,
    Predictive,
    QueueBound,
    Rule,
    Shedding,
    TokenBound,
    TpotObjective,
    TtftObjective,
    WorkBound,
)


def test_presets_match_the_reference_study():
    assert PRESETS["none"] == Policy("none")
    assert PRESETS["bounded"].max_queue == 8 and not PRESETS["bounded"].expire_at_front
    bd = PRESETS["bounded-deadline"]
    assert (bd.max_queue, bd.deadline_s, bd.expire_at_front) == (8, 2.0, True)
    pr = PRESETS["predictive"]
    assert (pr.max_queue, pr.predictive, pr.deadline_s, pr.expire_at_front) == (
        None,
        True,
        2.0,
        True,
    )


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="bounded-deadline"):
        preset("fifo")


def test_none_admits_everything():
    assert decide(PRESETS["none"], 10_000, 1e6, 50.0, 0.5, 2.0) is None


def test_queue_full_with_numbers_and_retry_after():
    r = decide(
        PRESETS["bounded"],
        queued=8,
        queued_work_s=2.3,
        in_service_remaining_s=0.4,
        est_service_s=0.1,
        deadline_s=2.0,
    )
    assert isinstance(r, Rejection)
    assert r.reason == "queue_full"
    assert r.numbers["queued"] == 8 and r.numbers["max_queue"] == 8
    assert r.numbers["wait_s"] == pytest.approx(2.7)
    assert r.retry_after_s == 3  # 2.7 s rounded up


def test_queue_below_bound_is_admitted():
    assert decide(PRESETS["bounded"], 7, 2.3, 0.4, 0.1, 2.0) is None


def test_work_limit():
    p = Policy(max_queued_seconds=1.0)
    r = decide(
        p,
        queued=3,
        queued_work_s=0.95,
        in_service_remaining_s=0.5,
        est_service_s=0.1,
        deadline_s=2.0,
    )
    assert r.reason == "work_limit"
    assert r.numbers == {
        "queued_work_s": 0.95,
        "est_service_s": 0.1,
        "max_queued_seconds": 1.0,
        "wait_s": pytest.approx(1.45),
    }
    assert r.retry_after_s == 2
    assert decide(p, 3, 0.85, 0.5, 0.1, 2.0) is None


def test_deadline_unreachable_uses_wait_over_workers():
    p = PRESETS["predictive"]
    # wait = (3.0 + 1.0) / 2 = 2.0, + 0.2 > 2 s
    r = decide(p, 5, 3.0, 1.0, 0.2, 2.0, workers=2)
    assert r.reason == "deadline_unreachable"
    assert r.numbers == {"wait_s": 2.0, "est_service_s": 0.2, "deadline_s": 2.0}
    assert r.retry_after_s == 2
    # With four workers the wait halves and it fits.
    assert decide(p, 5, 3.0, 1.0, 0.2, 2.0, workers=4) is None


def test_rules_are_checked_in_order():
    p = Policy(max_queue=2, max_queued_seconds=0.1, predictive=True)
    assert decide(p, 2, 5.0, 5.0, 1.0, 2.0).reason == "queue_full"
    assert decide(p, 1, 5.0, 5.0, 1.0, 2.0).reason == "work_limit"
    assert (
        decide(Policy(predictive=True, max_queued_seconds=100), 1, 5.0, 5.0, 1.0, 2.0).reason
        == "deadline_unreachable"
    )


def test_idle_engine_means_no_wait_and_no_bound():
    # max_queue 0 is the loss system: admit exactly when an engine is free.
    loss = Policy(max_queue=0)
    assert decide(loss, 0, 0.0, 0.0, 0.1, 2.0, workers=2, idle=1) is None
    assert decide(loss, 0, 0.0, 0.3, 0.1, 2.0, workers=2, idle=0).reason == "queue_full"
    # Predictive still refuses what cannot fit even when started at once.
    r = decide(PRESETS["predictive"], 0, 0.0, 0.0, 2.5, 2.0, idle=1)
    assert (
        r.reason == "deadline_unreachable" and r.numbers["wait_s"] == 0.0 and r.retry_after_s == 1
    )


def test_no_deadline_no_predictive_refusal():
    assert decide(PRESETS["predictive"], 100, 100.0, 1.0, 0.2, None) is None


@pytest.mark.parametrize(
    "wait,expected", [(0.0, 1), (0.2, 1), (1.0, 1), (1.01, 2), (2.7, 3), (10.0, 10)]
)
def test_retry_after_rounds_up_at_least_one(wait, expected):
    assert retry_after(wait) == expected


def test_retry_after_rejects_nonsense():
    with pytest.raises(ValueError):
        retry_after(math.inf)


def test_cannot_finish():
    assert cannot_finish(now=1.0, est_service_s=1.5, deadline_at=2.0)
    assert not cannot_finish(now=1.0, est_service_s=1.0, deadline_at=2.0)


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_queue=-1), dict(max_queued_seconds=0), dict(deadline_s=0), dict(deadline_s=math.inf)],
)
def test_policy_validates(kwargs):
    with pytest.raises(ValueError):
        Policy(**kwargs)


def test_overrides():
    p = PRESETS["bounded"].with_overrides(max_queue=4, deadline_s=1.5)
    assert (p.max_queue, p.deadline_s, p.name) == (4, 1.5, "bounded")
    assert PRESETS["none"].with_overrides() is PRESETS["none"]


def test_a_deadline_met_to_the_last_bit_is_met():
    # 0.1 + 0.2 != 0.3 in floats: sums of the same times in another order must not flip an outcome.
    assert on_time(0.1 + 0.2, 0.3) and not on_time(0.3 + 2 * TIME_TOLERANCE_S, 0.3)
    assert not cannot_finish(now=0.1, est_service_s=0.2, deadline_at=0.3)
    assert decide(PRESETS["predictive"], 1, 0.1, 0.0, 0.2, 0.3) is None


def test_a_sheddable_request_is_refused_whenever_it_would_wait():
    from qsim.policy import decide

    policy = Policy()
    # nobody waits: it may queue first
    assert decide(policy, 0, 0.0, 0.5, 0.1, 2.0, idle=0, priority=-1) is None
    shed = decide(policy, 2, 0.4, 0.5, 0.1, 2.0, idle=0, priority=-1)
    assert shed.reason == "shed" and shed.numbers["priority"] == -1 and shed.retry_after_s == 1
    # an idle engine takes it at once
    assert decide(policy, 2, 0.4, 0.5, 0.1, 2.0, idle=1, priority=-1) is None
    assert decide(policy, 2, 0.4, 0.5, 0.1, 2.0, idle=0, priority=0) is None


# -- rules as parts (qsim.rules) ------------------------------------------------------------


def test_presets_are_tuples_of_rules():
    assert PRESETS["none"].rules == PRESETS["codel"].rules == (SHEDDABLE,)
    assert PRESETS["bounded"].rules == (SHEDDABLE, QueueBound(8))
    assert PRESETS["predictive"].rules == (SHEDDABLE, Predictive())
    assert PRESETS["predictive-kv"].rules == (SHEDDABLE, KvAdmission(), Predictive())
    assert PRESETS["vllm-caps"].rules == (SHEDDABLE, QueueBound(64), TokenBound(16384))
    assert PRESETS["llm-d-shed"].rules == (SHEDDABLE, Shedding(5.0, 0.8, 5.0, 300.0, 0))


def test_every_field_rule_in_the_order_the_reasons_are_checked():
    policy = Policy(
        max_queue=4,
        max_queued_tokens=100,
        max_queued_seconds=3.0,
        shed_queue_threshold=2.0,
        predictive=True,
        kv_admission=True,
        ttft_slo_s=0.5,
        tpot_slo_s=0.05,
    )
    assert policy.rules == (
        SHEDDABLE,
        QueueBound(4),
        TokenBound(100),
        WorkBound(3.0),
        Shedding(2.0),
        KvAdmission(),
        Predictive(),
        TtftObjective(0.5),
        TpotObjective(0.05),
    )
    # Objectives and memory are predictive admission's: without it they name no rule.
    assert Policy(kv_admission=True, ttft_slo_s=0.5).rules == (SHEDDABLE,)


def test_the_configuration_surface_builds_the_rules():
    # Keyword fields, --policy-arg pairs, --max-queue: the rules follow the fields they are made of.
    assert from_options("predictive", ["max_queued_seconds=3"], max_queue=5).rules == (
        SHEDDABLE,
        QueueBound(5),
        WorkBound(3.0),
        Predictive(),
    )
    assert resolve("bounded", {"max_queue": 2}).rules == (SHEDDABLE, QueueBound(2))
    assert PRESETS["bounded"].rules == (SHEDDABLE, QueueBound(8))  # the preset is unchanged


def test_decide_is_the_first_rule_that_refuses():
    # queue_full and work_limit both apply: the bound checked first gives the reason.
    view = View(queued=2, queued_work_s=5.0, remaining_s=5.0, est_service_s=1.0, deadline_s=2.0)
    both = Policy(max_queue=2, max_queued_seconds=1.0, predictive=True)
    assert both.decide(view).reason == "queue_full"
    assert Policy(max_queued_seconds=1.0, predictive=True).decide(view).reason == "work_limit"
    assert Policy(predictive=True).decide(view).reason == "deadline_unreachable"
    assert Policy().decide(view) is None


def test_each_rule_reads_the_view_by_name():
    view = View(
        queued=3,
        queued_work_s=0.9,
        remaining_s=0.3,
        est_service_s=0.2,
        deadline_s=1.0,
        engines=2,
        queued_tokens=90,
        prompt_tokens=20,
        priority=-1,
        kv_use=0.9,
        u=0.5,
        kv_wait_s=0.9,
        ttft_s=0.7,
        tpot_s=0.01,
    )
    assert view.wait == pytest.approx(0.6)
    assert SHEDDABLE.check(view).numbers == {"priority": -1, "queued": 3, "wait_s": view.wait}
    assert QueueBound(3).check(view).reason == "queue_full" and QueueBound(4).check(view) is None
    assert (
        TokenBound(109).check(view).reason == "tokens_queued"
        and TokenBound(110).check(view) is None
    )
    assert WorkBound(1.0).check(view).reason == "work_limit" and WorkBound(1.2).check(view) is None
    assert Shedding(100.0, kv_threshold=0.5).check(view).reason == "shed"  # saturation 1.8 by KV
    assert Shedding(100.0, below_priority=-1).check(view) is None  # priority -1 is not below -1
    assert KvAdmission().check(view).reason == "kv_full"  # 0.9 + 0.2 > 1.0 though 0.6 + 0.2 fits
    assert Predictive().check(view) is None
    assert TtftObjective(0.5).check(view).numbers["ttft_projected_s"] == 0.7
    assert TpotObjective(0.02).check(view) is None
    idle = view._replace(idle=1)  # one starts at once: it waits for nobody, no bound applies
    assert all(
        r.check(idle) is None for r in (SHEDDABLE, QueueBound(0), TokenBound(0), WorkBound(0.1))
    )


@dataclass(frozen=True)
class _Even(Rule):
    """Refuses a request whose queue position is odd (a rule of one's own, for the tests)."""

    def check(self, view: View) -> Rejection | None:
        return Rejection("queue_full", {"queued": view.queued}) if view.queued % 2 else None


@dataclass(frozen=True)
class _EvenPolicy(Policy):
    bound: int = 4

    def make_rules(self):
        return (*super().make_rules(), QueueBound(self.bound), _Even())


def test_a_rule_of_ones_own_is_one_more_part():
    policy = _EvenPolicy(max_queued_seconds=10.0)
    assert policy.rules == (SHEDDABLE, WorkBound(10.0), QueueBound(4), _Even())
    assert decide(policy, 1, 0.1, 0.1, 0.1, 2.0).numbers == {"queued": 1}
    assert decide(policy, 2, 0.1, 0.1, 0.1, 2.0) is None
    assert decide(policy, 4, 0.1, 0.1, 0.1, 2.0).reason == "queue_full"
    assert not _Even.basic  # the core gives a rule of one's own the whole view
    check_plugin(_EvenPolicy)  # make_rules is a hook, and it reads the field
