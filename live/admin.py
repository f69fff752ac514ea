"""The operator's route: ``PUT /admin/calibration`` hands a running gate a new calibration.

``qlab calibrate --apply`` (or any client) sends the calibration JSON that ``qlab calibrate``
writes; the gate plans with it from its next arrival, without a restart
(:meth:`live.gate.Gate.use_calibration`: the line, the engines' slowdown and noise, and a batching
gate's step model). The route wants the
operator's key (``qlab serve --admin-key``, else ``QLAB_ADMIN_KEY``): ``Authorization: Bearer KEY``,
compared as the API keys are (:mod:`live.auth`: constant time, never logged). A gate started without
one refuses everyone (403): calibrations are then taken at start-up only (``--service-model``). The
key is the operator's alone, apart from the clients' API keys: a client key opens nothing here.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from fastapi import FastAPI, Request
from fastapi.responses import Response

from qsim.service import LoadTerms, ServiceModel

from .auth import OPERATOR_SCHEME, ApiKeys, Holder, digest
from .contract_fields import Limits
from .envelope import InvalidRequest, error_response, error_responses, json_response
from .request_io import read_body

CALIBRATION = "/admin/calibration"
#: Where ``--admin-key`` is read from when the flag is not given.
ADMIN_KEY_ENV = "QLAB_ADMIN_KEY"

NO_OPERATOR = error_response(
    403,
    "invalid_request",
    "forbidden",
    "this gate takes no calibration while it runs: "
    f"start it with --admin-key (or {ADMIN_KEY_ENV}) to allow PUT {CALIBRATION}",
)
NOT_OPERATOR = error_response(
    401,
    "invalid_request",
    "unauthorized",
    f"PUT {CALIBRATION} needs the operator's key: send Authorization: Bearer KEY",
    headers={"WWW-Authenticate": "Bearer"},
)


def operator_key(given: str | None) -> ApiKeys | None:
    """The operator's key (``--admin-key``, else :data:`ADMIN_KEY_ENV`) as a key set of one;
    None: none."""
    key = given or os.environ.get(ADMIN_KEY_ENV)
    return ApiKeys(((digest(key), Holder(None)),)) if key else None


def read_calibration(raw: bytes) -> tuple[ServiceModel, LoadTerms]:
    """A calibration JSON's line and load terms; InvalidRequest (400) for one that is not."""
    try:
        data = json.loads(raw)
        return (
            ServiceModel.from_calibration(data, "the calibration"),
            LoadTerms.from_calibration(data, "the calibration"),
        )
    except ValueError as exc:  # JSONDecodeError is one
        raise InvalidRequest(
            400, "invalid_calibration", f"not a calibration of qlab calibrate: {exc}"
        ) from None


def mount(app: FastAPI, gate, limits: Limits, operator: ApiKeys | None) -> None:
    """``PUT /admin/calibration`` on ``app``, for ``gate``."""

    # The operator's bearer scheme where there is an operator key (without one, all get the 403).
    security = {} if operator is None else {"security": [{OPERATOR_SCHEME: []}]}

    @app.put(
        CALIBRATION,
        responses=error_responses(400, 401, 403, 408, 413, 415, 421, 431),
        openapi_extra=security,
    )
    async def take_calibration(request: Request) -> Response:
        if operator is None:
            return NO_OPERATOR
        header = request.headers.get("authorization")
        if operator.holder(None if header is None else header.encode("latin-1")) is None:
            return NOT_OPERATOR
        model, terms = read_calibration(await read_body(request, limits.max_body_bytes))
        gate.use_calibration(model, terms)
        said = {
            "service_model": asdict(gate.config.model),
            "server_config": gate.config.to_fields(),
        }
        return json_response(json.dumps(said))


def sending_key() -> str:
    """The operator's key a client sends (:data:`ADMIN_KEY_ENV`: never on a command line);
    ValueError (one line) where it is not set."""
    key = os.environ.get(ADMIN_KEY_ENV)
    if not key:
        raise ValueError(
            f"--apply: set {ADMIN_KEY_ENV} to the gate's operator key (qlab serve --admin-key)"
        )
    return key


def send_calibration(url: str, calibration: dict, timeout_s: float = 30.0) -> dict:
    """PUT ``calibration`` to the gate at ``url`` with the operator's key (:data:`ADMIN_KEY_ENV`);
    what the gate now plans with. ValueError (one line) where it is not taken."""
    import httpx

    key = sending_key()
    try:
        answer = httpx.put(
            url + CALIBRATION,
            content=json.dumps(calibration),
            timeout=timeout_s,
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        )
    except httpx.HTTPError as exc:
        raise ValueError(f"--apply: {url}{CALIBRATION}: {type(exc).__name__}: {exc}") from None
    if answer.status_code != 200:
        raise ValueError(
            f"--apply: {url}{CALIBRATION} answered HTTP {answer.status_code}: {answer.text[:200]}"
        )
    return answer.json()
