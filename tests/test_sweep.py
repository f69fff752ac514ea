"""Sweeps: grid, determinism across executors, resume, crash safety, config checks, plots (the
notebook: test_notebook.py)."""

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments import config, sweep
from qsim import REFERENCE_MIX, ServiceModel, make_trace, records

ROOT = Path(__file__).resolve().parents[1]

SMALL = """
[sweep]
duration_s = 40
seeds = 2
[grid]
policy = ["none", "bounded", "bounded-deadline", "predictive"]
load = [0.5, 1.5]
speed = [1.0, 2.25]
"""


def write(tmp_path, text, name="s.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def rows_of(out):
    frame = pd.read_parquet(Path(out) / "cells")
    return frame.sort_values(["cell_id", "request_id"]).reset_index(drop=True)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    cfg = config.load(write(tmp, SMALL))
    out = tmp / "out"
    summary = sweep.run(cfg, out, workers=1, quiet=True)
    return cfg, out, summary


def test_grid_and_layout(small):
    cfg, out, summary = small
    assert len(sweep.cells(cfg)) == 4 * 2 * 2 * 2
    assert len(summary) == 32 and summary["cell_id"].is_unique
    assert len(list((out / "cells").glob("*.parquet"))) == 32
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["config_sha256"] == cfg.digest
        and manifest["seeds"] == [1, 2]
        and manifest["cells"] == 32
    )
    assert (
        "qlab_version" in manifest and manifest["load_meaning"] == "utilisation-at-simulated-speed"
    )
    rows = rows_of(out)
    # Every cell numbers its requests from 0 (one attempt each here): renumber them to validate the
    # lot as one run.
    records.validate(
        rows.drop_duplicates(["cell_id", "request_id"]).assign(
            request_id=range(len(rows)), first_request_id=range(len(rows))
        )
    )
    # One row per request per cell, and the summary counts them all.
    assert rows.groupby("cell_id").size().sum() == summary["requests"].sum()
    by_class = pd.read_parquet(out / "summary_by_class.parquet")
    assert set(by_class["size_class"]) == {"4", "16", "64"}


def test_common_random_numbers_across_policies(small):
    _, out, _ = small
    rows = rows_of(out)
    cell = rows[(rows["load"] == 1.5) & (rows["speed"] == 1.0) & (rows["seed"] == 1)]
    arrivals = {p: part["arrival_s"].to_numpy() for p, part in cell.groupby("policy")}
    first = next(iter(arrivals.values()))
    assert all((a == first).all() for a in arrivals.values())


def test_a_cell_is_make_trace_at_its_load_and_speed(small):
    """A sweep's load is make_trace's (and `qlab simulate --load`'s): utilisation at the
    simulated speed."""
    cfg, out, _ = small
    rows = rows_of(out)
    for load, speed in [(1.5, 2.25), (0.5, 2.25), (1.5, 1.0)]:
        cell = rows[
            (rows["policy"] == "bounded")
            & (rows["load"] == load)
            & (rows["speed"] == speed)
            & (rows["seed"] == 1)
        ]
        trace = make_trace("poisson", "mix", load=load, speed=speed, seconds=40, seed=1)
        assert len(cell) == len(trace)
        assert (cell["arrival_s"].to_numpy() == trace.arrival_s).all()
        assert (cell["true_service_s"].to_numpy() == trace.true_service_s).all()
    # Same seed, same unit gaps: at speed 2.25 every arrival comes 2.25x later (the rate is 2.25x
    # lower).
    slow = rows[
        (rows["policy"] == "none")
        & (rows["load"] == 1.5)
        & (rows["speed"] == 2.25)
        & (rows["seed"] == 1)
    ]
    fast = rows[
        (rows["policy"] == "none")
        & (rows["load"] == 1.5)
        & (rows["speed"] == 1.0)
        & (rows["seed"] == 1)
    ]
    assert 0 < len(slow) < len(fast)
    np.testing.assert_allclose(
        slow["arrival_s"].to_numpy(), 2.25 * fast["arrival_s"].to_numpy()[: len(slow)]
    )


