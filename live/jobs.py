"""A request on its way through the gate: the job it is given (:class:`Job`), what the gate saw
when it arrived (:class:`Arrival`), and what comes back: an :class:`Answer`, or for a streamed job
its future and text pieces (:class:`StreamingJob`, ended by :data:`END`). The ways a job ends
without an answer are :mod:`live.gate_errors`'s.

What the gate reports per request is exactly what the core knew at that
moment (:class:`Arrival`, and the gate-clock times an engine took and handed
back a request), so a replay needs no information from the future.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from qsim.queue import Seen

from .engine import Asked


@dataclass(frozen=True)
class Job:
    """A prepared request. deadline_s: seconds after arrival; None takes the policy's default."""

    prompt: str
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    deadline_s: float | None = None
    # whose token bucket it draws on, where the policy limits each client
    client_id: str | None = None
    priority: int = 0  # higher first under a priority discipline
    prompt_tokens: int = 0  # counted by the engine's tokenizer: the service model's prompt term
    stream: bool = False  # the engine hands over its text piece by piece (Gate.submit_streaming)
    asked: Asked = Asked()  # what else the client asked, for an engine that takes it (live.engine)
    # The client's objectives (the x-slo-ttft-ms and x-slo-tpot-ms headers), seconds; None: not
    # given. Carried into the answer and the run file; admission does not read them (yet).
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    # The prompt as token ids, where the client sent them (its prompt_tokens is then their number):
    # what a prefix cache hashes (qsim.prefix.TokenIds); None: the engine's tokenizer's ids of the
    # text.
    prompt_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Arrival:
    """The gate's view when the request arrived (what a record's admission columns hold)."""

    at: float  # gate clock
    deadline_s: float
    seen: Seen  # what the queue core decided on (AdmissionQueue.seen)
    # The fleet's replica that decided on it (live.fleet_gate; a central queue's: where it ran;
    # None: no fleet).
    replica: int | None = None

    def numbers(self) -> dict[str, float]:
        """For answers and refusals; arrived_at lets a client put the gate's own arrival order on
        its clock. in_service_s and idle (where the core said them) complete what the admission rule
        read."""
        seen = self.seen
        said = {"in_service_s": seen.in_service_s} if math.isfinite(seen.in_service_s) else {}
        if seen.idle >= 0:
            said["idle"] = seen.idle
        if self.replica is not None:
            said["replica"] = self.replica
        return {
            "arrived_at": self.at,
            "est_service_s": seen.est_service_s,
            "deadline_s": self.deadline_s,
            "queued": seen.queued,
            "queued_work_s": seen.queued_work_s,
            "speed_factor": seen.speed_factor,
            **said,
        }


@dataclass(frozen=True)
class Answer:
    """A request the engine ran; outcome good or late by the gate's clock.

    started_at / returned_at: gate clock when the engine took it and when the gate got it back;
    the engine counted as busy in between (engine_s, the engine's own time, is a little less:
    the hand-back from the engine thread to the event loop). The tracker learned engine_s.
    """

    text: str
    tokens: int
    outcome: str
    queue_s: float
    engine_s: float
    latency_s: float
    engine: int
    arrival: Arrival
    started_at: float = math.nan
    returned_at: float = math.nan
    # the engine's own seconds to its first token, where it sees that
    first_token_s: float | None = None
    # the engine's own count of the prompt (an upstream's usage), where it says
    prompt_tokens: int | None = None
    replica: int | None = None  # the fleet's replica that ran it (None: no fleet)
    # Of its prompt, the tokens its first scheduling found in the prefix cache (vLLM's
    # num_cached_tokens); None: no prefix cache.
    cached_prompt_tokens: int | None = None


#: The last item of a streamed job's pieces: its future is done (answered, failed, or cancelled).
END = object()


@dataclass(frozen=True)
class StreamingJob:
    """A streamed job: its future (as :meth:`live.gate.Gate.submit`'s) and the text pieces the
    engine produces.

    ``pieces`` holds each piece as it comes, then :data:`END` once the future is done; what came
    after (an engine still going after a cut) is never read. An engine without ``emit`` puts no
    piece.
    """

    future: asyncio.Future
    pieces: asyncio.Queue
