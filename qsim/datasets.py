"""Prompt datasets: ShareGPT-style conversations (what vLLM's ``bench serve --dataset-name
sharegpt`` and guidellm take) read into requests of a prompt text and an output length.

Formats (one file, JSON or JSONL, each entry either kind):

* ShareGPT: ``{"id": ..., "conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}, ...]}``. The prompt is the first human turn, the output length the
  token count of the first gpt turn after it ("user" and "assistant" are read as the same roles).
* plain: ``{"prompt": ..., "output_tokens": N}`` or ``{"prompt": ..., "completion": ...}`` (the
  completion's token count).

A JSON file is one list of entries; anything else is read as JSONL, one entry a line (blank lines
skipped). Filtering follows vLLM's benchmark (``is_valid_sequence``): an entry is kept when its
prompt and its output are each at least 4 tokens, its prompt at most 1024 and the two together at
most 2048; a conversation with fewer than 2 turns (or no human turn with a gpt turn after it) is
skipped first.

Token counts (qsim imports no tokenizer, so a count is a stated rule, :data:`COUNTS`):

* ``pieces`` (the default): the pieces GPT-2's pre-tokenizer splits text into (its regex, with
  Python's classes for letters and digits). A BPE tokenizer gives each piece at least one token and
  common English words exactly one, so this is close to GPT-2's count for plain English and low for
  rare words, long numbers and non-Latin text.
* ``bytes``: UTF-8 bytes, exactly what qlab's byte tokenizer counts (:mod:`live.tokenizer`: the
  synthetic engine, and GPT-2 without its vocabulary files, ``--model tiny`` and ``random``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: GPT-2's pre-tokenizer pattern, with \p{L} as [^\W\d_] and \p{N} as \d (Python's re has no \p).
_PIECES = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")
COUNTS = ("pieces", "bytes")
HUMAN, GPT = ("human", "user"), ("gpt", "assistant", "chatgpt", "bing", "bard")


def count_tokens(text: str, rule: str = "pieces") -> int:
    """Tokens in ``text`` under a rule of :data:`COUNTS`."""
    if rule == "bytes":
        return len(text.encode("utf-8"))
    if rule == "pieces":
        return len(_PIECES.findall(text))
    raise ValueError(f"unknown token count {rule!r}; choose one of {', '.join(COUNTS)}")


@dataclass(frozen=True)
class Limits:
    """vLLM's benchmark filter (``is_valid_sequence``), in tokens."""

    min_tokens: int = 4
    max_prompt_tokens: int = 1024
    max_total_tokens: int = 2048

    def why_not(self, prompt: int, output: int) -> str | None:
        """Why a request of these lengths is dropped (None: it is kept)."""
        if prompt < self.min_tokens:
            return f"prompt under {self.min_tokens} tokens"
        if output < self.min_tokens:
            return f"output under {self.min_tokens} tokens"
        if prompt > self.max_prompt_tokens:
            return f"prompt over {self.max_prompt_tokens} tokens"
        if prompt + output > self.max_total_tokens:
            return f"prompt and output over {self.max_total_tokens} tokens"
        return None


@dataclass(frozen=True)
class DatasetRequest:
    """One usable entry: its id (the entry's, else its place in the file), prompt and lengths."""

    id: str
    prompt: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Dataset:
    """The usable requests of a file, in file order, and how many entries each rule dropped."""

    path: str
    requests: tuple[DatasetRequest, ...]
    counting: str
    entries: int
    dropped: tuple[tuple[str, int], ...] = ()

    @property
    def prompt_tokens(self) -> np.ndarray:
        return np.array([r.prompt_tokens for r in self.requests], dtype=np.int64)

    @property
    def output_tokens(self) -> np.ndarray:
        return np.array([r.output_tokens for r in self.requests], dtype=np.int64)

    def sample(self, n: int, seed: int | np.random.Generator) -> np.ndarray:
        """Indices of ``n`` requests, seeded: a shuffle of the usable requests, its first n (no
        repeats) as vLLM's benchmark takes them; where n is more than there are, all of them
        shuffled and then the rest drawn uniformly with replacement (vLLM's oversampling)."""
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(self.requests))
        if n <= len(order):
            return order[:n]
        return np.concatenate([order, rng.integers(0, len(order), n - len(order))])

    def describe(self) -> str:
        """The file, its counts and its means, in a line."""
        p, o, n = self.prompt_tokens, self.output_tokens, len(self.requests)
        dropped = ", ".join(f"{k} {why}" for why, k in self.dropped)
        return (
            f"dataset {self.path}: {n} of {self.entries} entries usable"
            f"{f' (dropped: {dropped})' if dropped else ''}; prompt {p.mean():.1f} and output "
            f"{o.mean():.1f} tokens on average ({self.counting}); rows taken in a seeded "
            f"shuffle, drawn with replacement after the first {n} requests"
        )

    def summary(self) -> dict:
        """What a run's JSON says of the dataset."""
        return {
            "path": self.path,
            "tokens": self.counting,
            "entries": self.entries,
            "usable": len(self.requests),
            "dropped": dict(self.dropped),
            "mean_prompt_tokens": float(self.prompt_tokens.mean()),
            "mean_output_tokens": float(self.output_tokens.mean()),
        }


