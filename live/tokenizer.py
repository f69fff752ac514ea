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

#: The smallest context a replay may assume (``--context-tokens``, a live file's
#: ``context_tokens``): a prompt token and a new one.
MIN_CONTEXT_TOKENS = 2


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


#: Words of the synthetic prompts: common lowercase words, each one GPT-2 token (with its leading
#: space).
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak "
    "tree near the quiet river bank"
).split()


def words_prompt(words: int) -> str:
    """``words`` of :data:`WORDS` (at least one) in a fixed order: about that many tokens of a
    BPE vocabulary."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(max(1, words)))


def prompt_of(tokens: int, tokenizer: str | None) -> str:
    """A deterministic prompt of ``tokens`` tokens (at least one) under the server's tokenizer, by
    its name.

    The byte tokenizer (``bytes``, what the synthetic engine, GPT-2 with random weights and the
    upstream engine's gate count with) gets exactly that many ASCII bytes; any other (GPT-2's own
    BPE, or None: a server that does not say) gets that many words of one GPT-2 token each, exact
    for GPT-2 and close for other BPE vocabularies.
    """
    tokens = max(1, int(tokens))
    if tokenizer == ByteTokenizer.name:
        # n words are longer than n bytes; every character is ASCII, so characters are bytes.
        return words_prompt(tokens)[:tokens]
    return words_prompt(tokens)


def max_tokens_within(chars: int, tokenizer: str | None) -> int:
    """The longest :func:`prompt_of` (in tokens) whose text has at most ``chars`` characters (a
    server's cap)."""
    if tokenizer == ByteTokenizer.name:
        return chars
    lengths = [len(w) + 1 for w in WORDS]  # each word and the space before the next
    cycle = sum(lengths)
    whole, left = divmod(chars + 1, cycle)  # +1: the last word has no space after it
    n = whole * len(WORDS)
    for length in lengths:
        if left < length:
            break
        left -= length
        n += 1
    return n
