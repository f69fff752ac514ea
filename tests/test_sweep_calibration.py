"""A sweep's [service] file and ``qlab capacity --service-model``: a calibration's line, load terms
and step model.

The calibration file is read once, with the config: its cells are those of the same settings given
inline (same digest, same cell ids, same rows), on any executor.
"""

import json
from pathlib import Path

import pandas as pd
import pytest

from experiments import capacity_cli, config, sweep
from experiments.cli import main
from qsim.engines import StepModel

LINE = {"intercept_s": 0.002, "per_token_s": 0.009, "per_prompt_token_s": 0.0001}
LOAD = {"concurrency": 0.25, "noise_cv": 0.3}
STEP = {"b0": 0.006, "b1": 4e-05, "b2": 0.0002, "b3": 2e-07, "cv": 0.1}

# Two engines that slow each other, prompts (so the prefill term counts), noise: every term reaches
# the rows.
GRID = """
[grid]
policy = ["bounded", "predictive"]
load = [1.2]
engines = [2]
"""
HEAD = """
[sweep]
name = "calibrated"
duration_s = 30
seeds = 2
prompts = "fixed:200"
"""
BATCHING = """
[sweep]
name = "batching"
duration_s = 20
seeds = 1
[batching]
max_num_seqs = 8
[grid]
policy = ["bounded"]
load = [1.5]
"""


def calibration(folder: Path, step: bool = False) -> Path:
    path = folder / "cal.json"
    path.write_text(json.dumps({"model": LINE, "load": LOAD, **({"step": STEP} if step else {})}))
    return path


