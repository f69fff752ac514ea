"""The slow marker is kept honest (tests/conftest.py): a test not marked slow that starts a process
or a server fails once it is over, naming what it started and where from, also where its fixture
starts it or where it does so in a thread; what it started runs as it would (a refusal would leave
a pool half made); a test marked slow passes. A test not marked slow that imports torch (itself or
in a fixture) where torch was not imported before fails the same way."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

PROBES = """
import multiprocessing, socket, subprocess, threading
import pytest

def test_a_process():
    subprocess.run(["true"])

def test_a_pool_in_a_thread():
    def start():
        process = multiprocessing.get_context("spawn").Process(target=print)
        process.start()
        process.join()

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()

@pytest.fixture(scope="module")
def server():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock

def test_a_server_of_a_fixture(server):
    pass

def test_nothing_started():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # a port, nothing listening

@pytest.mark.slow
def test_marked():
    with socket.create_server(("127.0.0.1", 0)):
        subprocess.run(["true"], check=True)
"""


@pytest.mark.slow  # its marked probe really starts a process and listens
def test_a_test_that_starts_a_process_or_a_server_must_be_marked_slow(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini(
        "[pytest]\naddopts = --strict-markers\nmarkers =\n    slow: starts a server or a process\n"
    )
    pytester.makepyfile(test_probes=PROBES)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2, errors=1)
    result.stdout.fnmatch_lines_random(
        [
            "*test_probes.py::test_a_process starts a process (subprocess.Popen), from "
            "*test_probes.py:5, but is not "
            "marked slow*",
            "*test_probes.py::test_a_pool_in_a_thread starts a process (multiprocessing*), from "
            "*test_probes.py:10, but*",
            "*test_probes.py::test_a_server_of_a_fixture starts a server (a socket listening), "
            "from "
            "*test_probes.py:19, "
            "but*",
        ]
    )


# torch.py in the probes' folder stands in for torch: the guard goes by the name appearing in
# sys.modules, and the real one would cost 10 to 40 s of CPU to import.
TORCH_PROBES = """
import importlib, sys
import pytest

@pytest.fixture(autouse=True)
def forget_torch():
    yield
    sys.modules.pop("torch", None)  # each probe imports it afresh

def test_torch():
    import torch

@pytest.fixture
def model():
    return importlib.import_module("torch")

def test_torch_of_a_fixture(model):
    pass

def test_no_torch():
    import json

@pytest.mark.slow
def test_torch_marked():
    import torch
"""


@pytest.mark.slow  # a process of its own: this one's sys.modules may hold the real torch already
def test_a_test_that_imports_torch_must_be_marked_slow(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini("[pytest]\naddopts = --strict-markers\nmarkers =\n    slow: loads torch\n")
    pytester.makepyfile(torch="", test_torch_probes=TORCH_PROBES)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1, errors=1)
    result.stdout.fnmatch_lines_random(
        [
            "*test_torch_probes.py::test_torch imports torch, from *test_torch_probes.py:10, but "
            "is "
            "not marked slow*",
            "*test_torch_probes.py::test_torch_of_a_fixture imports torch, from "
            "*test_torch_probes.py:14, but is not marked slow*",
        ]
    )
