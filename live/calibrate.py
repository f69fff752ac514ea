"""Calibration: fit the service line S = intercept + per_token * max_new_tokens on a live server.

Requests go one at a time, so none waits in the gate and the engine time the
service reports is the service time alone. Sizes are interleaved (1, 2, 4, ...
64, 1, 2, ...) rather than grouped, so a machine that drifts in speed during a
round spreads its drift over every size instead of bending the line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from inputs.atomic import atomic_write
from qsim.service import Fit, ServiceModel, fit

from .loadgen import synthetic_prompt

SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class CalibrationConfig:
    url: str
    rounds: int = 2
    per_size: int = 12
    sizes: tuple[int, ...] = SIZES
    prompt_words: int = 16
    deadline_ms: int | None = None  # None: the server's default (run calibration on an idle server)
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.per_size < 1:
            raise ValueError(f"rounds and per_size must be >= 1, got {self.rounds}, {self.per_size}")
        if len(set(self.sizes)) < 2 or min(self.sizes) < 1:
            raise ValueError(f"calibration needs at least two different sizes >= 1, got {self.sizes}")


@dataclass(frozen=True)
class Round:
    """One round's fit and the points it was made from."""

    round: int
    model: ServiceModel
    median_rel_error: float
    worst_rel_error: float
    tokens: tuple[int, ...]
    engine_s: tuple[float, ...]

    def as_dict(self) -> dict:
        return {"round": self.round, "model": asdict(self.model), "n": len(self.tokens),
                "median_rel_error": self.median_rel_error, "worst_rel_error": self.worst_rel_error,
                "tokens": list(self.tokens), "engine_s": list(self.engine_s)}


@dataclass(frozen=True)
class Calibration:
    """The overall fit over every round, and each round's own."""

    overall: Fit
    rounds: tuple[Round, ...]

    def as_dict(self) -> dict:
        """The JSON that ``ServiceModel.load`` reads (its ``model`` key) and people read too."""
        return {"model": asdict(self.overall.model), "median_rel_error": self.overall.median_rel_error,
                "worst_rel_error": self.overall.worst_rel_error, "n": self.overall.n,
                "rounds": [r.as_dict() for r in self.rounds]}

    def save(self, path: str | Path) -> None:
        """Write the JSON whole or not at all (a resumed ``qlab live`` reuses it)."""
        atomic_write(path, (json.dumps(self.as_dict(), indent=2) + "\n").encode())


def schedule(cfg: CalibrationConfig) -> list[int]:
    """Token counts of one round, sizes interleaved."""
    return [s for _ in range(cfg.per_size) for s in cfg.sizes]


def _engine_seconds(http: httpx.Client, body: dict) -> float:
    response = http.post("/v1/generate", json=body)
    if response.status_code != 200:
        raise ValueError(f"calibration request {body['max_new_tokens']} tokens got HTTP {response.status_code}: "
                         f"{response.text[:200]} (calibrate an idle server, e.g. policy none)")
    return float(response.json()["timings"]["engine_s"])


def measure_round(http: httpx.Client, cfg: CalibrationConfig, number: int) -> Round:
    tokens = schedule(cfg)
    prompt = synthetic_prompt(cfg.prompt_words)
    seconds = []
    for n in tokens:
        body = {"prompt": prompt, "max_new_tokens": n}
        if cfg.deadline_ms is not None:
            body["deadline_ms"] = cfg.deadline_ms
        seconds.append(_engine_seconds(http, body))
    f = fit(tokens, seconds)
    return Round(number, f.model, f.median_rel_error, f.worst_rel_error, tuple(tokens), tuple(seconds))


def calibrate(cfg: CalibrationConfig, progress=None) -> Calibration:
    """Warm up once, measure ``rounds`` rounds, fit each and all of them together."""
    with httpx.Client(base_url=cfg.url, timeout=cfg.timeout_s) as http:
        # The first request pays for lazy set-up (connections, allocator, kernels): not service time.
        _engine_seconds(http, {"prompt": synthetic_prompt(cfg.prompt_words), "max_new_tokens": max(cfg.sizes)})
        rounds = []
        for number in range(1, cfg.rounds + 1):
            rounds.append(measure_round(http, cfg, number))
            if progress:
                progress(rounds[-1])
    tokens = np.concatenate([r.tokens for r in rounds])
    seconds = np.concatenate([r.engine_s for r in rounds])
    return Calibration(fit(tokens, seconds), tuple(rounds))


def describe(r: Round | Fit, label: str) -> str:
    m = r.model
    return (f"{label}: intercept {m.intercept_s * 1e3:.2f} ms, {m.per_token_s * 1e3:.3f} ms/token; "
            f"error of the line on one request: median {r.median_rel_error:.1%}, worst {r.worst_rel_error:.1%}")


def probe(url: str, model: ServiceModel, requests: int = 5, max_new_tokens: int = 16,
          prompt_words: int = 16, timeout_s: float = 120.0) -> float:
    """The machine's speed now: median engine time of a few fixed-size requests over the model's estimate.

    Sent one at a time on an idle server; NaN when none was answered (the run's rows then tell why).
    """
    body = {"prompt": synthetic_prompt(prompt_words), "max_new_tokens": max_new_tokens}
    seconds = []
    with httpx.Client(base_url=url, timeout=timeout_s) as http:
        for _ in range(requests):
            try:
                seconds.append(_engine_seconds(http, body))
            except (httpx.HTTPError, ValueError):
                continue
    return float(np.median(seconds) / model.estimate(max_new_tokens)) if seconds else float("nan")
