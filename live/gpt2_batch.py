"""The batched GPT-2 engine: each step one batched forward pass over the sequences decoding, with
the KV cache, and a pass of its own for each prefill chunk.

:class:`BatchedGPT2` is driven step by step, as :class:`qsim.batch.BatchQueue` plans steps:
sequences join (:meth:`~BatchedGPT2.add`) and leave (:meth:`~BatchedGPT2.remove`,
:meth:`~BatchedGPT2.preempt`) between steps; each :meth:`~BatchedGPT2.step` runs the sequences its
plan names, each feeding the number of tokens the plan gives it (a chunk of its prompt, or the one
token it sampled last), and returns the token each sequence sampled and the step's measured seconds.

The interface, for a driver such as the gate::

    engine = BatchedGPT2(GPT2Spec("tiny"))
    ids = engine.encode("Once upon a time", max_new_tokens=32)   # the prompt's token ids (its tail
    if long) engine.add("r1", ids, 32, stop=("\\n\\n",), min_tokens=0)     # joins at the next step
    boundary engine.remaining("r1")                                        # tokens it may feed now:
    len(ids) done = engine.step({"r1": 5})         # a prefill chunk of 5 prompt tokens: no token
                                                   sampled yet
    done = engine.step({"r1": engine.remaining("r1")})   # the rest of the prompt: its first token
    done.seconds, done.outputs["r1"].token, done.outputs["r1"].finished
    done = engine.step({"r1": 1})         # decode: the token sampled last goes in, the next comes
                                          out
    engine.step()                         # no plan: every sequence feeds all it has (what a bench
                                          does)
    engine.preempt("r1")                  # frees its KV; later it recomputes prompt + generated
                                          (vLLM's recompute)
    engine.remove("r1")                   # cancelled or answered: forgets it, frees its KV

From a :class:`qsim.batch.Step` the plan is ``{req: chunk for req, chunk in step.chunks} | {req: 1
for req in step.decoding}`` (a prompt token count there must be this engine's:
:meth:`~BatchedGPT2.count_tokens`); the driver then calls ``BatchQueue.step_done(now,
elapsed_s=result.seconds)``. :class:`GPT2BatchEngine` does this for the batching gate
(:mod:`live.batching`, ``qlab serve --batching --engine gpt2``).

A sequence samples a token (greedy) in the step whose feed reaches the end of its tokens (its
prompt, at first; after a preemption its prompt and what it had generated). It finishes when it has
``max_new_tokens`` tokens or a stop string appears in its text past its first ``min_tokens`` tokens'
text (the text is then cut before it), as :class:`live.gpt2.GPT2Engine` decides; a finished sequence
leaves the batch and its KV is freed at once, its :class:`Produced` carries the final text. A step
that raises (out of memory) leaves its sequences without KV, to compute their tokens again in the
steps that name them (:meth:`~BatchedGPT2.remaining` says how many), as after a preemption. Every
method is called from one thread (the engine's), between steps: the engine holds no lock.

How a step is computed. The sequences feeding one token (decoding, or the last token of a prompt)
run as one batched forward pass: row ``i`` holds its cached tokens left-padded to the longest row's,
then its new token; a 2-D attention mask hides the padding and per-row position ids continue each
sequence's own positions (GPT-2's are learned and absolute, added to the input), so a row computes
what the sequence computes alone. While those rows stay the same (the steady state) the pass appends
to the batched :class:`transformers.DynamicCache` in place; when they change (one joins, leaves) the
cache is rebuilt from each row's unpadded KV, a copy of the batch's context, once per change. Each
prefill chunk (more than one token) runs as a pass of its own on its sequence's unpadded KV, as vLLM
packs prefills beside decodes without padding one to the other: padding every row to a chunk's
length made a step mixing a chunk of ~390 tokens with 7 decoding rows cost 8 chunks (468 ms against
52 ms for 8 decoding rows and 26 ms for the chunk alone, GPT-2 tiny on CPU), a cost the step model
(prefill tokens, sequences, context) could not express. A step thus costs one pass over its decoding
rows plus one pass per chunk.

Transformers' own continuous batching (``init_continuous_batching`` / ``generate_batch``) is not
used: it runs its own scheduler and paged cache in a background thread, so a step cannot be planned
from outside or timed alone (its step, ``ContinuousBatchProcessor._generation_step``, is private).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

import torch
from transformers import DynamicCache

from .engine import PieceFeed, apply_stop
from .gpt2 import GPT2Engine, GPT2Spec, load


@dataclass(frozen=True)
class Produced:
    """What one sequence got from a step that sampled for it.

    token: the token sampled; generated: how many it has now; finished: it ended in this step
    (``reason`` ``"length"``: ``max_new_tokens`` reached, ``"stop"``: a stop string), and then
    ``text`` is its answer (cut before the stop string), else None."""

    token: int
    generated: int
    finished: bool
    reason: str | None = None
    text: str | None = None


@dataclass(frozen=True)
class StepResult:
    """One step: the seconds it took (the forward passes, the batch's rebuild if any, the sampled
    tokens brought to the host), the tokens it computed, and the sequences that sampled (by id)."""

    seconds: float
    rows: int
    fed_tokens: int
    outputs: Mapping[Hashable, Produced] = field(default_factory=dict)


class _Seq:
    """One sequence: its tokens (prompt, then generated), how many have their KV computed, and
    where the KV is."""

    __slots__ = ("tokens", "prompt_len", "max_new", "stop", "min_tokens", "computed", "kv", "floor")

    def __init__(
        self, ids: list[int], max_new: int, stop: tuple[str, ...], min_tokens: int
    ) -> None:
        self.tokens = list(ids)
        self.prompt_len = len(ids)
        self.max_new, self.stop, self.min_tokens = max_new, stop, min_tokens
        self.computed = 0
        # unpadded (1, heads, computed, dim) per layer
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.floor = 0  # characters of the first min_tokens tokens' text

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class BatchedGPT2:
    """GPT-2 decoding a batch of sequences one step at a time (see the module docstring for the
    interface)."""

    def __init__(self, spec: GPT2Spec = GPT2Spec(), loaded=None) -> None:
        self.spec = spec
        loaded = loaded if loaded is not None else load(spec)
        self.net, self.tokenizer, self.device = loaded
        # The one-at-a-time engine on the same weights: its rules for prompts and limits are this
        # engine's too.
        self._one = GPT2Engine(spec, loaded)
        self.context = self._one.context
        self.max_new_tokens_limit = self._one.max_new_tokens_limit
        self._seqs: dict[Hashable, _Seq] = {}
        # The batched cache of the last step, kept while the next step runs the same rows, all
        # decoding.
        self._rows: list[Hashable] = []
        self._cache: DynamicCache | None = None
        # (rows, columns): 1 where a column holds a row's token
        self._mask: torch.Tensor | None = None

    # -- membership, between steps ---------------------------------------------------------

    def encode(self, prompt: str, max_new_tokens: int) -> list[int]:
        """The prompt's token ids, its tail where it would not fit the context beside
        ``max_new_tokens``."""
        return self._one.prompt_ids(prompt, max_new_tokens)

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count(text)

    def add(
        self,
        seq_id: Hashable,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
    ) -> None:
        """A sequence joins; it computes from the next step that names it."""
        self._one.check_max_new_tokens(max_new_tokens)
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the batch")
        if not prompt_ids:
            raise ValueError("a sequence needs at least one prompt token")
        if len(prompt_ids) + max_new_tokens > self.context:
            raise ValueError(
                f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new ones exceed "
                "the context "
                f"of {self.context}"
            )
        self._seqs[seq_id] = _Seq(
            [int(t) for t in prompt_ids], max_new_tokens, tuple(stop), min_tokens
        )

    def remove(self, seq_id: Hashable) -> None:
        """The sequence leaves (cancelled, cut, or its answer taken): its KV is freed. Unknown ids
        are ignored (a sequence that finished has already left)."""
        if self._seqs.pop(seq_id, None) is not None and seq_id in self._rows:
            self._forget_rows()  # the batched cache holds its row: the others' rows move out of it

    def preempt(self, seq_id: Hashable) -> None:
        """Free the sequence's KV but keep its tokens: it recomputes prompt and generated tokens
        (vLLM's recompute preemption) in the steps that name it again, then goes on decoding where
        it was."""
        seq = self._seqs[seq_id]
        self._forget_rows()
        seq.kv, seq.computed = None, 0

    def remaining(self, seq_id: Hashable) -> int:
        """Tokens the sequence may feed in the next step: what is left of its prompt (or of its
        recompute), or 1 when it decodes."""
        seq = self._seqs[seq_id]
        return len(seq.tokens) - seq.computed

    def computed(self, seq_id: Hashable) -> int:
        """Tokens of the sequence whose KV the engine holds."""
        return self._seqs[seq_id].computed

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def cached_tokens(self) -> int:
        """Tokens whose KV the engine holds, over all sequences (0 once every sequence has left)."""
        return sum(s.computed for s in self._seqs.values())

    # -- a step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, plan: Mapping[Hashable, int] | None = None) -> StepResult:
        """One step over the plan's sequences, each feeding as many of its tokens as the plan says
        (None: every sequence, all it has): the sequences feeding one token in one batched forward
        pass, each longer chunk in a pass of its own (see the module docstring). Sequences that
        finish leave."""
        start = time.perf_counter()
        plan = {k: self.remaining(k) for k in self._seqs} if plan is None else dict(plan)
        for seq_id, n in plan.items():
            if seq_id not in self._seqs:
                raise KeyError(f"sequence {seq_id!r} is not in the batch")
            if not 1 <= n <= self.remaining(seq_id):
                raise ValueError(
                    f"sequence {seq_id!r} may feed 1..{self.remaining(seq_id)} tokens, planned {n}"
                )
        if not plan:
            return StepResult(0.0, 0, 0)
        single = [k for k, n in plan.items() if n == 1]
        chunks = [k for k, n in plan.items() if n > 1]
        if any(k in self._rows for k in chunks):
            self._unbatch()  # a chunk runs on its sequence's own KV
        try:
            sampled = self._batched(single) if single else {}
            for seq_id in chunks:
                sampled[seq_id] = self._chunk(self._seqs[seq_id], plan[seq_id])
            # The sampled tokens are on the host: the step is over on the device too.
        except BaseException:
            # The batched cache may be half updated (out of memory in a layer): the step's sequences
            # lose their KV and compute it again in the steps that name them, as after a preemption.
            # Nothing is silently wrong.
            if single:
                self._rows, self._cache, self._mask = [], None, None
            for seq_id in plan:
                self._seqs[seq_id].kv, self._seqs[seq_id].computed = None, 0
            raise
        outputs = {}
        for seq_id, n in plan.items():
            seq = self._seqs[seq_id]
            seq.computed += n
            # its feed reached its last token: what comes next is sampled
            if seq.computed == len(seq.tokens):
                outputs[seq_id] = self._sampled(seq_id, seq, sampled[seq_id])
        return StepResult(time.perf_counter() - start, len(plan), sum(plan.values()), outputs)

    def _batched(self, rows: list[Hashable]) -> dict[Hashable, int]:
        """One forward pass over ``rows``, each feeding its next token, on the batched cache (kept
        from the last step where its rows are these); the token each row's logits pick."""
        cache, mask = (self._cache, self._mask) if rows == self._rows else self._rebuild(rows)
        seqs = [self._seqs[k] for k in rows]
        ids = torch.tensor([[s.tokens[s.computed]] for s in seqs], device=self.device)
        pos = torch.tensor([[s.computed] for s in seqs], device=self.device)
        mask = torch.cat(
            [mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=self.device)], dim=1
        )
        out = self.net(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._rows, self._cache, self._mask = rows, out.cache, mask
        return dict(zip(rows, out.logits[:, -1].argmax(-1).tolist()))

    def _chunk(self, seq: _Seq, n: int) -> int:
        """A forward pass of one sequence's next ``n`` tokens on its own unpadded KV (which it
        keeps); the token its last one's logits pick."""
        config = self.net.config
        cache = (
            DynamicCache(ddp_cache_data=seq.kv, config=config)
            if seq.kv is not None
            else DynamicCache(config=config)
        )
        ids = torch.tensor([seq.tokens[seq.computed : seq.computed + n]], device=self.device)
        pos = torch.arange(seq.computed, seq.computed + n, device=self.device).unsqueeze(0)
        out = self.net(
            input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1
        )
        seq.kv = [(layer.keys, layer.values) for layer in out.cache.layers]
        return int(out.logits[0, -1].argmax())

    def _sampled(self, seq_id: Hashable, seq: _Seq, token: int) -> Produced:
        seq.tokens.append(token)
        new = seq.generated
        reason, text = None, None
        if seq.stop:
            decoded = self.tokenizer.decode(new)
            if len(new) == seq.min_tokens:
                seq.floor = len(decoded)
            cut = None if len(new) < seq.min_tokens else apply_stop(decoded, seq.stop, 0, seq.floor)
            if cut is not None:
                reason, text = "stop", cut
        if reason is None and len(new) >= seq.max_new:
            reason, text = "length", self.tokenizer.decode(new)
        if reason is not None:
            self.remove(seq_id)
        return Produced(token, len(new), reason is not None, reason, text)

    def _rebuild(self, rows: list[Hashable]) -> tuple[DynamicCache, torch.Tensor]:
        """The batched cache for ``rows``: each row's unpadded KV (taken from the last step's batch
        where it was there), left-padded to the longest."""
        self._unbatch()
        seqs = [self._seqs[k] for k in rows]
        longest = max(s.computed for s in seqs)
        mask = torch.zeros((len(rows), longest), dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            mask[i, longest - s.computed :] = 1
        if longest == 0:
            return DynamicCache(config=self.net.config), mask
        layers = []
        for layer in range(self.net.config.n_layer):
            k_rows, v_rows = [], []
            for s in seqs:
                k, v = s.kv[layer] if s.kv is not None else (None, None)
                k_rows.append(self._left_pad(k, longest))
                v_rows.append(self._left_pad(v, longest))
            layers.append((torch.cat(k_rows), torch.cat(v_rows)))
        for s in seqs:
            s.kv = None  # the batch holds it now
        return DynamicCache(ddp_cache_data=layers, config=self.net.config), mask

    def _unbatch(self) -> None:
        """Move each live row of the last step's batch into its sequence's own unpadded KV."""
        if self._cache is None:
            return
        for i, seq_id in enumerate(self._rows):
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue  # it left: its KV goes with the batch
            keep = self._mask[i].nonzero().squeeze(1)
            seq.kv = [
                (layer.keys[i : i + 1, :, keep], layer.values[i : i + 1, :, keep])
                for layer in self._cache.layers
            ]
        self._forget_rows(unbatch=False)

    def _forget_rows(self, unbatch: bool = True) -> None:
        if unbatch and self._cache is not None:
            self._unbatch()
            return
        self._rows, self._cache, self._mask = [], None, None

    def _left_pad(self, t: torch.Tensor | None, length: int) -> torch.Tensor:
        """A row's (1, heads, n, dim) keys or values (None: n = 0) with zeros before them up to
        ``length``."""
        if t is not None and t.shape[2] == length:
            return t
        config = self.net.config
        padded = torch.zeros(
            (1, config.n_head, length, config.n_embd // config.n_head),
            dtype=self.net.dtype,
            device=self.device,
        )
        if t is not None and t.shape[2]:
            padded[:, :, length - t.shape[2] :] = t
        return padded

    def warmup(self, rounds: int = 2) -> None:
        """A few short batched generations: first calls pay for allocation and kernel selection."""
        if self._seqs:
            raise RuntimeError("warm up before any sequence joins")
        for r in range(rounds):
            for i in range(2):
                self.add(
                    ("warmup", r, i), self.encode("Warm-up prompt for the engine." * (i + 1), 8), 8
                )
            while self._seqs:
                self.step()
        if self.device == "cuda":
            torch.cuda.synchronize()

    def info(self) -> dict:
        return {**self._one.info(), "engine": "gpt2-batch"}


class GPT2BatchEngine:
    """:class:`BatchedGPT2` behind the batching gate's engine protocol
    (:class:`live.batching.BatchEngine`):
    :func:`live.gate.BatchGate` hands it each step the queue core planned (a
    :class:`live.batching.StepWork`) from one engine thread, and it runs the step
    (:meth:`BatchedGPT2.step`).

    The queue core decides the work, as it does for the synthetic batching engine: every request
    runs to its ``max_new_tokens`` (a stop string cuts the text, not the work; its text must end
    past the first ``min_tokens`` tokens' text), so the engine adds its sequences without stop
    strings and the core and the engine end each request in the same step. A chunk that starts at 0
    for a sequence the engine holds KV of is a preemption (recompute): its KV is freed and it
    computes its prompt and generated tokens again. A request whose prompt, tokenized here, is not
    the ``prompt_tokens`` the core plans with, or does not fit the context beside its
    ``max_new_tokens``, fails (``StepDone.failed``) before any work. Streamed requests get each
    token's text as its step ends (held back while a stop string may be starting)."""

    def __init__(self, spec: GPT2Spec = GPT2Spec(), loaded=None) -> None:
        self.batch = BatchedGPT2(spec, loaded)
        self.max_new_tokens_limit = self.batch.max_new_tokens_limit
        # key -> the token ids it generated, until its text is taken or it ends
        self._ids: dict = {}
        self._feeds: dict = {}  # key -> (job, PieceFeed, the pieces of this step), for the streamed

    def step(self, work):
        # the gate's module (imports the gate); needed only when a gate drives this
        from .batching import StepDone

        batch = self.batch
        for key in work.ended:
            batch.remove(key)
            self._ids.pop(key, None)
            self._feeds.pop(key, None)
        plan, failed = {}, {}
        for chunk in work.prefill:
            key, job = chunk.key, chunk.job
            if key not in batch:
                try:
                    self._join(key, job)
                except ValueError as exc:
                    failed[key] = exc
                    continue
            elif chunk.start == 0 and batch.computed(key):
                batch.preempt(key)  # the core recomputes it from its first token: its KV is gone
            plan[key] = chunk.tokens
        plan.update(dict.fromkeys(work.decode, 1))
        result = batch.step(plan)
        pieces = {}
        for key, out in result.outputs.items():
            self._ids[key].append(out.token)
            if key in self._feeds:
                piece = self._stream(key, out.finished)
                if piece:
                    pieces[key] = piece
        return StepDone(result.seconds, failed, pieces)

    def _join(self, key, job) -> None:
        ids = self.batch.tokenizer.encode(job.prompt) or self.batch.encode(
            job.prompt, job.max_new_tokens
        )
        if len(ids) != job.prompt_tokens:
            raise ValueError(
                f"the prompt is {len(ids)} tokens here, the gate planned {job.prompt_tokens}"
            )
        # no stop strings: the core runs it to its limit
        self.batch.add(key, ids, job.max_new_tokens)
        self._ids[key] = []
        if job.stream:
            sink: list[str] = []
            self._feeds[key] = (
                job,
                PieceFeed(sink.append, max((len(s) for s in job.stop), default=0)),
                sink,
            )

    def _stream(self, key, finished: bool) -> str:
        job, feed, sink = self._feeds[key]
        text, cut = self._text(job, self._ids[key])
        feed.grow(text, final=finished or cut)
        if cut:
            del self._feeds[key]  # the text is over; the work goes on to the limit
        piece = "".join(sink)
        sink.clear()
        return piece

    def _text(self, job, ids: list[int]) -> tuple[str, bool]:
        """The text of these generated ids, cut before a stop string ending past the first
        min_tokens tokens' text; and whether it was cut."""
        decode = self.batch.tokenizer.decode
        text = decode(ids)
        floor = len(decode(ids[: job.asked.min_tokens])) if job.asked.min_tokens else 0
        cut = apply_stop(text, job.stop, 0, floor)
        return (text, False) if cut is None else (cut, True)

    def text(self, key, job, tokens: int) -> str:
        """The answer of a request that ended (called on the gate's loop, between steps)."""
        ids = self._ids.pop(key, [])
        self._feeds.pop(key, None)
        return self._text(job, ids[:tokens])[0]

    def count_tokens(self, text: str) -> int:
        return self.batch.count_tokens(text)

    def warmup(self) -> None:
        self.batch.warmup()

    def info(self) -> dict:
        return {**self.batch.info(), "batching": True}
