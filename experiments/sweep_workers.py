"""A sweep's local pool workers (:func:`experiments.sweep.executor`): each ignores Ctrl-C (the
parent stops the sweep) and ends when the sweep process dies, however it dies (a SIGKILLed sweep
runs no cleanup: see :func:`worker_start`)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path


def _ignore_sigint() -> None:
    """In a pool worker: Ctrl-C is for the parent, which stops the sweep (a worker would print a
    traceback). SIGTERM ends a worker at once, as Python's default does: a forked worker inherits
    the parent's handler, which turns it into an interrupt (qlab's main), but a worker writes no
    file and has nothing to clean up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); False where it
    cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc symbol table (static or unusual builds)
        return False


def _watch(still_there, every_s: float = 0.5) -> None:
    """A daemon thread's loop: end this process once ``still_there()`` is false."""
    while still_there():
        time.sleep(every_s)
    os._exit(1)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists (a zombie, killed but not yet reaped, does not
    count)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone (or its pid is now someone else's)
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc: take kill's word
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def worker_start(sweep_pid: int) -> None:
    """Pool worker initializer: ignore Ctrl-C, and end when the sweep process dies, however it dies.

    A SIGKILLed sweep runs no cleanup, so its idle workers (about 180 MB each) would wait on
    their call queue forever as orphans. On Linux prctl(PR_SET_PDEATHSIG, SIGKILL) makes the
    kernel kill the worker the moment its parent dies: no polling, and it works even while the
    worker is busy inside C code holding the GIL. It applies only from the call on, so a parent
    that died between the fork and the call is caught by checking the parent pid right after it
    (then the worker has already been re-parented). The signal follows the *thread* that forked
    the worker; ProcessPoolExecutor starts its workers from the thread that submits, here the
    sweep's own, which outlives the pool (its manager thread starts workers only to replace
    ones retired by max_tasks_per_child, which is not set). Where prctl is unavailable, a daemon
    thread polls os.getppid() instead (a re-parented process sees another parent pid). With the
    forkserver start method (Python 3.14's default on Linux) the parent is the fork server,
    which outlives the sweep as long as it has children: there the thread polls whether the
    sweep still runs.
    """
    _ignore_sigint()
    if os.getppid() == sweep_pid:  # fork or spawn: the sweep is the parent
        if _die_with_parent():
            if os.getppid() != sweep_pid:  # the sweep died before the request took effect
                os._exit(1)
            return
        still_there = lambda: os.getppid() == sweep_pid  # noqa: E731
    else:  # a fork server's child, or the sweep died before this worker got here
        still_there = lambda: _alive(sweep_pid)  # noqa: E731
    if not still_there():
        os._exit(1)
    threading.Thread(
        target=_watch, args=(still_there,), name="qlab-sweep-watch", daemon=True
    ).start()
