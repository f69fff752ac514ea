"""--json on qlab replay and qlab sweep: one document on stdout, the facts the text prints, agreeing
with the files written. In-process: the replayer's lanes answer from a stub gate (httpx's
MockTransport), and the sweep is the session's tiny one."""

import json
import math
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest

from experiments.cli import main
from live import lanes
from qsim import records

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
STATS = json.loads((EXAMPLES / "gate-stats.json").read_text())


def _gate(request: httpx.Request) -> httpx.Response:
    """A qlab gate that answers every request at once, good; its clock is the replayer's (one
    machine)."""
    now = time.monotonic()
    if request.url.path == "/stats":
        return httpx.Response(200, json={**STATS, "clock": now})
    if request.url.path == "/healthz":
        return httpx.Response(200, json={"status": "ok"})
    tokens = json.loads(request.content)["max_new_tokens"]
    timings = {
        "queue_s": 0.0,
        "engine_s": 0.001,
        "total_s": 0.001,
        "est_service_s": 0.001,
        "started_at": now,
        "returned_at": now + 0.001,
    }
    return httpx.Response(
        200,
        json={
            "text": "x" * tokens,
            "tokens": tokens,
            "outcome": "good",
            "engine": 0,
            "timings": timings,
            "admission": {},
        },
    )


@pytest.fixture
def stub_gate(monkeypatch):
    monkeypatch.setattr(lanes.Lanes, "_new", lambda self: httpx.MockTransport(_gate))
    return "http://gate.test"


def _replay(url, out, *flags):
    return [
        "replay",
        "--url",
        url,
        "--arrivals",
        "burst:6",
        "--engines",
        "1",
        "--out",
        str(out),
        *flags,
    ]


def test_replay_json_is_one_document_agreeing_with_the_run_file(stub_gate, tmp_path, capsys):
    out = tmp_path / "run.parquet"
    assert main(_replay(stub_gate, out, "--json")) == 0
    # the whole of stdout: no "replaying ..." line before it
    doc = json.loads(capsys.readouterr().out)
    rows = records.validate(pd.read_parquet(out))
    assert doc["out"] == str(out) and doc["rows"] == len(rows) == doc["requests"] == 6
    assert doc["outcomes"] == {o: int((rows["outcome"] == o).sum()) for o in records.OUTCOMES}
    assert doc["outcomes"]["good"] == 6 and doc["errors"] == 0 and doc["first_error"] is None
    assert doc["latency"]["good"] == 6 and doc["latency"]["goodput_rps"] > 0
    assert doc["send_lateness"]["max_s"] == pytest.approx(rows["send_lateness_s"].max())
    assert doc["load"]["nominal"] is None  # a burst of its own size has no nominal load
    assert doc["trace"] == rows.attrs["qlab_run"]["trace"] and doc["end_to_end"] is None
    assert "NaN" not in json.dumps(doc)


def test_replay_text_is_unchanged_without_json(stub_gate, tmp_path, capsys):
    assert main(_replay(stub_gate, tmp_path / "run.parquet")) == 0
    text = capsys.readouterr().out
    assert text.startswith("replaying 6 requests") and "wrote 6 rows to" in text
    assert not text.lstrip().startswith("{")


def test_replay_shows_answered_and_sent_on_a_terminal_only(
    stub_gate, tmp_path, capsys, monkeypatch
):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(_replay(stub_gate, tmp_path / "run.parquet")) == 0
    shown = capsys.readouterr()
    assert "answered" in shown.err and "6/6" in shown.err and "sent 6" in shown.err
    assert "answered:" not in shown.out
    for flag in ("--quiet", "--json"):
        assert main(_replay(stub_gate, tmp_path / f"run{flag}.parquet", flag)) == 0
        assert "answered" not in capsys.readouterr().err


def test_imported_json_agrees_with_its_run_file(tmp_path, capsys):
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
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    rows = pd.read_parquet(out)
    assert doc["imported"] == "inference-perf" and doc["rows"] == len(rows)
    assert doc["outcomes"]["good"] == 5 and doc["outcomes"]["rejected"] == 3


def test_sweep_json_is_the_summary_and_the_files(tiny_sweep, tmp_path, capsys):
    tiny_sweep_toml = str(tiny_sweep.parent / "tiny.toml")
    out = tmp_path / "sw"
    assert main(["sweep", tiny_sweep_toml, "--out", str(out), "--workers", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    summary = pd.read_parquet(out / "summary.parquet")
    assert doc["out"] == str(out) and doc["cells"] == len(summary) == doc["ran"]
    assert doc["skipped"] == 0 and doc["requests"] == int(summary["requests"].sum())
    assert {Path(p).name for p in doc["files"]} >= {"summary.parquet", "manifest.json"}
    assert all(Path(p).exists() for p in doc["files"])
    first = doc["summary"][0]
    assert {"policy", "load", "n", "share_good", "share_good_low", "share_good_high"} <= set(first)
    assert all(
        v is None or math.isfinite(v)
        for row in doc["summary"]
        for v in row.values()
        if isinstance(v, float)
    )
    # Run again: every cell already done, and still one document.
    assert main(["sweep", tiny_sweep_toml, "--out", str(out), "--workers", "1", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["ran"] == 0 and again["skipped"] == doc["cells"]
    assert again["summary"] == doc["summary"]


class _RefusesFirst:
    """The stub gate, refusing the first ``n`` generate requests (queue full) and answering the
    rest."""

    def __init__(self, n: int) -> None:
        self.left = n

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/generate" and self.left > 0:
            self.left -= 1
            over = {
                "error": {
                    "type": "overloaded",
                    "reason": "queue_full",
                    "numbers": {},
                    "retry_after_s": 1,
                }
            }
            return httpx.Response(503, json=over, headers={"retry-after": "1"})
        return _gate(request)


def test_replay_json_of_retrying_clients_says_the_end_to_end_view(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(lanes.Lanes, "_new", lambda self: httpx.MockTransport(_RefusesFirst(3)))
    out = tmp_path / "run.parquet"
    assert (
        main(
            _replay(
                "http://gate.test",
                out,
                "--retry",
                "fixed",
                "--retry-delay",
                "0.05",
                "--retry-max-attempts",
                "2",
                "--json",
            )
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    rows = records.validate(pd.read_parquet(out))
    assert doc["rows"] == len(rows) == 6 + 3 and doc["outcomes"]["rejected"] == 3
    e2e = doc["end_to_end"]
    assert e2e["requests"] == 6 and e2e["outcomes"]["good"] == 6
    assert e2e["attempts_per_request"] == pytest.approx(9 / 6)
    assert doc["retry_send_lateness"] is not None
