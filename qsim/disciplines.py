"""Queue disciplines: the order in which waiting requests are started.

A discipline is what :class:`qsim.queue.AdmissionQueue` keeps its waiting
requests in. It holds the queue's entries (:class:`qsim.entry.Entry`: ``req,
arrived_at, base_s, deadline_s, priority, client, work``, read by name), and
answers five things: ``push(entry)``,
``pop_next(now)`` (the entry to start next), ``remove(entry)`` (a client
left), ``len()`` and iteration. A discipline may also say that the entry it
just popped is to be dropped unrun: ``drop_reason(entry, now, est_s)``
returning a reason (CoDel does); the queue then ends it as ``expired``. And
it may want to hear of every start, including a request that went straight
onto an idle engine without waiting: ``started(entry)`` (fair share does).

Non-preemptive, all of them: a started request runs to its end. Cancellation
is rare, so ``remove`` may take linear time; push and pop may not.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque

from .outcomes import Reason

#: Reason of a request CoDel dropped at the front.
CODEL_REASON = Reason.CODEL


class Fifo(deque):
    """First come, first served: the study's discipline."""

    push = deque.append

    def pop_next(self, now: float):
        return self.popleft()


class Lifo(deque):
    """Last come, first served: under overload the newest request, which can still make its
    deadline, goes first."""

    push = deque.append

    def pop_next(self, now: float):
        return self.pop()


class AdaptiveLifo(deque):
    """FIFO while the queue is short, LIFO once it holds ``threshold`` or more (Facebook's adaptive
    LIFO): a short queue is served fairly, a long one sheds its oldest requests' chances instead of
    everyone's."""

    push = deque.append

    def __init__(self, threshold: int = 8) -> None:
        super().__init__()
        if threshold < 1:
            raise ValueError(f"adaptive LIFO threshold must be >= 1, got {threshold}")
        self.threshold = threshold

    def pop_next(self, now: float):
        return self.pop() if len(self) >= self.threshold else self.popleft()


class Keyed:
    """A heap ordered by ``key(entry)``, ties broken by arrival order: subclass it and give
    ``key``."""

    def __init__(self) -> None:
        self._heap: list = []
        self._seq = itertools.count()

    def key(self, entry) -> tuple:
        raise NotImplementedError

    def push(self, entry) -> None:
        heapq.heappush(self._heap, (*self.key(entry), next(self._seq), entry))

    def pop_next(self, now: float):
        return heapq.heappop(self._heap)[-1]

    def remove(self, entry) -> None:
        for n, item in enumerate(self._heap):
            if item[-1] is entry:
                self._heap[n] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError("entry is not waiting")

    def work_before(self, entry) -> float:
        """Calibrated work waiting that would start before ``entry`` if it arrived now and nobody
        else came: every entry of a key no greater (ties go to the earlier arrival). Linear in the
        queue."""
        # An item (*key, order, entry) is below (*mine, inf) exactly when its key is no greater than
        # mine: the comparison ends at the order at the latest, without slicing each item's key out
        # (once per arrival).
        bound = (*self.key(entry), math.inf)
        return sum(item[-1].base_s for item in self._heap if item < bound)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (item[-1] for item in self._heap)


class Edf(Keyed):
    """Earliest deadline first (absolute deadline: arrival + its deadline)."""

    def key(self, entry) -> tuple:
        return (entry.arrived_at + entry.deadline_s,)


class ShortestFirst(Keyed):
    """Shortest estimated job first (by the calibrated estimate: the speed factor scales all
    alike)."""

    def key(self, entry) -> tuple:
        return (entry.base_s,)


class Priority(Keyed):
    """Priority classes, non-preemptive: a higher ``priority`` first; FIFO or EDF inside a class."""

    def __init__(self, within: str = "fifo") -> None:
        super().__init__()
        if within not in ("fifo", "edf"):
            raise ValueError(
                f"priority classes order within a class by fifo or edf, got {within!r}"
            )
        self.within = within

    def key(self, entry) -> tuple:
        return (
            (-entry.priority, entry.arrived_at + entry.deadline_s)
            if self.within == "edf"
            else (-entry.priority,)
        )

    # Admission sees the classes: a request waits only behind its own class and those above it, so a
    # high class is not refused for a queue of low ones (future arrivals of higher classes aside).
    ahead_s = Keyed.work_before


class CoDel(Fifo):
    """FIFO with CoDel's drop rule at the front (Nichols and Jacobson, 2012).

    When the time a request waited (its sojourn) has stayed above ``target_s``
    for at least ``interval_s``, CoDel enters a dropping state and drops the
    front request, then the next after interval / sqrt(count) and so on, until
    a sojourn falls below the target. Defaults are scaled to this workload (a
    2 s deadline, requests of 0.01 to 0.55 s): on the reference mix at load 1.3,
    100 ms and 0.5 s gave 70 % in time against 13 % for 0.5 s and 2 s, and 1 %
    without a rule. Dropping only at the front, CoDel cannot shed half the
    arrivals at load 2 without an admission rule beside it.
    """

    def __init__(self, target_s: float = 0.1, interval_s: float = 0.5) -> None:
        super().__init__()
        for name, value in (("target_s", target_s), ("interval_s", interval_s)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"CoDel {name} must be a positive number of seconds, got {value}")
        self.target_s, self.interval_s = target_s, interval_s
        self._first_above = math.nan  # when the sojourn has been above target long enough to act
        self._dropping = False
        self._count = 0
        self._drop_next = math.inf

    def drop_reason(self, entry, now: float, est_s: float) -> str | None:
        sojourn = now - entry.arrived_at
        if sojourn < self.target_s or not self:  # below target, or the queue has drained behind it
            self._first_above = math.nan
            self._dropping = False
            return None
        if math.isnan(self._first_above):
            self._first_above = now + self.interval_s
            return None
        if not self._dropping:
            if now < self._first_above:
                return None
            self._dropping, self._count = True, 1
            self._drop_next = now + self.interval_s / math.sqrt(self._count)
            return CODEL_REASON
        if now >= self._drop_next:
            self._count += 1
            self._drop_next = now + self.interval_s / math.sqrt(self._count)
            return CODEL_REASON
        return None


