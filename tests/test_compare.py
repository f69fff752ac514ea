"""Simulator versus service, request by request (analysis/compare.py, replay.py, diagnosis.py and
prediction.py, and `qlab compare`).

The pure parts run on live-like runs made by the simulator itself, written in
exactly the run-file format `qlab replay` produces (answer bodies read back by
live.rows), with a hand-back delay and engine failures: the replay must agree
with them exactly. The end-to-end ones replay traces against real `qlab serve`
subprocesses with the synthetic engine.
"""

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from analysis.compare import compare
from analysis.diagnosis import confusion, describe_first_divergence
from analysis.prediction import PREDICTION_TARGETS, predict
from analysis.replay_inputs import run_setup
from qsim import from_arrays, make_trace, preset, records, simulate
from qsim.config import ServerConfig
from qsim.clients import Patience, RetryPolicy
from qsim.queue import StallRule

ZERO = 1000.0  # the gate's clock at the run's time 0: the rows must map it away


def _error(status: int, kind: str, reason: str, numbers: dict, retry_after_s=None):
    """An error answer as the gate writes it: (status, body)."""
    error = {"type": kind, "reason": reason, "message": "", "numbers": numbers}
    if retry_after_s is not None:
        error["retry_after_s"] = retry_after_s
    return status, {"error": error}


def live_like_run(
    trace,
    policy,
    engines=1,
    *,
    handback_s=0.0,
    fail_every=0,
    trip_in_s=4e-4,
    trip_out_s=3e-4,
    retry=None,
    retry_seed=7,
    gate=None,
    fleet=None,
):
    """A live run made by the simulator, in exactly the format `qlab replay` writes.

    The engine of request i runs trace.true_service_s (0 when it fails: instant failures, every
    ``fail_every``-th request) and is held handback_s longer (the hand-back to the gate); the
    tracker learns the engine's time. Each outcome becomes the answer body the service gives
    (live.http_api), read back by live.rows.to_frame. With ``retry`` (a RetryPolicy) the simulator's
    clients send refused requests again, each attempt a row; its clients hear an answer at the
    gate's end and reach the gate at once, so the trips must then be 0, and the gate's clock is the
    run's (retries due at one instant keep their order: no rounding through ZERO tells them apart).
    ``gate``: a Policy the simulated gate ran in place of ``policy``, which the run file still names
    (a gate whose rule is wrong). ``fleet``: a FleetSpec of replicas of the server, each ``engines``
    engines (the fleet gate's run, each answer saying its replica).
    """
    from live.rows import Exchange, ServerInfo, to_frame
    from qsim.runfile import ClientSettings

    assert retry is None or trip_in_s == trip_out_s == 0, "a simulated client's retry has no trips"
    zero = ZERO if retry is None else 0.0

    n = len(trace)
    failed = np.zeros(n, dtype=bool)
    if fail_every:
        failed[fail_every - 1 :: fail_every] = True
    engine_s = np.where(failed, 0.0, trace.true_service_s)
    held = from_arrays(
        trace.arrival_s,
        trace.max_new_tokens,
        true_service_s=engine_s + handback_s,
        est_service_s=trace.est_service_s,
        deadline_s=trace.deadline_s,
    )
    routed = (
        {}
        if fleet is None
        else dict(
            replicas=fleet.replicas,
            router=fleet.router,
            admission_at=fleet.admission,
            replica_speeds=fleet.speeds,
            replica_down=fleet.down,
            replica_drain=fleet.drain,
        )
    )
    sim = simulate(
        held,
        ServerConfig(gate or preset(policy), engines, stall=StallRule()),
        failed=failed,
        reported_s=engine_s,
        retry=retry,
        retry_seed=retry_seed,
        **routed,
    )
    exchanges = []
    for _, r in sim.iterrows():
        i = int(r["first_request_id"])
        # what the engine measured: its replica's speed in it, as a slower replica's engine's is
        routed_to = None if fleet is None or pd.isna(r["replica"]) else int(r["replica"])
        slow = 1.0 if routed_to is None else 1.0 / fleet.speed(routed_to)
        arrival, est, base = r["arrival_s"], r["est_service_s"], trace.est_service_s[i]
        admission = {
            "arrived_at": arrival + zero,
            "est_service_s": est,
            "deadline_s": r["deadline_s"],
            "queued": int(r["queued_at_arrival"]),
            "queued_work_s": r["queued_work_at_arrival_s"],
            "speed_factor": est / base,
            "in_service_s": r["in_service_work_at_arrival_s"],
            "idle": int(r["idle_at_arrival"]),
        }
        if fleet is not None and not pd.isna(r["replica"]):
            admission["replica"] = int(r["replica"])
        start, finish = r["start_s"], r["finish_s"]
        ran = {"started_at": start + zero, "returned_at": finish + zero}
        outcome = r["outcome"]
        if outcome in records.ANSWERED:
            status, body = (
                200,
                {
                    "text": "",
                    "tokens": int(r["max_new_tokens"]),
                    "outcome": outcome,
                    "engine": int(r["engine"]),
                    "admission": admission,
                    "timings": {
                        "queue_s": start - arrival,
                        "engine_s": engine_s[i] * slow,
                        "total_s": finish - arrival,
                        "est_service_s": est,
                        **ran,
                    },
                },
            )
        elif outcome == "rejected":
            status, body = _error(
                503, "overloaded", r["reason"], admission, int(r["retry_after_s"])
            )
        elif outcome == "expired":
            status, body = _error(
                503,
                "deadline_exceeded",
                r["reason"],
                {**admission, "waited_s": finish - arrival},
                int(r["retry_after_s"]),
            )
        # ran past its threshold, or given up behind stalled engines
        elif r["reason"] == "engine_stalled":
            numbers = (
                {"engine": int(r["engine"]), "running_s": finish - start, "est_service_s": est}
                if r["engine"] is not pd.NA
                else {"waited_s": finish - arrival, "stalled_engines": engines}
            )
            status, body = _error(500, "engine_error", "engine_stalled", {**admission, **numbers})
        elif r["reason"] == "shutting_down":  # waiting at a replica that went down
            numbers = {**admission, "waited_s": finish - arrival}
            status, body = _error(503, "unavailable", "shutting_down", numbers)
        elif not failed[i]:  # running on a replica that went down: the gate's numbers, no hand-back
            assert r["reason"] == "engine_exception" and fleet is not None and fleet.down
            numbers = {"engine": int(r["engine"]), "started_at": start + zero, "at": finish + zero}
            numbers = {**admission, **numbers, "running_s": finish - start}
            status, body = _error(500, "engine_error", "engine_exception", numbers)
        else:
            assert r["reason"] == "engine_exception"
            numbers = {
                **admission,
                "engine": int(r["engine"]),
                **ran,
                "engine_s": engine_s[i] * slow,
            }
            status, body = _error(500, "engine_error", "engine_exception", numbers)
        sent = arrival - trip_in_s
        exchanges.append(
            Exchange(
                sent, sent, finish + trip_out_s, status, body, first=i, attempt=int(r["attempt"])
            )
        )
    info = ServerInfo(
        ServerConfig(preset(policy), engines, stall=StallRule(10.0, 5.0), tracker_weight=0.2),
        fleet=None if fleet is None else fleet.to_fields(),
    )
    return to_frame(
        trace,
        exchanges,
        info,
        np.full(n, 16),
        server_zero=zero,
        clients=ClientSettings(retry, retry_seed),
    )


