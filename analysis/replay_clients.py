"""A live run's clients in its replay (:mod:`analysis.replay`): their patience and retry policy as
simulate()'s arguments, the simulator's retrier on the gate's clock (:class:`_LiveRetrier`), and
the replay inputs of a request whose attempts were retried (the attempt that ran live)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from qsim.clients import Decision, Retrier

from .replay_inputs import gate_knew, trip_s


def clients_of(run: pd.DataFrame):
    """The run's clients (:func:`qsim.runfile.client_settings`) and whether they retried."""
    from qsim.runfile import client_settings

    clients, _ = client_settings(run)
    return clients, clients.retry is not None and clients.retry.retries


def client_faults(
    run: pd.DataFrame, ordered: pd.DataFrame, arrival: np.ndarray, notice: np.ndarray | float = 0.0
) -> dict:
    """simulate()'s arguments for the run's clients: each request's patience, running out when the
    live client's did (its first send + patience) and ``notice`` later (when the gate heard of it),
    and the retry policy with its jitter seed."""
    clients, retrying = clients_of(run)
    out = {}
    if "patience_s" in ordered.columns:
        patience = ordered["patience_s"].to_numpy(float)
        hangup = (
            ordered["arrival_s"].to_numpy(float)
            + np.where(np.isnan(patience), np.inf, patience)
            + notice
        )
        if np.isfinite(hangup).any():
            out.update(cancel_after_s=hangup - arrival, cancel_until=clients.patience_until)
    if retrying:
        out.update(retry=clients.retry, retry_seed=clients.retry_seed)
    return out


class _LiveRetrier(Retrier):
    """The run's clients as the simulator's, on the gate's clock: :class:`qsim.clients.Retrier`
    itself, told each attempt's end when the live client learnt it and answering when the retry
    reached the gate.

    The simulator's clients hear an attempt's end at the gate's end and send again straight into the
    gate; the live client heard it ``out`` later (the answer's trip back; its hang-up for an attempt
    it left) and its retry reached the gate ``back`` after the time the retrier gave (send lateness
    and the trip in). Both are the run's own, per attempt, where the run sent that attempt (else the
    run's medians), so a retry both sides send arrives when it did. Requests are the run's (the
    jitter is drawn per request id), the budget counts the run's first sends, and a patience runs
    out when the client's did (the simulator's ends ``notice`` later, when the gate heard of it).
    """

    def __init__(
        self,
        policy,
        ids: np.ndarray,
        first_sends,
        seed: int,
        out: dict,
        back: dict,
        usual: tuple,
        notice: np.ndarray,
    ) -> None:
        super().__init__(policy, np.sort(first_sends), seed)
        self.ids, self.out, self.back, self.usual, self.notice = ids, out, back, usual, notice

    def after(
        self, request, attempt, first_sent_s, now, status, retry_after_s=None, patience_s=math.inf
    ):
        first = int(self.ids[request])
        heard = now + self.out.get((first, attempt), self.usual[0])
        decision = super().after(
            first,
            attempt,
            first_sent_s,
            heard,
            status,
            retry_after_s,
            patience_s - self.notice[request],
        )
        if decision.at_s is None:
            return decision
        return Decision(
            decision.at_s + self.back.get((first, attempt + 1), self.usual[1]), decision.why
        )


def _live_retrier(
    run: pd.DataFrame, arrival: np.ndarray, ids: np.ndarray, retrying, notice: np.ndarray
):
    """The :class:`_LiveRetrier` of ``run`` that :func:`qsim.simulate` takes for its clients (None:
    no retries).

    retrying: the run's retry policy and seed, or None."""
    if not retrying:
        return None
    live_end = np.where(
        run["outcome"].eq("abandoned"), run["hangup_s"], gate_knew(run)["server_finish_s"]
    )
    out = (run["finish_s"] - live_end).to_numpy(float)
    back = arrival - run["scheduled_s"].to_numpy(float)
    keys = list(zip(run["first_request_id"].tolist(), run["attempt"].tolist()))
    known = np.isfinite(out)
    usual = (
        float(np.median(out[known])) if known.any() else 0.0,
        float(np.median(back[run["attempt"].gt(1).to_numpy()]))
        if run["attempt"].gt(1).any()
        else trip_s(run),
    )
    firsts = run.loc[run["attempt"].eq(1), "scheduled_s"].to_numpy(float)
    policy, seed = retrying
    return _LiveRetrier(
        policy,
        ids,
        firsts,
        seed,
        {k: v for k, v in zip(keys, out) if math.isfinite(v)},
        dict(zip(keys, back)),
        usual,
        notice,
    )


def _per_request(run: pd.DataFrame, given: pd.DataFrame) -> pd.DataFrame:
    """replay_inputs per request (indexed by first_request_id): the attempt that ran live (the last,
    if several did), else the last attempt whose speed factor at arrival is known, else the last."""
    factor = (
        run["arrival_speed_factor"]
        if "arrival_speed_factor" in run.columns
        else pd.Series(np.nan, index=run.index)
    )
    g = given.assign(
        first=run["first_request_id"].to_numpy(),
        attempt=run["attempt"].to_numpy(),
        ran=given["replayed_with"].ne("estimate").to_numpy(),
        known=np.isfinite(factor.to_numpy(float)),
    )
    pick = (
        g.sort_values(["first", "ran", "known", "attempt"], kind="stable").groupby("first").tail(1)
    )
    return pick.set_index("first")[["hold_s", "reported_s", "failed", "replayed_with"]]
