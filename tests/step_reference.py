"""Continuous batching in discrete steps, written plainly and apart from qsim, as a reference for
the batching engine.

The model of ``qlab theory``'s batching rows: requests without a prompt, each generating its own
number of tokens; a step with m running takes a + b m seconds and gives each of them one token; a
request that arrives during a step joins at the step's end (the first K present run, the rest wait
in FIFO order); an arrival to an idle engine starts a step at once. tests/test_validation.py checks
that qsim's batching engine gives these sojourn times request by request; run as a script, it
measures how far the steps put the mean time in system from processor sharing's E[S] / (1 - rho) for
equal lengths, where no exact chain is at hand (docs/simulate.md, "Engines that share"):

    .venv/bin/python tests/step_reference.py
"""

from __future__ import annotations

import sys
from collections import deque

import numpy as np


def sojourns(arrival_s, tokens, a: float, b: float, max_running: int | None = None) -> np.ndarray:
    """Each request's time in system (finish - arrival), in arrival order."""
    arrival, left = list(map(float, arrival_s)), list(map(int, tokens))
    cap = len(arrival) if max_running is None else max_running
    out = np.full(len(arrival), np.nan)
    now, nxt, running, line = 0.0, 0, [], deque()
    while nxt < len(arrival) or running or line:
        if not running and not line:
            now = max(now, arrival[nxt])  # idle: the next arrival starts a step
        while nxt < len(arrival) and arrival[nxt] <= now:
            line.append(nxt)
            nxt += 1
        while line and len(running) < cap:
            running.append(line.popleft())
        now += a + b * len(running)
        for i in running:
            left[i] -= 1
            if left[i] == 0:
                out[i] = now - arrival[i]
        running = [i for i in running if left[i]]
    return out


def ps_gap(
    tokens: int, rho: float = 0.3, requests: int = 1_000_000, seed: int = 1
) -> tuple[float, float]:
    """Relative gap of the mean time in system from processor sharing (a = 0, b = 1 / tokens, so
    E[S] = 1 s) for ``tokens`` tokens each, and its standard error (batch means over 50 batches);
    the first 2 % left out."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rho, requests))
    t = sojourns(arrival, np.full(requests, tokens), 0.0, 1 / tokens)[requests // 50 :]
    batches = t[: len(t) // 50 * 50].reshape(50, -1).mean(axis=1)
    ps = 1 / (1 - rho)
    return float(t.mean() / ps - 1), float(batches.std(ddof=1) / np.sqrt(50) / ps)


if __name__ == "__main__":
    for n in map(int, sys.argv[1:] or ("5", "20", "50")):
        gap, se = ps_gap(n)
        print(
            f"{n} tokens each: W {gap:+.2%} from processor sharing (standard error {se:.2%})",
            flush=True,
        )