def assert_no_disagreement(result):
    s = result.summary
    assert s["disagreements"] == 0 and s["failure_disagreements"] == 0, result.joined.query(
        "~agree"
    )
    assert s["independent_disagreements"] == 0 and s["cascade_disagreements"] == 0
    assert np.isnan(s["first_divergence_s"]) and np.isnan(s["first_disagreement_s"])
    assert s["reasons_agree"] == s["both_refused"] and s["reasons_disagree"] == 0
    assert s["latency_abs_error_p99_s"] == pytest.approx(0.0, abs=1e-9)
    for outcome in ("good", "late", "rejected", "expired", "error"):
        assert s[f"live_{outcome}"] == s[f"sim_{outcome}"]
    assert result.joined["same_queue"].all() and not result.joined["diverged"].any()


@pytest.mark.parametrize("router", ["random", "jsq", "power_of_d", "least_work", "central"])
@pytest.mark.parametrize("policy", ["bounded", "predictive"])
def test_a_fleet_run_is_replayed_exactly(router, policy):
    """A fleet gate's run file names its fleet (FleetSpec in the fleet column): the replay routes
    the run's arrivals with the same router and its own random stream, request by request."""
    from qsim.fleet import FleetSpec
    from qsim.routers import make_router
    from qsim.runfile import fleet_spec

    trace = make_trace("poisson", seed=3, noise_cv=0.3, seconds=40, load=1.3, engines=4)
    fleet = FleetSpec(2, make_router(router))
    run = live_like_run(trace, policy, engines=2, fail_every=17, fleet=fleet)
    assert fleet_spec(run) == fleet
    if not fleet.router.shared:
        assert set(run["replica"].dropna()) == {0, 1}
    assert_no_disagreement(compare(run))
    # The same run read as one server's disagrees: the fleet is what the replay needs.
    alone = compare(run.drop(columns=["fleet"]))
    assert alone.summary["disagreements"] > 0 or router == "central"


@pytest.mark.parametrize("router", ["jsq", "round_robin"])
@pytest.mark.parametrize("policy", ["bounded", "predictive"])
def test_a_fleet_run_of_replicas_at_their_own_speeds_is_replayed_exactly(router, policy):
    """qlab serve --replica-speeds 1,0.5: the run file's fleet says the speeds, and each run's held
    time is what its engine took, its replica's speed already in it: the replay applies the speed
    once (not again to the held times), request by request equal."""
    from qsim.fleet import FleetSpec
    from qsim.routers import make_router
    from qsim.runfile import fleet_spec

    trace = make_trace("poisson", "mix", load=1.3, engines=3, seconds=60, seed=2, noise_cv=0.3)
    fleet = FleetSpec(2, make_router(router), (1.0, 0.5))
    run = live_like_run(trace, policy, engines=2, fail_every=17, fleet=fleet)
    assert fleet_spec(run) == fleet
    slow = run[run["replica"].eq(1) & run["outcome"].eq("good")]
    assert len(slow) > 20
    assert_no_disagreement(compare(run))


