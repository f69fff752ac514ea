"""The live gate as a router (live.fleet_gate) agrees with the simulator's fleet, per request.

Both drive one :class:`qsim.fleet.Fleet` with the same routers (qsim.routers) and the same
random stream (qsim.fleet.ROUTER_STREAM); the gate runs on a virtual clock (tests/virtual_time.py).
"""

import numpy as np
import pandas as pd
import pytest

from qsim import PRESETS, make_trace, simulate
from qsim.config import ServerConfig
from qsim.fleet import FleetSpec
from qsim.routers import make_router
from live.engine import WORD, Abilities, EngineResult, UpstreamError
from live.gate_errors import Rejected
from virtual_time import _ENDS, run_gate

ROUTERS = ["random", "round_robin", "jsq", "least_work", "power_of_d", "central"]


def _agree(
    trace,
    policy,
    engines: int,
    router: str,
    replicas: int = 3,
    admission="replica",
    speeds=None,
    down=(),
    drain=(),
):
    spec = FleetSpec(replicas, make_router(router), speeds, down, admission=admission, drain=drain)
    gate, stats = run_gate(trace, policy, engines, fleet=spec)
    sim = simulate(
        trace,
        ServerConfig(policy, engines),
        replicas=replicas,
        router=spec.router,
        admission_at=admission,
        replica_speeds=speeds,
        replica_down=down,
        replica_drain=drain,
    )
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    assert gate["reason"].fillna("-").tolist() == sim["reason"].fillna("-").tolist()
    assert gate["replica"].tolist() == sim["replica"].fillna(-1).tolist()
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(gate["start_s"], sim["start_s"], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(gate["engine"], sim["engine"].fillna(-1))
    seen = gate["queued"].ge(0).to_numpy()
    np.testing.assert_array_equal(gate.loc[seen, "queued"], sim.loc[seen, "queued_at_arrival"])
    counts = sim["outcome"].value_counts()
    assert {k: v for k, v in stats["counts"].items() if v} == {k: int(v) for k, v in counts.items()}
    assert stats["waiting"] == 0 and stats["in_service"] == 0
    return sim, stats


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("policy", ["predictive", "bounded"])
def test_a_fleet_gate_matches_the_simulators_fleet_exactly(router, policy):
    trace = make_trace("poisson", "mix", load=1.4, engines=6, seconds=10, seed=3, noise_cv=0.3)
    sim, stats = _agree(trace, PRESETS[policy], 2, router)
    assert len(sim) > 200
    if router != "central":  # a central queue binds where an engine frees, and says so per row too
        assert sorted(sim["replica"].unique()) == [0, 1, 2]
        assert [r["up"] for r in stats["replicas"]] == [True] * 3
    assert stats["router"] == router and len(stats["replicas"]) == (1 if router == "central" else 3)
    # /stats names the fleet, which a replay's run file keeps and qlab compare rebuilds.
    from live.rows import server_info

    assert FleetSpec.from_fields(stats["fleet"]) == FleetSpec(3, make_router(router))
    assert server_info(stats).fleet == stats["fleet"]


def test_a_fleet_of_one_engine_replicas_under_overload():
    trace = make_trace("poisson", "mix", load=2.0, engines=4, seconds=10, seed=11, noise_cv=0.3)
    sim, _ = _agree(trace, PRESETS["predictive"], 1, "power_of_d", replicas=4)
    assert sim["outcome"].eq("rejected").sum() > 20


@pytest.mark.parametrize("router", ["jsq", "round_robin", "power_of_d"])
@pytest.mark.parametrize("policy", ["predictive", "bounded"])
def test_a_fleet_gate_admitting_at_the_gate_matches_the_simulator_exactly(router, policy):
    """qlab serve --replicas 3 --router NAME --admission-at gate: one admission on the fleet's
    state before routing (qsim.gate_view, through the same Fleet), request by request equal to
    simulate(..., admission_at="gate"); a refusal is routed nowhere (replica -1)."""
    trace = make_trace("poisson", "mix", load=1.4, engines=6, seconds=10, seed=3, noise_cv=0.3)
    sim, stats = _agree(trace, PRESETS[policy], 2, router, admission="gate")
    assert len(sim) > 200 and sim["outcome"].eq("rejected").sum() > 10
    assert sim.loc[sim["outcome"].eq("rejected"), "replica"].isna().all()
    assert stats["admission_at"] == "gate" and stats["fleet"]["admission"] == "gate"
    assert FleetSpec.from_fields(stats["fleet"]) == FleetSpec(
        3, make_router(router), admission="gate"
    )
    # Where it admits matters: the same trace admitted per replica is another run.
    apart = simulate(
        trace, ServerConfig(PRESETS[policy], 2), replicas=3, router=make_router(router)
    )
    assert apart["outcome"].tolist() != sim["outcome"].tolist()


# -- replicas at their own speeds, and down for a while (--replica-speeds, --replica-down) --------

SPEEDS, DOWN = (1.0, 0.5, 1.0), ((1, 3.0, 6.0), (2, 7.5, 8.25))


@pytest.mark.parametrize("router", ["round_robin", "jsq"])
@pytest.mark.parametrize("policy", ["predictive", "bounded"])
def test_replicas_at_their_own_speeds_and_down_for_a_while_match_the_simulator(router, policy):
    """qlab serve --replicas 3 --replica-speeds 1,0.5,1 --replica-down 1:3:6 --replica-down
    2:7.5:8.25, one engine at a time: the gate takes each replica down at its window's start (what
    it held ends once: a run engine_exception, a request waiting shutting_down), routes around it
    and back at its end, request by request equal to simulate(replica_speeds=, replica_down=)."""
    trace = make_trace("poisson", "mix", load=1.2, engines=5, seconds=10, seed=3, noise_cv=0.3)
    sim, stats = _agree(trace, PRESETS[policy], 2, router, speeds=SPEEDS, down=DOWN)
    ended = sim[sim["reason"].isin(["engine_exception", "shutting_down"])]
    assert set(ended["replica"]) == {1, 2} and set(ended["reason"]) >= {"engine_exception"}
    np.testing.assert_allclose(sorted(set(ended["finish_s"])), [3.0, 7.5], rtol=0, atol=0)
    sent = sim["replica"].eq(1) & sim["arrival_s"].between(3.0, 6.0, inclusive="left")
    assert not sent.any() and sim["replica"].eq(1).any()
    # The slower replica's runs took twice their true time.
    slow = sim[sim["replica"].eq(1) & sim["outcome"].eq("good")]
    np.testing.assert_allclose(
        slow["finish_s"] - slow["start_s"], 2 * trace.true_service_s[slow.index], rtol=1e-12
    )
    assert FleetSpec.from_fields(stats["fleet"]) == FleetSpec(3, make_router(router), SPEEDS, DOWN)
    assert all(r["up"] for r in stats["replicas"])
    # A run file puts the windows on its own clock: they count from the gate's start.
    from live.rows import server_info
    from qsim.runfile import fleet_spec

    assert stats["fleet"]["down_started_at"] == 0.0
    columns = server_info(stats).columns(1, server_zero=-2.0)  # the run began 2 s before the gate
    run = pd.DataFrame({k: list(v) for k, v in columns.items()})
    assert fleet_spec(run).down == ((1, 5.0, 8.0), (2, 9.5, 10.25))
    late = server_info(stats).columns(1, server_zero=4.0)  # began 4 s after: the first window 0-2
    assert fleet_spec(pd.DataFrame({k: list(v) for k, v in late.items()})).down == (
        (1, 0.0, 2.0),
        (2, 3.5, 4.25),
    )


@pytest.mark.parametrize("router", ["round_robin", "jsq", "central"])
def test_batching_replicas_at_their_own_speeds_and_down_for_a_while_match_the_simulator(router):
    """The same for three batching replicas (the synthetic batching engine's steps x 1 / its
    replica's speed; a replica down: its batch and line end once each, its blocks free)."""
    engine, trace = _batching(0.3, 3.0, 12, 4)
    config = ServerConfig(PRESETS["predictive"], engine=engine, seed=5)
    sim, stats = _agree_batching(trace, config, router, speeds=SPEEDS, down=DOWN)
    ended = sim[sim["reason"].isin(["engine_exception", "shutting_down"])]
    assert set(ended["replica"]) == {1, 2} and len(ended) > 3
    assert stats["fleet"]["speeds"] == list(SPEEDS)


# -- a replica that drains for a while (--replica-drain) ----------------------------------------

DRAIN = ((1, 3.0, 6.0),)


def _drained(sim, at: float = 3.0, back: float = 6.0) -> None:
    """Nothing ended in error; replica 1 was sent nothing inside its window (what it held then ran
    on there, answered), and was sent to again after it."""
    assert not sim["outcome"].eq("error").any()
    there = sim["replica"].eq(1)
    arrived = sim["arrival_s"]
    assert not (there & arrived.between(at, back, inclusive="left")).any()
    assert (there & arrived.lt(at)).any() and (there & arrived.ge(back)).any()
    held = sim[there & arrived.lt(at) & sim["finish_s"].gt(at)]
    assert len(held) and held["outcome"].isin(["good", "late"]).all()


@pytest.mark.parametrize("router", ["round_robin", "jsq"])
@pytest.mark.parametrize("policy", ["predictive", "bounded"])
def test_a_replica_draining_for_a_while_matches_the_simulator(router, policy):
    """qlab serve --replicas 3 --replica-drain 1:3:6, one engine at a time: the router sends
    replica 1 nothing from 3 s to 6 s after the gate's start while what it holds runs out there,
    request by request equal to simulate(replica_drain=); the run file's window on its clock."""
    trace = make_trace("poisson", "mix", load=1.2, engines=5, seconds=10, seed=3, noise_cv=0.3)
    sim, stats = _agree(trace, PRESETS[policy], 2, router, drain=DRAIN)
    _drained(sim)
    assert FleetSpec.from_fields(stats["fleet"]) == FleetSpec(3, make_router(router), drain=DRAIN)
    assert all(r["up"] for r in stats["replicas"])
    from live.rows import server_info
    from qsim.runfile import fleet_spec

    assert stats["fleet"]["down_started_at"] == 0.0
    columns = server_info(stats).columns(1, server_zero=4.0)  # began 4 s after: the window 0-2
    assert fleet_spec(pd.DataFrame({k: list(v) for k, v in columns.items()})).drain == (
        (1, 0.0, 2.0),
    )
    early = server_info(stats).columns(1, server_zero=-2.0)
    assert fleet_spec(pd.DataFrame({k: list(v) for k, v in early.items()})).drain == (
        (1, 5.0, 8.0),
    )


@pytest.mark.parametrize("router", ["round_robin", "jsq", "central"])
def test_batching_replicas_draining_for_a_while_match_the_simulator(router):
    """The same for three batching replicas: a draining replica's batch and line run out there (a
    central line's: it takes nothing from it in the window, and takes from it at once after)."""
    engine, trace = _batching(0.3, 3.0, 12, 4)
    config = ServerConfig(PRESETS["predictive"], engine=engine, seed=5)
    sim, stats = _agree_batching(trace, config, router, drain=DRAIN)
    if router == "central":  # bound where it joins a batch: none joins replica 1 in the window
        there = sim["replica"].eq(1)
        assert not (there & sim["start_s"].between(3.0, 6.0, inclusive="neither")).any()
        assert (there & sim["start_s"].ge(6.0)).any()
        # the line waited at 6 s: replica 1 took from it then, as the simulator's
        assert np.isclose(sim.loc[there & sim["start_s"].ge(6.0), "start_s"].min(), 6.0)
        assert not sim["outcome"].eq("error").any()
    else:
        _drained(sim)
    assert stats["fleet"]["drain"] == [list(w) for w in DRAIN]


def test_the_watch_leaves_a_draining_replica_draining_and_takes_it_down_when_unwell():
    """LiveFleet.watch reads a replica's down state, not its routing flag: a draining replica (not
    up, not down) is not brought back by a watch while well, goes down when unready, and once well
    again is still draining until its window ends."""
    from live.fleet_gate import fleet_queue

    def hook(*_):
        return None

    fleet = fleet_queue(
        ServerConfig(PRESETS["none"], 1),
        FleetSpec(3, make_router("round_robin")),
        start=hook,
        drop=hook,
        gone=hook,
        routed=hook,
    )
    fleet.drain(1)
    assert fleet.watch(1.0) == [] and fleet.up == [True, False, True]
    fleet.watch(2.0, unready={1})
    assert fleet._down[1] and fleet.up == [True, False, True]
    fleet.watch(3.0)
    assert not fleet._down[1] and fleet.up == [True, False, True]  # well, still draining
    fleet.end_drain(1, 4.0)
    assert fleet.up == [True] * 3


# -- a replica that dies mid-run --------------------------------------------------------------

HANG_AT, HANG_S = 4, 20.0  # replica 1's 4th run hangs 20 s: stalled after 5 s (the gate's rule)


async def _submit_row(gate, job, row: dict) -> None:
    """Submit ``job`` and write how it ended into ``row``: outcome, reason, replica (every ending
    of a request is a row)."""
    try:
        answer = await gate.submit(job)
    except Rejected as exc:
        row.update(outcome="rejected", reason=exc.rejection.reason, replica=exc.arrival.replica)
    except tuple(_ENDS) as exc:
        outcome = next(o for kind, o in _ENDS.items() if isinstance(exc, kind))
        row.update(outcome=outcome, reason=exc.reason, replica=exc.arrival.replica)
    else:
        row.update(outcome=answer.outcome, reason=None, replica=answer.replica)


def _run_with_a_hung_replica(router: str):
    """Every 0.03 s for 39 s a request of 12 tokens (0.05 s) to 3 one-engine replicas, replica 1's
    engine hanging at its 4th run; each request's (arrival, replica, outcome, reason), /stats."""
    from live.engine import Faults
    from live.gate import Gate, gate_config
    from live.jobs import Job
    from test_gate_sim import MODEL
    from virtual_time import LoopSynthetic, on_virtual_clock

    rows, ups = [], []

    async def go():
        import asyncio

        loop = asyncio.get_running_loop()
        engines = [
            LoopSynthetic(MODEL),
            LoopSynthetic(MODEL, faults=Faults(hang_after=HANG_AT - 1, hang_s=HANG_S)),
            LoopSynthetic(MODEL),
        ]
        config = gate_config(PRESETS["predictive"], model=MODEL)
        tasks = []
        fleet = FleetSpec(3, make_router(router))
        async with Gate(engines, config, clock=loop.time, fleet=fleet) as gate:
            for i in range(1300):
                await asyncio.sleep(max(0.0, i * 0.03 - loop.time()))
                row = {"arrival_s": loop.time(), "outcome": None}
                rows.append(row)
                tasks.append(asyncio.ensure_future(_submit_row(gate, Job(str(i), 12), row)))
                ups.append((loop.time(), [r["up"] for r in gate.stats()["replicas"]]))
            await asyncio.gather(*tasks)
            while gate.in_service:
                await asyncio.sleep(0.05)
            return gate.stats()

    import pandas as pd

    stats = on_virtual_clock(go)
    return pd.DataFrame(rows), stats, ups


@pytest.mark.parametrize("router", ["round_robin", "jsq", "random"])
def test_a_replica_whose_engine_hangs_is_routed_around_until_it_is_back(router):
    frame, stats, ups = _run_with_a_hung_replica(router)
    # Every request ended once, and the counts say so.
    assert frame["outcome"].notna().all()
    assert sum(stats["counts"].values()) == stats["submitted"] == len(frame)
    assert stats["counts"]["error"] == frame["outcome"].eq("error").sum() >= 1
    assert set(frame.loc[frame["outcome"].eq("error"), "reason"]) == {"engine_stalled"}
    # Down once its one engine is stalled (5 s after the hung run began), up once it is back.
    down = [t for t, up in ups if not up[1]]
    assert down and 5.0 < down[0] < 7.0 and HANG_S < down[-1] < HANG_S + 3.0
    assert all(up[0] and up[2] for _, up in ups)
    sent = frame.loc[frame["replica"].eq(1), "arrival_s"]
    assert not sent.between(down[0], down[-1]).any()  # the router sent it nothing while down
    assert (sent > down[-1]).sum() > 20  # and sends again once it is back
    assert all(r["up"] for r in stats["replicas"])


class _GoneUpstream:
    """A coroutine engine on the loop's clock whose upstream is away from ``away[0]`` to ``away[1]``
    s: its runs then fail at once, as a refused connection does, and its readiness says so
    (live.engine.Checked, as the upstream engine's)."""

    abilities = Abilities(coroutine=True)
    max_new_tokens_limit = None

    def __init__(self, model, away=(None, None)) -> None:
        self.model, self.away = model, away

    def _gone(self) -> bool:
        import asyncio

        now = asyncio.get_running_loop().time()
        return self.away[0] is not None and self.away[0] <= now < self.away[1]

    async def arun(self, prompt, max_new_tokens, stop=None):
        import asyncio

        if self._gone():
            raise UpstreamError("http://b:8001/v1/completions: ClientConnectorError: refused")
        await asyncio.sleep(float(self.model.estimate(max_new_tokens)))
        return EngineResult(WORD * max_new_tokens, max_new_tokens, 0.0)

    async def readiness(self):
        return "http://b:8001/v1/models: cannot reach the upstream" if self._gone() else None

    def count_tokens(self, text: str) -> int:
        return len(text.encode())

    def warmup(self) -> None:
        pass

    def info(self) -> dict:
        return {"engine": "gone-upstream"}


def _fleet_of_upstreams(engines, policy: str, router: str):
    """800 requests, one each 30 ms, through a fleet gate of one replica per engine, on the
    virtual clock: each request's row (arrival, outcome, reason, replica), whether each replica
    was up at each arrival, and the final /stats."""
    import asyncio

    import pandas as pd

    from live.gate import Gate, gate_config
    from live.jobs import Job
    from test_gate_sim import MODEL
    from virtual_time import on_virtual_clock

    rows, ups = [], []

    async def go():
        loop = asyncio.get_running_loop()
        config = gate_config(PRESETS[policy], model=MODEL)
        tasks = []
        fleet = FleetSpec(len(engines), make_router(router))
        async with Gate(engines, config, clock=loop.time, fleet=fleet) as gate:
            for i in range(800):
                await asyncio.sleep(max(0.0, i * 0.03 - loop.time()))
                row = {"arrival_s": loop.time(), "outcome": None}
                rows.append(row)
                tasks.append(asyncio.ensure_future(_submit_row(gate, Job(str(i), 12), row)))
                ups.append((loop.time(), [r["up"] for r in gate.stats()["replicas"]]))
            await asyncio.gather(*tasks)
            return gate.stats()

    stats = on_virtual_clock(go)
    return pd.DataFrame(rows), ups, stats


@pytest.mark.parametrize("router", ["round_robin", "jsq"])
def test_a_replica_whose_upstream_goes_away_is_routed_around_until_it_is_back(router):
    from test_gate_sim import MODEL

    engines = [_GoneUpstream(MODEL), _GoneUpstream(MODEL, away=(5.0, 15.0)), _GoneUpstream(MODEL)]
    frame, ups, stats = _fleet_of_upstreams(engines, "predictive", router)
    assert frame["outcome"].notna().all()
    assert sum(stats["counts"].values()) == stats["submitted"] == len(frame)
    down = [t for t, up in ups if not up[1]]
    assert 5.0 <= down[0] < 5.2 and 15.0 <= down[-1] < 15.2  # within a watchdog tick or two
    sent = frame.loc[frame["replica"].eq(1), "arrival_s"]
    assert not sent.between(down[0], down[-1]).any()
    assert (sent > down[-1]).sum() > 20
    failed = frame[frame["outcome"].eq("error")]
    assert len(failed) >= 1 and set(failed["reason"]) == {"upstream_error"}
    assert failed["arrival_s"].between(5.0, 5.2).all()  # what it took before the gate noticed


# -- qlab serve's options ----------------------------------------------------------------------


def _options(*argv):
    import argparse

    from live.serve_options import ServeOptions

    parser = argparse.ArgumentParser()
    ServeOptions.add_flags(parser)
    return ServeOptions.from_args(parser.parse_args(list(argv)))


def test_serve_options_say_the_fleet():
    assert _options().fleet() is None
    fleet = _options("--replicas", "3", "--router", "power_of_d", "--router-d", "3").fleet()
    assert (fleet.replicas, fleet.router) == (3, make_router("power_of_d", 3))
    assert _options("--replicas", "2").fleet().router.name == "round_robin"
    up = _options(
        "--engine", "upstream", "--upstream-url", "http://a:1/v1", "--upstream-url", "http://b:2"
    )
    assert up.upstream_urls() == ["http://a:1/v1", "http://b:2"] and up.fleet().replicas == 2
    assert "--upstream-url" in up.argv() and "http://a:1/v1,http://b:2" in up.argv()


def test_serve_options_say_where_a_fleet_admits():
    """--admission-at {replica,gate} (the simulator's flag), and [server]'s admission_at: a
    fleet's option, refused in one line without replicas or with another value."""
    from inputs.tomlfiles import ConfigError
    from live.serve_options import ServeOptions

    assert _options("--replicas", "3").fleet().admission == "replica"
    gate = _options("--replicas", "3", "--router", "jsq", "--admission-at", "gate")
    assert gate.fleet() == FleetSpec(3, make_router("jsq"), admission="gate")
    argv = gate.argv()
    assert argv[argv.index("--admission-at") + 1] == "gate"
    batching = _options("--batching", "--replicas", "2", "--admission-at", "gate")
    assert batching.fleet() == FleetSpec(2, make_router("round_robin"), admission="gate")
    # What cmd_serve builds of them: one admission, the fleet's, for both replicas.
    from live.commands import _batching_gate
    from qsim import ServiceModel

    served = _batching_gate(
        batching, batching.make_policy(), ServiceModel(), batching.engine_model(), batching.fleet()
    )
    lines = served.queue.lines
    assert served.queue.gate is lines[0].admission is lines[1].admission
    table = ServeOptions.from_table("t", {"replicas": 2, "admission_at": "gate"})
    assert table.fleet().admission == "gate" and ServeOptions.toml_kinds()["admission_at"] is str
    with pytest.raises(ValueError, match=r"^--admission-at: a fleet's options, for --replicas"):
        _options("--admission-at", "gate")
    with pytest.raises(ConfigError, match=r"^t: --admission-at: a fleet's options"):
        ServeOptions.from_table("t", {"admission_at": "gate"})
    with pytest.raises(ConfigError, match=r"^t.admission_at: must be replica or gate, got 'pod'$"):
        ServeOptions.from_table("t", {"replicas": 2, "admission_at": "pod"})


def test_serve_refuses_a_bad_admission_at_in_one_line(capsys):
    import argparse

    from live.serve_options import ServeOptions

    parser = argparse.ArgumentParser(prog="qlab serve")
    ServeOptions.add_flags(parser)
    with pytest.raises(SystemExit) as exit:
        parser.parse_args(["--replicas", "2", "--admission-at", "pod"])
    assert exit.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]  # argparse's line, as --router's
    assert said.startswith("qlab serve: error: argument --admission-at: invalid choice: 'pod'")


