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
gate's own ``started_at`` / ``returned_at``. :func:`live.calibration_fit.fit_load` fits the
concurrency term of :class:`qsim.engines.OneAtATime` (a run takes its time x (1 + c (busy - 1))) to
every point, the rounds' (busy 1) included, by bounded least squares, and the noise: the CV of a
request's time around the model x that slowdown, one at a time and under load. Both go into the
calibration JSON (key ``load``), which ``serve``, ``simulate`` and ``compare`` read
(:class:`qsim.service.LoadTerms`: ``noise_cv`` there is
:attr:`live.calibration_fit.LoadFit.noise_cv`).

**A batching server** (its ``/stats`` server config's engine is :class:`qsim.engines.Batching`) runs
requests together in steps, so there is no concurrency term to fit: after the rounds, the schedule
is sent with 2, 4, ... up to its ``max_num_seqs`` requests in flight, and the steps the server ran
meanwhile (its step log, ``/stats?steps_since=``: each step's seconds on the gate's clock and what
it computed, prefill tokens, sequences that produced a token, context tokens held) are fitted to the
step model (:meth:`qsim.engines.StepModel.fit`), the rounds' steps with them. The fitted model, its
CV the spread of a step's time around it, goes into the calibration JSON (key ``step``, which
``--step FILE`` reads too; ``step_fit``: r^2, the errors, the standard errors, the levels), where
``LoadTerms`` reads it (:func:`live.calibration_fit.fit_steps`).

This module sends the requests and measures; what it measured and the fits are
:mod:`live.calibration_fit`'s, the lines said of them :mod:`live.calibration_report`'s, what
the server says of itself :mod:`live.server_facts`', and a batching gate's step log is read by
:mod:`live.step_pages`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import httpx
import numpy as np

from qsim.engines import Batching
from qsim.service import ServiceModel, fit

from .auth import client_headers
from .calibration_fit import (
    BatchLevel,
    Calibration,
    LoadLevel,
    Round,
    StepCalibration,
    busy_at_start,
    fit_load,
    fit_steps,
)
from .engine_steps import EnginePhase, counted, fit_phases
from .contract import GenerateRequest, GenerateResponse, Timings
from .contract_clients import UpstreamModels
from .contract_fields import num
from .contract_openai import Completion, CompletionRequest
from .server_facts import ServerFacts, default_prompt_tokens, read_facts
from .step_pages import fetch_steps, gate_clock
from .tokenizer import prompt_of, words_prompt

SIZES = (1, 2, 4, 8, 16, 32, 64)
#: Longer prompts of the default schedule, beside the replayer's default prompt.
LONG_PROMPTS = (256, 768)


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
