import numpy as np
import pytest

from qsim.service import ServiceModel, SpeedTracker, fit


def test_reference_model():
    m = ServiceModel()
    assert m.estimate(64) == pytest.approx(0.001 + 64 * 0.0085)
    assert np.allclose(m.estimate([1, 16]), [0.0095, 0.137])
    assert m.tokens_for(m.estimate(16)) == 16


def test_fit_recovers_a_line_and_reports_errors():
    rng = np.random.default_rng(3)
    tokens = np.repeat([1, 2, 4, 8, 16, 32, 64], 12)
    seconds = (0.001 + 0.0086 * tokens) * rng.lognormal(0, 0.05, tokens.size)
    f = fit(tokens, seconds)
    assert f.model.per_token_s == pytest.approx(0.0086, rel=0.03)
    assert f.n == tokens.size
    rel = np.abs(f.model.estimate(tokens) - seconds) / seconds
    assert f.median_rel_error == pytest.approx(np.median(rel))
    assert f.worst_rel_error == pytest.approx(rel.max())
    assert 0 < f.median_rel_error < f.worst_rel_error


def test_fit_exact_line():
    f = fit([1, 2, 4], [0.011, 0.021, 0.041])
    assert f.model.intercept_s == pytest.approx(0.001)
    assert f.model.per_token_s == pytest.approx(0.01)
    assert f.worst_rel_error < 1e-9


@pytest.mark.parametrize(
    "tokens,seconds", [([1], [0.1]), ([2, 2, 2], [0.1, 0.2, 0.3]), ([1, 2], [0.1])]
)
def test_fit_refuses_too_little(tokens, seconds):
    with pytest.raises(ValueError):
        fit(tokens, seconds)


def test_model_save_load(tmp_path):
    path = tmp_path / "m.json"
    ServiceModel(0.002, 0.009).save(path)
    assert ServiceModel.load(path) == ServiceModel(0.002, 0.009)
    path.write_text('{"model": {"intercept_s": 0.003, "per_token_s": 0.01}}')
    assert ServiceModel.load(path) == ServiceModel(0.003, 0.01)
    path.write_text("{oops")
    with pytest.raises(ValueError, match="m.json"):
        ServiceModel.load(path)


def test_tracker_ewma():
    t = SpeedTracker()
    assert t.factor == 1.0
    t.observe(0.1, 0.14)  # ratio 1.4: inside the bound, the plain EWMA step
    assert t.factor == pytest.approx(1.08)
    t.observe(0.1, 0.14)
    assert t.factor == pytest.approx(1.08 + 0.2 * 0.32)
    for _ in range(100):
        t.observe(0.1, 0.225)
    assert t.factor == pytest.approx(2.25)
    assert t.scale(0.5) == pytest.approx(1.125)


def test_one_observation_moves_the_factor_at_most_max_step():
    """A run 6 x its estimate (an upstream that paused) is one observation: the factor moves 25 %,
    not 100 %. Down, the EWMA's own step is the bound (1 - weight = 1 / 1.25). A lasting change is
    still followed."""
    up, down = SpeedTracker(), SpeedTracker()
    assert up.observe(1.7, 10.2) == pytest.approx(1.25)  # unbounded: 1 + 0.2 x 5 = 2.0
    assert down.observe(1.0, 1e-9) == pytest.approx(1 / 1.25)
    steps = [up.observe(1.0, 5.0) for _ in range(30)]  # a machine 5 x slower
    assert all(b / a <= 1.25 + 1e-12 for a, b in zip([1.25, *steps], steps))
    assert steps[6] < 4.0 < steps[7] and steps[-1] == pytest.approx(5.0, rel=0.01)
    wide = SpeedTracker(max_step=1e9)  # the bound off: the plain EWMA
    assert wide.observe(1.7, 10.2) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="max_step"):
        SpeedTracker(max_step=0)


def test_tracker_ignores_failures_and_fixed_stays():
    t = SpeedTracker()
    t.observe(0.1, 0.0)
    t.observe(0.0, 0.3)
    t.observe(0.1, float("nan"))
    assert t.factor == 1.0
    f = SpeedTracker(fixed=True)
    f.observe(0.1, 0.5)
    assert f.factor == 1.0
