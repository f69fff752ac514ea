"""One list of `qlab serve` options: its flags, a [server] table's keys and a child's argv agree."""

import argparse
import re
from dataclasses import fields, replace

import pytest

from live import live_config
from live.serve_options import ServeOptions


def _parse(argv: list[str]) -> ServeOptions:
    parser = argparse.ArgumentParser()
    ServeOptions.add_flags(parser)
    return ServeOptions.from_args(parser.parse_args(argv))


@pytest.mark.parametrize(
    "options",
    [
        ServeOptions(),
        ServeOptions(
            policy="predictive",
            max_queue=0,
            deadline=1.5,
            engines=3,
            speed=0.5,
            noise=0.2,
            speed_schedule="10:2.2",
            fail_every=3,
            hang_after=0,
            hang_for=2.5,
            stall_factor=1.0,
            stall_after=0.5,
            seed=7,
            fixed_estimate=True,
            port=0,
            http="h11",
            watch_stdin=True,
        ),
        ServeOptions(engine="gpt2", model="tiny", device="cpu", threads=2, speed=3.0, noise=0.5),
    ],
)
def test_a_childs_argv_parses_back_into_its_options(options):
    argv = options.argv()
    assert argv[1:4] == ["-m", "experiments", "serve"]
    back = _parse(argv[4:])
    if options.engine == "gpt2":  # synthetic-only values are not passed to a gpt2 server
        options = replace(options, speed=1.0, noise=0.0)
    assert back == options


def test_flags_are_checked_as_before():
    assert _parse([]) == ServeOptions() and _parse([]).host == "127.0.0.1"
    for argv, message in [
        (["--engine", "gpt2", "--noise", "0"], "--noise: only with --engine synthetic"),
        (
            ["--engine", "gpt2", "--speed", "2", "--fail-every", "1"],
            "--speed, --fail-every: only with --engine synthetic",
        ),
        (["--threads", "2"], "--threads: only with --engine gpt2"),
        (["--hang-for", "2"], "--hang-for: only with --hang-after (which run hangs)"),
        (["--speed-schedule", "x"], "speed schedule entries are SECONDS:FACTOR"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            _parse(argv)


def test_the_server_table_takes_the_serve_options_but_the_per_server_ones():
    keys = set(ServeOptions.toml_kinds())
    # Keys are never in a file of settings (live.serve_options: secret): a child reads them from its
    # environment.
    assert keys == {f.name for f in fields(ServeOptions)} - {
        "policy",
        "policy_arg",
        "host",
        "port",
        "log_level",
        "watch_stdin",
        "api_key",
        "upstream_api_key",
        "admin_key",
    }
    assert set(live_config.SERVER_KEYS) == keys | {"policies", "startup_timeout_s"}


def test_server_table_values_reach_the_options(tmp_path):
    path = tmp_path / "live.toml"
    path.write_text(
        "[server]\nengines = 2\nnoise = 0.1\nfail_every = 4\npolicies = ['bounded']\n"
        "startup_timeout_s = 30\n[[trace]]\nname = 'a'\nseconds = 1\n"
    )
    cfg = live_config.load(path)
    assert cfg.server == ServeOptions(engines=2, noise=0.1, fail_every=4)
    assert cfg.policies == ("bounded",) and cfg.startup_timeout_s == 30


def test_a_live_file_gives_each_policy_its_parameters_and_refuses_unknown_ones(tmp_path):
    path = tmp_path / "live.toml"
    head = (
        "[server]\npolicies = ['predictive', 'codel', 'slack:LeastSlack']\n[[trace]]\nname = "
        "'a'\nseconds = 1\n"
    )
    path.write_text(
        head + "[policy_args.codel]\ncodel_target_s = "
        "0.2\n[policy_args.'slack:LeastSlack']\nweight = 0.5\n"
    )
    import sys
    from pathlib import Path

    # slack.py, the docs' example
    sys.path.insert(0, str(Path(__file__).parents[1] / "docs" / "examples"))
    cfg = live_config.load(path)
    codel = cfg.serve_options("codel")
    assert codel.policy == "codel" and codel.make_policy().make_discipline().target_s == 0.2
    assert cfg.serve_options("slack:LeastSlack").make_policy().weight == 0.5
    assert cfg.serve_options("predictive").policy_arg == ""
    for extra, message in [
        (
            "[policy_args.codel]\nquantum = 1\n",
            "policy_args.codel: policy 'codel' has no parameter 'quantum'",
        ),
        (
            "[policy_args.edf]\ndeadline_s = 1\n",
            "policy_args.edf: 'edf' is not one of the file's policies",
        ),
    ]:
        path.write_text(head + extra)
        with pytest.raises(live_config.ConfigError, match=re.escape(message)):
            live_config.load(path)
    path.write_text(head.replace("'codel'", "'nosuch'"))
    with pytest.raises(
        live_config.ConfigError, match="server.policies.1.: unknown policy 'nosuch'"
    ):
        live_config.load(path)
