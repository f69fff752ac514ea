"""Fleets (qsim.fleet) and routers (qsim.routers): N replicas of one server behind a router."""

import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd
import pytest

from qsim import PRESETS, Policy, from_arrays, make_trace, records, simulate, testing
from qsim.clients import RetryPolicy
from qsim.config import ServerConfig
from qsim.engines import Batching, OneAtATime
from qsim.outcomes import OUTCOMES
from qsim.routers import (
    ROUTERS,
    Central,
    JoinShortestQueue,
    LeastKV,
    LeastTTFT,
    LeastWork,
    PowerOfD,
    PrefixAffinity,
    Random,
    ReplicaState,
    RoundRobin,
    Router,
    Weighted,
    make_router,
)
from qsim.fleet import FleetSpec
from qsim.mixes import Prompts, SharedPrefix


#: The routers that route one-at-a-time replicas (the rest read a batching engine's memory).
PLAIN = [n for n in ROUTERS if not ROUTERS[n].needs_batching]
PLAIN_EARLY = [n for n in PLAIN if not ROUTERS[n].shared]


def trace(load=0.9, replicas=4, requests=3000, seed=3, service="exponential"):
    return make_trace(
        "poisson",
        service,
        load=load,
        engines=replicas,
        requests=requests,
        seed=seed,
        mean_service_s=1.0,
    )


def wait(frame):
    served = frame[frame["start_s"].notna()]
    return float((served["start_s"] - served["arrival_s"]).mean())


@pytest.mark.parametrize("router", [None, *ROUTERS])
def test_one_replica_is_the_one_server(router):
    t = trace(1.3, 2, 1500)
    config = ServerConfig(PRESETS["bounded-deadline"], 2)
    plain = simulate(t, config)
    one = simulate(t, config, replicas=1, router=None if router is None else make_router(router))
    pd.testing.assert_frame_equal(plain, one)
    assert (plain["replica"] == 0).all()


@pytest.mark.parametrize("router", PLAIN_EARLY)
def test_one_replica_through_the_fleets_own_path_is_the_one_server(router):
    # A speed of 1 takes the fleet's path (its line, its router, each run through _run_time).
    t = trace(1.3, 2, 1500)
    config = ServerConfig(PRESETS["bounded-deadline"], 2)
    d = 1 if router == "power_of_d" else None
    one = simulate(t, config, replicas=1, router=make_router(router, d), replica_speeds=[1])
    pd.testing.assert_frame_equal(simulate(t, config), one)


