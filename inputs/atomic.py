"""Files written so a reader never sees half of one: the crash safety of sweeps and live runs.

A file is written under a hidden temporary name in its own folder and renamed
into place (``os.replace`` is atomic on one file system), so a process killed
at any moment leaves either the whole file or none. A temporary left by a
SIGKILL is named ``.NAME.tmp-PID``: :func:`clear_temporaries` removes them.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

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