def test_serve_options_take_replica_speeds_and_replicas_down():
    """--replica-speeds S,S,... and --replica-down R:FROM:TO (repeat), and [server]'s keys of the
    same names: the fleet's FleetSpec speeds and down, on a child's command line too; what
    cmd_serve builds of them: each replica's synthetic engines at its speed."""
    from live.commands import _batching_gate, _engines
    from live.serve_options import ServeOptions
    from qsim import ServiceModel

    argv = ("--replicas", "3", "--engines", "2", "--replica-speeds", "1,1,0.5")
    options = _options(*argv, "--replica-down", "1:3:6", "--replica-down", "0:1:2.5")
    fleet = options.fleet()
    assert fleet == FleetSpec(
        3, make_router("round_robin"), (1.0, 1.0, 0.5), ((1, 3, 6), (0, 1, 2.5))
    )
    child = options.argv()
    assert child[child.index("--replica-down") + 1] == "1:3:6,0:1:2.5"
    engines = _engines(options, ServiceModel(), fleet)
    times = [e.duration_s(10) for e in engines]
    assert times[:4] == [times[0]] * 4 and times[4] == times[5] == 2 * times[0]
    batching = _options("--batching", "--replicas", "2", "--replica-speeds", "2,1")
    gate = _batching_gate(
        batching, batching.make_policy(), ServiceModel(), batching.engine_model(), batching.fleet()
    )
    assert [e.slow for e in gate.engines] == [0.5, 1.0]
    assert gate.fleet.speeds == (2.0, 1.0)
    table = ServeOptions.from_table(
        "t", {"replicas": 2, "replica_speeds": "1,0.5", "replica_down": "1:2:3"}
    )
    assert table.fleet() == FleetSpec(2, make_router("round_robin"), (1.0, 0.5), ((1, 2, 3),))


