"""Values made ready for ``json.dumps``: what the commands print with ``--json``."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def json_ready(obj):
    """NaN and infinities become null: JSON has no such numbers."""
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # e.g. --used's UsedShare
        return json_ready(dataclasses.asdict(obj))
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def saying(as_json: bool):
    """print, flushed (a line said before minutes of work), or nothing: --json's stdout is one
    document."""
    return (lambda line: None) if as_json else (lambda line: print(line, flush=True))
