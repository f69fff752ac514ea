"""A simulation whose records stream to a parquet file as it runs, in row groups and in request
order.

:func:`simulate_to_parquet` runs what :func:`qsim.simulate` runs, with the same driver and the same
core, and writes the same rows; but it reads its trace a chunk at a time
(:class:`qsim.chunks.TraceChunks`: a synthetic trace's from :meth:`qsim.workload.TracePlan.chunks`,
or a trace in memory cut by :meth:`qsim.trace.Trace.chunks`) and keeps only the requests it has not
written yet. Its memory is that of the requests in flight, a few chunks and a row group, whatever
the trace's length.

How: the driver's per-request lists are a window of *slots*, a chunk's worth (a block) at a time.
The core's handle of a request is its slot, so the event loop indexes its lists exactly as an
in-memory run does. When the arrivals reach the end of a block, the next chunk of the trace is
loaded into a free block; the oldest blocks whose every request has an outcome are written (in
request order: a block waits for the ones before it), and a written block is free again once no
timer of its requests (a client's patience, an engine's run) can still fire.

A fleet (N replicas behind a router, :mod:`qsim.fleet`) streams as one server does: its driver's
lists are the same window, and the replica each request went to is one more of them. What does not
stream: clients that send again (a retry's row follows the whole trace's, and the retry budget
counts first sends around it), a prefix cache (its requests' tokens are the whole trace's), and the
per-request inputs that :func:`qsim.simulate` takes beside its trace (failures, reported times): a
streamed run reads what its trace carries.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from . import records
from .chunks import TraceChunks
from .clients import RetryPolicy
from .config import ServerConfig, as_config
from .fleet import FleetSpec
from .driver import Simulation
from .model import CANCEL_UNTIL, engine_part
from .policy import Policy
from .service import SpeedSchedule
from .mixes import REFERENCE_MIX
from .trace import Trace, assemble_trace

#: Requests per chunk of the trace (a block of the driver's window) unless told otherwise: the
#: driver keeps two or three blocks at a time when few requests wait long.
CHUNK = 8_192
#: Rows per row group of the file unless told otherwise: a few chunks' records, held as arrow tables
#: until written. Larger groups would hold more; smaller ones cost the writer about 0.8 KB a column
#: a group until it closes (parquet's footer describes every group), about 27 MB at 20 million rows
#: in groups of 16,384.
ROW_GROUP = 65_536


@dataclass(frozen=True)
class StreamResult:
    """What a streamed run wrote: ``rows`` records; ``slots``, the most requests its window held at
    once (its memory); and what :func:`qsim.simulate` puts in its frame's attrs (the trace's
    duration, the policy, the engines, the final speed factor)."""

    rows: int
    slots: int
    duration_s: float
    policy: str
    engines: int
    speed_factor: float


class RecordWriter:
    """A parquet file of records written in row groups of ``row_group`` rows (the last: what is
    left), to a hidden file beside ``path`` that takes its name when the writer closes after success
    and is removed after a failure: a half-written file never takes a path's name. A path that
    cannot be written is a ValueError on opening, before any run."""

    def __init__(self, path: str | Path, row_group: int = ROW_GROUP) -> None:
        if not (isinstance(row_group, (int, np.integer)) and row_group >= 1):
            raise ValueError(f"a row group holds a whole number >= 1 of rows, got {row_group!r}")
        self.path = Path(path)
        self.row_group = int(row_group)
        self._partial = self.path.with_name(f".{self.path.name}.partial")
        self._file = None
        self._writer: pq.ParquetWriter | None = None
        self._held: list[pa.Table] = []  # records not written yet, fewer than a row group
        self._held_rows = 0
        self.row_groups = 0

    def __enter__(self) -> "RecordWriter":
        if self.path.is_dir():
            raise ValueError(f"cannot write records to {self.path}: it is a directory")
        try:
            self._file = open(self._partial, "wb")
        except OSError as exc:
            raise ValueError(
                f"cannot write records to {self.path}: {exc.strerror or exc}"
            ) from None
        return self

    @property
    def started(self) -> bool:
        """Whether a frame has set the file's schema."""
        return self._writer is not None

    def write(self, frame: pd.DataFrame) -> None:
        """Append ``frame``'s rows (the first frame sets the file's schema), writing each row
        group once full."""
        if self._writer is None:
            table = pa.Table.from_pandas(frame, preserve_index=False)
            self._writer = pq.ParquetWriter(self._file, table.schema)
        else:
            table = pa.Table.from_pandas(frame, schema=self._writer.schema, preserve_index=False)
        self._held.append(table)
        self._held_rows += len(frame)
        while self._held_rows >= self.row_group:
            self._write_group(self.row_group)

    def _write_group(self, rows: int) -> None:
        held = pa.concat_tables(self._held)  # no copy: the tables' chunks side by side
        self._writer.write_table(held.slice(0, rows), row_group_size=max(rows, 1))
        rest = held.slice(rows)
        self._held, self._held_rows = ([rest] if rest.num_rows else []), rest.num_rows
        self.row_groups += 1

    def __exit__(self, kind, value, traceback) -> None:
        try:
            if kind is None:
                if self._writer is None:  # nothing written: an empty file of the schema
                    self.write(records.empty())
                if self._held_rows or self.row_groups == 0:
                    self._write_group(self._held_rows)
            if self._writer is not None:
                self._writer.close()
        finally:
            self._file.close()
            if kind is None:
                os.replace(self._partial, self.path)
            else:
                self._partial.unlink(missing_ok=True)


