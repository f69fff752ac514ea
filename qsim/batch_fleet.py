"""A central queue in front of batching replicas: one line, and each request bound to a replica
only when that replica can take it into its batch (late binding).

Under ``--batching --router central`` (:class:`qsim.routers.Central`) a fleet (:mod:`qsim.fleet`)
is N batching replicas, each its own :class:`~qsim.batch.BatchQueue` (batch, KV blocks, prefix
cache, step model, speed), behind one line: the Gateway API inference extension's flow control,
which holds requests at the gateway and dispatches one only when a replica has room for it. The
replicas are the batching core itself (:class:`Replica` only says where its line is), so early
binding (every other router) and late binding run through the same stepping code on the same trace.

* **Admission** is the cluster gate's: one :class:`~qsim.admission.Admission` for the fleet (the
  policy, its estimator, which learns from every replica's completions, the token buckets, the
  reserve, the shedding draw). It decides on the fleet's state: the requests and prompt tokens
  waiting anywhere in the fleet (the line, and what each replica preempted), and the projection
  of the replica the request would bind to: the one with room where it binds at once, else the
  one whose own projection gives the earliest wait with its share of the line ahead of it (the
  line split between the replicas up by their tracked speeds, 1 / speed factor each: a replica
  twice as fast takes twice the share).
* **The line** is the policy's discipline, with a head of its own for a request pulled and not
  fitting yet (as a batching engine's own). A replica's own line holds only what it preempted:
  vLLM puts a preempted request back in that engine's waiting queue, so it stays bound.
* **Binding.** An arrival that finds the line empty and a replica with room (a free seat and the
  blocks of its first chunk, nothing preempted waiting there) joins that replica's batch at once;
  of several, the one with the fewest seats taken (a step's time grows with its sequences, so that
  batch steps soonest), ties to the lowest index: deterministic. Else it waits, and each replica,
  whenever it plans a step, takes from the line's head as vLLM's scheduler takes from its waiting
  queue (its own preempted first; a seat, the blocks for the first chunk, the token budget): a
  request binds to the replica that frees room first. A replica between steps with a free seat is
  woken whenever the head may have changed (taken, put back, gone), so none sits with room for the
  head while it waits (tests/test_batch_central.py checks it at every step).
* **Replicas of their own KV sizes** (``FleetSpec.kv_blocks``): each replica's memory, preemption
  and prefix cache are its own size; the gate refuses a request the smallest could never hold.
* **A replica down** (``FleetSpec.down``) fails what is bound to it (its batch and its preempted,
  as under early binding) and takes nothing from the line until it is back; what waits in the line
  is not bound anywhere and waits on for the others.
* **A replica draining** (``FleetSpec.drain``) takes nothing from the line until its window ends,
  while what is bound to it (its batch, its preempted) runs to its end there.

With one replica the fleet is the one batching server, record for record.
"""

from __future__ import annotations

import math
from collections import deque
from functools import partial
from typing import Callable

from .batch import BatchQueue, _Seq
from .config import ServerConfig
from .fleet import Fleet, FleetSpec

__all__ = ["CentralBatch", "Replica"]