class FairShare:
    """Fair share across clients: a virtual token counter (VTC; Sheng et al., "Fairness in Serving
    Large Language Models", OSDI 2024), non-preemptive.

    Each client has a counter of the service it has been given (its requests' calibrated estimates,
    which are linear in tokens), charged whenever one of its requests starts, from the queue or
    straight onto an idle engine (the queue calls :meth:`started`). The backlogged client with the
    least is served next, FIFO within a client. A client that comes back after an idle spell has its
    counter lifted to the least among those waiting (or, when none waits, to the counter of the last
    one served), so it cannot bank credit while away and then hold the engines as long. Requests
    without a client share the client ``None``. So a light client is served before a heavy one
    whatever their arrival order, and backlogged clients get equal service whatever their rates.
    Choosing the next client looks at each backlogged client once: linear in clients, not requests.

    Admission sees this order: :meth:`ahead_s` is the work a new request would wait behind, so a
    light client's request is not refused for a queue the heavy client built (with FIFO's estimate
    it would be, and fair service behind a predictive gate would change nothing).
    """

    def __init__(self) -> None:
        self._queues: dict = {}  # backlogged client -> its waiting entries, oldest first
        self.counter: dict = {}  # client -> service given so far (seconds of calibrated estimate)
        self._floor = 0.0  # the counter of the last client served, before its charge
        # the entry pop_next just gave out (its client was lifted when it joined)
        self._popped = None
        self._n = 0

    def _joining(self, client) -> float:
        """The counter ``client`` has when it joins the backlogged: its own, lifted to the least
        among those waiting (or, when none waits, to the counter of the last one served)."""
        lift = min(map(self.counter.__getitem__, self._queues)) if self._queues else self._floor
        return max(self.counter.get(client, 0.0), lift)

    def _lift(self, client) -> None:
        self.counter[client] = self._joining(client)

    def push(self, entry) -> None:
        client = entry.client
        queue = self._queues.get(client)
        if queue is None:
            self._lift(client)
            queue = self._queues[client] = deque()
        queue.append(entry)
        self._n += 1

    def pop_next(self, now: float):
        # min() keeps the first of equal counters: the client backlogged longest.
        client = min(self._queues, key=self.counter.__getitem__)
        queue = self._queues[client]
        entry = self._popped = queue.popleft()
        if not queue:
            del self._queues[client]
        self._n -= 1
        return entry

    def ahead_s(self, entry) -> float:
        """Calibrated work that would start before a request of ``client`` arriving now, if nobody
        else came: its own client's waiting, and from each other client what is served while that
        client's counter is below the level this request's client reaches when the request comes to
        its head (on a tie the client that has waited longer goes first, as in :meth:`pop_next`).
        Sums are taken in the order the counters are charged, so the answer is exact, not a bound
        (tests/test_queue.py checks it)."""
        client = entry.client
        own = self._queues.get(client)
        level = self.counter[client] if own else self._joining(client)
        ahead = 0.0
        for waiting in own or ():
            ahead += waiting.base_s
            level += waiting.base_s
        # the other client has waited longer than this one (it comes first in the dict)
        first = True
        for other, queue in self._queues.items():
            if other == client:
                first = False
                continue
            given = self.counter[other]
            for waiting in queue:
                if given > level or (given == level and not first):
                    break
                given += waiting.base_s
                ahead += waiting.base_s
        return ahead

    def started(self, entry) -> None:
        """Charge the client of a request that starts (popped, or straight onto an idle engine)."""
        client = entry.client
        if entry is not self._popped:  # it never waited: it joins as a returning client would
            self._lift(client)
        self._popped = None
        self._floor = self.counter[client]
        self.counter[client] += entry.base_s

    def remove(self, entry) -> None:
        queue = self._queues[entry.client]
        queue.remove(entry)
        if not queue:
            del self._queues[entry.client]
        self._n -= 1

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return (entry for queue in self._queues.values() for entry in queue)


#: Disciplines by the name a policy gives (``Policy.discipline``), each with its default parameters.
DISCIPLINES = {
    "fifo": Fifo,
    "lifo": Lifo,
    "adaptive-lifo": AdaptiveLifo,
    "edf": Edf,
    "sjf": ShortestFirst,
    "priority": Priority,
    "priority-edf": lambda: Priority("edf"),
    "codel": CoDel,
    "fair": FairShare,
}
