"""The lines said of a calibration (:mod:`live.calibrate`): one as each step ends
(:func:`report`), and the fits (:func:`describe`, :func:`describe_terms`).
"""

from __future__ import annotations

import numpy as np

from qsim.service import Fit

from .calibration_fit import BatchLevel, Calibration, LoadFit, LoadLevel, Round, StepCalibration


def report(step: Round | LoadLevel | BatchLevel) -> str:
    """A line on one step of :func:`calibrate` as it ends (its ``progress``): a round's fit, or a
    load level."""
    if isinstance(step, Round):
        return describe(step, f"round {step.round}")
    return describe_level(step) if isinstance(step, LoadLevel) else describe_batch(step)


def describe_batch(level: BatchLevel) -> str:
    said = level.as_dict()
    batch = (
        ""
        if not level.steps
        else ", sequences producing a token per step: median "
        f"{said['sampling_median']:g}, "
        f"max {said['sampling_max']}"
    )
    return f"{level.level} in flight: {level.requests} requests, {said['steps']} steps{batch}"


def describe_terms(result: Calibration) -> str:
    """What the calibration fitted beside the line, in one line: the concurrency term and the noise
    (engines one at a time), or the step model (a batching server)."""
    return describe_load(result.load) if result.steps is None else describe_steps(result.steps)


def describe_steps(steps: StepCalibration) -> str:
    """The fitted step model and how well it fits, in a line (two with the engine's counters)."""
    m, f = steps.model, steps.fit
    line = (
        f"step model: {m.b0 * 1e3:.3f} ms + {m.b1 * 1e6:.3f} us/prefill token + "
        f"{m.b2 * 1e6:.1f} us/sequence + "
        f"{m.b3 * 1e9:.2f} ns/context token, CV {m.cv:.3f}; "
    )
    gate = (
        f"the gate's steps: r^2 {f.r2:.3f}, error on one step: median "
        f"{f.median_rel_error:.1%}, worst "
        f"{f.worst_rel_error:.1%}; {f.n} steps"
    )
    e = steps.engine
    if e is None:
        return line + gate
    return (
        line + f"fitted to the engine's counters ({len(e.phases)} phases): r^2 {e.fit.r2:.3f}, "
        "on held-out "
        f"phases {e.held_out_r2:.3f} (median error {e.held_out_median_rel_error:.1%})\n  "
        f"beside it, {gate}"
    )


def describe_level(level: LoadLevel) -> str:
    busy = np.asarray(level.busy)
    return (
        f"{level.level} in flight: {len(busy)} requests, engines busy at their start: median "
        f"{np.median(busy):g}, "
        f"max {busy.max()}"
    )


def describe_load(load: LoadFit) -> str:
    """The fitted concurrency term and noise, in one line."""

    def cv(value: float) -> str:
        return f"{value:.3f}" if np.isfinite(value) else "not measured"

    slowdown = (
        "not measured (one engine)"
        if load.concurrency is None
        else f"{load.concurrency:.3f} (a run x {1 + load.concurrency:.3f} with two engines busy)"
    )
    return (
        f"under load: concurrency {slowdown}; noise CV one at a time {cv(load.noise_cv_one)}, "
        "under load "
        f"{cv(load.noise_cv_load)}; ratio at one busy {load.speed:.3f}; {load.n} requests"
    )


def describe(r: Round | Fit, label: str) -> str:
    m = r.model
    prompt = f", {m.per_prompt_token_s * 1e6:.2f} us/prompt token" if m.per_prompt_token_s else ""
    return (
        f"{label}: intercept {m.intercept_s * 1e3:.2f} ms, {m.per_token_s * 1e3:.3f} "
        f"ms/token{prompt}; "
        f"error of the fit on one request: median {r.median_rel_error:.1%}, worst "
        f"{r.worst_rel_error:.1%}"
    )
