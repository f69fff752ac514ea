"""Write a Hugging Face tokenizer directory whose tokens are UTF-8 bytes, as qlab's own tokenizer
counts.

The benchmark clients (guidellm, inference-perf, aiperf) size their prompts and count their outputs
with a Hugging Face tokenizer, which they download by name; this machine reaches no hub. A
byte-level BPE with no merges (one token per byte, the ``tokenizers`` library's own byte alphabet)
needs no download and counts a prompt as ``qlab serve``'s synthetic engine does
(:class:`live.tokenizer.ByteTokenizer`), so a tool's prompt lengths are the gate's.

    python benchmarks/byte_tokenizer.py DIR      # in an environment with transformers (a tool's
                                                 venv)
"""

from __future__ import annotations

import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def write(directory: str) -> None:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    tokenizer = Tokenizer(
        models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[])
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(directory)
    check = PreTrainedTokenizerFast.from_pretrained(directory)
    text = "Hello, w\u00f6rld"
    if len(check.encode(text)) != len(text.encode()) or check.decode(check.encode(text)) != text:
        raise SystemExit(f"byte_tokenizer: {directory} does not count bytes")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python benchmarks/byte_tokenizer.py DIR")
    write(sys.argv[1])