def test_serve_options_take_replica_drains_for_every_engine():
    """--replica-drain R:FROM:TO (repeat) and [server]'s replica_drain: the fleet's FleetSpec
    drain, on a child's command line too; a drain is routing, so any engine's fleet takes it (a
    fleet of upstreams, one per --upstream-url, included)."""
    from live.serve_options import ServeOptions

    options = _options("--replicas", "3", "--replica-drain", "1:3:6", "--replica-drain", "0:1:2.5")
    assert options.fleet() == FleetSpec(
        3, make_router("round_robin"), drain=((1, 3, 6), (0, 1, 2.5))
    )
    child = options.argv()
    assert child[child.index("--replica-drain") + 1] == "1:3:6,0:1:2.5"
    assert _options(*child[child.index("serve") + 1 :]).fleet() == options.fleet()
    both = _options("--replicas", "2", "--replica-down", "0:1:2", "--replica-drain", "1:3:4")
    assert both.fleet() == FleetSpec(
        2, make_router("round_robin"), down=((0, 1, 2),), drain=((1, 3, 4),)
    )
    urls = ("--upstream-url", "http://a:1", "--upstream-url", "http://b:2")
    upstream = _options("--engine", "upstream", *urls, "--replica-drain", "1:2:3")
    assert upstream.fleet().drain == ((1, 2.0, 3.0),)
    assert "--replica-drain" in upstream.argv()
    table = ServeOptions.from_table("t", {"replicas": 2, "replica_drain": "1:2:3,0:5:6"})
    assert table.fleet().drain == ((1, 2.0, 3.0), (0, 5.0, 6.0))
    assert ServeOptions.toml_kinds()["replica_drain"] is str
    up_table = ServeOptions.from_table(
        "t",
        {"engine": "upstream", "upstream_url": "http://a:1,http://b:2", "replica_drain": "0:1:2"},
    )
    assert up_table.fleet().drain == ((0, 1.0, 2.0),)


