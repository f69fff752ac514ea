"""Metrics of per-request frames (simulated or live: the same schema) and intervals across seeds."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from qsim.policy import on_time
from qsim.records import ANSWERED, OUTCOMES


def run_duration(frame: pd.DataFrame, duration_s: float | None = None) -> float:
    """Seconds that rates are per: the trace's arrival window, else the run's makespan (bursts)."""
    if duration_s is not None and duration_s > 0:
        return float(duration_s)
    if frame.empty:
        return math.nan
    span = float(frame["finish_s"].max() - frame["arrival_s"].min())
    return span if span > 0 else math.nan


def summary(frame: pd.DataFrame, duration_s: float | None = None) -> dict[str, float]:
    """Outcome counts, share in time, goodput (requests/s and good tokens/s), latency percentiles.

    share_good is the share of all requests answered within their deadline; refused counts
    the rejected and the expired (said no to, unrun), share_refused their share of all.
    Latency percentiles are over the answered (good or late); refusal_* over the
    time it took to say no (rejected or expired).

    Rows are attempts: where clients retried, these are attempt-level, and :func:`retry_summary`'s
    end-to-end figures (judged from each request's first send) are added.
    """
    seconds = run_duration(frame, duration_s)
    row = _summary(*_columns(frame), seconds)
    if "attempt" in frame.columns and (frame["attempt"] > 1).any():
        row.update(retry_summary(frame, seconds))
    row.update(prefix_cache_summary(frame))
    return row


#: A prefix cache's counters a run's summary carries (in tokens, as vLLM's of these names).
PREFIX_CACHE_KEYS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate")


def prefix_cache_summary(frame: pd.DataFrame) -> dict[str, float]:
    """A batching engine's prefix cache (qsim.prefix), from the run's ``attrs`` (simulate puts
    them there): tokens queried, tokens hit, hits over queries (NaN: none queried); {} without."""
    if "prefix_cache_queries" not in frame.attrs:
        return {}
    queries, hits = frame.attrs["prefix_cache_queries"], frame.attrs["prefix_cache_hits"]
    return {
        "prefix_cache_queries": float(queries),
        "prefix_cache_hits": float(hits),
        "prefix_cache_hit_rate": hits / queries if queries else math.nan,
    }


def end_to_end(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per request (its first attempt's ``first_request_id``) as its client saw it, retries
    included.

    ``outcome`` is its last attempt's, with good/late judged from the *first* send against the first
    attempt's deadline (``latency_s`` = last finish - first send); ``attempts`` counts its rows.
    Other columns are the first attempt's (size, client, priority, arrival_s).
    """
    rows = frame.sort_values(["first_request_id", "attempt"], kind="stable")
    first = rows.groupby("first_request_id", sort=True).head(1).set_index("first_request_id")
    last = rows.groupby("first_request_id", sort=True).tail(1).set_index("first_request_id")
    out = first.drop(columns=["outcome", "reason", "finish_s", "latency_s"]).copy()
    out["attempts"] = rows.groupby("first_request_id", sort=True).size()
    out["finish_s"] = last["finish_s"]
    out["latency_s"] = last["finish_s"] - first["arrival_s"]
    answered = last["outcome"].isin(ANSWERED)
    in_time = on_time(out["latency_s"], first["deadline_s"])
    outcome = last["outcome"].astype(object).where(~answered, np.where(in_time, "good", "late"))
    out["outcome"] = pd.array(outcome, dtype="string")
    out["reason"] = last["reason"]
    return out.reset_index().rename(columns={"index": "first_request_id"})


def retry_summary(frame: pd.DataFrame, duration_s: float | None = None) -> dict[str, float]:
    """What retries did: amplification, end-to-end goodput, and whether clients waited as told.

    attempts_per_request: rows per request (1 without retries). goodput_e2e_rps and share_good_e2e:
    requests answered within their deadline from their first send (:func:`end_to_end`), beside the
    attempt-level goodput_rps. retry_after_adherence: of the retries that followed an answer
    carrying Retry-After, the share sent no sooner than it said (NaN when none did).
    """
    seconds = run_duration(frame, duration_s)
    e2e = end_to_end(frame)
    good = e2e["outcome"].eq("good").to_numpy()
    rows = frame.sort_values(["first_request_id", "attempt"], kind="stable")
    prev = rows.groupby("first_request_id", sort=False).shift(1)
    told = (rows["attempt"] > 1) & prev["retry_after_s"].notna()
    waited = (
        rows.loc[told, "arrival_s"]
        >= prev.loc[told, "finish_s"] + prev.loc[told, "retry_after_s"].astype(float) - 1e-9
    )
    return {
        "requests_e2e": float(len(e2e)),
        "attempts_per_request": len(frame) / len(e2e) if len(e2e) else math.nan,
        "share_good_e2e": float(good.mean()) if len(e2e) else math.nan,
        "goodput_e2e_rps": float(good.sum() / seconds),
        "retry_after_adherence": float(waited.mean()) if told.any() else math.nan,
    }


def over_time(
    frame: pd.DataFrame, bin_s: float = 1.0, until_s: float | None = None
) -> pd.DataFrame:
    """What happened each ``bin_s`` seconds of a run, one row per bin [t_s, t_s + bin_s) from 0, as
    rates per second.

    attempts_per_s: attempts sent (every row, retries included: the load the service was offered);
    first_sends_per_s: requests sent for the first time (attempt 1); goodput_rps: good answers by
    the time they came back (``finish_s``, attempt-level: an attempt answered within its deadline
    from its own send); goodput_e2e_rps: requests good end to end (:func:`end_to_end`: answered
    within the deadline from the *first* send), by the time of that first send. Bins run to
    ``until_s`` (default: the last send or finish); events at or after it are left out.
    """
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    if until_s is None:
        until_s = float(
            np.nanmax(frame[["arrival_s", "finish_s"]].to_numpy(dtype=float), initial=0.0)
        )
        n = int(np.floor(until_s / bin_s)) + 1  # the bin holding the last event
    else:
        n = int(np.ceil(until_s / bin_s - 1e-9))

    def per_s(times) -> np.ndarray:
        index = np.floor(np.asarray(times, dtype=float) / bin_s)
        index = index[(index >= 0) & (index < n)].astype(np.int64)
        return np.bincount(index, minlength=n)[:n] / bin_s

    first = (
        frame["attempt"].to_numpy() == 1 if "attempt" in frame else np.ones(len(frame), dtype=bool)
    )
    good = frame["outcome"].to_numpy(dtype=object) == "good"
    if "first_request_id" in frame and len(frame):
        e2e = end_to_end(frame)
        e2e_good = e2e.loc[e2e["outcome"].eq("good").to_numpy(), "arrival_s"]
    else:
        e2e_good = frame.loc[good, "arrival_s"]
    return pd.DataFrame(
        {
            "t_s": np.arange(n) * bin_s,
            "attempts_per_s": per_s(frame["arrival_s"]),
            "first_sends_per_s": per_s(frame.loc[first, "arrival_s"]),
            "goodput_rps": per_s(frame.loc[good, "finish_s"]),
            "goodput_e2e_rps": per_s(e2e_good),
        }
    )


def recovery(
    series: pd.DataFrame,
    start_s: float,
    end_s: float,
    column: str = "goodput_e2e_rps",
    *,
    window_s: float = 5.0,
    within: float = 0.1,
) -> dict[str, float]:
    """How long after a disturbance [start_s, end_s) a run's goodput took to come back (an
    :func:`over_time` table).

    The steady state is ``column``'s mean over the bins before ``start_s``. Recovered at the first
    bin from ``end_s`` on whose ``window_s`` seconds (that bin and the following ones: a forward
    moving average) average at least (1 - within) times the steady state; above it counts as
    recovered (a backlog being served). recovery_s: seconds from ``end_s`` to that bin's start, NaN
    when no whole window of the run reached it ("never"); recovered: 1 or 0 (NaN, with recovery_s,
    when there was no steady state to return to); steady_rps: the steady state.
    """
    t = series["t_s"].to_numpy(dtype=float)
    values = series[column].to_numpy(dtype=float)
    bin_s = float(t[1] - t[0]) if len(t) > 1 else 1.0
    steady = values[t + bin_s <= start_s + 1e-9]
    level = float(steady.mean()) if len(steady) else math.nan
    if not level > 0:
        return {"recovery_s": math.nan, "recovered": math.nan, "steady_rps": level}
    width = max(1, int(round(window_s / bin_s)))
    # Forward mean of each bin and the width - 1 after it; only whole windows (the run's last bins
    # have none).
    forward = pd.Series(values[::-1]).rolling(width).mean().to_numpy()[::-1]
    ok = np.flatnonzero((t >= end_s - 1e-9) & (forward >= (1.0 - within) * level))
    if not len(ok):
        return {"recovery_s": math.nan, "recovered": 0.0, "steady_rps": level}
    return {"recovery_s": float(t[ok[0]] - end_s), "recovered": 1.0, "steady_rps": level}


def by_group(
    frame: pd.DataFrame, column: str, duration_s: float | None = None, *, order=None
) -> pd.DataFrame:
    """:func:`summary` for each value of ``column``, one row each, indexed by that value.

    Rates are per the whole run's seconds (so the groups' goodputs add up to the run's), and
    each row also has ``share_of_requests``: its requests over the run's. A missing value
    (<NA>) is a group of its own, ordered last. ``order`` sorts the labels (a key function;
    default: their natural order).
    """
    seconds = run_duration(frame, duration_s)
    columns = _columns(frame)
    codes, uniques = pd.factorize(frame[column], use_na_sentinel=False)
    # plain ints: JSON-ready
    labels = [v.item() if isinstance(v, np.generic) else v for v in uniques]
    total = len(frame)
    rows = {}
    for i, label in enumerate(labels):
        mine = codes == i
        rows[label] = {
            **_summary(*(c[mine] for c in columns), seconds),
            "share_of_requests": float(mine.sum() / total),
        }
    named = sorted((v for v in labels if not pd.isna(v)), key=order)
    index = named + [v for v in labels if pd.isna(v)]
    table = pd.DataFrame([rows[v] for v in index], index=pd.Index(index, name=column, dtype=object))
    if table.empty:
        table = pd.DataFrame(
            columns=list(_summary(*(c[:0] for c in columns), seconds)) + ["share_of_requests"],
            index=pd.Index([], name=column, dtype=object),
        )
    return table


def by_class(frame: pd.DataFrame, duration_s: float | None = None) -> pd.DataFrame:
    """:func:`summary` for each size class, one row each, ordered by size."""
    return by_group(frame, "size_class", duration_s, order=_class_key)


def by_client(frame: pd.DataFrame, duration_s: float | None = None) -> pd.DataFrame:
    """:func:`summary` for each client, ordered by name.

    Requests that named no client (``client_id`` <NA>) are one group whose label is <NA>,
    last, as in the records: kept rather than left out, so that the rows add up to the run's
    (and no label can clash with a real client's id). :func:`client_fairness` leaves it out.
    """
    return by_group(frame, "client_id", duration_s, order=str)


def by_priority(frame: pd.DataFrame, duration_s: float | None = None) -> pd.DataFrame:
    """:func:`summary` for each priority value, lowest first (below 0: sheddable)."""
    return by_group(frame, "priority", duration_s, order=int)


def jain_index(values) -> float:
    """Jain's fairness index of non-negative values: (sum x)^2 / (n sum x^2), NaNs dropped.

    1 when all are equal, 1/n when one has everything; NaN for no values or all zero.
    """
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    squares = float(np.square(x).sum())
    if x.size == 0 or squares == 0:
        return math.nan
    return float(x.sum() ** 2 / (x.size * squares))


def by_replica(frame: pd.DataFrame, replicas: int) -> pd.DataFrame:
    """Each replica of a fleet (the records' ``replica``, 0..replicas-1, every one listed, an idle
    one too): its requests, those it ran (``started``) and its busy seconds (``busy_s``: the engine
    time of what it ran, its load)."""
    ran = frame["start_s"].notna()
    replica = frame["replica"]
    index = pd.RangeIndex(replicas, name="replica")
    count = replica.value_counts().reindex(index, fill_value=0)
    started = replica[ran].value_counts().reindex(index, fill_value=0)
    busy = frame.loc[ran, "true_service_s"].groupby(replica[ran]).sum()
    busy = busy.reindex(index, fill_value=0.0)
    return pd.DataFrame(
        {
            "requests": count.astype(int),
            "started": started.astype(int),
            "busy_s": busy.astype(float),
        },
        index=index,
    )


def fleet_balance(table: pd.DataFrame) -> dict[str, float]:
    """How evenly a fleet's load (a :func:`by_replica` table's busy seconds) is spread: the load
    imbalance (the busiest replica's over the mean: 1 when even, N when one takes all) and Jain's
    index over replicas (1 when even, 1 / N when one takes all)."""
    busy = table["busy_s"].to_numpy(dtype=float)
    mean = busy.mean() if busy.size else math.nan
    return {
        "load_imbalance": float(busy.max() / mean) if mean > 0 else math.nan,
        "jain_replicas": jain_index(busy),
    }


def client_fairness(table: pd.DataFrame) -> dict[str, float]:
    """Jain's index across the named clients of a :func:`by_client` table (the <NA> group left out).

    ``jain_goodput`` is over the clients' good tokens/s: equal throughput for everyone, what a
    fair-share discipline aims at while all are backlogged; a client that sends less scores
    lower on it however well it is served. ``jain_share`` is over their share answered in
    time (share_good): equal chances per request, whatever each client sends. A plain queue
    in front of one heavy client keeps jain_share near 1 with a low jain_goodput; a fair share
    raises jain_goodput at the price of the heavy client's share in time.
    """
    named = table[table.index.notna()]
    return {
        "jain_goodput": jain_index(named["good_tokens_per_s"]),
        "jain_share": jain_index(named["share_good"]),
    }


def _columns(frame: pd.DataFrame) -> tuple[np.ndarray, ...]:
    # numpy arrays, read once: a sweep summarises every cell and each size class in it, and pandas'
    # string comparisons cost more than the rest of a small cell's summary.
    nan = np.full(len(frame), np.nan)
    return (
        frame["outcome"].to_numpy(dtype=object),
        frame["latency_s"].to_numpy(dtype=float),
        frame["max_new_tokens"].to_numpy(),
        frame["ttft_s"].to_numpy(dtype=float) if "ttft_s" in frame else nan,
        frame["tpot_s"].to_numpy(dtype=float) if "tpot_s" in frame else nan,
    )


def _quantiles(values: np.ndarray, qs) -> list[float]:
    values = values[~np.isnan(values)]
    return list(np.quantile(values, qs)) if len(values) else [math.nan] * len(qs)


def _summary(
    outcome: np.ndarray,
    latency: np.ndarray,
    tokens: np.ndarray,
    ttft: np.ndarray,
    tpot: np.ndarray,
    seconds: float,
) -> dict[str, float]:
    n = len(outcome)
    each = {str(o): outcome == o for o in OUTCOMES}
    good = each["good"]
    answered = latency[each["good"] | each["late"]]
    refused = latency[each["rejected"] | each["expired"]]
    row: dict[str, float] = {"requests": n}
    row.update({o: int(mask.sum()) for o, mask in each.items()})
    row["refused"] = row["rejected"] + row["expired"]
    lat = np.quantile(answered, [0.5, 0.9, 0.99]) if len(answered) else [math.nan] * 3
    ref = np.quantile(refused, [0.5, 0.99]) if len(refused) else [math.nan] * 2
    row.update(
        share_good=good.mean() if n else math.nan,
        share_refused=row["refused"] / n if n else math.nan,
        goodput_rps=good.sum() / seconds,
        good_tokens_per_s=tokens[good].sum() / seconds,
        latency_p50_s=lat[0],
        latency_p90_s=lat[1],
        latency_p99_s=lat[2],
        refusal_p50_s=ref[0],
        refusal_p99_s=ref[1],
    )
    # Time to first token and per output token of the answered (definitions: docs/metrics.md).
    answered_mask = each["good"] | each["late"]
    first = _quantiles(ttft[answered_mask], [0.5, 0.99])
    per = _quantiles(tpot[answered_mask], [0.5, 0.99])
    row.update(ttft_p50_s=first[0], ttft_p99_s=first[1], tpot_p50_s=per[0], tpot_p99_s=per[1])
    return {k: float(v) for k, v in row.items()}


def _class_key(label: str) -> tuple[float, str]:
    """Sort '4' < '16' < '64' < '>64' and anything else after, by name."""
    text = str(label).lstrip(">")
    try:
        return (float(text) + (0.5 if str(label).startswith(">") else 0.0), str(label))
    except ValueError:
        return (math.inf, str(label))


def class_order(labels) -> list[str]:
    """The distinct size classes of ``labels`` in numeric order ('4', '16', '64', not '16', '4',
    '64')."""
    return sorted(dict.fromkeys(str(v) for v in labels), key=_class_key)


def mean_ci(values, level: float = 0.95) -> tuple[float, float, float]:
    """Mean and Student-t confidence interval of independent replications (NaNs dropped)."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    if x.size == 0:
        return (math.nan, math.nan, math.nan)
    mean = float(x.mean())
    if x.size < 2:
        return (mean, math.nan, math.nan)
    from scipy import stats  # at first use, not import: it costs each qlab process ~1 s

    sem = stats.sem(x)
    if sem == 0:
        return (mean, mean, mean)
    low, high = stats.t.interval(level, x.size - 1, loc=mean, scale=sem)
    return (mean, float(low), float(high))


def controlled_mean_ci(
    values, controls, known_mean: float, level: float = 0.95
) -> tuple[float, float, float]:
    """Mean and interval of independent replications by a control variate (Lavenberg and Welch,
    1981).

    ``controls`` holds, per replication, a statistic whose true mean ``known_mean`` is known (the
    run's mean output length, its mean step time) and which moves with ``values`` from one
    replication to the next. The estimate is the least-squares line of values on controls
    (scipy's linregress) read at the known mean, its interval the Student-t interval of that
    intercept with n - 2 degrees of freedom: the part of the spread that the control explains is
    removed, so the interval is narrower by about sqrt(1 - r^2) for a correlation r, and still
    exact for replications whose (value, control) pairs are jointly normal."""
    y, x = np.asarray(values, dtype=float), np.asarray(controls, dtype=float)
    keep = ~(np.isnan(y) | np.isnan(x))
    y, x = y[keep], x[keep]
    if y.size < 3:
        return (float(y.mean()) if y.size else math.nan, math.nan, math.nan)
    from scipy import stats  # at first use, not import: it costs each qlab process ~1 s

    fit = stats.linregress(x - known_mean, y)
    half = stats.t.ppf(0.5 + level / 2, y.size - 2) * fit.intercept_stderr
    return (float(fit.intercept), float(fit.intercept - half), float(fit.intercept + half))


def across_seeds(table: pd.DataFrame, level: float = 0.95) -> pd.DataFrame:
    """Rows are replications, columns metrics: return mean, ci_low, ci_high per metric."""
    out = {col: mean_ci(table[col], level) for col in table.columns}
    return pd.DataFrame.from_dict(out, orient="index", columns=["mean", "ci_low", "ci_high"])


def aggregate(
    table: pd.DataFrame, by: list[str], columns: list[str], level: float = 0.95
) -> pd.DataFrame:
    """Mean and CI over seeds of ``columns`` for each group of ``by`` (e.g. policy, speed, load).

    Returns one row per group with columns <metric>, <metric>_low, <metric>_high, and n (seeds).
    """
    rows = []
    for key, part in table.groupby(by, sort=True, dropna=False):
        row = dict(zip(by, key if isinstance(key, tuple) else (key,)))
        row["n"] = len(part)
        for col in columns:
            row[col], row[f"{col}_low"], row[f"{col}_high"] = mean_ci(part[col], level)
        rows.append(row)
    return pd.DataFrame(rows)


#: Metrics that are shares (in [0, 1]) and ones that cannot be negative (rates, seconds, counts), by
#: how their names begin; a paired difference or a signed error is neither and is left alone.
SHARE_PREFIXES = ("share", "jain", "recovered")
NON_NEGATIVE_PREFIXES = (
    "goodput",
    "good_tokens",
    "good_requests",
    "latency_p",
    "capacity",
    "attempts",
    "recovery",
    "offered",
    "ttft_p",
    "tpot_p",
    "itl_p",
    "e2e_p",
    "requests",
)


def clip_bounds(table: pd.DataFrame) -> pd.DataFrame:
    """:func:`aggregate`'s table with each interval cut to what its metric can be, for display.

    A t-interval over a few seeds can reach below 0, or past 1 for a share; shown as it is, a share
    "between -0.05 and 0.4" reads as nonsense. The mean is left as it is."""
    out = table.copy()
    for col in table.columns:
        if not (f"{col}_low" in table.columns and f"{col}_high" in table.columns):
            continue
        low, high = f"{col}_low", f"{col}_high"
        if col.startswith(SHARE_PREFIXES):
            out[low], out[high] = table[low].clip(0, 1), table[high].clip(0, 1)
        elif col.startswith(NON_NEGATIVE_PREFIXES):
            out[low], out[high] = table[low].clip(lower=0), table[high].clip(lower=0)
    return out


def with_ci(frame: pd.DataFrame) -> pd.DataFrame:
    """:func:`aggregate`'s columns ``m``, ``m_low``, ``m_high`` shown as one column
    "mean [low, high]", each interval cut to what its metric can be (:func:`clip_bounds`);
    other columns as they are."""
    frame = clip_bounds(frame)
    out = pd.DataFrame(index=frame.index)
    for col in frame.columns:
        if col.endswith(("_low", "_high")) and col.rsplit("_", 1)[0] in frame.columns:
            continue
        if f"{col}_low" in frame.columns and f"{col}_high" in frame.columns:
            out[col] = [
                str(Est(m, lo, hi)) if pd.notna(m) else "-"
                for m, lo, hi in zip(frame[col], frame[f"{col}_low"], frame[f"{col}_high"])
            ]
        else:
            out[col] = frame[col]
    return out.reset_index(drop=True)


# Paired comparisons across seeds: cells that differ only in policy (or speed, or load) share their
# seed's random numbers, so the interval of the per-seed difference is narrower than two apart.


@dataclass(frozen=True)
class Est:
    """A mean over seeds and its 95 % interval."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, values) -> "Est":
        return cls(*mean_ci(values))

    def __str__(self) -> str:
        if math.isnan(self.low):
            return f"{self.mean:.3g}"
        return f"{self.mean:.3g} [{self.low:.3g}, {self.high:.3g}]"


def _select(table: pd.DataFrame, equal: dict) -> pd.DataFrame:
    mask = np.ones(len(table), dtype=bool)
    for key, value in equal.items():
        mask &= (table[key] == value).to_numpy()
    return table[mask]


def per_seed(table: pd.DataFrame, metric: str, **equal) -> pd.Series:
    """``metric`` of the cells matching ``equal``, one value per seed (averaged over any other
    axis)."""
    return _select(table, equal).groupby("seed")[metric].mean()


def estimate(table: pd.DataFrame, metric: str, **equal) -> Est:
    """Mean and interval over seeds of ``metric`` in the cells matching ``equal``."""
    return Est.of(per_seed(table, metric, **equal))


def paired_difference(table: pd.DataFrame, metric: str, a: dict, b: dict) -> Est:
    """Mean and interval of metric(a) - metric(b), paired by seed."""
    return Est.of((per_seed(table, metric, **a) - per_seed(table, metric, **b)).dropna())
