"""Fleets (qsim.fleet) and routers (qsim.routers): N replicas of one server behind a router."""

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd
import pytest

from qsim import PRESETS, Policy, from_arrays, make_trace, records, simulate
from qsim.clients import RetryPolicy
from qsim.config import ServerConfig
from qsim.engines import Batching, OneAtATime
from qsim.routers import (ROUTERS, Central, JoinShortestQueue, LeastWork, PowerOfD, Random,
                          ReplicaState, RoundRobin, Router, make_router)


def trace(load=0.9, replicas=4, requests=3000, seed=3, service="exponential"):
    return make_trace("poisson", service, load=load, engines=replicas, requests=requests,
                      seed=seed, mean_service_s=1.0)


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


#: The routers that route one-at-a-time replicas (the rest read a batching engine's memory).
PLAIN = [n for n in ROUTERS if not ROUTERS[n].needs_batching]


@pytest.mark.parametrize("name", [n for n in PLAIN if n != "central"])
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
    frame = simulate(trace(0.5, 3, 300), ServerConfig(PRESETS["none"]), replicas=3,
                     router=RoundRobin())
    assert frame["replica"].tolist() == [i % 3 for i in range(300)]


def test_the_routers_draws_are_their_own():
    # Common random numbers: a policy that refuses does not move the random router's choices, and
    # another server seed draws others.
    t = trace(1.5, 4, 2000)
    picks = [simulate(t, ServerConfig(PRESETS[p], 1, seed=2), replicas=4,
                      router=Random())["replica"] for p in ("none", "bounded", "predictive")]
    assert picks[0].equals(picks[1]) and picks[0].equals(picks[2])
    other = simulate(t, ServerConfig(PRESETS["none"], 1, seed=3), replicas=4, router=Random())
    assert not other["replica"].equals(picks[0])


def test_each_replica_admits_on_its_own_state():
    # vLLM's caps per replica: a bound of 2 waiting at each of three replicas, not 2 in the fleet.
    t = from_arrays(np.zeros(30), np.full(30, 64))
    frame = simulate(t, ServerConfig(Policy("cap", max_queue=2), 1), replicas=3,
                     router=RoundRobin())
    admitted = frame[frame["outcome"] != "rejected"]
    # One running and two waiting at each.
    assert admitted.groupby("replica").size().tolist() == [3, 3, 3]
    assert frame["queued_at_arrival"].max() == 2


def test_load_aware_routers_wait_less_than_blind_ones():
    t = trace(0.9, 4, 20_000)
    config = ServerConfig(PRESETS["none"], 1, seed=1)
    waits = {name: wait(simulate(t, config, replicas=4, router=make_router(name)))
             for name in PLAIN}
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
    frame = simulate(trace(0.3, 2, 200), ServerConfig(PRESETS["none"]), replicas=2,
                     router=Busiest())
    assert (frame["replica"] == 0).all()
    with pytest.raises(ValueError, match="chose 2, not a replica of 0..1"):
        simulate(trace(0.3, 2, 20), ServerConfig(PRESETS["none"]), replicas=2, router=Nowhere())


def test_retries_and_patience_in_a_fleet():
    t = trace(2.0, 3, 1500)
    frame = simulate(t, ServerConfig(PRESETS["bounded"], 1), replicas=3,
                     router=JoinShortestQueue(), retry=RetryPolicy("fixed", delay_s=0.5),
                     cancel_after_s=np.full(len(t), 4.0))
    records.validate(frame)
    assert (frame["attempt"] > 1).any() and frame["outcome"].eq("abandoned").any()
    assert frame["replica"].notna().all()


