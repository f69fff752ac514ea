"""A live run against its prediction: would the simulator have predicted this run?

Only the arrivals are kept (:func:`predict`); service times come from the calibrated model at the
run's speed (:func:`prediction_speed`: the synthetic engine's setting, else the
probe before the run, ``speed_before`` from ``qlab live`` or ``qlab replay --probe``,
else the server's speed factor at the run's start), times lognormal noise
(:func:`prediction_noise`: the synthetic engine's ``--noise`` as the run file's
``engine_info`` records it, else the CV ``qlab calibrate`` measured under load, which the
server config's engines carry, else :data:`DEFAULT_NOISE_CV`), and each run slowed by the
engines busy at its start (their calibrated concurrency term), over many seeds. Share
in time, goodput and latency percentiles are compared with the live run's, with
95 % Student-t intervals of the mean across seeds and the 2.5-97.5 % range of
the seeds, as Vidur-like simulators report their error.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from qsim.config import ServerConfig
from qsim.engines import Batching, OneAtATime
from qsim.runfile import engine_info, fleet_spec, speed_probe, speed_schedule
from qsim.service import LoadTerms, SpeedSchedule
from qsim.workload import lognormal_noise

from .metrics import mean_ci, run_duration, summary
from .replay_clients import client_faults, clients_of
from .replay_inputs import (
    arrival_times,
    generated_tokens,
    in_arrival_order,
    run_setup,
    simulate_arrivals,
)

#: Metrics a prediction is judged on (analysis.metrics.summary's names).
PREDICTED = ("share_good", "goodput_rps", "latency_p50_s", "latency_p99_s")
#: Metrics predicted only where the run measured them: the time to the first token needs a streamed
#: answer (``qlab replay --api openai``); a run through ``/v1/generate`` has no live figure to
#: compare with.
PREDICTED_WHERE_MEASURED = ("ttft_p99_s",)
#: What the model-only prediction should reach on a live run (issue 22; BLIS reports 9.2 % and 29 %,
#: Vidur under 9 %): the most relative error of the mean over seeds, per metric.
PREDICTION_TARGETS = {
    "share_good": 0.05,
    "goodput_rps": 0.05,
    "latency_p99_s": 0.10,
    "ttft_p99_s": 0.15,
}


@dataclass(frozen=True)
class Prediction:
    table: pd.DataFrame  # one row per metric: live, sim mean, intervals, error
    per_seed: pd.DataFrame  # one row per seed: the metrics
    speed: float
    speed_source: str
    noise_cv: float
    noise_source: str = "given"
    # the engines' slowdown per other busy one (NaN: not engines one at a time)
    concurrency: float = math.nan

    def within_targets(self) -> dict[str, bool | None]:
        """Per metric of :data:`PREDICTION_TARGETS` that the prediction holds (the time to the first
        token only where the run measured it): whether its relative error is within the target
        (None: no error to judge, e.g. nothing answered live)."""
        errors = self.table["relative_error"]
        return {
            m: None if not math.isfinite(errors[m]) else bool(abs(errors[m]) <= target)
            for m, target in PREDICTION_TARGETS.items()
            if m in errors.index
        }

    def verdict(self) -> str:
        """PASS when every judged metric is within its target, MISS when one is not, n/a when one
        has no error to judge."""
        within = self.within_targets()
        return "n/a" if None in within.values() else "PASS" if all(within.values()) else "MISS"


#: The noise CV a prediction assumes where neither the caller nor the run file says (an older run
#: file, a GPT-2 engine, a server that is not a qlab gate).
DEFAULT_NOISE_CV = 0.1


def prediction_speed(run: pd.DataFrame) -> tuple[float, str]:
    """The speed the prediction runs at, and where it came from: the synthetic engine's own speed
    setting where the run file recorded it (its times are the model's x that, exactly; a probe of a
    few requests would measure it through their noise); else a probe before the run where the run
    file has one; else the gate's speed factor at the run's start."""
    engine = engine_info(run) or {}
    schedule = speed_schedule(run)
    if engine.get("engine") == "synthetic" and schedule is not None:
        return schedule.base, (
            "the synthetic engine's speed setting at the run's start (engine_info)"
        )
    probed = speed_probe(run)
    if math.isfinite(probed):
        return probed, "probed before the run (speed_before)"
    return (
        run_setup(run).initial_speed_factor,
        "the server's speed factor at the run's start (the run file has no probe: "
        "qlab replay --probe N records one)",
    )


def prediction_noise(run: pd.DataFrame, setup: ServerConfig | None = None) -> tuple[float, str]:
    """The CV of the lognormal noise on each modelled service time, and where it came from: the
    synthetic engine's noise setting (``qlab serve --noise``) where the run file recorded it; else
    the calibrated CV of the server's engines (``qlab calibrate`` under load,
    :attr:`qsim.engines.OneAtATime.cv` in the run's server config, or in ``setup`` where the caller
    gives the calibration); else :data:`DEFAULT_NOISE_CV`."""
    engine = engine_info(run)
    if (
        engine is not None
        and engine.get("engine") == "synthetic"
        and engine.get("noise_cv") is not None
    ):
        return float(engine["noise_cv"]), "the synthetic engine's noise setting (engine_info)"
    model = (setup or run_setup(run)).engine
    # its requests' times are its steps': their spread is the step model's
    if isinstance(model, Batching):
        return model.step.cv, (
            "the batching engine's step model CV (a gamma draw on each step; the server config's)"
        )
    if isinstance(model, OneAtATime) and model.cv > 0:
        return model.cv, "the calibrated CV under load (qlab calibrate; the server config's engine)"
    if engine is None:
        return DEFAULT_NOISE_CV, (
            f"the default {DEFAULT_NOISE_CV:g}: the run file does not record "
            "its engine "
            "(an older qlab replay, or not a qlab gate); --noise-cv sets it"
        )
    return DEFAULT_NOISE_CV, (
        f"the default {DEFAULT_NOISE_CV:g}: the "
        f"{engine.get('engine', 'unnamed')} engine does "
        "not say its noise and the server was not calibrated under load; "
        "--noise-cv or "
        "--service-model sets it"
    )


def step_speed(schedule: SpeedSchedule | None, speed: float) -> SpeedSchedule:
    """A batching engine's speed on the run's clock, as the simulator applies it to each step: its
    step model is the calibration's (fitted at speed 1), so a step takes the model's time x
    ``speed`` (the run's,
    :func:`prediction_speed`) x the schedule's later changes over its base. The simulator divides by
    the schedule's base (a one-at-a-time run's true times already carry it); here the base is the
    model's speed, 1."""
    base, later = (1.0, ()) if schedule is None else (schedule.base, schedule.steps)
    return SpeedSchedule(1.0, ((0.0, speed), *((t, speed * s / base) for t, s in later)))