def test_central_is_the_shared_queue_of_every_engine():
    # Four replicas of two engines behind one line: today's --engines 8, the replica where each
    # request started.
    t = trace(1.2, 8, 3000)
    plain = simulate(t, ServerConfig(PRESETS["bounded"], 8))
    fleet = simulate(t, ServerConfig(PRESETS["bounded"], 2), replicas=4, router=Central())
    records.validate(fleet)
    pd.testing.assert_frame_equal(plain.drop(columns="replica"), fleet.drop(columns="replica"))
    started = fleet["start_s"].notna()
    assert (fleet.loc[started, "replica"] == fleet.loc[started, "engine"] // 2).all()
    assert fleet.loc[~started, "replica"].isna().all() and (~started).any()
    assert fleet.attrs["replicas"] == 4 and fleet.attrs["router"] == "central"


@pytest.mark.parametrize("name", PLAIN_EARLY)
def test_every_router_runs_valid_records_and_is_seeded(name):
    t = trace(0.9, 4, 2000)
    config = ServerConfig(PRESETS["bounded"], 1, seed=5)
    a = records.validate(simulate(t, config, replicas=4, router=make_router(name)))
    b = simulate(t, config, replicas=4, router=make_router(name))
    pd.testing.assert_frame_equal(a, b)
    assert a["replica"].between(0, 3).all()  # early binding: refused ones too have a replica
    assert (a.loc[a["start_s"].notna(), "engine"] == a.loc[a["start_s"].notna(), "replica"]).all()
    assert set(a["replica"]) == {0, 1, 2, 3}


def test_round_robin_deals_arrivals_in_turn():
    frame = simulate(
        trace(0.5, 3, 300), ServerConfig(PRESETS["none"]), replicas=3, router=RoundRobin()
    )
    assert frame["replica"].tolist() == [i % 3 for i in range(300)]


def test_the_routers_draws_are_their_own():
    # Common random numbers: a policy that refuses does not move the random router's choices, and
    # another server seed draws others.
    t = trace(1.5, 4, 2000)
    picks = [
        simulate(t, ServerConfig(PRESETS[p], 1, seed=2), replicas=4, router=Random())["replica"]
        for p in ("none", "bounded", "predictive")
    ]
    assert picks[0].equals(picks[1]) and picks[0].equals(picks[2])
    other = simulate(t, ServerConfig(PRESETS["none"], 1, seed=3), replicas=4, router=Random())
    assert not other["replica"].equals(picks[0])


def test_each_replica_admits_on_its_own_state():
    # vLLM's caps per replica: a bound of 2 waiting at each of three replicas, not 2 in the fleet.
    t = from_arrays(np.zeros(30), np.full(30, 64))
    frame = simulate(
        t, ServerConfig(Policy("cap", max_queue=2), 1), replicas=3, router=RoundRobin()
    )
    admitted = frame[frame["outcome"] != "rejected"]
    # One running and two waiting at each.
    assert admitted.groupby("replica").size().tolist() == [3, 3, 3]
    assert frame["queued_at_arrival"].max() == 2


def test_load_aware_routers_wait_less_than_blind_ones():
    t = trace(0.9, 4, 20_000)
    config = ServerConfig(PRESETS["none"], 1, seed=1)
    waits = {
        name: wait(simulate(t, config, replicas=4, router=make_router(name))) for name in PLAIN
    }
    assert waits["central"] < waits["jsq"] < waits["power_of_d"] < waits["random"]
    assert waits["least_work"] < waits["round_robin"] < waits["random"]


def test_the_routers_choices_from_states():
    states = [ReplicaState(3, 2.0, 1, 0), ReplicaState(1, 5.0, 1, 0), ReplicaState(1, 0.5, 1, 0)]
    rng = np.random.default_rng(0)
    assert JoinShortestQueue().choose(states, 0, rng) == 1  # ties to the lowest
    assert LeastWork().choose(states, 0, rng) == 2
    assert RoundRobin().choose(states, 7, rng) == 1
    assert PowerOfD(3).choose(states, 0, rng) in (1, 2)  # all three drawn: a tie, at random
    # Two of three drawn: replica 0 (the longest) loses every pair it is in.
    assert {PowerOfD(2).choose(states, 0, rng) for _ in range(50)} == {1, 2}
    with pytest.raises(ValueError, match="d = 4 choices among 3"):
        PowerOfD(4).choose(states, 0, rng)


@dataclass(frozen=True)
class Busiest(Router):
    """A user's router: the replica with the most outstanding (a bad idea, a clear test)."""

    name: ClassVar[str] = "busiest"

    def choose(self, replicas, arrival, rng):
        return max(range(len(replicas)), key=lambda r: (replicas[r].outstanding, -r))


@dataclass(frozen=True)
class Nowhere(Router):
    name: ClassVar[str] = "nowhere"

    def choose(self, replicas, arrival, rng):
        return len(replicas)


def test_a_users_router_is_a_class():
    frame = simulate(
        trace(0.3, 2, 200), ServerConfig(PRESETS["none"]), replicas=2, router=Busiest()
    )
    assert (frame["replica"] == 0).all()
    with pytest.raises(ValueError, match="chose 2, not a replica of 0..1"):
        simulate(trace(0.3, 2, 20), ServerConfig(PRESETS["none"]), replicas=2, router=Nowhere())


def test_retries_and_patience_in_a_fleet():
    t = trace(2.0, 3, 1500)
    frame = simulate(
        t,
        ServerConfig(PRESETS["bounded"], 1),
        replicas=3,
        router=JoinShortestQueue(),
        retry=RetryPolicy("fixed", delay_s=0.5),
        cancel_after_s=np.full(len(t), 4.0),
    )
    records.validate(frame)
    assert (frame["attempt"] > 1).any() and frame["outcome"].eq("abandoned").any()
    assert frame["replica"].notna().all()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda t: simulate(t, ServerConfig(), replicas=2), "needs a router"),
        (lambda t: simulate(t, ServerConfig(), replicas=0, router=Random()), "whole number >= 1"),
        (
            lambda t: simulate(t, ServerConfig(), replicas=True, router=Random()),
            "whole number >= 1",
        ),
        (
            lambda t: simulate(
                t, ServerConfig(), replicas=2, router=Central(), replica_speeds=[1, 2]
            ),
            "replica speeds: a central queue in front of engines one at a time",
        ),
        (
            lambda t: simulate(t, ServerConfig(), replicas=2, router=make_router("prefix")),
            "router prefix reads a batching engine's",
        ),
        (
            lambda t: simulate(t, ServerConfig(), replicas=2, router=Random(), replica_speeds=[1]),
            "one number > 0 for each of the 2",
        ),
        (
            lambda t: simulate(
                t, ServerConfig(), replicas=2, router=Random(), replica_speeds=[1, 0]
            ),
            "one number > 0",
        ),
        (lambda t: make_router("jsq", weights={"kv": 1}), "takes no weights"),
        (lambda t: make_router("weighted", weights={"kv": -1}), "weights >= 0"),
        (
            lambda t: simulate(
                t, ServerConfig(engine=OneAtATime(2, concurrency=0.1)), replicas=2, router=Random()
            ),
            "concurrency 0",
        ),
        (lambda t: make_router("nearest"), "unknown router 'nearest'"),
        (lambda t: make_router("jsq", 2), "takes no d"),
        (lambda t: make_router("power_of_d", 0), "d, a whole number >= 1"),
    ],
)
def test_bad_fleets_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call(trace(0.5, 2, 50))


# ---------------------------------------------------------------- qlab simulate --replicas


def qlab(args, capsys):
    from experiments.cli import main

    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_a_fleet_prints_its_replicas_and_balance(capsys):
    code, out, err = qlab(
        [
            "simulate",
            "--replicas",
            "3",
            "--router",
            "power_of_d",
            "--router-d",
            "2",
            "--load",
            "0.9",
            "--requests",
            "3000",
            "--policy",
            "vllm-caps",
        ],
        capsys,
    )
    assert code == 0 and err == ""
    assert "3 replicas behind router power_of_d (d 2) of 1 engine(s)" in out
    assert "by replica (router power_of_d (d 2)):" in out and "busy_s" in out
    assert "load imbalance (busiest replica's busy seconds over the mean): 1.0" in out
    assert "Jain's index over replicas: 0.99" in out or "Jain's index over replicas: 1.0000" in out


def test_simulate_a_fleet_as_json_and_over_seeds(capsys):
    import json

    code, out, _ = qlab(
        [
            "simulate",
            "--replicas",
            "2",
            "--router",
            "central",
            "--engines",
            "2",
            "--requests",
            "800",
            "--json",
        ],
        capsys,
    )
    fleet = json.loads(out)["fleet"]
    assert code == 0 and fleet["router"] == "central" and set(fleet["by_replica"]) == {"0", "1"}
    assert sum(r["requests"] for r in fleet["by_replica"].values()) <= 800
    assert 1 <= fleet["load_imbalance"] <= 2 and 0.5 <= fleet["jain_replicas"] <= 1
    code, out, _ = qlab(
        ["simulate", "--replicas", "2", "--requests", "500", "--seeds", "3"], capsys
    )
    assert code == 0 and "fleet balance (router round_robin), mean and 95 % CI over seeds" in out


