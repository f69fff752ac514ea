"""Examples in the docs, run as tests (the SimPy / doctest pattern), and their links checked.

An example is a fenced ``console`` block in README.md or docs/*.md::

    ```console
    $ qlab simulate --policy bounded --load 1.5 --seconds 60 --seed 3
    <the output it prints>
    ```

Each ``$ qlab ...`` line is run (the venv's ``qlab``) in a fresh temporary folder
in which ``data/``, ``experiments/`` and ``docs/`` link to the repository's, so
commands read as if typed at the repository root but write nothing into it; the
commands of one block share that folder, in order. Their stdout is compared with
the lines under the command, trailing spaces and blank lines at the end ignored.
In the expected lines, a line ``...`` matches any number of lines, and ``...``
inside a line matches any text.

An HTML comment on the line before the block changes that, options separated by ``;``:

* ``<!-- doc-test: skip -->`` — not run (long runs, GPUs, commands that are not qlab);
* ``<!-- doc-test: skip-output -->`` — run, exit status 0 required, output not compared;
* ``<!-- doc-test: slow -->`` — run and compared only with ``QLAB_DOCS_SLOW=1``;
* ``<!-- doc-test: server: ARGS -->`` — start ``qlab serve --port 0 ARGS`` first and put
  its URL wherever the block says ``http://127.0.0.1:8000``.

``QLAB_DOCS_UPDATE=1`` rewrites the saved output of every compared block that no
longer matches with what the command prints now (keeping a whole-line ``...`` and
the lines around it in place), so ``git diff README.md docs/`` shows what changed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER_URL = "http://127.0.0.1:8000"
LINKED_INTO_TMP = ("data", "experiments", "docs", "tests")  # tests/data: fixtures a doc reads
COMMAND_TIMEOUT_S = 120
# a slow block (run with QLAB_DOCS_SLOW=1) may take minutes, e.g. the full qlab theory
SLOW_COMMAND_TIMEOUT_S = 3600

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doc-test:\s*(.*?)\s*-->\s*$")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Command:
    line: str  # the command, continuation lines joined, without "$ "
    raw: list[str]  # its lines as written
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    path: Path
    lineno: int  # 1-based line of the opening fence
    index: int  # position among the file's console blocks
    options: dict[str, str]
    commands: list[Command]
    body_start: int  # 0-based line index of the first line inside the fence
    body_end: int  # 0-based index of the closing fence

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.lineno}"


def _options(text: str) -> dict[str, str]:
    opts = {}
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        key, _, value = part.partition(":")
        opts[key.strip()] = value.strip()
    return opts


def parse_blocks(path: Path, text: str | None = None) -> list[Block]:
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(2), m.group(3)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if lang == "console":
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            d = _DIRECTIVE.match(lines[k]) if k >= 0 else None
            opts = _options(d.group(1)) if d else {}
            commands: list[Command] = []
            body = lines[i + 1 : j]
            n = 0
            while n < len(body):
                line = body[n]
                if line.startswith("$ "):
                    cmd, raw = line[2:], [line]
                    while cmd.endswith("\\") and n + 1 < len(body):
                        n += 1
                        cmd = cmd[:-1].rstrip() + " " + body[n].strip()
                        raw.append(body[n])
                    commands.append(Command(cmd, raw))
                elif commands:
                    commands[-1].expected.append(line)
                else:
                    raise ValueError(
                        f"{path}:{i + 2 + n}: console block text before its first '$ ' command"
                    )
                n += 1
            blocks.append(Block(path, i + 1, len(blocks), opts, commands, i + 1, j))
        i = j + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in parse_blocks(p)]


# ---------------------------------------------------------------- output matching


def _trim(lines: list[str]) -> list[str]:
    out = [line.rstrip() for line in lines]
    while out and not out[-1]:
        out.pop()
    return out


def _line_matches(expected: str, actual: str) -> bool:
    if "..." not in expected:
        return expected == actual
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, actual) is not None


def output_matches(expected: list[str], actual: list[str]) -> bool:
    expected, actual = _trim(expected), _trim(actual)

    def match(e: int, a: int) -> bool:
        if e == len(expected):
            return a == len(actual)
        if expected[e].strip() == "...":
            return any(match(e + 1, k) for k in range(a, len(actual) + 1))
        return a < len(actual) and _line_matches(expected[e], actual[a]) and match(e + 1, a + 1)

    return match(0, 0)


def updated_expected(expected: list[str], actual: list[str]) -> list[str]:
    """The saved output to write for ``actual``: keeps a whole-line ``...`` with as many
    lines before and after it as before, and inline ``...`` lines that still match."""
    expected, actual = _trim(expected), _trim(actual)
    if output_matches(expected, actual):
        return expected
    dots = [n for n, line in enumerate(expected) if line.strip() == "..."]
    if len(dots) == 1 and len(actual) >= len(expected) - 1:
        head, tail = dots[0], len(expected) - dots[0] - 1
        new = actual[:head] + ["..."] + (actual[len(actual) - tail :] if tail else [])
        keep = expected[:head] + ["..."] + expected[head + 1 :]
        return [e if _line_matches(e, a) else a for e, a in zip(keep, new)]
    if len(expected) == len(actual) and not dots:
        return [e if _line_matches(e, a) else a for e, a in zip(expected, actual)]
    return actual


# ---------------------------------------------------------------- running


def qlab_argv() -> list[str]:
    exe = shutil.which("qlab", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "experiments"]


def command_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(COLUMNS="80", LINES="24", PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    return env


def make_workdir() -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix="qlab-doc-")
    for name in LINKED_INTO_TMP:
        if (ROOT / name).exists():
            os.symlink(ROOT / name, Path(tmp.name) / name)
    return tmp


class Server:
    """``qlab serve --port 0 ARGS`` in the background; its URL from its first stdout line."""

    def __init__(self, args: str, cwd: str):
        self.proc = subprocess.Popen(
            qlab_argv() + ["serve", "--port", "0", *shlex.split(args)],
            cwd=cwd,
            env=command_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        first = self.proc.stdout.readline()
        m = re.search(r"listening on (http://\S+)", first)
        if not m:
            self.stop()
            raise RuntimeError(f"qlab serve {args} did not start: {first!r}")
        self.url = m.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


def run_command(
    cmd: str, cwd: str, url: str | None, timeout_s: float = COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess:
    if url:
        cmd = cmd.replace(PLACEHOLDER_URL, url)
    argv = shlex.split(cmd)
    if not argv or argv[0] != "qlab":
        raise ValueError(
            f"only qlab commands are run; mark this block <!-- doc-test: skip -->: {cmd}"
        )
    return subprocess.run(
        qlab_argv() + argv[1:],
        cwd=cwd,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@dataclass
class Result:
    command: Command
    stdout: list[str]
    stderr: str
    returncode: int
    seconds: float


def run_block(block: Block) -> list[Result]:
    results = []
    with make_workdir() as cwd:
        server = Server(block.options["server"], cwd) if "server" in block.options else None
        try:
            for c in block.commands:
                t0 = time.perf_counter()
                p = run_command(
                    c.line,
                    cwd,
                    server.url if server else None,
                    SLOW_COMMAND_TIMEOUT_S if "slow" in block.options else COMMAND_TIMEOUT_S,
                )
                out = p.stdout
                if server:
                    out = out.replace(server.url, PLACEHOLDER_URL)
                results.append(
                    Result(c, out.splitlines(), p.stderr, p.returncode, time.perf_counter() - t0)
                )
                if p.returncode != 0:
                    break
        finally:
            if server:
                server.stop()
    return results


def rewrite_block(block: Block, new_outputs: list[list[str]]) -> None:
    """Put new saved outputs into ``block``'s file (found again by its index: earlier
    rewrites may have moved it)."""
    text = block.path.read_text(encoding="utf-8")
    lines = text.splitlines()
    current = parse_blocks(block.path, text)[block.index]
    body: list[str] = []
    for c, out in zip(current.commands, new_outputs):
        body.extend(c.raw)
        body.extend(out)
    lines[current.body_start : current.body_end] = body
    block.path.write_text(
        "\n".join(lines) + ("\n" if text.endswith("\n") else ""), encoding="utf-8"
    )


# ---------------------------------------------------------------- links

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _strip_code(text: str, inline: bool = True) -> str:
    out, fence = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        out.append(re.sub(r"`[^`]*`", "", line) if inline else line.replace("`", ""))
    return "\n".join(out)


def github_slug(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in _strip_code(path.read_text(encoding="utf-8"), inline=False).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = github_slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            result.add(slug if n == 0 else f"{slug}-{n}")
    return result


def relative_links(path: Path) -> list[str]:
    text = _strip_code(path.read_text(encoding="utf-8"))
    links = [a or b for a, b in _LINK.findall(text)]
    return [t for t in links if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return bad
