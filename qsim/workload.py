"""A seeded synthetic workload: :func:`plan_trace` resolves a command's options into a
:class:`TracePlan`, whose requests are drawn whole (:func:`make_trace`) or a chunk at a time
(:func:`trace_chunks`), with their service times. What the requests are drawn from is
:mod:`qsim.mixes`'s, the arrival processes :mod:`qsim.arrivals`'s, the trace they make
:mod:`qsim.trace`'s (reading trace files, and building a trace from a command's options:
:mod:`qsim.tracefiles`).

Common random numbers: a seed is split into independent streams for arrival
gaps, sizes and service noise, and every stream is consumed in request order.
So the same seed gives request i the same gap (in units of the mean gap), size
and true service time whatever the policy, and at every load.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .arrivals import (
    _whole,
    arrivals_take_load,
    burst_pieces,
    check_load,
    parse_arrivals,
    periodic_at_rate_pieces,
    periodic_pieces,
    renewal_pieces,
    surge_pieces,
    takes_load,
)
from .chunks import PIECE, BlockStream, TraceChunks, exactly
from .clients import Patience
from .datasets import Dataset
from .mixes import (
    REFERENCE_MIX,
    Client,
    Mix,
    Prompts,
    SharedPrefix,
    UsedShare,
    blend,
    blended_means,
    used_mean_s,
    used_tokens,
)
from .service import ServiceModel
from .trace import Trace, assemble_trace

#: The load of a process that takes one when none is given (``qlab simulate``'s default).
DEFAULT_LOAD = 0.9
SERVICES = ("mix", "exponential", "deterministic")


def random_streams(seed: int) -> tuple[np.random.Generator, ...]:
    """Independent generators for gaps, sizes, service draws, clients, patience and early stops
    (common random numbers).

    The fourth was added with clients, the fifth with patience, the sixth with early stops and the
    seventh with prompt lengths, the eighth with shared prefixes;
    SeedSequence's children do not depend on how many are spawned, so the earlier ones (and every
    trace without them) are what they were.
    """
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(8))


def dataset_rows(dataset: Dataset, n: int, seed: int) -> np.ndarray:
    """The rows of ``dataset`` that a trace of n requests from ``seed`` takes, in request order:
    from the ninth stream (the eight before unchanged). What the simulator and the replayer both
    read."""
    return dataset.sample(n, np.random.default_rng(np.random.SeedSequence(seed).spawn(9)[8]))


def _draw_index(rng: np.random.Generator, probs, n: int) -> np.ndarray:
    """n draws of an index with these probabilities, one uniform each: what ``rng.choice(len(probs),
    n, p=probs)`` draws, written out so that each request's uniform can be mapped through its own
    client's mix."""
    cdf = np.cumsum(probs)
    return np.searchsorted(cdf / cdf[-1], rng.random(n), side="right")


def _sizes(rng: np.random.Generator, mixes: list[Mix], which: np.ndarray) -> np.ndarray:
    """Each request's size from the mix ``mixes[which[i]]``, one uniform per request in request
    order."""
    u = rng.random(len(which))
    tokens = np.empty(len(which), dtype=np.int64)
    for j, mix in enumerate(mixes):
        mine = which == j
        cdf = np.cumsum(mix.probs)
        tokens[mine] = np.asarray(mix.sizes)[np.searchsorted(cdf / cdf[-1], u[mine], side="right")]
    return tokens


def lognormal_noise(rng: np.random.Generator, n: int, cv: float) -> np.ndarray:
    """Multiplicative noise with mean 1 and coefficient of variation ``cv`` (ones when cv = 0)."""
    if cv <= 0:
        return np.ones(n)
    sigma2 = math.log1p(cv**2)
    return rng.lognormal(-sigma2 / 2, math.sqrt(sigma2), n)


class _Streams(NamedTuple):
    """The random streams a request's values are drawn from (:func:`random_streams`, gaps aside):
    numpy Generators, or :class:`qsim.chunks.BlockStream` s that serve the same draws a chunk at a
    time."""

    size: np.random.Generator
    service: np.random.Generator
    client: np.random.Generator
    patience: np.random.Generator
    used: np.random.Generator
    prompt: np.random.Generator
    prefix: np.random.Generator