def test_simulate_a_fleet_writes_its_replicas(tmp_path, capsys):
    out_file = tmp_path / "rows.parquet"
    code, _, _ = qlab(
        [
            "simulate",
            "--replicas",
            "2",
            "--router",
            "jsq",
            "--requests",
            "400",
            "--out",
            str(out_file),
        ],
        capsys,
    )
    rows = pd.read_parquet(out_file)
    assert code == 0 and len(rows) == 400 and set(rows["replica"]) == {0, 1}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--router", "jsq"], "--router: a fleet's options, for --replicas N > 1"),
        (
            ["--router-d", "2", "--replica-speeds", "1"],
            "--router-d, --replica-speeds: a fleet's options",
        ),
        (["--replicas", "2", "--router", "nearest"], "unknown router 'nearest'"),
        (["--replicas", "2", "--router", "jsq", "--router-d", "3"], "router 'jsq' takes no d"),
        (["--replicas", "2", "--router", "power_of_d", "--router-d", "0"], "--router-d"),
        (["--replicas", "0"], "--replicas"),
        (
            ["--replicas", "2", "--router", "central", "--replica-down", "1:1:2"],
            "a replica down: a central queue in front of engines one at a time",
        ),
        (["--replicas", "2", "--router", "least_kv"], "its replicas need --batching"),
        (["--replicas", "2", "--router", "jsq", "--router-weights", "kv=1"], "takes no weights"),
        (
            ["--replicas", "2", "--batching", "--router", "weighted", "--router-weights", "cpu=1"],
            "bad router weights",
        ),
        (["--replicas", "2", "--replica-speeds", "1,1,1"], "each of the 2 replicas"),
    ],
)
def test_simulate_refuses_a_bad_fleet_in_one_line(args, message, capsys):
    code, out, err = qlab(["simulate", "--requests", "50", *args], capsys)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- batching replicas

BATCH = Batching(kv_blocks=600, prefix_caching=True)
#: Every router that binds at arrival: what a batching fleet takes.
EARLY = [n for n in ROUTERS if not ROUTERS[n].shared]


def shared_trace(system="none", turns="4:16", replicas=3, load=0.6, requests=800, seed=2):
    """Conversations (and a system prompt) of prompts that share tokens, the load each replica's."""
    return make_trace(
        load=load,
        requests=requests,
        seed=seed,
        prompts=Prompts.parse("uniform:16:128"),
        capacity_rps=replicas * BATCH.capacity_rps(72, 20),
        prefixes=SharedPrefix.parse(system, turns),
    )


@pytest.mark.parametrize("router", EARLY)
def test_one_batching_replica_is_the_one_engine(router):
    # A speed of 1 takes the fleet's own path (its lines, its router, the replica hook) for one
    # replica: every row is the engine's without a fleet, noise in the steps and a cut at the
    # deadline included.
    engine = dataclasses.replace(BATCH, kv_blocks=200, step=dataclasses.replace(BATCH.step, cv=0.3))
    config = ServerConfig(
        dataclasses.replace(PRESETS["predictive"], cancel_at_deadline=True), engine, seed=4
    )
    t = shared_trace("128:0.5", "3:8", replicas=1, load=1.5, requests=500)
    plain = simulate(t, config)
    d = 1 if router == "power_of_d" else None  # d choices of one replica
    one = simulate(t, config, replicas=1, router=make_router(router, d), replica_speeds=[1.0])
    pd.testing.assert_frame_equal(plain, one)
    assert one.attrs["router"] == router and (one["replica"] == 0).all()
    assert one.attrs["prefix_cache_hits"] == plain.attrs["prefix_cache_hits"] > 0


@pytest.mark.parametrize("router", EARLY)
def test_every_request_ends_once_in_a_batching_fleet(router):
    config = ServerConfig(
        dataclasses.replace(PRESETS["predictive"], cancel_at_deadline=True),
        dataclasses.replace(BATCH, kv_blocks=150),
        seed=1,
    )
    t = shared_trace("128:0.5", "3:8", replicas=3, load=1.4, requests=600)
    patience = np.random.default_rng(0).exponential(3.0, len(t))
    with testing.audited_batches():  # every replica's blocks and seats, at every step
        frame = records.validate(
            simulate(t, config, replicas=3, router=make_router(router), cancel_after_s=patience)
        )
    assert len(frame) == len(t) and frame["request_id"].is_unique
    assert frame["outcome"].isin(OUTCOMES).all() and frame["finish_s"].notna().all()
    assert frame["replica"].between(0, 2).all() and set(frame["replica"]) == {0, 1, 2}
    started = frame["start_s"].notna()
    assert (frame.loc[started, "engine"] == frame.loc[started, "replica"]).all()
    assert frame["outcome"].eq("abandoned").any() and frame["outcome"].eq("good").any()


def test_each_batching_replica_cuts_at_its_deadlines_on_its_own_timer():
    # Each replica's line arms a timer of its own (qsim.run_batching.BatchingRun.arm): every cut,
    # on every replica, lands at its request's deadline, as the one engine's do.
    config = ServerConfig(
        dataclasses.replace(PRESETS["none"], cancel_at_deadline=True),
        dataclasses.replace(BATCH, kv_blocks=150),
        seed=1,
    )
    t = shared_trace("128:0.5", "3:8", replicas=4, load=1.6, requests=800)
    frame = simulate(t, config, replicas=4, router=RoundRobin())
    cut = frame[frame["outcome"] == "cancelled"]
    assert set(cut["replica"]) == {0, 1, 2, 3} and not frame["outcome"].eq("late").any()
    np.testing.assert_allclose(cut["finish_s"], cut["arrival_s"] + cut["deadline_s"])


def test_batching_routers_move_no_arrival_and_no_draw_of_another():
    # Common random numbers: a refusing policy does not move random's picks between batching
    # replicas, and no router moves an arrival, a request's tokens or its step noise's stream.
    t = shared_trace(load=2.0, requests=500)
    picks = [
        simulate(t, ServerConfig(PRESETS[p], BATCH, seed=2), replicas=3, router=Random())["replica"]
        for p in ("none", "vllm-caps", "predictive")
    ]
    assert picks[0].equals(picks[1]) and picks[0].equals(picks[2])
    frames = [
        simulate(
            t, ServerConfig(PRESETS["none"], BATCH, seed=2), replicas=3, router=make_router(name)
        )
        for name in ("random", "prefix", "weighted")
    ]
    for f in frames[1:]:
        for column in ("arrival_s", "max_new_tokens", "deadline_s", "client_id"):
            assert f[column].equals(frames[0][column])


