"""Files: written so a reader never sees half of one (the crash safety of sweeps and live runs),
and configuration files read with errors that name the file and line.

A file is written under a hidden temporary name in its own folder and renamed
into place (``os.replace`` is atomic on one file system), so a process killed
at any moment leaves either the whole file or none. A temporary left by a
SIGKILL is named ``.NAME.tmp-PID``: :func:`clear_temporaries` removes them.
"""

from __future__ import annotations

import io
import os
import tomllib
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


def read_toml(path: str | Path) -> dict:
    """A TOML file's tables; ValueError naming the file (and line) when it cannot be read or parsed."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:  # TOML is UTF-8; say where, as for any other syntax error
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path}: not valid TOML: not UTF-8 text ({exc.reason} at line {line})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
