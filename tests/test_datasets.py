"""Prompt datasets (qsim.datasets): ShareGPT JSON and JSONL, plain JSONL, vLLM's filter, seeded
rows, and ``qlab simulate --dataset`` / ``qlab replay --dataset`` describing the same requests.

The fixture (tests/data/datasets/) is text written for these tests: 30 one-exchange conversations,
one of four turns, and one entry for each rule that drops one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments.cli import main
from qsim import make_trace
from qsim.datasets import Limits, count_tokens, read_dataset
from qsim.workload import dataset_rows, trace_chunks

DATA = Path(__file__).parent / "data" / "datasets"
CHAT, CHAT_L, PLAIN = (str(DATA / name) for name in ("chat.json", "chat.jsonl", "plain.jsonl"))
DROPPED = {
    "fewer than 2 turns": 1,
    "prompt under 4 tokens": 1,
    "output under 4 tokens": 1,
    "prompt over 1024 tokens": 1,
    "prompt and output over 2048 tokens": 1,
    "no human turn": 1,
}


def _error(capsys, argv) -> str:
    """The one stderr line of a refused command (exit 2)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


# ------------------------------------------------------------------ reading and filtering


def test_each_of_vllms_rules_drops_its_entry_and_keeps_the_rest():
    data = read_dataset(CHAT)
    assert (data.entries, len(data.requests)) == (37, 31) and dict(data.dropped) == DROPPED
    ids = {r.id for r in data.requests}
    assert not ids & {
        "one-turn",
        "short-prompt",
        "short-output",
        "long-prompt",
        "too-long-together",
        "gpt-first",
    }
    multi = next(r for r in data.requests if r.id == "multi")  # only its first exchange counts
    answer = "A line of requests waiting their turn for an engine to become free."
    assert multi.prompt == "What is a queue in plain words?"
    assert (multi.prompt_tokens, multi.output_tokens) == (8, count_tokens(answer)) == (8, 14)


@pytest.mark.parametrize(
    "prompt, output, why",
    [
        (4, 4, None),
        (3, 100, "prompt under 4 tokens"),
        (100, 3, "output under 4 tokens"),
        (1024, 1024, None),
        (1025, 4, "prompt over 1024 tokens"),
        (1000, 1049, "prompt and output over 2048 tokens"),
    ],
)
def test_the_limits_are_vllms_at_their_edges(prompt, output, why):
    assert Limits().why_not(prompt, output) == why


def test_the_counting_rules_are_the_stated_ones():
    # GPT-2's pieces: words with their leading space, runs of digits and of punctuation, "'s".
    assert count_tokens("Hello, world! It's 2048.") == len(
        ["Hello", ",", " world", "!", " It", "'s", " 2048", "."]
    )
    assert count_tokens("naïve café", "bytes") == 12 and count_tokens("naïve café") == 2
    with pytest.raises(ValueError, match="unknown token count"):
        count_tokens("x", "words")


def test_json_and_jsonl_give_the_same_requests():
    assert read_dataset(CHAT).requests == read_dataset(CHAT_L).requests
    for rule in ("pieces", "bytes"):
        assert read_dataset(CHAT, rule).requests == read_dataset(CHAT_L, rule).requests


def test_plain_jsonl_takes_output_tokens_as_given_and_counts_a_completion():
    rows = [json.loads(line) for line in Path(PLAIN).read_text().splitlines()]
    data = read_dataset(PLAIN)
    assert len(data.requests) == 10
    for row, request in zip(rows, data.requests):
        expected = row.get("output_tokens") or count_tokens(row["completion"])
        assert (request.id, request.prompt, request.output_tokens) == (
            row["id"],
            row["prompt"],
            expected,
        )


# ------------------------------------------------------------------ seeded rows


def test_rows_are_seeded_without_repeats_then_with_replacement():
    data = read_dataset(CHAT)
    n = len(data.requests)
    assert (data.sample(20, 5) == data.sample(20, 5)).all()
    assert not (data.sample(20, 5) == data.sample(20, 6)).all()
    assert len(set(data.sample(n, 5).tolist())) == n  # up to its size: each row once
    more = data.sample(3 * n, 5)
    assert sorted(more[:n].tolist()) == list(range(n)) and set(more[n:].tolist()) <= set(range(n))
    assert (dataset_rows(data, 50, 3) == dataset_rows(data, 50, 3)).all()


def test_a_dataset_changes_the_lengths_and_leaves_the_arrivals_as_they_were():
    data = read_dataset(CHAT)
    plain, with_data = (
        make_trace(requests=200, seed=3),
        make_trace(requests=200, seed=3, dataset=data),
    )
    # The load counts the rows' mean estimate, so the rate differs; the gaps in units of the mean
    # gap are the same draws.
    assert with_data.meta["rate"] != plain.meta["rate"]
    assert np.allclose(
        with_data.arrival_s * with_data.meta["rate"], plain.arrival_s * plain.meta["rate"]
    )
    rows = dataset_rows(data, 200, 3)
    assert (with_data.max_new_tokens == data.output_tokens[rows]).all()
    assert (with_data.prompt_tokens == data.prompt_tokens[rows]).all()


def test_a_streamed_trace_takes_the_rows_the_whole_one_takes():
    data = read_dataset(CHAT)
    whole = make_trace(requests=250, seed=7, dataset=data)
    parts = list(trace_chunks(60, requests=250, seed=7, dataset=data))
    for column in ("arrival_s", "max_new_tokens", "prompt_tokens", "true_service_s"):
        assert (np.concatenate([getattr(p, column) for p in parts]) == getattr(whole, column)).all()