class Replica(BatchQueue):
    """A batching replica behind a :class:`CentralBatch`: it takes its requests from the fleet's
    line when it plans a step; its own line holds only what it preempted (bound here: started).
    ``share``: of the fleet's line, the part an arrival's projection here counts ahead of it."""

    def __init__(self, central: "CentralBatch", index: int, config: ServerConfig, **hooks) -> None:
        super().__init__(config, **hooks)
        self.central, self.index = central, index
        self.share = 1.0
        # Each start, here or on another replica, is the line's discipline's to hear (fair share).
        self._started = getattr(central.waiting, "started", None)

    @staticmethod
    def _bound(seq: _Seq) -> bool:
        return seq.start == seq.start  # it has started here (NaN: never)

    def _pull(self, now: float) -> _Seq | None:
        """Its own preempted first, then the fleet's line (nothing of it while down)."""
        central = self.central
        if self.front or not central.up[self.index]:
            return super()._pull(now)
        if central.front:
            seq = central.front.popleft()
            self._out_of_line(seq)
            return seq
        return self._next_waiting(now, central.waiting, central.seq_of, central.drop_reason)

    def _requeue(self, seq: _Seq) -> None:
        if self._bound(seq):
            super()._requeue(seq)
        else:  # from the fleet's line, not fitting here: back at its head, bound nowhere
            self.central.front.appendleft(seq)
            self._into_line(seq)

    def _into_line(self, seq: _Seq) -> None:
        if self._bound(seq):
            super()._into_line(seq)
        else:
            seq.in_line = True
            seq.hold = self._holds(seq)
            self.central.books(seq.prompt, seq.hold)

    def _out_of_line(self, seq: _Seq) -> None:
        if seq.in_line and not self._bound(seq):
            seq.in_line = False
            self.central.books(-seq.prompt, -seq.hold)
        else:
            super()._out_of_line(seq)

    def _join(self, seq: _Seq, now: float, blocks: int, hit=()) -> None:
        fresh = not self._bound(seq)
        super()._join(seq, now, blocks, hit)
        if fresh:
            self.central.where[seq.entry.req] = self

    def _next_step(self, now: float) -> None:
        super()._next_step(now)
        self.central.dispatch(now, self)

    def _line(self) -> tuple:
        central, share = self.central, self.share
        queued, hold, tokens = central.line_queued, central.line_hold, central.line_tokens
        if share != 1.0:
            queued, hold, tokens = int(queued * share), hold * share, tokens * share
        return self.queued + queued, self.line_hold + hold, self.line_tokens + tokens

    def _ahead(self) -> list:
        central, share = self.central, self.share
        line = [*central.front, *(central.seq_of[id(e)] for e in central.waiting)]
        if share != 1.0:  # every (1 / share)-th: its share, spread over the line's mix
            n = len(line)
            line = [line[min(n - 1, int((j + 1) / share) - 1)] for j in range(int(n * share))]
        return [*self.front, *line]


