"""Engine models: what runs the admitted requests, and how long it takes.

An engine model is a component of the queue core (:mod:`qsim.queue`), declared once in a
:class:`qsim.config.ServerConfig` and read the same way by the simulator, the gate, a run
file and ``qlab compare``. Two:

* :class:`OneAtATime`: K engines, each running one request from start to end (the
  reference study's; the default). With ``concurrency`` c > 0 a run is slower the more
  engines are busy when it starts: its time x (1 + c (n - 1)) for n busy, itself
  included (engine threads that share a machine's cores slow each other; measured live
  at 1.22-2.29x). ``cv``: the spread of one run's time around that (``qlab calibrate``
  measures both).
* :class:`Batching`: one engine that runs requests together in iteration-level steps,
  as vLLM's v1 scheduler does: at most ``max_num_seqs`` running, at most
  ``max_num_batched_tokens`` computed per step, chunked prefill, KV memory in blocks of
  ``block_size`` tokens, and recompute preemption of the newest running request when the
  blocks run out. How long a step takes is a :class:`StepModel`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

import numpy as np


def _finite(value: float, lowest: float = 0.0) -> bool:
    return math.isfinite(value) and value >= lowest


@dataclass(frozen=True)
class OneAtATime:
    """K engines, one request each at a time; ``concurrency``: the slowdown per other busy engine;
    ``cv``: the CV of one run's time around the model x that slowdown, as calibrated (0: not said).
    A trace's service times carry their own noise, so the simulator does not draw this again: it is
    where ``qlab simulate`` (without ``--noise``) and ``qlab compare --predict`` take their noise
    from."""

    engines: int = 1
    concurrency: float = 0.0
    cv: float = 0.0

    kind = "one-at-a-time"

    def __post_init__(self) -> None:
        if not (isinstance(self.engines, int) and self.engines >= 1):
            raise ValueError(f"engines must be an integer >= 1, got {self.engines!r}")
        if not _finite(self.concurrency):
            raise ValueError(f"concurrency must be a finite number >= 0, got {self.concurrency}")
        if not _finite(self.cv):
            raise ValueError(f"cv must be a finite number >= 0, got {self.cv}")

    def slowdown(self, busy: int) -> float:
        """How many times its calibrated time a run takes that starts with ``busy`` engines busy,
        itself included."""
        return 1.0 + self.concurrency * (busy - 1)


@dataclass(frozen=True)
class StepModel:
    """Seconds one step of a batching engine takes:

        t = b0 + b1 x prefill tokens computed in the step + b2 x sequences that produce a token
            + b3 x context tokens held (the KV the step's attention reads, its own tokens included)

    (DistServe's and BLIS's form). ``cv``: the spread of a step's time around the model, a gamma
    draw of mean 1 (cv 1 is exponential), for the simulator; 0: exactly the model.
    """

    b0: float = 0.010
    b1: float = 0.0
    b2: float = 0.0002
    b3: float = 0.0
    cv: float = 0.0

    def __post_init__(self) -> None:
        for name in ("b0", "b1", "b2", "b3", "cv"):
            if not _finite(getattr(self, name)):
                raise ValueError(
                    f"step model {name} must be a finite number >= 0, got {getattr(self, name)}"
                )
        if self.b0 + self.b1 + self.b2 + self.b3 <= 0:
            raise ValueError(
                "a step model needs a positive coefficient: every step would take no time"
            )

    def time(self, prefill: float, seqs: float, context: float) -> float:
        return self.b0 + self.b1 * prefill + self.b2 * seqs + self.b3 * context

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> "StepModel":
        """From a table of the fields (b0 ... cv; any may be absent: its default), as a step model
        file, a calibration's ``step`` and a run file's server config hold it; ValueError naming
        what is wrong."""
        if not isinstance(raw, Mapping) or set(raw) - set(STEP_FIELDS):
            raise ValueError(f"a step model is a table of {', '.join(STEP_FIELDS)}, got {raw!r}")
        try:
            return cls(**{k: float(v) for k, v in raw.items()})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad step model {dict(raw)!r}: {exc}") from None

    @classmethod
    def fit(cls, prefill, seqs, context, seconds) -> "StepFit":
        """Non-negative least squares (scipy's lsq_linear) of measured steps' times on the four
        terms; the fit's errors on one step, the CV of steps around it, r^2, and each coefficient's
        standard error (White's heteroscedasticity-consistent one: a step's spread grows with its
        time). ``context`` None: the measurements do not say the context held (an engine's
        counters), so b3 is 0, not fitted."""
        y = np.asarray(seconds, dtype=float)
        terms = [np.ones(len(y)), np.asarray(prefill, float), np.asarray(seqs, float)]
        if context is not None:
            terms.append(np.asarray(context, float))
        x = np.column_stack(terms)
        if x.shape[0] < x.shape[1]:
            raise ValueError(
                f"a step model of {x.shape[1]} terms needs at least {x.shape[1]} "
                "measured "
                f"steps, got {x.shape[0]}"
            )
        from scipy import optimize  # at first use, not import: it costs each qlab process ~1 s

        b = optimize.lsq_linear(x, y, bounds=(0, np.inf)).x
        model = cls(*map(float, b))
        rel = np.abs(x @ b - y) / np.where(y > 0, y, np.nan)
        resid = y / np.where(x @ b > 0, x @ b, np.nan)
        se = _standard_errors(x, y - x @ b) + (math.nan,) * (4 - x.shape[1])
        return StepFit(
            model,
            float(np.nanmedian(rel)),
            float(np.nanmax(rel)),
            float(np.nanstd(resid)),
            len(y),
            r_squared(y, x @ b),
            se,
        )


def r_squared(y: np.ndarray, fitted: np.ndarray) -> float:
    """1 - residual / total sum of squares (NaN: ``y`` does not vary)."""
    total = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - fitted) ** 2)) / total if total > 0 else math.nan


def _standard_errors(x: np.ndarray, resid: np.ndarray) -> tuple[float, ...]:
    """White's (HC0) standard error of each coefficient; NaN for a term the steps did not vary (its
    column is constant or zero: the intercept takes it, and nothing can be said of it alone)."""
    xtx_inv = np.linalg.pinv(x.T @ x)
    cov = xtx_inv @ (x.T * resid**2) @ x @ xtx_inv
    varied = np.array([True, *(np.ptp(x[:, k]) > 0 for k in range(1, x.shape[1]))])
    return tuple(
        float(np.sqrt(v)) if ok and v >= 0 else math.nan for v, ok in zip(np.diag(cov), varied)
    )


#: A step model's fields, in order (what ``--step B0,B1,B2,B3[,CV]`` gives).
STEP_FIELDS = ("b0", "b1", "b2", "b3", "cv")


@dataclass(frozen=True)
class StepFit:
    """A fitted step model (its ``cv`` 0: the spread is :attr:`cv`), its median and worst relative
    error on one step, the CV of steps around it (each step's time over the model's), the number of
    steps, r^2, and the standard errors of b0 ... b3 (NaN: a term the steps did not vary)."""

    model: StepModel
    median_rel_error: float
    worst_rel_error: float
    cv: float
    n: int
    r2: float = math.nan
    se: tuple[float, ...] = ()

    @property
    def calibrated(self) -> StepModel:
        """The fitted model with the spread of steps around it as its CV: what a simulator draws
        from."""
        return replace(self.model, cv=self.cv)


#: vLLM's defaults for an OpenAI-compatible server on a GPU under 70 GiB (its
#: EngineArgs.get_batch_defaults).
VLLM_MAX_NUM_SEQS = 256
VLLM_MAX_NUM_BATCHED_TOKENS = 2048
VLLM_BLOCK_SIZE = 16


@dataclass(frozen=True)
class FrontEnd:
    """The API process in front of a batching engine, as one FIFO server on a core of its own.

    vLLM's takes each request in (tokenises it, hands it to the engine) and, after each engine
    step, detokenises and streams every token the step produced; on a machine of few cores that
    process, not the engine, can set the pace (docs/vllm.md measured 2.3 s a request outside
    vLLM's engine at 32 in flight). Here it does one job of ``request_s`` per request as it joins
    the batch (the request computes once that job is done) and, after each step, one of
    ``step_s`` plus ``token_s`` per token the step produced (its tokens reach the client when that
    job is done; vLLM's API process handles each step's outputs together, at a cost a step and a
    smaller one a token: ``benchmarks/vllm_front_end.py``). A request keeps its seat until
    its last token has reached the client, as a gate in front counts it; its KV blocks are free
    when the engine is done with it. Jobs are served in the order they come.
    """

    request_s: float = 0.0
    token_s: float = 0.0
    step_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("request_s", "token_s", "step_s"):
            value = getattr(self, name)
            if not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
            ):
                raise ValueError(f"front_end {name} must be a number >= 0, got {value!r}")

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> "FrontEnd":
        """The front end a table of its fields describes (as TOML, a run file or a calibration
        carries it; a field not given is 0); ValueError naming a field it does not have."""
        unknown = set(raw) - {"request_s", "token_s", "step_s"}
        if unknown:
            raise ValueError(
                f"front_end takes request_s, token_s and step_s, not {sorted(unknown)}"
            )
        return cls(**raw)


@dataclass(frozen=True)
class Batching:
    """One engine running requests together in steps, as vLLM's v1 scheduler does (see
    :mod:`qsim.batch`).

    kv_blocks: KV-cache capacity in blocks of ``block_size`` tokens (None: unlimited).
    prefix_caching: full blocks are cached by their prefix's hash and shared, as vLLM v1 does by
    default (:mod:`qsim.prefix`); off by default here, so that runs without it keep their rows.
    front_end: the API process in front of the engine (:class:`FrontEnd`; None: none, requests
    reach the engine and tokens the client at once).
    """

    step: StepModel = StepModel()
    max_num_seqs: int = VLLM_MAX_NUM_SEQS
    max_num_batched_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS
    chunked_prefill: bool = True
    kv_blocks: int | None = None
    block_size: int = VLLM_BLOCK_SIZE
    prefix_caching: bool = False
    front_end: FrontEnd | None = None

    kind = "batching"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM refuses this too: every running request must be able to decode in each step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                "max_num_seqs "
                f"({self.max_num_seqs})"
            )
        if self.kv_blocks is not None and not (
            isinstance(self.kv_blocks, int) and self.kv_blocks >= 1
        ):
            raise ValueError(f"kv_blocks must be an integer >= 1 or None, got {self.kv_blocks!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be true or false, got {self.prefix_caching!r}")
        if isinstance(self.front_end, Mapping):  # as a TOML table or a run file's fields carry it
            object.__setattr__(self, "front_end", FrontEnd.from_fields(self.front_end))
        if self.front_end is not None and not isinstance(self.front_end, FrontEnd):
            raise ValueError(
                f"front_end must be a table of request_s, token_s and step_s, "
                f"got {self.front_end!r}"
            )

    @property
    def engines(self) -> int:
        return 1

    def blocks_for(self, tokens: int) -> int:
        """KV blocks that ``tokens`` tokens take."""
        return -(-tokens // self.block_size)

    def capacity_rps(self, mean_prompt: float, mean_out: float) -> float:
        """Requests per second this engine serves when saturated, for requests of these mean prompt
        and output lengths: a full batch (``max_num_seqs``, or as many as the KV blocks hold at a
        request's mean context, prompt plus half its output), each finishing after its output
        tokens, at the step model's time for that batch (its prefill tokens spread over the steps).
        An approximation a sweep's load is measured against (load 1: about saturation); the
        simulator, not this, says what the engine does."""
        if not (mean_out >= 1 and mean_prompt >= 0):
            raise ValueError(
                f"a capacity needs mean output >= 1 and prompt >= 0, got {mean_out}, {mean_prompt}"
            )
        context = mean_prompt + mean_out / 2
        seqs = float(self.max_num_seqs)
        if self.kv_blocks is not None:
            seqs = min(seqs, self.kv_blocks * self.block_size / max(context, 1.0))
        seqs = max(seqs, 1.0)
        step = self.step.time(seqs / mean_out * mean_prompt, seqs, seqs * context)
        return seqs / (mean_out * step)


EngineModel = OneAtATime | Batching


def engine_fields(engine: EngineModel) -> dict[str, Any]:
    """The engine model as JSON-able fields, ``kind`` first (what a run file and /stats carry)."""
    fields = asdict(engine)
    if not fields.get("prefix_caching", True):
        del fields["prefix_caching"]  # off: the fields a run file or /stats carried before it
    if fields.get("front_end", 0) is None:
        del fields["front_end"]  # none: likewise
    return {"kind": engine.kind, **fields}


def engine_from_fields(raw: Mapping[str, Any] | int) -> EngineModel:
    """The engine model ``raw`` describes (:func:`engine_fields`'s output; an int: that many engines
    one at a time). ValueError naming what is wrong."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return OneAtATime(raw)
    if not isinstance(raw, Mapping):
        raise ValueError(f"an engine model is a table with a kind, got {raw!r}")
    fields = {k: v for k, v in raw.items() if k != "kind"}
    kind = raw.get("kind", OneAtATime.kind)
    try:
        if kind == OneAtATime.kind:
            return OneAtATime(**fields)
        if kind == Batching.kind:
            step = fields.pop("step", {})
            return Batching(
                step=step if isinstance(step, StepModel) else StepModel(**step), **fields
            )
    except TypeError as exc:
        raise ValueError(f"engine model {kind}: {exc}") from None
    raise ValueError(
        f"unknown engine model kind {kind!r}; choose {OneAtATime.kind} or {Batching.kind}"
    )
