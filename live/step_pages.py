"""A batching gate's step log, read back (``GET /stats?steps_since=``, a page at a time) by a client
that holds an :class:`httpx.Client` (the calibrator): the gate's clock where a phase begins, the
steps it ran since. :func:`step_page` and :func:`page_params` are the replayer's too
(:func:`live.replay_server.fetch_steps`, on its own connections).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from qsim.runfile import LoggedStep

from .contract import Stats
from .contract_fields import num
from .server_facts import lenient


def gate_clock(http: httpx.Client) -> float:
    """The gate's clock now (``/stats``' ``clock``): where a phase's steps begin in its step log."""
    response = http.get("/stats")
    clock = lenient(Stats, response.json() if response.status_code == 200 else None).clock
    if clock is None:
        raise ValueError(
            f"GET /stats does not say the gate's clock (HTTP {response.status_code}): "
            "a batching "
            "server's steps cannot be read back"
        )
    return num(clock)


#: The most pages of a step log a client reads: the whole log (200,000 steps) is 40 of 5,000; a
#: gate that kept answering a next page past this is broken, and a client must not loop on it
#: forever.
MAX_STEP_PAGES = 1_000


@dataclass(frozen=True)
class StepPage:
    """One answer of ``/stats?steps_since=``: its steps, the cursor of the next page (None: the
    last), and the step models the gate took among them ([steps of the page before it, b0, b1, b2,
    b3, cv] each: :meth:`live.drive_batch.BatchDriver.step_page`)."""

    steps: list
    next: int | None
    models: list


def step_page(status: int, payload: object) -> StepPage:
    """One answer of ``/stats?steps_since=`` (or ``steps_from=``); a gate that does not page
    answers one, and one that took no step model says none. ValueError when it is not a page of
    steps."""
    if status != 200:
        raise ValueError(f"GET /stats?steps_since= answered HTTP {status}")
    steps = payload.get("step_log", []) if isinstance(payload, dict) else None
    cursor = payload.get("step_log_next") if isinstance(payload, dict) else None
    models = payload.get("step_models", []) if isinstance(payload, dict) else None
    if not isinstance(steps, list) or not (cursor is None or isinstance(cursor, int)):
        raise ValueError("GET /stats?steps_since= answered no step log")
    if not isinstance(models, list):
        raise ValueError("GET /stats?steps_since= answered step models that are no list")
    return StepPage(steps, cursor, models)


def page_params(since: float, cursor: int | None) -> dict[str, str]:
    """The query of the first page (``steps_since``), or of the page at ``cursor``."""
    return {"steps_since": repr(since)} if cursor is None else {"steps_from": str(cursor)}


def fetch_steps(http: httpx.Client, since: float) -> tuple[LoggedStep, ...]:
    """The steps a batching gate woke for at ``since`` or later (its clock;
    ``/stats?steps_since=``'s step log), page after page."""
    steps, cursor = [], None
    for _ in range(MAX_STEP_PAGES):
        response = http.get("/stats", params=page_params(since, cursor))
        page = step_page(response.status_code, response.json())
        steps += page.steps
        cursor = page.next
        if cursor is None:
            return tuple(LoggedStep(*row) for row in steps)
    raise ValueError(f"GET /stats?steps_since=: more than {MAX_STEP_PAGES} pages of steps")
