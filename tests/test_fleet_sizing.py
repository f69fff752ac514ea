"""Fleets everywhere a run is described: sweep axes (replicas, router), qlab capacity for a fleet,
sizing (the fewest replicas at a rate) and --rate."""

import pandas as pd
import pytest

from experiments import config, sweep

FLEET = """
[sweep]
duration_s = 20
seeds = 2
service_dist = "exponential"
mean_service_s = 1.0
[grid]
policy = ["none"]
load = [0.8]
replicas = [2, 4]
router = ["random", "power_of_d", "central"]
"""


def load_text(tmp_path, text):
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return config.load(path)


def rows(out):
    frame = pd.read_parquet(out / "cells")
    return frame.sort_values(["cell_id", "request_id"]).reset_index(drop=True)


@pytest.mark.slow
def test_a_fleet_sweep_gives_the_same_rows_with_any_number_of_workers(tmp_path):
    cfg = load_text(tmp_path, FLEET)
    sweep.run(cfg, tmp_path / "one", workers=1, quiet=True)
    sweep.run(cfg, tmp_path / "two", workers=2, quiet=True)
    pd.testing.assert_frame_equal(rows(tmp_path / "one"), rows(tmp_path / "two"))


def test_a_sweep_over_replicas_and_routers_writes_the_replica_column(tmp_path):
    cfg = load_text(tmp_path, FLEET)
    one = sweep.run(cfg, tmp_path / "one", workers=1, quiet=True)
    assert len(one) == 2 * 3 * 2 and one["cell_id"].is_unique
    frame = rows(tmp_path / "one")
    early = frame[frame["router"] != "central"]
    assert early["replica"].between(0, early["replicas"] - 1).all()
    assert set(frame["replica"].dropna()) == {0, 1, 2, 3}
    # Common random numbers: each seed's requests are the same whatever the router.
    for _, part in frame.groupby(["replicas", "seed"]):
        arrivals = part.groupby("router")["arrival_s"].apply(lambda s: tuple(s.round(9)))
        assert arrivals.nunique() == 1
    # The load is each replica's: 4 replicas take twice the rate of 2.
    rate = one.groupby("replicas")["capacity_rps"].first()
    assert rate[4] == 2 * rate[2] == 4.0
    assert one["jain_replicas"].between(0, 1).all() and (one["load_imbalance"] >= 1).all()


def test_a_config_without_fleet_axes_keeps_its_cells():
    cfg = config.load("docs/examples/tiny.toml")
    assert all(c.replicas is None and c.router is None for c in sweep.cells(cfg))
    assert [c.id for c in sweep.cells(cfg)][:1] == ["57010b41f132e792"]


@pytest.mark.parametrize("grid, says", [
    ('router = ["random"]', "add grid.replicas"),
    ('replicas = [2]\nrouter = ["fastest"]', "unknown router"),
    ('replicas = [2]\nrouter = ["power_of_d:3"]', "3 choices among 2 replicas"),
    ('replicas = [0]', "replicas"),
])
def test_bad_fleet_axes_are_refused_before_anything_runs(tmp_path, grid, says):
    text = f'[sweep]\nduration_s = 5\n[grid]\npolicy = ["none"]\nload = [0.5]\n{grid}\n'
    with pytest.raises(config.ConfigError, match=says):
        load_text(tmp_path, text)


def test_a_fleet_of_batching_replicas_is_refused(tmp_path):
    text = '[grid]\npolicy = ["none"]\nload = [0.5]\nreplicas = [2]\n[batching]\nb0 = 0.01\n'
    with pytest.raises(config.ConfigError, match="batching replicas"):
        load_text(tmp_path, text)
