"""``qlab calibrate`` with several prompt lengths: both terms of the service model, against a real
synthetic server.

The synthetic engine's true time is the served model's estimate of (new tokens, prompt tokens
counted in bytes by its tokenizer) with no noise, so the fit must recover the model it was given.
"""

import json

import numpy as np
import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from experiments.cli import main
from live.calibrate import CalibrationConfig, calibrate, prompt_schedule, schedule
from live.engine import SyntheticEngine
from live.procs import serving
from live.serve_options import ServeOptions
from live.server_facts import ServerFacts, default_prompt_tokens, server_facts
from live.tokenizer import ByteTokenizer, max_tokens_within, prompt_of, words_prompt
from qsim import ServiceModel

#: 10 ms + 8 ms per new token + 100 us per prompt byte: a 768-byte prompt costs 77 ms, as much as
#: 9.6 new tokens. Long enough that a loaded machine's scheduling jitter (a few ms on a sleep) stays
#: small beside each term.
TRUTH = ServiceModel(intercept_s=0.010, per_token_s=0.008, per_prompt_token_s=0.0001)
SIZES = (1, 4, 16)


@pytest.fixture(scope="module")
def prompt_costly(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompted")
    TRUTH.save(folder / "truth.json")
    options = ServeOptions(policy="none", service_model=str(folder / "truth.json"))
    with serving([options], folder, 60) as (server,):
        yield server


@pytest.mark.slow
def test_calibrating_recovers_both_terms_and_reports_the_error(prompt_costly, tmp_path):
    result = calibrate(CalibrationConfig(prompt_costly.url, rounds=1, per_size=6, sizes=SIZES))
    (only,) = result.rounds
    # The default schedule: the replayer's default prompt (16 words, 77 bytes), 256 and 768; every
    # size met every length twice in 6 repetitions.
    assert sorted(set(zip(only.tokens, only.prompt_tokens))) == sorted(
        (s, p) for s in SIZES for p in (len(words_prompt(16)), 256, 768)
    )
    fitted = result.overall.model
    assert fitted.per_prompt_token_s == pytest.approx(TRUTH.per_prompt_token_s, rel=0.1)
    assert fitted.per_token_s == pytest.approx(TRUTH.per_token_s, rel=0.05)
    assert fitted.intercept_s == pytest.approx(TRUTH.intercept_s, abs=0.005)
    assert 0 <= result.overall.median_rel_error <= result.overall.worst_rel_error < 0.25
    result.save(tmp_path / "model.json")
    saved = json.loads((tmp_path / "model.json").read_text())
    assert (
        saved["model"]["per_prompt_token_s"] == fitted.per_prompt_token_s
        and saved["prompt_tokenizer"] == "bytes"
    )
    assert ServiceModel.load(tmp_path / "model.json") == fitted


@pytest.mark.slow
def test_a_line_alone_misses_what_the_prompt_costs(prompt_costly):
    """One prompt length cannot see the prompt term: the fit is the old line, and it is wrong at
    other lengths."""
    result = calibrate(
        CalibrationConfig(prompt_costly.url, rounds=1, per_size=2, sizes=SIZES, prompt_tokens=(16,))
    )
    line = result.overall.model
    assert line.per_prompt_token_s == 0
    assert line.estimate(16, 768) < 0.8 * TRUTH.estimate(16, 768)


@pytest.mark.slow
def test_the_command_takes_prompt_lengths_and_saves_the_prompt_term(
    prompt_costly, tmp_path, capsys
):
    out = tmp_path / "cal.json"
    assert (
        main(
            [
                "calibrate",
                "--url",
                prompt_costly.url,
                "--rounds",
                "1",
                "--per-size",
                "2",
                "--prompt-tokens",
                "32,512",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "us/prompt token" in text and "median" in text and "worst" in text
    model = ServiceModel.load(out)
    assert model.per_prompt_token_s == pytest.approx(TRUTH.per_prompt_token_s, rel=0.15)
    assert set(json.loads(out.read_text())["rounds"][0]["prompt_tokens"]) == {32, 512}


def test_bad_prompt_lengths_are_one_line_and_exit_2(capsys):
    for value in ("0,16", "16,x", ""):
        assert (
            main(
                [
                    "calibrate",
                    "--url",
                    "http://127.0.0.1:9",
                    "--prompt-tokens",
                    value,
                    "--out",
                    "m.json",
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert "--prompt-tokens" in err and err.count("\n") == 1, err


def test_schedule_meets_every_size_with_every_prompt_length():
    # sizes a multiple of the lengths: still all
    cfg = CalibrationConfig("http://x", per_size=6, sizes=(1, 2, 4, 8))
    points = schedule(cfg, (10, 20))
    assert len(points) == 24 and {(s, p) for s, p in points} == {
        (s, p) for s in (1, 2, 4, 8) for p in (10, 20)
    }
    assert [s for s, _ in points[:4]] == [1, 2, 4, 8]  # sizes still interleaved


def test_prompt_lengths_fit_the_context_or_are_refused():
    gpt2 = server_facts(
        {"engine": {"tokenizer": "GPT2TokenizerFast", "context": 1024}},
        {"limits": {"max_prompt_tokens": 16384, "max_prompt_chars": 16384}},
    )
    assert gpt2 == ServerFacts("GPT2TokenizerFast", 1024, 16384, 16384)
    # 768 + 64 fits 1024
    assert prompt_schedule(CalibrationConfig("http://x"), gpt2) == (16, 256, 768)
    small = ServerFacts("bytes", context=300)
    # 256 + 64 > 300: left out
    assert prompt_schedule(CalibrationConfig("http://x"), small) == (77,)
    with pytest.raises(ValueError, match=r"prompt lengths \[256\] do not fit beside 64 new tokens"):
        prompt_schedule(CalibrationConfig("http://x", prompt_tokens=(16, 256)), small)
    # a server that says nothing: no limits, unknown tokenizer
    assert server_facts(None, None) == ServerFacts()


def test_prompts_have_the_asked_number_of_tokens():
    byte = ByteTokenizer()
    for n in (1, 7, 77, 768, 5000):
        assert byte.count(prompt_of(n, "bytes")) == n
        assert len(prompt_of(n, "GPT2TokenizerFast").split(" ")) == n  # one GPT-2 token per word
    assert default_prompt_tokens(ServerFacts("bytes"), 16) == byte.count(words_prompt(16))
    assert prompt_of(default_prompt_tokens(ServerFacts("bytes"), 16), "bytes") == words_prompt(16)
    assert max_tokens_within(2, None) == 0 and max_tokens_within(300, "bytes") == 300
    for chars in (3, 50, 16384):
        n = max_tokens_within(chars, None)
        assert len(prompt_of(n, None)) <= chars < len(prompt_of(n + 1, None))


def test_the_synthetic_engine_charges_the_prompt_term():
    engine = SyntheticEngine(TRUTH)
    assert engine.duration_s(4, 500) == pytest.approx(float(TRUTH.estimate(4, 500)))
    assert engine.info()["per_prompt_token_s"] == TRUTH.per_prompt_token_s
    # no term: none
    np.testing.assert_allclose(SyntheticEngine().duration_s(4, 500), ServiceModel().estimate(4))


def test_calibration_requests_carry_the_calibrators_patience_as_their_deadline():
    """A predictive gate refuses a request whose estimate is past its deadline: under the server's
    default deadline it refused its own 64-token calibration (503 deadline_unreachable)."""
    from live.calibrate import CalibrationConfig, _body

    assert _body(CalibrationConfig("http://h"), "p", 64)["deadline_ms"] == 120_000
    assert _body(CalibrationConfig("http://h", deadline_ms=500), "p", 64)["deadline_ms"] == 500