@pytest.mark.parametrize("router", ["jsq", "round_robin"])
@pytest.mark.parametrize("policy", ["bounded", "predictive"])
def test_a_fleet_run_with_replicas_down_for_a_while_is_replayed_exactly(router, policy):
    """qlab serve --replica-down 1:20:35 --replica-down 0:40:41.5 (and a slower replica): the run
    file's fleet says the windows on the run's clock; a run its replica's going down ended
    (engine_exception, no hand-back said) holds its engine until the engine next took a request
    (rule down), a request waiting there ends shutting_down; request by request equal."""
    from qsim.fleet import FleetSpec
    from qsim.routers import make_router
    from qsim.runfile import fleet_spec

    trace = make_trace("poisson", "mix", load=1.3, engines=3, seconds=60, seed=2, noise_cv=0.3)
    down = ((1, 20.0, 35.0), (0, 40.0, 41.5))
    fleet = FleetSpec(2, make_router(router), (1.0, 0.8), down)
    run = live_like_run(trace, policy, engines=2, fail_every=17, fleet=fleet)
    assert fleet_spec(run) == fleet
    ended = run[run["reason"].isin(["engine_exception", "shutting_down"])]
    assert set(ended["reason"]) == {"engine_exception", "shutting_down"}
    result = compare(run)
    assert_no_disagreement(result)
    assert result.joined["replayed_with"].eq("down").sum() >= 2


@pytest.mark.parametrize("router", ["jsq", "round_robin"])
@pytest.mark.parametrize("policy", ["bounded", "predictive"])
def test_a_fleet_run_with_a_replica_draining_for_a_while_is_replayed_exactly(router, policy):
    """qlab serve --replica-drain 1:20:35 (and a slower replica): the run file's fleet says the
    window; the replay's router skips replica 1 in it while what it held runs out there, request
    by request equal; the same file without the window replays otherwise."""
    import json

    from qsim.fleet import FleetSpec
    from qsim.routers import make_router
    from qsim.runfile import fleet_spec

    trace = make_trace("poisson", "mix", load=1.3, engines=3, seconds=60, seed=2, noise_cv=0.3)
    fleet = FleetSpec(2, make_router(router), (1.0, 0.8), drain=((1, 20.0, 35.0),))
    run = live_like_run(trace, policy, engines=2, fail_every=17, fleet=fleet)
    assert fleet_spec(run) == fleet
    arrived = run["server_arrival_s"]  # the run's clock
    inside = arrived.between(20.0, 35.0, inclusive="left") & run["replica"].eq(1)
    assert not inside.any() and run["replica"].eq(1).any()
    assert_no_disagreement(compare(run))
    plain = run.copy()
    fields = json.loads(str(plain["fleet"].iloc[0]))
    del fields["drain"]
    plain["fleet"] = pd.array([json.dumps(fields)] * len(plain), dtype="string")
    assert compare(plain).summary["disagreements"] > 0


@pytest.mark.parametrize("router", ["jsq", "round_robin"])
@pytest.mark.parametrize("policy", ["bounded", "predictive"])
def test_a_fleet_run_admitted_at_the_gate_is_replayed_so(router, policy):
    """A gate started with --admission-at gate writes it in the run file's fleet column
    (FleetSpec.to_fields' admission): qlab compare rebuilds it with admission_at="gate", request
    by request; the same file without the key (as one written before it) reads as "replica"."""
    import json

    from qsim.fleet import FleetSpec
    from qsim.routers import make_router
    from qsim.runfile import fleet_spec

    trace = make_trace("poisson", seed=3, noise_cv=0.3, seconds=40, load=1.3, engines=4)
    fleet = FleetSpec(2, make_router(router), admission="gate")
    run = live_like_run(trace, policy, engines=2, fail_every=17, fleet=fleet)
    assert fleet_spec(run) == fleet and run["outcome"].eq("rejected").any()
    # a request the gate refused went to no replica: <NA>, as the simulator's records say
    assert run.loc[run["outcome"].eq("rejected"), "replica"].isna().all()
    assert run.loc[run["outcome"].eq("good"), "replica"].notna().all()
    assert_no_disagreement(compare(run))
    old = run.copy()
    fields = json.loads(str(old["fleet"].iloc[0]))
    del fields["admission"]
    old["fleet"] = pd.array([json.dumps(fields)] * len(old), dtype="string")
    assert fleet_spec(old).admission == "replica"
    assert compare(old).summary["disagreements"] > 0


