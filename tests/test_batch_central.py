"""A central queue in front of batching replicas (qsim.batch_fleet): one line at the fleet's gate,
each request bound to a replica only when that replica takes it into its batch (late binding).

Checked: with one replica it is the one batching server, record for record; no replica between
steps has a free seat and the KV blocks for the line's head while it waits (checked at every step
and arrival on the virtual clock), and one FIFO line starts its requests in arrival order; against
early binding (jsq) on the same trace past capacity with replicas of two speeds, the line gives
every request the fleet's wait where jsq makes those behind a slow replica wait longer; a replica
down fails only what it holds, one draining finishes its batch and starts nothing new; the same seed
gives the same rows; and the command line runs it.
"""

import dataclasses
from contextlib import contextmanager

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsim import PRESETS, ServerConfig, make_trace, records, simulate, testing
from qsim.batch_fleet import CentralBatch
from qsim.engines import Batching, FrontEnd, OneAtATime
from qsim.routers import Central, make_router
from qsim.mixes import Prompts, SharedPrefix

BATCH = Batching(max_num_seqs=8, kv_blocks=400)
SLOW_HALF = (1, 1, 0.5, 0.5)  # two replicas at half speed: the fleet serves 3/4 of 4 at speed 1


def trace(load=0.9, replicas=4, requests=3000, seed=1, engine=BATCH, **options):
    """Prompts of 16 to 256 tokens at ``load`` on ``replicas`` replicas of ``engine`` (speed 1)."""
    return make_trace(
        load=load,
        requests=requests,
        seed=seed,
        prompts=Prompts.parse("uniform:16:256"),
        capacity_rps=replicas * engine.capacity_rps(136, 20),
        **options,
    )


def waits(frame: pd.DataFrame) -> pd.Series:
    return frame["start_s"] - frame["arrival_s"]


# ---------------------------------------------------------------- (a) one replica: the one server

ONE_SERVER = [  # (policy, discipline, front end): what admission reads, its line, the intake
    ("none", "fifo", None),
    ("predictive", "fifo", None),
    ("vllm-caps", "edf", None),
    ("bounded", "lifo", None),
    ("predictive-kv", "codel", None),
    ("predictive", "fair", None),
    ("predictive", "sjf", FrontEnd(0.002, 0.0001, 0.0005)),
]


@pytest.mark.parametrize("policy, discipline, front_end", ONE_SERVER)
def test_one_replica_behind_a_central_queue_is_the_one_batching_server(
    policy, discipline, front_end
):
    # A speed of 1 takes the fleet's path (the central line, its admission, each replica pulling
    # from it) for one replica: every column is the engine's without a fleet, with preemptions
    # (a small KV cache), a prefix cache, step noise, cuts at the deadline and clients leaving.
    # ``replica`` says where a request started: <NA> for one that never did (the one server
    # writes 0 for every row).
    engine = Batching(
        max_num_seqs=8,
        kv_blocks=120,
        prefix_caching=True,
        front_end=front_end,
        step=dataclasses.replace(Batching().step, cv=0.3),
    )
    config = ServerConfig(
        dataclasses.replace(PRESETS[policy], discipline=discipline, cancel_at_deadline=True),
        engine,
        seed=4,
    )
    t = trace(1.5, 1, 500, seed=2, engine=engine, prefixes=SharedPrefix.parse("64:0.5", "3:8"))
    patience = np.random.default_rng(0).exponential(3.0, len(t))
    plain = simulate(t, config, cancel_after_s=patience)
    one = records.validate(
        simulate(
            t, config, replicas=1, router=Central(), replica_speeds=[1], cancel_after_s=patience
        )
    )
    pd.testing.assert_frame_equal(plain.drop(columns="replica"), one.drop(columns="replica"))
    started = one["start_s"].notna()
    assert (one.loc[started, "replica"] == 0).all() and one.loc[~started, "replica"].isna().all()
    assert one.attrs["router"] == "central" and one["preemptions"].gt(0).any()
    assert one["outcome"].isin(["abandoned"]).any() and started.mean() < 1


# ---------------------------------------------------------------- (b) nobody waits beside room


def _head(central: CentralBatch):
    """The line's head: pulled already, or a FIFO's first."""
    if central.front:
        return central.front[0]
    return central.seq_of[id(central.waiting[0])] if len(central.waiting) else None


