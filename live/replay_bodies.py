"""A trace's requests as the replayer sends them: each one's prompt, planned in the server's tokens
and capped at what its context leaves (:func:`plan_prompts`) or given whole (:class:`GivenPrompts`),
its body (:func:`payloads`), and the HTTP request of that body in the API asked (:class:`Api`:
qlab's ``/v1/generate`` or OpenAI's ``/v1/completions``); and what is said of prompts capped or not
sent.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass

import httpx
import numpy as np
import pandas as pd

from qsim import Trace
from qsim.prefix import Tokens, render_ids

from . import openai_replay
from .lanes import Lanes
from .replay_config import ReplayConfig
from .routes import GENERATE
from .server_facts import ServerFacts, default_prompt_tokens
from .tokenizer import ByteTokenizer, prompt_of

#: The reason of a request the replayer did not send: its new tokens leave no room for a prompt
#: token.
CANNOT_FIT = "prompt_cannot_fit"


@dataclass(frozen=True)
class PromptPlan:
    """Each request's prompt length in the server's tokens, and what the context did to it.

    tokens: the length sent (0 where nothing is sent); capped: shortened to fit the context beside
    its new tokens (or the gate's prompt cap); unfit: not sent at all, its new tokens fill the
    context.
    """

    tokens: np.ndarray
    capped: np.ndarray
    unfit: np.ndarray
    facts: ServerFacts
    # Per request, where its prompt goes as token ids (a server that takes them): its tokens
    # (qsim.prefix.Tokens, capped as its length), which the run file keeps; None: text.
    segments: tuple = ()

    def segment_specs(self) -> pd.arrays.StringArray:
        """The run file's column of them (:meth:`qsim.prefix.Tokens.spec`; <NA>: text)."""
        specs = [None if t is None else t.spec() for t in self.segments] or [None] * len(
            self.tokens
        )
        return pd.array(specs, dtype="string")

    def meta(self) -> dict:
        """The counts, for the run's attrs and the command's report."""
        return {
            "context_tokens": self.facts.context,
            "prompt_tokenizer": self.facts.tokenizer,
            "prompts_capped": int(self.capped.sum()),
            "prompts_cannot_fit": int(self.unfit.sum()),
        }


@dataclass(frozen=True)
class GivenPrompts:
    """Each request's own prompt text (a dataset's rows, :mod:`qsim.datasets`), whose length the
    trace's prompt_tokens gives under the rule ``counting`` (pieces or bytes)."""

    texts: tuple[str, ...]
    counting: str


def plan_prompts(
    trace: Trace,
    cfg: ReplayConfig,
    facts: ServerFacts = ServerFacts(),
    given: GivenPrompts | None = None,
) -> PromptPlan:
    """The trace's prompt lengths where it has them, else the default prompt's; each capped at the
    room its new tokens leave in the context (``cfg.context_tokens``, else the server's), and at the
    gate's prompt cap. A request that leaves no room (max_new_tokens >= context) is not sent: never
    shortened without being counted. A given text (``given``) is never shortened: where it would be,
    it is not sent either."""
    if cfg.context_tokens is not None:
        facts = dataclasses.replace(facts, context=cfg.context_tokens)
    own = np.asarray(trace.prompt_tokens, dtype=np.int64)
    wanted = np.where(own > 0, own, default_prompt_tokens(facts, cfg.prompt_words))
    room = np.array([facts.longest_prompt(int(n)) for n in trace.max_new_tokens], dtype=float)
    unfit = room < 1
    capped = ~unfit & (wanted > room)
    if given is not None:  # a dataset's text is sent whole or not at all
        unfit, capped = unfit | capped, np.zeros_like(capped)
    tokens = np.where(
        unfit, 0, np.minimum(wanted, np.where(np.isfinite(room), room, wanted))
    ).astype(np.int64)
    segments = () if given is not None else _segments(trace, tokens, unfit, facts)
    return PromptPlan(tokens, capped, unfit, facts, segments)


def _segments(trace: Trace, tokens: np.ndarray, unfit: np.ndarray, facts: ServerFacts) -> tuple:
    """Where the server takes token ids, each sent request's tokens at its planned length: the
    trace's (a shared system prompt, a conversation's turns) or, a trace that shares none, its own
    (what the simulator makes of such a trace)."""
    if facts.token_id_vocab is None:
        return ()
    return tuple(
        None
        if unfit[i]
        else (Tokens.unique(i, n) if trace.tokens is None else trace.tokens[i].first(n))
        for i, n in enumerate(tokens.tolist())
    )


def payloads(
    trace: Trace,
    cfg: ReplayConfig,
    plan: PromptPlan | None = None,
    given: GivenPrompts | None = None,
    salt: int = 0,
) -> list[dict | None]:
    """One request body per trace entry (None: not sent, see :func:`plan_prompts`); deadline_ms only
    where the trace sets one (else the server's default), priority where it is not 0 and client_id
    where the trace names a client. The prompt is the given text (``given``), else token ids of the
    plan's segments where it has them (:func:`qsim.prefix.render_ids`, salted with ``salt``), else
    text generated to the planned length."""
    plan = plan_prompts(trace, cfg, given=given) if plan is None else plan
    ids = _rendered(plan, salt)
    out = []
    for i, (tokens, length, unfit, deadline, priority, client) in enumerate(
        zip(
            trace.max_new_tokens,
            plan.tokens,
            plan.unfit,
            trace.deadline_s,
            trace.priority,
            trace.client_id,
        )
    ):
        if unfit:
            out.append(None)
            continue
        if ids is not None:
            prompt = list(ids[i])
        elif given is None:
            prompt = prompt_of(int(length), plan.facts.tokenizer)
        else:
            prompt = given.texts[i]
        body = {"prompt": prompt, "max_new_tokens": int(tokens)}
        if math.isfinite(deadline):
            body["deadline_ms"] = int(round(deadline * 1000))
        if priority:
            body["priority"] = int(priority)
        if client is not None:
            body["client_id"] = str(client)
        out.append(body)
    return out


def _rendered(plan: PromptPlan, salt: int) -> list[tuple] | None:
    """The plan's segments as token ids (None: it has none); a request not sent renders as no
    tokens, so that no later turn takes an answer it never had from it."""
    if not plan.segments:
        return None
    empty = Tokens((), -1)
    tokens = [empty if t is None else t for t in plan.segments]
    return render_ids(tokens, plan.facts.token_id_vocab, salt)


@dataclass(frozen=True)
class Api:
    """Where the requests go and how their answers are read: qlab's ``/v1/generate`` (``model``
    None; answers read whole, as they always were), or an OpenAI-compatible server's
    ``/v1/completions``, streamed, asking for ``model`` (:mod:`live.openai_replay`: time to the
    first token and to ``[DONE]``)."""

    model: str | None = None

    @property
    def path(self) -> str:
        return GENERATE if self.model is None else openai_replay.COMPLETIONS

    @property
    def read(self):
        return None if self.model is None else openai_replay.read_completion

    def request(self, lanes: Lanes, body: dict) -> httpx.Request:
        """The request of one ``/v1/generate`` body, in this API."""
        kwargs = (
            {"json": body}
            if self.model is None
            else openai_replay.completion_request(body, self.model)
        )
        return lanes.request("POST", self.path, **kwargs)


def report_prompts(plan: PromptPlan, requests: int) -> None:
    """Say on stderr what the context did to the prompts: never shortened or left unsent without
    a count."""
    if plan.capped.any():
        print(
            f"qlab replay: {int(plan.capped.sum())} of {requests} prompts capped to fit the "
            "context "
            f"({plan.facts.context} tokens) beside their new tokens, or the server's prompt cap",
            file=sys.stderr,
        )
    if plan.unfit.any():
        # A dataset's text, never shortened, is unfit also where its prompt and new tokens overflow.
        print(
            f"qlab replay: {int(plan.unfit.sum())} of {requests} requests not sent: "
            "max_new_tokens fills the "
            f"context of {plan.facts.context} tokens, or a dataset's prompt beside it would "
            "overflow it "
            f"(outcome error, reason {CANNOT_FIT})",
            file=sys.stderr,
        )


def warn_counting(given: GivenPrompts, facts: ServerFacts) -> None:
    """Say on stderr where the server counts tokens by another rule than the texts were counted by:
    the simulated run of the same rows then describes other lengths than the server sees."""
    if facts.tokenizer == ByteTokenizer.name and given.counting != "bytes":
        print(
            f"qlab replay: warning: the server counts bytes, the dataset's lengths are "
            f"{given.counting}; --dataset-tokens bytes counts as it does",
            file=sys.stderr,
        )
