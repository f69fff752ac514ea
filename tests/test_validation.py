"""Each closed form against the simulator, inside a confidence interval over replications."""

import pandas as pd
import pytest

from analysis.validation import Scenario, blocked_share, check, mean_wait, standard_scenarios
from qsim import theory


@pytest.fixture(scope="module")
def table():
    return check(standard_scenarios(), replications=10, seed=1, workers=2)


@pytest.mark.slow
def test_every_closed_form_inside_its_interval(table):
    misses = table[~table["ok"]]
    assert misses.empty, "\n" + misses.to_string()


@pytest.mark.slow
def test_the_standard_set_covers_the_issue(table):
    cases = " ".join(table["case"])
    for needle in ("M/M/1 rho=0.95", "M/M/2", "M/M/8", "M/M/1/5", "Erlang B", "M/M/2/6", "M/D/1",
                   "reference mix rho=0.9 (P-K)", "Erlang A", "M/M/1+D tau=2", "M/M/4+D tau=1"):
        assert needle in cases
    assert set(table.columns) == {"case", "quantity", "theory", "sim_mean", "ci_low", "ci_high", "ok"}
    assert (table["ci_low"] < table["ci_high"]).all()


def test_the_check_can_fail():
    # A wrong closed form (M/M/1 Wq off by 20 %) must fall outside the interval.
    wrong = Scenario("M/M/1 rho=0.8, wrong", 1, 0.8, 20_000, 0.1,
                     checks=(("Wq", 1.2 * theory.mm1(0.8, 1).wq, mean_wait),
                             ("P(block)", 0.05, blocked_share)))
    result = check([wrong], replications=5, workers=1)
    assert not result["ok"].any()


@pytest.mark.slow
def test_results_do_not_depend_on_workers():
    small = [s for s in standard_scenarios(scale=0.1) if "M/M/1/5" in s.name or "Erlang B" in s.name]
    a = check(small, replications=3, workers=1)
    b = check(small, replications=3, workers=2)
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.slow
def test_impatient_clients_rows(table):
    a = table[table["case"].str.contains("Erlang A")].set_index("quantity")
    assert list(a.index) == ["P(wait)", "P(abandon)", "Wq"]
    assert round(a.loc["P(abandon)", "theory"], 5) == 0.01398
    # M/M/c+D two ways, clients that leave while waiting and expiry at the front: the same requests give up.
    d = table[table["case"].str.contains(r"\+D tau")]
    assert len(d) == 4
    for _, pair in d.groupby(d["case"].str.split(",").str[0]):
        assert pair["sim_mean"].nunique() == 1 and pair["ok"].all()


@pytest.mark.slow
def test_patience_while_waiting_against_erlang_a_short():
    # A few short replications: the simulator's clients that leave while waiting give Erlang A's P(abandon)
    # and M/M/1+D's.
    scenarios = [s for s in standard_scenarios(scale=0.25)
                 if "Erlang A" in s.name or ("M/M/1+D" in s.name and "leave" in s.name)]
    result = check(scenarios, replications=4, seed=11, workers=2)
    assert len(result) == 4 and result["ok"].all(), result.to_string()