class CentralBatch(Fleet):
    """N batching replicas behind one line (see the module), answering its driver
    (:mod:`qsim.model`) as :class:`~qsim.fleet.Fleet` does. ``line(r, config, make)``: replica
    r's queue core, built by ``make`` (a :class:`Replica` of this fleet) with the driver's hooks.
    """

    binds_late = True

    def __init__(
        self,
        config: ServerConfig,
        spec: FleetSpec,
        *,
        line: Callable,
        routed: Callable | None = None,
    ) -> None:
        self.waiting = config.policy.make_discipline()
        self.drop_reason = getattr(self.waiting, "drop_reason", None)
        self.seq_of: dict = {}  # id(entry) -> its sequence, while in the discipline's line
        self.front: deque[_Seq] = deque()  # pulled by a replica, not fitting there yet
        self.line_tokens = self.line_hold = 0
        super().__init__(
            config, spec, routed=routed, line=lambda r, cfg: line(r, cfg, partial(Replica, self, r))
        )
        admission = self.lines[0].admission
        for replica in self.lines[1:]:
            replica.admission = admission  # the cluster gate's, one for the fleet
        # The line may bind a request to any replica: the gate refuses what the smallest KV memory
        # could never hold (bound where it cannot fit, it would be preempted over and over).
        self.smallest = min(self.lines, key=lambda replica: replica.kv_cap)

    # -- the line's books ----------------------------------------------------------------

    def books(self, tokens: int, hold: int) -> None:
        """A request into (or, negative, out of) the line: its prompt tokens and seat-steps."""
        self.line_tokens += tokens
        self.line_hold += hold

    @property
    def line_queued(self) -> int:
        return len(self.front) + len(self.waiting)

    @property
    def queued(self) -> int:
        """Requests waiting anywhere in the fleet: the line, and each replica's preempted."""
        return self.line_queued + sum(replica.queued for replica in self.lines)

    @property
    def queued_tokens(self) -> int:
        return self.line_tokens + sum(replica.line_tokens for replica in self.lines)

    # -- events ----------------------------------------------------------------------

    def arrive(
        self,
        req,
        now: float,
        base_est_s: float,
        deadline_s: float | None = None,
        priority: int = 0,
        client=None,
        work=None,
    ):
        """Admit ``req`` at the fleet's gate (the refusal, or None): into a replica's batch at
        once where the line is empty and one has room, else into the line."""
        first = self.lines[0]  # what is the same on every replica: the admission, the config
        seq = first._arrival(req, now, base_est_s, deadline_s, priority, client, work)
        admission = first.admission
        never = self.smallest._never(seq)
        if never is not None:
            admission.seen_numbers = (
                math.nan,
                self.queued,
                math.nan,
                first.tracker.factor,
                math.nan,
                -1,
            )
            return never
        up = [replica for replica, ok in zip(self.lines, self.up) if ok]
        room = None
        if not self.line_queued:
            room = min(
                (q for q in up if not q.queued and q._has_room(seq)),
                default=None,
                key=lambda q: q._seats_taken(),
            )
        if room is not None:
            line, view = room, room._projection(seq, now, True)
        else:
            line, view = self._nearest(up, seq, now)
        view = view._replace(queued=self.queued, queued_tokens=self.queued_tokens)
        refusal = admission.admit(now, seq.entry, line.tracker.factor, view)
        if refusal is not None:
            return refusal
        if room is not None:
            room._take(seq, now)
            room._kick(now)
            return None
        self.seq_of[id(seq.entry)] = seq
        self.waiting.push(seq.entry)
        first._into_line(seq)  # the line's books: it is bound nowhere yet
        for replica in up:
            replica._kick(now)  # an idle one plans a step (none has room for it: see dispatch)
        return None

    def _nearest(self, up: list, seq: _Seq, now: float) -> tuple:
        """(the replica whose projection gives ``seq`` the earliest wait, that projection), each
        replica counting its share of the line ahead (by 1 / its speed factor; ties: the
        lowest)."""
        inverse = [1.0 / replica.tracker.factor for replica in up]
        total = sum(inverse)
        best = None
        for replica, v in zip(up, inverse):
            replica.share = v / total
            view = replica._projection(seq, now, False)
            if best is None or view.wait_s < best[1].wait_s:
                best = (replica, view)
        return best

    def dispatch(self, now: float, planned: Replica | None = None) -> None:
        """While the line waits, wake each replica up and between steps (but ``planned``, which
        just took what it could) that could take its head: room for the head pulled already, or
        a free seat where the discipline's next is not pulled yet (woken, it pulls it)."""
        if not self.line_queued:
            return
        head = self.front[0] if self.front else None
        for replica, ok in zip(self.lines, self.up):
            if not ok or replica is planned or replica.plan is not None or replica.waking:
                continue
            if (
                replica._has_room(head)
                if head is not None
                else replica._seats_taken() < replica.engine.max_num_seqs
            ):
                replica._kick(now)

    def cancel(self, req, now: float):
        if self.lines[0]._leave_line(req, self.front, self.waiting, self.seq_of):
            self.dispatch(now)  # a new head, which may fit where the last did not
            return "waiting"
        line = self.where.get(req)
        return None if line is None else line.cancel(req, now)

    def _settle(self, r: int, now: float | None) -> None:
        super()._settle(r, now)
        if now is not None:
            self.dispatch(now)  # back up (not down, not draining), it may take the line's head

    def audit(self) -> None:
        """The line's books against its requests, and each replica's (BatchQueue.audit);
        AssertionError naming what is off. For tests."""
        line = [*self.front, *(self.seq_of[id(e)] for e in self.waiting)]
        assert sum(s.prompt for s in line) == self.line_tokens, "prompt tokens of the line"
        assert sum(s.hold for s in line) == self.line_hold, "seat-steps of the line"
        assert not any(Replica._bound(s) for s in line), "a request bound and in the line"
        for replica in self.lines:
            replica.audit()