def test_prefix_affinity_finds_more_of_the_prompts_cached_than_round_robin():
    # Conversations of four turns, 16 open at once, over three replicas: round robin sends a turn
    # to another replica than the one before it two times in three; prefix affinity sends it to the
    # one holding its history.
    t = shared_trace()
    config = ServerConfig(PRESETS["none"], BATCH, seed=1)
    cached = {
        name: simulate(t, config, replicas=3, router=make_router(name))
        for name in ("round_robin", "prefix", "weighted")
    }
    for frame in cached.values():
        assert frame["outcome"].eq("good").all()
    tokens = {name: int(f["cached_prompt_tokens"].sum()) for name, f in cached.items()}
    assert tokens["prefix"] > 3 * tokens["round_robin"]
    assert tokens["weighted"] > 3 * tokens["round_robin"]
    assert (
        cached["prefix"].attrs["prefix_cache_hits"]
        > cached["round_robin"].attrs["prefix_cache_hits"]
    )


def test_pure_affinity_piles_a_shared_system_prompt_on_one_replica_and_weighted_does_not():
    # A system prompt before nine conversations in ten: every replica that has it cached scores
    # the same on it, but the first to cache it holds it first and takes nearly everything;
    # weighted's queue and memory scores spread the load again.
    t = shared_trace("256:0.9")
    config = ServerConfig(PRESETS["none"], BATCH, seed=1)
    share = {
        name: simulate(t, config, replicas=3, router=make_router(name))["replica"]
        .value_counts(normalize=True)
        .max()
        for name in ("prefix", "weighted")
    }
    assert share["prefix"] > 0.8 and share["weighted"] < 0.45


def test_a_router_that_reads_no_prefix_hit_spares_the_probe_and_changes_no_row():
    @dataclass(frozen=True)
    class ProbedJSQ(JoinShortestQueue):
        reads_prefix: ClassVar[bool] = True  # a router of one's own: probed unless it says so

    t = shared_trace("256:0.9", replicas=4)
    config = ServerConfig(PRESETS["none"], BATCH, seed=1)
    spared, probed = (
        simulate(t, config, replicas=4, router=r) for r in (JoinShortestQueue(), ProbedJSQ())
    )
    pd.testing.assert_frame_equal(spared, probed)
    assert spared.attrs == probed.attrs  # the probes counted nothing in vLLM's counters
    assert not JoinShortestQueue.reads_prefix and PrefixAffinity.reads_prefix
    assert [n for n, r in ROUTERS.items() if r.reads_prefix] == ["prefix", "weighted"]


def test_the_batching_routers_choices_from_states():
    s = [
        ReplicaState(3, 1.0, 1, 0, kv_use=0.2, prefix_hit=0.0),
        ReplicaState(1, 1.0, 1, 0, kv_use=0.9, prefix_hit=0.75),
        ReplicaState(2, 1.0, 1, 0, kv_use=0.2, prefix_hit=0.75),
    ]
    rng = np.random.default_rng(0)
    assert LeastKV().choose(s, 0, rng) == 2  # 0 and 2 tie on memory: fewer outstanding
    assert PrefixAffinity().choose(s, 0, rng) == 1  # 1 and 2 tie on the cache: fewer outstanding
    # Scores: queue (3 - q) / 2 = 0, 1, 0.5; kv 0.8, 0.1, 0.8; prefix 0, 0.75, 0.75.
    assert Weighted().choose(s, 0, rng) == 2  # 2 x 0.75 + 0.5 + 0.8 = 2.8 against 2.6 and 0.8
    assert Weighted(prefix=0, queue=1, kv=0).choose(s, 0, rng) == 1
    assert Weighted(prefix=0, queue=0, kv=1).choose(s, 0, rng) == 2  # ties to fewer outstanding
    assert make_router("weighted", weights={"kv": 3}) == Weighted(2, 1, 3)
    with pytest.raises(ValueError, match="not all 0"):
        Weighted(0, 0, 0)


def test_a_batching_replicas_state_reads_its_memory_and_cache():
    from qsim.batch import BatchQueue
    from qsim.entry import Work
    from qsim.prefix import SYSTEM_KEY, Tokens

    tokens = {
        0: Tokens(((SYSTEM_KEY, 64), (10, 8)), 11),
        1: Tokens(((SYSTEM_KEY, 64), (12, 8)), 13),
        2: Tokens(((14, 72),), 15),
    }
    engine = Batching(kv_blocks=100, prefix_caching=True)
    queue = BatchQueue(
        ServerConfig(PRESETS["none"], engine),
        step=lambda plan, now: None,
        end=lambda *a: None,
        drop=lambda *a: None,
        tokens=tokens.get,
    )
    assert queue.replica_state(0.0, 1) == ReplicaState(0, 0.0, 1, 1, 0.0, 0.0)
    assert queue.arrive(0, 0.0, 1.0, 100.0, work=Work(4, 72, 4)) is None
    state = queue.replica_state(0.0, 1)
    # Request 0's first chunk holds 5 blocks of 16 (72 tokens); its 4 system blocks are cached.
    assert (state.outstanding, state.kv_use, state.prefix_hit) == (1, 0.05, 1.0)
    assert queue.replica_state(0.0, 2).prefix_hit == 0.0
    assert queue.prefix_cache_stats()["prefix_cache_queries"] == 72  # the probes counted nothing


# ---------------------------------------------------------------- heterogeneous replicas, failures