def test_the_same_seed_gives_the_same_run_and_json_and_jsonl_the_same_one(capsys):
    def run(path, seed):
        assert (
            main(
                ["simulate", "--dataset", path, "--requests", "300", "--seed", str(seed), "--json"]
            )
            == 0
        )
        out = json.loads(capsys.readouterr().out)
        return out["summary"], out["dataset"]["usable"]

    first = run(CHAT, 4)
    assert run(CHAT, 4) == first == run(CHAT_L, 4)
    assert run(CHAT, 5) != first


# ------------------------------------------------------------------ a simulated run's lengths


def test_a_simulated_run_has_the_datasets_mean_prompt_and_output_lengths(tmp_path):
    data = read_dataset(CHAT)
    # A prompt term in the model makes each request's estimate say its prompt length.
    model = tmp_path / "model.json"
    model.write_text(
        json.dumps({"intercept_s": 0.01, "per_token_s": 0.001, "per_prompt_token_s": 0.002})
    )
    out, n = tmp_path / "run.parquet", 3000
    assert (
        main(
            [
                "simulate",
                "--dataset",
                CHAT,
                "--requests",
                str(n),
                "--seed",
                "2",
                "--service-model",
                str(model),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = pd.read_parquet(out)
    output = rows["max_new_tokens"].to_numpy(dtype=float)
    prompt = (rows["est_service_s"] - 0.01 - 0.001 * output).to_numpy() / 0.002
    assert np.allclose(prompt, np.round(prompt), atol=1e-6)  # whole numbers: the rows' lengths
    for drawn, of_data in ((output, data.output_tokens), (prompt, data.prompt_tokens)):
        # The first 31 take every row once; the rest are uniform draws: 4 standard errors.
        assert abs(drawn.mean() - of_data.mean()) < 4 * of_data.std() / np.sqrt(n)
    assert set(np.round(prompt).astype(int)) <= set(data.prompt_tokens.tolist())


# ------------------------------------------------------------------ bad input


def test_a_missing_file_is_one_line(capsys):
    err = _error(capsys, ["simulate", "--dataset", "no/such.json", "--requests", "5"])
    assert "no/such.json: no such dataset file" in err


def test_bad_jsonl_names_its_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "What is a queue, briefly?", "output_tokens": 9})
    path.write_text(f'{good}\n\n{good}\n{{"prompt": "cut off\n')
    err = _error(capsys, ["simulate", "--dataset", str(path), "--requests", "5"])
    assert f"{path}: bad JSON on line 4" in err


def test_a_bad_json_list_names_its_line(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text('[\n {"prompt": "a b c d e", "output_tokens": 9},\n {"prompt": }\n]\n')
    assert f"{path}: bad JSON at line 3" in _error(
        capsys, ["simulate", "--dataset", str(path), "--requests", "5"]
    )


def test_nothing_usable_says_why_each_entry_was_dropped(tmp_path, capsys):
    path = tmp_path / "none.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(e)
            for e in [
                {"conversations": [{"from": "human", "value": "Just one turn here."}]},
                {"prompt": "Hi", "output_tokens": 50},
                [1, 2],
            ]
        )
        + "\n"
    )
    err = _error(capsys, ["simulate", "--dataset", str(path), "--requests", "5"])
    assert "no usable conversations in 3 entries" in err
    assert "1 fewer than 2 turns; 1 prompt under 4 tokens; 1 not an object" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompts", "fixed:8"], "drop --prompts"),
        (["--used", "study"], "drop the early stops"),
        (["--service", "exponential"], "needs --service mix"),
        (["--turns", "3"], "drop --system-prompt and --turns"),
        (["--dataset-tokens", "words"], "invalid choice"),
    ],
)
def test_what_a_dataset_cannot_stand_beside_is_refused(capsys, flags, message):
    assert message in _error(capsys, ["simulate", "--dataset", CHAT, "--requests", "5", *flags])


def test_a_trace_file_and_a_dataset_are_one_or_the_other(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    make_trace(requests=5, seed=1).save(trace)
    err = _error(capsys, ["simulate", "--trace", str(trace), "--dataset", CHAT])
    assert "give one or the other" in err


# ------------------------------------------------------------------ replay


@pytest.mark.slow  # a scripted server listens
def test_replay_sends_the_rows_texts_with_max_tokens_their_answers(tmp_path, capsys):
    pytest.importorskip("httpx")
    from test_replay_openai import bare_server

    data, n, seed = read_dataset(CHAT), 8, 4
    out = tmp_path / "run.parquet"
    with bare_server() as (url, seen):
        assert (
            main(
                [
                    "replay",
                    "--url",
                    url,
                    "--api",
                    "openai",
                    "--dataset",
                    CHAT,
                    "--arrivals",
                    f"burst:{n}",
                    "--seed",
                    str(seed),
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    assert "prompts: the texts of" in capsys.readouterr().out
    rows = [data.requests[i] for i in dataset_rows(data, n, seed)]  # what simulate takes too
    sent = sorted((req["prompt"], req["max_tokens"]) for req, _ in seen)
    assert sent == sorted((r.prompt, r.output_tokens) for r in rows)
    frame = pd.read_parquet(out).sort_values("request_id")
    assert frame["max_new_tokens"].tolist() == [r.output_tokens for r in rows]
    assert frame["prompt_tokens"].tolist() == [r.prompt_tokens for r in rows]
