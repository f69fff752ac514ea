"""Progress bars of the long commands: on stderr, only on a terminal, never with --quiet or --json,
and never on stdout (whose bytes the docs tests compare)."""

import sys

import pytest

from experiments.cli import main
from qsim import theory


@pytest.fixture
def one_short_case(monkeypatch):
    """qlab theory on one short M/M/1 case, so that a whole run takes a fraction of a second."""
    from analysis import validation

    case = validation.Scenario(
        "M/M/1 short",
        1,
        0.5,
        500,
        0.1,
        checks=(("Wq", theory.mm1(0.5, 1).wq, validation.mean_wait),),
    )
    monkeypatch.setattr(validation, "standard_scenarios", lambda scale: [case])


def _on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)


THEORY = ["theory", "--replications", "3", "--workers", "1"]


def test_theory_ticks_once_per_replication_on_a_terminal(one_short_case, monkeypatch, capsys):
    assert main(THEORY) in (0, 1)
    plain = capsys.readouterr()
    assert plain.err == ""  # not a terminal: no bar
    _on_a_terminal(monkeypatch)
    assert main(THEORY) in (0, 1)
    shown = capsys.readouterr()
    assert "theory" in shown.err and "3/3" in shown.err
    assert shown.out == plain.out  # the bar never reaches stdout


@pytest.mark.parametrize("flag", ["--quiet", "--json"])
def test_theory_draws_no_bar_with_quiet_or_json(flag, one_short_case, monkeypatch, capsys):
    _on_a_terminal(monkeypatch)
    assert main([*THEORY, flag]) in (0, 1)
    assert capsys.readouterr().err == ""