def test_a_slower_one_at_a_time_replica_takes_longer_and_jsq_sends_it_less():
    t = trace(0.8, 3, 6000)
    config = ServerConfig(PRESETS["none"], 1, seed=1)
    rr = simulate(t, config, replicas=3, router=RoundRobin(), replica_speeds=[1, 1, 0.5])
    ran = rr[rr["start_s"].notna()]
    ratio = ran["true_service_s"] / t.true_service_s[ran["request_id"]]
    assert np.allclose(ratio[ran["replica"] == 2], 2.0) and np.allclose(
        ratio[ran["replica"] < 2], 1
    )
    sent = simulate(t, config, replicas=3, router=JoinShortestQueue(), replica_speeds=[1, 1, 0.5])[
        "replica"
    ].value_counts()
    assert sent[2] < 0.8 * sent[0] and sent[2] < 0.8 * sent[1]


def test_a_slower_batching_replica_answers_later_and_jsq_sends_it_less():
    t = shared_trace(load=0.8)
    config = ServerConfig(PRESETS["none"], BATCH, seed=1)
    rr = simulate(t, config, replicas=2, router=RoundRobin(), replica_speeds=[1, 0.25])
    ttft = rr.groupby("replica")["ttft_s"].median()
    assert ttft[1] > 3 * ttft[0]
    plain = simulate(t, config, replicas=2, router=RoundRobin())
    assert plain.groupby("replica")["ttft_s"].median()[1] < 1.5 * ttft[0]
    sent = simulate(t, config, replicas=2, router=make_router("jsq"), replica_speeds=[1, 0.25])[
        "replica"
    ].value_counts()
    assert sent[1] < 0.7 * sent[0]


def _windowed(kind: str, what: str):
    """(trace, config, replica 1's window's start and end, the records) of three replicas past
    capacity behind jsq, replica 1 ``what`` ("down" or "drain") in its window: one at a time
    (a window of 100 s) or batching (1 s)."""
    if kind == "batching":
        t, config, window = (
            shared_trace(load=0.9, requests=1500),
            ServerConfig(PRESETS["none"], BATCH, seed=1),
            (1, 1.0, 2.0),
        )
    else:
        t, config = trace(1.1, 3, 3000), ServerConfig(PRESETS["none"], 1, seed=1)
        window = (1, 100.0, 200.0)
    with testing.audited_batches():
        frame = records.validate(
            simulate(
                t, config, replicas=3, router=make_router("jsq"), **{f"replica_{what}": [window]}
            )
        )
    assert len(frame) == len(t) and frame["outcome"].notna().all()
    return t, config, window[1], window[2], frame


@pytest.mark.parametrize("kind", ["one_at_a_time", "batching"])
def test_a_replica_down_ends_what_it_held_once_and_gets_nothing_until_back(kind):
    t, config, at, back, frame = _windowed(kind, "down")
    failed = frame[frame["outcome"] == "error"]
    # Each ended at the failure, on the replica that failed: what ran there an engine's error,
    # what waited a stopped server's.
    assert len(failed) and (failed["finish_s"] == at).all() and (failed["replica"] == 1).all()
    assert (failed["arrival_s"] < at).all()
    reasons = set(failed["reason"])
    assert "engine_exception" in reasons and (kind == "batching" or "shutting_down" in reasons)
    running = failed["reason"] == "engine_exception"
    assert failed.loc[running, "start_s"].notna().all()
    while_down = frame[(frame["arrival_s"] >= at) & (frame["arrival_s"] < back)]
    assert len(while_down) and not (while_down["replica"] == 1).any()
    after = frame[frame["arrival_s"] >= back + 0.1 * (back - at)]
    assert (after["replica"] == 1).mean() > 0.2  # back in the rotation (jsq: it is the emptiest)
    # Nothing else ended in error, and the other replicas' rows are those of the fleet without it
    # until the failure.
    before = simulate(t, config, replicas=3, router=make_router("jsq"))
    early = frame["arrival_s"] < at
    same = early & ~frame["outcome"].eq("error") & (frame["finish_s"] < at)
    pd.testing.assert_frame_equal(
        frame[same].reset_index(drop=True), before[same].reset_index(drop=True)
    )


@pytest.mark.parametrize("kind", ["one_at_a_time", "batching"])
def test_a_draining_replica_finishes_what_it_held_and_gets_nothing_until_back(kind):
    _, _, at, back, frame = _windowed(kind, "drain")
    # What replica 1 held at the drain (arrived before it, not ended by then) ends answered.
    held = frame[(frame["replica"] == 1) & (frame["arrival_s"] < at) & (frame["finish_s"] > at)]
    assert len(held) and held["outcome"].isin(["good", "late"]).all()  # answered, late or not
    assert held["finish_s"].max() > at  # it ran on in the window, not cut at its start
    assert not (frame["outcome"] == "error").any()
    during = frame[(frame["arrival_s"] >= at) & (frame["arrival_s"] < back)]
    assert len(during) and not (during["replica"] == 1).any()
    after = frame[frame["arrival_s"] >= back + 0.1 * (back - at)]
    assert (after["replica"] == 1).mean() > 0.2  # back in the rotation


@pytest.mark.parametrize(
    "down, drain",
    [
        # down 100-200 s, draining 120-150 s: the drain's end does not route to it while it is
        # down (Fleet.fail marks it down; end_drain brings back only what nothing else holds off)
        ((1, 100.0, 200.0), (1, 120.0, 150.0)),
        # draining 100-200 s, down 120-150 s: the restore at 150 s does not route to it while it
        # still drains (Fleet.drain marks it draining)
        ((1, 120.0, 150.0), (1, 100.0, 200.0)),
    ],
    ids=["drain_inside_down", "down_inside_drain"],
)
def test_a_window_that_ends_inside_another_leaves_the_replica_off_until_both_end(down, drain):
    """Replica 1 down and draining in windows one inside the other, 100-200 s in all: nothing is
    routed to it until the outer one ends, and it takes requests again after 200 s."""
    t, config = trace(1.1, 3, 3000), ServerConfig(PRESETS["none"], 1, seed=1)
    frame = simulate(
        t,
        config,
        replicas=3,
        router=make_router("jsq"),
        replica_down=[down],
        replica_drain=[drain],
    )
    during = frame[frame["arrival_s"].between(100.0, 200.0, inclusive="left")]
    assert len(during) and not during["replica"].eq(1).any()
    assert frame.loc[frame["arrival_s"].ge(210.0), "replica"].eq(1).mean() > 0.2