def test_offered_load_agrees_with_load_and_capacity_is_at_the_simulated_speed(tmp_path):
    text = """
[sweep]
duration_s = 800
seeds = 1
[grid]
policy = ["bounded"]
load = [0.5, 2.0]
speed = [1.0, 2.25]
engines = [1, 2]
"""
    summary = sweep.run(config.load(write(tmp_path, text)), tmp_path / "out", workers=1, quiet=True)
    # Fewest requests: load 0.5 at speed 2.25 on one engine, about 1,200; the relative standard
    # error of the offered work is then about sqrt((1 + CV^2) / n) = 4.5 %, so 15 % is over three of
    # them.
    np.testing.assert_allclose(summary["offered_load"], summary["load"], rtol=0.15)
    mean_s = REFERENCE_MIX.mean_s(ServiceModel())
    np.testing.assert_allclose(
        summary["capacity_rps"], summary["engines"] / (summary["speed"] * mean_s)
    )
    # The arrival rate is load x capacity at the cell's speed.
    np.testing.assert_allclose(
        summary["requests"] / summary["duration_s"],
        summary["load"] * summary["capacity_rps"],
        rtol=0.15,
    )


@pytest.mark.slow
def test_a_folder_written_when_load_was_nominal_is_refused(small, tmp_path):
    cfg, out, _ = small
    old = tmp_path / "old"
    shutil.copytree(out, old)
    manifest = json.loads((old / "manifest.json").read_text())
    # what every sweep wrote before load meant utilisation at the simulated speed
    del manifest["load_meaning"]
    (old / "manifest.json").write_text(json.dumps(manifest, indent=2))
    before = {p.name: p.stat().st_mtime_ns for p in (old / "cells").glob("*.parquet")}
    with pytest.raises(config.ConfigError) as err:
        sweep.run(cfg, old, workers=1, quiet=True)
    message = str(err.value)
    assert "nominal" in message and "new --out" in message and "\n" not in message
    assert {p.name: p.stat().st_mtime_ns for p in (old / "cells").glob("*.parquet")} == before
    # From the command line: one line, exit 2; reading its summary still works, with a warning.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments", "sweep", cfg.source, "--out", str(old), "--quiet"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "was nominal" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "experiments", "summary", str(old)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0 and "warning" in proc.stderr and "nominal" in proc.stderr


@pytest.mark.slow
def test_same_rows_with_a_process_pool(small, tmp_path):
    cfg, out, _ = small
    other = tmp_path / "pool"
    sweep.run(cfg, other, workers=2, quiet=True)
    pd.testing.assert_frame_equal(rows_of(out), rows_of(other))


@pytest.mark.slow
def test_same_rows_on_a_dask_cluster(small, tmp_path):
    distributed = pytest.importorskip("distributed")
    cfg, out, _ = small
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as cluster:
        sweep.run(cfg, tmp_path / "dask", scheduler=cluster.scheduler_address, quiet=True)
    pd.testing.assert_frame_equal(rows_of(out), rows_of(tmp_path / "dask"))


def test_resume_skips_finished_cells(small, tmp_path):
    cfg, out, _ = small
    copy = tmp_path / "copy"
    sweep.run(cfg, copy, workers=1, quiet=True)
    victims = sorted((copy / "cells").glob("*.parquet"))[:5]
    for v in victims:
        v.unlink()
    mtimes = {p: p.stat().st_mtime_ns for p in (copy / "cells").glob("*.parquet")}
    summary = sweep.run(cfg, copy, workers=1, quiet=True)
    assert summary.attrs == {"ran": 5, "skipped": 27}
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())
    pd.testing.assert_frame_equal(rows_of(out), rows_of(copy))


