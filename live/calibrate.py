"""Calibration: fit S = intercept + per_prompt_token * prompt tokens + per_token * new tokens on a
live server.

Requests go one at a time, so none waits in the gate and the engine time the
service reports is the service time alone. Sizes are interleaved (1, 2, 4, ...
64, 1, 2, ...) rather than grouped, so a machine that drifts in speed during a
round spreads its drift over every size instead of bending the line. The
prompt's length cycles too, shifted by one at each repetition of the sizes, so
that every size is measured with every prompt length and the two terms can be
told apart (:func:`schedule`).

Prompt lengths are in the server's tokens, as its gate counts them: the prompts
are built for the tokenizer the server names in ``GET /healthz``
(:func:`live.tokenizer.prompt_of`), and their counts checked against the
``usage.prompt_tokens`` its ``/v1/completions`` reports, where it answers one.
The shortest prompt is the replayer's default one (``prompt_words``): the fit is
exact where most requests are. Lengths that would not fit the engine's context
beside the largest size are left out of the default schedule (and refused when
asked for by name).

**Under load** (:func:`measure_load`). With K engines on the server, the same schedule is then sent
with 2, 4, ... K requests in flight at once (each of L workers sends its next request as its last
one is answered), and each request's engines busy at its start (itself included) counted from the
gate's own ``started_at`` / ``returned_at``. :func:`fit_load` fits the concurrency term of
:class:`qsim.engines.OneAtATime` (a run takes its time x (1 + c (busy - 1))) to every point, the
rounds' (busy 1) included, by bounded least squares, and the noise: the CV of a request's time
around the model x that slowdown, one at a time and under load. Both go into the calibration JSON
(key ``load``), which ``serve``, ``simulate`` and ``compare`` read (:class:`qsim.service.LoadTerms`:
``noise_cv`` there is
:attr:`LoadFit.noise_cv`).

**A batching server** (its ``/stats`` server config's engine is :class:`qsim.engines.Batching`) runs
requests together in steps, so there is no concurrency term to fit: after the rounds, the schedule
is sent with 2, 4, ... up to its ``max_num_seqs`` requests in flight, and the steps the server ran
meanwhile (its step log, ``/stats?steps_since=``: each step's seconds on the gate's clock and what
it computed, prefill tokens, sequences that produced a token, context tokens held) are fitted to the
step model (:meth:`qsim.engines.StepModel.fit`), the rounds' steps with them. The fitted model, its
CV the spread of a step's time around it, goes into the calibration JSON (key ``step``, which
``--step FILE`` reads too; ``step_fit``: r^2, the errors, the standard errors, the levels), where
``LoadTerms`` reads it (:func:`fit_steps`).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
from pydantic import BaseModel
from scipy import optimize, stats

from inputs.atomic import atomic_write
from qsim.engines import STEP_FIELDS, Batching, StepFit, StepModel, engine_from_fields
from qsim.runfile import LoggedStep
from qsim.service import Fit, ServiceModel, fit

from .auth import client_headers
from .engine_steps import EnginePhase, EngineStepFit, counted, fit_phases
from .contract import EngineFacts, GenerateRequest, GenerateResponse, HealthFacts, Stats, Timings
from .contract_clients import UpstreamModels
from .contract_fields import num
from .contract_openai import Completion, CompletionRequest
from .tokenizer import ByteTokenizer, max_tokens_within, prompt_of, words_prompt

SIZES = (1, 2, 4, 8, 16, 32, 64)
#: Longer prompts of the default schedule, beside the replayer's default prompt.
LONG_PROMPTS = (256, 768)
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class CalibrationConfig:
    """prompt_tokens: the prompt lengths, in the server's tokens (None: the default prompt of
    ``prompt_words`` words and :data:`LONG_PROMPTS`, those that fit); one length fits the line
    without a prompt term."""

    url: str
    rounds: int = 2
    per_size: int = 12
    sizes: tuple[int, ...] = SIZES
    prompt_words: int = 16
    # None: as long as the calibrator waits (timeout_s). The server's default deadline is its
    # promise to clients; a predictive gate whose estimate of a 64-token request is past it would
    # refuse (503 deadline_unreachable) the very requests that would correct the estimate.
    deadline_ms: int | None = None
    timeout_s: float = 120.0
    prompt_tokens: tuple[int, ...] | None = None
    # Requests in flight at once under load (None: 2, 4, ... up to the server's engines; (): none),
    # and each level's schedule's repetitions of the sizes.
    levels: tuple[int, ...] | None = None
    load_per_size: int = 4
    # A batching engine's own counters (vLLM's /metrics at this base URL), read around each phase:
    # the step model is fitted to the engine's steps rather than the gate's (live.engine_steps).
    engine_metrics: str | None = None

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.per_size < 1:
            raise ValueError(
                f"rounds and per_size must be >= 1, got {self.rounds}, {self.per_size}"
            )
        if len(set(self.sizes)) < 2 or min(self.sizes) < 1:
            raise ValueError(
                f"calibration needs at least two different sizes >= 1, got {self.sizes}"
            )
        if self.prompt_words < 1:
            raise ValueError(f"prompt_words must be >= 1, got {self.prompt_words}")
        if self.prompt_tokens is not None and (
            not self.prompt_tokens or min(self.prompt_tokens) < 1
        ):
            raise ValueError(f"prompt lengths must be >= 1 token, got {list(self.prompt_tokens)}")
        if self.levels is not None and self.levels and min(self.levels) < 2:
            raise ValueError(
                "requests in flight under load must be >= 2 (one at a time is the "
                "rounds'), "
                f"got {list(self.levels)}"
            )
        if self.load_per_size < 1:
            raise ValueError(f"load_per_size must be >= 1, got {self.load_per_size}")

    def load_levels(self, engines: int, unit: str = "engine(s)") -> tuple[int, ...]:
        """The in-flight levels to measure on a server of ``engines`` engines (a batching server's:
        its seats in the batch, ``unit`` says which): as asked (none above them: the gate would
        queue them), or 2, 4, ... and ``engines`` itself."""
        if self.levels is not None:
            over = [n for n in self.levels if n > engines]
            if over:
                raise ValueError(
                    f"requests in flight {over} exceed the server's {engines} {unit}: "
                    "the gate would "
                    "queue them rather than run them at once"
                )
            return tuple(sorted(set(self.levels)))
        doubling = [2**k for k in range(1, max(engines, 1).bit_length()) if 2**k <= engines]
        return tuple(sorted({*doubling, engines} - {1}))


@dataclass(frozen=True)
class ServerFacts:
    """What the server says that prompts depend on: its tokenizer's name, the engine's context
    (None: no limit of its own) and the gate's caps on a prompt (tokens, characters; None: not
    said); and its engines, which the load phase fills, or its batching engine (None: engines one at
    a time, or not said)."""

    tokenizer: str | None = None
    context: int | None = None
    max_prompt_tokens: int | None = None
    max_prompt_chars: int | None = None
    engines: int = 1
    batching: Batching | None = None

    def longest_prompt(self, new_tokens: int) -> float:
        """The most prompt tokens a request of ``new_tokens`` new tokens may bring (inf: no
        limit)."""
        caps = [float("inf")]
        if self.context is not None:
            caps.append(self.context - new_tokens)
        if self.max_prompt_tokens is not None:
            caps.append(self.max_prompt_tokens)
        if self.max_prompt_chars is not None:
            caps.append(max_tokens_within(self.max_prompt_chars, self.tokenizer))
        return min(caps)


def _positive_int(value) -> int | None:
    return (
        int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
    )


def server_facts(health: Any, stats: Any) -> ServerFacts:
    """Read ``GET /healthz``'s engine (tokenizer, context) and ``GET /stats``'s limits (parsed
    bodies, through
    :class:`live.contract.HealthFacts` and :class:`~live.contract.Stats`); a page that is not one
    (None: not there, or not a qlab gate's) says nothing."""
    engine = _lenient(HealthFacts, health).engine or EngineFacts()
    said = _lenient(Stats, stats)
    limits = said.limits
    return ServerFacts(
        engine.tokenizer,
        _positive_int(engine.context),
        _positive_int(limits.max_prompt_tokens),
        _positive_int(limits.max_prompt_chars),
        _positive_int(said.engines) or 1,
        _batching(said.server_config),
    )


def _batching(server_config: dict | None) -> Batching | None:
    """The batching engine a gate's server config names (None: engines one at a time, or no config
    said); its engine alone is read (a policy of the server's own need not be known here)."""
    if server_config is None or "engine" not in server_config:
        return None
    try:
        engine = engine_from_fields(server_config["engine"])
    except ValueError:
        return None
    return engine if isinstance(engine, Batching) else None


def _lenient(model: type[M], body: Any) -> M:
    """``body`` through ``model``; the model's defaults (nothing said) when it is not one."""
    try:
        return model() if body is None else model.model_validate(body)
    except ValueError:
        return model()


def read_facts(http: httpx.Client) -> ServerFacts:
    """:func:`server_facts` of the server behind ``http`` (a page that is not there says
    nothing)."""
    pages = []
    for path in ("/healthz", "/stats"):
        try:
            response = http.get(path)
            pages.append(response.json() if response.status_code == 200 else None)
        except (httpx.HTTPError, ValueError):
            pages.append(None)
    return server_facts(*pages)


def default_prompt_tokens(facts: ServerFacts, prompt_words: int) -> int:
    """How many of the server's tokens the replayer's default prompt of ``prompt_words`` words
    is."""
    text = words_prompt(prompt_words)
    return len(text.encode()) if facts.tokenizer == ByteTokenizer.name else prompt_words


def prompt_schedule(cfg: CalibrationConfig, facts: ServerFacts) -> tuple[int, ...]:
    """The prompt lengths to measure: as asked (each must fit beside the largest size), or the
    default prompt and those of :data:`LONG_PROMPTS` that fit."""
    room = facts.longest_prompt(max(cfg.sizes))
    if cfg.prompt_tokens is not None:
        too_long = [p for p in cfg.prompt_tokens if p > room]
        if too_long:
            raise ValueError(
                f"prompt lengths {too_long} do not fit beside {max(cfg.sizes)} new "
                "tokens: the server "
                f"allows at most {room:g} prompt tokens (its context or prompt cap)"
            )
        return tuple(dict.fromkeys(cfg.prompt_tokens))
    short = min(default_prompt_tokens(facts, cfg.prompt_words), int(min(room, 1e9)))
    if short < 1:
        raise ValueError(
            f"no prompt fits beside {max(cfg.sizes)} new tokens (the engine's "
            f"context is {facts.context})"
        )
    return tuple(dict.fromkeys([short, *(p for p in LONG_PROMPTS if short < p <= room)]))


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


def schedule(cfg: CalibrationConfig, prompts: tuple[int, ...] = (0,)) -> list[tuple[int, int]]:
    """(new tokens, prompt tokens) of one round: sizes interleaved; at repetition r, size j gets
    prompt (j + r) mod P, so each size meets every prompt length once every P repetitions."""
    return [
        (s, prompts[(j + r) % len(prompts)])
        for r in range(cfg.per_size)
        for j, s in enumerate(cfg.sizes)
    ]


def _timings(http: httpx.Client, body: dict) -> Timings:
    # the contract's body: a misnamed key fails here
    request = GenerateRequest.model_validate(body, strict=False)
    try:
        response = http.post("/v1/generate", json=request.body())
    except httpx.RemoteProtocolError:
        # The server closed this pooled connection for sitting idle (its keep-alive timeout) as the
        # request went out on it, between two load levels of a busy machine: nothing ran, so it goes
        # again on a new connection.
        response = http.post("/v1/generate", json=request.body())
    if response.status_code != 200:
        raise ValueError(
            f"calibration request {request.max_new_tokens} tokens got HTTP "
            f"{response.status_code}: "
            f"{response.text[:200]} (calibrate an idle server, e.g. policy none)"
        )
    try:
        return GenerateResponse.model_validate_json(response.content).timings
    except ValueError:
        raise ValueError(
            f"calibration request: the answer is not /v1/generate's: {response.text[:200]}"
        ) from None


def _engine_seconds(http: httpx.Client, body: dict) -> float:
    return num(_timings(http, body).engine_s)


def counted_by_gate(http: httpx.Client, prompts: dict[int, str]) -> dict[int, int]:
    """Each prompt's tokens as the gate counts them (``usage.prompt_tokens`` of a one-token
    completion); the nominal count where the server does not answer one (no OpenAI routes)."""
    try:
        models = http.get("/v1/models")
        cards = (
            UpstreamModels.model_validate_json(models.content).data
            if models.status_code == 200
            else []
        )
    except (httpx.HTTPError, ValueError):
        cards = []
    model = cards[0].id if cards else None
    counts = {}
    for nominal, text in prompts.items():
        counts[nominal] = nominal
        if model is None:
            continue
        try:
            request = CompletionRequest(model=model, prompt=text, max_tokens=1)
            answer = http.post("/v1/completions", json=request.body())
            usage = (
                Completion.model_validate_json(answer.content).usage
                if answer.status_code == 200
                else None
            )
        except (httpx.HTTPError, ValueError):
            usage = None
        if usage is not None:
            counts[nominal] = usage.prompt_tokens
    return counts


def measure_round(
    http: httpx.Client,
    cfg: CalibrationConfig,
    number: int,
    texts: dict[int, str] | None = None,
    counts: dict[int, int] | None = None,
) -> Round:
    """One round; ``texts``: the prompt of each length (default: the ``prompt_words`` prompt alone),
    ``counts``: each length as the gate counts it."""
    texts = texts or {cfg.prompt_words: words_prompt(cfg.prompt_words)}
    counts = counts or {p: p for p in texts}
    points = schedule(cfg, tuple(texts))
    seconds = []
    for n, p in points:
        seconds.append(_engine_seconds(http, _body(cfg, texts[p], n)))
    tokens = [n for n, _ in points]
    prompt_tokens = [counts[p] for _, p in points]
    f = fit(tokens, seconds, prompt_tokens=prompt_tokens)
    return Round(
        number,
        f.model,
        f.median_rel_error,
        f.worst_rel_error,
        tuple(tokens),
        tuple(seconds),
        tuple(prompt_tokens),
    )


def _body(cfg: CalibrationConfig, text: str, tokens: int) -> dict:
    deadline_ms = cfg.deadline_ms if cfg.deadline_ms is not None else round(cfg.timeout_s * 1000)
    return {"prompt": text, "max_new_tokens": tokens, "deadline_ms": deadline_ms}


def measure_load(
    http: httpx.Client,
    cfg: CalibrationConfig,
    level: int,
    texts: dict[int, str],
    counts: dict[int, int],
    per_size: int | None = None,
) -> LoadLevel:
    """``level`` requests in flight at once: the schedule (``per_size`` repetitions, default
    ``load_per_size``) dealt to ``level`` workers, each sending its next request as its last is
    answered; busy at each start from the gate's clock."""
    points = schedule(replace(cfg, per_size=per_size or cfg.load_per_size), tuple(texts))

    def worker(share: list[tuple[int, int]]) -> list[Timings]:
        return [_timings(http, _body(cfg, texts[p], n)) for n, p in share]

    shares = [points[w::level] for w in range(level)]
    with ThreadPoolExecutor(max_workers=level, thread_name_prefix="qlab-calibrate") as pool:
        answers = list(pool.map(worker, shares))
    done = [(point, t) for share, got in zip(shares, answers) for point, t in zip(share, got)]
    started = np.array([num(t.started_at) for _, t in done])
    returned = np.array([num(t.returned_at) for _, t in done])
    return LoadLevel(
        level,
        tuple(n for (n, _), _ in done),
        tuple(counts[p] for (_, p), _ in done),
        tuple(num(t.engine_s) for _, t in done),
        tuple(int(b) for b in busy_at_start(started, returned)),
    )


def calibrate(cfg: CalibrationConfig, progress=None) -> Calibration:
    """Warm up once, measure ``rounds`` rounds, fit each and all of them together; then the load
    levels, and the concurrency term and noise around that fit (engines one at a time) or the step
    model (a batching server)."""
    # As many connections as requests in flight (httpx's default pool holds 100: a batch of 256
    # would queue).
    with httpx.Client(
        base_url=cfg.url,
        timeout=cfg.timeout_s,
        headers=client_headers(),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    ) as http:
        facts = read_facts(http)
        if cfg.engine_metrics and facts.batching is None:
            raise ValueError(
                f"--engine-metrics reads a batching engine's steps; {cfg.url} runs "
                "requests one at a "
                "time (no --batching)"
            )
        lengths = prompt_schedule(cfg, facts)
        texts = {p: prompt_of(p, facts.tokenizer) for p in lengths}
        # The first request pays for lazy set-up (connections, allocator, kernels): not service
        # time.
        _engine_seconds(http, {"prompt": texts[lengths[-1]], "max_new_tokens": max(cfg.sizes)})
        counts = counted_by_gate(http, texts) if len(lengths) > 1 else {p: p for p in lengths}
        since = gate_clock(http) if facts.batching is not None else None
        rounds, phases = [], []
        for number in range(1, cfg.rounds + 1):
            rounds.append(
                _counted(
                    cfg,
                    phases,
                    1,
                    (number - 1) % 2,
                    lambda n=number: measure_round(http, cfg, n, texts, counts),
                )
            )
            if progress:
                progress(rounds[-1])
        if facts.batching is not None:
            batch = [BatchLevel(1, sum(len(r.tokens) for r in rounds), fetch_steps(http, since))]
            batch.extend(
                measure_batches(http, cfg, facts.batching, texts, counts, progress, phases)
            )
        else:
            levels = []
            for level in cfg.load_levels(facts.engines):
                levels.append(measure_load(http, cfg, level, texts, counts))
                if progress:
                    progress(levels[-1])
    tokens = np.concatenate([r.tokens for r in rounds])
    prompt_tokens = np.concatenate([r.prompt_tokens for r in rounds])
    seconds = np.concatenate([r.engine_s for r in rounds])
    overall = fit(tokens, seconds, prompt_tokens=prompt_tokens)
    # a batch's requests share each step: the step model, no concurrency term
    if facts.batching is not None:
        engine = fit_phases(phases) if cfg.engine_metrics else None
        steps = StepCalibration(
            fit_steps([s for level in batch for s in level.steps]), tuple(batch), engine
        )
        return Calibration(overall, tuple(rounds), facts.tokenizer, steps=steps)
    # The rounds ran one at a time: busy 1 each.
    every = [
        *((r.tokens, r.prompt_tokens, r.engine_s, (1,) * len(r.tokens)) for r in rounds),
        *((lv.tokens, lv.prompt_tokens, lv.engine_s, lv.busy) for lv in levels),
    ]
    load = fit_load(
        overall.model, *(np.concatenate([np.asarray(p[k]) for p in every]) for k in range(4))
    )
    return Calibration(overall, tuple(rounds), facts.tokenizer, tuple(levels), load)


def _counted(cfg: CalibrationConfig, phases: list[EnginePhase], level: int, half: int, run):
    """``run()``; with the engine's counters, what the engine did meanwhile joins ``phases``."""
    if cfg.engine_metrics is None:
        return run()
    result, phase = counted(cfg.engine_metrics, level, half, run)
    phases.append(phase)
    return result


def measure_batches(
    http: httpx.Client,
    cfg: CalibrationConfig,
    batching: Batching,
    texts: dict[int, str],
    counts: dict[int, int],
    progress=None,
    phases: list[EnginePhase] | None = None,
) -> list[BatchLevel]:
    """A batching server under load: at each level (2, 4, ... up to its ``max_num_seqs``, or as
    asked) the schedule sent with that many in flight (:func:`measure_load`; repeated at least
    ``level`` times, so that each worker sends about one request of each size: the batch is full for
    most of the phase, not only until the first workers run out), and the steps the server ran
    meanwhile. With the engine's counters, each level is sent in two halves, each half a phase of
    ``phases``."""
    measured = []
    for level in cfg.load_levels(batching.max_num_seqs, "seats in the batch (max_num_seqs)"):
        since = gate_clock(http)
        per_size = max(cfg.load_per_size, level)
        if cfg.engine_metrics is None:
            sent = measure_load(http, cfg, level, texts, counts, per_size).tokens
        else:
            half = max(1, per_size // 2)
            # Each phase its own share of the sizes, alternating with the level and the half: with
            # every size in every phase, prompt tokens a step stay proportional to sequences a step
            # and the fit cannot tell a prefill token from a sequence (vllm-tiny-nocache: nine to
            # one in each phase).
            mixes = output_mixes(cfg.sizes)
            k = len(measured)
            sent = [
                t
                for h in (0, 1)
                for t in _counted(
                    cfg,
                    phases,
                    level,
                    h,
                    lambda h=h: measure_load(
                        http, replace(cfg, sizes=mixes[(k + h) % 2]), level, texts, counts, half
                    ),
                ).tokens
            ]
        measured.append(BatchLevel(level, len(sent), fetch_steps(http, since)))
        if progress:
            progress(measured[-1])
    return measured


def output_mixes(sizes: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shorter and the longer half of the output sizes (each at least two sizes; fewer than
    four: all of them both times), so that phases differ in prompt tokens per token generated."""
    ordered = tuple(sorted(set(sizes)))
    if len(ordered) < 4:
        return ordered, ordered
    middle = len(ordered) // 2
    return ordered[:middle], ordered[middle:]


def gate_clock(http: httpx.Client) -> float:
    """The gate's clock now (``/stats``' ``clock``): where a phase's steps begin in its step log."""
    response = http.get("/stats")
    clock = _lenient(Stats, response.json() if response.status_code == 200 else None).clock
    if clock is None:
        raise ValueError(
            f"GET /stats does not say the gate's clock (HTTP {response.status_code}): "
            "a batching "
            "server's steps cannot be read back"
        )
    return num(clock)


#: The most pages of a step log a client reads: the whole log (200,000 steps) is 40 of 5,000; a
#: gate that kept answering a next page past this is broken, and a client must not loop on it
#: forever.
MAX_STEP_PAGES = 1_000


@dataclass(frozen=True)
class StepPage:
    """One answer of ``/stats?steps_since=``: its steps, the cursor of the next page (None: the
    last), and the step models the gate took among them ([steps of the page before it, b0, b1, b2,
    b3, cv] each: :meth:`live.drive_batch.BatchDriver.step_page`)."""

    steps: list
    next: int | None
    models: list


def step_page(status: int, payload: object) -> StepPage:
    """One answer of ``/stats?steps_since=`` (or ``steps_from=``); a gate that does not page
    answers one, and one that took no step model says none. ValueError when it is not a page of
    steps."""
    if status != 200:
        raise ValueError(f"GET /stats?steps_since= answered HTTP {status}")
    steps = payload.get("step_log", []) if isinstance(payload, dict) else None
    cursor = payload.get("step_log_next") if isinstance(payload, dict) else None
    models = payload.get("step_models", []) if isinstance(payload, dict) else None
    if not isinstance(steps, list) or not (cursor is None or isinstance(cursor, int)):
        raise ValueError("GET /stats?steps_since= answered no step log")
    if not isinstance(models, list):
        raise ValueError("GET /stats?steps_since= answered step models that are no list")
    return StepPage(steps, cursor, models)


def page_params(since: float, cursor: int | None) -> dict[str, str]:
    """The query of the first page (``steps_since``), or of the page at ``cursor``."""
    return {"steps_since": repr(since)} if cursor is None else {"steps_from": str(cursor)}


def fetch_steps(http: httpx.Client, since: float) -> tuple[LoggedStep, ...]:
    """The steps a batching gate woke for at ``since`` or later (its clock;
    ``/stats?steps_since=``'s step log), page after page."""
    steps, cursor = [], None
    for _ in range(MAX_STEP_PAGES):
        response = http.get("/stats", params=page_params(since, cursor))
        page = step_page(response.status_code, response.json())
        steps += page.steps
        cursor = page.next
        if cursor is None:
            return tuple(LoggedStep(*row) for row in steps)
    raise ValueError(f"GET /stats?steps_since=: more than {MAX_STEP_PAGES} pages of steps")


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


def probe(
    url: str,
    model: ServiceModel,
    requests: int = 5,
    max_new_tokens: int = 16,
    prompt_words: int = 16,
    timeout_s: float = 120.0,
) -> float:
    """The machine's speed now: median engine time of a few fixed-size requests over the model's
    estimate (its prompt term counting the prompt in the server's tokens).

    Sent one at a time on an idle server; NaN when none was answered (the run's rows then tell why).
    """
    body = {"prompt": words_prompt(prompt_words), "max_new_tokens": max_new_tokens}
    seconds = []
    with httpx.Client(base_url=url, timeout=timeout_s, headers=client_headers()) as http:
        prompt_tokens = (
            default_prompt_tokens(read_facts(http), prompt_words) if model.per_prompt_token_s else 0
        )
        for _ in range(requests):
            try:
                seconds.append(_engine_seconds(http, body))
            except (httpx.HTTPError, ValueError):
                continue
    return (
        float(np.median(seconds) / model.estimate(max_new_tokens, prompt_tokens))
        if seconds
        else float("nan")
    )
