"""What a calibration measured and what was fitted to it: each round's line (:class:`Round`), the
load levels' points (:class:`LoadLevel`) and the concurrency term and noise fitted to them
(:func:`fit_load`, :class:`LoadFit`), a batching server's phases (:class:`BatchLevel`) and the step
model fitted to their steps (:func:`fit_steps`, :class:`StepCalibration`); and the whole
(:class:`Calibration`), as the JSON that ``serve``, ``simulate`` and ``compare`` read. Pure: no
request is sent here (:mod:`live.calibrate` measures).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy import optimize, stats

from inputs.atomic import atomic_write
from qsim.engines import STEP_FIELDS, StepFit, StepModel
from qsim.runfile import LoggedStep
from qsim.service import Fit, ServiceModel

from .engine_steps import EngineStepFit


@dataclass(frozen=True)
class Round:
    """One round's fit and the points it was made from."""

    round: int
    model: ServiceModel
    median_rel_error: float
    worst_rel_error: float
    tokens: tuple[int, ...]
    engine_s: tuple[float, ...]
    prompt_tokens: tuple[int, ...] = ()

    def as_dict(self) -> dict:
        return {
            "round": self.round,
            "model": asdict(self.model),
            "n": len(self.tokens),
            "median_rel_error": self.median_rel_error,
            "worst_rel_error": self.worst_rel_error,
            "tokens": list(self.tokens),
            "prompt_tokens": list(self.prompt_tokens),
            "engine_s": list(self.engine_s),
        }


@dataclass(frozen=True)
class LoadLevel:
    """One in-flight level's requests under load: their sizes, engine times, and engines busy at
    each start."""

    level: int
    tokens: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    engine_s: tuple[float, ...]
    busy: tuple[int, ...]

    def as_dict(self) -> dict:
        return {
            "level": self.level,
            "n": len(self.tokens),
            "tokens": list(self.tokens),
            "prompt_tokens": list(self.prompt_tokens),
            "engine_s": list(self.engine_s),
            "busy": list(self.busy),
        }


@dataclass(frozen=True)
class LoadFit:
    """The concurrency term and the noise, fitted to every point (the rounds' at busy 1 and the load
    levels').

    ratio = engine time / the line's estimate = speed x (1 + concurrency x (busy - 1)) x noise;
    ``speed``: the fitted ratio at busy 1 (about 1: the line was fitted to those points);
    ``concurrency``: None where no point had another engine busy; ``noise_cv_one`` /
    ``noise_cv_load``: the CV of the noise at busy 1 and above (NaN: no such point); ``noise_cv``:
    the one a prediction draws, under load where it was measured."""

    speed: float
    concurrency: float | None
    noise_cv_one: float
    noise_cv_load: float
    n: int
    busy_counts: dict[int, int]

    @property
    def noise_cv(self) -> float:
        return self.noise_cv_load if np.isfinite(self.noise_cv_load) else self.noise_cv_one

    def as_dict(self) -> dict:
        finite = _json_number
        return {
            "concurrency": self.concurrency,
            "noise_cv": finite(self.noise_cv),
            "speed_at_one": self.speed,
            "noise_cv_one_at_a_time": finite(self.noise_cv_one),
            "noise_cv_under_load": finite(self.noise_cv_load),
            "n": self.n,
            "busy_counts": {str(k): v for k, v in sorted(self.busy_counts.items())},
        }


def _json_number(value: float) -> float | None:
    """A number for the JSON: None where it is not finite (not measured; JSON has no NaN)."""
    return float(value) if np.isfinite(value) else None


def busy_at_start(started: np.ndarray, returned: np.ndarray) -> np.ndarray:
    """For each request, how many of these requests held an engine when it started, itself included:
    those started at or before it and not yet returned (the gate's clock, where only these requests
    ran)."""
    started, returned = np.asarray(started, float), np.asarray(returned, float)
    holding = (started[None, :] <= started[:, None]) & (returned[None, :] > started[:, None])
    return holding.sum(axis=1)


def _cv(values: np.ndarray) -> float:
    return float(stats.variation(values, ddof=1)) if values.size >= 2 else float("nan")


def fit_load(model: ServiceModel, tokens, prompt_tokens, engine_s, busy) -> LoadFit:
    """Fit ratio = speed + d x (busy - 1) by least squares bounded at 0 (scipy's lsq_linear),
    concurrency = d / speed, and the noise: the CV of ratio / (speed + d (busy - 1)), at busy 1 and
    above."""
    ratio = np.asarray(engine_s, float) / model.estimate(
        np.asarray(tokens), np.asarray(prompt_tokens)
    )
    busy = np.asarray(busy, dtype=int)
    if (
        ratio.size < 2
        or not np.all(np.isfinite(ratio))
        or busy.shape != ratio.shape
        or busy.min() < 1
    ):
        raise ValueError(
            "a load fit needs at least 2 points, each with a finite time and busy >= 1"
        )
    shared = np.unique(busy).size > 1
    if shared:
        x = np.column_stack([np.ones_like(ratio), busy - 1.0])
        speed, slope = optimize.lsq_linear(x, ratio, bounds=([1e-9, 0.0], [np.inf, np.inf])).x
    else:  # every point at one busy count: no slope to fit, the speed is the mean ratio
        speed, slope = float(ratio.mean()), 0.0
    noise = ratio / (speed + slope * (busy - 1.0))
    return LoadFit(
        float(speed),
        float(slope / speed) if shared else None,
        _cv(noise[busy == 1]),
        _cv(noise[busy > 1]),
        int(ratio.size),
        {int(b): int(n) for b, n in zip(*np.unique(busy, return_counts=True))},
    )


