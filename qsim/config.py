"""One configuration of a server: what ``simulate``, the gate, a run file and ``qlab compare`` all
read and write.

A :class:`ServerConfig` is everything the queue core (:mod:`qsim.queue`) is built from: the
policy, the engine model, the calibrated service line, the speed tracker's settings and the
stall rule. What varies per request (failures, patience, the tokens each generates) or per
run (a machine's speed schedule) stays apart, as inputs to a run.

It travels as JSON (:meth:`ServerConfig.to_fields` / :meth:`ServerConfig.from_fields`): the
gate reports it in ``/stats``, ``qlab replay`` writes it into every run file (column
``server_config``) and ``qlab compare`` rebuilds the simulator's server from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from .engines import Batching, EngineModel, OneAtATime, engine_fields, engine_from_fields
from .policy import PRESETS, Policy, policy_from_fields
from .service import ServiceModel


@dataclass(frozen=True)
class StallRule:
    """An engine is stalled once its request has run past max(factor x estimate at start, floor_s).

    Far beyond any speed change seen on a shared machine (2.25x); the floor keeps a
    short request's hiccup from counting.
    """

    factor: float = 10.0
    floor_s: float = 5.0

    def __post_init__(self) -> None:
        if not (self.factor >= 1 and math.isfinite(self.factor)):
            raise ValueError(f"stall factor must be a finite number >= 1, got {self.factor}")
        if not (self.floor_s > 0 and math.isfinite(self.floor_s)):
            raise ValueError(
                f"stall floor must be a positive number of seconds, got {self.floor_s}"
            )

    def after_s(self, est_service_s: float) -> float:
        """How long a request estimated at ``est_service_s`` may run before its engine counts as
        stalled."""
        return max(self.factor * est_service_s, self.floor_s)


@dataclass(frozen=True)
class ServerConfig:
    """A server: its policy, its engines, its calibration, and how it tracks speed and stalls.

    engine: an engine model (:mod:`qsim.engines`), or an int K for K engines one at a time.
    model: the calibrated service line estimates come from.
    fixed_estimate: keep the calibrated estimate (speed factor fixed at initial_speed_factor)
    instead of
        tracking the machine's speed: the baseline tracking is measured against.
    tracker_weight: the speed tracker's EWMA weight; initial_speed_factor: where it starts (a live
    server's
        is resident across runs).
    stall: the stall rule (None: engines never stall, the study's model; the gate's default is
    StallRule()). watch_interval_s: while every engine is stalled, how often the waiting past their
    deadline are ended. seed: the seed of the server's own random draws (a randomised admission
    rule's, a batching engine's
        step times in the simulator); the n-th arrival draws the same under every policy.
    """

    policy: Policy = PRESETS["none"]
    engine: EngineModel | int = OneAtATime()
    model: ServiceModel = ServiceModel()
    fixed_estimate: bool = False
    tracker_weight: float = 0.2
    initial_speed_factor: float = 1.0
    stall: StallRule | None = None
    watch_interval_s: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise ValueError(f"policy must be a qsim Policy, got {type(self.policy).__name__}")
        if isinstance(self.engine, int) and not isinstance(self.engine, bool):
            object.__setattr__(self, "engine", OneAtATime(self.engine))
        if not isinstance(self.engine, (OneAtATime, Batching)):
            raise ValueError(
                f"engine must be an engine model (qsim.engines) or a count, got {self.engine!r}"
            )
        if not 0 < self.tracker_weight <= 1:
            raise ValueError(f"tracker_weight must be in (0, 1], got {self.tracker_weight}")
        if not (self.initial_speed_factor > 0 and math.isfinite(self.initial_speed_factor)):
            raise ValueError(
                f"initial_speed_factor must be a positive number, got {self.initial_speed_factor}"
            )
        if not (self.watch_interval_s > 0 and math.isfinite(self.watch_interval_s)):
            raise ValueError(
                "watch_interval_s must be a positive number of seconds, got "
                f"{self.watch_interval_s}"
            )

    @property
    def engines(self) -> int:
        """How many engines the queue holds (a batching engine is one)."""
        return self.engine.engines

    @property
    def batching(self) -> bool:
        return isinstance(self.engine, Batching)

    def replace(self, **changes) -> "ServerConfig":
        return dataclasses.replace(self, **changes)

    # -- as JSON ------------------------------------------------------------------------

    def to_fields(self) -> dict[str, Any]:
        """JSON-able fields (the policy's every field, a policy class's own too)."""
        return {
            "policy": dataclasses.asdict(self.policy),
            "engine": engine_fields(self.engine),
            "model": dataclasses.asdict(self.model),
            "fixed_estimate": self.fixed_estimate,
            "tracker_weight": self.tracker_weight,
            "initial_speed_factor": self.initial_speed_factor,
            "stall": None if self.stall is None else dataclasses.asdict(self.stall),
            "watch_interval_s": self.watch_interval_s,
            "seed": self.seed,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_fields(), sort_keys=True)

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> "ServerConfig":
        """The config :meth:`to_fields` wrote (keys it lacks take their defaults). ValueError
        naming what is wrong."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"a server config is a table, got {type(raw).__name__}")
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"server config has no field(s) {', '.join(sorted(unknown))}")
        changes: dict[str, Any] = {}
        try:
            if "policy" in raw:
                changes["policy"] = policy_from_fields(raw["policy"])
            if "engine" in raw:
                changes["engine"] = engine_from_fields(raw["engine"])
            if "model" in raw:
                changes["model"] = ServiceModel.from_fields(raw["model"])
            if "stall" in raw:
                changes["stall"] = None if raw["stall"] is None else StallRule(**raw["stall"])
            for name in (
                "fixed_estimate",
                "tracker_weight",
                "initial_speed_factor",
                "watch_interval_s",
                "seed",
            ):
                if name in raw:
                    changes[name] = raw[name]
        except (TypeError, KeyError) as exc:
            raise ValueError(f"server config: {exc}") from None
        return cls(**changes)

    @classmethod
    def from_json(cls, text: str) -> "ServerConfig":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"server config is not JSON: {exc}") from None
        return cls.from_fields(raw)


def as_config(config: "ServerConfig | Policy") -> ServerConfig:
    """A ServerConfig, or a bare Policy as the config of one engine with everything else at its
    default."""
    if isinstance(config, ServerConfig):
        return config
    if isinstance(config, Policy):
        return ServerConfig(config)
    raise TypeError(f"expected a ServerConfig or a Policy, got {type(config).__name__}")


__all__ = ["ServerConfig", "StallRule", "as_config"]
