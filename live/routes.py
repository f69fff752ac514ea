"""The paths and headers of ``qlab serve``'s HTTP surface, named once.

Every module that serves, forwards to or calls a route reads its path here (the service in
:mod:`live.http_api` and :mod:`live.openai_api`, the upstream engine, the replayer), so that none
of them imports another for a string.
"""

from __future__ import annotations

GENERATE = "/v1/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"

#: Whose per-client limit a request counts against, where its body does not say.
CLIENT_HEADER = "x-client-id"
#: A request's deadline, in whole milliseconds, where its body does not say.
DEADLINE_HEADER = "x-request-deadline-ms"

#: What a 404 or 405 lists.
ROUTES = (
    f"POST {GENERATE}, POST {COMPLETIONS}, POST {CHAT}, GET {MODELS}, GET /stats, "
    "GET /health, GET /ready, GET /healthz, GET /metrics, GET /openapi.json (and HEAD on "
    "each GET route)"
)
#: The request's objectives, in milliseconds: time to the first token and time per output token
#: after it (the headers inference-perf and the Gateway API inference extension send).
TTFT_SLO_HEADER = "x-slo-ttft-ms"
TPOT_SLO_HEADER = "x-slo-tpot-ms"
