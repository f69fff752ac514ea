"""notebooks/goodput_curves.ipynb, executed headless with nbclient as Jupyter would run it: its
figures, its tables per load or at one named load (never a mean over the grid's loads), columns in
numeric order, and a clear message where it has no sweep or the named load is not in it."""

from pathlib import Path

import pytest

from experiments import config, sweep

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "goodput_curves.ipynb"
GRID = """
[sweep]
duration_s = 20
seeds = 2
[clients.two-tenant]
heavy = { share = 0.85 }
light = { share = 0.15, priority = 1 }
[grid]
policy = ["none", "bounded", "predictive"]
load = [0.5, 1.5]
clients = ["none", "two-tenant"]
"""
POLICIES = [
    f"{p} / {c}" for p in ("none", "bounded", "predictive") for c in ("no clients", "two-tenant")
]
#: Run after the notebook in its kernel: what its tables hold.
CHECKS = f"""
import numpy as np

assert classes == ['4', '16', '64']
assert list(classes_at_load.columns) == list(classes_by_load.columns) == ['4', '16', '64']
assert LOAD == 1.5  # the load closest to 1.3
# At the named load: each entry is that load's cells only.
cells = by_class[(by_class['load'] == LOAD) & (by_class['policy'] == 'predictive')
                 & (by_class['size_class'] == '64') & by_class['clients'].isna()]
assert np.isclose(classes_at_load.loc[('predictive / no clients', 1.0), '64'],
                  cells['share_good'].mean())
cells = summary[(summary['load'] == LOAD) & (summary['policy'] == 'bounded')
                & (summary['clients'] == 'two-tenant')]
assert len(cells) == 2
assert np.isclose(at_load.loc[(1.0, 'bounded / two-tenant'), 'share_good'],
                  cells['share_good'].mean())
# Intervals shown as what a share and a rate can be (2 seeds' t-intervals reach past them).
assert at_load['share_good_low'].ge(0).all() and at_load['share_good_high'].le(1).all()
assert at_load['goodput_rps_low'].ge(0).all()
# Per load: every load of the grid is a row of its own.
for table in (share_by_load, goodput_by_load, classes_by_load):
    assert sorted(set(table.index.get_level_values('load'))) == [0.5, 1.5]
# Policies in the figures' order, not the alphabet's, each client set apart.
assert list(share_by_load.columns) == {POLICIES!r}
assert list(at_load.index.get_level_values('policy')) == {POLICIES!r}
"""


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("notebook")
    (tmp / "s.toml").write_text(GRID)
    sweep.run(config.load(tmp / "s.toml"), tmp / "out", workers=1, quiet=True)
    return tmp / "out"


def execute(cells: int | None = None, extra: str | None = None, cwd: Path = ROOT):
    """The notebook (its first ``cells`` code cells) executed in a fresh kernel in ``cwd``,
    ``extra`` run last."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    if cells is not None:
        code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        nb.cells = nb.cells[: code[cells - 1] + 1]
    if extra:
        nb.cells.append(nbformat.v4.new_code_cell(extra))
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    ).execute()
    return nb


@pytest.mark.slow
def test_the_notebook_runs_headless_with_tables_per_load(small_sweep, monkeypatch):
    monkeypatch.setenv("QLAB_SWEEP", str(small_sweep))
    monkeypatch.delenv("QLAB_LOAD", raising=False)
    nb = execute(extra=CHECKS)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    images = [
        o
        for o in outputs
        if o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
    ]
    # goodput, by class, the comparison, the latency CDF at the named load, by client
    assert len(images) == 5
    assert not any(o.get("output_type") == "error" for o in outputs)


def run_cells(cells: int) -> dict:
    """The notebook's first ``cells`` code cells run here, in-process (plain Python, as the kernel
    would run them), for what they define; faster than a kernel for the checks of its first
    cells."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    namespace = {}
    for cell in [c for c in nb.cells if c.cell_type == "code"][:cells]:
        exec(compile(cell.source, str(NOTEBOOK), "exec"), namespace)
    return namespace


def test_qlab_load_names_the_load_and_must_be_one_of_the_grids(small_sweep, monkeypatch):
    monkeypatch.setenv("QLAB_SWEEP", str(small_sweep))
    monkeypatch.setenv("QLAB_LOAD", "0.5")
    assert run_cells(2)["LOAD"] == 0.5
    monkeypatch.setenv("QLAB_LOAD", "1.25")
    with pytest.raises(
        ValueError,
        match=r"^QLAB_LOAD=1\.25 is not a load of this sweep; its "
        r"loads: 0\.5, 1\.5$",
    ):
        run_cells(2)


def test_without_a_sweep_the_notebook_says_what_to_do(tmp_path, monkeypatch):
    # Run where neither runs/ nor ../runs/ holds the demo's sweep, whatever this checkout has.
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("QLAB_SWEEP", raising=False)
    with pytest.raises(FileNotFoundError) as raised:
        run_cells(1)
    assert str(raised.value) == (
        "no sweep to show: QLAB_SWEEP is not set, and runs/study/sections/reference/sweep (what "
        "`make demo` writes) holds no "
        "summary.parquet (a folder written by `qlab sweep`). Run `make demo`, or `qlab sweep "
        "FILE.toml --out DIR` and "
        "then `make notebook SWEEP=DIR` (or set QLAB_SWEEP=DIR before starting Jupyter)."
    )
    monkeypatch.setenv("QLAB_SWEEP", str(tmp_path))
    with pytest.raises(
        FileNotFoundError,
        match=f"^no sweep to show: QLAB_SWEEP={tmp_path} holds no summary.parquet",
    ):
        run_cells(1)


@pytest.mark.slow
def test_make_notebook_opens_it_in_jupyterlab_from_an_extra_that_make_test_does_not_need(tmp_path):
    import shutil
    import subprocess
    import tomllib

    if shutil.which("make") is None:
        pytest.skip("no make here")
    # -n: print what it would run (installing JupyterLab and starting it is for a person, not a
    # test); -B: as on a fresh clone, where nothing is installed yet.
    plan = subprocess.run(
        ["make", "-n", "-B", "notebook", f"SWEEP={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "pip install --quiet -e '.[notebook]'" in plan
    assert f"QLAB_SWEEP='{tmp_path}' .venv/bin/jupyter lab notebooks/goodput_curves.ipynb" in plan
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(r.startswith("jupyterlab") for r in extras["notebook"])
    test_plan = subprocess.run(
        ["make", "-n", "-B", "test"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "notebook" not in test_plan and "jupyterlab" not in test_plan
