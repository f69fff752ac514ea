"""A run's summary read from its records' parquet file in bounded memory, exactly as metrics
computes it.

``qlab simulate --out`` streams records to a file (qsim.stream); reading every record back to
summarise them cost more memory than the run itself (0.7 GB at 2 million requests). Here the file is
read a batch of rows at a time: counts and sums add up batch by batch, and each latency percentile
is found by radix selection (a few passes over the file, each a histogram of 12 more bits of the
values' order-preserving keys, then the few values left, sorted). The percentiles are np.quantile's
own (its linear method, from the same two order statistics), not an estimate: the printed output of
a streamed run is unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from qsim.records import OUTCOMES

from . import metrics

BATCH = 65_536  # rows read at a time
DIGIT = 12  # bits a pass selects on: a histogram of 4,096 counts (32 KB) a series
COLLECT = 8_192  # values few enough to gather and sort instead of another pass
#: metrics._summary's quantiles of each series.
QUANTILES = {
    "latency": (0.5, 0.9, 0.99),
    "refusal": (0.5, 0.99),
    "ttft": (0.5, 0.99),
    "tpot": (0.5, 0.99),
}
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
    """np.quantile's linear method: the order statistics below and above each quantile, and the
    weight."""
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


def _width(depth: int) -> int:
    """Bits the digit below ``depth`` bits holds (the last: what is left of 64)."""
    return min(DIGIT, 64 - depth)


def _column(file: pq.ParquetFile, group: int, name: str) -> np.ndarray:
    """One column of one row group as numpy (nulls NaN, or None in a dictionary column's labels)."""
    return file.read_row_group(group, columns=[name], use_threads=False).column(0).to_numpy()


def _codes(file: pq.ParquetFile, group: int, name: str, code_of) -> np.ndarray:
    """A dictionary column of one row group as integer codes: ``code_of`` of each label (None:
    null), looked up once a label, not once a row (strings through pandas cost more than the
    rest)."""
    column = file.read_row_group(group, columns=[name], use_threads=False).column(0)
    parts = []
    for chunk in column.chunks:
        # a null is a label only where there is one
        null = code_of(None) if chunk.null_count else -1
        lookup = np.array(
            [code_of(v) for v in chunk.dictionary.to_pylist()] + [null], dtype=np.intp
        )
        indices = chunk.indices.fill_null(len(lookup) - 1).to_numpy()
        parts.append(lookup[indices])
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.intp)