@pytest.mark.parametrize("call, message", [
    (lambda t: simulate(t, ServerConfig(), replicas=2), "needs a router"),
    (lambda t: simulate(t, ServerConfig(), replicas=0, router=Random()), "whole number >= 1"),
    (lambda t: simulate(t, ServerConfig(), replicas=True, router=Random()), "whole number >= 1"),
    (lambda t: simulate(t, ServerConfig(engine=Batching()), replicas=2, router=Central()),
     "central queue in front of batching replicas"),
    (lambda t: simulate(t, ServerConfig(), replicas=2, router=make_router("prefix")),
     "router prefix reads a batching engine's"),
    (lambda t: simulate(t, ServerConfig(), replicas=2, router=Random(), replica_speeds=[1]),
     "one number > 0 for each of the 2"),
    (lambda t: simulate(t, ServerConfig(), replicas=2, router=Random(), replica_speeds=[1, 0]),
     "one number > 0"),
    (lambda t: make_router("jsq", weights={"kv": 1}), "takes no weights"),
    (lambda t: make_router("weighted", weights={"kv": -1}), "weights >= 0"),
    (lambda t: simulate(t, ServerConfig(engine=OneAtATime(2, concurrency=0.1)), replicas=2,
                        router=Random()), "concurrency 0"),
    (lambda t: make_router("nearest"), "unknown router 'nearest'"),
    (lambda t: make_router("jsq", 2), "takes no d"),
    (lambda t: make_router("power_of_d", 0), "d, a whole number >= 1"),
])
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
    code, out, err = qlab(["simulate", "--replicas", "3", "--router", "power_of_d",
                           "--router-d", "2", "--load", "0.9", "--requests", "3000",
                           "--policy", "vllm-caps"], capsys)
    assert code == 0 and err == ""
    assert "3 replicas behind router power_of_d (d 2) of 1 engine(s)" in out
    assert "by replica (router power_of_d (d 2)):" in out and "busy_s" in out
    assert "load imbalance (busiest replica's busy seconds over the mean): 1.0" in out
    assert "Jain's index over replicas: 0.99" in out or "Jain's index over replicas: 1.0000" in out


def test_simulate_a_fleet_as_json_and_over_seeds(capsys):
    import json

    code, out, _ = qlab(["simulate", "--replicas", "2", "--router", "central", "--engines", "2",
                         "--requests", "800", "--json"], capsys)
    fleet = json.loads(out)["fleet"]
    assert code == 0 and fleet["router"] == "central" and set(fleet["by_replica"]) == {"0", "1"}
    assert sum(r["requests"] for r in fleet["by_replica"].values()) <= 800
    assert 1 <= fleet["load_imbalance"] <= 2 and 0.5 <= fleet["jain_replicas"] <= 1
    code, out, _ = qlab(["simulate", "--replicas", "2", "--requests", "500", "--seeds", "3"],
                        capsys)
    assert code == 0 and "fleet balance (router round_robin), mean and 95 % CI over seeds" in out


def test_simulate_a_fleet_writes_its_replicas(tmp_path, capsys):
    out_file = tmp_path / "rows.parquet"
    code, _, _ = qlab(["simulate", "--replicas", "2", "--router", "jsq", "--requests", "400",
                       "--out", str(out_file)], capsys)
    rows = pd.read_parquet(out_file)
    assert code == 0 and len(rows) == 400 and set(rows["replica"]) == {0, 1}


@pytest.mark.parametrize("args, message", [
    (["--router", "jsq"], "--router: a fleet's options, for --replicas N > 1"),
    (["--router-d", "2", "--replica-speeds", "1"],
     "--router-d, --replica-speeds: a fleet's options"),
    (["--replicas", "2", "--router", "nearest"], "unknown router 'nearest'"),
    (["--replicas", "2", "--router", "jsq", "--router-d", "3"], "router 'jsq' takes no d"),
    (["--replicas", "2", "--router", "power_of_d", "--router-d", "0"], "--router-d"),
    (["--replicas", "0"], "--replicas"),
    (["--replicas", "2", "--batching", "--router", "central"],
     "central queue in front of batching replicas"),
    (["--replicas", "2", "--router", "least_kv"], "its replicas need --batching"),
    (["--replicas", "2", "--router", "jsq", "--router-weights", "kv=1"], "takes no weights"),
    (["--replicas", "2", "--batching", "--router", "weighted", "--router-weights", "cpu=1"],
     "bad router weights"),
    (["--replicas", "2", "--replica-speeds", "1,1,1"], "each of the 2 replicas"),
])
def test_simulate_refuses_a_bad_fleet_in_one_line(args, message, capsys):
    code, out, err = qlab(["simulate", "--requests", "50", *args], capsys)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1
