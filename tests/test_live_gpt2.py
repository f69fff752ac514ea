"""The GPT-2 engine on CPU: the tiny configuration with random weights (no download).

torch and transformers are imported by the ``gpt2`` fixture, not at collection: importing them takes
longer than running these tests, and a run that leaves them out (``-k``, ``-m``) need not pay for
it."""

import asyncio

import pytest

from live.engine import Asked, Engine
from live.gate import Gate, gate_config
from live.jobs import Job
from qsim import PRESETS

# Loading GPT-2 (torch and transformers: 7 s of CPU to import) is a heavy start, as a server's is.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpt2():
    """live.gpt2 (torch and transformers), or a skip where they are not installed."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import live.gpt2

    return live.gpt2


def tiny_spec():
    """The tiny configuration, random weights, on CPU with one thread (steady on a shared CI
    machine)."""
    from live.gpt2 import GPT2Spec

    return GPT2Spec("tiny", "cpu", seed=0, threads=1)


@pytest.fixture(scope="module")
def spec(gpt2):
    return tiny_spec()


@pytest.fixture(scope="module")
def engine(gpt2, spec):
    e = gpt2.GPT2Engine(spec)
    e.warmup(rounds=1)
    return e


def test_generates_exactly_max_new_tokens_greedily(engine):
    assert isinstance(engine, Engine)
    first = engine.run("The queue in front of the engine", 12)
    again = engine.run("The queue in front of the engine", 12)
    assert first.tokens == again.tokens == 12
    assert first.text == again.text  # greedy: the same prompt gives the same text
    assert first.engine_s > 0
    assert engine.info()["tokenizer"] == "bytes" and engine.info()["n_layer"] == 2


class _IdTokenizer:
    """Decodes each id as '<id>': random weights give unreadable bytes, this makes every token
    visible."""

    name = "ids"

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return "".join(f"<{int(i)}>" for i in ids)

    def count(self, text):
        return len(text.encode())


def test_min_tokens_holds_a_stop_string_off(engine, gpt2, spec):
    """vLLM's min_tokens: no stop string ends the answer before that many tokens; one ending
    after them does."""
    visible = gpt2.GPT2Engine(spec, loaded=(engine.net, _IdTokenizer(), "cpu"))
    full = visible.run("stop here", 24)
    ids = [int(part) for part in full.text.strip("<>").split("><")]
    stop = f"<{ids[2]}>"  # the third token's text
    assert visible.run("stop here", 24, [stop]).tokens == ids.index(ids[2]) + 1
    later = [i for i, t in enumerate(ids) if t == ids[2] and i >= 5]
    held = visible.run("stop here", 24, [stop], asked=Asked(min_tokens=5))
    # only a stop past the first 5 tokens counts
    assert held.tokens == (later[0] + 1 if later else 24)
    assert held.text == (
        full.text[: full.text.index(stop, len("".join(f"<{t}>" for t in ids[:5])) - len(stop) + 1)]
        if later
        else full.text
    )


def test_stop_string_ends_generation_early(engine, gpt2, spec):
    visible = gpt2.GPT2Engine(spec, loaded=(engine.net, _IdTokenizer(), "cpu"))
    full = visible.run("stop here", 24)
    ids = [int(part) for part in full.text.strip("<>").split("><")]
    assert len(ids) == 24
    stop = f"<{ids[2]}>"  # the third token: generation must end where it first appears
    cut = visible.run("stop here", 24, ["never appears", stop])
    assert cut.tokens == ids.index(ids[2]) + 1
    assert cut.text == full.text[: full.text.index(stop)] and stop not in cut.text
    # With the byte tokenizer too: a stop that is already in the text ends generation at once.
    first = engine.run("stop here", 24).text[:1]
    short = engine.run("stop here", 24, [first])
    assert short.tokens < 24 and short.text == ""


def test_long_and_empty_prompts_fit_the_context(engine):
    assert engine.run("x" * 3000, 4).tokens == 4  # truncated to context - max_new_tokens
    assert engine.run("", 3).tokens == 3  # starts from the begin-of-text token
    with pytest.raises(ValueError):
        engine.run("x", engine.max_new_tokens_limit + 1)


def test_same_seed_same_weights_and_local_path_loading(engine, gpt2, tmp_path):
    engine.net.save_pretrained(tmp_path)
    # A local directory without tokenizer files falls back to the byte tokenizer.
    loaded = gpt2.GPT2Engine(gpt2.GPT2Spec(str(tmp_path), "cpu", threads=1))
    assert loaded.info()["tokenizer"] == "bytes"
    assert loaded.run("same weights", 6).text == engine.run("same weights", 6).text


def test_missing_model_is_a_value_error(gpt2, tmp_path):
    with pytest.raises(ValueError, match="--model random"):
        gpt2.GPT2Engine(gpt2.GPT2Spec(str(tmp_path / "absent"), "cpu"))


def test_device_resolution(gpt2):
    import torch

    assert gpt2.resolve_device("cpu") == "cpu"
    assert gpt2.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError):
        gpt2.resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError):
            gpt2.resolve_device("cuda")


def test_two_engines_share_weights_behind_the_gate(gpt2, spec):
    engines = gpt2.make_engines(2, spec)
    assert engines[0].net is engines[1].net

    async def go():
        async with Gate(engines, gate_config(PRESETS["none"])) as gate:
            answers = await asyncio.gather(*(gate.submit(Job(f"prompt {i}", 4)) for i in range(3)))
            return answers, gate.stats()

    answers, stats = asyncio.run(go())
    assert [a.tokens for a in answers] == [4, 4, 4]
    assert sorted(a.engine for a in answers[:2]) == [0, 1]
    assert stats["counts"]["good"] + stats["counts"]["late"] == 3