def test_a_drain_rides_a_fleets_fields_and_old_fields_read_as_none():
    spec = FleetSpec(3, RoundRobin(), drain=((1, 1.0, 2.0),))
    assert FleetSpec.from_fields(spec.to_fields()) == spec
    plain = FleetSpec(3, RoundRobin()).to_fields()
    assert "drain" not in plain and FleetSpec.from_fields(plain).drain == ()
    with pytest.raises(ValueError, match="every replica is down or draining at 1.5 s"):
        FleetSpec(2, RoundRobin(), down=((0, 1.0, 3.0),), drain=((1, 1.5, 2.0),))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--replica-drain", "1:x:2"], "bad --replica-drain '1:x:2'"),
        (["--replica-drain", "5:1:2"], "a replica draining is (replica of 0..1"),
    ],
)
def test_simulate_refuses_a_bad_drain_in_one_line(args, message, capsys):
    code, out, err = qlab(["simulate", "--requests", "50", "--replicas", "2", *args], capsys)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- replicas of their own KV sizes


@pytest.mark.parametrize("router", ["round_robin", "least_kv", "weighted", "central"])
def test_every_replica_at_the_engines_kv_blocks_is_the_fleet_without_them(router):
    t = shared_trace(load=1.2, requests=600)
    config = ServerConfig(PRESETS["predictive"], BATCH, seed=1)
    plain = simulate(t, config, replicas=3, router=make_router(router))
    same = simulate(t, config, replicas=3, router=make_router(router), replica_kv_blocks=[600] * 3)
    pd.testing.assert_frame_equal(plain, same)


def test_a_replica_of_little_kv_memory_preempts_more_and_answers_later():
    # Past capacity, round robin deals each replica the same arrivals: the one of 40 blocks (a
    # few requests' worth) preempts what the others seldom do and makes its line wait, while the
    # others, on their own memory, run exactly as in the fleet without the field.
    t = shared_trace(load=1.3, requests=800)
    config = ServerConfig(PRESETS["none"], BATCH, seed=1)
    with testing.audited_batches():  # every replica's blocks within its own size, at every step
        small = records.validate(
            simulate(t, config, replicas=3, router=RoundRobin(), replica_kv_blocks=[600, 600, 40])
        )
    plain = simulate(t, config, replicas=3, router=RoundRobin())
    preempted = small.groupby("replica")["preemptions"].mean()
    assert preempted[2] > 3 * max(preempted[0], preempted[1])
    assert plain.groupby("replica")["preemptions"].mean()[2] < preempted[2] / 3
    ttft = small.groupby("replica")["ttft_s"].median()
    assert ttft[2] > 5 * max(ttft[0], ttft[1])
    assert small.loc[small["replica"] == 2, "kv_blocks_peak"].max() <= 40
    others = small["replica"] < 2
    pd.testing.assert_frame_equal(small[others], plain[others])


def test_least_kv_sends_the_replica_of_more_kv_memory_more():
    # Within the memory's reach the same batch is a larger share of a smaller cache: least_kv
    # reads the share in use, so it sends the replica of 600 blocks most (about evenly without
    # the field). Past a small memory's reach its use swings low at each finish, and this holds
    # no more: least_kv alone reads no line.
    t = shared_trace(load=0.5, requests=800, replicas=2)
    config = ServerConfig(PRESETS["none"], BATCH, seed=1)
    sent = simulate(t, config, replicas=2, router=LeastKV(), replica_kv_blocks=[600, 150])[
        "replica"
    ].value_counts()
    assert sent[0] > 2 * sent[1]
    even = simulate(t, config, replicas=2, router=LeastKV())["replica"].value_counts()
    assert even[0] < 1.2 * even[1]


@pytest.mark.parametrize("router", ["round_robin", "least_kv"])
def test_one_replica_of_its_own_kv_blocks_is_the_engine_of_that_size(router):
    # A kv_blocks given takes the fleet's path for one replica: every row is the engine's of
    # that size without a fleet (its preemptions and prefix cache at 200 blocks, not 600).
    config = ServerConfig(
        dataclasses.replace(PRESETS["predictive"], cancel_at_deadline=True), BATCH
    )
    t = shared_trace("128:0.5", "3:8", replicas=1, load=1.5, requests=500)
    one = simulate(t, config, replicas=1, router=make_router(router), replica_kv_blocks=[200])
    engine = simulate(t, config.replace(engine=dataclasses.replace(BATCH, kv_blocks=200)))
    pd.testing.assert_frame_equal(engine, one)
    assert one["preemptions"].gt(0).any() and not simulate(t, config).equals(one)


def test_kv_blocks_ride_a_fleets_fields_and_old_fields_read_as_none():
    spec = FleetSpec(3, RoundRobin(), kv_blocks=(800, 800, 400))
    assert FleetSpec.from_fields(json.loads(json.dumps(spec.to_fields()))) == spec
    plain = FleetSpec(3, RoundRobin()).to_fields()
    assert "kv_blocks" not in plain and FleetSpec.from_fields(plain).kv_blocks is None


@pytest.mark.parametrize("kv_blocks", [(800, 800), (800, 0, 400), (800, 1.5, 400), (800, True, 1)])
def test_bad_replica_kv_blocks_are_refused(kv_blocks):
    with pytest.raises(
        ValueError, match="replica kv_blocks: one whole number >= 1 for each of the 3 replicas"
    ):
        FleetSpec(3, RoundRobin(), kv_blocks=kv_blocks)


def test_engines_one_at_a_time_take_no_replica_kv_blocks():
    with pytest.raises(ValueError, match="engines one at a time hold no KV memory"):
        simulate(
            trace(0.5, 2, 50), ServerConfig(), replicas=2, router=Random(), replica_kv_blocks=[8, 8]
        )


