"""TTFT, ITL, TPOT, E2E and goodput by their stated definitions (analysis/latency.py,
docs/metrics.md), and other tools' result files read into qlab's run schema (live/imports.py, ``qlab
replay --import``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.latency import e2e_s, good, goodput, itl_s, summary, tpot_s, ttft_s
from experiments.cli import main
from qsim import records

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"
RESULTS = ROOT / "tests" / "data" / "clients" / "results"


def test_the_definitions_on_one_request():
    # Sent at 10.0; first piece at 10.2, last at 10.9 after 8 pieces; done at 11.0; 8 tokens.
    ttft, e2e = ttft_s([10.0], [10.2]), e2e_s([10.0], [11.0])
    assert ttft[0] == pytest.approx(0.2) and e2e[0] == pytest.approx(1.0)
    # vLLM's: (E2E - TTFT) / (tokens - 1)
    assert tpot_s(e2e, ttft, [8])[0] == pytest.approx(0.8 / 7)
    assert itl_s([10.2], [10.9], [8])[0] == pytest.approx(0.1)  # the mean gap between pieces
    # one token: none
    assert np.isnan(tpot_s(e2e, ttft, [1])[0]) and np.isnan(itl_s([10.2], [10.2], [1])[0])
    assert np.isnan(tpot_s(e2e, [np.nan], [8])[0])  # TTFT unknown (not streamed): no TPOT


def test_good_is_every_objective_set_met():
    outcome = ["good", "good", "good", "good", "late", "rejected", "good"]
    e2e = [1.0, 1.0, 1.0, 2.0, 2.5, 0.01, 1.0]
    deadline = [2.0] * 7
    ttft = [0.3, 0.6, 0.5, 0.3, 0.3, np.nan, np.nan]
    tpot = [0.01, 0.01, 0.05, np.nan, 0.01, np.nan, 0.01]
    # With no objective but the deadline: the answers within it (a deadline met at equality).
    assert good(outcome, e2e, deadline).tolist() == [True, True, True, True, False, False, True]
    # TTFT <= 0.5 s and TPOT <= 0.05 s (met at equality); an unknown value (no TPOT: one token; no
    # TTFT: not streamed) is not judged, as qsim.records.met_objectives judges a record.
    verdict = good(outcome, e2e, deadline, ttft, [0.5] * 7, tpot, [0.05] * 7)
    assert verdict.tolist() == [True, False, True, True, False, False, True]
    # Objectives per request: NaN is none set.
    assert good(
        outcome, e2e, deadline, ttft, [0.5, np.nan, 0.1, 0.5, 0.5, 0.5, np.nan]
    ).tolist() == [True, True, False, True, False, False, True]
    assert goodput(verdict, 2.0) == 2.0 and math.isnan(goodput(verdict, 0.0))


def test_the_summary_of_a_run_file():
    frame = pd.DataFrame(
        {
            "arrival_s": [0.0, 1.0, 2.0],
            "finish_s": [1.0, 2.5, 2.01],
            "outcome": ["good", "good", "rejected"],
            "deadline_s": [2.0] * 3,
            "ttft_s": [0.2, 0.4, np.nan],
            "last_token_s": [0.9, 1.3, np.nan],
            "pieces": [8, 10, 0],
            "tokens": pd.array([8, 10, pd.NA], dtype="Int64"),
        }
    )
    s = summary(frame, seconds=4.0)
    assert s["ttft_p50_s"] == pytest.approx(0.3) and s["e2e_p50_s"] == pytest.approx(1.25)
    assert (
        s["itl_p50_s"] == pytest.approx((0.1 + 0.1) / 2)
        and s["good"] == 2
        and s["goodput_rps"] == 0.5
    )
    frame["ttft_slo_s"] = 0.3
    assert summary(frame, 4.0)["good"] == 1


def test_an_inference_perf_file_is_a_run_file(tmp_path, capsys):
    out = tmp_path / "run.parquet"
    assert (
        main(
            [
                "replay",
                "--import",
                str(EXAMPLES / "inference-perf-requests.json"),
                "--stats",
                str(EXAMPLES / "gate-stats.json"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    run = records.validate(pd.read_parquet(out))
    sent = json.loads((EXAMPLES / "inference-perf-requests.json").read_text())
    assert len(run) == len(sent) and run["outcome"].value_counts().to_dict() == {
        "good": 5,
        "rejected": 3,
    }
    # the gate's envelope, read from its errors
    assert run["reason"].dropna().eq("deadline_unreachable").all()
    answered = run[run["outcome"].eq("good")]
    assert answered["tokens"].tolist() == [
        json.loads(r["request"])["max_tokens"] for r in sent if not r["error"]
    ]
    assert answered["ttft_s"].between(0, 2).all() and answered["pieces"].ge(1).all()
    # The gate's own timings came with the stream's last chunk (its qlab part).
    assert answered["engine_s"].notna().all() and answered["queue_s"].notna().all()
    # the configuration from /stats: what compare --predict reads
    assert run["policy"].eq("predictive").all()
    assert "goodput: 5 answered meeting the deadline" in capsys.readouterr().out


@pytest.mark.parametrize(
    "tool, name", [("guidellm", "guidellm.json"), ("aiperf", "aiperf/profile_export.jsonl")]
)
def test_guidellm_and_aiperf_files_are_run_files(tmp_path, tool, name):
    from live.imports import read_tool_file

    found, sent = read_tool_file(RESULTS / name)
    assert found == tool and sent
    out = tmp_path / "run.parquet"
    assert (
        main(
            [
                "replay",
                "--import",
                str(RESULTS / name),
                "--stats",
                str(EXAMPLES / "gate-stats.json"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    run = records.validate(pd.read_parquet(out))
    outcomes = set(run["outcome"])
    assert "good" in outcomes and outcomes <= {"good", "late", "rejected", "expired", "abandoned"}
    assert run.loc[run["outcome"].eq("good"), "ttft_s"].gt(0).all()


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", "not a result file qlab reads"),
        ("{oops", "not a result file"),
        ('{"benchmarks": [{}]}', "KeyError"),
    ],
)
def test_a_file_no_tool_wrote_is_one_line(tmp_path, capsys, text, message):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert (
        main(
            [
                "replay",
                "--import",
                str(bad),
                "--stats",
                str(EXAMPLES / "gate-stats.json"),
                "--out",
                str(tmp_path / "x.parquet"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
