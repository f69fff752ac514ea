"""Each closed form against the simulator, inside a confidence interval over replications."""

import math
from dataclasses import replace

import pandas as pd
import pytest

from analysis.validation import (
    TOO_WIDE,
    BatchScenario,
    Lengths,
    Scenario,
    blocked_share,
    check,
    judge_interval,
    mean_sojourn,
    mean_step_s,
    control_columns,
    fleet_scenarios,
    load_deviation,
    mean_wait,
    queue_scenarios,
    sharing_scenarios,
    standard_scenarios,
    tally,
)
from qsim import StepModel, theory

COLUMNS = {
    "case",
    "quantity",
    "theory",
    "sim_mean",
    "ci_low",
    "ci_high",
    "control",
    "rel_half_width",
    "inside",
    "verdict",
}


@pytest.fixture(scope="module")
def table():
    return check(queue_scenarios(), replications=10, seed=1, workers=2)


@pytest.fixture(scope="module")
def sharing():
    # The quick study's size, a tenth of qlab theory's lengths (which give half-widths of about 1.2
    # %): about 60 CPU s.
    return check(sharing_scenarios(0.1), replications=10, seed=1, workers=2)


@pytest.mark.slow
def test_every_closed_form_inside_its_interval(table):
    misses = table[table["verdict"] != "pass"]
    assert misses.empty, "\n" + misses.to_string()


@pytest.mark.slow
def test_the_standard_set_covers_the_issue(table):
    cases = " ".join(table["case"])
    for needle in (
        "M/M/1 rho=0.95",
        "M/M/2",
        "M/M/8",
        "M/M/1/5",
        "Erlang B",
        "M/M/2/6",
        "M/D/1",
        "reference mix rho=0.9 (P-K)",
        "Erlang A",
        "M/M/1+D tau=2",
        "M/M/4+D tau=1",
    ):
        assert needle in cases
    assert set(table.columns) == COLUMNS
    assert (table["ci_low"] < table["ci_high"]).all()
    names = [s.name for s in standard_scenarios(0.01)]
    assert names == [
        s.name for s in (*queue_scenarios(0.01), *sharing_scenarios(0.01), *fleet_scenarios(0.01))
    ]
    for needle in (
        "M/M/1-PS",
        "M/G/1-PS",
        "E[L]=200 lambda=5",
        "E[L]=200 lambda=12.5",
        "K=16 lambda=5",
        "M/M^[4]/1 bulk service lambda=3 mu=1",
    ):
        assert any(needle in name for name in names), needle


@pytest.mark.slow
def test_engines_that_share_against_their_closed_forms(sharing):
    assert set(sharing.columns) == COLUMNS
    misses = sharing[sharing["verdict"] != "pass"]
    assert misses.empty, "\n" + misses.to_string()
    # Two length distributions, one closed form: processor sharing is insensitive to all but the
    # mean.
    ps = sharing[sharing["case"].str.contains("-PS")]
    assert len(ps) == 2 and ps["theory"].nunique() == 1
    assert (sharing["rel_half_width"] < 0.06).all()  # about sqrt(10) x the full size's 1.2 %
    assert set(sharing["control"]) == {"", "mean tokens", "mean gap", "mean step time"}


def test_the_check_can_fail():
    # A wrong closed form (M/M/1 Wq off by 20 %) must fall outside the interval.
    wrong = Scenario(
        "M/M/1 rho=0.8, wrong",
        1,
        0.8,
        20_000,
        0.1,
        checks=(("Wq", 1.2 * theory.mm1(0.8, 1).wq, mean_wait), ("P(block)", 0.05, blocked_share)),
    )
    result = check([wrong], replications=5, workers=1)
    assert list(result["verdict"]) == ["fail", "fail"] and not result["inside"].any()


@pytest.mark.slow  # long runs of several rows: 8 s of CPU
def test_processor_sharing_rows_tell_sharing_from_fifo():
    # Equal lengths served first come, first served (M/D/1) would be in for 1 + rho / (2 (1 - rho))
    # = 1.21 s, not the 1.43 s of processor sharing: the batching engine's row must refuse it.
    row = next(s for s in sharing_scenarios(0.1) if "M/G/1-PS" in s.name)
    fifo = replace(row, checks=(("W", theory.md1(0.3, 1.0).w, mean_sojourn),))
    result = check([fifo], replications=5, workers=1)
    assert list(result["verdict"]) == ["fail"], result.to_string()