def test_a_fleet_s_fields_come_back_and_a_router_of_ones_own_is_named():
    from dataclasses import dataclass

    from qsim.fleet import FleetSpec
    from qsim.routers import PowerOfD, Random

    spec = FleetSpec(3, PowerOfD(3), speeds=(1.0, 0.5, 1.0), down=((1, 2.0, 4.0),))
    assert FleetSpec.from_fields(json.loads(json.dumps(spec.to_fields()))) == spec

    @dataclass(frozen=True)
    class Mine(Random):
        name = "mine"

    with pytest.raises(ValueError, match="router 'mine' is not one of qsim's"):
        FleetSpec.from_fields(FleetSpec(2, Mine()).to_fields())


@pytest.mark.parametrize("policy", ["none", "bounded", "bounded-deadline", "predictive"])
@pytest.mark.parametrize("arrivals", ["poisson", "burst:30"])
def test_the_simulator_agrees_with_itself_exactly(policy, arrivals):
    # a burst takes no load
    length = {"requests": 30} if arrivals.startswith("burst") else {"seconds": 60, "load": 1.5}
    trace = make_trace(arrivals, seed=3, noise_cv=0.3, **length)
    result = compare(live_like_run(trace, policy))
    assert_no_disagreement(result)
    assert result.summary["requests"] == len(trace) and result.confusion.to_numpy().sum() == len(
        trace
    )


@pytest.mark.parametrize("policy", ["bounded-deadline", "predictive"])
def test_hand_back_delay_and_failures_are_replayed_as_the_gate_saw_them(policy):
    # The engine is held 2 ms past its own time (the tracker learns the engine's time), and every
    # 7th run fails at once: the replay must hold, teach and fail exactly as the gate did.
    trace = make_trace("poisson", load=2.0, seconds=40, seed=11, noise_cv=0.3)
    run = live_like_run(trace, policy, handback_s=0.002, fail_every=7)
    assert (
        run["failed"].sum() > 0
        and (run["engine_returned_s"] - run["engine_started_s"] - run["engine_reported_s"])
        .dropna()
        .round(9)
        .eq(0.002)
        .all()
    )
    result = compare(run)
    assert_no_disagreement(result)
    s = result.summary
    assert (
        s["engine_failures"] == run["failed"].sum() and s["live_rejected"] + s["live_expired"] > 0
    )
    # Nothing from the future: what never ran was given its estimate at arrival.
    never = result.joined["replayed_with"].eq("estimate")
    assert never.sum() == s["replayed_estimate"] == run["engine_started_s"].isna().sum()


def test_the_old_replay_would_have_disagreed():
    # Learning the held time instead of the engine's (the old replay) moves the tracker:
    # disagreements.
    trace = make_trace("poisson", load=2.0, seconds=40, seed=11, noise_cv=0.3)
    run = live_like_run(trace, "predictive", handback_s=0.02)
    run["engine_reported_s"] = run["engine_returned_s"] - run["engine_started_s"]
    assert compare(run).summary["disagreements"] > 0


@pytest.mark.parametrize("policy", ["none", "bounded-deadline"])
def test_a_stalled_engine_is_replayed_as_the_gate_saw_it(policy):
    # Request k hangs for 12 s (its threshold is 5 s): it ends as an error at 5 s, the engine stays
    # busy until it comes back, and the gate's watchdog gives up on the queue behind it.
    trace = make_trace("poisson", load=0.8, seconds=30, seed=3)
    true = trace.true_service_s.copy()
    k = int(np.searchsorted(trace.arrival_s, 5.0))
    true[k] = 12.0
    hung = from_arrays(
        trace.arrival_s,
        trace.max_new_tokens,
        true_service_s=true,
        est_service_s=trace.est_service_s,
    )
    run = live_like_run(hung, policy)
    # none: the queue behind it ends as engine_stalled errors; bounded-deadline: expired.
    assert run.loc[k, "stalled"] and run["outcome"].isin(["error", "expired"]).sum() > 1
    result = compare(run)
    s = result.summary
    assert (
        s["replayed_stalled"] == 1 and s["failure_disagreements"] == 0 and s["disagreements"] == 0
    )
    assert result.joined.set_index("request_id").loc[k, "sim_outcome"] == "error"


def test_two_engines_and_run_setup_round_trip():
    trace = make_trace("poisson", load=1.8, engines=2, seconds=30, seed=5)
    run = live_like_run(trace, "bounded-deadline", engines=2, handback_s=0.001, fail_every=9)
    setup = run_setup(run)
    assert setup.engines == 2 and setup.policy == preset("bounded-deadline")
    assert setup.stall == StallRule(10.0, 5.0) and setup.tracker_weight == 0.2
    assert_no_disagreement(compare(run))


def test_one_early_flip_is_one_independent_disagreement_and_a_cascade():
    trace = make_trace("poisson", load=0.9, seconds=60, seed=4)
    run = live_like_run(trace, "none")
    # Request k was answered in time; the run file says its engine was held 3 s longer (a
    # measurement the replay cannot know is wrong): it ends late in the replay, and the queue behind
    # it grows.
    k = int(run.index[run["outcome"].eq("good") & (run["arrival_s"] > 5)][0])
    run.loc[k, "engine_returned_s"] += 3.0
    result = compare(run)
    s, joined = result.summary, result.joined.set_index("request_id")
    assert joined.loc[k, "disagreement"] == "independent" and s["independent_disagreements"] == 1
    assert s["cascade_disagreements"] >= 2 and s["disagreements"] == 1 + s["cascade_disagreements"]
    assert s["first_divergence_s"] == pytest.approx(run.loc[k, "server_arrival_s"])
    assert (
        joined.loc[joined["disagreement"].eq("cascade"), "gate_arrival_s"]
        > joined.loc[k, "gate_arrival_s"]
    ).all()


