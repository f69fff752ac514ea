"""Open-loop replay of a qsim trace against the live service.

Request i is sent at its scheduled time whatever happened to the others: a
dispatcher starts one asyncio task per request at its time on a shared start
clock and never waits for answers. The client never queues a request itself
(a connection of its own for every request in flight, see :class:`live.lanes.Lanes`), so
any waiting the rows show happened in the service, which is what we study.

Every request ends in exactly one row of qsim's schema (:mod:`qsim.records`),
even when the server dies: a transport failure is outcome ``error`` (the rows
themselves are built by :mod:`live.rows`).

Clients give up and retry as the simulator's do (:mod:`live.loadgen_clients`, which sends every
attempt). The run's parts: its configuration (:mod:`live.replay_config`), the requests' prompts and
bodies (:mod:`live.replay_bodies`), the connections (:mod:`live.lanes`), and what is read of the
server before and after (:mod:`live.replay_server`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import secrets
import sys
from contextlib import contextmanager

import numpy as np
import pandas as pd

from qsim import Trace
from qsim.prefix import SEGMENTS
from qsim.runfile import ClientSettings, batch_step_columns

from . import openai_replay
from .contract import Stats
from .lanes import Lanes, peak_simultaneous, raise_fd_limit, warm_up
from .replay_bodies import Api, GivenPrompts, payloads, plan_prompts, report_prompts, warn_counting
from .loadgen_clients import Clients, check_patience
from .replay_config import ReplayConfig
from .replay_server import bare_server_info, counted_upstream, read_server, stats_at_end, step_log
from .rows import server_info, to_frame


async def replay_async(
    trace: Trace, cfg: ReplayConfig, given: GivenPrompts | None = None, progress=None
) -> pd.DataFrame:
    """Send every request of ``trace`` at its time (and its retries at theirs); return one validated
    row per attempt. ``given``: each request's own prompt text, sent as it is. ``progress``: a tqdm
    bar to show attempts answered and sent as the run goes (None: none)."""
    if len(trace) == 0:
        raise ValueError("the trace has no requests")
    if given is not None and len(given.texts) != len(trace):
        raise ValueError(f"{len(given.texts)} prompt texts for {len(trace)} requests")
    if np.any(np.diff(trace.arrival_s) < 0):
        raise ValueError("trace arrivals must be sorted by time")
    check_patience(trace)
    seed = int(trace.meta.get("seed", 0)) if cfg.retry_seed is None else int(cfg.retry_seed)
    clients = ClientSettings(cfg.retry, seed, str(trace.meta.get("patience_until", "answer")))
    raise_fd_limit(len(trace) + 64)
    api = Api(
        None
        if cfg.api == "qlab"
        else openai_replay.choose_model(cfg.url, cfg.model, min(cfg.timeout_s, 30.0))
    )
    async with Lanes(cfg) as lanes:
        stats, offset, facts = await read_server(lanes, cfg)
        info = server_info(stats) if stats is not None else bare_server_info()
        plan = plan_prompts(trace, cfg, facts, given)
        # a run's own salt: a server that ran the trace before has none of its prompts cached
        bodies = payloads(trace, cfg, plan, given, salt=secrets.randbits(31))
        if given is not None:
            warn_counting(given, facts)
        # Requests are built (JSON encoded) and connections opened before the clock starts:
        # at send time only the send is left.
        requests = [None if b is None else api.request(lanes, b) for b in bodies]
        await warm_up(
            lanes,
            min(peak_simultaneous(trace.arrival_s), cfg.max_warm_connections),
            "/healthz" if cfg.api == "qlab" else openai_replay.MODELS,
        )
        with _frozen_heap():
            t0 = asyncio.get_running_loop().time() + cfg.lead_s  # the trace's time 0
            run = Clients(lanes, trace, bodies, cfg.retry, seed, t0, api)
            with _ticking(run, progress):
                exchanges = await run.run(requests, trace.arrival_s.tolist())
        # A batching server's steps since the run's time 0, for the replay (qlab compare), on the
        # run's clock.
        batching = stats is not None and info.config.batching
        steps, lost = await step_log(lanes, t0 + offset) if batching else (None, None)
        counts = stats is not None and Stats.model_validate(stats).upstream_counters is not None
        upstream = (
            counted_upstream(stats, await stats_at_end(lanes), t0 + offset) if counts else None
        )
    frame = to_frame(trace, exchanges, info, plan.tokens, server_zero=t0 + offset, clients=clients)
    if steps is not None:
        zero = t0 + offset
        frame = frame.assign(
            **batch_step_columns(
                [[w - zero, b - zero, e - zero, *rest] for w, b, e, *rest in steps.steps],
                len(frame),
                steps.models,
            )
        )
    first = frame["first_request_id"].to_numpy()
    frame["prompt_capped"] = plan.capped[first]
    # what a prefix cache shared of the prompts sent as token ids, for the replay (qlab compare)
    frame[SEGMENTS] = plan.segment_specs()[first]
    # never sent: no lateness to speak of
    frame.loc[plan.unfit[first], "send_lateness_s"] = math.nan
    meta = {
        "url": cfg.url,
        "trace": trace.name,
        "trace_meta": _plain(trace.meta),
        "duration_s": trace.duration_s,
        "clock_offset_s": offset,
        "retry": None if cfg.retry is None else dataclasses.asdict(cfg.retry),
        "retry_seed": seed,
        **plan.meta(),
    }
    if upstream is not None:
        meta["upstream_counters"] = upstream
    # Said in the file and once on stderr: a reader of the run knows why it has no steps.
    if lost is not None:
        meta["warnings"] = [lost]
        print(f"qlab replay: warning: {lost}; the rows are written without it", file=sys.stderr)
    if cfg.slo is not None:
        frame = cfg.slo.columns(frame)
    if api.model is not None:
        # Time to the first and the last piece of text, client-measured from the send (NaN: no text
        # came, or not a stream), and the pieces: what analysis.latency reads TTFT, ITL and TPOT
        # from.
        frame["ttft_s"] = np.array([ex.first_token_s - ex.sent_s for ex in exchanges], dtype=float)
        frame["last_token_s"] = np.array(
            [ex.last_token_s - ex.sent_s for ex in exchanges], dtype=float
        )
        frame["pieces"] = np.array([ex.pieces for ex in exchanges], dtype=np.int64)
        frame["api"] = pd.array(["openai"] * len(frame), dtype="string")
        frame["qlab_gate"] = stats is not None
        meta.update(api="openai", model=api.model, qlab_gate=stats is not None)
    frame.attrs["qlab_run"] = meta
    report_prompts(plan, len(trace))
    warn_if_late(frame, cfg.late_warn_s)
    return frame


def replay(
    trace: Trace, cfg: ReplayConfig, given: GivenPrompts | None = None, progress=None
) -> pd.DataFrame:
    """Synchronous :func:`replay_async`."""
    return asyncio.run(replay_async(trace, cfg, given, progress))


#: How often the bar is redrawn. From a task of its own rather than at each answer: the sends keep
#: their schedule, and a terminal is written twice a second at most.
TICK_S = 0.5


@contextmanager
def _ticking(run: Clients, bar):
    """Redraw ``bar`` from ``run``'s counts every TICK_S while the block runs, and once at its
    end."""
    if bar is None or bar.disable:
        yield
        return

    def draw() -> None:
        bar.n = run.ended
        bar.set_postfix_str(f"sent {run.sent}", refresh=False)
        bar.refresh()

    async def tick() -> None:
        while True:
            await asyncio.sleep(TICK_S)
            draw()

    task = asyncio.ensure_future(tick())
    try:
        yield
    finally:
        task.cancel()
        draw()
        bar.close()  # its line ended before the run's warnings (report_prompts, warn_if_late)


def _plain(meta: dict) -> dict:
    """Trace metadata as JSON-able scalars (numpy numbers become Python ones)."""
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in meta.items()}


@contextmanager
def _frozen_heap():
    """Keep the collector off the objects that exist before the replay.

    A full collection walks every object of pandas, numpy and pyarrow (and the
    prepared requests): 30-70 ms during which no request leaves. Frozen, they
    are skipped; the replay's own garbage is still collected.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# ---------------------------------------------------------------- lateness


def lateness(frame: pd.DataFrame, retries: bool = False) -> dict[str, float]:
    """p50, p99 and max of how late the sends left, in seconds: of the first attempts (the open
    loop's schedule), or with ``retries`` of the retries alone (NaN where there were none)."""
    late = frame["send_lateness_s"]
    if "attempt" in frame.columns:
        late = late[frame["attempt"].gt(1) == retries]
    elif retries:
        late = late.iloc[:0]
    return {
        "p50_s": float(late.quantile(0.5)),
        "p99_s": float(late.quantile(0.99)),
        "max_s": float(late.max()),
    }


def warn_if_late(frame: pd.DataFrame, threshold_s: float) -> bool:
    """Say on stderr when sends left late: the replay was then not the open loop it claims to be."""
    if frame.empty:
        return False
    late = lateness(frame)
    if late["p99_s"] <= threshold_s:
        return False
    print(
        f"qlab replay: WARNING: sends ran late: p99 {late['p99_s'] * 1e3:.1f} ms, max "
        f"{late['max_s'] * 1e3:.1f} ms "
        f"behind schedule (threshold {threshold_s * 1e3:.0f} ms); the client, not the service, "
        "delayed these "
        "requests",
        file=sys.stderr,
    )
    return True
