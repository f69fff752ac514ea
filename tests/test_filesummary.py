"""analysis.filesummary: a records file's summary in bounded memory equals metrics' of the frame."""

import math

import numpy as np
import pandas as pd
import pytest

from analysis import filesummary, metrics
from analysis.filesummary import FileSummary
from qsim import PRESETS, Batching, ServerConfig, StepModel, make_trace
from qsim.stream import simulate_to_parquet


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    assert all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a), (a, b)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 101, 4097])
def test_the_interpolation_is_numpys_to_the_last_bit(n):
    x = np.random.default_rng(n).lognormal(size=n)
    qs = (0.5, 0.9, 0.99)
    below, above, t = filesummary._ranks(n, qs)
    ordered = np.sort(x)
    assert (filesummary._lerp(ordered[below], ordered[above], t) == np.quantile(x, qs)).all()


@pytest.mark.parametrize(
    "engine",
    [None, Batching(StepModel(b0=0.008, b1=5e-5, b2=1e-4), max_num_seqs=64, kv_blocks=2000)],
)
@pytest.mark.parametrize("duration", [None, 0.0])
def test_a_file_summary_equals_metrics_of_its_frame(tmp_path, monkeypatch, engine, duration):
    # Small digits and gathers: several passes even over a few thousand rows.
    monkeypatch.setattr(filesummary, "COLLECT", 64)
    monkeypatch.setattr(filesummary, "BATCH", 1000)
    path = tmp_path / "r.parquet"
    trace = make_trace("poisson", load=1.3, requests=6000, seed=2)
    config = (
        ServerConfig(PRESETS["predictive"])
        if engine is None
        else ServerConfig(PRESETS["predictive"], engine)
    )
    simulate_to_parquet(trace, path, config, row_group=1000)
    frame = pd.read_parquet(path)
    stats = FileSummary(path, None, duration)
    _same(metrics.summary(frame, duration), stats.summary())
    pd.testing.assert_frame_equal(
        metrics.by_class(frame, duration), stats.by_class(), check_exact=True
    )
    assert stats.timed == (engine is not None)


def test_a_seed_of_a_shared_file_is_its_rows_alone(tmp_path):
    path = tmp_path / "r.parquet"
    trace = make_trace("poisson", load=1.3, requests=3000, seed=4)
    from qsim.stream import RecordWriter, stream_run

    with RecordWriter(path, row_group=700) as writer:
        for seed in (1, 2):
            stream_run(
                trace, writer, ServerConfig(PRESETS["bounded"], seed=seed), columns={"seed": seed}
            )
    rows = pd.read_parquet(path)
    for seed in (1, 2):
        mine = rows[rows["seed"] == seed].reset_index(drop=True)
        _same(
            metrics.summary(mine, trace.duration_s),
            FileSummary(path, seed, trace.duration_s).summary(),
        )
