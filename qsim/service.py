"""Service-time estimates: the calibrated line and the speed tracker.

Service time is close to a straight line in the number of new tokens, but the
machine changes speed; :class:`SpeedTracker` scales every estimate by a running
ratio of actual over predicted engine time, as the live gate does.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class ServiceModel:
    """S = intercept_s + per_token_s * max_new_tokens (reference: 1 ms + 8.5 ms/token)."""

    intercept_s: float = 0.001
    per_token_s: float = 0.0085

    def __post_init__(self) -> None:
        if not (self.intercept_s >= 0 and self.per_token_s > 0):
            raise ValueError(
                f"service model needs intercept_s >= 0 and per_token_s > 0, got {self.intercept_s}, {self.per_token_s}"
            )

    def estimate(self, max_new_tokens):
        """Estimated seconds for a request (works on scalars and numpy arrays)."""
        return self.intercept_s + self.per_token_s * np.asarray(max_new_tokens, dtype=float)

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
        data = data.get("model", data) if isinstance(data, dict) else data
        try:
            return cls(intercept_s=float(data["intercept_s"]), per_token_s=float(data["per_token_s"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: expected intercept_s and per_token_s ({exc})") from None


@dataclass(frozen=True)
class Fit:
    """A least-squares fit and how well it predicts one request."""

    model: ServiceModel
    median_rel_error: float
    worst_rel_error: float
    n: int


def fit(tokens, seconds) -> Fit:
    """Fit the service line by least squares; report per-request relative errors."""
    x = np.asarray(tokens, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if x.shape != y.shape or x.size < 2:
        raise ValueError("fit needs two equally long sequences of at least 2 points")
    if np.unique(x).size < 2:
        raise ValueError("fit needs at least two different token counts")
    line = stats.linregress(x, y)
    # A negative intercept is noise around a tiny fixed cost; clamp it rather than predict < 0.
    model = ServiceModel(intercept_s=max(0.0, float(line.intercept)), per_token_s=float(line.slope))
    rel = np.abs(model.estimate(x) - y) / y
    return Fit(model, float(np.median(rel)), float(np.max(rel)), int(x.size))


class SpeedTracker:
    """Exponentially weighted ratio of actual over predicted engine time.

    ``factor`` multiplies every estimate. With ``fixed=True`` it stays at its
    initial value: the stale-calibration baseline that tracking is measured against.
    """

    def __init__(self, weight: float = 0.2, initial: float = 1.0, fixed: bool = False) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if not initial > 0:
            raise ValueError(f"initial factor must be > 0, got {initial}")
        self.weight = weight
        self.factor = float(initial)
        self.fixed = fixed

    def observe(self, predicted_s: float, actual_s: float) -> float:
        """Fold one completed request in; ignores unusable pairs (failed or zero-time)."""
        if not self.fixed and predicted_s > 0 and actual_s > 0 and math.isfinite(actual_s):
            self.factor += self.weight * (actual_s / predicted_s - self.factor)
        return self.factor

    def scale(self, est_s: float) -> float:
        return est_s * self.factor
