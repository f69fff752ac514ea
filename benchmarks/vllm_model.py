"""Write a random-weight GPT-2 and a tokenizer trained here, for vLLM to serve with no model hub.

    python benchmarks/vllm_model.py DIR [--shape tiny|small] [--seed 0]

Run it with any Python that has torch, transformers and tokenizers (vLLM's own venv has them:
``live/vllm_server.py`` runs it there). Everything follows from the seed:

* the tokenizer: a byte-level BPE (the ``tokenizers`` library) trained on text generated from the
  seed, to exactly the model's vocabulary, saved as a ``PreTrainedTokenizerFast`` with a chat
  template (without one vLLM answers chats with 400) and no end-of-text token: a random model's
  first EOS would end answers at random, and the study wants each request's work to be its size,
  so every request generates exactly ``max_tokens``;
* the weights: ``GPT2LMHeadModel`` of the shape asked, initialised by torch from the seed.

Shapes: ``tiny`` (4 layers x 256, vocabulary 8,192: ~3 ms a token alone on this project's CPUs)
and ``small`` (GPT-2 small's 12 layers x 768 and 50,257 tokens, 124 M parameters).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    layers: int
    width: int
    heads: int
    vocab: int
    positions: int = 1024


SHAPES = {"tiny": Shape(4, 256, 4, 8192), "small": Shape(12, 768, 12, 50257)}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
#: vLLM formats a chat with this (a base model has none); the prompt ends where the answer begins.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def corpus(seed: int, vocab: int) -> list[str]:
    """Lines of made-up words, Zipf-like in frequency, with enough distinct words for ``vocab``
    merges: the tokenizer's training text."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 10))) for _ in range(vocab)]
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    lines = max(4000, vocab // 2)
    return [" ".join(rng.choices(words, weights, k=40)) for _ in range(lines)]


def write_tokenizer(directory: Path, seed: int, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed, vocab), trainer)
    # Too little text for the merges asked would leave the vocabulary short of the model's rows.
    if tokenizer.get_vocab_size() != vocab:
        raise SystemExit(
            f"vllm_model: the tokenizer has {tokenizer.get_vocab_size()} tokens, not {vocab}"
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def write_model(directory: Path, shape: Shape, seed: int) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=shape.vocab,
        n_positions=shape.positions,
        n_layer=shape.layers,
        n_head=shape.heads,
        n_embd=shape.width,
        bos_token_id=None,
        eos_token_id=None,
    )
    GPT2LMHeadModel(config).save_pretrained(directory)


def write(directory: Path, shape_name: str, seed: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[shape_name]
    write_tokenizer(directory, seed, shape.vocab)
    write_model(directory, shape, seed)
    (directory / "qlab_model.json").write_text(
        json.dumps({"shape": shape_name, "seed": seed}) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write(args.directory, args.shape, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