def test_a_wrong_rule_at_the_gate_reads_as_a_rule_difference():
    # The gate refused at a bound of 3 waiting that predictive does not have: the simulator, given
    # the numbers the gate decided on, admits. The old split calls most of it a cascade; the cause
    # says rule, from the first.
    trace = make_trace("poisson", load=2.0, seconds=60, seed=11, noise_cv=0.3)
    run = live_like_run(
        trace, "predictive", gate=dataclasses.replace(preset("predictive"), max_queue=3)
    )
    result = compare(run)
    s, joined = result.summary, result.joined
    wrong = joined["live_decision"].eq("queue_full")
    assert wrong.any() and joined.loc[wrong, "live_rule"].ne("queue_full").all()
    assert (joined.loc[wrong, "cause"] == "rule").all()
    assert (
        s["rule_disagreements"]
        >= (wrong & ~joined["agree"]).sum()
        > 10 * s["independent_disagreements"]
    )
    assert s["first_divergence_rule"] == 1.0 and result.first_divergence["cause"] == "rule"
    assert result.first_divergence["live_decision"] == "queue_full"
    # The simulator's own decisions are decide's on its own numbers, everywhere.
    sim = joined["sim_rule"].notna()
    assert (
        sim.sum() > 0.9 * len(joined)
        and joined.loc[sim, "sim_rule"].eq(joined.loc[sim, "sim_decision"]).all()
    )


def test_a_finish_shifted_a_few_ms_reads_as_timing():
    # The gate's rule is the simulator's; one run handed back 40 ms later than the run file says (a
    # finish a few ms apart, as on a busy machine): the queues behind it differ, and every decision
    # is still decide's on the numbers it was made on.
    trace = make_trace("poisson", load=2.0, seconds=60, seed=11, noise_cv=0.3)
    run = live_like_run(trace, "predictive")
    assert_no_disagreement(compare(run))
    waited = run["queued_at_arrival"].gt(0) & run["outcome"].eq("good") & run["arrival_s"].gt(10)
    k = int(run.index[waited][0])
    # the replay frees the engine 40 ms sooner than the gate did
    run.loc[k, "engine_returned_s"] -= 0.04
    result = compare(run)
    s = result.summary
    assert s["disagreements"] > 0 and s["timing_disagreements"] == s["disagreements"]
    assert s["rule_disagreements"] == s["unknown_cause_disagreements"] == s["rule_divergences"] == 0
    first = result.first_divergence
    assert (
        first["request_id"] == k
        and first["cause"] == "timing"
        and s["first_divergence_rule"] == 0.0
    )
    assert first["differ"] == ["end_s sim - live -40.000 ms"]
    text = describe_first_divergence(first)
    assert (
        text.startswith(f"request {k} attempt 1 at")
        and ("timing (end_s sim - live -40.000 ms)") in text
    )


def test_disagreements_reasons_and_latency_error_are_counted():
    trace = make_trace("poisson", load=1.5, seconds=30, seed=7)
    run = live_like_run(trace, "bounded")
    refused = np.flatnonzero(run["outcome"].eq("rejected"))
    assert len(refused) >= 2
    # The service said work_limit where the simulator says queue_full, and started one answer 50 ms
    # later than the simulator does (same hold): 50 ms more in the gate. A slower trip back is no
    # error.
    run.loc[refused[0], "reason"] = "work_limit"
    last = int(np.flatnonzero(run["outcome"].eq("good"))[-1])
    run.loc[last, ["finish_s", "engine_started_s", "engine_returned_s", "server_finish_s"]] += 0.05
    run.loc[last - 1, "finish_s"] += 0.01
    run["latency_s"] = run["finish_s"] - run["arrival_s"]
    result = compare(run)
    s = result.summary
    assert s["reasons_disagree"] == 1 and s["reasons_agree"] == s["both_refused"] - 1
    assert result.reasons.loc["work_limit", "queue_full"] == 1
    error = result.joined.set_index("request_id")["latency_error_s"]
    assert error[last] == pytest.approx(-0.05)
    assert error.drop(index=last).abs().max() < 1e-9