@pytest.mark.parametrize(
    "argv, says",
    [
        (("--replica-drain", "0:1:2"), "--replica-drain: a fleet's options"),
        (("--replicas", "2", "--replica-drain", "1:3"), "bad --replica-drain '1:3'"),
        (("--replicas", "2", "--replica-drain", "2:1:3"), "a replica draining is (replica of 0..1"),
        (("--replicas", "2", "--replica-drain", "1:3:2"), "0 <= from_s < to_s"),
        (
            ("--replicas", "2", "--replica-down", "0:1:3", "--replica-drain", "1:2:4"),
            "every replica is down or draining at 2 s",
        ),
        (
            ("--replicas", "2", "--router", "central", "--replica-drain", "1:2:3"),
            "a replica draining: a central queue in front of engines one at a time",
        ),
        (("--replica-speeds", "1,1"), "--replica-speeds: a fleet's options, for --replicas N > 1"),
        (("--replica-down", "0:1:2"), "--replica-down: a fleet's options"),
        (("--replicas", "2", "--replica-speeds", "1,x"), "bad --replica-speeds '1,x'"),
        (("--replicas", "2", "--replica-speeds", "1"), "one number > 0 for each of the 2"),
        (("--replicas", "2", "--replica-speeds", "1,0"), "one number > 0 for each of the 2"),
        (("--replicas", "2", "--replica-down", "1:3"), "bad --replica-down '1:3'"),
        (("--replicas", "2", "--replica-down", "2:1:3"), "replica of 0..1"),
        (("--replicas", "2", "--replica-down", "1:3:2"), "0 <= from_s < to_s"),
        (
            ("--replicas", "2", "--replica-down", "0:1:3", "--replica-down", "1:2:4"),
            "every replica is down at 2 s",
        ),
        (
            ("--replicas", "2", "--router", "central", "--replica-speeds", "1,2"),
            "a central queue in front of engines one at a time",
        ),
        (
            (
                "--engine",
                "upstream",
                "--upstream-url",
                "http://a:1",
                "--upstream-url",
                "http://b:2",
                "--replica-speeds",
                "1,2",
            ),
            "--replica-speeds: only with --engine synthetic",
        ),
        (("--engine", "gpt2", "--replica-down", "0:1:2"), "only with --engine synthetic"),
    ],
)
def test_serve_refuses_bad_replica_speeds_downs_and_drains_in_one_line(argv, says, capsys):
    from experiments.cli import main

    assert main(["serve", "--port", "0", *argv]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and says in said[0], said


def test_a_server_table_refuses_replica_speeds_for_an_engine_of_its_own_speed():
    from inputs.tomlfiles import ConfigError
    from live.serve_options import ServeOptions

    table = {"engine": "upstream", "upstream_url": "http://a:1,http://b:2"}
    with pytest.raises(ConfigError, match=r"^t: --replica-speeds, --replica-down: only with"):
        ServeOptions.from_table("t", {**table, "replica_speeds": "1,2"})


@pytest.mark.parametrize("router", ["least_work", "least_kv", "least_ttft", "central"])
def test_serve_options_take_a_fleet_of_batching_replicas(router):
    """qlab serve --batching --replicas 3 --router NAME (the synthetic engine): one batching engine
    per replica behind the simulator's router; routers that read a batch's KV memory or project
    its first token are a batching fleet's."""
    from qsim.engines import Batching

    options = _options(
        "--batching",
        "--replicas",
        "3",
        "--router",
        router,
        "--kv-blocks",
        "64",
        "--faulty-replica",
        "2",
        "--fail-every",
        "9",
    )
    assert options.fleet() == FleetSpec(3, make_router(router))
    assert options.engine_model() == Batching(kv_blocks=64)
    argv = options.argv()
    assert "--batching" in argv and argv[argv.index("--replicas") + 1] == "3"
    assert argv[argv.index("--router") + 1] == router


def test_serve_builds_a_gate_of_batching_replicas():
    """What cmd_serve serves for those options: one SyntheticBatchEngine per replica (its noise
    that replica's stream, the faults --faulty-replica's alone) in one gate."""
    from live.commands import _batching_gate
    from qsim import ServiceModel

    options = _options(
        "--batching",
        "--replicas",
        "3",
        "--router",
        "jsq",
        "--faulty-replica",
        "1",
        "--fail-every",
        "5",
        "--seed",
        "4",
    )
    gate = _batching_gate(
        options, options.make_policy(), ServiceModel(), options.engine_model(), options.fleet()
    )
    assert gate.fleet == FleetSpec(3, make_router("jsq")) and gate.config.seed == 4
    assert [e.replica for e in gate.engines] == [0, 1, 2]
    assert [e.faults.fail_every for e in gate.engines] == [0, 5, 0]
    assert type(gate.driver).__name__ == "BatchDriver"


@pytest.mark.parametrize(
    "argv, says",
    [
        (("--replicas", "2", "--batching", "--engine", "gpt2"), "--batching with replicas"),
        (
            ("--replicas", "2", "--batching", "--engines", "2"),
            "--batching runs one batching engine",
        ),
        (("--router", "jsq"), "--router: a fleet's options"),
        (("--replicas", "2", "--router", "least_kv"), "its replicas need --batching"),
        (("--replicas", "2", "--faulty-replica", "2"), "replicas are 0..1"),
        (
            (
                "--engine",
                "upstream",
                "--upstream-url",
                "http://a:1",
                "--upstream-url",
                "http://b:2",
                "--replicas",
                "3",
            ),
            "one replica per --upstream-url",
        ),
        (
            ("--engine", "upstream", "--upstream-url", "http://a:1", "--upstream-url", "ftp://b"),
            "must be http",
        ),
    ],
)
def test_serve_options_refuse_a_fleet_that_cannot_run(argv, says):
    with pytest.raises(ValueError, match=says):
        _options(*argv)


def test_a_server_table_takes_the_fleet_too():
    from inputs.tomlfiles import ConfigError
    from live.serve_options import ServeOptions

    assert ServeOptions.from_table("t", {"replicas": 3, "router": "jsq"}).fleet().replicas == 3
    with pytest.raises(ConfigError, match="t: --batching with replicas"):
        ServeOptions.from_table("t", {"replicas": 2, "batching": True, "engine": "gpt2"})
    table = ServeOptions.from_table("t", {"replicas": 3, "batching": True, "router": "least_kv"})
    assert table.fleet() == FleetSpec(3, make_router("least_kv"))
    with pytest.raises(ConfigError, match="t.router: must be"):
        ServeOptions.from_table("t", {"replicas": 2, "router": "nearest"})


def test_a_new_calibration_reaches_every_replica():
    import asyncio

    from live.gate import Gate, gate_config
    from qsim import ServiceModel
    from qsim.service import LoadTerms
    from virtual_time import LoopSynthetic, on_virtual_clock
    from test_gate_sim import MODEL

    async def go():
        loop = asyncio.get_running_loop()
        config = gate_config(PRESETS["predictive"], model=MODEL)
        gate = Gate(
            [LoopSynthetic(MODEL) for _ in range(4)],
            config,
            clock=loop.time,
            fleet=FleetSpec(2, make_router("jsq")),
        )
        async with gate:
            new = ServiceModel(intercept_s=0.01, per_token_s=0.002)
            gate.use_calibration(new, LoadTerms())
            return [line.config.model for line in gate.queue.lines], gate.stats()

    models, stats = on_virtual_clock(go)
    assert models == [ServiceModel(intercept_s=0.01, per_token_s=0.002)] * 2
    assert stats["engines"] == 4 and [r["engines"] for r in stats["replicas"]] == [2, 2]


def test_draining_a_fleet_gate_answers_every_replicas_waiting():
    import asyncio

    from live.gate import Gate, gate_config
    from live.gate_errors import ShuttingDown
    from live.jobs import Job
    from test_gate_sim import MODEL
    from virtual_time import LoopSynthetic, on_virtual_clock

    async def go():
        loop = asyncio.get_running_loop()
        config = gate_config(PRESETS["none"], model=MODEL)
        gate = Gate(
            [LoopSynthetic(MODEL) for _ in range(3)],
            config,
            clock=loop.time,
            fleet=FleetSpec(3, make_router("round_robin")),
        )
        async with gate:
            futures = [gate.submit(Job(str(i), 12)) for i in range(12)]
            assert [r["waiting"] for r in gate.stats()["replicas"]] == [3, 3, 3]
            gate.drain()
            ended = await asyncio.gather(*futures, return_exceptions=True)
            return ended, gate.stats(), gate.queue.where

    ended, stats, where = on_virtual_clock(go)
    assert sum(isinstance(e, ShuttingDown) for e in ended) == 9
    assert stats["counts"]["good"] == 3 and stats["counts"]["error"] == 9
    assert not where  # each ended request's replica is forgotten


class _FailingUpstream(_GoneUpstream):
    """Reachable and ready all along (its readiness says nothing is wrong), but from ``away[0]`` to
    ``away[1]`` s every run fails at once: an upstream that answers 500 to everything."""

    async def readiness(self):
        return None


@pytest.mark.parametrize("router", ["jsq", "least_work"])
def test_a_replica_that_fails_at_once_is_paused_and_tried_again(router):
    """A replica whose runs fail at once looks idle: jsq and least_work would send it nearly
    everything. After FAILING_STREAK failures in a row the gate pauses it for FAILING_PAUSE_S,
    sends to it again, and keeps it once it answers."""
    from live.fleet_gate import FAILING_PAUSE_S, FAILING_STREAK
    from test_gate_sim import MODEL

    engines = [
        _GoneUpstream(MODEL),
        _FailingUpstream(MODEL, away=(5.0, 15.0)),
        _GoneUpstream(MODEL),
    ]
    frame, ups, stats = _fleet_of_upstreams(engines, "none", router)
    assert frame["outcome"].notna().all() and sum(stats["counts"].values()) == len(frame)
    failed = frame[frame["outcome"].eq("error")]
    assert set(failed["reason"]) == {"upstream_error"}
    # Without the pause the idle-looking replica would take most of the 333 arrivals of the 10 s;
    # with it, a streak before each pause and one trial after it.
    pauses = 10.0 / FAILING_PAUSE_S
    assert len(failed) <= FAILING_STREAK + pauses + 2
    down = [t for t, up in ups if not up[1]]
    assert down and 5.0 <= down[0] < 6.0 and down[-1] < 15.0 + FAILING_PAUSE_S + 0.2
    sent = frame.loc[frame["replica"].eq(1), "arrival_s"]
    assert (sent > 15.0 + FAILING_PAUSE_S + 0.2).sum() > 20  # it answers again, and is kept
    assert all(r["up"] for r in stats["replicas"])


# -- batching replicas ---------------------------------------------------------------------------

#: prefix and weighted read a prefix cache the live engine does not model (prefix_hit 0 there).
BATCH_ROUTERS = [
    "round_robin",
    "random",
    "jsq",
    "least_work",
    "least_kv",
    "least_ttft",
    "power_of_d",
    "prefix",
    "weighted",
    "central",
]


def _agree_batching(
    trace,
    config,
    router: str,
    replicas: int = 3,
    admission="replica",
    speeds=None,
    down=(),
    drain=(),
):
    """A gate of ``replicas`` batching replicas (the real SyntheticBatchEngine, one each) and the
    simulator's batching fleet, request by request: outcome, reason, replica, engine, start,
    finish, first token, tokens and the admission view (admitted where ``admission`` says)."""
    spec = FleetSpec(replicas, make_router(router), speeds, down, admission=admission, drain=drain)
    gate, stats = run_gate(trace, None, 1, config=config, fleet=spec)
    sim = simulate(
        trace,
        config,
        replicas=replicas,
        router=spec.router,
        admission_at=admission,
        replica_speeds=speeds,
        replica_down=down,
        replica_drain=drain,
    )
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    assert gate["reason"].fillna("-").tolist() == sim["reason"].fillna("-").tolist()
    joined = sim["start_s"].notna().to_numpy()
    early = not spec.router.shared  # a central queue's request has a replica once it joins
    both = gate["replica"].ge(0).to_numpy() if early else joined
    assert gate.loc[both, "replica"].tolist() == sim.loc[both, "replica"].astype(int).tolist()
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-9)
    known = gate["outcome"].ne("abandoned").to_numpy() & joined
    np.testing.assert_allclose(
        gate.loc[known, "start_s"], sim.loc[known, "start_s"], rtol=0, atol=1e-9
    )
    np.testing.assert_array_equal(gate.loc[known, "engine"], sim.loc[known, "engine"])
    answered = sim["outcome"].isin(["good", "late"]).to_numpy()
    np.testing.assert_allclose(
        gate.loc[answered, "first_token_s"] - gate.loc[answered, "arrival_s"],
        sim.loc[answered, "ttft_s"],
        rtol=0,
        atol=1e-9,
    )
    np.testing.assert_array_equal(gate.loc[answered, "tokens"], sim.loc[answered, "output_tokens"])
    seen = gate["queued"].ge(0).to_numpy()
    np.testing.assert_array_equal(
        gate.loc[seen, "queued"], sim.loc[seen, "queued_at_arrival"].astype(int)
    )
    np.testing.assert_allclose(
        gate.loc[seen, "est_service_s"], sim.loc[seen, "est_service_s"], rtol=0, atol=1e-9
    )
    counts = sim["outcome"].value_counts()
    assert {k: v for k, v in stats["counts"].items() if v} == {k: int(v) for k, v in counts.items()}
    assert stats["waiting"] == 0 and stats["in_service"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["router"] == router and len(stats["replicas"]) == replicas
    assert FleetSpec.from_fields(stats["fleet"]) == spec
    return sim, stats


def _batching(cv: float | None, load: float, seconds: float, seed: int):
    """Batching replicas of the test step model (noise ``cv``; None: none) whose KV blocks bind,
    and test_gate_batching's Poisson trace of the mix at ``load`` times one replica's capacity."""
    from qsim.engines import Batching, StepModel
    from test_gate_batching import STEP, _trace

    step = STEP if cv is None else StepModel(STEP.b0, STEP.b1, STEP.b2, STEP.b3, cv=cv)
    engine = Batching(step, max_num_seqs=8, max_num_batched_tokens=256, kv_blocks=40, block_size=16)
    return engine, _trace(engine, load, seed, seconds)


@pytest.mark.parametrize("router", BATCH_ROUTERS)
def test_a_fleet_of_batching_replicas_matches_the_simulators_fleet_exactly(router):
    """Three batching replicas (KV blocks that bind, noisy steps: each replica its own stream)
    behind each router, on the virtual clock: 0 disagreements with the simulator's fleet."""
    # Load 4 over one replica's capacity: 1.33 on each of the three.
    engine, trace = _batching(0.3, 4.0, 12, 4)
    config = ServerConfig(PRESETS["predictive"], engine=engine, seed=5)
    sim, stats = _agree_batching(trace, config, router)
    assert len(sim) > 300 and sim["preemptions"].max() >= 1
    if router != "central":
        assert sorted(sim["replica"].unique()) == [0, 1, 2]
    assert stats["batching"]["steps"] > 100


@pytest.mark.parametrize("router", ["jsq", "round_robin", "least_kv"])
@pytest.mark.parametrize("policy", ["predictive", "bounded"])
def test_batching_replicas_admitting_at_the_gate_match_the_simulator_exactly(router, policy):
    """qlab serve --batching --replicas 3 --router NAME --admission-at gate: the fleet's waiting and
    the soonest replica's projection decide (qsim.gate_view.batching), 0 disagreements with
    simulate(..., admission_at="gate")."""
    engine, trace = _batching(0.3, 8.0, 8, 4)
    config = ServerConfig(PRESETS[policy], engine=engine, seed=5)
    sim, stats = _agree_batching(trace, config, router, admission="gate")  # 2.7 on each replica
    assert len(sim) > 600 and sim["outcome"].eq("rejected").sum() > 10
    assert sim.loc[sim["outcome"].eq("rejected"), "replica"].isna().all()
    assert stats["admission_at"] == "gate"
    apart = simulate(trace, config, replicas=3, router=make_router(router))
    assert apart["outcome"].tolist() != sim["outcome"].tolist()


@pytest.mark.parametrize("router", ["jsq", "central"])
def test_batching_replicas_that_cut_at_the_deadline_and_lose_clients_match_the_simulator(router):
    from test_gate_batching import PROMPTS, TIGHT

    trace = make_trace(
        "poisson",
        "mix",
        load=6.0,
        engines=1,
        seconds=12,
        seed=7,
        prompts=PROMPTS,
        capacity_rps=TIGHT.capacity_rps(PROMPTS.mean(), 28.0),
    )
    patience = np.where(np.arange(len(trace)) % 4 == 0, 0.4, np.inf)  # every fourth leaves
    policy = PRESETS["none"].with_args({"cancel_at_deadline": True}).with_overrides(deadline_s=1.5)
    spec = FleetSpec(3, make_router(router))
    config = ServerConfig(policy, engine=TIGHT)
    gate, stats = run_gate(trace, None, 1, config=config, fleet=spec, cancel_after_s=patience)
    sim = simulate(trace, config, replicas=3, router=spec.router, cancel_after_s=patience)
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    assert gate["reason"].fillna("-").tolist() == sim["reason"].fillna("-").tolist()
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-9)
    counts = sim["outcome"].value_counts()
    assert counts.get("cancelled", 0) >= 3 and counts.get("abandoned", 0) >= 5
    assert stats["in_service"] == 0 and stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("router", ["jsq", "central"])
