import math

import pytest

from qsim.policy import TIME_TOLERANCE_S, PRESETS, Policy, Rejection, cannot_finish, decide, on_time, preset, retry_after


def test_presets_match_the_reference_study():
    assert PRESETS["none"] == Policy("none")
    assert PRESETS["bounded"].max_queue == 8 and not PRESETS["bounded"].expire_at_front
    bd = PRESETS["bounded-deadline"]
    assert (bd.max_queue, bd.deadline_s, bd.expire_at_front) == (8, 2.0, True)
    pr = PRESETS["predictive"]
    assert (pr.max_queue, pr.predictive, pr.deadline_s, pr.expire_at_front) == (None, True, 2.0, True)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="bounded-deadline"):
        preset("fifo")


def test_none_admits_everything():
    assert decide(PRESETS["none"], 10_000, 1e6, 50.0, 0.5, 2.0) is None


def test_queue_full_with_numbers_and_retry_after():
    r = decide(PRESETS["bounded"], queued=8, queued_work_s=2.3, in_service_remaining_s=0.4,
               est_service_s=0.1, deadline_s=2.0)
    assert isinstance(r, Rejection)
    assert r.reason == "queue_full"
    assert r.numbers["queued"] == 8 and r.numbers["max_queue"] == 8
    assert r.numbers["wait_s"] == pytest.approx(2.7)
    assert r.retry_after_s == 3  # 2.7 s rounded up


def test_queue_below_bound_is_admitted():
    assert decide(PRESETS["bounded"], 7, 2.3, 0.4, 0.1, 2.0) is None


def test_work_limit():
    p = Policy(max_queued_seconds=1.0)
    r = decide(p, queued=3, queued_work_s=0.95, in_service_remaining_s=0.5, est_service_s=0.1, deadline_s=2.0)
    assert r.reason == "work_limit"
    assert r.numbers == {"queued_work_s": 0.95, "est_service_s": 0.1, "max_queued_seconds": 1.0,
                         "wait_s": pytest.approx(1.45)}
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
    assert decide(Policy(predictive=True, max_queued_seconds=100), 1, 5.0, 5.0, 1.0, 2.0).reason == "deadline_unreachable"


def test_idle_engine_means_no_wait_and_no_bound():
    # max_queue 0 is the loss system: admit exactly when an engine is free.
    loss = Policy(max_queue=0)
    assert decide(loss, 0, 0.0, 0.0, 0.1, 2.0, workers=2, idle=1) is None
    assert decide(loss, 0, 0.0, 0.3, 0.1, 2.0, workers=2, idle=0).reason == "queue_full"
    # Predictive still refuses what cannot fit even when started at once.
    r = decide(PRESETS["predictive"], 0, 0.0, 0.0, 2.5, 2.0, idle=1)
    assert r.reason == "deadline_unreachable" and r.numbers["wait_s"] == 0.0 and r.retry_after_s == 1


def test_no_deadline_no_predictive_refusal():
    assert decide(PRESETS["predictive"], 100, 100.0, 1.0, 0.2, None) is None


@pytest.mark.parametrize("wait,expected", [(0.0, 1), (0.2, 1), (1.0, 1), (1.01, 2), (2.7, 3), (10.0, 10)])
def test_retry_after_rounds_up_at_least_one(wait, expected):
    assert retry_after(wait) == expected


def test_retry_after_rejects_nonsense():
    with pytest.raises(ValueError):
        retry_after(math.inf)


def test_cannot_finish():
    assert cannot_finish(now=1.0, est_service_s=1.5, deadline_at=2.0)
    assert not cannot_finish(now=1.0, est_service_s=1.0, deadline_at=2.0)


@pytest.mark.parametrize("kwargs", [dict(max_queue=-1), dict(max_queued_seconds=0), dict(deadline_s=0),
                                    dict(deadline_s=math.inf)])
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
    assert decide(policy, 0, 0.0, 0.5, 0.1, 2.0, idle=0, priority=-1) is None  # nobody waits: it may queue first
    shed = decide(policy, 2, 0.4, 0.5, 0.1, 2.0, idle=0, priority=-1)
    assert shed.reason == "shed" and shed.numbers["priority"] == -1 and shed.retry_after_s == 1
    assert decide(policy, 2, 0.4, 0.5, 0.1, 2.0, idle=1, priority=-1) is None  # an idle engine takes it at once
    assert decide(policy, 2, 0.4, 0.5, 0.1, 2.0, idle=0, priority=0) is None
