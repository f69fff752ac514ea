"""The GPT-2 engine: greedy decoding with the KV cache, on CUDA or CPU.

This is the only module of qlab that imports torch and transformers; the rest
of the harness (gate, service, synthetic engine) works without them.

Models (``--model``):

* ``tiny``: a 2-layer, 64-wide GPT-2 with random weights, for tests;
* ``random``: GPT-2 small's architecture (12 layers, 768 wide, 124 M
  parameters) with seeded random weights: the same compute per token as the
  real model, with no download;
* anything else: a hub name or a local directory for
  ``AutoModelForCausalLM.from_pretrained`` (``gpt2`` where its weights are
  cached or can be downloaded).

Tokenizer: the model's own where its files load; otherwise (always for
``tiny`` and ``random``) the byte-level tokenizer of :mod:`live.tokenizer`.

Decoding generates exactly ``max_new_tokens`` tokens (end-of-text does not
stop it: the study wants the work to follow the request's size) unless a stop
string appears in the decoded text, which is then cut before the stop string,
or the gate cancels the run (its client left, or its deadline passed under a policy
that cuts there): decoding then stops before the next step and the run reports
``stopped``. A run that streams (``emit``, see :mod:`live.engine`) brings each token to the
host as it is decoded and emits its text (held back while a stop string may be starting).
``EngineResult.tokens`` is the number generated, not the limit: what a learning estimator
(``Policy.estimator = "learned"``) learns from.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from .engine import Abilities, Asked, Emit, EngineResult, PieceFeed, apply_stop
from .tokenizer import ByteTokenizer

#: The test model: GPT-2's vocabulary and context, two thin layers.
TINY = {"n_layer": 2, "n_head": 4, "n_embd": 64}
RANDOM_MODELS = ("tiny", "random")


@dataclass(frozen=True)
class GPT2Spec:
    """Which model, on which device, with which seed for random weights.

    threads: torch's CPU threads (process-wide); None leaves torch's default.
    With K engines on a CPU, K x threads above the core count slows everyone.
    """

    model: str = "tiny"
    device: str = "auto"
    seed: int = 0
    threads: int | None = None


def resolve_device(device: str) -> str:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is a ValueError."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no CUDA device")
    return device


class _HFTokenizer:
    """The model's own tokenizer behind the same three methods as ByteTokenizer."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.name = type(tok).__name__

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self._tok.decode(ids, clean_up_tokenization_spaces=False)  # the text as generated

    def count(self, text: str) -> int:
        return len(self.encode(text))


def _random_model(name: str, seed: int):
    config = GPT2Config(**TINY) if name == "tiny" else GPT2Config()
    # Seed the weights without disturbing the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)


def _local_then_hub(loader, name: str):
    """Cached or local files first; only then the hub (offline, its retries take half a minute)."""
    if Path(name).is_dir():  # a local directory: there is no hub to fall back on
        return loader(name)
    try:
        return loader(name, local_files_only=True)
    except OSError:
        print(
            f"qlab: {name!r} is not on this machine; trying the Hugging Face hub "
            "(HF_HUB_OFFLINE=1 skips this)",
            file=sys.stderr,
        )
        return loader(name)


