"""qlab summary --format table|csv|json|markdown, and every qlab command quiet on a closed pipe."""

import io
import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from analysis.metrics import aggregate
from experiments.cli import main


@pytest.fixture(scope="module")
def tiny(tiny_sweep):
    """conftest's tiny sweep (2 policies x 2 loads x 3 seeds) and its summary table."""
    return tiny_sweep, pd.read_parquet(tiny_sweep / "summary.parquet")


def summary_out(args, capsys) -> str:
    assert main(["summary", *args]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def test_csv_and_json_give_the_mean_and_interval_as_numbers(tiny, capsys):
    out, summary = tiny
    csv = pd.read_csv(io.StringIO(summary_out([str(out), "--format", "csv"], capsys)))
    records = json.loads(summary_out([str(out), "--format", "json"], capsys))
    assert len(csv) == len(records) == 4  # policy x load; the seeds are what the interval is over
    assert list(csv.columns[:5]) == ["speed", "engines", "load", "policy", "n"]
    for metric in ("share_good", "goodput_rps", "good_tokens_per_s", "latency_p99_s"):
        assert {metric, f"{metric}_low", f"{metric}_high"} <= set(csv.columns)
    expected = aggregate(summary, ["load", "policy"], ["share_good", "goodput_rps"])
    for (_, want), got, record in zip(expected.iterrows(), csv.itertuples(), records):
        assert (got.load, got.policy, got.n) == (want["load"], want["policy"], 3)
        for metric in ("share_good", "share_good_low", "share_good_high", "goodput_rps"):
            assert getattr(got, metric) == pytest.approx(want[metric], rel=1e-12)
            assert record[metric] == pytest.approx(want[metric], rel=1e-12)
        assert record["policy"] == want["policy"] and record["n"] == 3


def test_json_writes_null_where_a_figure_has_no_value(tiny, tmp_path, capsys):
    out, summary = tiny
    # A cell whose seeds answered nobody has no latency: NaN in the table, null in JSON.
    folder = tmp_path / "copy"
    folder.mkdir()
    summary.assign(latency_p99_s=float("nan")).to_parquet(folder / "summary.parquet")
    records = json.loads(summary_out([str(folder), "--format", "json"], capsys))
    assert all(r["latency_p99_s"] is None for r in records)


def test_markdown_is_the_table_as_a_pipe_table(tiny, capsys):
    out, _ = tiny
    table = summary_out([str(out)], capsys).splitlines()
    markdown = summary_out([str(out), "--format", "markdown"], capsys).splitlines()
    assert markdown[0] == (
        "| speed | engines | load | policy | share_good | goodput_rps | "
        "good_tokens_per_s | latency_p99_s |"
    )
    assert markdown[1] == "|---|---|---|---|---|---|---|---|"
    assert len(markdown) == 2 + 4 and all(
        line.startswith("| ") and line.endswith(" |") for line in markdown[2:]
    )
    # The same cells as the default table (mean ± half-width), without its two lines of preamble.
    assert [line.split("|")[4].strip() for line in markdown[2:]] == [
        line.split()[3] for line in table[3:]
    ]
    assert "±" in markdown[2]


def test_an_unknown_format_is_one_clear_error(tiny, capsys):
    out, _ = tiny
    assert main(["summary", str(out), "--format", "xml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'xml'" in err


@pytest.mark.slow
def test_a_closed_pipe_ends_the_command_quietly(tiny):
    """`qlab summary DIR | head -1`: the reader goes away. Its read end is closed before qlab starts
    here, so the first write fails, whatever the timing: no traceback, no "Broken pipe" line, the
    status of SIGPIPE."""
    out, _ = tiny
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "experiments", "summary", str(out)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert proc.stderr == ""
    assert proc.returncode == 141  # 128 + SIGPIPE, as for a program the signal ends


def test_a_broken_pipe_that_is_not_stdout_is_still_an_error(tiny, capsys, monkeypatch):
    from experiments import commands

    def lost_connection(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(commands, "cmd_summary", lost_connection)
    assert main(["summary", str(tiny[0])]) == 2
    assert capsys.readouterr().err == "qlab: error: [Errno 32] Broken pipe\n"
