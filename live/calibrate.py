"""Calibration: fit S = intercept + per_prompt_token * prompt tokens + per_token * new tokens on a live server.

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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
from pydantic import BaseModel

from inputs.atomic import atomic_write
from qsim.service import Fit, ServiceModel, fit

from .auth import client_headers
from .contract import (Completion, CompletionRequest, EngineFacts, GenerateRequest, GenerateResponse, HealthFacts,
                       Stats, UpstreamModels, num)
from .tokenizer import ByteTokenizer, max_tokens_within, prompt_of, words_prompt

SIZES = (1, 2, 4, 8, 16, 32, 64)
#: Longer prompts of the default schedule, beside the replayer's default prompt.
LONG_PROMPTS = (256, 768)
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class CalibrationConfig:
    """prompt_tokens: the prompt lengths, in the server's tokens (None: the default prompt of ``prompt_words``
    words and :data:`LONG_PROMPTS`, those that fit); one length fits the line without a prompt term."""

    url: str
    rounds: int = 2
    per_size: int = 12
    sizes: tuple[int, ...] = SIZES
    prompt_words: int = 16
    deadline_ms: int | None = None  # None: the server's default (run calibration on an idle server)
    timeout_s: float = 120.0
    prompt_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.per_size < 1:
            raise ValueError(f"rounds and per_size must be >= 1, got {self.rounds}, {self.per_size}")
        if len(set(self.sizes)) < 2 or min(self.sizes) < 1:
            raise ValueError(f"calibration needs at least two different sizes >= 1, got {self.sizes}")
        if self.prompt_words < 1:
            raise ValueError(f"prompt_words must be >= 1, got {self.prompt_words}")
        if self.prompt_tokens is not None and (not self.prompt_tokens or min(self.prompt_tokens) < 1):
            raise ValueError(f"prompt lengths must be >= 1 token, got {list(self.prompt_tokens)}")


@dataclass(frozen=True)
class ServerFacts:
    """What the server says that prompts depend on: its tokenizer's name, the engine's context (None: no
    limit of its own) and the gate's caps on a prompt (tokens, characters; None: not said)."""

    tokenizer: str | None = None
    context: int | None = None
    max_prompt_tokens: int | None = None
    max_prompt_chars: int | None = None

    def longest_prompt(self, new_tokens: int) -> float:
        """The most prompt tokens a request of ``new_tokens`` new tokens may bring (inf: no limit)."""
        caps = [float("inf")]
        if self.context is not None:
            caps.append(self.context - new_tokens)
        if self.max_prompt_tokens is not None:
            caps.append(self.max_prompt_tokens)
        if self.max_prompt_chars is not None:
            caps.append(max_tokens_within(self.max_prompt_chars, self.tokenizer))
        return min(caps)


def _positive_int(value) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def server_facts(health: Any, stats: Any) -> ServerFacts:
    """Read ``GET /healthz``'s engine (tokenizer, context) and ``GET /stats``'s limits (parsed bodies, through
    :class:`live.contract.HealthFacts` and :class:`~live.contract.Stats`); a page that is not one (None: not
    there, or not a qlab gate's) says nothing."""
    engine = _lenient(HealthFacts, health).engine or EngineFacts()
    limits = _lenient(Stats, stats).limits
    return ServerFacts(engine.tokenizer, _positive_int(engine.context), _positive_int(limits.max_prompt_tokens),
                       _positive_int(limits.max_prompt_chars))


def _lenient(model: type[M], body: Any) -> M:
    """``body`` through ``model``; the model's defaults (nothing said) when it is not one."""
    try:
        return model() if body is None else model.model_validate(body)
    except ValueError:
        return model()


def read_facts(http: httpx.Client) -> ServerFacts:
    """:func:`server_facts` of the server behind ``http`` (a page that is not there says nothing)."""
    pages = []
    for path in ("/healthz", "/stats"):
        try:
            response = http.get(path)
            pages.append(response.json() if response.status_code == 200 else None)
        except (httpx.HTTPError, ValueError):
            pages.append(None)
    return server_facts(*pages)


