"""How to replay a trace against a live server (:class:`ReplayConfig`): where, how patiently, with
what prompts, in which API, and the objectives sent with every request (:class:`Objectives`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from qsim.clients import RetryPolicy

from .routes import TPOT_SLO_HEADER, TTFT_SLO_HEADER
from .tokenizer import MIN_CONTEXT_TOKENS

#: qlab: qlab's own /v1/generate; openai: POST /v1/completions, streamed, on any OpenAI-compatible
#: server.
APIS = ("qlab", "openai")


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay: where, how patiently, and with what prompts.

    timeout_s bounds one request end to end: long enough for a request stuck
    behind an unbounded queue to be answered late rather than counted an error.
    lead_s is the head start between starting the clock and the first send, so
    that the first requests do not leave late. Prompts are the trace's length in the
    server's tokens (prompt_words words where it has none: see :func:`plan_prompts`),
    capped at the context minus the request's new tokens; context_tokens: the
    engine's context (None: what the server's /healthz says, else no limit). retry: how clients send
    a request again (None: never; its timeout_s is the per-attempt hang-up); retry_seed: the
    jitter's seed (None: the trace's seed, as :func:`qsim.simulate` takes it).
    api: qlab (``/v1/generate``) or openai (streamed ``/v1/completions`` of ``model``, None: the
    first the server lists; see :class:`Api`).
    """

    url: str
    timeout_s: float = 300.0
    prompt_words: int = 16
    context_tokens: int | None = None
    lead_s: float = 0.2
    late_warn_s: float = 0.005
    max_warm_connections: int = 256
    retry: RetryPolicy | None = None
    retry_seed: int | None = None
    api: str = "qlab"
    model: str | None = None
    slo: Objectives | None = None  # sent with every request, and recorded (ttft_slo_s, tpot_slo_s)

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.model is not None and self.api != "openai":
            raise ValueError(
                "a model is named only with api openai (qlab's /v1/generate takes none)"
            )
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if not (self.timeout_s > 0 and self.lead_s >= 0 and self.late_warn_s > 0):
            raise ValueError("timeout_s and late_warn_s must be > 0 and lead_s >= 0")
        if self.prompt_words < 1:
            raise ValueError(f"prompt_words must be >= 1, got {self.prompt_words}")
        if self.context_tokens is not None and self.context_tokens < MIN_CONTEXT_TOKENS:
            raise ValueError(
                f"context_tokens must be >= {MIN_CONTEXT_TOKENS} (a prompt token and "
                "a new one), "
                f"got {self.context_tokens}"
            )
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise ValueError(
                f"retry must be a qsim.clients.RetryPolicy, got {type(self.retry).__name__}"
            )


@dataclass(frozen=True)
class Objectives:
    """A run's objectives beside the deadline: time to the first token and time per output token
    after it (seconds; None: not set), sent as the ``x-slo-ttft-ms`` and ``x-slo-tpot-ms`` headers
    and recorded as the ttft_slo_s and tpot_slo_s columns, which goodput (analysis.latency) judges
    by."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def headers(self) -> dict[str, str]:
        pairs = ((TTFT_SLO_HEADER, self.ttft_s), (TPOT_SLO_HEADER, self.tpot_s))
        return {name: f"{seconds * 1000:g}" for name, seconds in pairs if seconds is not None}

    def columns(self, frame: pd.DataFrame) -> pd.DataFrame:
        for name, seconds in (("ttft_slo_s", self.ttft_s), ("tpot_slo_s", self.tpot_s)):
            frame[name] = np.full(len(frame), math.nan if seconds is None else seconds)
        return frame