@dataclass(frozen=True)
class TracePlan:
    """A synthetic workload as :func:`plan_trace` resolves it from its options: its requests drawn
    whole (:meth:`trace`, what :func:`make_trace` returns) or a chunk at a time (:meth:`chunks`),
    the same values."""

    kind: str  # the arrival process (parse_arrivals) and its numbers
    numbers: tuple[float, ...]
    rate: float
    surge_rate: float  # a surge's rate during it (NaN for other processes)
    seconds: float | None
    requests: int | None
    seed: int
    service: str
    model: ServiceModel
    mean_s: float
    speed: float
    noise_cv: float
    mix: Mix
    shares: tuple[float, ...]
    mixes: tuple[Mix, ...]
    clients: tuple[Client, ...]
    used: "UsedShare | dict[int, UsedShare] | None"
    prompts: "Prompts | None"
    patience: Patience | None
    name: str
    meta: dict = field(compare=False)
    prefixes: SharedPrefix | None = None
    dataset: Dataset | None = None

    def trace(self) -> Trace:
        gaps, *rest = random_streams(self.seed)
        times = _whole(self._pieces(gaps, None))
        duration = self._duration(times[-1] if times.size else None)
        return self._requests(times, duration, _Streams(*rest), self.dataset_rows(times.size))

    def dataset_rows(self, n: int) -> np.ndarray | None:
        """The dataset's rows that the n requests take, in request order (None: no dataset): drawn
        for all n at once (:meth:`qsim.datasets.Dataset.sample`, a shuffle), from a stream of its
        own, so the other streams draw what they drew without a dataset."""
        return None if self.dataset is None else dataset_rows(self.dataset, n, self.seed)

    def chunks(self, size: int) -> TraceChunks:
        """The requests of :meth:`trace`, ``size`` at a time, in memory of a chunk: the arrivals are
        drawn through once first (to count them and find the duration), every other stream as
        :class:`qsim.chunks.BlockStream` serves it."""
        if not (isinstance(size, (int, np.integer)) and size >= 1):
            raise ValueError(f"a chunk holds a whole number >= 1 of requests, got {size!r}")
        if self.prefixes is not None:  # a conversation's turns span chunks: no history there
            raise ValueError("a workload of shared prefixes is drawn whole: it does not stream")
        count, last = 0, None
        for times in self._pieces(random_streams(self.seed)[0], PIECE):
            count, last = count + times.size, times[-1]
        duration = float(self._duration(last))
        return TraceChunks(
            count,
            int(size),
            duration,
            self.name,
            self.meta,
            lambda: self._chunked(int(size), count, duration),
        )

    def _chunked(self, size: int, count: int, duration: float) -> Iterator[Trace]:
        gaps, *rest = random_streams(self.seed)
        streams = _Streams(*(BlockStream(rng, count) for rng in rest))
        rows, done = self.dataset_rows(count), 0  # one int a request: a dataset's shuffle is whole
        for times in exactly(self._pieces(gaps, size), size):
            for stream in streams:
                stream.chunk()
            part = None if rows is None else rows[done : done + times.size]
            done += times.size
            yield self._requests(times, duration, streams, part)

    def _pieces(self, gaps: np.random.Generator, size: int | None) -> Iterator[np.ndarray]:
        """The arrival times in pieces of at most ``size`` (None: as drawn)."""
        kind, numbers, seconds, requests = self.kind, self.numbers, self.seconds, self.requests
        if kind in ("poisson", "constant", "gamma"):
            cv = numbers[0] if numbers else 1.0
            return renewal_pieces(
                kind, gaps, self.rate, seconds=seconds, requests=requests, cv=cv, size=size
            )
        if kind == "surge":
            start_s, length_s, _ = numbers
            return surge_pieces(
                gaps,
                self.rate,
                self.surge_rate,
                start_s,
                length_s,
                seconds=seconds,
                requests=requests,
                size=size,
            )
        if kind == "burst":
            return burst_pieces(int(numbers[0]), size=size)
        if takes_load(kind, numbers):  # periodic:PERIOD_S, bursts whose size follows the load
            return periodic_at_rate_pieces(
                self.rate, numbers[-1], seconds=seconds, requests=requests, size=size
            )
        return periodic_pieces(
            int(numbers[0]), numbers[1], seconds=seconds, requests=requests, size=size
        )

    def _duration(self, last: float | None) -> float:
        """The arrival window that rates are per, from the last arrival (None: none came)."""
        if self.kind == "burst":
            return 0.0
        if self.seconds is not None:
            return self.seconds
        if last is None:
            return 0.0
        return last + self.numbers[-1] if self.kind == "periodic" else last

    def _requests(
        self, times: np.ndarray, duration: float, rng: _Streams, rows: np.ndarray | None = None
    ) -> Trace:
        """The requests that arrive at ``times``: each stream drawn once per request, in request
        order (``rows``: the dataset's row of each, whose lengths replace the mix's and the
        prompts')."""
        n = times.size
        which = (
            _draw_index(rng.client, self.shares, n) if self.clients else np.zeros(n, dtype=np.int64)
        )
        model, speed, used, prompts = self.model, self.speed, self.used, self.prompts
        generated = ids = None
        prompt = None if prompts is None or prompts.kind == "none" else prompts.draw(rng.prompt, n)
        if rows is not None:
            prompt = self.dataset.prompt_tokens[rows]
        if self.service == "mix":
            tokens = _sizes(rng.size, self.mixes, which)
            if rows is not None:  # the sizes' stream still draws: the noise's is its own anyway
                tokens = self.dataset.output_tokens[rows]
            # Each stream is its own: drawing the early stops first changes none of the others'
            # draws.
            generated = None if used is None else used_tokens(rng.used, tokens, used)
            if self.prefixes is not None:
                prompt, ids = self._shared(rng, prompt, tokens if generated is None else generated)
            est = model.estimate(tokens) if prompt is None else model.estimate(tokens, prompt)
            noise = lognormal_noise(rng.service, n, self.noise_cv)
            if used is None:
                true = est * speed * noise
            else:  # the engine does the work actually generated; the estimate still sees the limit
                work = (
                    model.estimate(generated)
                    if prompt is None
                    else model.estimate(generated, prompt)
                )
                true = work * speed * noise
        else:
            tokens = np.full(n, model.tokens_for(self.mean_s), dtype=np.int64)
            if self.prefixes is not None:
                prompt, ids = self._shared(rng, prompt, tokens)
            est = np.full(n, self.mean_s)
            draws = (
                rng.service.standard_exponential(n) if self.service == "exponential" else np.ones(n)
            )
            true = self.mean_s * speed * draws
        priority = client_id = None
        if self.clients:
            priority = np.asarray([c.priority for c in self.clients], dtype=np.int64)[which]
            client_id = np.asarray([c.name for c in self.clients], dtype=object)[which]
        patience = self.patience
        drawn = None if patience is None else patience.draw(rng.patience, n)
        trace = assemble_trace(
            times,
            tokens,
            est,
            true,
            mix=self.mix,
            duration_s=duration,
            name=self.name,
            meta=self.meta,
            priority=priority,
            client_id=client_id,
            prompt_tokens=prompt,
            patience_s=drawn,
            tokens_generated=generated,
        )
        return trace if ids is None else dataclasses.replace(trace, tokens=ids)

    def _shared(self, rng: _Streams, prompt: np.ndarray | None, answers: np.ndarray):
        """The prompts (lengths, token identities) with their shared prefixes: ``prompt`` is each
        request's own new tokens (None: none)."""
        own = np.zeros(len(answers), dtype=np.int64) if prompt is None else prompt
        return self.prefixes.compose(rng.prefix, own, np.asarray(answers, dtype=np.int64))