def simulate_to_parquet(
    source: Trace | TraceChunks,
    path: str | Path,
    config: ServerConfig | Policy = ServerConfig(),
    *,
    cancel_until: str | None = None,
    retry: RetryPolicy | None = None,
    speed_schedule: SpeedSchedule | None = None,
    chunk: int = CHUNK,
    row_group: int = ROW_GROUP,
    fleet: FleetSpec | None = None,
) -> StreamResult:
    """Run ``source`` through a server as :func:`qsim.simulate` does and write its records to the
    parquet file ``path`` as the run goes, in request order, in row groups of ``row_group`` rows
    (reading the file back gives simulate's frame for the same trace and server). source: a trace's
    chunks (:class:`qsim.chunks.TraceChunks`, read in its own chunk size) or a trace (cut into
    chunks of ``chunk``). config, cancel_until and speed_schedule: as simulate's. retry: None or one
    that never retries (retries do not stream). fleet: N replicas of the server behind a router
    (simulate's replicas, router, replica_speeds, replica_down)."""
    with RecordWriter(path, row_group) as writer:
        return stream_run(
            source,
            writer,
            config,
            cancel_until=cancel_until,
            retry=retry,
            speed_schedule=speed_schedule,
            chunk=chunk,
            fleet=fleet,
        )


def stream_run(
    source: Trace | TraceChunks,
    writer: RecordWriter,
    config: ServerConfig | Policy = ServerConfig(),
    *,
    cancel_until: str | None = None,
    retry: RetryPolicy | None = None,
    speed_schedule: SpeedSchedule | None = None,
    chunk: int = CHUNK,
    columns: dict | None = None,
    fleet: FleetSpec | None = None,
) -> StreamResult:
    """:func:`simulate_to_parquet` into an open :class:`RecordWriter` (several runs may share one
    file), each record with the constant ``columns`` added (as ``frame.assign(**columns)``: the
    command line adds each run's seed and policy)."""
    config = ServerConfig(config) if isinstance(config, Policy) else as_config(config)
    if retry is not None and retry.retries:
        raise ValueError(
            "clients that send again do not stream (a retry's row follows the whole "
            "trace's): "
            "run qsim.simulate for retries"
        )
    if config.batching and config.engine.prefix_caching:  # a slot is no trace request: no tokens
        raise ValueError(
            "a prefix cache does not stream (its requests' tokens are the whole "
            "trace's): run qsim.simulate with prefix caching"
        )
    chunks = source.chunks(chunk) if isinstance(source, Trace) else source
    if cancel_until is None:
        cancel_until = chunks.meta.get("patience_until", "answer")
    if cancel_until not in CANCEL_UNTIL:
        raise ValueError(
            f"cancel_until must be one of {', '.join(CANCEL_UNTIL)}, got {cancel_until!r}"
        )
    if fleet is not None:
        fleet.check(config)
    inputs = dict(cancel_until=cancel_until, speed_schedule=speed_schedule, fleet=fleet)
    part = engine_part(config)
    rows = 0

    def write(frame: pd.DataFrame) -> None:
        nonlocal rows
        writer.write(frame if not columns else frame.assign(**columns))
        rows += len(frame)

    parts = iter(chunks)
    first = next(parts, None)
    slots = 0
    if first is None:  # no requests: the schema alone
        factor = Simulation(_NO_REQUESTS, config, part, **inputs).speed_factor()
    else:
        run = _StreamedRun(first, config, part, cancel_after_s=first.patience_s, **inputs)
        run.stream(first, parts, chunks.size, inputs, write)
        factor, slots = run.speed_factor(), len(run.arrival)
    # no requests, and the first run in the file: its schema, its own columns too
    if not writer.started:
        write(records.empty())
    return StreamResult(rows, slots, chunks.duration_s, config.policy.name, config.engines, factor)


_NO_REQUESTS = assemble_trace(
    np.empty(0),
    np.empty(0, dtype=np.int64),
    np.empty(0),
    np.empty(0),
    mix=REFERENCE_MIX,
    duration_s=0.0,
    name="none",
    meta={},
)


class _Block(NamedTuple):
    """Requests first .. first + len(trace) - 1, held in slots slot .. slot + len(trace) - 1."""

    slot: int
    first: int
    trace: Trace