def _idle_with_room(central: CentralBatch) -> list[int]:
    """The replicas up, between steps (none planned, none being woken), nothing of their own
    preempted waiting, with a free seat and the blocks for the line's head."""
    head = _head(central)
    if head is None:
        return []
    return [
        r
        for r, q in enumerate(central.lines)
        if central.up[r] and q.plan is None and not q.waking and not q.front and q._has_room(head)
    ]


@contextmanager
def watched(broken: list):
    """While in this block, after every step a replica plans (and every line change that may
    wake one: a client leaving the line, a replica back) and after every arrival, note in
    ``broken`` each (time, replica) that sits with room for the line's head while it waits, and
    each arrival that waited although the line was empty and a replica had room for it."""
    dispatch, arrive = CentralBatch.dispatch, CentralBatch.arrive

    def checked_dispatch(self, now, planned=None):
        dispatch(self, now, planned)
        self.audit()
        broken.extend((now, r) for r in _idle_with_room(self))

    def checked_arrive(self, req, now, *args, **kwargs):
        empty = not self.line_queued
        refusal = arrive(self, req, now, *args, **kwargs)
        if refusal is None and empty and self.line_queued:  # it waits: nobody had room for it
            seq = _head(self)
            broken.extend(
                (now, r)
                for r, q in enumerate(self.lines)
                if self.up[r] and not q.queued and q._has_room(seq)
            )
        broken.extend((now, r) for r in _idle_with_room(self))
        return refusal

    CentralBatch.dispatch, CentralBatch.arrive = checked_dispatch, checked_arrive
    try:
        yield
    finally:
        CentralBatch.dispatch, CentralBatch.arrive = dispatch, arrive


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    replicas=st.integers(2, 4),
    seqs=st.sampled_from([1, 2, 4]),
    kv_blocks=st.sampled_from([30, 60, 400]),
    load=st.sampled_from([0.7, 1.5, 3.0]),
    caching=st.booleans(),
    chunked=st.booleans(),
    slow=st.booleans(),
    leave=st.booleans(),
    down=st.booleans(),
)
def test_no_replica_has_room_while_a_request_that_fits_waits(
    seed, replicas, seqs, kv_blocks, load, caching, chunked, slow, leave, down
):
    engine = Batching(
        max_num_seqs=seqs,
        kv_blocks=kv_blocks,
        prefix_caching=caching,
        chunked_prefill=chunked,
        max_num_batched_tokens=512,
    )
    config = ServerConfig(PRESETS["none"], engine, seed=seed)
    t = trace(load, replicas, 300, seed=seed, engine=engine)
    speeds = [1.0 / (1 + r % 2) for r in range(replicas)] if slow else None
    patience = np.random.default_rng(seed).exponential(2.0, len(t)) if leave else None
    window = [(1, float(t.arrival_s[50]), float(t.arrival_s[150]))] if down else ()
    broken: list = []
    with watched(broken), testing.audited_batches():  # each replica's books, at every step
        frame = records.validate(
            simulate(
                t,
                config,
                replicas=replicas,
                router=Central(),
                replica_speeds=speeds,
                cancel_after_s=patience,
                replica_down=window,
            )
        )
    assert broken == []
    # One FIFO line: what starts, starts in arrival order (wherever it binds).
    started = frame[frame["start_s"].notna()]
    assert started["start_s"].is_monotonic_increasing
    assert started["replica"].between(0, replicas - 1).all()
    assert frame["replica"].isna().eq(frame["start_s"].isna()).all()


# ---------------------------------------------------------------- (c) late against early binding


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_late_binding_gives_every_request_the_fleets_wait_where_jsq_queues_behind_slow_replicas(
    seed,
):
    # Four replicas, two at half speed, at 0.9 of four full-speed replicas' capacity: 1.2 of what
    # this fleet serves. jsq evens out the requests outstanding, so a request routed to a slow
    # replica waits behind as many as one at a fast replica, served at half the pace: its wait is
    # about twice as long. The central line binds each request to whichever replica frees a seat
    # first: its wait is its place in the one line, whatever replica it ends up on.
    t = trace(0.9, seed=seed)
    config = ServerConfig(PRESETS["none"], BATCH, seed=seed)
    late, early = (
        simulate(t, config, replicas=4, router=make_router(name), replica_speeds=SLOW_HALF)
        for name in ("central", "jsq")
    )
    assert waits(late).quantile(0.99) <= 0.8 * waits(early).quantile(0.99)
    by_late = waits(late).groupby(late["replica"]).mean()
    by_early = waits(early).groupby(early["replica"]).mean()
    slow_over_fast = by_early[[2, 3]].mean() / by_early[[0, 1]].mean()
    assert slow_over_fast > 1.5  # jsq: those behind a slow replica wait longer
    assert by_late.max() <= 1.15 * by_late.min()  # the line: the same wait wherever it runs
    assert late["outcome"].eq("good").mean() >= early["outcome"].eq("good").mean()
    # The fast replicas take twice what the slow ones do under the line (they free seats twice
    # as often); jsq sends about as many to each.
    count = late["replica"].value_counts()
    assert count[[0, 1]].sum() > 1.7 * count[[2, 3]].sum()