def test_changed_config_is_refused(small, tmp_path):
    cfg, out, _ = small
    changed = config.load(write(tmp_path, SMALL.replace("seeds = 2", "seeds = 3")))
    with pytest.raises(config.ConfigError, match="another sweep config"):
        sweep.run(changed, out, quiet=True)


@pytest.mark.slow
def test_killed_sweep_leaves_whole_files_and_resumes(tmp_path):
    path = write(
        tmp_path,
        SMALL.replace("duration_s = 40", "duration_s = 400").replace("seeds = 2", "seeds = 3"),
    )
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "experiments",
            "sweep",
            str(path),
            "--out",
            str(out),
            "--workers",
            "2",
            "--quiet",
        ],
        env=env,
        start_new_session=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline and len(list((out / "cells").glob("*.parquet"))) < 3:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    written = list((out / "cells").glob("*.parquet"))
    assert 3 <= len(written) < 48, "the sweep should have been killed part way"
    for p in written:
        pd.read_parquet(p)  # every visible file is whole
    cfg = config.load(path)
    summary = sweep.run(cfg, out, workers=2, quiet=True)
    assert summary.attrs["skipped"] == len(written) and len(summary) == 48
    assert not list((out / "cells").glob(".*tmp*"))


@pytest.mark.parametrize(
    "text,message",
    [
        ("[grid]\npolicy = ['none']\nload = []\n", "grid.load: empty list"),
        ("[grid]\npolicy = ['none']\nload = [1.0]\nsped = [1.0]\n", "unknown key 'sped'"),
        ("[grid]\npolicy = ['none']\nload = ['high']\n", "grid.load[0]: expected float"),
        ("[grid]\npolicy = ['fifo']\nload = [1.0]\n", "unknown policy 'fifo'"),
        ("[grid]\npolicy = ['none']\nload = [-1.0]\n", "grid.load[0]: must be > 0"),
        ("[grid]\npolicy = ['none']\n", "needs load"),
        ("[grid]\nload = [1.0]\n", "grid.policy is required"),
        (
            "[sweep]\nseeds = 'many'\n[grid]\npolicy = ['none']\nload = [1.0]\n",
            "sweep.seeds: expected int",
        ),
        (
            "[sweep]\nseeds = 0\n[grid]\npolicy = ['none']\nload = [1.0]\n",
            "sweep.seeds: must be > 0",
        ),
        (
            "[sweep]\narrivals = 'pareto'\n[grid]\npolicy = ['none']\nload = [1.0]\n",
            "sweep.arrivals",
        ),
        ("[sweeps]\n[grid]\npolicy = ['none']\nload = [1.0]\n", "unknown key 'sweeps'"),
        ("[grid]\npolicy = ['none']\nmix = ['short']\nload = [1.0]\n", "unknown mix 'short'"),
        (
            "[mixes.short]\nsizes = [4]\nprobs = [0.5]\n[grid]\npolicy = ['none']\nload = [1.0]\n",
            "mixes.short",
        ),
        # A quoted key may hold anything, a line break too: the error names it quoted, on one line.
        (
            "[mixes.\"a\\nb\"]\nsizes = [4]\n[grid]\npolicy = ['none']\nload = [1.0]\n",
            'mixes."a\\nb"',
        ),
        ("[grid]\npolicy = ['none']\ntrace = ['nope.csv']\n", "no such trace file"),
        ("[grid\npolicy = ['none']\n", "not valid TOML"),
    ],
)
def test_bad_toml_is_one_clear_error(tmp_path, text, message):
    with pytest.raises(config.ConfigError) as err:
        config.load(write(tmp_path, text))
    assert message in str(err.value) and "s.toml" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_bad_toml_from_the_cli_runs_nothing(tmp_path):
    path = write(tmp_path, "[grid]\npolicy = ['none']\nload = [1.0, 'x']\n")
    out = tmp_path / "never"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments", "sweep", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "grid.load[1]" in proc.stderr and not out.exists()


