"""Issue 32, items 6 and 8: simulate --out summarises from its file (the same text and JSON as a
run in memory); --json on qlab summary and qlab live."""

import json

import pandas as pd

from experiments import live_runner
from experiments.cli import main

RUN = ["simulate", "--policy", "predictive", "--load", "1.3", "--requests", "3000", "--seed", "5"]


def _out(capsys, argv) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_simulate_out_prints_what_a_run_in_memory_prints(tmp_path, capsys):
    whole = _out(capsys, RUN)
    streamed = _out(capsys, [*RUN, "--out", str(tmp_path / "r.parquet")])
    assert streamed == whole + f"\nwrote 3000 rows to {tmp_path / 'r.parquet'}\n"


def test_simulate_out_json_is_the_run_in_memorys(tmp_path, capsys):
    whole = json.loads(_out(capsys, [*RUN, "--json"]))
    streamed = json.loads(_out(capsys, [*RUN, "--json", "--out", str(tmp_path / "r.parquet")]))
    assert streamed["summary"] == whole["summary"] and streamed["by_class"] == whole["by_class"]


def test_simulate_out_of_seeds_prints_what_runs_in_memory_print(tmp_path, capsys):
    seeds = [*RUN[:-4], "--requests", "1500", "--seeds", "3"]
    whole = _out(capsys, seeds)
    streamed = _out(capsys, [*seeds, "--out", str(tmp_path / "r.parquet")])
    assert streamed.startswith(whole)


def test_summary_json_is_format_json(tiny_sweep, capsys):
    by_format = json.loads(_out(capsys, ["summary", str(tiny_sweep), "--format", "json"]))
    assert json.loads(_out(capsys, ["summary", str(tiny_sweep), "--json"])) == by_format


def _fake_live(monkeypatch):
    def run(cfg, out, log=print, bar=None):
        log("a run's line")
        with bar(2, 1) as shown:  # one run of two done before: the bar starts there
            shown.update(1)
        return pd.DataFrame(
            {c: [0] for c in ["good", "late", "rejected", "expired", "error"]}
            | {
                "trace": ["t"],
                "policy": ["none"],
                "effective_load": [1.0],
                "goodput_rps": [float("nan")],
                "good_tokens_per_s": [2.0],
                "sim_disagreement_rate": [0.0],
            }
        )

    monkeypatch.setattr(live_runner, "run", run)
    monkeypatch.setattr("live.live_config.load", lambda path: None)


def test_live_json_is_one_document_its_lines_on_stderr(monkeypatch, tmp_path, capsys):
    _fake_live(monkeypatch)
    assert main(["live", "x.toml", "--out", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["runs"][0]["policy"] == "none" and doc["runs"][0]["goodput_rps"] is None
    assert doc["summary"] == str(tmp_path / "summary.parquet")
    assert captured.err == "a run's line\n"


def test_live_quiet_says_no_line_as_it_goes(monkeypatch, tmp_path, capsys):
    _fake_live(monkeypatch)
    assert main(["live", "x.toml", "--out", str(tmp_path), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "a run's line" not in captured.out + captured.err and "wrote 1 runs" in captured.out


def test_replay_rate_is_the_nominal_load_that_sends_it(monkeypatch, tmp_path, capsys):
    import httpx

    from live import lanes
    from qsim.workload import load_at_rate
    from test_json_output import _gate  # tests/ is on the path (rootdir-relative imports)

    monkeypatch.setattr(lanes.Lanes, "_new", lambda self: httpx.MockTransport(_gate))
    argv = [
        "replay",
        "--url",
        "http://gate.test",
        "--arrivals",
        "poisson",
        "--requests",
        "6",
        "--engines",
        "1",
        "--seed",
        "3",
        "--out",
        str(tmp_path / "r.parquet"),
        "--json",
    ]
    assert main([*argv, "--rate", "40"]) == 0
    doc = json.loads(capsys.readouterr().out)
    want = load_at_rate(40.0, arrivals="poisson", engines=1, requests=6, seed=3)
    assert doc["load"]["nominal"] == want and doc["requests"] == 6
    assert main([*argv, "--rate", "40", "--nominal-load", "1"]) == 2
    assert "give --rate or --nominal-load" in capsys.readouterr().err


def test_live_bar_on_a_terminal_only(monkeypatch, tmp_path, capsys):
    import sys

    _fake_live(monkeypatch)
    assert main(["live", "x.toml", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""  # stderr no terminal: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["live", "x.toml", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "live" in err and "2/2" in err
    for flag in ("--quiet", "--json"):
        assert main(["live", "x.toml", "--out", str(tmp_path), flag]) == 0
        assert "2/2" not in capsys.readouterr().err


def test_study_bar_over_sections_on_a_terminal_only(monkeypatch, tmp_path, capsys):
    import sys

    from experiments.study import runner

    monkeypatch.setattr(runner, "run_section", lambda ctx, section, force: "done")
    monkeypatch.setattr(runner, "write_report", lambda ctx: [])
    runner.run(tmp_path / "a", runner.QUICK, log=lambda line: None, quiet=False)
    assert capsys.readouterr().err == ""  # stderr no terminal: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    runner.run(tmp_path / "b", runner.QUICK, log=lambda line: None, quiet=False)
    n = len(runner.SECTIONS)
    assert f"{n}/{n}" in capsys.readouterr().err
    runner.run(tmp_path / "c", runner.QUICK, log=lambda line: None)  # quiet unless asked: no bar
    assert capsys.readouterr().err == ""


def test_study_json_is_its_verdicts(monkeypatch, tmp_path, capsys):
    from experiments.study import runner
    from experiments.study.blocks import Verdict

    section = runner.SECTIONS[0]
    parts = [
        (
            section,
            [Verdict("H1", "a claim", True, "the numbers"), Verdict("check", "a check", True, "")],
        )
    ]
    monkeypatch.setattr(runner, "run_section", lambda ctx, section, force: "done")
    monkeypatch.setattr(runner, "write_report", lambda ctx: parts)
    assert main(["study", "--out", str(tmp_path / "s"), "--quick", "--json"]) == 0
    said = capsys.readouterr()
    doc = json.loads(said.out)
    assert doc["hypotheses"] == [
        {"label": "H1", "claim": "a claim", "verdict": "supported", "evidence": "the numbers"}
    ]
    assert doc["failed"] == [] and section.name in said.err  # the sections' lines on stderr
