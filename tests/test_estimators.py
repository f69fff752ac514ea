"""What the controller knows (qsim.estimators, early stops, a changing speed, cutting at the
deadline, prompt cost)."""

import numpy as np
import pytest

from qsim import PRESETS, from_arrays, make_trace, records, simulate
from qsim.service import ServiceModel, SpeedSchedule, fit
from qsim.mixes import UsedShare


def test_early_stops_match_their_exact_mean_and_leave_the_limit_alone():
    used = UsedShare()
    rng = np.random.default_rng(3)
    for limit in (4, 16, 64):
        drawn = used.draw(rng, np.full(100_000, limit))
        assert 1 <= drawn.min() and drawn.max() <= limit
        assert abs(drawn.mean() - used.mean_tokens(limit)) < 4 * drawn.std() / np.sqrt(drawn.size)
    plain = make_trace(load=1.0, seconds=200, seed=1)
    stops = make_trace(load=1.0, seconds=200, seed=1, used=used)
    assert (stops.tokens_generated <= stops.max_new_tokens).all() and (
        stops.tokens_generated < stops.max_new_tokens
    ).any()
    np.testing.assert_array_equal(plain.tokens_generated, plain.max_new_tokens)
    # The load counts the work actually done: more requests for the same utilisation.
    assert len(stops) > 2 * len(plain)


def test_learned_and_oracle_estimates_beat_the_limit_on_early_stops():
    trace = make_trace(load=2.0, seconds=300, seed=2, used=UsedShare())
    good = {}
    for estimator in ("limit", "learned", "oracle"):
        policy = PRESETS["predictive"].with_args({"estimator": estimator})
        df = records.validate(simulate(trace, policy))
        good[estimator] = df["outcome"].eq("good").mean()
    assert good["limit"] < good["learned"] <= good["oracle"] + 0.02


def test_a_quantile_estimator_and_bad_settings():
    policy = PRESETS["predictive"].with_args({"estimator": "learned", "estimator_quantile": 0.9})
    records.validate(simulate(make_trace(load=1.5, seconds=60, seed=3, used=UsedShare()), policy))
    for args, needle in (
        ({"estimator": "psychic"}, "unknown estimator"),
        ({"estimator_quantile": 1.5}, "estimator_quantile"),
        ({"estimator_window": 0}, "estimator_window"),
    ):
        with pytest.raises(ValueError, match=needle):
            PRESETS["predictive"].with_args(args)


def test_cutting_at_the_deadline_frees_the_engine():
    # One engine, 1 s runs, deadline 1.5 s: the second would end at 2.0, 0.5 s late; cut at 1.5, the
    # third starts then.
    trace = from_arrays(
        [0.0, 0.0, 0.0], [64] * 3, true_service_s=[1.0] * 3, deadline_s=[1.5, 1.5, 5.0]
    )
    late = simulate(trace, PRESETS["none"])
    cut = records.validate(simulate(trace, PRESETS["none"].with_args({"cancel_at_deadline": True})))
    assert late["outcome"].tolist() == ["good", "late", "good"]
    assert cut["outcome"].tolist() == ["good", "cancelled", "good"]
    assert cut["reason"][1] == "deadline_passed" and cut["finish_s"][1] == pytest.approx(1.5)
    assert cut["start_s"][2] == pytest.approx(1.5) and late["start_s"][2] == pytest.approx(2.0)


def test_a_speed_schedule_slows_the_runs_that_start_after_it():
    trace = from_arrays(np.arange(6.0), [64] * 6, true_service_s=[0.5] * 6, deadline_s=[10.0] * 6)
    df = simulate(trace, PRESETS["none"], speed_schedule=SpeedSchedule(1.0, ((2.5, 2.0),)))
    np.testing.assert_allclose(df["finish_s"] - df["start_s"], [0.5, 0.5, 0.5, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(df["true_service_s"], [0.5, 0.5, 0.5, 1.0, 1.0, 1.0])


def test_the_prompt_term_is_fitted_when_prompts_differ():
    truth = ServiceModel(0.002, 0.008, 0.0001)
    tokens = np.array([4, 16, 64] * 4)
    prompts = np.repeat([10, 500, 1000, 2000], 3)
    seconds = truth.estimate(tokens, prompts)
    got = fit(tokens, seconds, prompts)
    assert got.model.per_prompt_token_s == pytest.approx(1e-4, rel=1e-6)
    assert got.worst_rel_error < 1e-6
    assert fit(tokens, truth.estimate(tokens)).model.per_prompt_token_s == 0.0
    # no prompt term: the study's line
    assert ServiceModel().estimate(64, 7437) == ServiceModel().estimate(64)
