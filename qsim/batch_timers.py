"""The batching core's events between steps: a client leaving (:meth:`Timers.cancel`), the cut
of joined requests at their deadline, and the front end's intake and streaming
(:class:`qsim.engines.FrontEnd`), which :meth:`Timers.next_timer` and :meth:`Timers.timer` tell
the driver of and handle.

:class:`Timers` is a part of :class:`qsim.batch.BatchQueue` (its base), as
:class:`qsim.batch_projection.Projections` and :class:`qsim.batch_prefix.PrefixCache` are: it works
on the queue's line, batch, cut heap and front end's heaps; the queue calls it where a request
finishes in a step (``_drain``) and its drivers call ``cancel``, ``next_timer`` and ``timer``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from .outcomes import CANCELLED
from .queue import CUT_REASON


class Timers:
    """The events between steps of :class:`qsim.batch.BatchQueue` (see the module); ``seq`` is one
    of its sequences (``qsim.batch._Seq``)."""

    def cancel(self, req, now: float) -> str | None:
        """The client of ``req`` left: "waiting" (it left the line), "running" (it left the batch:
        its blocks are free for the next step), or None (it had ended)."""
        if self._leave_line(req, self.front, self.waiting, self.seq_of):
            return "waiting"
        for seq in self.running.values():
            if seq.entry.req == req:
                self._leave(seq)
                if self.plan is None:
                    self._next_step(now)
                return "running"
        for _, _, seq in self.delivering:
            if seq.draining and seq.entry.req == req:
                self._undrain(seq)
                seq.alive = False
                self._kick(now)
                return "running"
        return None

    def _leave_line(self, req, front: deque, waiting, seq_of: dict) -> bool:
        """``req`` out of a line (``front``, then the discipline's ``waiting``): False if not
        there."""
        for seq in front:
            if seq.entry.req == req:
                front.remove(seq)
                break
        else:
            entry = next((e for e in waiting if e.req == req), None)
            if entry is None:
                return False
            waiting.remove(entry)
            seq = seq_of.pop(id(entry))
        self._out_of_line(seq)
        seq.alive = False
        return True

    # -- timers: cutting at the deadline -----------------------------------------------

    def next_timer(self) -> float:
        """When the core next needs to be told the time (a joined request's deadline, where the
        policy cuts there; with a front end, an intake done or tokens delivered); inf: never."""
        cuts = self.cuts
        while cuts and not cuts[0][2].alive:
            heapq.heappop(cuts)
        due = cuts[0][0] if cuts else math.inf
        if self.fe is None:
            return due
        intake, delivering = self.intake, self.delivering
        while intake and not intake[0][2].alive:
            heapq.heappop(intake)
        while delivering and not delivering[0][2].draining:
            heapq.heappop(delivering)
        return min(
            due, intake[0][0] if intake else math.inf, delivering[0][0] if delivering else math.inf
        )

    def timer(self, now: float) -> None:
        """Time ``now`` has come: cut the joined requests whose deadline it is (outcome cancelled),
        in the batch or preempted and waiting to join again; with a front end, end those whose last
        token has reached the client and let in those whose intake is done."""
        if self.fe is not None:
            self._front_end_timer(now)
        cuts = self.cuts
        while cuts and (not cuts[0][2].alive or cuts[0][0] <= now):
            due, _, seq = heapq.heappop(cuts)
            if not seq.alive:
                continue
            if seq.in_line:
                self.front.remove(seq)
                self._out_of_line(seq)
                seq.alive = False
            elif seq.draining:
                self._undrain(seq)
                seq.alive = False
            else:
                self._leave(seq)
            # One that joined after its deadline (it waited past it) is cut as it joins, as an
            # engine run one at a time cuts it as it starts: never before its start.
            self._end(seq.entry.req, max(due, seq.start), CANCELLED, CUT_REASON, self._stats(seq))
        self._kick(now)

    # -- the front end (qsim.engines.FrontEnd) ---------------------------------------------

    def _seats_taken(self) -> int:
        """Seats held: the batch's, and those whose last tokens are still being streamed."""
        return len(self.running) + self.draining

    def _fe_job(self, now: float, cost: float) -> float:
        """A job of ``cost`` seconds for the front end's FIFO core from ``now``: when it is done (a
        job of no cost is none: it waits for nothing)."""
        if cost <= 0:
            return now
        self.fe_free = max(self.fe_free, now) + cost
        return self.fe_free

    def _front_end_timer(self, now: float) -> None:
        delivering = self.delivering
        while delivering and delivering[0][0] <= now:
            at, _, seq = heapq.heappop(delivering)
            if seq.draining:  # else its client left, or it was cut, meanwhile
                self._undrain(seq)
                self._done(seq, at)
        intake = self.intake
        while intake and intake[0][0] <= now:
            heapq.heappop(intake)  # it computes from the next step, which the kick plans

    def _drain(self, seq, delivered: float) -> None:
        seq.draining = True
        self.draining += 1
        heapq.heappush(self.delivering, (delivered, seq.order, seq))

    def _undrain(self, seq) -> None:
        seq.draining = False
        self.draining -= 1
