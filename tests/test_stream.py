"""A run streamed to parquet in row groups (qsim.stream) writes simulate's rows for the same
trace and server."""

import dataclasses

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from qsim import (
    PRESETS,
    Batching,
    ServerConfig,
    StepModel,
    from_arrays,
    make_trace,
    records,
    simulate,
)
from qsim.engines import OneAtATime
from qsim.fleet import FleetSpec
from qsim.routers import Central, JoinShortestQueue, LeastKV, PowerOfD
from qsim.clients import Patience, RetryPolicy
from qsim.config import StallRule
from qsim.policy import resolve
from qsim.service import SpeedSchedule
from qsim.stream import RecordWriter, simulate_to_parquet, stream_run
from qsim.mixes import Prompts, UsedShare
from qsim.workload import plan_trace

BATCHING = Batching(
    StepModel(0.005, 2e-5, 3e-4, 1e-6), max_num_seqs=8, max_num_batched_tokens=256, kv_blocks=200
)


def streamed(tmp_path, source, config, **options) -> tuple[pd.DataFrame, object]:
    path = tmp_path / "records.parquet"
    info = simulate_to_parquet(source, path, config, **options)
    return pd.read_parquet(path), info


def assert_same_rows(got: pd.DataFrame, want: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(got, want.reset_index(drop=True), check_exact=True)


CASES = {
    "predictive past capacity": (
        dict(arrivals="poisson", seconds=120.0, load=1.3),
        ServerConfig(PRESETS["predictive"]),
    ),
    "three engines, no control": (
        dict(arrivals="poisson", requests=1500, load=0.9),
        ServerConfig(PRESETS["none"], 3),
    ),
    # Clients leave while waiting and while running (their timers outlive their rows), a heap,
    # prompts.
    "impatient clients, EDF": (
        dict(
            arrivals="poisson",
            seconds=90.0,
            load=1.6,
            patience=Patience.parse("exponential:10"),
            prompts=Prompts.parse("uniform:0:50"),
        ),
        ServerConfig(PRESETS["predictive-edf"], 2),
    ),
    "patience while waiting": (
        dict(
            arrivals="gamma:2",
            seconds=90.0,
            load=1.4,
            patience=Patience.parse("exponential:10", "start"),
        ),
        ServerConfig(PRESETS["bounded"]),
    ),
    "cut at the deadline, early stops": (
        dict(arrivals="poisson", seconds=90.0, load=1.5, used=UsedShare()),
        ServerConfig(resolve("none", {"cancel_at_deadline": True}), 2),
    ),
    "a burst": (dict(arrivals="burst:900", requests=1), ServerConfig(PRESETS["bounded-deadline"])),
    "engines that slow each other": (
        dict(arrivals="poisson", seconds=60.0, load=1.2, engines=3),
        ServerConfig(PRESETS["predictive"], OneAtATime(3, concurrency=0.3)),
    ),
    "periodic bursts at a load": (
        dict(arrivals="periodic:5", seconds=60.0, load=1.2),
        ServerConfig(PRESETS["predictive"]),
    ),
    "batching": (
        dict(
            arrivals="poisson",
            seconds=40.0,
            load=8.0,
            used=UsedShare(),
            prompts=Prompts.parse("uniform:0:120"),
        ),
        ServerConfig(PRESETS["predictive"], BATCHING),
    ),
    "batching, cut, impatient, step noise": (
        dict(
            arrivals="poisson", seconds=40.0, load=12.0, patience=Patience.parse("exponential:0.5")
        ),
        ServerConfig(
            resolve("predictive-kv", {"cancel_at_deadline": True}),
            dataclasses.replace(BATCHING, step=StepModel(0.005, 2e-5, 3e-4, 1e-6, cv=0.4)),
            seed=3,
        ),
    ),
}


def row_groups(path) -> list[int]:
    metadata = pq.ParquetFile(path).metadata
    return [metadata.row_group(k).num_rows for k in range(metadata.num_row_groups)]


@pytest.mark.parametrize("size", [64, 1000])
@pytest.mark.parametrize("case", list(CASES))
def test_a_streamed_run_writes_simulates_rows(tmp_path, case, size):
    options, config = CASES[case]
    want = simulate(make_trace(**options), config)
    got, info = streamed(tmp_path, plan_trace(**options).chunks(size), config, row_group=150)
    assert_same_rows(got, want)
    records.validate(got)
    groups = row_groups(tmp_path / "records.parquet")
    assert (
        info.rows == len(want) == sum(groups)
        and set(groups[:-1]) <= {150}
        and 0 < groups[-1] <= 150
    )
    assert (info.duration_s, info.policy, info.engines, info.speed_factor) == (
        want.attrs["duration_s"],
        want.attrs["policy"],
        want.attrs["engines"],
        want.attrs["speed_factor"],
    )


def test_the_window_holds_a_few_chunks_however_long_the_trace(tmp_path):
    chunks = plan_trace("poisson", requests=20_000, load=1.3, seed=1).chunks(500)
    _, info = streamed(tmp_path, chunks, PRESETS["predictive"], row_group=3000)
    assert info.rows == 20_000 and info.slots <= 4 * 500
    assert row_groups(tmp_path / "records.parquet") == [3000] * 6 + [2000]


def test_a_trace_in_memory_streams_in_chunks_of_the_size_asked(tmp_path):
    trace = make_trace("poisson", seconds=60.0, load=1.2, seed=7)
    schedule = SpeedSchedule(1.0, ((0.0, 1.0), (20.0, 1.6), (40.0, 1.0)))
    config = ServerConfig(PRESETS["predictive"], 2)
    got, info = streamed(tmp_path, trace, config, speed_schedule=schedule, chunk=100, row_group=250)
    assert_same_rows(got, simulate(trace, config, speed_schedule=schedule))
    assert info.slots % 100 == 0 and info.slots <= 400
    groups = row_groups(tmp_path / "records.parquet")
    assert set(groups[:-1]) == {250} and sum(groups) == len(trace)


def test_a_stalled_engine_streams_as_it_runs_in_memory(tmp_path):
    trace = from_arrays(
        np.arange(300) * 0.05,
        np.full(300, 16),
        true_service_s=np.where(np.arange(300) % 97 == 5, 60.0, 0.137),
    )
    config = ServerConfig(PRESETS["bounded-deadline"], 2, stall=StallRule(10.0, 5.0))
    got, _ = streamed(tmp_path, trace, config, chunk=16)
    want = simulate(trace, config)
    assert "error" in set(want["outcome"])
    assert_same_rows(got, want)


def test_several_runs_share_one_file_with_their_own_columns(tmp_path):
    path = tmp_path / "seeds.parquet"
    traces = [make_trace("poisson", seconds=30.0, load=1.3, seed=s) for s in (1, 2)]
    with RecordWriter(path) as writer:
        for seed, trace in zip((1, 2), traces):
            stream_run(
                trace,
                writer,
                PRESETS["predictive"],
                chunk=50,
                columns={"seed": seed, "policy": "predictive"},
            )
    want = pd.concat(
        [
            simulate(t, PRESETS["predictive"]).assign(seed=s, policy="predictive")
            for s, t in zip((1, 2), traces)
        ],
        ignore_index=True,
    )
    pd.testing.assert_frame_equal(pd.read_parquet(path), want, check_exact=True)


def test_a_row_group_holds_a_whole_number_of_rows(tmp_path):
    with pytest.raises(ValueError, match="whole number >= 1 of rows"):
        simulate_to_parquet(make_trace("poisson", requests=10), tmp_path / "x.parquet", row_group=0)


def test_no_requests_give_an_empty_file_of_the_schema(tmp_path):
    got, info = streamed(tmp_path, make_trace("poisson", requests=5).rows(0, 0), PRESETS["none"])
    assert info.rows == 0 and len(got) == 0 and list(got.columns) == list(records.COLUMNS)


def test_a_path_that_cannot_be_written_is_a_clear_error_before_the_run(tmp_path):
    trace = make_trace("poisson", requests=10)
    with pytest.raises(
        ValueError, match="cannot write records to .*missing.*No such file or directory"
    ):
        simulate_to_parquet(trace, tmp_path / "missing" / "out.parquet")
    with pytest.raises(ValueError, match="it is a directory"):
        simulate_to_parquet(trace, tmp_path)


def test_a_failed_run_leaves_no_file(tmp_path):
    path = tmp_path / "out.parquet"
    unsorted = from_arrays(np.r_[np.arange(100) * 0.1, [0.5]], np.full(101, 4))
    with pytest.raises(ValueError, match="sorted"):
        simulate_to_parquet(unsorted, path, chunk=10)
    assert list(tmp_path.iterdir()) == []


def test_retries_do_not_stream(tmp_path):
    with pytest.raises(ValueError, match="do not stream"):
        simulate_to_parquet(
            make_trace("poisson", requests=10),
            tmp_path / "x.parquet",
            retry=RetryPolicy("fixed", max_attempts=3),
        )
    assert list(tmp_path.iterdir()) == []


def test_a_run_whose_client_left_keeps_its_slot_until_its_engine_is_free(tmp_path):
    """Rows are written when they end, but a run goes on after its client left: its engine reads the
    slot at its end (what it reports teaches the speed tracker), so the slot is not reused before
    then."""
    n = 1200
    slow = np.arange(n) % 100 == 3  # 5 s runs whose clients leave after 1 s, among 0.1 s ones
    trace = from_arrays(
        np.arange(n) * 0.05, np.full(n, 16), true_service_s=np.where(slow, 5.0, 0.1)
    )
    trace = dataclasses.replace(trace, patience_s=np.where(slow, 1.0, np.inf))
    config = ServerConfig(PRESETS["none"], 3)
    want = simulate(trace, config)
    assert set(want.loc[slow, "outcome"]) == {"abandoned"}
    got, info = streamed(tmp_path, trace, config, chunk=16)
    assert_same_rows(got, want)
    assert info.speed_factor == want.attrs["speed_factor"]


FLEETS = {
    # Early binding by queue length, replicas of unequal speeds, one down for a while.
    "jsq, speeds, a replica down": (
        dict(arrivals="poisson", seconds=60.0, load=1.3, engines=3),
        ServerConfig(PRESETS["predictive"]),
        FleetSpec(3, JoinShortestQueue(), (1.0, 1.0, 0.5), ((1, 10.0, 30.0),)),
    ),
    "central queue, two engines a replica": (
        dict(arrivals="poisson", seconds=60.0, load=1.2, engines=6),
        ServerConfig(PRESETS["bounded-deadline"], 2),
        FleetSpec(3, Central()),
    ),
    "batching replicas, power of 2, one down": (
        dict(arrivals="poisson", seconds=30.0, load=20.0, prompts=Prompts.parse("uniform:0:120")),
        ServerConfig(PRESETS["predictive-kv"], BATCHING),
        FleetSpec(3, PowerOfD(2), None, ((2, 5.0, 15.0),)),
    ),
    "batching replicas, central, speeds, one down": (
        dict(arrivals="poisson", seconds=30.0, load=20.0, prompts=Prompts.parse("uniform:0:120")),
        ServerConfig(PRESETS["predictive"], BATCHING),
        FleetSpec(3, Central(), (1.0, 1.0, 0.5), ((1, 5.0, 12.0),)),
    ),
    "batching replicas, least KV, speeds": (
        dict(arrivals="poisson", seconds=30.0, load=20.0, used=UsedShare()),
        ServerConfig(PRESETS["predictive"], BATCHING, seed=4),
        FleetSpec(2, LeastKV(), (1.0, 0.6)),
    ),
}


@pytest.mark.parametrize("case", list(FLEETS))
def test_a_streamed_fleet_run_writes_simulates_rows(tmp_path, case):
    options, config, fleet = FLEETS[case]
    want = simulate(
        make_trace(**options),
        config,
        replicas=fleet.replicas,
        router=fleet.router,
        replica_speeds=fleet.speeds,
        replica_down=fleet.down,
    )
    assert want["replica"].nunique() == fleet.replicas  # every replica ran something
    got, info = streamed(
        tmp_path, plan_trace(**options).chunks(64), config, row_group=150, fleet=fleet
    )
    assert_same_rows(got, want)
    records.validate(got)
    assert info.rows == len(want)
