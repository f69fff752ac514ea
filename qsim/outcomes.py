"""The vocabulary of how a request ends: its outcome and the reason, in one place.

Both are :class:`enum.StrEnum`, so a member *is* its string: it compares equal to it,
prints as it, goes into pandas, parquet and JSON as it, and a record written before
this module existed reads the same. The queue core, the records, the HTTP layer, the
comparison and the analysis all spell an outcome or a reason through these names.
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """How a request (attempt) ended: exactly one per row of :mod:`qsim.records`."""

    # answered, and every objective it had was met (its deadline; TTFT and TPOT where set)
    GOOD = "good"
    LATE = "late"  # answered, but an objective was missed
    REJECTED = "rejected"  # refused at arrival
    EXPIRED = "expired"  # dropped unrun when it reached the front
    ERROR = "error"  # an engine failed or stalled, or a transport or server failure
    ABANDONED = "abandoned"  # its client left before the answer
    CANCELLED = "cancelled"  # stopped in service when its deadline passed


class Reason(StrEnum):
    """Why a request was refused, dropped or ended (a record's ``reason``; NA for an answer)."""

    # Refused at arrival (outcome rejected), in the order the rules are checked.
    RATE_LIMITED = "rate_limited"  # its client is over its own rate (HTTP 429)
    SHED = "shed"  # sheddable (priority below 0) and the service is loaded
    QUEUE_FULL = "queue_full"  # too many waiting (bounded; vLLM's max_num_queued_reqs)
    TOKENS_QUEUED = "tokens_queued"  # too many tokens waiting (vLLM's max_num_queued_tokens)
    WORK_LIMIT = "work_limit"  # too much estimated work waiting
    # its estimated wait and service pass an objective
    DEADLINE_UNREACHABLE = "deadline_unreachable"
    # its KV blocks cannot be had in time for its deadline (admission by memory)
    KV_FULL = "kv_full"
    # no state of the engine could ever serve it (its prompt exceeds what a step or the KV takes)
    TOO_LARGE = "too_large"
    # Dropped at the front (outcome expired).
    CANNOT_FINISH = "cannot_finish"  # it could not finish by its deadline even if started now
    CODEL = "codel"  # CoDel's sojourn rule
    # Ended in or by the engine.
    ENGINE_EXCEPTION = "engine_exception"
    ENGINE_STALLED = "engine_stalled"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    DEADLINE_PASSED = "deadline_passed"  # cut in service at its deadline (outcome cancelled)
    # The client's side.
    CLIENT_LEFT = "client_left"  # its client hung up (outcome abandoned)
    # the retry policy's per-attempt timeout ran out (outcome abandoned)
    CLIENT_TIMEOUT = "client_timeout"
    # a live replayer did not send it: its new tokens fill the context
    PROMPT_CANNOT_FIT = "prompt_cannot_fit"
    # The gate's words for its HTTP answers (the record keeps the core's reason).
    # refused, and no queue state could answer it in time (HTTP 400)
    DEADLINE_TOO_SHORT = "deadline_too_short"
    # the server stopped while it waited (outcome error; a fleet: its replica went down)
    SHUTTING_DOWN = "shutting_down"


#: Every outcome, in the schema's order.
OUTCOMES: tuple[Outcome, ...] = tuple(Outcome)
# The members as plain module names, for the paths that run once per request: an enum member read
# through its class (Outcome.GOOD) costs ten times a module global on Python 3.11.
GOOD, LATE, REJECTED, EXPIRED, ERROR, ABANDONED, CANCELLED = OUTCOMES
#: The outcomes of a request the engine answered.
ANSWERED: tuple[Outcome, ...] = (Outcome.GOOD, Outcome.LATE)
#: Reasons a request can be refused at arrival, in the order they are checked. rate_limited is a
#: client over its own rate (HTTP 429); the others are the service over capacity (HTTP 503).
REJECT_REASONS: tuple[Reason, ...] = (
    Reason.RATE_LIMITED,
    Reason.SHED,
    Reason.QUEUE_FULL,
    Reason.TOKENS_QUEUED,
    Reason.WORK_LIMIT,
    Reason.DEADLINE_UNREACHABLE,
    Reason.KV_FULL,
)
#: Reasons of a refusal that says the request itself cannot be served (HTTP 400: a retry cannot
#: help).
NEVER_SERVABLE: tuple[Reason, ...] = (Reason.TOO_LARGE,)