def default_prompt_tokens(facts: ServerFacts, prompt_words: int) -> int:
    """How many of the server's tokens the replayer's default prompt of ``prompt_words`` words is."""
    text = words_prompt(prompt_words)
    return len(text.encode()) if facts.tokenizer == ByteTokenizer.name else prompt_words


def prompt_schedule(cfg: CalibrationConfig, facts: ServerFacts) -> tuple[int, ...]:
    """The prompt lengths to measure: as asked (each must fit beside the largest size), or the default
    prompt and those of :data:`LONG_PROMPTS` that fit."""
    room = facts.longest_prompt(max(cfg.sizes))
    if cfg.prompt_tokens is not None:
        too_long = [p for p in cfg.prompt_tokens if p > room]
        if too_long:
            raise ValueError(f"prompt lengths {too_long} do not fit beside {max(cfg.sizes)} new tokens: the server "
                             f"allows at most {room:g} prompt tokens (its context or prompt cap)")
        return tuple(dict.fromkeys(cfg.prompt_tokens))
    short = min(default_prompt_tokens(facts, cfg.prompt_words), int(min(room, 1e9)))
    if short < 1:
        raise ValueError(f"no prompt fits beside {max(cfg.sizes)} new tokens (the engine's context is {facts.context})")
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
        return {"round": self.round, "model": asdict(self.model), "n": len(self.tokens),
                "median_rel_error": self.median_rel_error, "worst_rel_error": self.worst_rel_error,
                "tokens": list(self.tokens), "prompt_tokens": list(self.prompt_tokens), "engine_s": list(self.engine_s)}


@dataclass(frozen=True)
class Calibration:
    """The overall fit over every round, and each round's own."""

    overall: Fit
    rounds: tuple[Round, ...]
    tokenizer: str | None = None

    def as_dict(self) -> dict:
        """The JSON that ``ServiceModel.load`` reads (its ``model`` key) and people read too."""
        return {"model": asdict(self.overall.model), "median_rel_error": self.overall.median_rel_error,
                "worst_rel_error": self.overall.worst_rel_error, "n": self.overall.n,
                "prompt_tokenizer": self.tokenizer, "rounds": [r.as_dict() for r in self.rounds]}

    def save(self, path: str | Path) -> None:
        """Write the JSON whole or not at all (a resumed ``qlab live`` reuses it)."""
        atomic_write(path, (json.dumps(self.as_dict(), indent=2) + "\n").encode())


def schedule(cfg: CalibrationConfig, prompts: tuple[int, ...] = (0,)) -> list[tuple[int, int]]:
    """(new tokens, prompt tokens) of one round: sizes interleaved; at repetition r, size j gets prompt
    (j + r) mod P, so each size meets every prompt length once every P repetitions."""
    return [(s, prompts[(j + r) % len(prompts)]) for r in range(cfg.per_size) for j, s in enumerate(cfg.sizes)]


def _engine_seconds(http: httpx.Client, body: dict) -> float:
    request = GenerateRequest.model_validate(body, strict=False)  # the contract's body: a misnamed key fails here
    response = http.post("/v1/generate", json=request.body())
    if response.status_code != 200:
        raise ValueError(f"calibration request {request.max_new_tokens} tokens got HTTP {response.status_code}: "
                         f"{response.text[:200]} (calibrate an idle server, e.g. policy none)")
    try:
        return num(GenerateResponse.model_validate_json(response.content).timings.engine_s)
    except ValueError:
        raise ValueError(f"calibration request: the answer is not /v1/generate's: {response.text[:200]}") from None


def counted_by_gate(http: httpx.Client, prompts: dict[int, str]) -> dict[int, int]:
    """Each prompt's tokens as the gate counts them (``usage.prompt_tokens`` of a one-token completion);
    the nominal count where the server does not answer one (no OpenAI routes)."""
    try:
        models = http.get("/v1/models")
        cards = UpstreamModels.model_validate_json(models.content).data if models.status_code == 200 else []
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
            usage = Completion.model_validate_json(answer.content).usage if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            usage = None
        if usage is not None:
            counts[nominal] = usage.prompt_tokens
    return counts


