"""Files written so a reader never sees half of one: the crash safety of sweeps and live runs.

A file is written under a hidden temporary name in its own folder and renamed into place
(``os.replace`` is atomic on one file system), so a process killed at any moment leaves either the
whole file or none. A temporary left by a SIGKILL is named ``.NAME.tmp-PID``:
:func:`clear_temporaries` removes them. SIGINT and SIGTERM leave none: :func:`sigterm_interrupts`
makes SIGTERM raise as SIGINT does, so the writers' clean-up (here, and
:class:`qsim.stream.RecordWriter`'s ``.partial`` file) runs.
"""

from __future__ import annotations

import io
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pandas as pd


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # an interrupt (SIGINT) or a full disk: leave no temporary behind
        tmp.unlink(missing_ok=True)
        raise


def parquet_bytes(frame: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    return buffer.getvalue()


def write_parquet(frame: pd.DataFrame, path: str | Path) -> None:
    """``frame.to_parquet(path)``, atomically."""
    atomic_write(path, parquet_bytes(frame))


def clear_temporaries(folder: str | Path) -> None:
    """Remove the temporaries a killed writer left in ``folder``."""
    for stale in Path(folder).glob(".*.tmp-*"):
        stale.unlink(missing_ok=True)


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt, as SIGINT is, so that ``finally`` blocks run: a
    temporary file is removed, a server started for a run is stopped.

    Python's default for SIGTERM ends the process at once, skipping them. Only the main thread
    may set a handler; elsewhere (a library caller's thread) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
