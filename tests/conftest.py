import contextlib
import multiprocessing.process
import os
import platform
import socket
import subprocess
import sysconfig
import traceback
from pathlib import Path

import pytest
from hypothesis import settings

# CI replays the same examples every run (a red CI then means a real regression, reproducible
# here with CI=true); locally hypothesis explores new ones each run.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- the slow marker, kept honest
#
# A test that starts a server or another process is marked slow (docs/testing.md), so that `make test-fast`
# leaves it out. Rather than trust each author to remember, a test run without the marker (its fixtures'
# set-up included) that makes one of these calls fails once it is over, naming what it started and where from.
# The call itself goes ahead: refusing it would leave a pool or a server half made, to hang the run.
STARTS = (
    (subprocess.Popen, "__init__", "a process (subprocess.Popen)"),
    (multiprocessing.process.BaseProcess, "start", "a process (multiprocessing: a pool, a Dask cluster)"),
    (os, "fork", "a process (os.fork)"),
    (socket.socket, "listen", "a server (a socket listening)"),
)

# The platform module runs `uname -p` once per process and caches the answer: asked here, before any test, so
# that a library that asks later (the openai SDK's request headers) starts no process inside a test.
platform.platform()
platform.processor()


@contextlib.contextmanager
def _no_servers_or_processes(item: pytest.Item):
    started: list[str] = []
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in STARTS]

    def noting(what: str, original):
        def note(*args, **kwargs):
            started.append(f"{what}, from {_caller()}")
            return original(*args, **kwargs)
        return note

    for (owner, name, what), (_, _, original) in zip(STARTS, originals):
        setattr(owner, name, noting(what, original))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    if started:  # also where it was started in a thread
        pytest.fail(f"{item.nodeid} starts {started[0]}, but is not marked slow: give it @pytest.mark.slow "
                    "(docs/testing.md)", pytrace=False)


def _caller() -> str:
    """Where the start was asked for: the innermost frame outside the standard library (a test, a fixture, or
    the package that spawns)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.startswith(stdlib)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "the standard library"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with contextlib.nullcontext() if item.get_closest_marker("slow") else _no_servers_or_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with contextlib.nullcontext() if item.get_closest_marker("slow") else _no_servers_or_processes(item):
        return (yield)


@pytest.fixture(scope="session")
def azure_csv() -> Path:
    """The hour of Azure LLM arrivals shipped in data/ (CC-BY 4.0, Patel et al., ISCA 2024)."""
    return ROOT / "data" / "azure_llm_2023_code.csv"


TINY_SWEEP = """
[sweep]
duration_s = 10
seeds = 3
[grid]
policy = ["bounded", "predictive"]
load = [0.5, 2.0]
"""


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory) -> Path:
    """A sweep folder of 2 policies x 2 loads x 3 seeds of 10 s (a second or two), for the commands that read one."""
    from experiments import config, sweep

    tmp = tmp_path_factory.mktemp("tiny_sweep")
    (tmp / "tiny.toml").write_text(TINY_SWEEP)
    sweep.run(config.load(tmp / "tiny.toml"), tmp / "out", workers=1, quiet=True)
    return tmp / "out"
