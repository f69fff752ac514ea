"""Service-time estimates: the calibrated line, the speed tracker and the machine's speed over time.

Service time is close to a straight line in the number of new tokens (plus a
term in the prompt's tokens, the prefill), but the machine changes speed;
:class:`SpeedTracker` scales every estimate by a running ratio of actual over
predicted engine time, as the live gate does. :class:`SpeedSchedule` is how
fast the machine is at each moment, for the simulator and the synthetic engine alike.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .engines import FrontEnd, StepModel


@dataclass(frozen=True)
class ServiceModel:
    """S = intercept_s + per_prompt_token_s * prompt tokens + per_token_s * new tokens.

    The reference: 1 ms + 8.5 ms per new token, and no prompt term (the study's prompts were
    short); ``qlab calibrate`` fits the prompt term where it sends several prompt lengths.
    """

    intercept_s: float = 0.001
    per_token_s: float = 0.0085
    per_prompt_token_s: float = 0.0

    def __post_init__(self) -> None:
        if not (
            self.intercept_s >= 0
            and self.per_token_s > 0
            and self.per_prompt_token_s >= 0
            and all(
                map(math.isfinite, (self.intercept_s, self.per_token_s, self.per_prompt_token_s))
            )
        ):
            raise ValueError(
                "service model needs intercept_s >= 0, per_token_s > 0 and per_prompt_token_s >= "
                "0, all finite, "
                f"got {self.intercept_s}, {self.per_token_s}, {self.per_prompt_token_s}"
            )

    def estimate(self, max_new_tokens, prompt_tokens=0):
        """Estimated seconds for a request (works on scalars and numpy arrays)."""
        if type(max_new_tokens) is int and type(prompt_tokens) is int:
            # One request (the gate's every arrival): plain floats, the same operations in the same
            # order as numpy's below, so the same bits, without numpy's array machinery on a
            # refusal's path.
            seconds = self.intercept_s + self.per_token_s * float(max_new_tokens)
            return (
                seconds
                if self.per_prompt_token_s == 0
                else seconds + self.per_prompt_token_s * float(prompt_tokens)
            )
        new = self.per_token_s * np.asarray(max_new_tokens, dtype=float)
        if self.per_prompt_token_s == 0:  # no prefill term: the study's line, exactly
            return self.intercept_s + new
        return (
            self.intercept_s
            + new
            + self.per_prompt_token_s * np.asarray(prompt_tokens, dtype=float)
        )

    def tokens_for(self, seconds: float) -> int:
        """The whole number of new tokens (>= 1) whose estimate is closest to ``seconds``."""
        return max(1, round((seconds - self.intercept_s) / self.per_token_s))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ServiceModel":
        """Read a model saved by :meth:`save` or by ``qlab calibrate`` (its ``model`` key)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read a service model: {exc}") from None
        return cls.from_calibration(data, str(path))

    @classmethod
    def from_calibration(cls, data: Any, where: str = "calibration") -> "ServiceModel":
        """The model of a saved model's or a calibration's parsed JSON (its ``model`` key)."""
        data = data.get("model", data) if isinstance(data, dict) else data
        try:
            return cls.from_fields(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{where}: expected intercept_s and per_token_s ({exc})") from None

    @classmethod
    def from_fields(cls, data) -> "ServiceModel":
        """From a mapping of the fields (as saved, or as /stats reports them); the prompt term
        may be absent."""
        return cls(
            intercept_s=float(data["intercept_s"]),
            per_token_s=float(data["per_token_s"]),
            per_prompt_token_s=float(data.get("per_prompt_token_s", 0.0)),
        )


@dataclass(frozen=True)
class LoadTerms:
    """What ``qlab calibrate`` measured beside the line, under load: ``concurrency``, the slowdown
    per other busy engine (:class:`qsim.engines.OneAtATime`), and ``noise_cv``, the CV of one
    request's time around the model x that slowdown (None: not measured); against a batching server,
    ``step``: the step model fitted to the steps it ran, its CV the spread of a step around the fit
    (None: not a batching server's calibration), and ``front_end``: its API process's costs
    (:class:`qsim.engines.FrontEnd`; None: not measured). A calibration file without them (an older
    ``qlab calibrate``'s) reads as no slowdown, noise not said, no step model."""

    concurrency: float = 0.0
    noise_cv: float | None = None
    step: StepModel | None = None
    front_end: FrontEnd | None = None

    def __post_init__(self) -> None:
        for name, value in (("concurrency", self.concurrency), ("noise_cv", self.noise_cv)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"calibrated {name} must be a finite number >= 0, got {value}")

    @classmethod
    def load(cls, path: str | Path | None) -> "LoadTerms":
        """The terms of a calibration JSON (its ``load`` and ``step`` keys); none (None, or a file
        without the keys) reads as :class:`LoadTerms`'s defaults."""
        if not path:
            return cls()
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read a calibration: {exc}") from None
        return cls.from_calibration(data, str(path))

    @classmethod
    def from_calibration(cls, data: Any, where: str = "calibration") -> "LoadTerms":
        """The terms of a calibration's parsed JSON (``where`` names it in a ValueError)."""
        data = data if isinstance(data, dict) else {}
        load, step, front = data.get("load"), data.get("step"), data.get("front_end")
        try:
            step = None if step is None else StepModel.from_fields(step)
        except ValueError as exc:
            raise ValueError(f"{where}: bad calibrated step model ({exc})") from None
        try:
            front = (
                None
                if front is None
                else FrontEnd(front["request_s"], front["token_s"], front.get("step_s", 0.0))
            )
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"{where}: bad calibrated front end ({exc!r})") from None
        if not isinstance(load, dict):
            return cls(step=step, front_end=front)
        try:
            concurrency, cv = load.get("concurrency"), load.get("noise_cv")
            return cls(
                0.0 if concurrency is None else float(concurrency),
                None if cv is None else float(cv),
                step,
                front,
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: bad calibrated load terms ({exc})") from None


@dataclass(frozen=True)
class Fit:
    """A least-squares fit and how well it predicts one request."""

    model: ServiceModel
    median_rel_error: float
    worst_rel_error: float
    n: int


def fit(tokens, seconds, prompt_tokens=None) -> Fit:
    """Fit the service line by least squares; report per-request relative errors.

    With ``prompt_tokens`` of at least two lengths, the prompt term too: a least-squares fit of all
    three terms bounded at 0 (scipy's lsq_linear), since a negative cost is noise around a tiny one.
    """
    x = np.asarray(tokens, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if x.shape != y.shape or x.size < 2:
        raise ValueError("fit needs two equally long sequences of at least 2 points")
    if np.unique(x).size < 2:
        raise ValueError("fit needs at least two different token counts")
    p = None if prompt_tokens is None else np.asarray(prompt_tokens, dtype=float)
    if p is not None and p.shape != x.shape:
        raise ValueError("prompt_tokens needs one value per point")
    from scipy import optimize, stats  # at first use, not import: it costs each qlab process ~1 s

    if p is None or np.unique(p).size < 2:
        line = stats.linregress(x, y)
        # A negative intercept is noise around a tiny fixed cost; clamp it rather than predict < 0.
        model = ServiceModel(
            intercept_s=max(0.0, float(line.intercept)), per_token_s=float(line.slope)
        )
    else:
        terms = optimize.lsq_linear(
            np.column_stack([np.ones_like(x), x, p]), y, bounds=(0, np.inf)
        ).x
        model = ServiceModel(
            intercept_s=float(terms[0]),
            per_token_s=float(terms[1]),
            per_prompt_token_s=float(terms[2]),
        )
    rel = np.abs(model.estimate(x, 0 if p is None else p) - y) / y
    return Fit(model, float(np.median(rel)), float(np.max(rel)), int(x.size))


#: The most one observation moves the speed factor up, as a share of it: a run far beyond the model
#: (an upstream that paused, a machine that hiccuped) is one observation, not a new speed. 25 % up
#: mirrors the 20 % down that the EWMA's weight (0.2) already bounds a step to (a ratio is never
#: below 0): factor x 1.25 or / 1.25.
MAX_STEP = 0.25
_INF = math.inf  # a module global: observe() runs once per completed request


class SpeedTracker:
    """Exponentially weighted ratio of actual over predicted engine time, each step bounded.

    ``factor`` multiplies every estimate. Each completed request moves it towards its ratio r =
    actual / predicted by ``weight`` (an EWMA: factor + weight x (r - factor)), but never by more
    than ``max_step`` of itself: the new factor stays within [factor / (1 + max_step),
    factor x (1 + max_step)]. So one outlier (a run 6 x its estimate, an upstream that paused) moves
    the factor 25 %, not 100 % (with the default weight 0.2); a lasting change of speed is followed
    as before (a machine 2.25 x slower: no step reaches the bound; 5 x slower: the factor passes
    4 after 9 requests, 7 unbounded). Inside the bound, which an observation below 2.25 x the factor
    is (with the default weight the lower bound is where the plain EWMA's step ends anyway), the
    step is the plain EWMA's. With ``fixed=True`` it stays at its initial value: the
    stale-calibration baseline that tracking is measured against.
    """

    def __init__(
        self,
        weight: float = 0.2,
        initial: float = 1.0,
        fixed: bool = False,
        max_step: float = MAX_STEP,
    ) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if not initial > 0:
            raise ValueError(f"initial factor must be > 0, got {initial}")
        if not max_step > 0:
            raise ValueError(f"max_step must be > 0, got {max_step}")
        self.weight = weight
        self.factor = float(initial)
        self.fixed = fixed
        self.max_step = max_step

    @property
    def max_step(self) -> float:
        return self._up - 1.0

    @max_step.setter
    def max_step(self, value: float) -> None:
        # observe() runs once per completed request: it reads the bound as 1 + max_step, kept ready.
        self._up = 1.0 + value

    def observe(self, predicted_s: float, actual_s: float) -> float:
        """Fold one completed request in; ignores unusable pairs (failed or zero-time)."""
        if not self.fixed and predicted_s > 0 and actual_s > 0 and actual_s != _INF:
            factor = self.factor
            moved = factor + self.weight * (actual_s / predicted_s - factor)
            up = self._up
            if moved > factor * up:
                moved = factor * up
            elif moved < factor / up:
                moved = factor / up
            self.factor = moved
        return self.factor

    def scale(self, est_s: float) -> float:
        return est_s * self.factor


@dataclass(frozen=True)
class SpeedSchedule:
    """How many times slower than calibrated the machine is, as a step function of seconds since it
    started.

    ``steps`` are (elapsed_s, speed) pairs; before the first step the base speed holds. The
    simulator (``simulate(..., speed_schedule=)``) and the synthetic engine (``--speed-schedule``)
    read the same one: a run takes its estimate times the speed at the moment it starts.
    """

    base: float = 1.0
    steps: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.base > 0 or any(not s > 0 for _, s in self.steps):
            raise ValueError("speed factors must be > 0")
        times = [t for t, _ in self.steps]
        if times != sorted(times) or any(t < 0 for t in times):
            raise ValueError(f"speed schedule times must be >= 0 and increasing, got {times}")

    def at(self, elapsed_s: float) -> float:
        k = bisect.bisect_right([t for t, _ in self.steps], elapsed_s)
        return self.base if k == 0 else self.steps[k - 1][1]


def parse_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """'10:2.2,30:1' -> ((10.0, 2.2), (30.0, 1.0)): from 10 s on 2.2x slower, from 30 s back to
    1x."""
    steps = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            t, s = part.split(":")
            steps.append((float(t), float(s)))
        except ValueError:
            raise ValueError(f"speed schedule entries are SECONDS:FACTOR, got {part!r}") from None
    SpeedSchedule(1.0, tuple(steps))  # checks the factors and the order
    return tuple(steps)