def test_a_refused_request_the_simulator_runs_gets_its_estimate_at_arrival():
    trace = make_trace("poisson", load=1.5, seconds=30, seed=7)
    run = live_like_run(trace, "bounded")
    answered = np.flatnonzero(run["outcome"].eq("good"))
    flip = answered[-2:]  # the service said no to two requests the simulator will run
    run.loc[
        flip,
        [
            "outcome",
            "reason",
            "start_s",
            "engine_s",
            "engine_started_s",
            "engine_returned_s",
            "engine_reported_s",
        ],
    ] = ["rejected", "queue_full", np.nan, np.nan, np.nan, np.nan, np.nan]
    run.loc[flip, "finish_s"] = run.loc[flip, "arrival_s"]
    run["latency_s"] = run["finish_s"] - run["arrival_s"]
    result = compare(run)
    assert result.summary["disagreements"] == 2 and result.confusion.loc["rejected", "good"] == 2
    assert result.summary["disagreement_rate"] == pytest.approx(2 / len(run))
    joined = result.joined.set_index("request_id")
    assert set(joined.loc[flip, "replayed_with"]) == {"estimate"}
    # the second arrived behind the first's divergence
    assert joined.loc[flip[0], "disagreement"] == "independent"


def test_confusion_shows_every_outcome():
    joined = pd.DataFrame({"live_outcome": ["good", "error"], "sim_outcome": ["good", "rejected"]})
    table = confusion(joined)
    assert list(table.index) == list(records.OUTCOMES)
    # the simulator's, without clients
    assert list(table.columns) == [o for o in records.OUTCOMES if o != "abandoned"]
    assert (
        table.loc["good", "good"] == 1
        and table.loc["error", "rejected"] == 1
        and table.to_numpy().sum() == 2
    )
    # Clients that give up and retry: abandoned on both sides, and attempts only one side sent.
    joined = pd.DataFrame(
        {
            "live_outcome": ["abandoned", "rejected", "not_sent"],
            "sim_outcome": ["abandoned", "not_sent", "rejected"],
        }
    )
    table = confusion(joined)
    assert list(table.index)[-1] == "not_sent" and list(table.columns)[-2:] == [
        "abandoned",
        "not_sent",
    ]
    assert (
        table.loc["abandoned", "abandoned"]
        == table.loc["rejected", "not_sent"]
        == table.loc["not_sent", "rejected"]
        == 1
    )


def test_prediction_of_a_run_reports_errors_with_intervals():
    trace = make_trace("poisson", load=1.5, seconds=60, seed=2, noise_cv=0.1)
    run = live_like_run(trace, "predictive")
    result = predict(run, seeds=8, noise_cv=0.1)
    table = result.table
    assert list(table.index) == ["share_good", "goodput_rps", "latency_p50_s", "latency_p99_s"]
    assert (table["ci_low"] <= table["sim_mean"]).all() and (
        table["sim_mean"] <= table["ci_high"]
    ).all()
    assert len(result.per_seed) == 8 and result.speed == 1.0 and "no probe" in result.speed_source
    # The same model with other noise: the live run is one of the seeds' kind.
    assert abs(table.loc["share_good", "relative_error"]) < 0.1
    # a probe said the machine ran at half speed: the prediction follows it
    run["speed_before"] = 2.0
    slow = predict(run, seeds=3).table
    assert slow.loc["latency_p50_s", "sim_mean"] > table.loc["latency_p50_s", "sim_mean"]


def test_prediction_judges_the_time_to_first_token_only_where_the_run_measured_it():
    trace = make_trace("poisson", load=1.5, seconds=30, seed=2, noise_cv=0.1)
    run = live_like_run(trace, "predictive")
    plain = predict(run, seeds=3)  # through /v1/generate: no TTFT in the run, none judged
    assert "ttft_p99_s" not in plain.table.index and set(plain.within_targets()) == {
        "share_good",
        "goodput_rps",
        "latency_p99_s",
    }
    # streamed, and absurdly slow
    run["ttft_s"] = np.where(run["outcome"].isin(records.ANSWERED), 1e3, np.nan)
    streamed = predict(run, seeds=3)
    assert (
        streamed.table.loc["ttft_p99_s", "live"] == 1e3
        and streamed.within_targets()["ttft_p99_s"] is False
    )
    assert streamed.verdict() == "MISS" and set(streamed.within_targets()) == set(
        PREDICTION_TARGETS
    )


def test_a_frame_without_the_live_columns_is_refused():
    run = simulate(make_trace("poisson", load=1.0, seconds=5, seed=1), preset("none"))
    with pytest.raises(ValueError, match="not a live run file"):
        compare(run)


RETRIES = {
    "honoured": RetryPolicy(mode="exponential", jitter=1.0, max_attempts=3),
    "jittered": RetryPolicy(
        mode="exponential", delay_s=0.5, jitter=1.0, retry_after="ignore", max_attempts=4
    ),
}


@pytest.mark.parametrize("retry", list(RETRIES))
@pytest.mark.parametrize(
    "policy, arrivals", [("predictive", "poisson"), ("bounded", "poisson"), ("bounded", "burst:30")]
)
def test_retries_are_replayed_by_the_simulators_own_clients(policy, arrivals, retry):
    # A run whose clients retried: compare gives the simulator the first attempts and the run's
    # retry policy and seed; its clients must send every retry the run has, at the same times, and
    # no other. a burst takes no load
    length = {"requests": 30} if arrivals.startswith("burst") else {"seconds": 40, "load": 2.0}
    trace = make_trace(arrivals, seed=5, noise_cv=0.2, **length)
    run = live_like_run(trace, policy, trip_in_s=0.0, trip_out_s=0.0, retry=RETRIES[retry])
    assert run["attempt"].max() > 1 and set(run["retry_seed"]) == {7}
    result = compare(run)
    assert_no_disagreement(result)
    s, requests = result.summary, result.requests
    assert s["requests"] == len(run) and s["requests_e2e"] == len(trace) == len(requests)
    assert s["e2e_disagreements"] == 0 and s["live_attempts"] == s["sim_attempts"] == len(run)
    assert requests["agree"].all() and (requests["live_attempts"] == requests["sim_attempts"]).all()
    assert s["live_not_sent"] == s["sim_not_sent"] == 0