def read_dataset(path: str | Path, counting: str = "pieces", limits: Limits = Limits()) -> Dataset:
    """The usable requests of a dataset file. ValueError, in a line naming the file (and the line of
    a JSONL file), for a missing or unreadable file, bad JSON, and a file with nothing usable."""
    count_tokens("", counting)  # an unknown rule is refused before the file is read
    entries = _entries(Path(path))
    kept, dropped = [], {}
    for place, entry in entries:
        request, why = _request(entry, place, counting, limits)
        if request is None:
            dropped[why] = dropped.get(why, 0) + 1
        else:
            kept.append(request)
    if not kept:
        reasons = "; ".join(f"{n} {why}" for why, n in dropped.items()) or "the file is empty"
        raise ValueError(f"{path}: no usable conversations in {len(entries)} entries ({reasons})")
    return Dataset(str(path), tuple(kept), counting, len(entries), tuple(dropped.items()))


def _entries(path: Path) -> list[tuple[str, object]]:
    """(place, entry) of every entry: place is the list index of a JSON file, the line of JSONL."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such dataset file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the dataset: {exc}") from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: bad JSON at line {exc.lineno}: {exc.msg}") from None
        return [(str(i), entry) for i, entry in enumerate(data)]
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}: bad JSON on line {number}: {exc.msg} "
                    "(JSONL: one entry a line; JSON: one list)"
                ) from None
    return out


def _request(entry, place: str, counting: str, limits: Limits):
    """(the request, None) of a usable entry, else (None, why it is dropped)."""
    if not isinstance(entry, dict):
        return None, "not an object"
    if "conversations" in entry:
        pair = _first_exchange(entry["conversations"])
        if isinstance(pair, str):
            return None, pair
        prompt, answer = pair
        output = count_tokens(answer, counting)
    elif isinstance(entry.get("prompt"), str):
        prompt, output = entry["prompt"], _plain_output(entry, counting)
        if output is None:
            return None, "no output_tokens or completion"
    else:
        return None, "neither conversations nor a prompt"
    tokens = count_tokens(prompt, counting)
    why = limits.why_not(tokens, output)
    if why is not None:
        return None, why
    return DatasetRequest(str(entry.get("id", place)), prompt, tokens, output), None


def _first_exchange(turns) -> tuple[str, str] | str:
    """(first human turn, first gpt turn after it), or why the conversation has none."""
    if not isinstance(turns, list) or len(turns) < 2:
        return "fewer than 2 turns"
    texts = [(t.get("from"), t.get("value")) for t in turns if isinstance(t, dict)]
    for i, (role, value) in enumerate(texts):
        if role in HUMAN and isinstance(value, str):
            answer = next((v for r, v in texts[i + 1 :] if r in GPT and isinstance(v, str)), None)
            return "no gpt turn after the human one" if answer is None else (value, answer)
    return "no human turn"


def _plain_output(entry: dict, counting: str) -> int | None:
    """A plain entry's output length: output_tokens as given, else the completion's count."""
    given = entry.get("output_tokens")
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    completion = entry.get("completion")
    return count_tokens(completion, counting) if isinstance(completion, str) else None