def make_trace(arrivals: str = "poisson", service: str = "mix", **options) -> Trace:
    """A seeded synthetic trace: :func:`plan_trace`'s (which says what each option does), drawn
    whole."""
    return plan_trace(arrivals, service, **options).trace()


def trace_chunks(size: int, **options) -> TraceChunks:
    """:func:`make_trace`'s trace for these options, ``size`` requests at a time
    (:meth:`TracePlan.chunks`)."""
    return plan_trace(**options).chunks(size)


def load_rate(load: float, engines: int, mean_true_s: float) -> float:
    """Requests per second at utilisation ``load`` of ``engines`` engines whose requests take
    ``mean_true_s`` on average: lambda = load * K / E[true S] (synthetic arrivals here, a trace
    file's window in
    :class:`qsim.tracefiles.TraceWindow`)."""
    return load * engines / mean_true_s


def load_at_rate(rate_rps: float, **options) -> float:
    """The load at which :func:`plan_trace` with ``options`` sends ``rate_rps`` requests per second.
    The rate is linear in the load (:func:`load_rate`, or load x capacity_rps), so this is the
    rate over the one at load 1: whatever counts in the load (engines, speed, the mix, clients,
    early stops, a batching engine's capacity) counts here. ValueError for a process that takes
    no load (its bursts bring their own rate)."""
    if not (rate_rps > 0 and math.isfinite(rate_rps)):
        raise ValueError(f"a rate must be a positive number of requests per second, got {rate_rps}")
    arrivals = options.get("arrivals", "poisson")
    if not arrivals_take_load(arrivals):
        raise ValueError(
            f"arrivals {arrivals!r} bring their own rate (their burst size sets it) "
            "and take no --rate"
        )
    return rate_rps / plan_trace(**{**options, "load": 1.0}).rate