@dataclass(frozen=True)
class BatchLevel:
    """A phase against a batching server: ``level`` requests in flight (1: the rounds, one at a
    time), the requests it sent, and the steps the server ran meanwhile (its step log)."""

    level: int
    requests: int
    steps: tuple[LoggedStep, ...]

    def as_dict(self) -> dict:
        running = np.array([s.sampling for s in self.steps], dtype=float)
        return {
            "level": self.level,
            "requests": self.requests,
            "steps": len(self.steps),
            "sampling_median": float(np.median(running)) if running.size else None,
            "sampling_max": int(running.max()) if running.size else None,
        }


def step_seconds(step: LoggedStep) -> float:
    """A logged step's seconds as the gate's core counted them (from its start to the gate having it
    back): what the simulator's step takes, the engine's own time and the hop back to the gate's
    loop included."""
    return float(step.ended) - float(step.began)


def fit_steps(steps) -> StepFit:
    """The step model fitted to logged steps (:class:`qsim.runfile.LoggedStep`; those without their
    composition, from an older gate, are left out): :meth:`qsim.engines.StepModel.fit` of
    :func:`step_seconds` on the prefill tokens, the sequences that produced a token and the context
    held."""
    known = [s for s in steps if s.prefill_tokens >= 0]
    if len(known) < 4:
        raise ValueError(
            "a step model needs at least 4 logged steps with what they computed, the "
            "server logged "
            f"{len(known)} (a qlab gate from before step compositions were logged?)"
        )
    return StepModel.fit(
        [s.prefill_tokens for s in known],
        [s.sampling for s in known],
        [s.context for s in known],
        [step_seconds(s) for s in known],
    )


@dataclass(frozen=True)
class StepCalibration:
    """A batching server's step model, fitted to the steps of every phase (:func:`fit_steps`)."""

    fit: StepFit
    levels: tuple[BatchLevel, ...]
    # fitted to the engine's own counters: the model, where there
    engine: EngineStepFit | None = None

    @property
    def model(self) -> StepModel:
        return (self.fit if self.engine is None else self.engine.fit).calibrated

    def as_dict(self) -> dict:
        f = self.fit
        return {
            "median_rel_error": f.median_rel_error,
            "worst_rel_error": f.worst_rel_error,
            "cv": f.cv,
            "r2": _json_number(f.r2),
            "n": f.n,
            "standard_errors": dict(zip(STEP_FIELDS, map(_json_number, f.se))),
            "seconds": "gate: each step's start to the gate having it back",
            "levels": [lv.as_dict() for lv in self.levels],
            "engine": None if self.engine is None else self.engine.as_dict(),
        }


@dataclass(frozen=True)
class Calibration:
    """The overall fit over every round, each round's own, and the load phase's levels and fit
    (engines one at a time) or the step model (a batching server)."""

    overall: Fit
    rounds: tuple[Round, ...]
    tokenizer: str | None = None
    levels: tuple[LoadLevel, ...] = ()
    load: LoadFit | None = None
    steps: StepCalibration | None = None

    def as_dict(self) -> dict:
        """The JSON that ``ServiceModel.load`` reads (its ``model`` key), ``LoadTerms.load`` too
        (its ``load`` and ``step`` keys; ``step`` is a step model file too, as ``--step FILE``
        reads), and people read."""
        load = (
            None
            if self.load is None
            else {**self.load.as_dict(), "levels": [lv.as_dict() for lv in self.levels]}
        )
        step = (
            {}
            if self.steps is None
            else {"step": asdict(self.steps.model), "step_fit": self.steps.as_dict()}
        )
        engine = None if self.steps is None else self.steps.engine
        if engine is not None and engine.front_end is not None:  # LoadTerms reads it
            step["front_end"] = asdict(engine.front_end.model)
        return {
            "model": asdict(self.overall.model),
            "median_rel_error": self.overall.median_rel_error,
            "worst_rel_error": self.overall.worst_rel_error,
            "n": self.overall.n,
            "prompt_tokenizer": self.tokenizer,
            "rounds": [r.as_dict() for r in self.rounds],
            "load": load,
            **step,
        }

    def save(self, path: str | Path) -> None:
        """Write the JSON whole or not at all (a resumed ``qlab live`` reuses it)."""
        atomic_write(path, (json.dumps(self.as_dict(), indent=2) + "\n").encode())
