"""A replayed live run against the run: per attempt, whether and how the two parted, and why.

The two outcomes of each request (attempt: rows of a run whose clients retried) are joined on
(first_request_id, attempt) (:func:`join`); an attempt one side never sent is outcome ``not_sent``
on that side, and :func:`per_request` adds the end-to-end view, one row per request: its outcome
(the last attempt's, judged from the first send) and its number of attempts, live and simulated.
A disagreement is **independent** when the simulator met the
same queue at that arrival as the gate did, and **cascade** otherwise (it
inherits an earlier divergence). The same queue means, precisely: equal
``queued_at_arrival``, ``queued_work_at_arrival_s`` within
:data:`analysis.replay.TOLERANCE_S`, the same speed factor (within 1e-9), and no earlier
arrival still in the system on either side (until the later of its two ends)
whose trajectory diverged (outcome, engine start or end differ by more than
:data:`analysis.replay.TOLERANCE_S`). The first divergence is the gate time of the first
arrival that diverged or met a different queue.

That split says how a disagreement spread, not why it began (a systematically wrong rule reads as
one independent disagreement and a long cascade). Each attempt apart (diverged, met another queue,
or disagrees) is also given a **cause** (:func:`_causes`, :data:`CAUSES`): the numbers each side
recorded as its admission decision's inputs (estimate, waiting count and work, work left in service,
idle engines, deadline, priority: qsim.policy.decide's arguments) are put into
:func:`qsim.policy.decide`; where its answer is not the decision that side recorded, the simulator,
given that queue state, would have decided otherwise: a **rule** difference (a bug). Where both
sides decided as decide does, the states they met differed, or they parted after admission:
**timing** (a run that ended a few ms apart, a hang-up heard earlier). **unknown** where no decision
can be checked and the two differ (a live client that hung up unanswered has no numbers). An
attempt one side never sent takes the cause of the attempt before it. :func:`first_divergence`
names the first one's cause and what told the two apart.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from qsim.config import ServerConfig
from qsim.records import with_optional
from qsim.outcomes import ANSWERED, OUTCOMES, REJECT_REASONS, Reason
from qsim.policy import Policy, decide, on_time, reads_basic

from .metrics import end_to_end
from .replay_inputs import KEYS, RULES, TOLERANCE_S, arrival_times, gate_knew, run_setup
from .replay_unsaid import Unsaid

SIM_OUTCOMES = tuple(o for o in OUTCOMES if o != "abandoned")
#: The outcome of an attempt one side never sent (the simulator's clients retried otherwise).
NOT_SENT = "not_sent"
REFUSED = ("rejected", "expired")
#: Engine failures the simulator replays; any other live error (transport, 4xx) it cannot.
ENGINE_REASONS = ("engine_exception", "engine_stalled")
#: Why a divergence began (column cause; :func:`_causes`).
CAUSES = {
    "rule": "the numbers one side decided on, put into qsim.policy.decide, give another "
    "answer than the one it "
    "recorded: the gate and the simulator do not run the same rule (a bug)",
    "timing": "each side decided as decide does on the queue it met: the queue states "
    "differed, or the two "
    "parted after admission (a start, an end, a hang-up at another time)",
    "unknown": "no decision can be checked (no numbers recorded: a client that hung up "
    "unanswered, or a rule "
    "that reads more than the record holds) and the two sides' decisions differ",
}
#: Refusals qsim.policy.decide gives (rate_limited comes from a client's bucket, before it).
DECIDE_REASONS = tuple(str(r) for r in REJECT_REASONS if r != Reason.RATE_LIMITED)
#: What the built-in rule reads, as record columns (besides deadline_s), per side in the joined
#: frame.
DECIDED_ON = (
    "est_service_s",
    "queued_at_arrival",
    "queued_work_at_arrival_s",
    "in_service_work_at_arrival_s",
    "idle_at_arrival",
    "priority",
)


def join(run: pd.DataFrame, sim: pd.DataFrame, unsaid: Unsaid | None = None) -> pd.DataFrame:
    """One row per attempt (per request without retries): live and simulated outcome, reason,
    latency, queue at arrival, and agreement, matched on (first_request_id, attempt).

    Latencies are the client's: live_latency_s as measured; sim_latency_s is the simulator's own
    time in the gate (its finish, from its own start and hold, less the gate arrival) plus the trips
    the client measured (send to gate arrival, gate end to answer), so latency_error_s is the time
    in the gate the simulator got wrong. A simulated answer is good or late by that latency, as
    the live one is by the client's; sim_outcome_at_gate keeps the simulator's own verdict. An
    attempt one side never sent is ``not_sent`` there (its times NaN, its gate arrival the other's).
    unsaid: what the replay took for what the run does not say (default: arrivals from
    :func:`arrival_times`, hang-ups heard at once).
    """
    known = gate_knew(run)
    arrival = arrival_times(run) if unsaid is None else unsaid.arrival
    live_end = known["server_finish_s"].to_numpy()
    # the gate's end of an attempt whose client hung up: when it heard of it
    if "hangup_s" in run.columns:
        hung = run["outcome"].eq("abandoned").to_numpy()
        heard = 0.0 if unsaid is None else unsaid.notice(run["first_request_id"])
        live_end = np.where(hung, run["hangup_s"].to_numpy(float) + heard, live_end)
    live = with_optional(run)[
        [
            "request_id",
            *KEYS,
            "size_class",
            "max_new_tokens",
            "deadline_s",
            "outcome",
            "reason",
            "arrival_s",
            "finish_s",
            *DECIDED_ON,
        ]
    ].assign(
        gate_arrival_s=arrival,
        live_start_s=known["engine_started_s"].to_numpy(),
        live_end_s=live_end,
        live_speed_factor=known["arrival_speed_factor"].to_numpy(),
    )
    simmed = sim[
        [
            "request_id",
            *KEYS,
            "outcome",
            "reason",
            "arrival_s",
            "start_s",
            "finish_s",
            "latency_s",
            *DECIDED_ON,
            "speed_factor_at_arrival",
            "replayed_with",
            "size_class",
            "max_new_tokens",
            "deadline_s",
        ]
    ].rename(
        columns={
            "start_s": "sim_start_s",
            "finish_s": "sim_end_s",
            "latency_s": "sim_gate_latency_s",
            "speed_factor_at_arrival": "sim_speed_factor",
            "arrival_s": "sim_arrival_s",
            "request_id": "sim_request_id",
            "size_class": "sim_size_class",
            "max_new_tokens": "sim_max_new_tokens",
            "deadline_s": "sim_deadline_s",
        }
    )
    both = live.merge(
        simmed, on=KEYS, how="outer", suffixes=("_live", "_sim"), validate="one_to_one"
    )
    both = both.rename(
        columns={
            "outcome_live": "live_outcome",
            "outcome_sim": "sim_outcome_at_gate",
            "reason_live": "live_reason",
            "reason_sim": "sim_reason",
        }
    )
    only_sim = both["live_outcome"].isna()
    if only_sim.any():  # sent only by the simulator's clients: what the simulator knows of it
        both["request_id"] = both["request_id"].fillna(both["sim_request_id"])
        for name in ("size_class", "max_new_tokens", "deadline_s"):
            both[name] = both[name].fillna(both[f"sim_{name}"])
        both["gate_arrival_s"] = both["gate_arrival_s"].fillna(both["sim_arrival_s"])
        both["live_outcome"] = both["live_outcome"].fillna(NOT_SENT)
    both["request_id"] = both["request_id"].astype(np.int64)
    both["max_new_tokens"] = both["max_new_tokens"].astype(np.int64)
    both = both.drop(
        columns=["sim_request_id", "sim_size_class", "sim_max_new_tokens", "sim_deadline_s"]
    )
    both["live_latency_s"] = both["finish_s"] - both["arrival_s"]
    live_gate = both["live_end_s"] - both["gate_arrival_s"]
    trips = (both["live_latency_s"] - live_gate).where(
        live_gate.notna(), both["gate_arrival_s"] - both["arrival_s"]
    )
    both["sim_latency_s"] = both["sim_gate_latency_s"] + trips.fillna(0.0)
    in_time = np.where(on_time(both["sim_latency_s"], both["deadline_s"]), "good", "late")
    sim_answered = both["sim_outcome_at_gate"].isin(ANSWERED)
    both["sim_outcome"] = both["sim_outcome_at_gate"].where(
        ~sim_answered, pd.Series(in_time, index=both.index)
    )
    both["sim_outcome"] = both["sim_outcome"].fillna(NOT_SENT)
    # an answer that would have reached the client after it hung up: it had left
    if "hangup_s" in run.columns:
        hangup = (
            run.set_index(KEYS)["hangup_s"]
            .reindex(pd.MultiIndex.from_frame(both[KEYS]))
            .to_numpy(float)
        )
        answered_live = run["outcome"].isin(ANSWERED).to_numpy()
        back = (run["finish_s"] - known["server_finish_s"]).to_numpy(float)[answered_live]
        back = float(np.nanmedian(back)) if np.isfinite(back).any() else 0.0
        gone = sim_answered.to_numpy() & (both["sim_end_s"].to_numpy(float) + back > hangup)
        both.loc[gone, "sim_outcome"] = "abandoned"
    both = both.drop(columns=["finish_s", "sim_arrival_s"])
    both["agree"] = both["live_outcome"].eq(both["sim_outcome"]).astype(bool)
    answered = both["live_outcome"].isin(ANSWERED) & both["sim_outcome"].isin(ANSWERED)
    both["latency_error_s"] = (both["sim_latency_s"] - both["live_latency_s"]).where(answered)
    both["modelled"] = (
        both["live_outcome"].ne("error") | both["live_reason"].isin(ENGINE_REASONS)
    ).astype(bool)
    return _causes(_divergence(both), run_setup(run))


def per_request(run: pd.DataFrame, joined: pd.DataFrame) -> pd.DataFrame:
    """One row per request (first_request_id), end to end as its client saw it, live and simulated:
    the outcome of its last attempt (an answer judged good or late from the *first* send, as
    :func:`analysis.metrics.end_to_end`), that attempt's reason, and how many attempts were sent.

    The simulated latency from the first send is the simulated attempt's (:func:`join`) plus the
    time from the first send to that attempt's send (the live send where the run sent it, else the
    simulator's arrival). agree: same outcome and attempt count."""
    live = end_to_end(run).set_index("first_request_id")
    first_sent = live["arrival_s"]
    sent = joined[joined["sim_outcome"].ne(NOT_SENT)].sort_values(KEYS, kind="stable")
    last = sent.groupby("first_request_id", sort=True).tail(1).set_index("first_request_id")
    own_send = last["arrival_s"].fillna(last["gate_arrival_s"])
    latency = own_send - first_sent.reindex(last.index) + last["sim_latency_s"]
    answered = last["sim_outcome_at_gate"].isin(ANSWERED) & last["sim_outcome"].ne("abandoned")
    in_time = on_time(latency, live["deadline_s"].reindex(last.index))
    sim_outcome = (
        last["sim_outcome"].astype(object).where(~answered, np.where(in_time, "good", "late"))
    )
    out = pd.DataFrame(
        {
            "live_outcome": live["outcome"].astype(str),
            "sim_outcome": sim_outcome.reindex(live.index).fillna(NOT_SENT).astype(str),
            "live_reason": live["reason"],
            "sim_reason": last["sim_reason"].reindex(live.index),
            "live_attempts": live["attempts"].astype(np.int64),
            "sim_attempts": sent.groupby("first_request_id")
            .size()
            .reindex(live.index, fill_value=0)
            .astype(np.int64),
            "live_latency_s": live["latency_s"],
            "sim_latency_s": latency.where(answered).reindex(live.index),
        },
        index=live.index,
    )
    out["outcome_agree"] = out["live_outcome"].eq(out["sim_outcome"])
    out["attempts_agree"] = out["live_attempts"].eq(out["sim_attempts"])
    out["agree"] = out["outcome_agree"] & out["attempts_agree"]
    return out.reset_index()


def _close(a: pd.Series, b: pd.Series, tol: float) -> np.ndarray:
    """Equal within tol, NaN equal to NaN."""
    a, b = a.to_numpy(float), b.to_numpy(float)
    return (np.abs(a - b) <= tol) | (np.isnan(a) & np.isnan(b))


def _divergence(both: pd.DataFrame) -> pd.DataFrame:
    """Mark each request's trajectory (diverged), the queue it met (same_queue), and its
    disagreement as independent or cascade; see the module docstring for the definitions."""
    order = np.lexsort((both["request_id"].to_numpy(), both["gate_arrival_s"].to_numpy(float)))
    b = both.iloc[order].copy()
    live_end = b["live_end_s"].fillna(b["arrival_s"] + b["live_latency_s"])
    # A client that hung up got no answer: whether (and when) its request started, the run cannot
    # say.
    unknown = b["live_outcome"].eq("abandoned").to_numpy() & b["live_start_s"].isna().to_numpy()
    b["diverged"] = ~(
        b["agree"].to_numpy()
        & (_close(b["live_start_s"], b["sim_start_s"], TOLERANCE_S) | unknown)
        & _close(live_end, b["sim_end_s"], TOLERANCE_S)
    )
    counts = b["queued_at_arrival_live"].astype("Float64").to_numpy(dtype=float, na_value=np.nan)
    sim_counts = b["queued_at_arrival_sim"].astype("Float64").to_numpy(dtype=float, na_value=np.nan)
    same = np.isnan(counts) | (counts == sim_counts)
    work = b["queued_work_at_arrival_s_live"].to_numpy(float)
    same &= np.isnan(work) | (
        np.abs(work - b["queued_work_at_arrival_s_sim"].to_numpy(float)) <= TOLERANCE_S
    )
    factor = b["live_speed_factor"].to_numpy(float)
    same &= np.isnan(factor) | (np.abs(factor - b["sim_speed_factor"].to_numpy(float)) <= 1e-9)
    # Still in the system at this arrival: an earlier diverged request whose later end is after it.
    reach = np.where(
        b["diverged"], np.fmax(live_end.to_numpy(float), b["sim_end_s"].to_numpy(float)), -np.inf
    )
    reach = np.where(np.isnan(reach), np.inf, reach)
    before = np.concatenate([[-np.inf], np.maximum.accumulate(reach)[:-1]])
    b["same_queue"] = same & (before <= b["gate_arrival_s"].to_numpy(float))
    wrong = ~b["agree"] & b["modelled"]
    b["disagreement"] = np.where(wrong, np.where(b["same_queue"], "independent", "cascade"), "")
    return b.sort_values("request_id", ignore_index=True)


def _checkable(policy: Policy) -> bool:
    """Whether a record holds every number this policy's admission rule reads: the built-in rule
    over the basic numbers (no plug-in rule, queued tokens, shedding draw, objectives or memory,
    reserved class, or a discipline that serves some arrivals ahead of others, as the queue core's
    own test for it)."""
    return (
        reads_basic(policy)
        and policy.reserve_min_s is None
        and getattr(policy.make_discipline(), "ahead_s", None) is None
    )


def _decisions(b: pd.DataFrame, side: str, setup: ServerConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per row, one side's admission decision as recorded ("admit" or the refusal's reason) and what
    :func:`qsim.policy.decide` answers on the numbers that side recorded; None where unknown (not
    sent, no numbers, a refusal decide does not give, or a policy whose rule reads more than the
    record)."""
    outcome = (
        b["live_outcome" if side == "live" else "sim_outcome_at_gate"].astype(object).to_numpy()
    )
    reason = b[f"{side}_reason"].astype(object).to_numpy()
    numbers = {
        c: b[f"{c}_{side}"].astype("Float64").to_numpy(dtype=float, na_value=np.nan)
        for c in DECIDED_ON
    }
    deadline = b["deadline_s"].to_numpy(float)
    policy, engines = setup.policy, setup.engine.engines
    checkable = _checkable(policy)
    recorded, rule = np.full(len(b), None, dtype=object), np.full(len(b), None, dtype=object)
    for i in range(len(b)):
        values = [numbers[c][i] for c in DECIDED_ON]
        said = all(math.isfinite(v) for v in values)
        if (
            pd.isna(outcome[i])
            or outcome[i] == NOT_SENT
            or (outcome[i] == "error" and not said)
            or (outcome[i] == "rejected" and reason[i] == Reason.RATE_LIMITED)
        ):
            continue  # not sent, a transport failure, or refused before the rule
        # Any other outcome was admitted; one whose client hung up too (a refusal is answered at
        # once).
        recorded[i] = reason[i] if outcome[i] == "rejected" else "admit"
        if not checkable or not said:
            continue
        est, queued, work, in_service, idle, priority = values
        due = deadline[i] if math.isfinite(deadline[i]) else policy.deadline_s
        refusal = decide(
            policy, int(queued), work, in_service, est, due, engines, int(idle), int(priority)
        )
        rule[i] = "admit" if refusal is None else str(refusal.reason)
    return recorded, rule


def _agrees(recorded, rule) -> bool | None:
    """Whether decide's answer is the recorded decision (the reason too, where it is one decide
    gives; the gate's deadline_too_short is decide's refusal in its HTTP words); None where either
    is unknown."""
    if pd.isna(recorded) or pd.isna(rule):  # None, or NaN once in a frame
        return None
    if recorded == "admit" or rule == "admit" or recorded not in DECIDE_REASONS:
        return (recorded == "admit") == (rule == "admit")
    return recorded == rule


def _causes(b: pd.DataFrame, setup: ServerConfig) -> pd.DataFrame:
    """Name why each attempt that diverged, met another queue or disagrees did so (column cause, one
    of
    :data:`CAUSES`): ``rule`` where a side's recorded decision is not what
    :func:`qsim.policy.decide` gives on the numbers that side recorded (so the simulator, given the
    live queue state, would have decided otherwise), ``timing`` where both decided as decide does
    (the states they met differed, or they parted after admission), ``unknown`` where neither can be
    checked and the decisions differ. An attempt one side never sent follows from the request's
    earlier attempt, and takes its cause. Columns live_decision / sim_decision (as recorded) and
    live_rule / sim_rule (decide on that side's numbers): "admit" or a reason."""
    for side in ("live", "sim"):
        b[f"{side}_decision"], b[f"{side}_rule"] = _decisions(b, side, setup)
    checks = {
        side: [_agrees(d, r) for d, r in zip(b[f"{side}_decision"], b[f"{side}_rule"])]
        for side in ("live", "sim")
    }
    same = [
        pd.notna(d) and pd.notna(e) and (d == "admit") == (e == "admit")
        for d, e in zip(b["live_decision"], b["sim_decision"])
    ]
    cause = np.where(
        [a is False or c is False for a, c in zip(checks["live"], checks["sim"])],
        "rule",
        np.where([a is True or s for a, s in zip(checks["live"], same)], "timing", "unknown"),
    ).astype(object)
    # A retry one side never sent: the cause of the request's attempt before it (attempts in order).
    position = {key: k for k, key in enumerate(zip(b["first_request_id"], b["attempt"]))}
    unsent = (b["live_outcome"].eq(NOT_SENT) | b["sim_outcome"].eq(NOT_SENT)).to_numpy()
    for k in sorted(np.flatnonzero(unsent), key=lambda k: b["attempt"].iat[k]):
        before = position.get((b["first_request_id"].iat[k], b["attempt"].iat[k] - 1))
        cause[k] = cause[before] if before is not None and cause[before] != "" else "unknown"
    apart = (b["diverged"] | ~b["same_queue"] | ~b["agree"]).to_numpy()
    b["cause"] = np.where(apart, cause, "")
    return b


def first_divergence(joined: pd.DataFrame) -> dict | None:
    """The first attempt (in gate order) that diverged or met another queue: its keys, outcomes,
    cause, and what told the two apart (the decision numbers that differ, or the start and end);
    None: no divergence."""
    apart = joined[joined["diverged"] | ~joined["same_queue"]]
    if apart.empty:
        return None
    row = apart.sort_values(["gate_arrival_s", "request_id"]).iloc[0]
    differ = []
    # A live attempt the gate never answered (its client hung up) has no numbers; its estimate is
    # the calibrated one.
    said = pd.notna(row["queued_at_arrival_live"])
    for c in (*DECIDED_ON, "speed_factor") if said else ():
        live, sim = (
            (row["live_speed_factor"], row["sim_speed_factor"])
            if c == "speed_factor"
            else (row[f"{c}_live"], row[f"{c}_sim"])
        )
        if pd.notna(live) and pd.notna(sim) and abs(float(live) - float(sim)) > TOLERANCE_S:
            differ.append(f"{c} live {float(live):.6g}, sim {float(sim):.6g}")
    if not differ:
        for c in ("start_s", "end_s"):
            live, sim = row[f"live_{c}"], row[f"sim_{c}"]
            if pd.notna(live) and pd.notna(sim) and abs(float(live) - float(sim)) > TOLERANCE_S:
                differ.append(f"{c} sim - live {(float(sim) - float(live)) * 1e3:+.3f} ms")
    return {
        "request_id": int(row["request_id"]),
        "first_request_id": int(row["first_request_id"]),
        "attempt": int(row["attempt"]),
        "gate_arrival_s": float(row["gate_arrival_s"]),
        "live_outcome": str(row["live_outcome"]),
        "sim_outcome": str(row["sim_outcome"]),
        "cause": str(row["cause"]),
        "differ": differ,
        **{
            c: None if pd.isna(row[c]) else str(row[c])
            for c in ("live_decision", "live_rule", "sim_decision", "sim_rule")
        },
    }


def describe_first_divergence(first: dict) -> str:
    """One line for :func:`first_divergence`'s answer: which attempt, its outcomes, its cause and
    why."""
    head = (
        f"request {first['first_request_id']} attempt {first['attempt']} at "
        f"{first['gate_arrival_s']:.3f} s, live "
        f"{first['live_outcome']}, sim {first['sim_outcome']}: {first['cause']}"
    )
    if first["cause"] == "rule":
        wrong = [
            f"{side} recorded {first[f'{side}_decision']}, decide on its numbers gives "
            f"{first[f'{side}_rule']}"
            for side in ("live", "sim")
            if _agrees(first[f"{side}_decision"], first[f"{side}_rule"]) is False
        ]
        return f"{head} ({'; '.join(wrong)})"
    return f"{head} ({'; '.join(first['differ']) or 'the same numbers and times'})"


def confusion(joined: pd.DataFrame) -> pd.DataFrame:
    """Counts of (live outcome, simulated outcome), every outcome shown even when zero."""
    live, sim = joined["live_outcome"].astype(str), joined["sim_outcome"].astype(str)
    table = pd.crosstab(live, sim)
    # Where clients gave up or retried: abandoned on the simulator's side too, and attempts one side
    # never sent.
    hung = ["abandoned"] if (live.eq("abandoned") | sim.eq("abandoned")).any() else []
    rows = list(OUTCOMES) + ([NOT_SENT] if live.eq(NOT_SENT).any() else [])
    columns = list(SIM_OUTCOMES) + hung + ([NOT_SENT] if sim.eq(NOT_SENT).any() else [])
    table = table.reindex(index=rows, columns=columns, fill_value=0)
    table.index.name, table.columns.name = "live", "sim"
    return table


def reasons(joined: pd.DataFrame) -> pd.DataFrame:
    """Counts of (live reason, simulated reason) among requests both refused or dropped."""
    refused = joined[joined["live_outcome"].isin(REFUSED) & joined["sim_outcome"].isin(REFUSED)]
    table = pd.crosstab(refused["live_reason"].astype(str), refused["sim_reason"].astype(str))
    table.index.name, table.columns.name = "live", "sim"
    return table


def summarize(
    joined: pd.DataFrame, speed: float = math.nan, requests: pd.DataFrame | None = None
) -> dict[str, float]:
    """Disagreements among requests the service handled (live errors apart; engine failures are
    replayed and counted as failure_disagreements), independent and cascade, and by cause (rule,
    timing, unknown: :data:`CAUSES`; ``*_divergences`` count every attempt apart, agreeing or not),
    the first divergence, refusal reasons both ways, outcome counts both ways and the latency error
    of requests both answered.

    Rows are attempts where clients retried; with ``requests`` (:func:`per_request`) the end-to-end
    figures are added: requests_e2e, e2e_disagreements (outcome or attempt count differ, among
    requests not ending in a live error) and their rate, e2e_outcome_disagreements,
    attempt_count_disagreements, attempts and abandoned requests on each side, and live_not_sent /
    sim_not_sent (attempts only the other side sent)."""
    handled = joined[joined["live_outcome"] != "error"]
    wrong = ~handled["agree"]
    failures = joined[joined["live_outcome"].eq("error") & joined["modelled"]]
    error = joined["latency_error_s"].dropna()
    refused = joined["live_outcome"].isin(REFUSED) & joined["sim_outcome"].isin(REFUSED)
    same_reason = (
        joined.loc[refused, "live_reason"]
        .astype(str)
        .eq(joined.loc[refused, "sim_reason"].astype(str))
    )
    apart = joined["diverged"] | ~joined["same_queue"]
    first = first_divergence(joined)
    row: dict[str, float] = {
        "requests": len(joined),
        "live_errors": int((joined["live_outcome"] == "error").sum()),
        "engine_failures": len(failures),
        "disagreements": int(wrong.sum()),
        "disagreement_rate": wrong.sum() / len(handled) if len(handled) else math.nan,
        "independent_disagreements": int((handled["disagreement"] == "independent").sum()),
        "cascade_disagreements": int((handled["disagreement"] == "cascade").sum()),
        "failure_disagreements": int((~failures["agree"]).sum()),
        **{
            f"{cause}_disagreements" if cause != "unknown" else "unknown_cause_disagreements": int(
                handled.loc[wrong, "cause"].eq(cause).sum()
            )
            for cause in CAUSES
        },
        **{f"{cause}_divergences": int(joined["cause"].eq(cause).sum()) for cause in CAUSES},
        # 1: the first divergence is a rule difference, 0: timing, NaN: unknown or none
        # (first_divergence says).
        "first_divergence_rule": math.nan
        if first is None or first["cause"] == "unknown"
        else float(first["cause"] == "rule"),
        "first_divergence_s": joined.loc[apart, "gate_arrival_s"].min()
        if apart.any()
        else math.nan,
        "first_disagreement_s": handled.loc[wrong, "gate_arrival_s"].min()
        if wrong.any()
        else math.nan,
        "both_refused": int(refused.sum()),
        "reasons_agree": int(same_reason.sum()),
        "reasons_disagree": int((~same_reason).sum()),
        "both_answered": len(error),
        "latency_abs_error_p50_s": error.abs().quantile(0.5),
        "latency_abs_error_p90_s": error.abs().quantile(0.9),
        "latency_abs_error_p99_s": error.abs().quantile(0.99),
        "latency_error_mean_s": error.mean(),
        "measured_speed": speed,
    }
    for rule in RULES:
        row[f"replayed_{rule}"] = int((joined["replayed_with"] == rule).sum())
    for outcome in (*OUTCOMES, NOT_SENT):
        row[f"live_{outcome}"] = int((joined["live_outcome"] == outcome).sum())
        row[f"sim_{outcome}"] = int((joined["sim_outcome"] == outcome).sum())
    if requests is not None:
        judged = requests[requests["live_outcome"] != "error"]
        row.update(
            {
                "requests_e2e": len(requests),
                "e2e_disagreements": int((~judged["agree"]).sum()),
                "e2e_disagreement_rate": float((~judged["agree"]).mean())
                if len(judged)
                else math.nan,
                "e2e_outcome_disagreements": int((~judged["outcome_agree"]).sum()),
                "attempt_count_disagreements": int((~judged["attempts_agree"]).sum()),
                "live_attempts": int(requests["live_attempts"].sum()),
                "sim_attempts": int(requests["sim_attempts"].sum()),
                "live_abandoned_e2e": int(requests["live_outcome"].eq("abandoned").sum()),
                "sim_abandoned_e2e": int(requests["sim_outcome"].eq("abandoned").sum()),
            }
        )
    return {k: float(v) for k, v in row.items()}