def test_an_attempt_only_the_simulator_sends_is_a_disagreement_of_attempts():
    trace = make_trace("poisson", load=2.0, seconds=40, seed=5)
    run = live_like_run(
        trace, "predictive", trip_in_s=0.0, trip_out_s=0.0, retry=RETRIES["honoured"]
    )
    # As if the live client of one retried request had given up after its first refusal.
    gone = run.index[run["attempt"].eq(2)][0]
    first = int(run.loc[gone, "first_request_id"])
    run = run[run["first_request_id"].ne(first) | run["attempt"].eq(1)].reset_index(drop=True)
    result = compare(run)
    s = result.summary
    assert s["live_not_sent"] >= 1 and s["sim_not_sent"] == 0
    assert s["attempt_count_disagreements"] == 1 and s["e2e_disagreements"] == 1
    assert result.confusion.loc["not_sent"].sum() == s["live_not_sent"]
    mine = result.requests.set_index("first_request_id").loc[first]
    assert mine["live_attempts"] == 1 and mine["sim_attempts"] > 1 and not mine["agree"]
    # Everything else is the same run: every attempt both sent agrees.
    both = result.joined[result.joined["live_outcome"].ne("not_sent")]
    assert both["agree"].all() and result.joined["request_id"].is_unique


def test_a_run_file_carries_its_clients():
    from live.rows import Exchange, to_frame
    from qsim.runfile import client_settings

    trace = make_trace(
        "poisson", load=1.0, seconds=5, seed=2, patience=Patience.parse("deterministic:3")
    )
    run = live_like_run(trace, "bounded", trip_in_s=0.0, trip_out_s=0.0, retry=RETRIES["jittered"])
    clients, patience = client_settings(run)
    assert (
        clients.retry == RETRIES["jittered"]
        and clients.retry_seed == 7
        and clients.patience_until == "answer"
    )
    np.testing.assert_array_equal(patience[run["attempt"].eq(1).to_numpy()], 3.0)
    # A client that hung up: abandoned, with its reason; no answer, so no status, start or gate
    # arrival.
    ex = Exchange(1.0, 1.0, 4.0, first=0, attempt=1, left="client_left", hangup_s=4.0, next="left")
    info_run = to_frame(trace, [ex], *_info_args(), clients=clients)
    row = info_run.iloc[0]
    assert (row["outcome"], row["reason"], row["client_next"]) == (
        "abandoned",
        "client_left",
        "left",
    )
    assert (
        pd.isna(row["http_status"])
        and np.isnan(row["start_s"])
        and np.isnan(row["server_arrival_s"])
    )
    assert row["hangup_s"] == 4.0 and row["patience_s"] == 3.0
    # An older run file: patient clients that never retry.
    old = run.drop(columns=["retry_policy", "retry_seed", "patience_until", "patience_s"])
    clients, patience = client_settings(old)
    assert clients.retry is None and np.isinf(patience).all()


def _info_args():
    from live.rows import ServerInfo

    return ServerInfo(ServerConfig(preset("bounded"))), np.full(1, 16)


# ---------------------------------------------------------------- against the live service


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from live.procs import serving
    from live.serve_options import ServeOptions

    with serving(
        [ServeOptions(policy=p) for p in ("bounded", "bounded-deadline", "predictive")],
        tmp_path_factory.mktemp("logs"),
        60,
    ) as started:
        yield {s.options.policy: s.url for s in started}


def live_run(url, trace):
    from live.loadgen import ReplayConfig, replay

    return replay(trace, ReplayConfig(url))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["bounded", "bounded-deadline", "predictive"])
def test_a_live_burst_is_replayed_exactly(servers, policy):
    run = live_run(servers[policy], make_trace("burst:30", requests=30, seed=1))
    s = compare(run).summary
    assert s["live_errors"] == 0
    counts = {o: (s[f"live_{o}"], s[f"sim_{o}"]) for o in ("good", "late", "rejected", "expired")}
    assert all(live == sim for live, sim in counts.values()), (
        f"{policy}: live vs sim counts {counts}; exact counts need the gate's arrival times "
        "(arrived_at in the answers, clock in /stats)"
    )
    assert s["disagreements"] == 0 and s["reasons_disagree"] == 0


