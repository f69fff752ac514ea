import contextlib
import importlib.abc
import multiprocessing.process
import os
import platform
import socket
import subprocess
import sys
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
# A test that starts a server or another process is marked slow (docs/testing.md), so that `make
# test-fast` leaves it out. Rather than trust each author to remember, a test run without the marker
# (its fixtures' set-up included) that makes one of these calls fails once it is over, naming what
# it started and where from. The call itself goes ahead: refusing it would leave a pool or a server
# half made, to hang the run.
STARTS = (
    (subprocess.Popen, "__init__", "a process (subprocess.Popen)"),
    (
        multiprocessing.process.BaseProcess,
        "start",
        "a process (multiprocessing: a pool, a Dask cluster)",
    ),
    (os, "fork", "a process (os.fork)"),
    (socket.socket, "listen", "a server (a socket listening)"),
)

# The platform module runs `uname -p` once per process and caches the answer: asked here, before any
# test, so that a library that asks later (the openai SDK's request headers) starts no process
# inside a test.
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
        pytest.fail(
            f"{item.nodeid} starts {started[0]}, but is not marked slow: give it "
            "@pytest.mark.slow "
            "(docs/testing.md)",
            pytrace=False,
        )


def _caller() -> str:
    """Where the start was asked for: the innermost frame outside the standard library (a test, a
    fixture, or the package that spawns)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    # "<frozen importlib._bootstrap>": the machinery between an import statement and a finder.
    frames = [
        f for f in traceback.extract_stack()[:-2] if not f.filename.startswith((stdlib, "<frozen "))
    ]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "the standard library"


# Loading torch costs 10 to 40 s of CPU (and GPT-2 more), which is what the slow marker is for. A
# test not marked slow whose code or fixtures make torch appear in sys.modules fails the same way.
# Only a first import is seen: once a slow test has loaded it in a process, a later test finds it
# there and is not blamed (`make test-fast` runs no slow test: there every first import is seen).
HEAVY_MODULES = ("torch",)


class _FirstImports(importlib.abc.MetaPathFinder):
    """Notes where a heavy module is first imported from, and finds nothing: the import goes on
    to the finders after it as it would have."""

    def __init__(self, noted: list[str]):
        self.noted = noted

    def find_spec(self, name, path=None, target=None):
        if name in HEAVY_MODULES and name not in sys.modules:
            self.noted.append(f"{name}, from {_caller()}")
        return None


@contextlib.contextmanager
def _no_heavy_imports(item: pytest.Item):
    before = {name for name in HEAVY_MODULES if name in sys.modules}
    noted: list[str] = []
    finder = _FirstImports(noted)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
    loaded = [name for name in HEAVY_MODULES if name in sys.modules and name not in before]
    if loaded:
        what = noted[0] if noted else loaded[0]
        pytest.fail(
            f"{item.nodeid} imports {what}, but is not marked slow: give it "
            "@pytest.mark.slow (docs/testing.md)",
            pytrace=False,
        )


@contextlib.contextmanager
def _kept_fast(item: pytest.Item):
    if item.get_closest_marker("slow"):
        yield
        return
    with _no_heavy_imports(item), _no_servers_or_processes(item):
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _kept_fast(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _kept_fast(item):
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
    """A sweep folder of 2 policies x 2 loads x 3 seeds of 10 s (a second or two), for the
    commands that read one."""
    from experiments import config, sweep

    tmp = tmp_path_factory.mktemp("tiny_sweep")
    (tmp / "tiny.toml").write_text(TINY_SWEEP)
    sweep.run(config.load(tmp / "tiny.toml"), tmp / "out", workers=1, quiet=True)
    return tmp / "out"
