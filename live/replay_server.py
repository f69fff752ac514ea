"""What the replayer reads of the server, on its own lanes: ``/stats`` and the clocks' offset before
the run, with ``/healthz``'s facts (:func:`read_server`); after it, a batching gate's step log
(:func:`step_log`) and the upstream's counters (:func:`counted_upstream`). What is read after the
run is optional: a gate that died costs the run those, never its rows.
"""

from __future__ import annotations

import asyncio
import math

import httpx

from qsim import Policy
from qsim.config import ServerConfig

from .contract import Stats
from .contract_fields import num
from .lanes import Lanes
from .replay_config import ReplayConfig
from .rows import ServerInfo, server_info
from .server_facts import ServerFacts, server_facts
from .step_pages import MAX_STEP_PAGES, StepPage, page_params, step_page


async def fetch_stats(lanes: Lanes) -> tuple[dict, float]:
    """/stats, and the server's clock minus ours (NaN when it does not report ``clock``).

    The server reads its clock somewhere inside our round trip. When its
    reading is within half a round trip of our midpoint, the two are taken to
    be the same clock (one machine's CLOCK_MONOTONIC, as on loopback): offset 0.
    """
    loop = asyncio.get_running_loop()
    before = loop.time()
    response = await lanes.send(lanes.request("GET", "/stats"))
    after = loop.time()
    if response.status_code != 200:
        raise ValueError(f"GET /stats answered HTTP {response.status_code}")
    stats = response.json()
    # the contract's reading (ValueError when /stats is not it)
    clock = num(Stats.model_validate(stats).clock)
    offset = clock - (before + after) / 2
    return stats, (0.0 if abs(offset) <= (after - before) / 2 else offset)


async def fetch_steps(lanes: Lanes, since: float) -> StepPage:
    """A batching server's steps woken for at ``since`` or later (its clock):
    :class:`qsim.runfile.LoggedStep`'s fields each (/stats' step_log, page after page), and the step
    models it took among them, each after the steps before it counted from the first
    (:func:`qsim.runfile.batch_step_columns`)."""
    steps, models, cursor = [], [], None
    for _ in range(MAX_STEP_PAGES):
        asked = lanes.request("GET", "/stats", params=page_params(since, cursor))
        response = await lanes.send(asked)
        page = step_page(response.status_code, response.json())
        models += [[len(steps) + after, *fields] for after, *fields in page.models]
        steps += page.steps
        cursor = page.next
        if cursor is None:
            return StepPage(steps, None, models)
    raise ValueError(f"GET /stats?steps_since=: more than {MAX_STEP_PAGES} pages of steps")


async def step_log(lanes: Lanes, since: float) -> tuple[StepPage | None, str | None]:
    """:func:`fetch_steps`, or None and why not. The step log is optional data (qlab compare
    replays with it): a gate that died, hung up or answered nonsense after the run costs the run
    its steps, never its rows."""
    try:
        return await fetch_steps(lanes, since), None
    except (httpx.HTTPError, OSError, ValueError) as exc:
        return None, f"the gate's step log was not read ({type(exc).__name__}: {exc})"[:300]


def counted_upstream(start: dict | None, end: dict | None, zero: float) -> dict | None:
    """The upstream's own counters (/stats' upstream_counters) at the run's start and end, for the
    run's metadata: what vLLM counted over the run (its preemptions too) beside the rows, each
    reading's ``read_at`` (gate clock) also as ``read_s`` on the run's clock (``zero``: the gate's
    clock at the run's time 0). None where either /stats lacks them (an upstream without vLLM's
    counters, another engine, a failed read at the end)."""
    said = [None if s is None else Stats.model_validate(s).upstream_counters for s in (start, end)]
    if None in said:
        return None
    return {
        at: {**c.model_dump(), "read_s": c.read_at - zero} for at, c in zip(("start", "end"), said)
    }


async def stats_at_end(lanes: Lanes) -> dict | None:
    """/stats after the run, or None: optional data (the upstream's counters), as the step log is:
    a gate that died or answered nonsense after the run costs the run nothing else."""
    try:
        return (await fetch_stats(lanes))[0]
    except (httpx.HTTPError, OSError, ValueError):
        return None


async def read_server(lanes: Lanes, cfg: ReplayConfig) -> tuple[dict | None, float, ServerFacts]:
    """/stats (None: the server is not a qlab gate, which only ``--api openai`` may replay against),
    the clocks' offset, and what prompts depend on (/healthz's tokenizer and context, /stats' prompt
    caps)."""
    try:
        stats, offset = await fetch_stats(lanes)
        server_info(stats)  # a qlab gate's /stats says which policy it runs
    except (httpx.HTTPError, ValueError) as exc:
        if cfg.api == "qlab":
            raise ValueError(f"{cfg.url}: cannot read the server's /stats: {exc}") from None
        return None, math.nan, ServerFacts()
    try:
        response = await lanes.send(lanes.request("GET", "/healthz"))
        health = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        health = None
    return stats, offset, server_facts(health, stats)


def bare_server_info() -> ServerInfo:
    """What a run against a server that is not a qlab gate records of it: nothing is known (no
    policy: the deadline where the trace has none is :class:`qsim.Policy`'s default, 2 s)."""
    return ServerInfo(ServerConfig(Policy("unknown")), model_known=False)
