"""The import layering, read from the source (every import, also those inside functions): each
package imports only from the layers below its own (qsim; inputs; analysis and live, which never
import each other; experiments), qsim imports neither argparse nor a TOML reader (the command line
and config files are inputs'), no modules import each other in a circle, only qsim.testing (the
kit's package) imports hypothesis, nothing imports the project's tests as a package (a `tests`
package installed in site-packages would answer instead), and no module is longer than MAX_LINES
(but those not split yet, STILL_LONG)."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: qlab's packages, bottom layer first: a package imports only from layers below its own. The run
#: file's settings (qsim.runfile) are in the bottom layer, so that the comparison (analysis) reads
#: them without live; the commands that drive live runs and measure them (experiments.replay_command
#: and its siblings, live_runner) are on top.
LAYERS = (("qsim",), ("inputs",), ("analysis", "live"), ("experiments",))
PACKAGES = tuple(p for layer in LAYERS for p in layer)
LAYER = {p: i for i, layer in enumerate(LAYERS) for p in layer}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


@cache
def _imports(path: Path) -> frozenset[str]:
    """What a file imports, as full module names (``from . import records`` in qsim:
    qsim.records)."""
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in _modules() else module)
    return frozenset(found)


def _graph(packages) -> dict[str, set[str]]:
    mods = {m: p for m, p in _modules().items() if m.split(".")[0] in packages}
    return {m: {i for i in _imports(p) if i in mods and i != m} for m, p in mods.items()}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (the modules in order, the first repeated last), or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def _upward(module: str, imported: str) -> bool:
    """Whether ``module`` importing ``imported`` goes sideways or up a layer (into another
    package not below)."""
    mine, theirs = module.split(".")[0], imported.split(".")[0]
    return theirs in LAYER and theirs != mine and LAYER[theirs] >= LAYER[mine]


def test_each_package_imports_only_from_the_layers_below():
    wrong = sorted(
        f"{m} imports {i}" for m, p in _modules().items() for i in _imports(p) if _upward(m, i)
    )
    assert not wrong, (
        "imports across the layering ("
        + " < ".join(" & ".join(layer) for layer in LAYERS)
        + "): "
        + "; ".join(wrong)
    )


def test_the_layering_check_sees_an_import_up_or_sideways():
    assert _upward("live.runner", "analysis.compare") and _upward("analysis.compare", "live.rows")
    assert _upward("qsim.model", "inputs.atomic") and _upward("inputs.atomic", "experiments.cli")
    assert not _upward("experiments.study", "live.procs") and not _upward("live.gate", "qsim.queue")
    assert not _upward("live.gate", "live.engine") and not _upward("live.gate", "numpy")


#: What reads a command line or a config file: inputs' (and the commands'), never qsim's.
PARSERS = {"argparse", "tomllib", "tomli"}


def test_qsim_reads_no_command_line_and_no_toml():
    wrong = sorted(
        f"{m} imports {i}"
        for m, p in _modules().items()
        if m.split(".")[0] == "qsim"
        for i in _imports(p)
        if i.split(".")[0] in PARSERS
    )
    assert not wrong, "qsim parses no flags or TOML (inputs/ does): " + "; ".join(wrong)
    # The check sees such an import where there is one (inputs' flag types, its TOML files).
    assert "argparse" in _imports(_modules()["inputs.argtypes"])
    assert "tomllib" in _imports(_modules()["inputs.tomlfiles"])


#: Modules each hold one thing (issue 30): none is longer than this, but those of STILL_LONG.
MAX_LINES = 800
#: The modules not split yet: each must still be over MAX_LINES (take it off once it is split).
#: Each was under 800 lines before `ruff format` laid the tree out (27 % more lines in all, one
#: argument a line where a call does not fit): see docs/changes.md.
STILL_LONG: set[str] = set()


def test_no_module_is_longer_than_max_lines():
    lines = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in _modules().items()}
    long = {m for m, n in lines.items() if n > MAX_LINES}
    over = sorted(f"{m} ({lines[m]} lines)" for m in long - STILL_LONG)
    assert not over, f"over {MAX_LINES} lines: {', '.join(over)}"
    assert long >= STILL_LONG, (
        f"split now, so take them off STILL_LONG: {sorted(STILL_LONG - long)}"
    )
    # The check reads the split modules (a package's modules, not only top-level files).
    assert {"experiments.study.runner", "analysis.replay", "qsim.testing.queue_core"} <= set(lines)


def test_no_import_circles():
    circle = _circle(_graph(PACKAGES))
    assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_the_circle_finder_finds_a_circle():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


def test_only_the_test_kit_imports_hypothesis():
    kit = {m for m in _modules() if m == "qsim.testing" or m.startswith("qsim.testing.")}
    users = {
        m
        for m, p in _modules().items()
        if any(i.split(".")[0] == "hypothesis" for i in _imports(p))
    }
    assert "qsim.testing" in users and users <= kit, sorted(users - kit)
    importers = sorted(
        m for m, p in _modules().items() if m not in kit and any(i in kit for i in _imports(p))
    )
    assert importers == []  # nothing in qlab needs the kit: qsim runs without hypothesis


def test_nothing_imports_the_projects_tests_as_a_package():
    files = [
        p
        for folder in (*PACKAGES, "tests", "benchmarks", "docs")
        for p in (ROOT / folder).rglob("*.py")
    ]
    wrong = [
        str(p.relative_to(ROOT))
        for p in files
        if any(i == "tests" or i.startswith("tests.") for i in _imports(p))
    ]
    assert not wrong
    assert not (ROOT / "tests" / "__init__.py").exists()


@pytest.mark.slow
def test_a_tests_package_in_site_packages_does_not_shadow_the_projects(tmp_path):
    """Run a test file that imports the helpers of tests/ with a decoy ``tests`` package (and decoy
    helpers) ahead of everything on the path: pytest still loads the project's."""
    decoy = tmp_path / "decoy"
    (decoy / "tests").mkdir(parents=True)
    (decoy / "tests" / "__init__.py").write_text(
        "raise ImportError('the decoy tests package was imported')\n"
    )
    (decoy / "virtual_time.py").write_text(
        "raise ImportError('the decoy virtual_time was imported')\n"
    )
    env = {"PYTHONPATH": str(decoy), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "decoy_probe",
            str(ROOT / "tests" / "test_layout.py"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_decoy_probe():
    """Where the helpers come from, whoever runs this (the test above runs it with decoys on the
    path)."""
    import importlib.util

    for helper in ("virtual_time", "fake_http", "doc_examples"):
        assert (
            Path(importlib.util.find_spec(helper).origin).resolve()
            == ROOT / "tests" / f"{helper}.py"
        )


def test_the_readmes_map_names_every_module():
    """The README's layout is current: every module of the packages and every benchmark script
    is named in its map (a module added without a line there fails here)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index("## Map") : readme.index("## Data attribution")]
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    files += list((ROOT / "benchmarks").glob("*.py"))
    missing = sorted(
        str(p.relative_to(ROOT)) for p in files if p.name != "__init__.py" and p.name not in block
    )
    assert not missing, f"README.md's map names none of: {', '.join(missing)}"


def _texts():
    """The repository's own text files: none under a hidden folder (.git, .venv) or a run's
    output."""
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if any(p.startswith(".") or p in ("runs", "build") for p in parts[:-1]):
            continue
        if path.suffix in (".py", ".md", ".toml", ".ipynb") or path.name == "Makefile":
            yield path


def test_no_file_holds_a_merge_conflicts_markers():
    """A merge resolved by hand leaves no conflict marker behind."""
    left = [
        f"{path.relative_to(ROOT)}:{k}"
        for path in _texts()
        for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if line.startswith(("<<<<<<< ", ">>>>>>> "))
    ]
    assert not left, f"conflict markers at {', '.join(left[:10])}"


@pytest.mark.slow
def test_a_qlab_process_starts_without_scipy_or_torch():
    """Every qlab process (each server, each docs example, each command) imports the CLI and the
    gate; scipy's stats and optimize (about a second of CPU) and torch load only where a function
    uses them, so starting one stays cheap."""
    code = (
        "import sys, experiments.cli, live.commands, live.http_api, live.openai_api, "
        "live.upstream_batch, analysis.compare; "
        "print(sorted(m for m in ('scipy.stats', 'scipy.optimize', 'torch', 'matplotlib') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"
