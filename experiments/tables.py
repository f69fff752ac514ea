"""Markdown (pipe) tables, as ``qlab summary --format markdown`` prints them and ``qlab study``'s
report holds them.

A module of its own so that the summary command and the study share it without importing each other.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd


def table_cell(value) -> str:
    """A value as a table shows it: 4 significant digits, "-" for NaN, yes or no."""
    if isinstance(value, (float, np.floating)):
        return "-" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    return str(value)


def pipe_table(frame: pd.DataFrame) -> str:
    """A markdown (pipe) table; | in a cell is escaped."""
    cells = [
        [table_cell(v).replace("|", "\\|") for v in row] for row in frame.itertuples(index=False)
    ]
    head = [str(c).replace("|", "\\|") for c in frame.columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])
