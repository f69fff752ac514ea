"""What the controller knows of a request's work before it runs: estimators the queue core consults.

A request asks for up to ``max_new_tokens`` (its *limit*) but often stops early (a stop string, an
end of text): the reference study measured a median of 13 % of a 64-token limit. The queue core
(:class:`qsim.queue.AdmissionQueue`) asks its estimator for each arrival's calibrated estimate and,
when a run completes, tells it the tokens generated, in the simulator and the gate alike:

* none (the policy's ``estimator = "limit"``): the estimate from the limit, as the driver gives it;
* :class:`Learned`: the limit times the share of their limit that recent requests of the same size
  class used, their mean or a chosen quantile over the last ``window`` completions (1 before any);
* :class:`Oracle`: the tokens the request will generate, which only the simulator knows.

An estimate is the calibrated one scaled by the service line's ratio (work estimated over work at
the limit), so a trace's own estimates keep their calibration. The speed tracker then learns the
machine's speed against the tokens actually generated: the estimator, not the tracker, accounts for
early stops.
"""

from __future__ import annotations

from collections import deque

import numpy as np

ESTIMATORS = ("limit", "learned", "oracle")


def size_class(limit: int) -> int:
    """The class a limit learns with: the next power of two (4, 16 and 64 are their own)."""
    return 1 << max(0, int(limit) - 1).bit_length()


class _Scaled:
    """An estimate of the work of ``tokens`` new tokens, scaled from the calibrated estimate at
    the limit."""

    learns = False

    def __init__(self, model) -> None:
        self.model = model

    def _scale(self, calibrated_s: float, limit: int, prompt: int, tokens: float) -> float:
        at_limit = float(self.model.estimate(limit, prompt))
        return (
            calibrated_s * float(self.model.estimate(tokens, prompt)) / at_limit
            if at_limit > 0
            else calibrated_s
        )

    def work_s(self, limit: int, prompt: int, generated: int) -> float:
        """The calibrated time of the work a completed run did: what the speed tracker compares
        with."""
        return float(self.model.estimate(generated, prompt))

    def learn(self, limit: int, generated: int) -> None:
        pass


class Learned(_Scaled):
    """The limit times the used share of recent completions of the same size class (mean, or a
    quantile)."""

    learns = True

    def __init__(self, model, quantile: float | None = None, window: int = 200) -> None:
        super().__init__(model)
        self.quantile, self.window = quantile, int(window)
        self.shares: dict[int, deque[float]] = {}
        # the statistic, recomputed at each completion, read at each arrival
        self.share_now: dict[int, float] = {}

    def base_s(
        self, calibrated_s: float, limit: int, prompt: int, generated: int | None = None
    ) -> float:
        share = self.share_now.get(size_class(limit), 1.0)
        return self._scale(calibrated_s, limit, prompt, max(1.0, share * limit))

    def learn(self, limit: int, generated: int) -> None:
        key = size_class(limit)
        seen = self.shares.setdefault(key, deque(maxlen=self.window))
        seen.append(min(1.0, max(0.0, generated / limit)))
        self.share_now[key] = float(
            np.mean(seen) if self.quantile is None else np.quantile(seen, self.quantile)
        )


class Oracle(_Scaled):
    """The tokens the request will generate (the simulator passes them; a live gate cannot)."""

    def base_s(
        self, calibrated_s: float, limit: int, prompt: int, generated: int | None = None
    ) -> float:
        if generated is None:
            raise ValueError(
                "the oracle estimator needs each request's tokens generated (simulator only)"
            )
        return self._scale(calibrated_s, limit, prompt, generated)


def make_estimator(kind: str, model, quantile: float | None = None, window: int = 200):
    """The estimator ``kind`` names over ``model``; None for "limit" (the driver's estimate as it
    is)."""
    if kind == "limit":
        return None
    if kind == "learned":
        return Learned(model, quantile, window)
    if kind == "oracle":
        return Oracle(model)
    raise ValueError(f"unknown estimator {kind!r}; choose one of {', '.join(ESTIMATORS)}")
