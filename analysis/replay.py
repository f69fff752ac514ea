"""A live run replayed in the simulator with what the gate knew, request by request.

**Replay** (:func:`simulate_run`). A live run (rows from ``qlab replay``) is replayed
in qsim with what the gate knew of each request at the time (the columns
:mod:`live.rows` writes), so that a disagreement measures the machine, not the
comparison:

* arrivals: the gate's (``server_arrival_s``), else the send times: in a burst
  the server takes requests in over tens of milliseconds and in an order of
  its own, and the simulator must see the order the gate saw;
* the policy, engines, stall rule, tracker weight, whether the estimate is
  fixed, and the tracker's factor at the run's start, all from the server's
  /stats (constant columns), passed to :func:`qsim.simulate` as they are;
* a request the engine took holds its engine for ``engine_returned_s -
  engine_started_s`` (what the gate counted busy: the engine's time plus the
  hand-back), and teaches the tracker ``engine_reported_s`` (what the gate's
  tracker was given); a failed run is a failure (holds its engine, teaches
  nothing, ends as an error);
* a stalled run holds its engine until that engine next took a request (the
  gate never reports the hand-back of a stalled run), or past the run's end;
* a run the gate cut at its deadline (``Policy.cancel_at_deadline``, outcome
  ``cancelled``) would have run past it: it holds its engine for its deadline plus
  its estimate, longer than any start leaves it, so the simulator cuts it too (rule ``cut``);
* the policy's estimator learns from the tokens each answered run generated (column
  ``tokens``; the limit where the run does not say), scaled by the server's own
  calibration (column ``service_model``), as the gate's did. The synthetic engine's
  speed schedule (column ``speed_schedule``, on the run's clock) is not replayed: the
  held times already carry it; :func:`analysis.prediction.predict`, which draws its service
  times, applies it;
* **a request the engine never took** (refused, dropped, or run only in the
  simulator) gets what was known at its arrival and nothing later: its
  estimate then, ``calibrated_est_s x arrival_speed_factor`` (the tracker's
  factor at its arrival; the run's initial factor where the answer did not
  say). Column ``replayed_with`` names the rule each request got.

**Clients that give up and retry** (run files of ``qlab replay`` with patience or a retry
policy; :mod:`qsim.clients`). The simulator is run with the run's retry policy and jitter
seed and each request's patience (columns ``retry_policy``, ``retry_seed``, ``patience_s``;
:func:`qsim.runfile.client_settings`): it is given the *first* attempts at the gate's arrivals
and decides the retries itself, so a retry it sends at another time, or does not send,
is a disagreement. Each request's patience runs out at the moment the live client's did
(its first send + patience, on the run's clock). A request's engine time is that of the
attempt that ran live (at most one does, unless an attempt timed out while running); one
that ran only in the simulator gets its estimate at its last live arrival. A run the
live client hung up on while it ran (the gate tells the engine to stop, and the stopped
run teaches nothing) holds its engine in the replay until the hang-up reached the gate
(the hang-up plus the run's median trip to the gate), teaching nothing: rule
``cancelled``, found by a first pass; whether it was stopped or ran to its end (and what it
taught) is read from the tracker's factor the gate reported around its end
(:class:`analysis.replay_unsaid._TrackerEvidence`). A simulated answer that would reach its
client after the live client hung up (the run's median trip back) is ``abandoned``, as live. The
replay's rows are then joined to the run's on (first_request_id, attempt) and diagnosed
(:mod:`analysis.diagnosis`).

This module runs the replay. What the gate knew and the inputs made of it are in
:mod:`analysis.replay_inputs`, the clients in :mod:`analysis.replay_clients`, and what the run
does not say (guessed arrivals, hang-ups, runs whose clients hung up) in
:mod:`analysis.replay_unsaid`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qsim.config import ServerConfig
from qsim.runfile import batch_step_times, fleet_spec

from .replay_clients import _live_retrier, _per_request, client_faults, clients_of
from .replay_inputs import (
    KEYS,
    arrival_times,
    generated_tokens,
    in_arrival_order,
    replay_inputs,
    run_setup,
    simulate_arrivals,
    trip_s,
)
from .replay_unsaid import Unsaid, _cancelled_runs, _guessed, _misplaced


def simulate_run(run: pd.DataFrame, origin: str = "server") -> pd.DataFrame:
    """qsim's rows for the run's arrivals, with the run's request ids (times on the run's clock).

    With retries the simulator gets the first attempts and its own clients send the rest; a
    simulated attempt takes the run's request_id of the same (first_request_id, attempt), and one
    the run lacks an id after the run's. Extra columns: speed_factor_at_arrival (est_service_s /
    calibrated) and replayed_with."""
    return replay(run, origin)[0]


def _base_estimates(ordered: pd.DataFrame, batching: bool) -> np.ndarray:
    """Each request's estimate before the speed factor, the divisor of its simulated factor.

    One at a time that is calibrated_est_s. A batching gate estimates with its step model (then
    x the factor), not from calibrated_est_s: its base is the live estimate over the live factor,
    and the simulated factor the live one x the ratio of the two estimates (qsim's records do not
    carry the tracker's factor): equal where the estimates are, apart where they are not."""
    base = ordered["calibrated_est_s"].to_numpy(float)
    if not batching or "arrival_speed_factor" not in ordered.columns:
        return base
    live = ordered["est_service_s"].to_numpy(float) / ordered["arrival_speed_factor"].to_numpy(
        float
    )
    return np.where(np.isfinite(live) & (live > 0), live, base)


def replay(run: pd.DataFrame, origin: str) -> tuple[pd.DataFrame, Unsaid]:
    """:func:`simulate_run`, and what it took for what the run does not say (:class:`Unsaid`).

    An attempt the gate never answered (its client hung up) has no known gate arrival: it is placed
    at its send plus the run's median trip; a client's hang-up reaches the gate that median trip
    after it. Where either puts an arrival or a departure on the wrong side of a request that came
    within the run's spread of trips of it (that request's queue at arrival, as the gate reported
    it, says so), it is moved just across and the run replayed again."""
    setup = run_setup(run)
    unsaid = Unsaid(arrival_times(run, origin).copy(), trip_s(run), {})
    guessed = _guessed(run, origin)
    moved: set = set()
    for _ in range(int(guessed.sum()) + int(run["outcome"].eq("abandoned").sum()) + 1):
        sim = _replay_once(run, setup, unsaid)
        if not _misplaced(run, sim, unsaid, guessed, moved):
            break
    return sim, unsaid


def _replay_once(run: pd.DataFrame, setup: ServerConfig, unsaid: Unsaid) -> pd.DataFrame:
    """One replay of the run with these gate arrivals and hang-ups (see :func:`simulate_run`)."""
    _, retrying = clients_of(run)
    arrival = unsaid.arrival
    first_attempts = run["attempt"].eq(1).to_numpy() if retrying else None
    ordered, first_arrival = in_arrival_order(run, arrival, first_attempts)
    if retrying:
        given = _per_request(run, replay_inputs(run, setup)).loc[ordered["request_id"].to_numpy()]
    else:
        given = replay_inputs(ordered, setup)
    if setup.batching:
        given = given.assign(replayed_with="steps")
    hold = given["hold_s"].to_numpy(float).copy()
    reported = given["reported_s"].to_numpy(float).copy()
    failed = given["failed"].to_numpy(bool).copy()
    rule = given["replayed_with"].to_numpy(object).copy()
    ids = ordered["request_id"].to_numpy()
    for j, first in enumerate(ids):
        if first in unsaid.settled:
            hold[j], reported[j], failed[j], rule[j] = unsaid.settled[first]
    # the delay from a hang-up to its engine's next start, once a pass has seen it
    usual = unsaid.usual
    # Each pass settles at least the earliest run a live client hung up on that the last one had
    # wrong (a later one's start moves with it): at most one pass per such attempt, and one to
    # confirm.
    for _ in range(int(run["outcome"].eq("abandoned").sum()) + 1):
        notice = unsaid.notice(ordered["first_request_id"])
        faults = client_faults(run, ordered, first_arrival, notice)
        retrier = _live_retrier(
            run,
            arrival,
            ordered["request_id"].to_numpy(),
            (faults["retry"], faults["retry_seed"]) if retrying else None,
            notice,
        )
        # A batching engine's steps take the run's step times, in order (the core decides the rest,
        # as live); its requests have no run time of their own.
        # Engines one at a time held their engines for the times the run says, slowdown included
        # (held).
        runs = (
            {"step_times": batch_step_times(run)}
            if setup.batching
            else {"failed": failed, "reported_s": reported, "held": True}
        )
        sim = simulate_arrivals(
            ordered,
            first_arrival,
            setup,
            hold,
            "live-arrivals",
            generated_tokens(run, ordered),
            retrier=retrier,
            fleet=fleet_spec(run),
            **runs,
            **faults,
        )
        if setup.batching or not _cancelled_runs(
            run, setup, unsaid, ordered, sim, hold, reported, failed, rule, usual
        ):
            break
    unsaid.settled = {
        first: (hold[j], reported[j], failed[j], rule[j])
        for j, first in enumerate(ids)
        if rule[j] == "cancelled"
    }
    sim_first = sim["first_request_id"].to_numpy()
    sim["first_request_id"] = ordered["request_id"].to_numpy()[sim_first]
    base = _base_estimates(ordered, setup.batching)[sim_first]
    sim["speed_factor_at_arrival"] = sim["est_service_s"].to_numpy(float) / base
    sim["replayed_with"] = rule[sim_first]
    # a request's rule is its run's: an attempt the simulator did not start held nothing
    if retrying:
        sim["replayed_with"] = sim["replayed_with"].where(
            np.isfinite(sim["start_s"].to_numpy(float)), "estimate"
        )
    ids = (
        run.set_index(KEYS)["request_id"]
        .reindex(pd.MultiIndex.from_arrays([sim["first_request_id"], sim["attempt"]]))
        .to_numpy(dtype=float, na_value=np.nan)
        .copy()
    )
    extra = np.isnan(ids)
    ids[extra] = run["request_id"].max() + 1 + np.arange(extra.sum())
    sim["request_id"] = ids.astype(np.int64)
    return sim.sort_values("request_id", ignore_index=True)