def test_a_batching_fleets_own_steps_replayed_give_its_rows(router):
    """qlab compare's replay of a batching fleet's run: the gate logs its replicas' steps in the
    order their cores planned them, which is the order simulate(step_times=) gives them out, so
    the run's own step times (another seed's noise in the simulator) give its rows again."""
    noisy, trace = _batching(0.5, 4.0, 10, 9)
    config = ServerConfig(
        PRESETS["predictive"].with_args({"cancel_at_deadline": True}), engine=noisy, seed=3
    )
    spec = FleetSpec(3, make_router(router))
    gate, stats = run_gate(trace, None, 1, config=config, fleet=spec)
    log = stats["step_log"]
    assert len(log) == stats["batching"]["steps"] > 300
    times = [(began - woken, ended - began, engine) for woken, began, ended, engine, *_ in log]
    replayed = simulate(
        trace, config.replace(seed=4), replicas=3, router=spec.router, step_times=times
    )
    assert gate["outcome"].tolist() == replayed["outcome"].tolist()
    np.testing.assert_allclose(gate["finish_s"], replayed["finish_s"], rtol=0, atol=1e-9)
    own = simulate(trace, config.replace(seed=4), replicas=3, router=spec.router)
    assert own["finish_s"].tolist() != replayed["finish_s"].tolist()


