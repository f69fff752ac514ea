"""A policy of one's own (docs/examples/slack.py, shown in docs/policies.md) runs everywhere a
preset does: simulate, a sweep, the gate (exactly as the simulator, on a virtual clock), a real
server, and compare."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments import config, sweep
from qsim import make_trace, simulate
from qsim.policy import resolve

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
SPEC = "slack:LeastSlack"


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLES))  # for the server and command-line children


def test_resolved_with_its_own_parameter_and_its_own_order():
    policy = resolve(SPEC, {"weight": "0.5"})
    assert type(policy).__name__ == "LeastSlack" and policy.name == SPEC and policy.weight == 0.5
    with pytest.raises(ValueError, match="weight must be >= 0"):
        resolve(SPEC, {"weight": "-1"})
    trace = make_trace("poisson", "mix", load=2.0, seconds=120, seed=3, noise_cv=0.2)
    slack, fifo = simulate(trace, policy), simulate(trace, resolve("predictive"))
    assert not slack["start_s"].equals(fifo["start_s"])  # another order of service
    assert slack["outcome"].eq("good").mean() > 0.7


def test_the_gate_runs_it_as_the_simulator_does():
    from virtual_time import run_gate

    trace = make_trace("poisson", "mix", load=2.0, engines=2, seconds=15, seed=5, noise_cv=0.3)
    policy = resolve(SPEC, {"weight": 0.5})
    gate, _ = run_gate(trace, policy, 2)
    sim = simulate(trace, policy, 2)
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-12)


def test_a_sweep_takes_it_with_its_parameters(tmp_path):
    (tmp_path / "s.toml").write_text(f"""
[sweep]
duration_s = 60
seeds = 2
[grid]
policy = ["predictive", "{SPEC}"]
load = [1.5]
[policy_args."{SPEC}"]
weight = 0.5
""")
    cfg = config.load(tmp_path / "s.toml")
    summary = sweep.run(cfg, tmp_path / "out", workers=1, quiet=True)
    assert sorted(summary["policy"].unique()) == sorted(["predictive", SPEC]) and len(summary) == 4
    (tmp_path / "bad.toml").write_text(
        f'[grid]\npolicy = ["{SPEC}"]\nload = [1.0]\n[policy_args."{SPEC}"]\nquantum = 1\n'
    )
    with pytest.raises(config.ConfigError, match="has no parameter 'quantum'"):
        config.load(tmp_path / "bad.toml")


@pytest.mark.slow
def test_a_server_serves_it_and_compare_rebuilds_it(tmp_path):
    pytest.importorskip("fastapi")
    from live.procs import serving
    from live.serve_options import ServeOptions

    options = ServeOptions(policy=SPEC, policy_arg="weight=0.5")
    with serving([options], tmp_path, 60) as (server,):
        qlab = [sys.executable, "-m", "experiments"]
        run = tmp_path / "run.parquet"
        subprocess.run(
            [*qlab, "replay", "--url", server.url, "--arrivals", "burst:30", "--out", str(run)],
            check=True,
            capture_output=True,
            text=True,
        )
        done = subprocess.run(
            [*qlab, "compare", str(run), "--out", str(tmp_path / "cmp")],
            check=True,
            capture_output=True,
            text=True,
        )
    frame = pd.read_parquet(run)
    assert frame["policy"].iloc[0] == SPEC and '"weight": 0.5' in frame["server_config"].iloc[0]
    assert "disagreements: 0 of 30" in done.stdout


def test_a_rule_of_its_own_decides_in_the_gate_as_in_the_simulator():
    """docs/examples/margin.py overrides Policy.decide: the gate, on a virtual clock, makes every
    decision the simulator makes, and the margin refuses what plain predictive admits."""
    from virtual_time import run_gate

    trace = make_trace("poisson", "mix", load=2.0, engines=2, seconds=15, seed=5, noise_cv=0.3)
    policy = resolve("margin:Margin", {"margin_s": "0.4"})
    assert type(policy).__name__ == "Margin" and policy.margin_s == 0.4
    gate, _ = run_gate(trace, policy, 2)
    sim = simulate(trace, policy, 2)
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    assert gate["reason"].fillna("").tolist() == sim["reason"].fillna("").tolist()
    np.testing.assert_allclose(gate["finish_s"], sim["finish_s"], rtol=0, atol=1e-12)
    # The first decision that differs from plain predictive's is the margin's refusal of what
    # predictive admits.
    plain = simulate(trace, resolve("predictive"), 2)
    differ = np.flatnonzero(sim["outcome"].to_numpy() != plain["outcome"].to_numpy())
    assert (
        len(differ)
        and sim["outcome"].iloc[differ[0]] == "rejected" != plain["outcome"].iloc[differ[0]]
    )
    with pytest.raises(ValueError, match="margin_s must be >= 0"):
        resolve("margin:Margin", {"margin_s": "-1"})


def test_a_rule_of_its_own_is_one_more_part_in_the_gate_as_in_the_simulator():
    """docs/examples/prompts.py adds a rule refusing long prompts to the predictive preset's rules:
    the simulator and the gate (on a virtual clock) refuse exactly the prompts over the bound, as
    too_large."""
    from virtual_time import run_gate

    from qsim.policy import PRESETS
    from qsim.mixes import Prompts

    policy = resolve("prompts:ShortPrompts", {"max_prompt_tokens": "120"})
    bound = policy.rules[-1]
    assert type(bound).__name__ == "PromptBound" and bound.max_prompt_tokens == 120
    assert policy.rules == (*PRESETS["predictive"].rules, bound)
    trace = make_trace(
        "poisson",
        "mix",
        load=1.5,
        engines=2,
        seconds=15,
        seed=5,
        noise_cv=0.3,
        prompts=Prompts("uniform", 0, 200),
    )
    sim = simulate(trace, policy, 2)
    gate, _ = run_gate(trace, policy, 2)
    assert gate["outcome"].tolist() == sim["outcome"].tolist()
    assert gate["reason"].fillna("").tolist() == sim["reason"].fillna("").tolist()
    long = trace.prompt_tokens > 120
    assert long.any() and (~long).any()
    np.testing.assert_array_equal(sim["reason"].fillna("").eq("too_large").to_numpy(), long)
    retry = sim["retry_after_s"].to_numpy(dtype=float, na_value=np.nan)[long]
    assert not (retry > 0).any()  # no Retry-After: sending it again cannot help
    with pytest.raises(ValueError, match="max_prompt_tokens must be >= 0"):
        resolve("prompts:ShortPrompts", {"max_prompt_tokens": "-1"})