class _StreamedRun(Simulation):
    """The driver whose lists are a window of slots, whatever its engines and queue core."""

    def stream(self, first: Trace, parts, size: int, inputs: dict, write) -> None:
        """Run ``first`` (the chunk this driver was made from) and the chunks ``parts``, writing
        as it goes."""
        self._parts, self._size, self._inputs, self._write = parts, size, inputs, write
        if len(first) > size:
            raise ValueError(f"a trace's chunks hold at most {size} requests, got {len(first)}")
        self._names = _rows(self)
        for values in self._names.values():  # the first block as long as every other
            values.extend([None] * (size - self.n))
        # What builds a block's records: an in-memory run of a chunk, whose rows become the block's
        # each time.
        self._view = self._made(first)
        self._view_rows = _rows(self._view)
        self._pending: deque[_Block] = deque([_Block(0, 0, first)])
        # (when its last timer is due, slot) of written blocks
        self._cooling: list[tuple[float, int]] = []
        self._free: list[int] = []
        self._next_id = self.n
        self._last_arrival = first.arrival_s[-1] if self.n else -math.inf
        self.arrivals()
        self.env.run()
        self._flush(final=True)

    def arrivals(self, _event=None) -> None:
        super().arrivals(_event)
        # the block's last request came: on to the next chunk
        while self.next_arrival == self.n and self._load():
            super().arrivals()

    def _load(self) -> bool:
        trace = next(self._parts, None)
        if trace is None:
            return False
        m = len(trace)
        if m > self._size:
            raise ValueError(f"a trace's chunks hold at most {self._size} requests, got {m}")
        if m and (trace.arrival_s[0] < self._last_arrival or np.any(np.diff(trace.arrival_s) < 0)):
            raise ValueError("trace arrivals must be sorted by time")
        self._flush()
        slot = self._free.pop() if self._free else self._grow()
        scratch = self._scratch(trace)
        for name, values in scratch.items():
            self._names[name][slot : slot + m] = values
        self._pending.append(_Block(slot, self._next_id, trace))
        self._next_id += m
        self._last_arrival = trace.arrival_s[-1] if m else self._last_arrival
        self.next_arrival, self.n = slot, slot + m
        return True

    def _grow(self) -> int:
        slot = len(self.arrival)
        for values in self._names.values():
            values.extend([None] * self._size)
        return slot

    def _scratch(self, trace: Trace) -> dict:
        """A new chunk's rows as an in-memory run of it starts them (its inputs, and what it
        writes unwritten)."""
        rows = _rows(self._made(trace))
        if rows.keys() != self._names.keys():
            raise AssertionError(
                f"a chunk's rows {sorted(rows)} are not the run's {sorted(self._names)}"
            )
        return rows

    def _made(self, trace: Trace):
        """An in-memory run of one chunk (never run: its lists are what a row starts with, or a
        block's rows)."""
        return Simulation(
            trace,
            self.queue.config,
            type(self.engine),
            cancel_after_s=trace.patience_s,
            **self._inputs,
        )

    def _flush(self, final: bool = False) -> None:
        """Write the oldest blocks whose every request has ended; free the written ones no timer
        can reach now."""
        now = self.env.now
        while self._pending:
            block = self._pending[0]
            end = block.slot + len(block.trace)
            if None in self.outcome[block.slot : end]:
                if final:
                    raise AssertionError("a request ended the run without an outcome")
                break
            self._pending.popleft()
            self._write(self._frame(block))
            self._cooling.append((self._last_timer(block.slot, end), block.slot))
        ready = [slot for due, slot in self._cooling if due <= now]
        self._cooling = [(due, slot) for due, slot in self._cooling if due > now]
        self._free.extend(ready)

    def _last_timer(self, lo: int, hi: int) -> float:
        """When the last timer that names one of these slots can fire: a client's patience (from its
        arrival) or the end of an engine's run (a run goes on after its client left; a stall timer
        fires before its end)."""
        arrival = np.asarray(self.arrival[lo:hi], dtype=float)
        due = np.concatenate(
            [
                arrival + np.asarray(self.patience[lo:hi], dtype=float),
                np.asarray(self.start[lo:hi], dtype=float)
                + np.asarray(self.ran[lo:hi], dtype=float),
            ]
        )
        return float(np.max(due[np.isfinite(due)], initial=-math.inf))

    def _frame(self, block: _Block) -> pd.DataFrame:
        """The block's records, as an in-memory run of its chunk builds them from its rows."""
        end = block.slot + len(block.trace)
        for name, values in self._view_rows.items():
            values[:] = self._names[name][block.slot : end]
        columns = self._view._columns(block.trace)
        columns["request_id"] = columns["request_id"] + block.first
        columns["first_request_id"] = np.asarray(columns["first_request_id"]) + block.first
        return records.from_arrays(columns)


def _rows(run: Simulation) -> dict:
    """A run's per-request rows by name, every one a list: an in-memory run keeps some as arrays,
    and patience as None where nobody is impatient (forever, as a list)."""
    if run.patience is None:
        run.patience = [math.inf] * run.n
    if isinstance(run.prompt_tokens, np.ndarray):
        run.prompt_tokens, run.generated = run.prompt_tokens.tolist(), run.generated.tolist()
    return {name: values for name, values in run._rows().items() if values is not None}