@pytest.mark.parametrize("router", ["jsq", "central"])
def test_a_batching_replicas_own_step_model_moves_its_line_alone_and_is_replayed_so(router):
    """Each replica of a fleet of batching upstreams learns its own server's steps: a refit on
    replica 1 moves replica 1's line alone (the others plan on), the step log says after which
    step, and the replay (qsim.runfile.batch_step_times) moves the line whose step took it: the
    same rows, and the replicas' estimates moved only where replica 1 planned."""
    import pandas as pd

    from qsim.engines import StepModel
    from qsim.runfile import batch_step_columns, batch_step_times
    from test_gate_batching import ENGINE, STEP, _Refits, _trace

    slower = StepModel(4 * STEP.b0, 2 * STEP.b1, 4 * STEP.b2, STEP.b3)
    trace = _trace(ENGINE, 3.0, seed=12)
    config = ServerConfig(PRESETS["predictive"], engine=ENGINE)
    spec = FleetSpec(3, make_router(router))
    refits = {40: slower}
    gate, stats = run_gate(
        trace,
        None,
        1,
        config=config,
        fleet=spec,
        wrap_engine=lambda e: _Refits(e, refits if e.replica == 1 else {}),
    )
    models = stats["step_models"]
    assert len(models) == 1 and stats["server_config"]["engine"]["step"]["b0"] == STEP.b0
    steps = stats["step_log"]
    run = pd.DataFrame(batch_step_columns(steps, 1, models))
    times = batch_step_times(run)
    assert [t[3] for t in times if t[3] is not None] == [slower]
    replayed = simulate(trace, config, replicas=3, router=spec.router, step_times=times)
    assert gate["outcome"].tolist() == replayed["outcome"].tolist()
    assert gate["replica"].fillna(-1).tolist() == replayed["replica"].fillna(-1).tolist()
    np.testing.assert_allclose(gate["finish_s"], replayed["finish_s"], rtol=0, atol=1e-9)
    seen = gate["queued"].ge(0).to_numpy()
    np.testing.assert_allclose(
        gate.loc[seen, "est_service_s"], replayed.loc[seen, "est_service_s"], rtol=0, atol=1e-9
    )
    # Without the refit the replay projects otherwise; routed early, only where replica 1
    # decided (a central queue projects over every replica's line).
    blind = simulate(
        trace, config, replicas=3, router=spec.router, step_times=[t[:3] for t in times]
    )
    moved = seen & ~np.isclose(gate["est_service_s"], blind["est_service_s"], rtol=1e-6)
    assert moved.sum() >= 20
    assert router == "central" or gate.loc[moved, "replica"].eq(1).all()


@pytest.mark.parametrize("router", ["round_robin", "central"])
def test_draining_a_batching_fleet_answers_what_waits_and_runs_the_batches_out(router):
    """One seat per replica: a burst of 12 to 3 replicas seats 3; drain() answers the 9 waiting
    (each replica's line, or the central one) ShuttingDown, the 3 in the batches are answered."""
    import asyncio

    from live.batching import SyntheticBatchEngine
    from live.gate import Gate, gate_config
    from live.gate_errors import ShuttingDown
    from live.jobs import Job
    from qsim.engines import Batching, StepModel
    from virtual_time import on_virtual_clock

    async def go():
        loop = asyncio.get_running_loop()
        engine = Batching(StepModel(0.01, 0.0, 0.0002, 0.0), max_num_seqs=1)
        engines = [SyntheticBatchEngine(engine.step, clock=loop.time, replica=r) for r in range(3)]
        gate = Gate(
            engines,
            gate_config(PRESETS["none"], engine=engine),
            clock=loop.time,
            fleet=FleetSpec(3, make_router(router)),
        )
        async with gate:
            futures = [gate.submit(Job(str(i), 12)) for i in range(12)]
            assert gate.waiting == 9 and gate.in_service == 3
            gate.drain()
            ended = await asyncio.gather(*futures, return_exceptions=True)
            return ended, gate.stats(), gate.queue.where

    ended, stats, where = on_virtual_clock(go)
    assert sum(isinstance(e, ShuttingDown) for e in ended) == 9
    answered = [e for e in ended if not isinstance(e, Exception)]
    assert sorted(a.replica for a in answered) == [0, 1, 2]
    assert all(a.tokens == 12 for a in answered)
    assert stats["counts"]["good"] == 3 and stats["counts"]["error"] == 9
    assert stats["waiting"] == 0 and stats["batching"]["running"] == 0
    assert not where  # each ended request's replica is forgotten


# -- batching replicas' health -------------------------------------------------------------------