def test_a_replica_down_fails_only_what_is_bound_to_it():
    # Replica 1 is down from arrival 1000 to arrival 2000. Under jsq what waited in its line
    # fails with it (shutting_down); under the central line nothing waiting is bound anywhere,
    # so only its batch fails (engine_exception), and nothing starts there while it is down.
    t = trace(0.9, seed=1)
    config = ServerConfig(PRESETS["none"], BATCH, seed=1)
    window = (1, float(t.arrival_s[1000]), float(t.arrival_s[2000]))
    late, early = (
        records.validate(
            simulate(
                t,
                config,
                replicas=4,
                router=make_router(name),
                replica_speeds=SLOW_HALF,
                replica_down=[window],
            )
        )
        for name in ("central", "jsq")
    )
    failed = late[late["outcome"] == "error"]
    assert len(failed) > 0 and set(failed["replica"]) == {1}
    assert set(failed["reason"]) == {"engine_exception"}
    assert early["reason"].eq("shutting_down").sum() > 0
    started_there = late["start_s"].between(window[1], window[2], inclusive="left") & late[
        "replica"
    ].eq(1)
    assert not started_there.any() and late["replica"].eq(1).sum() > 0


def test_a_draining_replica_behind_the_line_finishes_its_batch_and_starts_nothing_new():
    # Replica 1 drains from arrival 1000 to arrival 2000: what its batch holds then runs to its
    # end there (no error anywhere), nothing starts there until the window ends, and afterwards
    # it takes from the line again.
    t = trace(0.9, seed=1)
    config = ServerConfig(PRESETS["none"], BATCH, seed=1)
    _, at, back = window = (1, float(t.arrival_s[1000]), float(t.arrival_s[2000]))
    with testing.audited_batches():
        frame = records.validate(
            simulate(t, config, replicas=4, router=Central(), replica_drain=[window])
        )
    assert not frame["outcome"].eq("error").any()
    there = frame["replica"].eq(1)
    assert not (there & frame["start_s"].between(at, back, inclusive="left")).any()
    held = frame[there & (frame["start_s"] < at) & (frame["finish_s"] > at)]
    assert len(held) and held["outcome"].isin(["good", "late"]).all()
    assert (there & (frame["start_s"] >= back)).sum() > 0


def test_one_replica_of_its_own_kv_blocks_behind_the_line_is_the_engine_of_that_size():
    config = ServerConfig(PRESETS["predictive"], BATCH, seed=2)
    t = trace(1.5, 1, 500, seed=2)
    one = simulate(t, config, replicas=1, router=Central(), replica_kv_blocks=[40])
    engine = simulate(t, config.replace(engine=dataclasses.replace(BATCH, kv_blocks=40)))
    pd.testing.assert_frame_equal(engine.drop(columns="replica"), one.drop(columns="replica"))
    assert one["preemptions"].gt(0).any()


@pytest.mark.parametrize("router, admission", [("central", "replica"), ("jsq", "gate")])
def test_the_gate_refuses_what_the_smallest_replica_could_never_hold(router, admission):
    # Replica 3 holds 12 blocks (192 tokens): the line (or the gate, before routing) may place a
    # request on any replica, so it refuses one whose prompt and limit need more, as that replica
    # alone would; bound there, it would be preempted over and over and never end. What it
    # admits ends once, and the small replica takes fewer than the others.
    t = trace(0.9, seed=1, requests=1500)
    config = ServerConfig(PRESETS["none"], BATCH, seed=1)
    with testing.audited_batches():
        frame = records.validate(
            simulate(
                t,
                config,
                replicas=4,
                router=make_router(router),
                admission_at=admission,
                replica_kv_blocks=[400, 400, 400, 12],
            )
        )
    assert len(frame) == len(t) and frame["outcome"].notna().all()
    refused = frame["reason"].eq("too_large")
    assert refused.any() and frame.loc[refused, "replica"].isna().all()
    assert frame.loc[~refused, "outcome"].isin(["good", "late"]).all()
    count = frame["replica"].value_counts()
    assert count[3] < 0.7 * count[[0, 1, 2]].min()
    plain = simulate(t, config, replicas=4, router=make_router(router), admission_at=admission)
    assert not plain["reason"].eq("too_large").any()