def test_trace_and_mix_grids(tmp_path, azure_csv):
    text = f"""
[sweep]
seeds = 1
[mixes.short]
sizes = [2, 8]
probs = [0.7, 0.3]
[grid]
policy = ["predictive"]
trace = ["{azure_csv}"]
time_scale = [0.25]
"""
    cfg = config.load(write(tmp_path, text))
    summary = sweep.run(cfg, tmp_path / "t", workers=1, quiet=True)
    assert summary["requests"].iloc[0] == 8819 and summary["rejected"].iloc[0] > 0
    cfg2 = config.load(
        write(
            tmp_path,
            SMALL.replace(
                "[grid]",
                '[mixes.short]\nsizes = [2, 8]\nprobs = [0.7, 0.3]\n[grid]\nmix = ["short"]',
            ),
            "m.toml",
        )
    )
    rows = sweep.run(cfg2, tmp_path / "m", workers=1, quiet=True)
    assert len(rows) == 32


@pytest.mark.slow
def test_cli_sweep_and_plot(tmp_path, small):
    _, out, _ = small
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    figs = tmp_path / "figs"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments", "plot", str(out), "--out", str(figs)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("share_in_time", "goodput", "share_by_class", "latency_cdf", "outcomes"):
        for ext in ("png", "svg"):
            assert (figs / f"{name}.{ext}").stat().st_size > 1000
    proc = subprocess.run(
        [sys.executable, "-m", "experiments", "plot", str(tmp_path), "--out", str(figs)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2 and "no summary.parquet" in proc.stderr


TENANTS = """
[sweep]
duration_s = 40
seeds = 2
[mixes.short]
sizes = [4, 16]
probs = [0.6, 0.4]
[clients.two-tenant]
heavy = { share = 0.85 }
light = { share = 0.15, priority = 1, mix = "short" }
[grid]
policy = ["predictive", "predictive-fair"]
load = [0.8, 2.0]
clients = ["none", "two-tenant"]
"""


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    out = tmp / "out"
    summary = sweep.run(config.load(write(tmp, TENANTS)), out, workers=1, quiet=True)
    return out, summary


def test_a_clients_sweep_summarises_by_client_and_priority(tenants):
    out, summary = tenants
    by_client = pd.read_parquet(out / "summary_by_client.parquet")
    with_clients = summary[summary["clients"] == "two-tenant"]
    # One row per client in each cell with clients; none for the cells whose requests name no
    # client.
    assert set(by_client["cell_id"]) == set(with_clients["cell_id"]) and len(with_clients) == 8
    assert all(
        sorted(part) == ["heavy", "light"] for _, part in by_client.groupby("cell_id")["client_id"]
    )
    for column in (
        "goodput_rps",
        "good_tokens_per_s",
        "share_good",
        "latency_p50_s",
        "latency_p99_s",
        "rejected",
        "expired",
        "refused",
        "share_refused",
        "share_of_requests",
    ):
        assert by_client[column].notna().all(), column
    # The clients add up to their cell.
    totals = by_client.groupby("cell_id")[["requests", "good", "good_tokens_per_s"]].sum()
    cells = with_clients.set_index("cell_id").loc[totals.index]
    np.testing.assert_allclose(
        totals.to_numpy(), cells[["requests", "good", "good_tokens_per_s"]].to_numpy()
    )
    # Jain's index over two clients lies in [1/2, 1]; cells without clients have none.
    for column in ("jain_goodput", "jain_share"):
        assert with_clients[column].between(0.5, 1.0).all(), column
        assert summary.loc[summary["clients"].isna(), column].isna().all()
    # The heavy client sends most, so its good tokens/s are far above the light one's: jain_goodput
    # < jain_share.
    assert (with_clients["jain_goodput"] < with_clients["jain_share"]).all()
    by_priority = pd.read_parquet(out / "summary_by_priority.parquet")
    assert set(by_priority["cell_id"]) == set(with_clients["cell_id"]) and set(
        by_priority["priority"]
    ) == {0, 1}
    # The cells' rows are the simulator's with the cell's parameters, no summary columns; and the
    # cells of both client sets read back as one dataset (a "none" cell's clients column is typed,
    # not null).
    rows = pd.read_parquet(out / "cells")
    assert len(rows) == summary["requests"].sum() and set(records.COLUMNS) <= set(rows.columns)
    assert not {"jain_goodput", "jain_share", "share_of_requests", "refused"} & set(rows.columns)
    assert rows.loc[rows["clients"].isna(), "client_id"].isna().all()
    assert set(rows.loc[rows["clients"] == "two-tenant", "client_id"]) == {"heavy", "light"}


def test_a_sweep_without_clients_writes_no_client_tables(small):
    _, out, summary = small
    assert (
        not (out / "summary_by_client.parquet").exists()
        and not (out / "summary_by_priority.parquet").exists()
    )
    assert "jain_goodput" not in summary


@pytest.mark.slow
def test_cli_summary_and_plot_by_client(tenants, tmp_path):
    out, _ = tenants
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments", "summary", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    header, *lines = proc.stdout.splitlines()[2:]
    assert "clients" in header.split() and "jain_goodput" in header.split()
    # One line per load, client set and policy: "none" and "two-tenant" cells are not mixed.
    assert len(lines) == 2 * 2 * 2
    assert (
        sum(" none " in line for line in lines) == 4
        and sum(" two-tenant " in line for line in lines) == 4
    )
    figs = tmp_path / "figs"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments", "plot", str(out), "--out", str(figs)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("share_in_time", "goodput", "by_client", "by_priority"):
        for ext in ("png", "svg"):
            assert (figs / f"{name}.{ext}").stat().st_size > 1000


RETRIES = """
[sweep]
duration_s = 40
seeds = 2
arrivals = "surge:10:10:2.5"
[retry.naive]
mode = "immediate"
retry_after = "ignore"
max_attempts = 4
timeout_s = 6
[grid]
policy = ["none", "predictive"]
load = [0.8]
retry = ["none", "naive"]
patience = ["none", "exponential:20"]
"""
RETRY_COLUMNS = (
    "attempts_per_request",
    "share_good_e2e",
    "goodput_e2e_rps",
    "retry_after_adherence",
)


@pytest.fixture(scope="module")
def retries(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("retries")
    cfg = config.load(write(tmp, RETRIES))
    out = tmp / "out"
    return cfg, out, sweep.run(cfg, out, workers=1, quiet=True)


def test_a_sweep_with_retry_and_patience_axes(retries):
    cfg, out, summary = retries
    assert len(summary) == 2 * 2 * 2 * 2 and summary["cell_id"].is_unique
    assert cfg.retries["naive"].mode == "immediate" and cfg.retries["naive"].timeout_s == 6
    # Every cell of a retry sweep has the end-to-end view and, with surge arrivals, the recovery
    # measure.
    for column in (*RETRY_COLUMNS, "requests_e2e", "recovery_s", "recovered", "steady_rps"):
        assert column in summary, column
    plain = summary[summary["retry"].isna()]
    naive = summary[summary["retry"] == "naive"]
    assert (plain["attempts_per_request"] == 1).all() and (
        plain["requests"] == plain["requests_e2e"]
    ).all()
    assert (naive.loc[naive["policy"] == "none", "attempts_per_request"] > 1.2).all()
    np.testing.assert_allclose(plain["share_good_e2e"], plain["share_good"])
    # Impatient clients leave: abandoned requests where there is patience, none where there is not
    # (and no timeout).
    assert (
        summary.loc[summary["patience"].notna() & (summary["policy"] == "none"), "abandoned"] > 0
    ).all()
    assert (
        summary.loc[summary["patience"].isna() & summary["retry"].isna(), "abandoned"] == 0
    ).all()
    assert summary["recovered"].isin([0.0, 1.0]).all()
    assert (summary.loc[summary["policy"] == "predictive", "recovered"] == 1).all()
    # The rows carry their cell's retry and patience; both kinds of cell read back as one dataset.
    rows = pd.read_parquet(out / "cells")
    assert len(rows) == summary["requests"].sum()
    assert set(rows["retry"].dropna()) == {"naive"} and set(rows["patience"].dropna()) == {
        "exponential:20"
    }
    assert rows.loc[rows["retry"].isna(), "attempt"].eq(1).all()
    # One row per cell and second: attempts add up to the rows sent in the run's 40 s.
    series = pd.read_parquet(out / "timeseries.parquet")
    assert len(series) == 16 * 40 and set(series.groupby("cell_id")["t_s"].max()) == {39.0}
    sent = rows[rows["arrival_s"] < 40].groupby("cell_id").size()
    np.testing.assert_array_equal(
        series.groupby("cell_id")["attempts_per_s"].sum().loc[sent.index], sent
    )
    first = series.groupby("cell_id")["first_sends_per_s"].sum()
    np.testing.assert_array_equal(first.loc[summary["cell_id"]], summary["requests_e2e"])
    assert {"policy", "retry", "patience", "seed", "goodput_rps", "goodput_e2e_rps"} <= set(
        series.columns
    )


def test_cells_without_retry_or_patience_keep_their_ids_and_rows(retries, tmp_path):
    # The id a cell had before the clients, retry and patience axes existed.
    assert (
        sweep.Cell("predictive", 1.0, 1.0, 1, None, None, "reference", None, None, 1).id
        == "0b3c8c9626cf6f2b"
    )
    cfg, out, summary = retries
    # The same sweep without the two axes and the [retry] table.
    without = RETRIES.split("[retry.naive]")[0] + "[grid]" + RETRIES.split("[grid]")[1]
    without = without.replace('retry = ["none", "naive"]\n', "").replace(
        'patience = ["none", "exponential:20"]\n', ""
    )
    old_cfg = config.load(write(tmp_path, without))
    assert "retry" not in old_cfg.canonical() and "patience_until" not in old_cfg.canonical()
    old_summary = sweep.run(old_cfg, tmp_path / "old", workers=1, quiet=True)
    # No retry or patience columns in a sweep without those axes.
    assert not {"retry", "patience", *RETRY_COLUMNS} & set(old_summary.columns)
    old_rows = rows_of(tmp_path / "old")
    assert not {"retry", "patience"} & set(old_rows.columns)
    plain = summary[summary["retry"].isna() & summary["patience"].isna()]
    assert sorted(plain["cell_id"]) == sorted(old_summary["cell_id"])
    new_rows = rows_of(out)
    new_rows = new_rows[new_rows["cell_id"].isin(plain["cell_id"])].drop(
        columns=["retry", "patience"]
    )
    pd.testing.assert_frame_equal(new_rows.reset_index(drop=True), old_rows)
    same = old_summary.columns.drop(["cell_id"])
    pd.testing.assert_frame_equal(
        plain.set_index("cell_id").sort_index()[same],
        old_summary.set_index("cell_id").sort_index()[same],
    )


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "[retry.naive]\nmode = 'immediate'\ntmeout_s = 8\n",
            "retry.naive: unknown retry setting 'tmeout_s'",
        ),
        (
            "[retry.naive]\nmode = 'immediate'\nmax_attempts = 'five'\n",
            "retry.naive.max_attempts: expected int",
        ),
        (
            "[retry.naive]\nmode = 'immediate'\njitter = 2.0\n",
            "retry.naive: retry jitter must be in [0, 1]",
        ),
        ("[retry.naive]\nmode = 'sometimes'\n", "retry.naive: retry mode must be one of"),
        ("[retry.naive]\ndelay_s = 2.0\n", "retry.naive.delay_s needs a retry mode"),
        ("[retry.none]\nmode = 'immediate'\n", "retry.none: 'none' is the built-in"),
        ("[retry]\nnaive = 3\n", "retry.naive: expected a table"),
        ("", "grid.retry[1]: unknown retry policy 'naive'"),
    ],
)
def test_bad_retry_tables_are_one_clear_error(tmp_path, text, message):
    grid = "[grid]\npolicy = ['none']\nload = [1.0]\nretry = ['none', 'naive']\n"
    with pytest.raises(config.ConfigError) as err:
        config.load(write(tmp_path, text + grid))
    assert message in str(err.value) and "s.toml" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "[grid]\npolicy = ['none']\nload = [1.0]\npatience = ['exponential']\n",
            "grid.patience[0]: bad patience",
        ),
        ("[grid]\npolicy = ['none']\nload = [1.0]\npatience = ['weibull:3']\n", "grid.patience[0]"),
        ("[grid]\npolicy = ['none']\nload = [1.0]\npatience = ['column']\n", "needs grid.trace"),
        (
            "[sweep]\npatience_until = 'end'\n[grid]\npolicy = ['none']\nload = [1.0]\npatience = "
            "['exponential:9']\n",
            "sweep.patience_until: expected one of answer, start",
        ),
        (
            "[sweep]\npatience_until = 'start'\n[grid]\npolicy = ['none']\nload = [1.0]\n",
            "patience_until applies only with grid.patience",
        ),
    ],
)
def test_bad_patience_is_one_clear_error(tmp_path, text, message):
    with pytest.raises(config.ConfigError) as err:
        config.load(write(tmp_path, text))
    assert message in str(err.value) and "s.toml" in str(err.value) and "\n" not in str(err.value)