def _batching_fleet_with(faults, router: str, n: int = 1000, every_s: float = 0.03):
    """Every ``every_s`` a request of 12 tokens to 3 batching replicas (the real
    SyntheticBatchEngine), replica 1's with ``faults``, on the virtual clock; each request's
    (arrival, replica, outcome, reason), each arrival's replicas up, /stats."""
    import asyncio

    import pandas as pd

    from live.batching import SyntheticBatchEngine
    from live.gate import Gate, gate_config
    from live.jobs import Job
    from qsim.engines import Batching, StepModel
    from virtual_time import on_virtual_clock

    from live.engine import Faults

    rows, ups = [], []

    async def go():
        loop = asyncio.get_running_loop()
        engine = Batching(StepModel(0.01, 0.0, 0.0002, 0.0), max_num_seqs=4)
        engines = [
            SyntheticBatchEngine(
                engine.step, clock=loop.time, replica=r, faults=faults if r == 1 else Faults()
            )
            for r in range(3)
        ]
        config = gate_config(PRESETS["none"], engine=engine)
        tasks = []
        fleet = FleetSpec(3, make_router(router))
        async with Gate(engines, config, clock=loop.time, fleet=fleet) as gate:
            for i in range(n):
                await asyncio.sleep(max(0.0, i * every_s - loop.time()))
                row = {"arrival_s": loop.time(), "outcome": None}
                rows.append(row)
                tasks.append(asyncio.ensure_future(_submit_row(gate, Job(str(i), 12), row)))
                ups.append(
                    (
                        loop.time(),
                        [r["up"] for r in gate.stats()["replicas"]],
                        gate.health()["status"],
                    )
                )
            await asyncio.gather(*tasks)
            while gate.in_service:
                await asyncio.sleep(0.05)
            return gate.stats()

    stats = on_virtual_clock(go)
    return pd.DataFrame(rows), ups, stats


