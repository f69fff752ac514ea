"""Latency of streamed answers, defined once: TTFT, ITL, TPOT, end-to-end latency, and goodput.

Each metric is a function of per-request arrays (times in seconds on one clock, token counts),
so a live run file, a simulated one and an imported benchmark's all go through the same
definitions; docs/metrics.md sets them beside those of vLLM's ``bench serve``, guidellm,
inference-perf and aiperf.

* **TTFT** (:func:`ttft_s`): the first piece of text received, less the send. As vLLM's ``bench
  serve``, guidellm, inference-perf and aiperf measure it (client-side, from the request's start).
* **E2E** (:func:`e2e_s`): the answer's end (``data: [DONE]``) less the send.
* **TPOT** (:func:`tpot_s`): (E2E - TTFT) / (output tokens - 1), for answers of more than one token:
  vLLM's ``bench serve`` TPOT, "time per output token, excluding the first"; guidellm calls the same
  quantity ITL (to its last token instead of the end), aiperf ITL too; inference-perf's TPOT divides
  the first-to-last-token time likewise. Not guidellm's TPOT, which divides the time to the last
  token by all the tokens, the first included (inference-perf's NTPOT is that with the end).
* **ITL** (:func:`itl_s`): the time between consecutive pieces of text of one answer, averaged over
  that answer: (last piece - first piece) / (pieces - 1), as inference-perf averages its per-request
  deltas. vLLM's ``bench serve`` pools every gap of every answer instead (its percentiles are over
  gaps, not answers); for a server that streams one token a piece, ITL's mean equals TPOT's.
* **Goodput** (:func:`good`, :func:`goodput`): requests answered that met *every* objective set for
  them, per second (DistServe, Zhong et al., OSDI 2024; vLLM's ``bench serve --goodput``, aiperf's
  ``--goodput``, inference-perf's SLOs): the deadline for E2E (qlab's own objective, always set),
  and where set (the ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` headers, ``qlab replay --slo-ttft-ms``,
  ``--slo-tpot-ms``) TTFT and TPOT. An objective is met at equality (vLLM's ``<=``); one whose value
  is unknown (an answer not streamed has no TTFT, one of one token no TPOT) is not judged, as
  :func:`qsim.records.met_objectives` judges a record's good and late (vLLM counts a one-token TPOT
  as 0).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from qsim import records
from qsim.records import ANSWERED

#: The percentiles :func:`summary` reports.
PERCENTILES = (0.5, 0.9, 0.99)


def _floats(values) -> np.ndarray:
    return np.asarray(pd.to_numeric(pd.Series(values), errors="coerce"), dtype=float)


def ttft_s(sent_s, first_token_s) -> np.ndarray:
    """Time to the first token: when the first piece of text arrived, less the send (NaN: none
    arrived)."""
    return _floats(first_token_s) - _floats(sent_s)


def e2e_s(sent_s, done_s) -> np.ndarray:
    """End-to-end latency: the answer's end less the send."""
    return _floats(done_s) - _floats(sent_s)


def tpot_s(e2e, ttft, tokens) -> np.ndarray:
    """Time per output token after the first: (E2E - TTFT) / (tokens - 1); NaN for one token or
    fewer, or where TTFT or the count is unknown."""
    tokens = _floats(tokens)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(tokens > 1, (_floats(e2e) - _floats(ttft)) / (tokens - 1), np.nan)


def itl_s(first_token_s, last_token_s, pieces) -> np.ndarray:
    """Inter-token latency of one answer: the mean gap between its consecutive pieces of text, (last
    - first) / (pieces - 1); NaN for fewer than two pieces."""
    pieces = _floats(pieces)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(
            pieces > 1, (_floats(last_token_s) - _floats(first_token_s)) / (pieces - 1), np.nan
        )


def good(
    outcome, e2e, deadline_s, ttft=None, ttft_slo_s=None, tpot=None, tpot_slo_s=None
) -> np.ndarray:
    """Which requests were answered meeting every objective set for them (DistServe's good request):
    E2E within the deadline, and TTFT and TPOT within theirs where the objective is set and the
    value known (NaN: not set, or not measured), as :func:`qsim.records.met_objectives` judges a
    record's good and late."""
    n = len(outcome)
    nothing = np.full(n, np.nan)
    frame = pd.DataFrame(
        {
            "latency_s": _floats(e2e),
            "deadline_s": _floats(deadline_s),
            "ttft_s": _floats(nothing if ttft is None else ttft),
            "ttft_slo_s": _floats(nothing if ttft_slo_s is None else ttft_slo_s),
            "tpot_s": _floats(nothing if tpot is None else tpot),
            "tpot_slo_s": _floats(nothing if tpot_slo_s is None else tpot_slo_s),
        }
    )
    answered = pd.Series(outcome).astype(object).isin(ANSWERED).to_numpy()
    return answered & records.met_objectives(frame).to_numpy(dtype=bool)