def measure_round(http: httpx.Client, cfg: CalibrationConfig, number: int, texts: dict[int, str] | None = None,
                  counts: dict[int, int] | None = None) -> Round:
    """One round; ``texts``: the prompt of each length (default: the ``prompt_words`` prompt alone), ``counts``:
    each length as the gate counts it."""
    texts = texts or {cfg.prompt_words: words_prompt(cfg.prompt_words)}
    counts = counts or {p: p for p in texts}
    points = schedule(cfg, tuple(texts))
    seconds = []
    for n, p in points:
        body = {"prompt": texts[p], "max_new_tokens": n}
        if cfg.deadline_ms is not None:
            body["deadline_ms"] = cfg.deadline_ms
        seconds.append(_engine_seconds(http, body))
    tokens = [n for n, _ in points]
    prompt_tokens = [counts[p] for _, p in points]
    f = fit(tokens, seconds, prompt_tokens=prompt_tokens)
    return Round(number, f.model, f.median_rel_error, f.worst_rel_error, tuple(tokens), tuple(seconds),
                 tuple(prompt_tokens))


def calibrate(cfg: CalibrationConfig, progress=None) -> Calibration:
    """Warm up once, measure ``rounds`` rounds, fit each and all of them together."""
    with httpx.Client(base_url=cfg.url, timeout=cfg.timeout_s, headers=client_headers()) as http:
        facts = read_facts(http)
        lengths = prompt_schedule(cfg, facts)
        texts = {p: prompt_of(p, facts.tokenizer) for p in lengths}
        # The first request pays for lazy set-up (connections, allocator, kernels): not service time.
        _engine_seconds(http, {"prompt": texts[lengths[-1]], "max_new_tokens": max(cfg.sizes)})
        counts = counted_by_gate(http, texts) if len(lengths) > 1 else {p: p for p in lengths}
        rounds = []
        for number in range(1, cfg.rounds + 1):
            rounds.append(measure_round(http, cfg, number, texts, counts))
            if progress:
                progress(rounds[-1])
    tokens = np.concatenate([r.tokens for r in rounds])
    prompt_tokens = np.concatenate([r.prompt_tokens for r in rounds])
    seconds = np.concatenate([r.engine_s for r in rounds])
    return Calibration(fit(tokens, seconds, prompt_tokens=prompt_tokens), tuple(rounds), facts.tokenizer)


def describe(r: Round | Fit, label: str) -> str:
    m = r.model
    prompt = f", {m.per_prompt_token_s * 1e6:.2f} us/prompt token" if m.per_prompt_token_s else ""
    return (f"{label}: intercept {m.intercept_s * 1e3:.2f} ms, {m.per_token_s * 1e3:.3f} ms/token{prompt}; "
            f"error of the fit on one request: median {r.median_rel_error:.1%}, worst {r.worst_rel_error:.1%}")


def probe(url: str, model: ServiceModel, requests: int = 5, max_new_tokens: int = 16,
          prompt_words: int = 16, timeout_s: float = 120.0) -> float:
    """The machine's speed now: median engine time of a few fixed-size requests over the model's estimate
    (its prompt term counting the prompt in the server's tokens).

    Sent one at a time on an idle server; NaN when none was answered (the run's rows then tell why).
    """
    body = {"prompt": words_prompt(prompt_words), "max_new_tokens": max_new_tokens}
    seconds = []
    with httpx.Client(base_url=url, timeout=timeout_s, headers=client_headers()) as http:
        prompt_tokens = default_prompt_tokens(read_facts(http), prompt_words) if model.per_prompt_token_s else 0
        for _ in range(requests):
            try:
                seconds.append(_engine_seconds(http, body))
            except (httpx.HTTPError, ValueError):
                continue
    return float(np.median(seconds) / model.estimate(max_new_tokens, prompt_tokens)) if seconds else float("nan")
