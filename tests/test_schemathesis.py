"""/openapi.json and the server agree both ways, as schemathesis (an OpenAPI fuzzer) judges them.

Positive cases (what the document allows) are served: never a 422 or a 500, and a 400 only for
what no JSON schema can state (a deadline shorter than the request's estimate, or two fields that
disagree; each field's description says so). Negative cases (what the document does not allow)
are refused with a 4xx in the envelope. Every answer is one the document describes (its status,
content type and schema: schemathesis' own checks), with and without API keys, and the service
keeps serving.

In-process: schemathesis makes the cases from the document the app serves, FastAPI's TestClient
sends them (the gate's lifespan runs around them). ``QLAB_SCHEMATHESIS_EXAMPLES`` sets the cases
per operation and mode (docs/http.md has the figures of a longer run through a real server).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

# Slow: some 20 s of CPU. Skipped where schemathesis is not installed (the dev extra has it).
pytestmark = pytest.mark.slow
schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.config import SchemathesisConfig  # noqa: E402

# It sends a request of its own, past the client here: the security test below does its work.
from schemathesis.specs.openapi.checks import ignored_auth  # noqa: E402

from live.auth import load_keys  # noqa: E402
from live.contract_clients import read_error  # noqa: E402
from live.engine import SyntheticEngine  # noqa: E402
from live.gate import Gate, gate_config  # noqa: E402
from live.http_api import create_app  # noqa: E402
from qsim import preset  # noqa: E402

EXAMPLES = int(os.environ.get("QLAB_SCHEMATHESIS_EXAMPLES", "25"))
KEY = "schemathesis-key"
#: What a schema-valid request may still be refused for (400): what no JSON schema states.
NOT_IN_ANY_SCHEMA = {"deadline_too_short", "conflicting_parameters"}
# The positive check's statuses with 400, whose reasons are checked here (NOT_IN_ANY_SCHEMA); the
# negative one's without 5xx (the test asserts none) and with 413 (a body past the cap is refused
# before it is read). The key is sent with every case, not drawn: the security test sends none.
CONFIG = SchemathesisConfig.from_dict(
    {
        "generation": {"with-security-parameters": False},
        "checks": {
            "positive_data_acceptance": {
                "expected-statuses": ["2xx", "400", "401", "403", "404", "429", "503"]
            },
            "negative_data_rejection": {
                "expected-statuses": [
                    "400",
                    "401",
                    "403",
                    "404",
                    "405",
                    "406",
                    "409",
                    "413",
                    "415",
                    "422",
                    "428",
                    "429",
                ]
            },
        },
    }
)


@pytest.fixture(scope="module", params=["open", "with keys"])
def served(request):
    """(the client, the schema, the headers every case carries): a gate without keys, one with."""
    keys = load_keys(KEY, None, guard_stats=True) if request.param == "with keys" else None
    gate = Gate(
        [SyntheticEngine(speed=1e-4)], gate_config(preset("predictive"), fixed_estimate=True)
    )
    with TestClient(create_app(gate, keys=keys)) as client:
        doc = client.get("/openapi.json").json()
        schema = schemathesis.openapi.from_dict(doc, config=CONFIG)
        yield client, schema, {"authorization": f"Bearer {KEY}"} if keys else {}


def _send(client: TestClient, case, headers: dict):
    sent = case.as_transport_kwargs(base_url=str(client.base_url), headers=headers)
    body = {"json": sent["json"]} if "json" in sent else {"content": sent.get("data")}
    response = client.request(
        sent["method"], sent["url"], params=sent.get("params"), headers=sent.get("headers"), **body
    )
    return response, sent


def _operations(schema) -> list:
    return [operation.ok() for operation in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_the_document_and_the_server_agree(served, mode):
    client, schema, headers = served
    statuses: Counter = Counter()
    for operation in _operations(schema):

        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(operation.as_strategy(mode))
        def run(case):
            response, sent = _send(client, case, headers)
            statuses[response.status_code] += 1
            case.validate_response(
                response,
                headers=sent.get("headers"),
                transport_kwargs=sent,
                excluded_checks=[ignored_auth],
            )
            status, said = response.status_code, case.as_curl_command()
            if status != 200 and response.headers.get("content-type") == "application/json":
                assert read_error(response.json()) is not None, response.text  # the envelope
            if mode is GenerationMode.POSITIVE:
                assert status not in (422, 500), (said, response.text)
                if status == 400:
                    assert read_error(response.json()).reason in NOT_IN_ANY_SCHEMA, response.text
            else:  # a 4xx: schemathesis' negative_data_rejection, which knows what a query ignores
                assert status < 500, (said, response.text)

        try:
            run()
        except Unsatisfiable:  # nothing to break: no parameters and no body (GET /health)
            assert mode is GenerationMode.NEGATIVE, operation.label
    assert sum(statuses.values()) >= EXAMPLES, statuses
    still = client.post(
        "/v1/generate", json={"prompt": "still there?", "max_new_tokens": 3}, headers=headers
    )
    assert still.status_code == 200, still.text


def test_the_security_the_document_declares_holds(served):
    """Each operation the document secures refuses a request without the key (401 in the envelope,
    with WWW-Authenticate), and each it leaves open answers one."""
    client, schema, headers = served
    schemes = schema.raw_schema.get("components", {}).get("securitySchemes", {})
    assert ("apiKey" in schemes) == bool(headers)
    for operation in _operations(schema):
        wants = {name for need in operation.definition.raw.get("security", ()) for name in need}
        assert wants <= {"apiKey"}, wants  # the operator's: where the gate has one (test_contract)
        path = operation.path.replace("{model_id}", "synthetic")
        r = client.request(operation.method.upper(), path)
        if wants:
            assert r.status_code == 401, (operation.label, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert read_error(r.json()).reason == "unauthorized"
        else:
            assert r.status_code != 401, (operation.label, r.text)
