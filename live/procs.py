"""A ``qlab serve`` subprocess: start it on a free port, learn its URL, stop it cleanly.

Its flags are its :class:`live.serve_options.ServeOptions`
(:meth:`~live.serve_options.ServeOptions.argv`), with ``--port 0`` (a free port) and
``--watch-stdin``.

The server prints ``qlab serve: listening on http://HOST:PORT`` as its first
line on stdout; everything it says after that goes to a log file, so a chatty
server can never fill the pipe and stall.

A server started here never outlives its parent: its stdin is a pipe from the
parent and it runs with ``--watch-stdin``, so when the parent ends, however
it ends (SIGKILL included), the kernel closes the pipe and the server stops.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import httpx

from .serve_options import ServeOptions

LISTENING = re.compile(r"listening on (https?://\S+)")
ROOT = Path(__file__).resolve().parents[1]


class Server:
    """A running ``qlab serve``; ``url`` is known once :meth:`start` returns."""

    def __init__(self, options: ServeOptions, log_path: str | Path) -> None:
        self.options = options
        self.log_path = Path(log_path)
        self.url = ""
        self._log = None
        self._copier: threading.Thread | None = None
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> None:
        """Launch without waiting (so several servers load their models side by side)."""
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        # stdin: the pipe whose end tells the server (--watch-stdin) that this process is gone.
        argv = replace(self.options, port=0, watch_stdin=True).argv()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float) -> str:
        """Read the URL from the first stdout line, then wait for /healthz; ValueError on
        failure."""
        line = _first_line(self.proc, timeout_s)
        match = LISTENING.search(line or "")
        if not match:
            self.stop()
            raise ValueError(
                f"qlab serve --policy {self.options.policy} did not start: first line "
                f"{line!r}; "
                f"see {self.log_path}:\n{_tail(self.log_path)}"
            )
        self.url = match.group(1).rstrip("/")
        self._copier = threading.Thread(
            target=shutil.copyfileobj, args=(self.proc.stdout, self._log), daemon=True
        )
        self._copier.start()
        _wait_healthy(self.url, timeout_s)
        return self.url

    def start(self, timeout_s: float = 180.0) -> str:
        self.spawn()
        return self.wait_ready(timeout_s)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """Die at once, as a crash would (tests of the replayer's error path)."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (uvicorn finishes what it holds), then SIGKILL after ``grace_s``."""
        if self.proc is None:
            return
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._copier:
            self._copier.join(2.0)  # the copy ends at EOF, once the process is gone
        if self.proc.stdin:
            self.proc.stdin.close()
        if self._log:
            self._log.close()


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """The first stdout line, or None if the process exits or says nothing in time."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0] if box else None


def _wait_healthy(url: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            raise ValueError(f"{url}/healthz did not answer 200 within {timeout_s:g} s")
        time.sleep(0.05)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextmanager
def serving(
    options: list[ServeOptions],
    log_dir: str | Path,
    timeout_s: float = 180.0,
    prefix: str = "serve",
) -> Iterator[list[Server]]:
    """Start every server at once (models load in parallel), yield them ready, always stop them.

    Logs go to LOG_DIR/PREFIX-POLICY.log.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        servers = []
        for opt in options:
            server = Server(opt, log_dir / f"{prefix}-{opt.policy}.log")
            stack.callback(server.stop)
            server.spawn()
            servers.append(server)
        for server in servers:
            server.wait_ready(timeout_s)
        yield servers
