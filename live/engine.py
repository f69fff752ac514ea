"""Engines: what runs one request. The gate calls ``run`` from an engine thread.

An engine is anything with the :class:`Engine` shape. Two exist: the GPT-2
engine (:mod:`live.gpt2`, the only module that imports torch) and
:class:`SyntheticEngine`, which sleeps for the calibrated service time so the
whole harness runs on machines without a GPU, in tests and in the demo.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from qsim.service import ServiceModel
from qsim.workload import lognormal_noise

from .tokenizer import ByteTokenizer


@dataclass(frozen=True)
class EngineResult:
    """What one run produced: the text, tokens generated and the engine's own seconds."""

    text: str
    tokens: int
    engine_s: float


@runtime_checkable
class Engine(Protocol):
    """One request at a time; ``run`` blocks and is called from one engine thread.

    max_new_tokens_limit: the most new tokens a request may ask for (None: no
    limit of the engine's own; the service applies its cap).
    """

    max_new_tokens_limit: int | None

    def run(self, prompt: str, max_new_tokens: int, stop: Sequence[str] | None) -> EngineResult: ...

    def count_tokens(self, text: str) -> int: ...

    def warmup(self) -> None: ...

    def info(self) -> dict: ...


def apply_stop(text: str, stop: Sequence[str] | None, search_from: int = 0) -> str | None:
    """Text cut before the earliest stop string found at or after ``search_from``; None if none is found.

    The stop string itself is not part of the answer.
    """
    if not stop:
        return None
    hits = [i for i in (text.find(s, search_from) for s in stop) if i >= 0]
    return text[: min(hits)] if hits else None


@dataclass(frozen=True)
class SpeedSchedule:
    """Speed factor as a step function of seconds since the engine started.

    ``steps`` are (elapsed_s, speed) pairs; before the first step the base speed holds.
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
    """'10:2.2,30:1' -> ((10.0, 2.2), (30.0, 1.0)): from 10 s on 2.2x slower, from 30 s back to 1x."""
    steps = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            t, s = part.split(":")
            steps.append((float(t), float(s)))
        except ValueError:
            raise ValueError(f"speed schedule entries are SECONDS:FACTOR, got {part!r}") from None
    return tuple(steps)


class SyntheticEngine:
    """Sleeps the service model's estimate x speed (x optional lognormal noise).

    speed > 1 is a slower machine. ``schedule`` changes the speed at given
    seconds since construction (the machine slowing down mid-run). The text is
    ``tokens`` copies of one word, so its length follows the request.
    """

    max_new_tokens_limit = None

    def __init__(
        self,
        model: ServiceModel = ServiceModel(),
        speed: float = 1.0,
        noise_cv: float = 0.0,
        seed: int = 0,
        schedule: Sequence[tuple[float, float]] = (),
        clock=time.monotonic,
    ) -> None:
        if noise_cv < 0:
            raise ValueError(f"noise_cv must be >= 0, got {noise_cv}")
        self.model = model
        self.speed = SpeedSchedule(float(speed), tuple((float(t), float(s)) for t, s in schedule))
        self.noise_cv = float(noise_cv)
        self._rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()  # an engine is normally used by one thread; be safe anyway
        self._clock = clock
        self._started = clock()
        self._tokenizer = ByteTokenizer()

    def duration_s(self, max_new_tokens: int) -> float:
        """Seconds the next run of this size will take (draws the noise)."""
        speed = self.speed.at(self._clock() - self._started)
        with self._rng_lock:
            noise = float(lognormal_noise(self._rng, 1, self.noise_cv)[0])
        return float(self.model.estimate(max_new_tokens)) * speed * noise

    def run(self, prompt: str, max_new_tokens: int, stop: Sequence[str] | None = None) -> EngineResult:
        start = time.perf_counter()
        time.sleep(self.duration_s(max_new_tokens))
        text = " tok" * max_new_tokens
        cut = apply_stop(text, stop)
        # The sleep was for every token: a synthetic stop shortens the text, not the work.
        text = text if cut is None else cut
        return EngineResult(text, max_new_tokens, time.perf_counter() - start)

    def count_tokens(self, text: str) -> int:
        return self._tokenizer.count(text)

    def warmup(self) -> None:
        """Nothing to warm: sleeping needs no kernels or caches."""

    def info(self) -> dict:
        return {
            "engine": "synthetic",
            "intercept_s": self.model.intercept_s,
            "per_token_s": self.model.per_token_s,
            "speed": self.speed.base,
            "schedule": [list(step) for step in self.speed.steps],
            "noise_cv": self.noise_cv,
            "tokenizer": self._tokenizer.name,
        }
