"""Progress bars for the long commands: on stderr, and only where someone watches it.

stdout stays the command's output alone (docs tests compare it byte for byte, scripts parse its
JSON); a bar on a pipe or a log file is noise, so it shows only when stderr is a terminal.
"""

from __future__ import annotations

import sys


def shown(quiet: bool = False) -> bool:
    """Whether a bar would be drawn: not ``quiet`` (--quiet, --json) and stderr is a terminal."""
    return not quiet and sys.stderr.isatty()


def progress_bar(
    total: int | None, *, unit: str, quiet: bool = False, initial: int = 0, desc: str | None = None
):
    """A tqdm bar on stderr, disabled (drawing nothing, costing next to nothing) unless
    :func:`shown`."""
    from tqdm import tqdm  # imported here: a command that draws no bar need not load it

    return tqdm(
        total=total,
        initial=initial,
        unit=unit,
        desc=desc,
        disable=not shown(quiet),
        dynamic_ncols=True,
        file=sys.stderr,
    )
