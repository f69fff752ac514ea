"""What a section's report is made of: text, verdicts, tables, figures, code and failures.

The renderer (:mod:`experiments.study.render`) writes each kind as Markdown and as HTML.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import pandas as pd


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Table:
    frame: pd.DataFrame
    caption: str = ""


@dataclass(frozen=True)
class Figure:
    name: str  # file name stem under figures/
    png: bytes
    caption: str = ""


@dataclass(frozen=True)
class Code:
    text: str


@dataclass(frozen=True)
class Failed:
    error: str


@dataclass(frozen=True)
class Verdict:
    label: str  # "H1", or "check"
    claim: str
    supported: bool | None  # None: the data cannot test it (say why in evidence)
    evidence: str

    @property
    def word(self) -> str:
        return {True: "supported", False: "not supported", None: "not testable"}[self.supported]


def png(fig) -> bytes:
    """A matplotlib figure as PNG bytes; the figure is closed (a report draws dozens)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def not_run(folder: Path) -> list:
    """The report of a section whose folder holds no results."""
    return [Text(f"not available: no results in {folder} (the section did not run)")]