def write(folder: Path, text: str, name: str = "s.toml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def inline(terms: dict) -> str:
    return "\n".join(f"{k} = {v!r}" for k, v in terms.items())


def rows(cfg, out) -> pd.DataFrame:
    sweep.run(cfg, out, workers=1, quiet=True)
    return (
        pd.read_parquet(Path(out) / "cells")
        .sort_values(["cell_id", "request_id"])
        .reset_index(drop=True)
    )


def test_a_calibration_file_is_its_settings_inline(tmp_path):
    calibration(tmp_path)
    by_file = config.load(write(tmp_path, HEAD + '[service]\nfile = "cal.json"\n' + GRID))
    assert (by_file.service.per_prompt_token_s, by_file.concurrency, by_file.noise_cv) == (
        0.0001,
        0.25,
        0.3,
    )
    explicit = config.load(
        write(
            tmp_path,
            HEAD + "noise_cv = 0.3\n[service]\n" + inline({**LINE, "concurrency": 0.25}) + GRID,
            "inline.toml",
        )
    )
    # the terms decide the cells, not where they were written
    assert by_file.digest == explicit.digest
    got = rows(by_file, tmp_path / "file")
    pd.testing.assert_frame_equal(got, rows(explicit, tmp_path / "inline"))
    # The engines did slow each other: without the concurrency term the same seeds give other rows.
    alone = config.load(
        write(tmp_path, HEAD + "noise_cv = 0.3\n[service]\n" + inline(LINE) + GRID, "alone.toml")
    )
    assert not got["latency_s"].equals(rows(alone, tmp_path / "alone")["latency_s"])
    manifest = json.loads((tmp_path / "file" / "manifest.json").read_text())
    assert manifest["calibration"] == {
        "file": str(tmp_path / "cal.json"),
        "model": LINE,
        "load": LOAD,
        "step": None,
    }
    assert manifest["config"]["concurrency"] == 0.25 and manifest["config"]["noise_cv"] == 0.3
    assert "calibration" not in json.loads((tmp_path / "inline" / "manifest.json").read_text())


def test_a_noise_cv_given_wins_over_the_calibrations(tmp_path):
    calibration(tmp_path)
    cfg = config.load(
        write(tmp_path, HEAD + 'noise_cv = 0.05\n[service]\nfile = "cal.json"\n' + GRID)
    )
    assert cfg.noise_cv == 0.05 and cfg.concurrency == 0.25


def test_a_batching_sweep_takes_the_calibrated_step_model_unless_it_gives_one(tmp_path):
    calibration(tmp_path, step=True)
    service = '[service]\nfile = "cal.json"\n'
    by_file = config.load(write(tmp_path, service + BATCHING + "[steps.slow]\nb0 = 0.02\n"))
    assert by_file.engine().step == StepModel(**STEP) and by_file.steps["slow"] == StepModel(
        **{**STEP, "b0": 0.02}
    )
    assert by_file.concurrency == 0.0  # a batch's requests share steps: no concurrency term
    explicit = config.load(
        write(
            tmp_path,
            "[service]\n"
            + inline(LINE)
            + BATCHING.replace("max_num_seqs = 8", "max_num_seqs = 8\n" + inline(STEP)).replace(
                "seeds = 1", "seeds = 1\nnoise_cv = 0.3"
            )
            + "[steps.slow]\nb0 = 0.02\n",
            "inline.toml",
        )
    )
    assert by_file.digest == explicit.digest
    pd.testing.assert_frame_equal(
        rows(by_file, tmp_path / "file"), rows(explicit, tmp_path / "inline")
    )
    own = config.load(
        write(
            tmp_path,
            service + BATCHING.replace("max_num_seqs = 8", "max_num_seqs = 8\nb0 = 0.02"),
            "own.toml",
        )
    )
    # [batching]'s own step model wins, as --step does
    assert own.engine().step == StepModel(b0=0.02)


@pytest.mark.parametrize(
    "service, message",
    [
        ('file = "nope.json"', "service.file: "),
        ('file = "bad.json"', "cannot read a service model"),
        (
            'file = "cal.json"\nper_token_s = 0.01',
            "service.file and service.per_token_s exclude each other",
        ),
        ("file = 3", "service.file: expected str"),
        ("concurrency = -0.1", "service.concurrency: must be >= 0"),
    ],
)
def test_a_bad_service_table_is_one_line_and_exit_2(service, message, tmp_path, capsys):
    calibration(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    path = write(tmp_path, f"[service]\n{service}\n" + GRID)
    assert main(["sweep", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and message in err
        and "Traceback" not in err
        and not (tmp_path / "o").exists()
    )


def test_inline_concurrency_with_a_batching_engine_is_refused(tmp_path):
    with pytest.raises(
        config.ConfigError, match="service.concurrency slows engines that run one request at a time"
    ):
        config.load(write(tmp_path, "[service]\nconcurrency = 0.2\n" + BATCHING))


def _capacity(argv):
    from experiments.cli import build_parser

    base = ["capacity", "--policy", "bounded", "--objective", "share_good>=0.9", "--out", "unused"]
    return capacity_cli.config_from_args(build_parser().parse_args([*base, *argv]))


def test_capacity_reads_the_calibrations_terms(tmp_path):
    path = str(calibration(tmp_path, step=True))
    cfg = _capacity(["--service-model", path, "--engines", "2"])
    assert (cfg.service.per_prompt_token_s, cfg.concurrency, cfg.noise_cv) == (0.0001, 0.25, 0.3)
    assert cfg.calibration.file == str(Path(path).resolve())
    assert _capacity(["--service-model", path, "--noise", "0.1"]).noise_cv == 0.1
    batching = _capacity(["--service-model", path, "--batching"])
    assert batching.engine().step == StepModel(**STEP) and batching.concurrency == 0.0
    assert _capacity(
        ["--service-model", path, "--batching", "--step", "0.02,0,0,0"]
    ).engine().step == StepModel(0.02, 0, 0, 0)
    # Without a calibration, --concurrency slows the search's engines (the refusal is lifted).
    assert _capacity(["--concurrency", "0.4", "--engines", "2"]).concurrency == 0.4
    assert _capacity([]).concurrency == 0.0 and _capacity([]).noise_cv == 0.0


def test_capacity_with_a_calibration_and_concurrency_is_one_line(tmp_path, capsys):
    argv = [
        "capacity",
        "--policy",
        "none",
        "--objective",
        "share_good>=0.9",
        "--out",
        str(tmp_path / "o"),
        "--service-model",
        str(calibration(tmp_path)),
        "--concurrency",
        "0.1",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "--concurrency with --service-model" in err
        and not (tmp_path / "o").exists()
    )


@pytest.mark.slow  # worker processes; then a Dask cluster of them
def test_same_rows_with_a_calibration_on_every_executor(tmp_path):
    distributed = pytest.importorskip("distributed")
    calibration(tmp_path)
    cfg = config.load(write(tmp_path, HEAD + '[service]\nfile = "cal.json"\n' + GRID))
    one = rows(cfg, tmp_path / "one")
    sweep.run(cfg, tmp_path / "pool", workers=2, quiet=True)
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as cluster:
        sweep.run(cfg, tmp_path / "dask", scheduler=cluster.scheduler_address, quiet=True)
    for other in ("pool", "dask"):
        got = (
            pd.read_parquet(tmp_path / other / "cells")
            .sort_values(["cell_id", "request_id"])
            .reset_index(drop=True)
        )
        pd.testing.assert_frame_equal(one, got)