class _Pass:
    """One read of the file: for each series, a histogram of one digit of its keys under a prefix,
    or the keys under a prefix gathered."""

    def __init__(self) -> None:
        # (series, depth, prefix) -> counts of the next digit
        self.hist: dict[tuple, np.ndarray] = {}
        self.gather: dict[tuple, list] = {}  # (series, depth, prefix) -> keys
        # (series, depth, prefix) -> (distinct keys, their counts) under it, while there are at most
        # COLLECT of them (None: more): values that repeat (a refusal's 0 s, a time per token of a
        # few values) are read off these at once, where digits would take a pass each down to the
        # last bit.
        self.distinct: dict[tuple, tuple | None] = {}

    def wants(self, series) -> bool:
        return any(k[0] == series for k in (*self.hist, *self.gather))

    def add(self, series, keys: np.ndarray) -> None:
        for job in (*self.hist, *self.gather):
            if job[0] != series:
                continue
            _, depth, prefix = job
            mine = (
                keys if depth == 0 else keys[(keys >> np.uint64(64 - depth)) == np.uint64(prefix)]
            )
            if job in self.hist:
                width = _width(depth)
                digit = (mine >> np.uint64(64 - depth - width)) & np.uint64((1 << width) - 1)
                self.hist[job] += np.bincount(digit.astype(np.intp), minlength=1 << width)
                self._tally(job, mine)
            else:
                self.gather[job].append(mine)

    def _tally(self, job: tuple, keys: np.ndarray) -> None:
        if job in self.distinct and self.distinct[job] is None:
            return
        seen = [self.distinct[job]] if job in self.distinct else []
        merged = np.concatenate([*(k for k, _ in seen), keys])
        weights = np.concatenate([*(c for _, c in seen), np.ones(len(keys), dtype=np.int64)])
        unique, where = np.unique(merged, return_inverse=True)
        self.distinct[job] = (
            None
            if len(unique) > COLLECT
            else (unique, np.bincount(where, weights=weights).astype(np.int64))
        )


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
        """The rows of this seed a row group at a time, as numpy arrays, read a column at a time:
        reading them together, or through pandas, holds more of the file at once."""
        columns = ["outcome", "size_class", "latency_s", "ttft_s", "tpot_s"]
        if first:
            columns += ["max_new_tokens", "kv_blocks_peak", "ttft_slo_s", "arrival_s", "finish_s"]
        file = pq.ParquetFile(
            self.path, pre_buffer=False, read_dictionary=["outcome", "size_class"]
        )
        names = set(file.schema_arrow.names)
        wanted = [c for c in columns if c in names]
        for group, mine in self._groups(file):
            batch = {
                c: _column(file, group, c) for c in wanted if c not in ("outcome", "size_class")
            }
            batch["outcome"] = _codes(file, group, "outcome", self._outcome_code)
            batch["size_class"] = _codes(file, group, "size_class", self._group_code(first))
            yield batch if mine is None or mine.all() else {c: v[mine] for c, v in batch.items()}

    def _groups(self, file: pq.ParquetFile):
        """Each row group holding rows of this seed, with which of its rows are (None: all, no
        seed)."""
        for group in range(file.num_row_groups):
            mine = None
            if self.seed is not None:
                mine = _column(file, group, "seed") == self.seed
                if not mine.any():
                    continue
            yield group, mine

    def by_replica(self, replicas: int) -> pd.DataFrame:
        """metrics.by_replica of this seed's rows, a row group at a time (its counts and sums add
        up)."""
        file = pq.ParquetFile(self.path, pre_buffer=False)
        total = metrics.by_replica(
            pd.DataFrame(
                {"replica": pd.array([], dtype="Int64"), "start_s": [], "true_service_s": []}
            ),
            replicas,
        )
        for group, mine in self._groups(file):
            rows = file.read_row_group(
                group, columns=["replica", "start_s", "true_service_s"], use_threads=False
            ).to_pandas()
            total += metrics.by_replica(rows if mine is None else rows[mine], replicas)
        return total

    def _scan(self, job: _Pass, first: bool = False) -> None:
        for frame in self._batches(first):
            outcome, group = frame["outcome"], frame["size_class"]
            if first:
                self._count(frame, outcome, group)
            for series, keys in self._series(frame, outcome, group, first):
                if first:
                    job.hist.setdefault((series, 0, 0), np.zeros(1 << DIGIT, dtype=np.int64))
                if job.wants(series):
                    job.add(series, keys)

    @staticmethod
    def _outcome_code(label) -> int:
        return OUTCOMES.index(label) if label in OUTCOMES else -1

    def _group_code(self, first: bool):
        """A size class's group number (1, 2, ... in the order met; NaN's None too), new ones in the
        first pass."""

        def code_of(label) -> int:
            if first and label not in self.labels:
                self.labels[label] = len(self.labels) + 1
            return self.labels.get(label, -1)

        return code_of

    def _count(self, frame: dict, outcome: np.ndarray, group: np.ndarray) -> None:
        tokens = frame["max_new_tokens"]
        good = outcome == OUTCOMES.index("good")
        for g in [0, *np.unique(group)]:
            mine = slice(None) if g == 0 else group == g
            counts = np.bincount(outcome[mine][outcome[mine] >= 0], minlength=len(OUTCOMES))
            self.counts[g] = self.counts.get(g, 0) + counts
            self.tokens[g] = self.tokens.get(g, 0) + tokens[mine][good[mine]].sum()
        self.span = [
            min(self.span[0], np.min(frame["arrival_s"])),
            max(self.span[1], np.max(frame["finish_s"])),
        ]
        self.timed = self.timed or any(
            c in frame and pd.notna(frame[c]).any() for c in ("kv_blocks_peak", "ttft_slo_s")
        )

    def _series(self, frame, outcome, group, first: bool):
        """(group, name) and the keys of its values in this batch: the whole run's and each
        class's."""
        answered, refused = np.isin(outcome, _ANSWERED), np.isin(outcome, _REFUSED)
        latency = np.asarray(frame["latency_s"], dtype=float)
        nan = np.full(len(latency), np.nan)
        columns = {
            "latency": (latency, answered),
            "refusal": (latency, refused),
            "ttft": (np.asarray(frame.get("ttft_s", nan), dtype=float), answered),
            "tpot": (np.asarray(frame.get("tpot_s", nan), dtype=float), answered),
        }
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
                    job.hist.setdefault(target, np.zeros(1 << _width(depth), dtype=np.int64))
            self._scan(job)
        return {series: self._interpolate(series, wanted) for series in self.n}

    def _under(self, series, depth: int, prefix: int) -> int:
        """How many of the series' values have this prefix, from the last histogram taken of it."""
        return self._sizes.get((series, depth, prefix), self.n[series])

    def _settle(self, job: _Pass, wanted: dict) -> None:
        """Move each open order statistic a digit down the histograms, or read it off the
        gathered keys."""
        for (series, _), w in wanted.items():
            depth, prefix, rank, key = w
            if key is not None:
                continue
            target = (series, depth, prefix)
            if target in job.gather:
                keys = np.sort(np.concatenate(job.gather[target] or [np.empty(0, np.uint64)]))
                w[3] = int(keys[rank])
            elif job.distinct.get(target) is not None:
                keys, counts = job.distinct[target]
                w[3] = int(keys[np.searchsorted(np.cumsum(counts), rank, side="right")])
            elif target in job.hist:
                cum = np.cumsum(job.hist[target])
                digit = int(np.searchsorted(cum, rank, side="right"))
                before = int(cum[digit - 1]) if digit else 0
                prefix = (prefix << _width(depth)) | digit
                depth += _width(depth)
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
        q = {
            name: self.quantiles.get((g, name), [math.nan] * len(qs))
            for name, qs in QUANTILES.items()
        }
        row.update(
            share_good=row["good"] / n if n else math.nan,
            share_refused=row["refused"] / n if n else math.nan,
            goodput_rps=np.int64(row["good"]) / self.seconds,
            good_tokens_per_s=np.int64(self.tokens.get(g, 0)) / self.seconds,
            latency_p50_s=q["latency"][0],
            latency_p90_s=q["latency"][1],
            latency_p99_s=q["latency"][2],
            refusal_p50_s=q["refusal"][0],
            refusal_p99_s=q["refusal"][1],
        )
        row.update(
            ttft_p50_s=q["ttft"][0],
            ttft_p99_s=q["ttft"][1],
            tpot_p50_s=q["tpot"][0],
            tpot_p99_s=q["tpot"][1],
        )
        return {k: float(v) for k, v in row.items()}

    def summary(self) -> dict[str, float]:
        """What metrics.summary gives for the frame of these rows (no retries or prefix cache
        stream)."""
        return self._row(0)

    def by_class(self) -> pd.DataFrame:
        """What metrics.by_class gives for the frame of these rows."""
        total = self._row(0)["requests"]
        named = sorted((v for v in self.labels if not pd.isna(v)), key=metrics._class_key)
        index = named + [v for v in self.labels if pd.isna(v)]
        rows = [
            {
                **self._row(self.labels[v]),
                "share_of_requests": float(self._row(self.labels[v])["requests"] / total),
            }
            for v in index
        ]
        if not rows:
            columns = list(self._row(0)) + ["share_of_requests"]
            return pd.DataFrame(
                columns=columns, index=pd.Index([], name="size_class", dtype=object)
            )
        return pd.DataFrame(rows, index=pd.Index(index, name="size_class", dtype=object))