def goodput(good_rows, seconds: float) -> float:
    """Good requests per second of the run."""
    return float(np.count_nonzero(good_rows)) / seconds if seconds > 0 else math.nan


def _quantiles(values: np.ndarray) -> dict[str, float]:
    values = values[np.isfinite(values)]
    if not values.size:
        return {f"p{round(q * 100)}": math.nan for q in PERCENTILES}
    return {f"p{round(q * 100)}": float(np.quantile(values, q)) for q in PERCENTILES}


def streamed(frame: pd.DataFrame) -> pd.DataFrame:
    """The four latencies of each request of a run file, by the definitions above, from its columns:
    arrival_s (the send), finish_s, ttft_s (first piece less the send), last_token_s and pieces
    (where recorded), tokens."""
    sent = frame["arrival_s"].to_numpy(float)
    e2e = e2e_s(sent, frame["finish_s"])
    ttft = _floats(frame["ttft_s"]) if "ttft_s" in frame.columns else np.full(len(frame), np.nan)
    tokens = _floats(frame["tokens"]) if "tokens" in frame.columns else np.full(len(frame), np.nan)
    itl = (
        itl_s(sent + ttft, sent + _floats(frame["last_token_s"]), frame["pieces"])
        if {"last_token_s", "pieces"} <= set(frame.columns)
        else np.full(len(frame), np.nan)
    )
    return pd.DataFrame(
        {"ttft_s": ttft, "itl_s": itl, "tpot_s": tpot_s(e2e, ttft, tokens), "e2e_s": e2e},
        index=frame.index,
    )


def judged(frame: pd.DataFrame) -> pd.DataFrame:
    """A live run file with its schema's token columns filled from what it streamed (``ttft_s`` as
    measured, ``tpot_s`` by :func:`tpot_s`, ``output_tokens`` the server's count) and each answered
    request judged good or late by every objective it had (:func:`good`): what ``qlab replay``
    writes, where it streamed or has objectives."""
    out = frame.copy()
    metrics = streamed(out)
    out["ttft_s"] = metrics["ttft_s"].to_numpy(float)
    out["tpot_s"] = metrics["tpot_s"].to_numpy(float)
    if "tokens" in out.columns:
        out["output_tokens"] = out["tokens"]
    answered = out["outcome"].isin(ANSWERED).to_numpy()
    ok = good(
        out["outcome"],
        out["latency_s"],
        out["deadline_s"],
        out["ttft_s"],
        out["ttft_slo_s"] if "ttft_slo_s" in out.columns else None,
        out["tpot_s"],
        out["tpot_slo_s"] if "tpot_slo_s" in out.columns else None,
    )
    out["outcome"] = pd.array(
        np.where(answered, np.where(ok, "good", "late"), out["outcome"].astype(object)),
        dtype="string",
    )
    return out


def summary(frame: pd.DataFrame, seconds: float) -> dict[str, float]:
    """p50, p90, p99 of TTFT, ITL, TPOT and E2E over the answered requests of a run file, and
    goodput with its objectives (the deadline; ttft_slo_s and tpot_slo_s where the run file has
    them)."""
    metrics = streamed(frame)
    answered = frame["outcome"].isin(ANSWERED).to_numpy()
    out: dict[str, float] = {}
    for name in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        for q, v in _quantiles(metrics.loc[answered, name].to_numpy(float)).items():
            out[f"{name[:-2]}_{q}_s"] = v
    slo = {k: frame[k] if k in frame.columns else None for k in ("ttft_slo_s", "tpot_slo_s")}
    ok = good(
        frame["outcome"],
        metrics["e2e_s"],
        frame["deadline_s"],
        metrics["ttft_s"],
        slo["ttft_slo_s"],
        metrics["tpot_s"],
        slo["tpot_slo_s"],
    )
    out["good"] = float(np.count_nonzero(ok))
    out["goodput_rps"] = goodput(ok, seconds)
    return out
