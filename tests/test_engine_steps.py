"""The step model fitted to a batching engine's own counters (live.engine_steps), judged on
held-out phases."""

from __future__ import annotations

import pytest

from live.engine_steps import Counters, EnginePhase, fit_phases
from qsim.engines import StepModel

TRUE = StepModel(b0=0.005, b1=0.0001, b2=0.0005)


def _phase(level: int, half: int, seqs: float, prefill: float, jitter: float = 1.0) -> EnginePhase:
    """A phase of 1,000 steps of ``seqs`` sequences and ``prefill`` prompt tokens a step, each
    step ``TRUE``'s time x ``jitter``."""
    steps = 1000
    step = TRUE.time(prefill, seqs, 0.0) * jitter
    generated = round(seqs * steps)
    before = Counters(10.0, 0, 0, 0, 0.0, 0, 0, 0.0)
    requests = generated // 64
    after = Counters(
        10.0 + steps * step * 1.2,
        steps,
        generated + round(prefill * steps),
        generated,
        generated * step,
        generated,
        requests,
        requests * 64 * step,
    )
    return EnginePhase.between(level, half, before, after)


def test_a_phase_is_read_from_the_counters_rise():
    p = _phase(8, 0, seqs=6.0, prefill=10.0)
    assert (p.steps, p.generated, p.seqs, p.prefill) == (1000, 6000, 6.0, 10.0)
    assert p.step_s == pytest.approx(TRUE.time(10.0, 6.0, 0.0))
    # 8 clients always waiting, a fifth of the wall time not in the engine's steps.
    assert p.outside_s == pytest.approx((8 * p.seconds - p.inference_s) / p.requests)


def test_the_engines_step_model_is_found_and_judged_on_held_out_phases():
    levels = [(1, 1.0, 2.0), (4, 3.5, 8.0), (8, 7.0, 4.0), (16, 14.0, 20.0), (32, 28.0, 12.0)]
    phases = [_phase(n, h, s, p, 1.0 + 0.02 * (h - 0.5)) for n, s, p in levels for h in (0, 1)]
    fitted = fit_phases(phases)
    assert fitted.held_out_r2 > 0.99
    m = fitted.fit.model
    assert (m.b0, m.b1, m.b2) == pytest.approx((TRUE.b0, TRUE.b1, TRUE.b2), rel=0.05)
    assert m.b3 == 0.0  # the counters do not say the context: no term fitted
    assert fitted.as_dict()["held_out_r2"] == fitted.held_out_r2


def test_a_model_that_only_fits_its_own_phases_fails_on_the_held_out_ones():
    """Steps whose time has nothing to do with what they held (a machine whose speed moves):
    the first halves' fit says nothing of the second."""
    levels = [(1, 1.0, 2.0), (4, 3.5, 8.0), (8, 7.0, 4.0), (16, 14.0, 20.0), (32, 28.0, 12.0)]
    jitter = {0: (1.0, 4.0, 0.5, 3.0, 1.0), 1: (3.0, 0.5, 4.0, 1.0, 0.4)}
    phases = [
        _phase(n, h, s, p, jitter[h][k]) for k, (n, s, p) in enumerate(levels) for h in (0, 1)
    ]
    assert fit_phases(phases).held_out_r2 < 0.5


def test_too_few_phases_or_an_engine_that_ran_nothing_is_said():
    phases = [_phase(n, h, n, 1.0) for n in (1, 8) for h in (0, 1)]
    with pytest.raises(ValueError, match="3 first and 2 second halves"):
        fit_phases(phases)
    idle = EnginePhase.between(
        4, 0, Counters(0, 0, 0, 0, 0, 0, 0, 0), Counters(1, 0, 0, 0, 0, 0, 0, 0)
    )
    with pytest.raises(ValueError, match="--engine-metrics"):
        fit_phases([*phases, idle])


def test_a_step_model_without_the_context_term_needs_three_steps():
    with pytest.raises(ValueError, match="3 terms needs at least 3"):
        StepModel.fit([1, 2], [1, 2], None, [0.01, 0.02])
    fit = StepModel.fit([0, 0, 10], [1, 2, 1], None, [0.006, 0.007, 0.0065])
    assert fit.model.b3 == 0.0 and len(fit.se) == 4


def test_the_api_process_cpu_gives_the_front_end():
    """Phases whose API-process CPU is 2.5 ms a request, 0.23 ms a step, 0.03 ms a token and
    2 ms a second idle: the fit finds each, and the calibration writes it where LoadTerms reads
    it."""
    from dataclasses import replace

    from live.engine_steps import fit_front_end
    from qsim.engines import FrontEnd
    from qsim.service import LoadTerms

    levels = [(1, 1.0, 2.0), (4, 3.5, 8.0), (8, 7.0, 4.0), (16, 14.0, 20.0), (32, 28.0, 12.0)]
    phases = []
    for n, s, p in levels:
        for h in (0, 1):
            phase = _phase(n, h, s * (1 + 0.3 * h), p)
            cpu = (
                0.0025 * phase.requests
                + 0.00023 * phase.steps
                + 0.00003 * phase.generated
                + 0.002 * phase.seconds
            )
            phases.append(replace(phase, api_cpu_s=cpu))
    fitted = fit_front_end(phases)
    m = fitted.model
    assert (m.request_s, m.step_s, m.token_s) == pytest.approx((0.0025, 0.00023, 0.00003), rel=1e-6)
    assert fitted.idle_cpu_a_second == pytest.approx(0.002) and fitted.r2 > 0.999999
    engine = fit_phases(phases)
    assert engine.front_end == fitted and engine.as_dict()["front_end"]["step_s"] == m.step_s
    assert fit_front_end([replace(p, api_cpu_s=0.0) for p in phases]) is None  # not shown
    assert fit_front_end(phases[:4]) is None
    written = {
        "step": {"b0": 0.005},
        "front_end": {"request_s": m.request_s, "token_s": m.token_s, "step_s": m.step_s},
    }
    assert LoadTerms.from_calibration(written).front_end == FrontEnd(**written["front_end"])


def test_a_phase_in_which_the_engine_ran_nothing_reads_nan_not_an_error():
    import math

    idle = EnginePhase.between(
        4, 0, Counters(0, 0, 0, 0, 0, 0, 0, 0), Counters(1, 0, 0, 0, 0, 0, 0, 0)
    )
    assert math.isnan(idle.step_s) and math.isnan(idle.seqs) and math.isnan(idle.prefill)
    assert math.isnan(idle.outside_s)
