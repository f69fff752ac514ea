"""A simulated run, :func:`simulate`: a trace through a server (or a fleet) on SimPy's clock.

The queue core holds every piece of queue state and applies the rules; the one driver
(:class:`qsim.driver.Simulation`) only turns its answers into SimPy events. Its arrival process
walks the trace and hands each request to the core; its engine part (:func:`engine_part`:
engines one at a time, :mod:`qsim.run_one_at_a_time`, or a batching engine's steps,
:mod:`qsim.run_batching`) runs what the core starts and hands it back. Beside the study's model
it can simulate what the live gate meets:

* engine failures (``failed``): the run holds the engine for its time, ends
  as an error and teaches the speed tracker nothing;
* what the engine reports (``reported_s``): the tracker learns this, while the
  engine is held for ``true_service_s`` (the live gate counts the engine busy
  until the answer is handed back to it, a little after the engine's own time);
* clients that leave (``cancel_after_s``, by default the trace's ``patience_s``):
  a waiting request leaves the queue with its work; a running one leaves its
  engine busy until it finishes. The patience counts to the whole answer
  (``cancel_until="answer"``, the default) or only to its start
  (``cancel_until="start"``: a client whose request has started stays, the
  patience-while-waiting of Erlang A and M/M/c+D);
* clients that send again (``retry``, a :class:`qsim.clients.RetryPolicy`): an
  attempt refused (503, 429) is sent again when :class:`qsim.clients.Retrier`
  says, as a new row (``attempt`` 2, 3, ... with its ``first_request_id``) that
  arrives like any other. Patience counts from the first send;
* requests that stop early (the trace's ``tokens_generated``): the engine takes
  their true time, and the policy's estimator (:mod:`qsim.estimators`) learns
  from the tokens each completion generated, as the gate's does;
* a machine whose speed changes (``speed_schedule``): a run takes its true time
  times the schedule's speed at its start, over the trace's own speed;
* cancelling at the deadline (``Policy.cancel_at_deadline``): a run that would pass
  its request's deadline is cut there (outcome ``cancelled``), freeing its engine;
* stalled engines (``stall``): a request that runs past its threshold ends as
  an error at that moment, and while every engine is stalled a watchdog ends
  waiting requests past their deadline, every ``watch_interval_s`` as the gate's does.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .clients import Retrier, RetryPolicy
from .config import ServerConfig, StallRule, as_config  # noqa: F401 (StallRule: re-exported)
from .driver import DOWN_REASON, FAILED_REASON, LEFT_REASON, Simulation  # noqa: F401 (re-exported)
from .fleet import FleetSpec
from .policy import Policy
from .routers import RoundRobin, Router
from .run_batching import BatchingRun
from .run_one_at_a_time import OneAtATimeRun
from .service import SpeedSchedule
from .trace import Trace

#: What a client's patience (``cancel_after_s``) waits for: its answer to start, or all of it.
CANCEL_UNTIL = ("answer", "start")


def engine_part(config: ServerConfig) -> type:
    """The engine part of :class:`qsim.driver.Simulation` that runs ``config``'s engine model."""
    return BatchingRun if config.batching else OneAtATimeRun


def _check_tokens(trace: Trace) -> None:
    """A trace's token identities (Trace.tokens) must be as long as its prompts: a prefix cache
    hashes the one and the engine computes the other."""
    if len(trace.tokens) != len(trace):
        raise ValueError(f"trace tokens: {len(trace.tokens)} for {len(trace)} requests")
    for i, (tokens, prompt) in enumerate(zip(trace.tokens, trace.prompt_tokens.tolist())):
        if sum(length for _, length in tokens.prompt) != prompt:
            raise ValueError(
                f"request {i}: its tokens' segments do not add up to its {prompt} prompt tokens"
            )