def test_judging_an_interval():
    assert judge_interval(1.0, 0.9, 1.1) == dict(
        rel_half_width=pytest.approx(0.1), inside=True, verdict="pass"
    )
    assert judge_interval(1.0, 1.05, 1.1)["verdict"] == "fail"
    # Over TOO_WIDE of the value: neither pass nor fail, whether or not the value is inside.
    assert judge_interval(1.0, 0.5, 1.6) == dict(
        rel_half_width=pytest.approx(0.55), inside=True, verdict="too wide"
    )
    assert judge_interval(-2.0, -4.0, 0.0)["verdict"] == "too wide"
    # the bound itself is judged
    assert judge_interval(1.0, 1 - TOO_WIDE, 1 + TOO_WIDE)["verdict"] == "pass"
    assert judge_interval(1.0, math.nan, math.nan)["verdict"] == "too wide"  # no interval at all
    assert judge_interval(0.0, -0.1, 0.1)["verdict"] == "too wide"  # no value to be relative to
    table = pd.DataFrame({"verdict": ["pass", "too wide", "pass", "fail"]})
    assert tally(table) == {"pass": 2, "fail": 1, "too wide": 1}


def test_short_runs_are_too_wide_to_judge():
    # Two short replications of a case with a control variate leave no interval; of a plain one, a
    # wide one.
    short = [
        s
        for s in standard_scenarios(0.01)
        if s.name in ("M/M/1 rho=0.8", "M/M^[4]/1 bulk service lambda=3 mu=1 (Bailey)")
    ]
    result = check(short, replications=2, workers=1).set_index("case")
    assert (result["verdict"] == "too wide").all()
    assert (result.loc["M/M/1 rho=0.8", "rel_half_width"] > TOO_WIDE).all()
    assert math.isnan(result.loc["M/M^[4]/1 bulk service lambda=3 mu=1 (Bailey)", "rel_half_width"])


def test_step_times_recovered_from_the_records():
    # With exact steps (cv 0) every recovered step of a one-token engine is exactly b0 long.
    bulk = next(s for s in sharing_scenarios(0.01) if "bulk" in s.name)
    exact = replace(
        bulk, step=StepModel(b0=0.5, b1=0.0, b2=0.0, b3=0.0), checks=(("step", 0.5, mean_step_s),)
    )
    assert exact.run(3) == [pytest.approx(0.5, rel=1e-12)] * 2  # the statistic, and the control


@pytest.mark.slow  # long runs of several rows: 7 s of CPU
def test_the_batching_engine_is_the_discrete_chain():
    # Few tokens and a large step overhead: the steps put W 8 % above the continuous-time form, and
    # the simulator agrees with the discrete model solved exactly (theory.continuous_batching_steps)
    # instead.
    lam, a, b, tokens = 20.0, 0.02, 0.002, 5
    steps = theory.continuous_batching_steps(lam, a, b, tokens)
    continuous = theory.continuous_batching(lam, a, b, tokens).w
    assert steps / continuous - 1 == pytest.approx(0.084, abs=0.002)
    case = BatchScenario(
        "steps",
        lam,
        Lengths("geometric", tokens),
        StepModel(b0=a, b1=0.0, b2=b, b3=0.0),
        20_000,
        0.05,
        checks=(("W", steps, mean_sojourn), ("W", continuous, mean_sojourn)),
    )
    result = check([case], replications=5, workers=1)
    assert list(result["verdict"]) == ["pass", "fail"], result.to_string()


def test_the_batching_engine_step_by_step_against_a_plain_reference():
    # The rows' engine is the model the docs describe: a step of a + b m for m running, joins at a
    # step's end, the first K present run, FIFO behind. tests/step_reference.py writes that model
    # plainly; both give every request the same time in system (a cap that binds, and one that does
    # not).
    from step_reference import sojourns

    for cap in (3, 100_000):
        case = BatchScenario(
            "reference",
            8.0,
            Lengths("geometric", 8),
            StepModel(b0=0.02, b1=0.0, b2=0.004, b3=0.0),
            3000,
            0.0,
            max_num_seqs=cap,
        )
        frame = case.records(7)
        assert frame["outcome"].eq("good").all()
        want = sojourns(frame["arrival_s"], frame["output_tokens"], 0.02, 0.004, cap)
        assert (frame["finish_s"] - frame["arrival_s"]).to_numpy() == pytest.approx(
            want, rel=1e-9, abs=1e-9
        )