def _pretrained(name: str):
    # safetensors only: a pickled .bin checkpoint can run code when it is loaded.
    try:
        return _local_then_hub(
            partial(AutoModelForCausalLM.from_pretrained, use_safetensors=True), name
        )
    except (OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(
            f"cannot load model {name!r} ({type(exc).__name__}: {first}); "
            "--model random gives GPT-2 small's architecture with random weights, "
            "no download needed"
        ) from None


def _tokenizer_for(name: str):
    if name in RANDOM_MODELS:
        return ByteTokenizer()
    try:
        tok = _HFTokenizer(_local_then_hub(AutoTokenizer.from_pretrained, name))
        # transformers 5 builds an empty GPT2Tokenizer for a directory without vocabulary files:
        # it loads, but encodes every text to nothing. A round trip tells a real one.
        probe = "The queue in front of the engine."
        if tok.decode(tok.encode(probe)) != probe:
            raise ValueError("the tokenizer does not round-trip text (no vocabulary?)")
        return tok
    except Exception as exc:
        print(
            f"qlab: no usable tokenizer for {name!r} ({type(exc).__name__}: {exc}); "
            "using the byte-level tokenizer (one token per UTF-8 byte)",
            file=sys.stderr,
        )
        return ByteTokenizer()


def load(spec: GPT2Spec):
    """(model on its device in eval mode, tokenizer, device)."""
    device = resolve_device(spec.device)
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    net = (
        _random_model(spec.model, spec.seed)
        if spec.model in RANDOM_MODELS
        else _pretrained(spec.model)
    )
    return net.to(device).eval(), _tokenizer_for(spec.model), device


class GPT2Engine:
    """One engine; several engines may share one loaded model (see :func:`make_engines`)."""

    abilities = Abilities(cancel=True, emit=True, asked=True)

    def __init__(self, spec: GPT2Spec = GPT2Spec(), loaded=None) -> None:
        self.spec = spec
        self.net, self.tokenizer, self.device = loaded if loaded is not None else load(spec)
        config = self.net.config
        self.context = int(
            getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", 1024)
        )
        # At least one prompt token must fit beside the new ones.
        self.max_new_tokens_limit = self.context - 1
        bos = getattr(config, "bos_token_id", None)
        self._bos = int(bos) if bos is not None else 0
        self._parameters = sum(p.numel() for p in self.net.parameters())

    # -- the Engine protocol ------------------------------------------------

    def run(
        self,
        prompt: str,
        max_new_tokens: int,
        stop: Sequence[str] | None = None,
        cancel: threading.Event | None = None,
        emit: Emit | None = None,
        asked: Asked = Asked(),
    ) -> EngineResult:
        start = time.perf_counter()
        ids = self.prompt_ids(prompt, max_new_tokens)
        new_ids, text, stopped = self._generate(
            ids, max_new_tokens, tuple(stop or ()), cancel, emit, asked.min_tokens
        )
        # tokens: what it generated (fewer than asked where a stop string or the Cancel ended it),
        # which a learning estimator learns from; the stop string's own tokens are work done, so
        # they count.
        return EngineResult(text, len(new_ids), time.perf_counter() - start, stopped=stopped)

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count(text)

    def warmup(self, rounds: int = 3) -> None:
        """A few short generations: first calls pay for allocation and kernel selection."""
        for _ in range(rounds):
            self.run("Warm-up prompt for the engine.", 8)
        if self.device == "cuda":
            torch.cuda.synchronize()

    def info(self) -> dict:
        config = self.net.config
        return {
            "engine": "gpt2",
            "model": self.spec.model,
            "device": self.device,
            "tokenizer": self.tokenizer.name,
            "n_layer": getattr(config, "n_layer", None),
            "n_embd": getattr(config, "n_embd", None),
            "context": self.context,
            "parameters": self._parameters,
        }

    # -- decoding -------------------------------------------------------------

    def check_max_new_tokens(self, max_new_tokens: int) -> None:
        if not 1 <= max_new_tokens <= self.max_new_tokens_limit:
            raise ValueError(
                f"max_new_tokens must be 1..{self.max_new_tokens_limit}, got {max_new_tokens}"
            )

    def prompt_ids(self, prompt: str, max_new_tokens: int) -> list[int]:
        """The prompt's token ids as a run decodes from them (also the batched engine's,
        :mod:`live.gpt2_batch`)."""
        self.check_max_new_tokens(max_new_tokens)
        # Keep the end of a long prompt: it is what the continuation follows.
        ids = self.tokenizer.encode(prompt)[-(self.context - max_new_tokens) :]
        return ids or [self._bos]

    def greedy_ids(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """The token ids a run decodes after these prompt ids, with no stop string: what a batched
        engine (:mod:`live.gpt2_batch`) must decode for the same sequence."""
        return self._generate(ids, max_new_tokens, ())[0]

    @torch.inference_mode()
    def _generate(
        self,
        ids: list[int],
        max_new_tokens: int,
        stop: tuple[str, ...],
        cancel: threading.Event | None = None,
        emit: Emit | None = None,
        min_tokens: int = 0,
    ) -> tuple[list[int], str, bool]:
        """The new token ids, their text (cut before a stop string that ends past the first
        ``min_tokens`` tokens' text) and whether the Cancel stopped it; ``emit`` gets the text as it
        grows, step by step (live.engine.PieceFeed)."""
        x = torch.tensor([ids], device=self.device)
        cache = None
        steps: list[torch.Tensor] = []
        new_ids: list[int] = []
        longest = max((len(s) for s in stop), default=0)
        seen = 0  # characters already searched for a stop string
        floor = 0  # characters of the first min_tokens tokens
        stopped = False
        feed = None if emit is None else PieceFeed(emit, longest)
        for _ in range(max_new_tokens):
            # the client left, or its deadline passed: work for nobody
            if cancel is not None and cancel.is_set():
                stopped = True
                break
            # transformers 5's keywords (pyproject requires it), as live.gpt2_batch passes them: the
            # KV cache, and the vocabulary projection for the last position only.
            out = self.net(input_ids=x, use_cache=True, cache=cache, logits_to_keep=1)
            cache = out.cache
            x = out.logits[:, -1:].argmax(-1)  # greedy; shape (1, 1), stays on the device
            if not stop and feed is None:
                steps.append(x)  # no reason to wait for the device each token
                continue
            new_ids.append(int(x))  # a stop check, or a stream, needs the token on the host
            text = self.tokenizer.decode(new_ids)
            if len(new_ids) == min_tokens:
                floor = len(text)  # a stop string must end past the first min_tokens tokens' text
            # Only the tail can hold a new match; a few extra characters cover
            # a multi-byte character that completed this step.
            cut = (
                None
                if len(new_ids) < min_tokens
                else apply_stop(text, stop, max(0, seen - longest - 4), floor)
            )
            if cut is not None:
                if feed is not None:
                    feed.grow(cut, final=True)
                return new_ids, cut, False
            if feed is not None:
                feed.grow(text)
            seen = len(text)
        if steps:
            new_ids = torch.cat(steps, dim=1)[0].tolist()
        text = self.tokenizer.decode(new_ids)
        if feed is not None:
            feed.grow(text, final=True)
        return new_ids, text, stopped


def make_engines(k: int, spec: GPT2Spec) -> list[GPT2Engine]:
    """K engines sharing one copy of the weights (inference only reads them, so threads may
    share)."""
    if k < 1:
        raise ValueError(f"engines must be >= 1, got {k}")
    loaded = load(spec)
    return [GPT2Engine(spec, loaded) for _ in range(k)]