@pytest.mark.parametrize("router", ["round_robin", "jsq", "central"])
def test_a_batching_replica_whose_step_hangs_is_routed_around_until_it_is_back(router):
    """Replica 1's 31st step hangs 20 s: past the stall rule (live.drive_batch.STEP_STALL: 5 s for
    a step this short) the gate takes it out of routing and ends what it held (its batch and its
    line) engine_stalled, once each; when the step comes back the replica takes requests again."""
    from live.drive_batch import STEP_STALL
    from live.engine import Faults

    frame, ups, stats = _batching_fleet_with(Faults(hang_after=30, hang_s=20.0), router)
    assert frame["outcome"].notna().all()
    assert sum(stats["counts"].values()) == stats["submitted"] == len(frame)
    failed = frame[frame["outcome"].eq("error")]
    assert len(failed) >= 1 and set(failed["reason"]) == {"engine_stalled"}
    assert set(failed["replica"]) == {1}
    assert set(frame.loc[frame["outcome"].ne("error"), "outcome"]) == {"good"}
    # Down once its step has run past the rule, up once the step is back (20 s after it began);
    # the watchdog looks every 50 ms.
    down = [t for t, up, _ in ups if not up[1]]
    assert down and all(up[0] and up[2] for _, up, _ in ups)
    began = down[0] - STEP_STALL.floor_s
    assert 0.0 < began < 2.0  # the 31st step of 10 ms ones, 0.05 s of watching late at most
    assert down[-1] - down[0] < 20.0 - STEP_STALL.floor_s + 0.2
    # /healthz says "degraded" while its step is past the rule (from when the watch took it out).
    degraded = [t for t, _, status in ups if status == "degraded"]
    assert degraded and degraded[0] <= down[0] and degraded[-1] <= down[-1]
    assert all(status == "ok" for t, _, status in ups if t > down[-1])
    sent = frame.loc[frame["replica"].eq(1), "arrival_s"]
    assert not sent.between(down[0], down[-1]).any()  # nothing routed there while down
    assert (sent > down[-1]).sum() > 20  # and it takes requests again once back
    assert all(r["up"] for r in stats["replicas"])
    assert stats["in_service"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("router", ["jsq", "least_kv"])
def test_a_batching_replica_that_fails_every_request_is_paused_and_tried_again(router):
    """Replica 1's engine fails every request at its first step: it looks idle, so load-aware
    routers would send it nearly everything. FAILING_STREAK failures in a row pause it for
    FAILING_PAUSE_S (what it held ends upstream_error, once each), then it is tried again."""
    from live.engine import Faults
    from live.fleet_gate import FAILING_PAUSE_S, FAILING_STREAK

    frame, ups, stats = _batching_fleet_with(Faults(fail_every=1), router, n=600)
    assert frame["outcome"].notna().all()
    assert sum(stats["counts"].values()) == stats["submitted"] == len(frame)
    failed = frame[frame["outcome"].eq("error")]
    assert set(failed["replica"]) == {1}
    assert set(failed["reason"]) <= {"engine_exception", "upstream_error"}
    # 18 s: a streak, then one trial after each pause (each trial a batch of up to 4).
    pauses = 18.0 / FAILING_PAUSE_S
    assert FAILING_STREAK <= len(failed) <= FAILING_STREAK + 4 * (pauses + 2)
    down = [t for t, up, _ in ups if not up[1]]
    assert down and down[0] < 1.0 and all(up[0] and up[2] for _, up, _ in ups)
    assert stats["in_service"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0


# -- served, replayed and compared: real processes ---------------------------------------------

# the replay of a fleet with a replica down for a while: its window, trace and load
# (the window opens 6 s after the gate starts, counted from there: a replay whose process took
# up to 6 s to send its first request (a loaded machine's start-up) still meets all of it, and one
# that took up to 8 s its end; the run file's window then begins at 0)
E2E_DOWN, E2E_SECONDS, E2E_LOAD = "1:6:8", 10, {False: 0.8, True: 1.5}


def _qlab(*argv) -> str:
    """``qlab ARGV`` in a process of its own, as a user runs it; its stdout (its stderr said where
    it fails)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "experiments", *map(str, argv)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _replayed(url: str, run, load: float, seconds: float = 8, seed: int = 5) -> pd.DataFrame:
    """``qlab replay`` of a seeded poisson trace against ``url``, written to ``run``; its rows."""
    _qlab(
        *("replay", "--url", url, "--arrivals", "poisson", "--nominal-load", load),
        *("--seconds", seconds, "--seed", seed, "--out", run),
    )
    return pd.read_parquet(run)


def _compared(run, out) -> dict:
    """``qlab compare RUN --json``'s summary: the run rebuilt and replayed by the simulator."""
    import json

    return json.loads(_qlab("compare", run, "--json", "--out", out))["summary"]


@pytest.mark.slow
def test_a_fleet_of_batching_upstreams_routes_learns_each_and_replays(tmp_path):
    """qlab serve --engine upstream --batching with two --upstream-url, each a real ``qlab serve
    --batching`` (4 seats, a known step): one replica per upstream behind jsq, every request one
    outcome on the replica that served it (each upstream counted those routed to it), each
    replica's learner its own, and qlab compare rebuilds the run with no rule disagreement."""
    import httpx

    pytest.importorskip("fastapi")
    from live.procs import serving
    from live.serve_options import ServeOptions

    step = "0.02,0.0001,0.002,0"
    ups = [ServeOptions(policy="none", batching=True, step=step, max_num_seqs=4)] * 2
    run = tmp_path / "run.parquet"
    with serving(ups, tmp_path / "up", 60) as (a, b):
        gate = ServeOptions(
            policy="predictive",
            engine="upstream",
            upstream_url=f"{a.url},{b.url}",
            batching=True,
            router="jsq",
        )
        with serving([gate], tmp_path / "gate", 60) as (server,):
            frame = _replayed(server.url, run, 1.2)
            stats = httpx.get(server.url + "/stats", timeout=10).json()
        served = [httpx.get(u.url + "/stats", timeout=10).json()["counts"] for u in (a, b)]
    assert len(frame) > 20 and frame["outcome"].notna().all()
    answered = frame["outcome"].isin(["good", "late"])
    by_replica = frame.loc[answered, "replica"].value_counts()
    assert set(by_replica.index) == {0, 1}
    for r, counts in enumerate(served):  # the gate's probes are not answers
        assert counts.get("good", 0) + counts.get("late", 0) >= by_replica[r]
    assert [e["max_num_seqs"] for e in stats["replica_engines"]] == [4, 4]
    assert len(stats["replicas"]) == 2 and all("step" in r for r in stats["replicas"])
    assert all("learned" in e for e in stats["replica_engines"])
    summary = _compared(run, tmp_path / "cmp")
    assert summary["requests"] == len(frame) and summary["rule_disagreements"] == 0


@pytest.mark.slow
def test_a_batching_fleet_served_replayed_and_compared(tmp_path):
    """qlab serve --batching --replicas 3 --router jsq, a short seeded trace through qlab replay,
    and qlab compare on its run file: every request one outcome, each with its replica; the
    compare rebuilds the fleet (simulate(replicas=, step_times=) from the run's step log) and
    reports its disagreements by cause, none of them the rules' (timing ones may be: a real
    clock)."""
    pytest.importorskip("fastapi")
    from live.procs import serving
    from live.serve_options import ServeOptions

    options = ServeOptions(policy="predictive", batching=True, replicas=3, router="jsq")
    run = tmp_path / "run.parquet"
    with serving([options], tmp_path, 60) as (server,):
        frame = _replayed(server.url, run, 1.5)
    assert len(frame) > 20 and frame["request_id"].is_unique
    assert frame["outcome"].notna().all()
    answered = frame["outcome"].isin(["good", "late"])
    assert frame.loc[answered, "replica"].between(0, 2).all()
    assert frame.loc[answered, "replica"].nunique() == 3
    said = _qlab("compare", run, "--out", tmp_path / "cmp")
    assert "by cause: rule 0 (" in said, said
    assert "disagreements:" in said
    s = _compared(run, tmp_path / "cmp2")
    assert s["requests"] == len(frame)
    assert s["rule_disagreements"] == 0
    assert s["disagreements"] == s["timing_disagreements"] + s["unknown_cause_disagreements"]
    assert s["unknown_cause_disagreements"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("batching", [False, True], ids=["one_at_a_time", "batching"])
def test_replicas_at_their_own_speeds_and_down_for_a_while_served_replayed_and_compared(
    batching, tmp_path
):
    """qlab serve --replicas 2 --router jsq --replica-speeds 1,0.5 --replica-down 1:FROM:TO (one
    at a time, and --batching), a seeded trace of a few seconds through qlab replay and qlab
    compare on its run file: every request one outcome; replica 1 sent nothing while down (but
    what the gate took as the window began, before its timer ran: ended there at once); the replay's
    rule disagreements 0 (the speeds' times are the virtual-clock tests' above: a wall clock's
    would be a margin)."""
    import httpx

    pytest.importorskip("fastapi")
    from live.procs import serving
    from live.serve_options import ServeOptions
    from qsim.runfile import fleet_spec

    options = ServeOptions(
        policy="predictive",
        batching=batching,
        replicas=2,
        router="jsq",
        replica_speeds="1,0.5",
        replica_down=E2E_DOWN,
    )
    run = tmp_path / "run.parquet"
    with serving([options], tmp_path, 60) as (server,):
        frame = _replayed(server.url, run, E2E_LOAD[batching], seconds=E2E_SECONDS)
        fleet = httpx.get(server.url + "/stats", timeout=10).json()["fleet"]
    assert fleet["speeds"] == [1.0, 0.5] and fleet["down"] == [[1, 6.0, 8.0]]
    assert len(frame) > 20 and frame["request_id"].is_unique
    assert frame["outcome"].notna().all() and frame["server_arrival_s"].notna().all()
    # The window on the run's clock (the gate's own, /stats' down_started_at), inside the run.
    ((r, down_s, up_s),) = fleet_spec(frame).down
    assert r == 1 and 0 <= down_s < up_s < E2E_SECONDS
    took, there = frame["server_arrival_s"], frame["replica"].eq(1)
    inside = took.ge(down_s) & took.lt(up_s)
    assert inside.any() and there[~inside].any() and frame["replica"].eq(0)[inside].any()
    edge = frame[there & inside]
    assert edge["reason"].isin(["engine_exception", "shutting_down"]).all()
    assert edge["server_arrival_s"].lt(down_s + 0.05).all()
    errors = frame[frame["outcome"].eq("error")]
    assert errors["replica"].eq(1).all()
    assert errors["reason"].isin(["engine_exception", "shutting_down"]).all()
    summary = _compared(run, tmp_path / "cmp")
    assert summary["requests"] == len(frame) and summary["rule_disagreements"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("batching", [False, True], ids=["one_at_a_time", "batching"])
def test_a_replica_draining_for_a_while_served_replayed_and_compared(batching, tmp_path):
    """qlab serve --replicas 2 --router jsq --replica-drain 1:6:8 (one at a time, and --batching),
    a seeded trace through qlab replay and qlab compare on its run file: nothing ends in error,
    replica 1 sent nothing in its window on the run's clock (but what the gate took as it began,
    before its timer ran), sent to again after; the replay's rule disagreements 0."""
    import httpx

    pytest.importorskip("fastapi")
    from live.procs import serving
    from live.serve_options import ServeOptions
    from qsim.runfile import fleet_spec

    options = ServeOptions(
        policy="predictive", batching=batching, replicas=2, router="jsq", replica_drain=E2E_DOWN
    )
    run = tmp_path / "run.parquet"
    with serving([options], tmp_path, 60) as (server,):
        frame = _replayed(server.url, run, E2E_LOAD[batching], seconds=E2E_SECONDS)
        fleet = httpx.get(server.url + "/stats", timeout=10).json()["fleet"]
    assert fleet["drain"] == [[1, 6.0, 8.0]] and "down_started_at" in fleet
    assert len(frame) > 20 and frame["request_id"].is_unique
    assert frame["outcome"].notna().all() and not frame["outcome"].eq("error").any()
    ((r, from_s, to_s),) = fleet_spec(frame).drain
    assert r == 1 and 0 <= from_s < to_s < E2E_SECONDS
    took, there = frame["server_arrival_s"], frame["replica"].eq(1)
    inside = took.ge(from_s) & took.lt(to_s)
    before = from_s == 0 or there[took.lt(from_s)].any()  # (0: the run began inside it)
    assert inside.any() and before and there[took.ge(to_s + 0.1)].any()
    assert frame.loc[there & inside, "server_arrival_s"].lt(from_s + 0.05).all()
    summary = _compared(run, tmp_path / "cmp")
    assert summary["requests"] == len(frame) and summary["rule_disagreements"] == 0


@pytest.mark.parametrize("router", ["jsq", "round_robin", "central"])
def test_a_hung_batching_replica_is_the_simulators_replica_down(router, monkeypatch):
    """The live watch and the simulator's replica_down agree on the virtual clock: replica 1's
    301st step hangs 20 s; the gate takes it out of routing when the step passes its stall rule
    and back once the step is in. simulate(replica_down=[(1, down, up)]) at those times, with the
    run's own steps (the hung one included), gives every request the gate's outcome, replica and
    finish time; only the error reasons are each side's (the gate's engine_stalled, the
    simulator's engine_exception for the batch and shutting_down for the line)."""
    from live.engine import Faults
    from live.fleet_gate import LiveBatchFleet, LiveCentralBatch

    events = []
    for cls in (LiveBatchFleet, LiveCentralBatch):
        fail, restore = cls.fail, cls.restore

        def down(self, r, now, fail=fail):
            events.append(("down", r, now))
            return fail(self, r, now)

        def up(self, r, now=None, restore=restore):
            events.append(("up", r, now))
            return restore(self, r, now)

        monkeypatch.setattr(cls, "fail", down)
        monkeypatch.setattr(cls, "restore", up)

    def hang(engine):
        if engine.replica == 1:
            engine.faults = Faults(hang_after=300, hang_s=20.0)
        return engine

    engine, trace = _batching(None, 2.0, 30, 9)
    config = ServerConfig(PRESETS["predictive"], engine=engine, seed=3)
    spec = FleetSpec(3, make_router(router))
    gate, stats = run_gate(trace, None, 1, config=config, fleet=spec, wrap_engine=hang)
    assert [(kind, r) for kind, r, _ in events] == [("down", 1), ("up", 1)]
    (_, _, down_s), (_, _, up_s) = events
    # Down at the first watch past the rule's 5 s, up at the first after the 20 s step is in.
    assert 15.0 - 0.05 < up_s - down_s < 15.0 + 0.05 + 0.1
    errors = gate["outcome"].eq("error")
    assert errors.any() and set(gate.loc[errors, "reason"]) == {"engine_stalled"}
    times = [(began - woken, ended - began, k) for woken, began, ended, k, *_ in stats["step_log"]]
    sim = simulate(
        trace,
        config,
        replicas=3,
        router=spec.router,
        step_times=times,
        replica_down=[(1, down_s, up_s)],
    )
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    assert set(sim.loc[errors, "reason"]) <= {"engine_exception", "shutting_down"}
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-9)
    placed = gate["replica"].ge(0).to_numpy() & sim["replica"].ge(0).to_numpy()
    assert gate.loc[placed, "replica"].tolist() == sim.loc[placed, "replica"].astype(int).tolist()
    assert stats["in_service"] == 0 and stats["kv_blocks_used"] == 0
