"""What clients do besides sending: how long they wait (patience) and when they send again
(retries).

Both are the client's side of a run, the same for the simulator (:func:`qsim.model.simulate`) and
the live replayer (:mod:`live.loadgen`), so that a live run with impatient, retrying clients
compares with the simulator request by request:

* :class:`Patience`: seconds a client waits for its answer to start, or for the whole answer, drawn
  per request (exponential, deterministic, lognormal, or a trace file's ``patience_s`` column). It
  counts from the request's *first* send: a client that retries does not start its patience over.
* :class:`RetryPolicy`: which answers are retried (503 and 429, and optionally a connection error;
  never a 4xx for bad input), after what delay (immediate, fixed, exponential backoff with jitter
  and a cap, or the server's Retry-After), at most how many attempts, within what budget.
* :class:`Retrier`: the state machine, clock-free like :class:`qsim.queue.AdmissionQueue`: its
  driver tells it that an attempt ended (at what time, with what status and Retry-After) and it
  answers when to send the next attempt, or why not. Jitter comes from a uniform that depends only
  on (seed, request, attempt), so the simulator and the replayer draw the same delay for the same
  attempt.

The retry budget is Finagle's (``RetryBudget``: retries may add at most ``budget`` times the first
tries of the last ``budget_window_s`` seconds, plus a reserve of ``budget_min_per_s`` per second),
shared by every client of a workload, as one SDK instance's budget is shared by its callers.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, fields

import numpy as np

from .outcomes import ANSWERED, NEVER_SERVABLE, Outcome, Reason
from .policy import RATE_LIMITED

PATIENCE = ("none", "exponential:MEAN_S", "deterministic:SECONDS", "lognormal:MEAN_S:CV", "column")
#: What a patience waits for: the answer's start (patience while waiting, Erlang A's), or the whole
#: answer.
PATIENCE_UNTIL = ("answer", "start")
RETRY_MODES = ("none", "immediate", "fixed", "exponential")
RETRY_AFTER = ("honour", "ignore")
#: Reason of an attempt whose client stopped waiting for it (RetryPolicy.timeout_s); outcome
#: abandoned.
TIMEOUT_REASON = Reason.CLIENT_TIMEOUT
#: Statuses a client retries: the service is overloaded (503) or this client sent too much (429).
RETRY_STATUSES = (503, 429)


def status_of(outcome: str, reason: str | None) -> int | None:
    """The HTTP status the gate answers an attempt with (None: no answer, the client left).

    Refusals and drops at the front are 503, except a client's own rate limit (429); an engine
    failure or stall is 500; a run stopped at its deadline 504. The live gate's handlers say the
    same (tests compare them per row).
    """
    if outcome in ANSWERED:
        return 200
    if outcome == Outcome.REJECTED:
        return 429 if reason == RATE_LIMITED else 400 if reason in NEVER_SERVABLE else 503
    if outcome == Outcome.EXPIRED:
        return 503
    if outcome == Outcome.ERROR:
        return 500
    # stopped in service at its deadline: too late, like a gateway's timeout
    if outcome == Outcome.CANCELLED:
        return 504
    return None


def _positive_number(value: str, what: str, spec: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"bad patience {spec!r}: {what} {value!r} is not a number") from None
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"bad patience {spec!r}: {what} must be a positive number of seconds")
    return x


@dataclass(frozen=True)
class Patience:
    """How long each client waits: a distribution of seconds, drawn per request, and what it waits
    for.

    kind: "none" (forever), "exponential" (mean ``mean_s``), "deterministic" (``mean_s`` each),
    "lognormal" (mean ``mean_s``, coefficient of variation ``cv``) or "column" (a trace file's
    ``patience_s``). until: "answer" (the client hangs up at that time, waiting or in service) or
    "start" (it hangs up only if its request has not started by then).
    """

    kind: str = "none"
    mean_s: float = math.inf
    cv: float = 0.0
    until: str = "answer"

    def __post_init__(self) -> None:
        if self.kind not in ("none", "exponential", "deterministic", "lognormal", "column"):
            raise ValueError(
                f"unknown patience distribution {self.kind!r}; expected one of "
                f"{', '.join(PATIENCE)}"
            )
        if self.until not in PATIENCE_UNTIL:
            raise ValueError(
                f"patience until must be one of {', '.join(PATIENCE_UNTIL)}, got {self.until!r}"
            )
        drawn = self.kind in ("exponential", "deterministic", "lognormal")
        if drawn and not (self.mean_s > 0 and math.isfinite(self.mean_s)):
            raise ValueError(
                f"{self.kind} patience needs a positive mean in seconds, got {self.mean_s}"
            )
        if not (self.cv >= 0 and math.isfinite(self.cv)) or (
            self.kind == "lognormal" and self.cv == 0
        ):
            raise ValueError(
                "patience cv must be a finite number > 0 for lognormal (>= 0 "
                f"otherwise), got {self.cv}"
            )

    @classmethod
    def parse(cls, spec: str, until: str = "answer") -> "Patience":
        """'none' | 'exponential:MEAN_S' | 'deterministic:SECONDS' | 'lognormal:MEAN_S:CV' |
        'column'."""
        kind, *args = str(spec).strip().split(":")
        arity = {"none": 0, "column": 0, "exponential": 1, "deterministic": 1, "lognormal": 2}
        if kind not in arity or len(args) != arity[kind]:
            raise ValueError(f"bad patience {spec!r}; expected one of {', '.join(PATIENCE)}")
        mean = _positive_number(args[0], "mean", spec) if args else math.inf
        cv = _positive_number(args[1], "cv", spec) if len(args) > 1 else 0.0
        return cls(kind, mean, cv, until)

    @property
    def spec(self) -> str:
        """The text :meth:`parse` reads back."""
        if self.kind in ("none", "column"):
            return self.kind
        return f"{self.kind}:{self.mean_s:g}" + (
            f":{self.cv:g}" if self.kind == "lognormal" else ""
        )

    def draw(self, rng: np.random.Generator, n: int, column=None) -> np.ndarray:
        """Each of n requests' patience in seconds (inf: none), one draw each in request order from
        ``rng``.

        column: the trace file's ``patience_s`` (NaN or inf: that request waits forever), for
        "column".
        """
        if self.kind == "none":
            return np.full(n, math.inf)
        if self.kind == "column":
            if column is None:
                raise ValueError("patience 'column' needs a trace file with a patience_s column")
            values = np.asarray(column, dtype=float)
            return np.where(np.isnan(values), math.inf, values)
        if self.kind == "exponential":
            return self.mean_s * rng.standard_exponential(n)
        if self.kind == "deterministic":
            return np.full(n, self.mean_s)
        sigma2 = math.log1p(self.cv**2)
        return rng.lognormal(math.log(self.mean_s) - sigma2 / 2, math.sqrt(sigma2), n)


@dataclass(frozen=True)
class RetryPolicy:
    """When a client sends a request again.

    mode: "none" (never), "immediate" (at once), "fixed" (after ``delay_s``) or "exponential"
    (after ``delay_s`` x 2^(retry - 1), at most ``cap_s``). jitter in [0, 1] takes each such delay d
    down to a uniform in [d (1 - jitter), d]: 1 is AWS's "full jitter". retry_after: "honour" waits
    the server's Retry-After where it gave one, stretched by a uniform factor in [1, 1 +
    retry_after_jitter] (never sooner than told), "ignore" uses the delay above. max_attempts counts
    the first. budget: retries at most this share (0 to 1) of the first tries sent in the last
    budget_window_s seconds, plus budget_min_per_s x budget_window_s (Finagle's reserve); None: no
    budget. timeout_s: seconds an attempt waits for its whole answer before the client hangs up
    (None: no limit), as an SDK's request timeout; the attempt ends ``abandoned`` (reason
    client_timeout) and, having had no answer, is retried when on_connection_errors is set (the
    openai SDK retries timeouts). on_connection_errors: retry an attempt that got no answer (a
    refused or reset connection, a timeout).
    """

    mode: str = "none"
    delay_s: float = 1.0
    cap_s: float = 30.0
    jitter: float = 0.0
    retry_after: str = "honour"
    retry_after_jitter: float = 0.0
    max_attempts: int = 3
    budget: float | None = None
    budget_window_s: float = 10.0
    budget_min_per_s: float = 0.0
    on_connection_errors: bool = True
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"retry {what}")

        need(
            self.mode in RETRY_MODES,
            f"mode must be one of {', '.join(RETRY_MODES)}, got {self.mode!r}",
        )
        need(
            self.retry_after in RETRY_AFTER,
            f"retry_after must be one of {', '.join(RETRY_AFTER)}, got {self.retry_after!r}",
        )
        for name in (
            "delay_s",
            "cap_s",
            "budget_window_s",
            "budget_min_per_s",
            "retry_after_jitter",
        ):
            value = getattr(self, name)
            need(
                isinstance(value, (int, float)) and value >= 0 and math.isfinite(value),
                f"{name} must be a finite number >= 0, got {value!r}",
            )
        need(self.budget_window_s > 0, "budget_window_s must be > 0")
        need(
            isinstance(self.jitter, (int, float)) and 0 <= self.jitter <= 1,
            f"jitter must be in [0, 1], got {self.jitter!r}",
        )
        need(
            isinstance(self.max_attempts, int)
            and not isinstance(self.max_attempts, bool)
            and self.max_attempts >= 1,
            f"max_attempts must be a whole number >= 1, got {self.max_attempts!r}",
        )
        need(
            self.budget is None
            or (isinstance(self.budget, (int, float)) and 0 <= self.budget <= 1),
            f"budget must be a share of first tries in [0, 1], got {self.budget!r}",
        )
        need(
            isinstance(self.on_connection_errors, bool),
            "on_connection_errors must be true or false",
        )
        need(
            self.timeout_s is None
            or (
                isinstance(self.timeout_s, (int, float))
                and self.timeout_s > 0
                and math.isfinite(self.timeout_s)
            ),
            f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}",
        )

    @classmethod
    def from_table(cls, table: dict) -> "RetryPolicy":
        """From a config file's table or the command line's options (unknown keys are an error)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(
                f"unknown retry setting {unknown[0]!r}; the settings are {', '.join(sorted(known))}"
            )
        args = dict(table)
        if (
            "max_attempts" in args
            and isinstance(args["max_attempts"], float)
            and args["max_attempts"].is_integer()
        ):
            args["max_attempts"] = int(args["max_attempts"])
        return cls(**args)

    @property
    def retries(self) -> bool:
        return self.mode != "none" and self.max_attempts > 1

    def retryable(self, status: int | None) -> bool:
        return status in RETRY_STATUSES or (status is None and self.on_connection_errors)

    def delay(self, retry: int, u: float) -> float:
        """Seconds before retry number ``retry`` (from 1), with the jitter uniform ``u`` in [0,
        1)."""
        if self.mode == "immediate":
            return 0.0
        d = (
            self.delay_s
            if self.mode == "fixed"
            else min(self.cap_s, self.delay_s * 2.0 ** (retry - 1))
        )
        return d * (1.0 - self.jitter * u)