@pytest.mark.slow
def test_a_live_overload_run_is_replayed_request_by_request(servers, tmp_path, capsys):
    # The case, shortened: predictive at nominal load 2 for 10 s, through a real server
    # (resident: its tracker does not start at 1) and `qlab compare`.
    from experiments.cli import main

    run = live_run(servers["predictive"], make_trace("poisson", load=2.0, seconds=10, seed=11))
    path = tmp_path / "run.parquet"
    run.to_parquet(path, index=False)
    assert main(["compare", str(path), "--out", str(tmp_path / "cmp")]) == 0
    text = capsys.readouterr().out
    for needle in (
        "outcomes, live (rows) x simulator (columns)",
        "disagreements:",
        "independent (same queue",
        "refusal reasons of the",
        "never started: calibrated estimate x speed factor at its arrival",
    ):
        assert needle in text
    joined = pd.read_parquet(tmp_path / "cmp" / "compare.parquet")
    assert len(joined) == len(run) and joined["request_id"].is_unique
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000
    s = compare(run).summary
    assert s["live_errors"] == 0 and s["live_rejected"] > 0
    assert s["disagreement_rate"] < 0.005, compare(run).joined.query("~agree")
    assert s["reasons_disagree"] == 0
    assert s["latency_abs_error_p99_s"] < 0.005
    assert main(["compare", str(path), "--predict", "--seeds", "3", "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)
    assert set(predicted["metrics"]) == {
        "share_good",
        "goodput_rps",
        "latency_p50_s",
        "latency_p99_s",
    }
    # Nothing passed by hand: the run file says the engine is synthetic, at speed 1 and without
    # noise.
    assert (
        "the synthetic engine's speed setting" in predicted["speed_source"]
        and predicted["speed"] == 1.0
    )
    assert "noise setting" in predicted["noise_source"] and predicted["noise_cv"] == 0.0


@pytest.mark.parametrize("taught", [None, 0.8, 1.3])
def test_the_gate_factor_says_whether_a_run_around_its_hang_up_taught_the_tracker(taught):
    # Request 1's client hung up around the end of its run: the gate's factor at the next arrival
    # (request 3) says whether it was stopped (taught nothing) or ran out (and what it taught), with
    # request 2's teaching in between folded in as the replay has it.
    from analysis.replay_unsaid import Unsaid, _TrackerEvidence
    from qsim.service import SpeedTracker

    base, reported2 = np.array([0.1, 0.2, 0.1, 0.1]), 0.11
    tracker = SpeedTracker(0.2, 1.0)
    if taught is not None:
        tracker.observe(base[1], taught * base[1])
    tracker.observe(base[2], reported2)
    run = pd.DataFrame(
        {
            "first_request_id": range(4),
            "attempt": 1,
            "arrival_speed_factor": [1.0, np.nan, np.nan, tracker.factor],
        }
    )
    ordered = pd.DataFrame({"request_id": range(4), "calibrated_est_s": base})
    sim = pd.DataFrame(
        {
            "first_request_id": range(4),
            "attempt": 1,
            "start_s": [0.0, 0.1, 0.3, 0.5],
            "finish_s": [0.1, 0.3, 0.5, 0.6],
            "est_service_s": base,
        }
    )
    position = pd.Series(range(4), index=pd.MultiIndex.from_arrays([range(4), [1] * 4]))
    setup = ServerConfig(preset("predictive"), 1, tracker_weight=0.2)
    evidence = _TrackerEvidence(
        run,
        setup,
        Unsaid(np.array([0.0, 0.05, 0.1, 0.55]), 0.0, {}),
        ordered,
        sim,
        position,
        np.array([0.1, np.nan, reported2, 0.1]),
        np.zeros(4, dtype=bool),
    )
    said = evidence.learned(1, 0.3)
    assert said is False if taught is None else said == pytest.approx(taught * base[1], rel=1e-9)
    # Apart before its end (the replay's factor at request 0 is not the gate's): the run cannot
    # tell.
    run.loc[0, "arrival_speed_factor"] = 1.01
    assert (
        _TrackerEvidence(
            run,
            setup,
            Unsaid(np.array([0.0, 0.05, 0.1, 0.55]), 0.0, {}),
            ordered,
            sim,
            position,
            np.array([0.1, np.nan, reported2, 0.1]),
            np.zeros(4, dtype=bool),
        ).learned(1, 0.3)
        is None
    )


def test_the_compare_figure_wraps_its_titles_and_keeps_outcome_names_apart():
    import matplotlib

    matplotlib.use("Agg")
    from analysis.compare import TITLE_WIDTH, draw

    trace = make_trace("poisson", load=1.5, seconds=30, seed=3, noise_cv=0.3)
    fig = draw(compare(live_like_run(trace, "predictive")))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes[:3]:
        title = ax.get_title()
        assert max(map(len, title.split("\n"))) <= TITLE_WIDTH, title
        # Inside the figure: none cut at its edge.
        box = ax.title.get_window_extent(renderer)
        assert box.x0 >= 0 and box.x1 <= fig.bbox.x1 + 1
    names = [t for t in fig.axes[0].get_xticklabels() if t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in names]
    assert all(not a.overlaps(b) for a, b in zip(boxes, boxes[1:]))
    import matplotlib.pyplot as plt

    plt.close(fig)