@pytest.mark.slow
def test_results_do_not_depend_on_workers():
    small = [
        s
        for s in standard_scenarios(scale=0.1)
        if "M/M/1/5" in s.name or "Erlang B" in s.name or "M/M/1-PS" in s.name
    ]
    a = check(small, replications=3, workers=1)
    b = check(small, replications=3, workers=2)
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.slow
def test_impatient_clients_rows(table):
    a = table[table["case"].str.contains("Erlang A")].set_index("quantity")
    assert list(a.index) == ["P(wait)", "P(abandon)", "Wq"]
    assert round(a.loc["P(abandon)", "theory"], 5) == 0.01398
    # M/M/c+D two ways, clients that leave while waiting and expiry at the front: the same requests
    # give up.
    d = table[table["case"].str.contains(r"\+D tau")]
    assert len(d) == 4
    for _, pair in d.groupby(d["case"].str.split(",").str[0]):
        assert pair["sim_mean"].nunique() == 1 and (pair["verdict"] == "pass").all()


@pytest.mark.slow
def test_patience_while_waiting_against_erlang_a_short():
    # A few short replications: the simulator's clients that leave while waiting give Erlang A's
    # P(abandon) and M/M/1+D's.
    scenarios = [
        s
        for s in standard_scenarios(scale=0.25)
        if "Erlang A" in s.name or ("M/M/1+D" in s.name and "leave" in s.name)
    ]
    result = check(scenarios, replications=4, seed=11, workers=2)
    assert len(result) == 4 and result["inside"].all(), result.to_string()


# ---------------------------------------------------------------- fleets behind a router


@pytest.fixture(scope="module")
def fleets():
    # 15 % of qlab theory's lengths (half-widths of 2 % or less at full size): about 60 CPU s.
    return check(fleet_scenarios(0.15), replications=10, seed=1, workers=2)


@pytest.mark.slow
def test_fleets_against_their_closed_forms(fleets):
    misses = fleets[fleets["verdict"] != "pass"]
    assert misses.empty, "\n" + misses.to_string()
    assert (fleets["rel_half_width"] < 0.06).all()  # 1.1-3.7 % with seed 1
    cases = " ".join(fleets["case"])
    for needle in ("random routing", "round robin", "power of 2 choices", "central queue"):
        assert needle in cases


def test_the_fleet_rows_can_fail():
    # Random routing is not round robin (E_4/M/1 waits 2.27 s, not 4), and a fleet of 400 behind
    # two choices is not 400 M/M/1s (W 10 s, not 2.6): short runs must refuse both.
    random, _, pod, _ = fleet_scenarios(0.05)
    wrong = [
        replace(random, checks=(("Wq", theory.round_robin(3.2, 1, 4).wq, mean_wait),)),
        replace(pod, requests=20_000, checks=(("W", theory.mm1(0.9, 1).w, mean_sojourn),)),
    ]
    result = check(wrong, replications=5, workers=1)
    assert list(result["verdict"]) == ["fail", "fail"], result.to_string()


@pytest.mark.slow
def test_each_check_may_have_its_own_control():
    # Round robin's P(wait) keeps the mean service; its Wq has the realised load, arrivals and
    # sizes.
    rr = fleet_scenarios(0.1)[1]
    assert [c.name for c in control_columns(rr)] == ["mean service", "realised load"]
    result = check([rr], replications=6, seed=3, workers=2)  # workers: its controls pickle
    assert list(result["control"]) == ["mean service", "realised load"]
    assert list(result["verdict"]) == ["pass", "pass"], result.to_string()
    # The same runs against M/M/1's wait (4 s, not 2.27): the narrower interval must refuse it.
    wrong = replace(
        rr, checks=(("Wq", theory.mm1(0.8, 1).wq, mean_wait),), control=(rr.control[1],)
    )
    assert list(check([wrong], replications=6, seed=3, workers=1)["verdict"]) == ["fail"]


def test_the_realised_load_is_zero_for_the_offered_load():
    # Gaps of exactly 1 / rate and sizes of exactly the mean: no deviation; twice the sizes: +1.
    frame = pd.DataFrame(
        {
            "arrival_s": [0.0, 0.5, 1.0, 1.5],
            "true_service_s": [1.0] * 4,
            "finish_s": [1.0, 2.0, 3.0, 4.0],
            "start_s": [0.0, 1.0, 2.0, 3.0],
        }
    )
    assert load_deviation(2.0, 1.0)(frame) == pytest.approx(0.0)
    assert load_deviation(2.0, 0.5)(frame) == pytest.approx(1.0)