def uniform(seed: int, request: int, attempt: int) -> float:
    """The jitter uniform of one attempt: the same in every executor, whatever order attempts end
    in."""
    return random.Random(f"qlab-retry:{seed}:{request}:{attempt}").random()


@dataclass(frozen=True)
class Decision:
    """What a client does after an attempt: send again at ``at_s`` (None: stop), and why it
    stops."""

    at_s: float | None
    why: str  # "retry", or why not: answered, left, not_retryable, exhausted, patience, budget


class Retrier:
    """The clients of one run: after each attempt, whether and when its request is sent again.

    first_sends: every request's first send time, sorted (the trace's arrivals), which the budget
    counts; seed: the jitter's. Clock-free: every call carries its time, and the driver calls
    :meth:`after` in the order attempts end (the budget's state depends on it).
    """

    def __init__(self, policy: RetryPolicy, first_sends, seed: int = 0) -> None:
        self.policy = policy
        self.first_sends = np.asarray(first_sends, dtype=float)
        self.seed = int(seed)
        # times at which retries were granted, within the window
        self.granted: deque[float] = deque()
        self.denied_by_budget = 0

    def after(
        self,
        request: int,
        attempt: int,
        first_sent_s: float,
        now: float,
        status: int | None,
        retry_after_s: int | None = None,
        patience_s: float = math.inf,
    ) -> Decision:
        """Attempt ``attempt`` (from 1) of ``request`` ended at ``now`` with ``status`` (None: no
        answer; a client that left is not asked) and the server's Retry-After (None: none given)."""
        p = self.policy
        if status is not None and 200 <= status < 300:
            return Decision(None, "answered")
        if not p.retries or not p.retryable(status):
            return Decision(None, "not_retryable")
        if attempt >= p.max_attempts:
            return Decision(None, "exhausted")
        u = uniform(self.seed, request, attempt)
        if p.retry_after == "honour" and retry_after_s is not None and retry_after_s >= 0:
            wait = retry_after_s * (1.0 + p.retry_after_jitter * u)
        else:
            wait = p.delay(attempt, u)
        at = now + wait
        if at >= first_sent_s + patience_s:
            return Decision(None, "patience")
        if p.budget is not None and not self._budget_allows(now):
            self.denied_by_budget += 1
            return Decision(None, "budget")
        return Decision(at, "retry")

    def _budget_allows(self, now: float) -> bool:
        p = self.policy
        since = now - p.budget_window_s
        while self.granted and self.granted[0] <= since:
            self.granted.popleft()
        lo, hi = np.searchsorted(self.first_sends, (since, now), side="right")
        firsts = int(hi - lo)
        if len(self.granted) + 1 > p.budget * firsts + p.budget_min_per_s * p.budget_window_s:
            return False
        self.granted.append(now)
        return True
