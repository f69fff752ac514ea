"""Admission at a fleet's cluster gate (``FleetSpec(admission="gate")``): one decision on the
fleet's state, before routing.

Under ``admission="replica"`` (the default) each replica of a :class:`~qsim.fleet.Fleet` admits
what the router sends it, on its own state, with its own admission (vLLM's caps per replica). At
the gate there is one :class:`~qsim.admission.Admission` for the fleet, every replica's (one
estimator, which learns from every replica's completions, one set of token buckets, one reserve,
one shedding draw), and it decides before the router is asked: a refused request is routed
nowhere (its record's ``replica`` is -1, as a central queue's unbound) and takes no draw of the
router's. What it admits, the router routes and that replica places (starts or queues) without
deciding again. Why before routing: a gateway's flow control (the Gateway API inference
extension's, llm-d's saturation check) looks at the pool, not at the pod its scheduler will pick,
and a policy's bound then means the fleet's: a ``max_queue`` of B is B waiting in the fleet.

The view the policy reads is the fleet's, over the replicas up:

* **engines one at a time** (:func:`one_at_a_time`): the fleet as one line of all its engines,
  the view a central queue of N x K engines would give: the requests waiting and their work
  (each replica's at its own speed factor), the work left in service, the engines and the idle
  ones summed; its estimate at the replicas' mean speed factor; ``ahead_s`` (a discipline's) and
  the first-token projection of the summed numbers.
* **batching replicas** (:func:`batching`): the requests and prompt tokens waiting anywhere in
  the fleet, and the projection of the replica that would serve it soonest, as
  :class:`qsim.batch_fleet.CentralBatch`'s gate reads: a replica with room for it now (nobody
  waiting there; of several the fewest seats taken), else the one whose own projection gives the
  earliest wait. Its KV use is that replica's.

What a replica still enforces: nothing of the policy. Its line keeps its discipline (an expiry at
the front, CoDel's drops), and a batching replica its physical limits: a request no replica could
ever hold (its prompt and limit over the KV cache, or over a step without chunked prefill) is
refused at the gate as the replica would (the replicas are copies of one server; of replicas of
their own KV sizes, ``FleetSpec.kv_blocks``, the smallest up refuses), and one admitted waits for
the seat and blocks it needs where it is routed.

The idle engines the gate counts are the fleet's: a request admitted because an engine is free
somewhere starts at once where the router sends it to a free engine (jsq does while one is free;
round robin and random may send it to a busy replica, where it waits). So a fleet-wide bound of B
holds at every decision, and holds of the fleet's line at all times under a router that finds
the free engines.
"""

from __future__ import annotations

import math

from .admission import Admission, Projection
from .entry import Entry
from .policy import Rejection
from .queue import first_token_split

__all__ = ["batching", "one_at_a_time"]

_new = tuple.__new__


def one_at_a_time(
    admission: Admission,
    up: list,
    req,
    now: float,
    base_est_s: float,
    deadline_s=None,
    priority: int = 0,
    client=None,
    work=None,
) -> tuple[Rejection | None, Entry]:
    """(the gate's refusal or None, the arrival's entry) for replicas of engines one at a time
    (:class:`~qsim.queue.AdmissionQueue` each): the view of them as one line."""
    base_est_s, deadline_s, work = admission.arrival(base_est_s, deadline_s, work)
    entry = _new(Entry, (req, now, base_est_s, deadline_s, priority, client, work))
    factor = math.fsum(q.tracker.factor for q in up) / len(up)
    idle = sum(len(q.idle) for q in up)
    engines = sum(q.engines for q in up)
    queued_work = math.fsum(q.queued_work_s for q in up)
    remaining = 0.0 if idle else math.fsum(q.remaining_s(now) for q in up)
    first = up[0]
    ahead = (
        None
        if first._ahead is None or idle
        else math.fsum(q._ahead(entry) * q.tracker.factor for q in up)
    )
    est = base_est_s * factor
    ttft = tpot = math.nan
    if first._objectives:
        wait = 0.0 if idle else (queued_work + remaining) / engines
        ttft, tpot = first_token_split(first.config.model, entry, est, wait)
    view = _new(
        Projection,
        (
            sum(len(q.waiting) for q in up),
            queued_work,
            remaining,
            est,
            engines,
            idle,
            ahead,
            None,
            ttft,
            tpot,
            None,
            0.0,
            sum(q.waiting_tokens for q in up),
        ),
    )
    return admission.admit(now, entry, factor, view), entry


def batching(
    admission: Admission,
    up: list,
    req,
    now: float,
    base_est_s: float,
    deadline_s=None,
    priority: int = 0,
    client=None,
    work=None,
):
    """(the gate's refusal or None, the arrival's sequence) for batching replicas
    (:class:`~qsim.batch.BatchQueue` each): the fleet's waiting, the soonest replica's
    projection."""
    first = up[0]  # its entry is the same on every replica (only their KV sizes may differ)
    seq = first._arrival(req, now, base_est_s, deadline_s, priority, client, work)
    queued = sum(q.queued for q in up)
    # The router may place it on any replica up: refused where the smallest could never hold it.
    never = min(up, key=lambda q: q.kv_cap)._never(seq)
    if never is not None:
        admission.seen_numbers = (math.nan, queued, math.nan, first.tracker.factor, math.nan, -1)
        return never, seq
    room = min(
        (q for q in up if not q.queued and q._has_room(seq)),
        default=None,
        key=lambda q: q._seats_taken(),
    )
    if room is not None:
        line, view = room, room._projection(seq, now, True)
    else:
        line = view = None
        for q in up:
            v = q._projection(seq, now, False)
            if view is None or v.wait_s < view.wait_s:
                line, view = q, v
    view = view._replace(queued=queued, queued_tokens=sum(q.line_tokens for q in up))
    return admission.admit(now, seq.entry, line.tracker.factor, view), seq
