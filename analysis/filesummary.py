"""A run's summary read from its records' parquet file in bounded memory, exactly as metrics computes it.

``qlab simulate --out`` streams records to a file (qsim.stream); reading every record back to summarise
them cost more memory than the run itself (0.7 GB at 2 million requests). Here the file is read a batch of
rows at a time: counts and sums add up batch by batch, and each latency percentile is found by radix
selection (a few passes over the file, each a histogram of 16 more bits of the values' order-preserving
keys, then the few values left, sorted). The percentiles are np.quantile's own (its linear method, from the
same two order statistics), not an estimate: the printed output of a streamed run is unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from qsim.records import OUTCOMES

from . import metrics

BATCH = 65_536  # rows read at a time
DIGIT = 16  # bits a pass selects on
COLLECT = 1 << 16  # values few enough to gather and sort instead of another pass
#: metrics._summary's quantiles of each series.
QUANTILES = {"latency": (0.5, 0.9, 0.99), "refusal": (0.5, 0.99), "ttft": (0.5, 0.99),
             "tpot": (0.5, 0.99)}
_ANSWERED = [OUTCOMES.index("good"), OUTCOMES.index("late")]
_REFUSED = [OUTCOMES.index("rejected"), OUTCOMES.index("expired")]
_SIGN = np.uint64(1 << 63)


def _keys(values: np.ndarray) -> np.ndarray:
    """float64 as uint64 in the same order (negatives' bits flipped, positives' sign bit set)."""
    bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)
    return np.where(bits & _SIGN, ~bits, bits | _SIGN)


def _value(key: int) -> float:
    key = np.uint64(key)
    bits = key & ~_SIGN if key & _SIGN else ~key
    return float(np.array([bits], dtype=np.uint64).view(np.float64)[0])


def _ranks(n: int, qs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """np.quantile's linear method: the order statistics below and above each quantile, and the weight."""
    virtual = np.asanyarray((n - 1) * np.asarray(qs, dtype=np.float64))
    below = np.floor(virtual).astype(np.intp)
    above = below + 1
    top = virtual >= n - 1
    below[top], above[top] = n - 1, n - 1
    low = virtual < 0
    below[low], above[low] = 0, 0
    return below, above, np.asanyarray(virtual - np.floor(virtual))


def _lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """numpy's interpolation between two order statistics, to the last bit (numpy's _lerp)."""
    diff = b - a
    out = np.add(a, diff * t)
    np.subtract(b, diff * (1 - t), out=out, where=t >= 0.5, casting="unsafe")
    return out


class _Pass:
    """One read of the file: for each series, a histogram of one digit of its keys under a prefix, or the
    keys under a prefix gathered."""

    def __init__(self) -> None:
        self.hist: dict[tuple, np.ndarray] = {}  # (series, depth, prefix) -> counts of the next digit
        self.gather: dict[tuple, list] = {}  # (series, depth, prefix) -> keys

    def wants(self, series) -> bool:
        return any(k[0] == series for k in (*self.hist, *self.gather))

    def add(self, series, keys: np.ndarray) -> None:
        for job in (*self.hist, *self.gather):
            if job[0] != series:
                continue
            _, depth, prefix = job
            mine = keys if depth == 0 else keys[(keys >> np.uint64(64 - depth)) == np.uint64(prefix)]
            if job in self.hist:
                digit = (mine >> np.uint64(64 - depth - DIGIT)) & np.uint64((1 << DIGIT) - 1)
                self.hist[job] += np.bincount(digit.astype(np.intp), minlength=1 << DIGIT)
            else:
                self.gather[job].append(mine)