def test_simulate_a_fleet_of_its_own_kv_sizes(capsys):
    code, out, err = qlab(
        [
            "simulate",
            "--batching",
            "--kv-blocks",
            "600",
            "--requests",
            "200",
            "--replicas",
            "3",
            "--replica-kv-blocks",
            "600,600,100",
        ],
        capsys,
    )
    assert code == 0 and err == "" and "3 replicas, KV blocks 600,600,100 behind" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--replicas", "3", "--replica-kv-blocks", "800,800"], "each of the 3 replicas"),
        (["--replicas", "2", "--replica-kv-blocks", "800,0"], "one whole number >= 1"),
        (["--replicas", "2", "--replica-kv-blocks", "800,x"], "bad --replica-kv-blocks '800,x'"),
        (["--replicas", "2", "--replica-kv-blocks", "8.5,8"], "expected whole numbers"),
        (["--replica-kv-blocks", "800"], "--replica-kv-blocks: a fleet's options"),
    ],
)
def test_simulate_refuses_bad_replica_kv_blocks_in_one_line(args, message, capsys):
    code, out, err = qlab(["simulate", "--requests", "50", "--batching", *args], capsys)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_simulate_refuses_replica_kv_blocks_of_engines_one_at_a_time_in_one_line(capsys):
    args = ["simulate", "--requests", "50", "--replicas", "2", "--replica-kv-blocks", "8,8"]
    code, out, err = qlab(args, capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "engines one at a time hold no KV memory" in err


@pytest.mark.parametrize(
    "down, message",
    [
        ([(3, 1.0, 2.0)], "replica of 0..2"),
        ([(0, 2.0, 1.0)], "from_s < to_s"),
        ([(0, 1.0, 5.0), (1, 2.0, 3.0), (2, 2.5, 4.0)], "every replica is down at 2.5 s"),
    ],
)
def test_bad_replica_downs_are_refused(down, message):
    with pytest.raises(ValueError, match=message):
        simulate(trace(0.5, 3, 50), ServerConfig(), replicas=3, router=Random(), replica_down=down)


def test_simulate_a_batching_fleet_with_prefix_affinity(capsys):
    args = [
        "simulate",
        "--batching",
        "--kv-blocks",
        "600",
        "--prefix-caching",
        "--prompts",
        "uniform:16:128",
        "--turns",
        "4:16",
        "--replicas",
        "3",
        "--load",
        "0.6",
        "--seconds",
        "5",
        "--seed",
        "1",
    ]
    code, out, err = qlab([*args, "--router", "prefix"], capsys)
    assert code == 0 and err == ""
    assert "3 replicas behind router prefix of a batching engine (" in out
    assert "by replica (router prefix):" in out and "prefix cache:" in out
    hit = float(out.split("(hit rate ")[1].split(")")[0])
    code, out, _ = qlab([*args, "--router", "round_robin"], capsys)
    assert code == 0 and float(out.split("(hit rate ")[1].split(")")[0]) < hit / 2
    code, out, _ = qlab(
        [
            *args,
            "--router",
            "weighted",
            "--router-weights",
            "prefix=1,kv=0",
            "--replica-speeds",
            "1,1,0.5",
            "--replica-down",
            "2:1:2",
            "--json",
        ],
        capsys,
    )
    summary = json.loads(out)
    assert code == 0 and summary["fleet"]["router"] == "weighted"
    assert summary["summary"]["error"] > 0 and set(summary["fleet"]["by_replica"]) == {
        "0",
        "1",
        "2",
    }


def test_least_ttft_chooses_the_earliest_projected_first_token():
    s = [
        ReplicaState(1, 1.0, 1, 0, ttft_s=0.9),
        ReplicaState(3, 2.0, 1, 0, ttft_s=0.2),
        ReplicaState(0, 0.1, 1, 0, ttft_s=0.2),
    ]
    rng = np.random.default_rng(0)
    assert LeastTTFT().choose(s, 0, rng) == 2  # 1 and 2 tie: fewer outstanding
    drawn = {LeastTTFT(d=1).choose(s, 0, rng) for _ in range(50)}
    assert drawn == {0, 1, 2}  # one drawn: any of them
    with pytest.raises(ValueError, match="least_ttft needs d"):
        LeastTTFT(d=0)
    assert make_router("least_ttft", 2) == LeastTTFT(2)


def test_least_ttft_asks_each_replica_its_projection_and_beats_jsq_on_a_slow_replica():
    # Two batching replicas, one at a quarter of the speed: jsq counts requests, least_work the
    # work per seat; least_ttft asks each replica's own projection of the arrival's first token
    # (its batch, its line, its prompt's steps at its tracked speed), and has the shortest tail.
    p99 = {name: [] for name in ("jsq", "least_work", "least_ttft")}
    for seed in (1, 2, 3):
        t = shared_trace(load=0.8, seed=seed)
        config = ServerConfig(PRESETS["none"], BATCH, seed=seed)
        for name in p99:
            frame = simulate(
                t, config, replicas=2, router=make_router(name), replica_speeds=[1, 0.25]
            )
            p99[name].append(frame["ttft_s"].quantile(0.99))
    assert np.mean(p99["least_ttft"]) < 0.9 * np.mean(p99["least_work"])
    assert np.mean(p99["least_ttft"]) < 0.6 * np.mean(p99["jsq"])


# ---------------------------------------------------------------- admission at the gate


def _waiting_over_time(frame, replicas):
    """The most requests waiting at once, in the fleet and at each replica (from the records:
    a request waits from its arrival until its start, or its end unrun)."""
    admitted = frame[frame["outcome"] != "rejected"]
    until = admitted["start_s"].fillna(admitted["finish_s"])
    events = sorted(
        [(t, 1, r) for t, r in zip(admitted["arrival_s"], admitted["replica"])]
        + [(t, -1, r) for t, r in zip(until, admitted["replica"])],
        key=lambda e: (e[0], e[1]),
    )  # a start frees its place before an arrival
    now, most, each, most_each = 0, 0, [0] * replicas, [0] * replicas
    for _, step, r in events:
        now += step
        each[r] += step
        most, most_each[r] = max(most, now), max(most_each[r], each[r])
    return most, most_each


def test_a_queue_bound_at_the_gate_is_the_fleets_and_at_each_replica_each_ones():
    # The same seeded trace, a bound of 2 waiting: per replica, up to 2 waiting at each of the
    # three (6 in the fleet); at the gate, never more than 2 waiting in the whole fleet.
    t = trace(1.5, 3, 4000)
    config = ServerConfig(Policy("cap", max_queue=2), 1)
    each = simulate(t, config, replicas=3, router=JoinShortestQueue())
    gate = simulate(t, config, replicas=3, router=JoinShortestQueue(), admission_at="gate")
    records.validate(gate)
    most, most_each = _waiting_over_time(each, 3)
    assert max(most_each) == 2 and most > 2
    most, _ = _waiting_over_time(gate, 3)
    assert most <= 2
    assert (gate["queued_at_arrival"] <= 2).all() and gate["queued_at_arrival"].max() == 2
    # The gate refuses more (a tighter bound), and a refusal is routed nowhere.
    refused = gate["outcome"] == "rejected"
    assert refused.sum() > (each["outcome"] == "rejected").sum()
    assert gate.loc[refused, "replica"].isna().all()
    assert gate.loc[~refused, "replica"].notna().all()
    assert each["replica"].notna().all()


def test_the_gate_on_zero_time_arrivals_admits_the_fleets_engines_and_its_bound():
    t = from_arrays(np.zeros(30), np.full(30, 64))
    frame = simulate(
        t,
        ServerConfig(Policy("cap", max_queue=2), 1),
        replicas=3,
        router=RoundRobin(),
        admission_at="gate",
    )
    admitted = frame[frame["outcome"] != "rejected"]
    # Three start at once, two wait in the fleet (at 0 and 1, round robin's turn): 5, not 9.
    assert len(admitted) == 5 and admitted.groupby("replica").size().tolist() == [2, 2, 1]


@pytest.mark.parametrize("router", ["round_robin", "jsq", "central"])
def test_admission_at_the_replica_is_todays_fleet(router):
    t = trace(1.3, 3, 1500)
    config = ServerConfig(PRESETS["predictive"], 2)
    today = simulate(t, config, replicas=3, router=make_router(router))
    pd.testing.assert_frame_equal(
        simulate(t, config, replicas=3, router=make_router(router), admission_at="replica"), today
    )
    if router == "central":  # one line: its admission is the gate's already
        pd.testing.assert_frame_equal(
            simulate(t, config, replicas=3, router=make_router(router), admission_at="gate"), today
        )


def test_one_replica_at_the_gate_is_the_one_server():
    t = trace(1.3, 2, 1500)
    config = ServerConfig(PRESETS["bounded-deadline"], 2)
    # Through the fleet's path (a speed of 1): the same decisions; a refusal routed nowhere.
    one = simulate(
        t, config, replicas=1, router=RoundRobin(), replica_speeds=[1], admission_at="gate"
    )
    plain = simulate(t, config)
    refused = plain["outcome"] == "rejected"
    assert refused.any() and one.loc[refused, "replica"].isna().all()
    pd.testing.assert_frame_equal(plain.drop(columns="replica"), one.drop(columns="replica"))
    # One replica without a fleet's options is the one server, wherever it admits.
    pd.testing.assert_frame_equal(plain, simulate(t, config, replicas=1, admission_at="gate"))


@pytest.mark.parametrize("policy", ["bounded-deadline", "predictive"])
def test_batching_replicas_admit_at_the_gate_on_the_fleets_waiting(policy):
    t = trace(1.5, 3, 3000)
    config = ServerConfig(PRESETS[policy], engine=Batching(max_num_seqs=4, kv_blocks=600))
    each = simulate(t, config, replicas=3, router=JoinShortestQueue())
    gate = simulate(t, config, replicas=3, router=JoinShortestQueue(), admission_at="gate")
    records.validate(gate)
    assert not gate.equals(each)
    refused = gate["outcome"] == "rejected"
    assert gate.loc[refused, "replica"].isna().all()
    assert gate["outcome"].isin(OUTCOMES).all() and len(gate) == len(t)


def test_a_bad_admission_place_is_refused():
    with pytest.raises(ValueError, match="admission is at one of replica, gate"):
        simulate(
            trace(0.5, 2, 50), ServerConfig(), replicas=2, router=Random(), admission_at="router"
        )


def test_a_fleets_fields_keep_its_admission():
    from qsim.fleet import FleetSpec

    spec = FleetSpec(3, JoinShortestQueue(), admission="gate")
    assert spec.to_fields()["admission"] == "gate"
    assert FleetSpec.from_fields(json.loads(json.dumps(spec.to_fields()))) == spec
    assert "admission" not in FleetSpec(3, JoinShortestQueue()).to_fields()  # as before


def test_simulate_admission_at_the_gate(tmp_path, capsys):
    args = [
        "simulate",
        "--replicas",
        "3",
        "--router",
        "jsq",
        "--policy",
        "bounded",
        "--load",
        "1.5",
        "--requests",
        "2000",
        "--json",
    ]
    each = json.loads(qlab(args, capsys)[1])
    code, out, err = qlab(args + ["--admission-at", "gate"], capsys)
    assert code == 0 and err == ""
    gate = json.loads(out)
    assert gate["summary"]["rejected"] > each["summary"]["rejected"]
    # Streamed to --out (qsim.stream), the same run.
    code, out, _ = qlab(
        args + ["--admission-at", "gate", "--out", str(tmp_path / "r.parquet")], capsys
    )
    assert code == 0 and json.loads(out)["summary"] == gate["summary"]
    code, out, _ = qlab(args[:-1] + ["--admission-at", "gate"], capsys)
    assert code == 0 and "admitted at the gate" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--replicas", "2", "--admission-at", "router"],
            "--admission-at: invalid choice 'router': a fleet admits at one of replica, gate",
        ),
        (["--admission-at", "gate"], "--admission-at: a fleet's options, for --replicas N > 1"),
    ],
)
def test_simulate_refuses_a_bad_admission_place_in_one_line(args, message, capsys):
    code, out, err = qlab(["simulate", "--requests", "50", *args], capsys)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1