def simulate(
    trace: Trace,
    config: ServerConfig | Policy = ServerConfig(),
    engines: int | None = None,
    *,
    failed=None,
    reported_s=None,
    cancel_after_s=None,
    cancel_until: str | None = None,
    priority=None,
    client=None,
    retry: RetryPolicy | None = None,
    retry_seed: int | None = None,
    retrier: Retrier | None = None,
    speed_schedule: SpeedSchedule | None = None,
    step_times=None,
    held: bool = False,
    replicas: int = 1,
    router: Router | None = None,
    replica_speeds=None,
    replica_down=(),
    admission_at: str = "replica",
    replica_drain=(),
    replica_kv_blocks=None,
) -> pd.DataFrame:
    """Run ``trace`` through a server and return one record per request (see :mod:`qsim.records`).

    config: the server (:class:`qsim.config.ServerConfig`: policy, engine model, calibration, speed
    tracking, stall rule), or a bare Policy on ``engines`` engines (default 1) with the rest at its
    defaults. The rest are the run's inputs, per request in trace order: failed (bools), reported_s
    (the engine's own seconds, which the tracker learns; default the true service time),
    cancel_after_s (seconds after arrival at which the client leaves; NaN or inf: never; default the
    trace's patience_s), priority (ints, higher first under a priority discipline) and client (any
    hashable; the policy's per-client token bucket and fair share count by it); priority and client
    default to the trace's own. cancel_until: what the patience cancel_after_s waits for, "answer"
    (the client leaves at that time whether its request waits or runs) or "start" (it leaves only if
    its request has not started by then: patience while waiting); default what the trace's patience
    was drawn for (its meta's patience_until), else "answer". Either way a client that leaves ends
    its request ``abandoned`` (reason client_left). retry: how clients send refused requests again
    (None or mode "none": never); each attempt is a row, with ``attempt`` and ``first_request_id``.
    retry_seed: the jitter's seed (default the trace's seed). retrier: the clients' state machine
    itself, in place of one built from ``retry`` (``qlab compare`` passes one that hears each answer
    when the live client did). speed_schedule: the machine's speed over time
    (:class:`qsim.service.SpeedSchedule`, base = the trace's speed): each run takes its true time x
    the speed at its start / base. step_times: a batching engine's steps as a live run's took them,
    in order (``qlab compare``'s replay): (seconds from an idle engine's wake to the step's start,
    seconds the step ran, seconds the speed tracker learns, and optionally the step model the live
    gate planned with from the next step on, or None) each; the steps after the last take the step
    model's. held: the true times are what each run held its engine live, the engines' slowdown
    (:attr:`qsim.engines.OneAtATime.concurrency`) already in them: the core still slows its
    estimates as the gate's did, the runs are not slowed again.
    replicas: N copies of the server (a fleet, :mod:`qsim.fleet`), each its own line, engines
    and admission, behind ``router`` (:mod:`qsim.routers`; required where N > 1); 1 (the default):
    the one server, whatever the router. Each row's ``replica`` says where it went. Replicas
    are one-at-a-time engines or batching engines, as ``config``'s engine is; behind router
    ``central`` they share one line, each request bound where it starts (:mod:`qsim.batch_fleet`
    for batching replicas; engines one at a time are one line of N x K engines, which takes no
    replica speeds and no replica down).
    replica_speeds: each replica's speed over the server's (0.5: its runs, or its steps, take
    twice as long; its speed tracker learns so); None: all as calibrated.
    replica_down: failures, (replica, from_s, to_s) each: at from_s what runs there ends
    ``error`` (engine_exception) and what waits there ``error`` (shutting_down); the router sends
    nothing there until to_s.
    replica_drain: drains, (replica, from_s, to_s) each: the router sends nothing there from
    from_s until to_s (as while down), while what the replica holds at from_s, running or waiting
    in its line, runs to its end there as any other.
    replica_kv_blocks: each batching replica's KV memory in blocks (its engine's kv_blocks: its
    batch, preemption and prefix cache, and what the routers read of its KV use, at that size);
    None: all the engine's.
    admission_at: where a fleet admits (:attr:`qsim.fleet.FleetSpec.admission`): "replica" (the
    default), each replica on its own state after routing; "gate", one admission on the fleet's
    state before routing (:mod:`qsim.gate_view`).
    The frame's ``attrs`` carry the run's duration_s, policy, engines and final speed factor
    (a batching engine's: its steps run too, all replicas' in a fleet);
    with a prefix cache (:attr:`qsim.engines.Batching.prefix_caching`), its counters too:
    prefix_cache_queries, prefix_cache_hits (in tokens, as vLLM's) and prefix_cache_evictions.
    """
    if isinstance(config, Policy):
        config = ServerConfig(config, 1 if engines is None else engines)
    elif engines is not None:
        raise ValueError("engines come from the ServerConfig; pass them there")
    config = as_config(config)
    if cancel_until is None:
        cancel_until = trace.meta.get("patience_until", "answer")
    if cancel_after_s is None:
        cancel_after_s = trace.patience_s
    if cancel_until not in CANCEL_UNTIL:
        raise ValueError(
            f"cancel_until must be one of {', '.join(CANCEL_UNTIL)}, got {cancel_until!r}"
        )
    if len(trace) and np.any(np.diff(trace.arrival_s) < 0):
        raise ValueError("trace arrivals must be sorted by time")
    for name, values in (
        ("failed", failed),
        ("reported_s", reported_s),
        ("cancel_after_s", cancel_after_s),
        ("priority", priority),
        ("client", client),
    ):
        if values is not None and np.shape(values) != (len(trace),):
            raise ValueError(
                f"{name} must have one value per request ({len(trace)}), got shape "
                f"{np.shape(values)}"
            )
    if retrier is None and retry is not None and retry.retries:
        seed = trace.meta.get("seed", 0) if retry_seed is None else retry_seed
        retrier = Retrier(retry, trace.arrival_s, seed)
    if config.batching and (failed is not None or reported_s is not None):
        raise ValueError(
            "failures and reported times are per run: a batching engine's steps have neither here"
        )
    if trace.tokens is not None:
        _check_tokens(trace)
    if step_times is not None and not config.batching:
        raise ValueError(
            "step_times are a batching engine's steps: this server runs engines one at a time"
        )
    fleet = _fleet(
        replicas,
        router,
        config,
        replica_speeds,
        replica_down,
        admission_at,
        replica_drain,
        replica_kv_blocks,
    )
    run = Simulation(
        trace,
        config,
        engine_part(config),
        fleet=fleet,
        step_times=step_times,
        failed=failed,
        reported_s=reported_s,
        cancel_after_s=cancel_after_s,
        cancel_until=cancel_until,
        priority=priority,
        client=client,
        retrier=retrier,
        speed_schedule=speed_schedule,
        held=held,
    )
    run.arrivals()
    run.env.run()
    frame = run.frame(trace)
    frame.attrs.update(
        duration_s=trace.duration_s,
        policy=config.policy.name,
        engines=config.engines,
        speed_factor=run.speed_factor(),
    )
    if fleet is not None:
        frame.attrs.update(replicas=fleet.replicas, router=fleet.router.name)
    if config.batching:  # the simulator's unit of work (benchmarks/bench_fleet.py counts by it)
        frame.attrs["steps"] = run.engine.steps_run
    if config.batching and config.engine.prefix_caching:  # vLLM's counters, for a run's summary
        frame.attrs.update(run.queue.prefix_cache_stats())
    return frame


def _fleet(
    replicas: int,
    router: Router | None,
    config: ServerConfig,
    speeds=None,
    down=(),
    admission: str = "replica",
    drain=(),
    kv_blocks=None,
) -> FleetSpec | None:
    """The fleet of a run (None: one server, today's path), checked against its server. One
    replica admits as the one server, wherever its admission is (refused where it is neither)."""
    plain = speeds is None and not down and not drain and kv_blocks is None
    if replicas == 1 and not isinstance(replicas, bool) and plain:
        FleetSpec(1, RoundRobin(), admission=admission)  # checks ``admission``
        return None
    if replicas == 1 and router is None:
        router = RoundRobin()  # one replica of its own speed: nothing to route
    fleet = FleetSpec(
        replicas,
        router,
        speeds=None if speeds is None else tuple(speeds),
        down=tuple(tuple(w) for w in down),
        admission=admission,
        drain=tuple(tuple(w) for w in drain),
        kv_blocks=None if kv_blocks is None else tuple(kv_blocks),
    )
    fleet.check(config)
    return fleet