def calibrated_setup(run: pd.DataFrame, terms: LoadTerms | None = None) -> ServerConfig:
    """The run's server, with the calibration's load terms in its engines (a run from a server that
    did not load them: an older calibration, or an older qlab serve), or a batching engine's fitted
    step model where the calibration has one; ``terms`` None: as the run file says (a batching
    gate's: the step model it planned with)."""
    setup = run_setup(run)
    if terms is not None and isinstance(setup.engine, Batching) and terms.step is not None:
        # The engine's API process in front of it too, where the calibration measured it.
        front = terms.front_end or setup.engine.front_end
        return setup.replace(
            engine=dataclasses.replace(setup.engine, step=terms.step, front_end=front)
        )
    if terms is None or not isinstance(setup.engine, OneAtATime):
        return setup
    return setup.replace(
        engine=dataclasses.replace(
            setup.engine, concurrency=terms.concurrency, cv=terms.noise_cv or 0.0
        )
    )


def run_seconds(run: pd.DataFrame) -> float:
    """The run's arrival window (from the replay's metadata) else its makespan: goodput is per
    these seconds."""
    meta = run.attrs.get("qlab_run") if isinstance(run.attrs.get("qlab_run"), dict) else {}
    return run_duration(run, meta.get("duration_s"))


def predict(
    run: pd.DataFrame,
    seeds: int = 20,
    noise_cv: float | None = None,
    origin: str = "server",
    level: float = 0.95,
    terms: LoadTerms | None = None,
) -> Prediction:
    """Simulate the run's arrivals with modelled service times over ``seeds`` seeds; compare the
    metrics. ``noise_cv`` None: what the run file says (:func:`prediction_noise`); ``terms``: a
    calibration's load terms in place of the run file's (:func:`calibrated_setup`). The engines'
    slowdown (their concurrency term) is the simulator's own, applied to each run as it starts."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    setup = calibrated_setup(run, terms)
    speed, source = prediction_speed(run)
    noise_cv, noise_source = (
        prediction_noise(run, setup)
        if noise_cv is None
        else (float(noise_cv), "given (--noise-cv)")
    )
    schedule = speed_schedule(run)
    # a batching engine draws its noise on each step, not on a request
    if isinstance(setup.engine, Batching):
        setup = setup.replace(
            engine=dataclasses.replace(
                setup.engine, step=dataclasses.replace(setup.engine.step, cv=noise_cv)
            )
        )
        # and its steps, not its requests' true times, carry the speed
        schedule = step_speed(schedule, speed)
    # With retries the simulator's own clients send all but the first attempts.
    _, retrying = clients_of(run)
    ordered, arrival = in_arrival_order(
        run, arrival_times(run, origin), run["attempt"].eq(1).to_numpy() if retrying else None
    )
    faults = client_faults(run, ordered, arrival)
    base = ordered["calibrated_est_s"].to_numpy(float)
    seconds = run_seconds(run)
    live = summary(run, seconds)
    metrics = PREDICTED + tuple(m for m in PREDICTED_WHERE_MEASURED if math.isfinite(live[m]))
    rows = []
    for seed in range(seeds):
        true = base * speed * lognormal_noise(np.random.default_rng(seed), len(base), noise_cv)
        # The server's own draws (a batching engine's step noise, a randomised rule's) from this
        # seed too: with the run's seed alone every seed drew the same steps, and the interval
        # across seeds was too narrow.
        seeded = setup.replace(seed=setup.seed + seed)
        got = summary(
            simulate_arrivals(
                ordered,
                arrival,
                seeded,
                true,
                "predicted",
                generated_tokens(run, ordered),
                schedule,
                fleet_spec(run),
                **faults,
            ),
            seconds,
        )
        rows.append({"seed": seed, **{m: got[m] for m in metrics}})
    per_seed = pd.DataFrame(rows)
    table = []
    for m in metrics:
        mean, low, high = mean_ci(per_seed[m], level)
        values = per_seed[m].dropna()
        lo_q, hi_q = (
            (values.quantile(0.025), values.quantile(0.975))
            if len(values)
            else (math.nan, math.nan)
        )
        error = mean - live[m]
        table.append(
            {
                "metric": m,
                "live": live[m],
                "sim_mean": mean,
                "ci_low": low,
                "ci_high": high,
                "seeds_p2_5": lo_q,
                "seeds_p97_5": hi_q,
                "error": error,
                "relative_error": error / live[m] if live[m] else math.nan,
                "live_within_seeds": bool(lo_q <= live[m] <= hi_q),
            }
        )
    concurrency = setup.engine.concurrency if isinstance(setup.engine, OneAtATime) else math.nan
    return Prediction(
        pd.DataFrame(table).set_index("metric"),
        per_seed,
        speed,
        source,
        noise_cv,
        noise_source,
        concurrency,
    )
