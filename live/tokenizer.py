"""A self-contained byte-level tokenizer (no files, no downloads).

GPT-2's own tokenizer needs its vocabulary files, which cannot always be had
(no hub access). The engines then fall back to this: a prompt is its UTF-8
bytes, one token per byte (ids 0..255), and a generated id decodes as the byte
``id % 256``. With random weights the text means nothing anyway; what matters
for the study is that the engine does the same work per token as GPT-2 small.
Prompt token counts under this tokenizer are byte counts, so they run about
four times GPT-2's BPE counts for English text.
"""

from __future__ import annotations


class ByteTokenizer:
    """UTF-8 bytes <-> ids; invalid byte sequences decode as U+FFFD."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        # A vocabulary larger than 256 (GPT-2's 50257) folds onto bytes.
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def count(self, text: str) -> int:
        return len(text.encode("utf-8"))