def plan_trace(
    arrivals: str = "poisson",
    service: str = "mix",
    *,
    load: float | None = None,
    engines: int = 1,
    speed: float = 1.0,
    seconds: float | None = None,
    requests: int | None = None,
    seed: int = 0,
    mix: Mix = REFERENCE_MIX,
    model: ServiceModel = ServiceModel(),
    mean_service_s: float | None = None,
    noise_cv: float = 0.0,
    clients: tuple[Client, ...] = (),
    patience: Patience | None = None,
    used: "UsedShare | dict[int, UsedShare] | None" = None,
    prompts: "Prompts | None" = None,
    capacity_rps: float | None = None,
    prefixes: SharedPrefix | None = None,
    dataset: Dataset | None = None,
) -> TracePlan:
    """A seeded synthetic workload: what :func:`make_trace` draws whole and :meth:`TracePlan.chunks`
    a chunk at a time.

    load is the utilisation at the simulated speed: lambda = load * engines / E[true S] (None:
    :data:`DEFAULT_LOAD`); a process whose size sets its rate (:data:`qsim.arrivals.SIZED`) takes
    none, and giving it one is a ValueError. speed multiplies every true service time (2.25 = the
    machine 2.25x slower). service: 'mix' (sizes from ``mix`` through ``model``, optional lognormal
    noise of CV ``noise_cv``), 'exponential' or 'deterministic' with mean ``mean_service_s``
    (default: the mix's mean). clients: who sends each request (:class:`~qsim.mixes.Client`; each
    brings its priority and may bring its own mix); the load counts their mixes by their shares.
    patience: how long each client waits (:class:`qsim.clients.Patience`, drawn from a fifth stream;
    None or "none": forever). used: early stops (:class:`~qsim.mixes.UsedShare`, one for all or a
    mapping from a size to its own, from a sixth stream; None: every request generates its limit):
    true service times follow the tokens generated, and ``load`` counts that work. prompts: prompt
    lengths (:class:`~qsim.mixes.Prompts`, from a seventh stream; None: none). prefixes: prompts
    that share tokens (:class:`~qsim.mixes.SharedPrefix`: a system prompt, conversations; from an
    eighth stream; None or sharing nothing: every prompt its own), whose tokens a prefix cache reads
    (Trace.tokens). capacity_rps: the requests per second the server can take (a batching engine's,
    :func:`qsim.engines.Batching.capacity_rps`): then lambda = load * capacity_rps, and engines,
    speed and the mix's mean time no longer set the rate. dataset: each request's prompt and output
    lengths from a dataset's rows (:class:`qsim.datasets.Dataset`, sampled from a ninth stream); it
    replaces the mix's sizes and ``prompts``, and the load counts its mean estimate.
    """
    if (seconds is None) == (requests is None):
        raise ValueError("give exactly one of seconds and requests")
    if seconds is not None and not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if requests is not None and requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    check_load(arrivals, load)
    kind, numbers = parse_arrivals(arrivals)
    if load is None and takes_load(kind, numbers):
        load = DEFAULT_LOAD
    if load is not None and not load > 0:
        raise ValueError(f"load must be > 0, got {load}")
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    if service not in SERVICES:
        raise ValueError(
            f"unknown service distribution {service!r}; choose one of {', '.join(SERVICES)}"
        )
    if mean_service_s is not None and not mean_service_s > 0:
        raise ValueError(f"mean service time must be > 0, got {mean_service_s}")
    shares, mixes = blend(mix, clients)
    mean_s = (
        blended_means(mix, clients, model)[0] if mean_service_s is None else float(mean_service_s)
    )
    if used is not None and service == "mix":  # the load is of the work actually done
        mean_s = used_mean_s(mix, clients, model, used)
    if dataset is not None:
        _check_dataset(service, used, prompts, prefixes, clients)
        mean_s = float(np.mean(model.estimate(dataset.output_tokens, dataset.prompt_tokens)))
    if service == "mix" and mean_service_s is not None:
        raise ValueError(
            "--mean-service applies to exponential and deterministic service, not to the mix"
        )

    if capacity_rps is not None and not (capacity_rps > 0 and math.isfinite(capacity_rps)):
        raise ValueError(
            f"capacity_rps must be a positive number of requests per second, got {capacity_rps}"
        )
    if used is not None and service != "mix":
        raise ValueError(
            "early stops (used share) apply to the mix's sizes, not to exponential "
            "or deterministic service"
        )
    # a sized process's rate is its own: a burst has none, periodic bursts of N one every period
    if load is None:
        rate = numbers[0] / numbers[1] if kind == "periodic" else math.nan
    else:
        rate = (
            load_rate(load, engines, speed * mean_s)
            if capacity_rps is None
            else load * capacity_rps
        )
    surge_rate = load_rate(numbers[2], engines, speed * mean_s) if kind == "surge" else math.nan
    meta = dict(
        arrivals=arrivals,
        service=service,
        load=load,
        engines=engines,
        speed=speed,
        seed=seed,
        rate=rate,
        mean_service_s=mean_s,
        noise_cv=noise_cv,
    )
    if clients:
        meta["clients"] = [c.name for c in clients]
    if patience is not None and patience.kind != "none":
        meta.update(patience=patience.spec, patience_until=patience.until)
    if prompts is not None and prompts.kind != "none":
        meta["prompts"] = prompts.spec
    if prefixes is not None and not prefixes.shares:
        prefixes = None  # nothing shared: the trace it was without (no tokens to carry)
    if prefixes is not None:
        meta["prefixes"] = dataclasses.asdict(prefixes)
    if dataset is not None:
        meta.update(dataset=dataset.path, dataset_tokens=dataset.counting)
    return TracePlan(
        kind,
        numbers,
        rate,
        surge_rate,
        seconds,
        requests,
        seed,
        service,
        model,
        mean_s,
        speed,
        noise_cv,
        mix,
        tuple(shares),
        tuple(mixes),
        tuple(clients),
        used,
        prompts,
        patience,
        f"{arrivals}-{service}",
        meta,
        prefixes,
        dataset,
    )


def _check_dataset(service: str, used, prompts, prefixes, clients) -> None:
    """What a dataset's lengths cannot stand beside (ValueError): they are the sizes, the prompts
    and the tokens generated (each request generates its output length, as vLLM's benchmark
    asks)."""
    if service != "mix":
        raise ValueError("a dataset's output lengths are the sizes: it needs --service mix")
    if used is not None:
        raise ValueError(
            "a dataset's output lengths are the tokens generated: drop the early stops (--used)"
        )
    if prompts is not None and prompts.kind != "none":
        raise ValueError("a dataset brings its own prompt lengths: drop --prompts")
    if prefixes is not None and prefixes.shares:
        raise ValueError(
            "a dataset's prompts share no prefixes here: drop --system-prompt and --turns"
        )
    if any(c.mix is not None for c in clients):
        raise ValueError(
            "a dataset's output lengths replace every mix: clients may bring no mix of their own"
        )