def test_patience_until_start_reaches_the_cells(tmp_path):
    text = RETRIES.replace("[sweep]\n", "[sweep]\npatience_until = 'start'\n").replace(
        "seeds = 2", "seeds = 1"
    )
    cfg = config.load(write(tmp_path, text))
    assert (
        cfg.patience("exponential:20").until == "start"
        and cfg.canonical()["patience_until"] == "start"
    )
    assert cfg.digest != config.load(write(tmp_path, RETRIES, "r.toml")).digest
    cell = next(
        c for c in sweep.cells(cfg) if c.patience and c.retry is None and c.policy == "none"
    )
    rows = pd.read_parquet(io.BytesIO(sweep.run_cell(cfg, cell).parquet))
    left = rows[rows["outcome"] == "abandoned"]
    # patience while waiting: none left once started
    assert len(left) and left["start_s"].isna().all()


@pytest.mark.slow
def test_cli_summary_and_plot_of_a_retry_sweep(retries, tmp_path):
    _, out, _ = retries
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments", "summary", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    header, *lines = proc.stdout.splitlines()[2:]
    for column in (
        "retry",
        "patience",
        "share_good_e2e",
        "attempts_per_request",
        "recovery_s",
        "recovered",
    ):
        assert column in header.split(), column
    assert len(lines) == 2 * 2 * 2
    figs = tmp_path / "figs"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments", "plot", str(out), "--out", str(figs)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("retries", "recovery", "share_in_time", "outcomes"):
        for ext in ("png", "svg"):
            assert (figs / f"{name}.{ext}").stat().st_size > 1000


def test_per_variant_labels_each_axis_that_varies(retries):
    from analysis import plots

    _, _, summary = retries
    labelled = plots.per_variant(summary)
    # A cell without retries or patience says so: "none / none / none" said nothing of which was
    # which.
    assert set(labelled["policy"]) == {
        f"{p} / {r} / {q}"
        for p in ("none", "predictive")
        for r in ("no retries", "naive")
        for q in ("no patience", "exponential:20")
    }
    one = summary[summary["patience"].isna()]
    assert set(plots.per_variant(one)["policy"]) == {
        "none / no retries",
        "none / naive",
        "predictive / no retries",
        "predictive / naive",
    }
