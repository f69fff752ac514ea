"""``PUT /admin/calibration``: a running gate takes a new calibration, for its operator only
(live/admin.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from live.admin import operator_key
from live.auth import load_keys
from live.engine import SyntheticEngine
from live.gate import Gate, gate_config
from live.http_api import create_app
from qsim import preset
from qsim.service import ServiceModel

#: A calibration as qlab calibrate writes it (the keys the gate reads: model, load).
FAST = {
    "model": {"intercept_s": 0.001, "per_token_s": 0.0085, "per_prompt_token_s": 0.0},
    "load": {"concurrency": 0.25, "noise_cv": 0.1},
    "rounds": [],
}
SLOW = ServiceModel(intercept_s=0.001, per_token_s=0.1)  # 64 tokens: 6.4 s, past predictive's 2 s
ASK = {"prompt": "hi", "max_new_tokens": 64}
OPERATOR = {"authorization": "Bearer op-key"}


def _gate(model: ServiceModel = SLOW) -> Gate:
    return Gate(
        [SyntheticEngine(speed=1e-4)],
        gate_config(preset("predictive"), model=model, fixed_estimate=True),
    )


def test_the_operator_hands_a_running_gate_a_calibration_and_it_admits_by_it_at_once():
    gate = _gate()
    with TestClient(create_app(gate, operator=operator_key("op-key"))) as c:
        refused = c.post("/v1/generate", json=ASK)
        assert (
            refused.status_code == 400 and refused.json()["error"]["reason"] == "deadline_too_short"
        )
        took = c.put("/admin/calibration", content=json.dumps(FAST), headers=OPERATOR)
        assert took.status_code == 200, took.text
        assert took.json()["service_model"]["per_token_s"] == 0.0085
        assert c.post("/v1/generate", json=ASK).status_code == 200  # the same request, no restart
        stats = c.get("/stats").json()
    assert stats["service_model"]["per_token_s"] == 0.0085
    engine = stats["server_config"]["engine"]
    assert engine["concurrency"] == 0.25 and engine["cv"] == 0.1
    assert gate.queue.config.model == ServiceModel(0.001, 0.0085)  # the core plans with it too


def test_nobody_else_can_calibrate_the_gate():
    keys = load_keys("client-key", None)
    with TestClient(create_app(_gate(), keys=keys, operator=operator_key("op-key"))) as c:
        for headers in (
            {},
            {"authorization": "Bearer client-key"},
            {"authorization": "Bearer op-ke"},
        ):
            answer = c.put("/admin/calibration", content=json.dumps(FAST), headers=headers)
            assert answer.status_code == 401 and answer.json()["error"]["reason"] == "unauthorized"
            assert "op-key" not in answer.text
        assert c.get("/stats").json()["service_model"]["per_token_s"] == 0.1  # unchanged
    with TestClient(create_app(_gate())) as c:  # no operator key: the route refuses everyone
        answer = c.put("/admin/calibration", content=json.dumps(FAST), headers=OPERATOR)
        assert answer.status_code == 403 and "--admin-key" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, said",
    [
        (b"{not json", "not a calibration"),
        (json.dumps({"model": {"per_token_s": 0.01}}).encode(), "intercept_s"),
        (json.dumps({**FAST, "load": {"concurrency": -1}}).encode(), "concurrency"),
    ],
)
def test_a_bad_calibration_is_a_400_and_the_gate_keeps_its_model_and_serving(body, said):
    with TestClient(create_app(_gate(ServiceModel()), operator=operator_key("op-key"))) as c:
        answer = c.put("/admin/calibration", content=body, headers=OPERATOR)
        assert (
            answer.status_code == 400 and answer.json()["error"]["reason"] == "invalid_calibration"
        )
        assert said in answer.json()["error"]["message"]
        assert c.get("/stats").json()["service_model"] == {
            "intercept_s": 0.001,
            "per_token_s": 0.0085,
            "per_prompt_token_s": 0.0,
        }
        assert c.post("/v1/generate", json=ASK).status_code == 200


def test_the_operator_key_comes_from_the_environment_where_the_flag_is_not_given(monkeypatch):
    assert operator_key(None) is None
    monkeypatch.setenv("QLAB_ADMIN_KEY", "env-key")
    assert operator_key(None).holder(b"Bearer env-key") is not None