class FileSummary:
    """metrics.summary and metrics.by_class of the rows of one seed of a records file."""

    def __init__(self, path, seed: int | None, duration_s: float | None) -> None:
        self.path, self.seed = path, seed
        self.labels: dict = {}  # size class -> group number (1, 2, ...); 0 is the whole run
        self.counts: dict[int, np.ndarray] = {}  # group -> counts of each outcome
        self.tokens: dict[int, int] = {}  # group -> good tokens
        self.n: dict[tuple, int] = {}  # (group, series) -> values
        self.nans: dict[tuple, int] = {}  # (group, series) -> NaN latencies (np.quantile's NaN)
        self.span = [math.inf, -math.inf]
        self.timed = False  # any kv_blocks_peak or ttft_slo_s: the run has token times to show
        self._first = _Pass()
        self._duration_s = duration_s
        self._sizes: dict[tuple, int] = {}  # (series, depth, prefix) -> values under it
        self._scan(self._first, first=True)
        self.seconds = self._seconds()
        self.quantiles = self._select()

    # ------------------------------------------------------------ reading
    def _batches(self, first: bool):
        columns = ["outcome", "size_class", "latency_s", "ttft_s", "tpot_s"]
        if first:
            columns += ["max_new_tokens", "kv_blocks_peak", "ttft_slo_s", "arrival_s", "finish_s"]
        file = pq.ParquetFile(self.path)
        names = set(file.schema_arrow.names)
        wanted = [c for c in columns if c in names] + (["seed"] if self.seed is not None else [])
        for batch in file.iter_batches(batch_size=BATCH, columns=wanted, use_threads=False):
            frame = batch.to_pandas()
            if self.seed is not None:
                frame = frame[frame["seed"].to_numpy() == self.seed]
            if len(frame):
                yield frame

    def _scan(self, job: _Pass, first: bool = False) -> None:
        for frame in self._batches(first):
            outcome = pd.Categorical(frame["outcome"], categories=OUTCOMES).codes
            group = self._groups(frame["size_class"], first)
            if first:
                self._count(frame, outcome, group)
            for series, keys in self._series(frame, outcome, group, first):
                if first:
                    job.hist.setdefault((series, 0, 0), np.zeros(1 << DIGIT, dtype=np.int64))
                if job.wants(series):
                    job.add(series, keys)

    def _groups(self, size_class: pd.Series, first: bool) -> np.ndarray:
        codes, uniques = pd.factorize(size_class, use_na_sentinel=False)
        for label in uniques:
            if first and label not in self.labels:
                self.labels[label] = len(self.labels) + 1
        return np.asarray([self.labels[v] for v in uniques], dtype=np.intp)[codes]

    def _count(self, frame: pd.DataFrame, outcome: np.ndarray, group: np.ndarray) -> None:
        tokens = frame["max_new_tokens"].to_numpy()
        good = outcome == OUTCOMES.index("good")
        for g in [0, *np.unique(group)]:
            mine = slice(None) if g == 0 else group == g
            counts = np.bincount(outcome[mine][outcome[mine] >= 0], minlength=len(OUTCOMES))
            self.counts[g] = self.counts.get(g, 0) + counts
            self.tokens[g] = self.tokens.get(g, 0) + tokens[mine][good[mine]].sum()
        self.span = [min(self.span[0], frame["arrival_s"].min()), max(self.span[1], frame["finish_s"].max())]
        self.timed = self.timed or any(c in frame and frame[c].notna().any()
                                       for c in ("kv_blocks_peak", "ttft_slo_s"))

    def _series(self, frame, outcome, group, first: bool):
        """(group, name) and the keys of its values in this batch: the whole run's and each class's."""
        answered, refused = np.isin(outcome, _ANSWERED), np.isin(outcome, _REFUSED)
        latency = frame["latency_s"].to_numpy(dtype=float)
        nan = np.full(len(frame), np.nan)
        columns = {"latency": (latency, answered), "refusal": (latency, refused),
                   "ttft": (frame["ttft_s"].to_numpy(dtype=float) if "ttft_s" in frame else nan, answered),
                   "tpot": (frame["tpot_s"].to_numpy(dtype=float) if "tpot_s" in frame else nan, answered)}
        for g in [0, *np.unique(group)]:
            for name, (values, take) in columns.items():
                mask = take if g == 0 else take & (group == g)
                values = values[mask]
                missing = np.isnan(values)
                if first:
                    self.n[g, name] = self.n.get((g, name), 0) + int((~missing).sum())
                    self.nans[g, name] = self.nans.get((g, name), 0) + int(missing.sum())
                yield (g, name), _keys(values[~missing])

    # ------------------------------------------------------------ selecting
    def _select(self) -> dict[tuple, list[float]]:
        """Each series' quantiles: its order statistics found a digit a pass, then interpolated."""
        wanted = {}  # (series, rank) -> [depth, prefix, rank under the prefix, key or None]
        for (g, name), n in self.n.items():
            if n:
                below, above, _ = _ranks(n, QUANTILES[name])
                for rank in {*below.tolist(), *above.tolist()}:
                    wanted[(g, name), rank] = [0, 0, rank, None]
        job = self._first
        while True:
            self._settle(job, wanted)
            open_ = {k: w for k, w in wanted.items() if w[3] is None}
            if not open_:
                break
            job = _Pass()
            for (series, _), (depth, prefix, _, _) in open_.items():
                target = (series, depth, prefix)
                if self._under(series, depth, prefix) <= COLLECT:
                    job.gather.setdefault(target, [])
                else:
                    job.hist.setdefault(target, np.zeros(1 << DIGIT, dtype=np.int64))
            self._scan(job)
        return {series: self._interpolate(series, wanted) for series in self.n}

    def _under(self, series, depth: int, prefix: int) -> int:
        """How many of the series' values have this prefix, from the last histogram taken of it."""
        return self._sizes.get((series, depth, prefix), self.n[series])

    def _settle(self, job: _Pass, wanted: dict) -> None:
        """Move each open order statistic a digit down the histograms, or read it off the gathered keys."""
        for (series, _), w in wanted.items():
            depth, prefix, rank, key = w
            if key is not None:
                continue
            target = (series, depth, prefix)
            if target in job.gather:
                keys = np.sort(np.concatenate(job.gather[target] or [np.empty(0, np.uint64)]))
                w[3] = int(keys[rank])
            elif target in job.hist:
                cum = np.cumsum(job.hist[target])
                digit = int(np.searchsorted(cum, rank, side="right"))
                before = int(cum[digit - 1]) if digit else 0
                depth += DIGIT
                prefix = (prefix << DIGIT) | digit
                self._sizes[series, depth, prefix] = int(job.hist[target][digit])
                w[:3] = depth, prefix, rank - before
                if depth == 64:
                    w[3] = prefix

    def _interpolate(self, series, wanted: dict) -> list[float]:
        g, name = series
        n = self.n[series]
        if not n or (name in ("latency", "refusal") and self.nans[series]):
            return [math.nan] * len(QUANTILES[name])
        below, above, t = _ranks(n, QUANTILES[name])
        a = np.array([_value(wanted[series, r][3]) for r in below])
        b = np.array([_value(wanted[series, r][3]) for r in above])
        return list(_lerp(a, b, t))

    # ------------------------------------------------------------ results
    def _seconds(self) -> float:
        if self._duration_s is not None and self._duration_s > 0:
            return float(self._duration_s)
        if not self.counts:
            return math.nan
        span = float(self.span[1] - self.span[0])
        return span if span > 0 else math.nan

    def _row(self, g: int) -> dict[str, float]:
        """metrics._summary's row of one group, in its order."""
        counts = self.counts.get(g, np.zeros(len(OUTCOMES), dtype=np.int64))
        n = int(counts.sum())
        row: dict[str, float] = {"requests": n}
        row.update({o: int(c) for o, c in zip(OUTCOMES, counts)})
        row["refused"] = row["rejected"] + row["expired"]
        q = {name: self.quantiles.get((g, name), [math.nan] * len(qs)) for name, qs in QUANTILES.items()}
        row.update(share_good=row["good"] / n if n else math.nan,
                   share_refused=row["refused"] / n if n else math.nan,
                   goodput_rps=np.int64(row["good"]) / self.seconds,
                   good_tokens_per_s=np.int64(self.tokens.get(g, 0)) / self.seconds,
                   latency_p50_s=q["latency"][0], latency_p90_s=q["latency"][1],
                   latency_p99_s=q["latency"][2], refusal_p50_s=q["refusal"][0],
                   refusal_p99_s=q["refusal"][1])
        row.update(ttft_p50_s=q["ttft"][0], ttft_p99_s=q["ttft"][1], tpot_p50_s=q["tpot"][0],
                   tpot_p99_s=q["tpot"][1])
        return {k: float(v) for k, v in row.items()}

    def summary(self) -> dict[str, float]:
        """What metrics.summary gives for the frame of these rows (no retries or prefix cache stream)."""
        return self._row(0)

    def by_class(self) -> pd.DataFrame:
        """What metrics.by_class gives for the frame of these rows."""
        total = self._row(0)["requests"]
        named = sorted((v for v in self.labels if not pd.isna(v)), key=metrics._class_key)
        index = named + [v for v in self.labels if pd.isna(v)]
        rows = [{**self._row(self.labels[v]), "share_of_requests": float(self._row(self.labels[v])["requests"]
                                                                          / total)} for v in index]
        if not rows:
            columns = list(self._row(0)) + ["share_of_requests"]
            return pd.DataFrame(columns=columns, index=pd.Index([], name="size_class", dtype=object))
        return pd.DataFrame(rows, index=pd.Index(index, name="size_class", dtype=object))