# ---------------------------------------------------------------- (d) determinism


def test_the_same_seed_gives_the_same_rows():
    engine = Batching(
        max_num_seqs=4,
        kv_blocks=80,
        prefix_caching=True,
        step=dataclasses.replace(Batching().step, cv=0.2),
    )
    config = ServerConfig(PRESETS["predictive"], engine, seed=5)
    t = trace(1.4, 3, 800, seed=5, engine=engine, prefixes=SharedPrefix.parse("64:0.5", "3:8"))
    patience = np.random.default_rng(5).exponential(3.0, len(t))
    runs = [
        simulate(
            t,
            config,
            replicas=3,
            router=Central(),
            replica_speeds=[1, 0.7, 0.5],
            cancel_after_s=patience,
        )
        for _ in range(2)
    ]
    pd.testing.assert_frame_equal(*runs)
    assert set(runs[0]["replica"].dropna()) == {0, 1, 2}
    other = simulate(
        t,
        dataclasses.replace(config, seed=6),
        replicas=3,
        router=Central(),
        replica_speeds=[1, 0.7, 0.5],
        cancel_after_s=patience,
    )
    assert not other["finish_s"].equals(runs[0]["finish_s"])  # the seed moves the step noise


# ---------------------------------------------------------------- refusals and the command line


def test_a_central_queue_of_engines_one_at_a_time_refuses_replica_speeds_and_downs():
    t = make_trace("poisson", load=0.5, engines=2, requests=50, seed=1)
    config = ServerConfig(PRESETS["none"], OneAtATime(1))
    with pytest.raises(
        ValueError,
        match="replica speeds: a central queue in front of engines "
        "one at a time is one line of N x K engines",
    ):
        simulate(t, config, replicas=2, router=Central(), replica_speeds=[1, 0.5])
    with pytest.raises(ValueError, match="a replica down: a central queue in front of engines"):
        simulate(t, config, replicas=2, router=Central(), replica_down=[(1, 1.0, 2.0)])


def qlab(args, capsys):
    from experiments.cli import main

    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_batching_replicas_behind_a_central_queue(capsys):
    code, out, err = qlab(
        [
            "simulate",
            "--batching",
            "--replicas",
            "4",
            "--router",
            "central",
            "--max-num-seqs",
            "8",
            "--replica-speeds",
            "1,1,0.5,0.5",
            "--load",
            "1.2",
            "--requests",
            "2000",
        ],
        capsys,
    )
    assert code == 0 and err == ""
    assert "4 replicas (speeds 1,1,0.5,0.5) behind router central of a batching engine" in out
    assert "by replica (router central):" in out


def test_capacity_sizes_batching_replicas_behind_a_central_queue(tmp_path, capsys):
    import json

    code, out, _ = qlab(
        [
            "capacity",
            "--policy",
            "none",
            "--objective",
            "share_good>=0.9",
            "--batching",
            "--max-num-seqs",
            "4",
            "--step",
            "0.01,0,0.0002,0",
            "--seconds",
            "30",
            "--seeds",
            "2",
            "--workers",
            "1",
            "--rate",
            "30",
            "--router",
            "central",
            "--router",
            "jsq",
            "--json",
            "--out",
            str(tmp_path),
        ],
        capsys,
    )
    assert code == 0
    found = {r["router"]: r for r in json.loads(out)}
    assert set(found) == {"central", "jsq"} and found["central"]["replicas"] >= 2
    assert found["central"]["replicas"] <= found["jsq"]["replicas"]
    rows = pd.read_parquet(tmp_path / "cells", columns=["router", "replica", "start_s"])
    central = rows[rows["router"] == "central"]
    assert central["replica"].isna().eq(central["start_s"].isna()).all()
