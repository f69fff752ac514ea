"""A sweep's cell ids and columns pinned as literals: a resumed sweep folder finds its cells by id
(``Cell.id``), and plots and tables read the columns by name, so neither may change when the
cell's fields are declared elsewhere (issue 30: one declaration of a run's axes)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import shutil

import pyarrow.parquet as pq
import pytest

from experiments import config, sweep

#: Every axis a grid can sweep, in a file of its own (the repository's files sweep fewer).
EVERY_AXIS = """
[sweep]
duration_s = 10
seeds = 2
prompts = "uniform:16:64"
[batching]
b0 = 0.008
b1 = 5e-05
b2 = 0.0001
kv_blocks = 400
[steps.slow]
b0 = 0.02
[clients.two]
a = { share = 0.5 }
b = { share = 0.5 }
[grid]
policy = ["none", "predictive"]
load = [0.9]
deadline_s = [5.0]
max_queue = [0, 64]
max_num_seqs = [8, 32]
kv_blocks = [400]
chunked_prefill = [false, true]
step = ["default", "slow"]
prefix_caching = [true]
system_prompt = ["256:0.8"]
turns = ["1", "3:8"]
tpot_slo_s = [0.05]
patience = ["none", "exponential:30"]
clients = ["none", "two"]
replicas = [1, 2]
router = ["jsq"]
admission_at = ["replica", "gate"]
"""

#: A trace file's axes, and the server's.
TRACE_AXES = """
[sweep]
duration_s = 10
seeds = 1
[grid]
policy = ["bounded"]
trace = ["t.csv"]
time_scale = [1.0, 2.0]
speed = [1.0, 2.0]
engines = [1, 2]
mix = ["reference"]
"""

#: file: (cells, first id, middle id, last id, sha256 of every id in order, cut to 16)
IDS = {
    "docs/examples/axes.toml": (
        24,
        "23d0ccc51f44efeb",
        "a0b0c8a312a7faa8",
        "48be7d293c273a94",
        "7427fb82479bc589",
    ),
    "docs/examples/fleet.toml": (
        18,
        "157cddb3bc634000",
        "1c79a39022730b95",
        "026985ce7b4a055c",
        "5ed3614b33b1d483",
    ),
    "docs/examples/tenants.toml": (
        24,
        "0b3c8c9626cf6f2b",
        "fa01619cd4a555ff",
        "257979980a42a9b3",
        "8f689bedbfa63754",
    ),
    "docs/examples/tiny.toml": (
        12,
        "57010b41f132e792",
        "49d04b4890a69a96",
        "f9e3ce1122b70919",
        "2641e4649b4dac02",
    ),
    "experiments/batching.toml": (
        350,
        "fba89264df5b9cbb",
        "484e20d3defd99f4",
        "c09b6677254eceaf",
        "a5b54e1e6868d327",
    ),
    "experiments/cancellation.toml": (
        180,
        "ece95b8de61b5bff",
        "3d4ae60a01a60ab7",
        "6dc48d2876464828",
        "f92f9884949429a3",
    ),
    "experiments/estimation.toml": (
        90,
        "99cb99f0e6f68294",
        "ef2606c2b212ed84",
        "3fd871604e37f93e",
        "39511c63b482643b",
    ),
    "experiments/policies.toml": (
        1320,
        "b26b14e6f7634680",
        "b85ab8688b0e37ec",
        "d54c067ba1a83557",
        "71755df344caaada",
    ),
    "experiments/retries.toml": (
        200,
        "04354141890a6e4e",
        "3fbbed3a690de049",
        "922a9c579e8a690f",
        "f6376d24c4bd1bb5",
    ),
    "experiments/stale.toml": (
        40,
        "27de10ec13d00401",
        "77412256e8861b5f",
        "677d9103d46fcc1d",
        "fe0f6ffbdc3dc41d",
    ),
    "every_axis.toml": (
        2048,
        "3ea98e0fb2924f71",
        "b279ecf03b6b1c7e",
        "2369baea0f09db10",
        "d1297ddaabd7a62b",
    ),
    "trace_axes.toml": (
        8,
        "8bbc09cb4e1e6a53",
        "262e682942c8f56c",
        "c60c80f9e846e747",
        "506f5d67faef56ac",
    ),
}

CELL_FIELDS = [
    *("policy", "load", "speed", "engines", "deadline_s", "max_queue", "mix", "trace"),
    *("time_scale", "seed", "clients", "retry", "patience", "estimator", "cancel_at_deadline"),
    *("used", "speed_schedule", "fixed_estimate", "max_num_seqs", "kv_blocks", "chunked_prefill"),
    *("step", "ttft_slo_s", "tpot_slo_s", "arrivals", "policy_args", "prefix_caching"),
    *("system_prompt", "turns", "replicas", "router", "rate", "admission_at"),
]

#: The cell columns of one cell's rows (after qsim's own), with their arrow types.
EVERY_AXIS_ROWS = [
    *(("cell_id", "large_string"), ("policy", "large_string"), ("load", "double")),
    *(("speed", "double"), ("engines", "int64"), ("max_queue", "int64")),
    *(("mix", "large_string"), ("trace", "large_string"), ("time_scale", "double")),
    *(("seed", "int64"), ("clients", "large_string"), ("patience", "large_string")),
    *(("max_num_seqs", "int64"), ("kv_blocks", "int64"), ("chunked_prefill", "bool")),
    *(("step", "large_string"), ("prefix_caching", "bool"), ("system_prompt", "large_string")),
    *(("turns", "large_string"), ("replicas", "int64"), ("router", "large_string")),
    ("admission_at", "large_string"),
]
#: The summary's parameters (its columns before the metrics) of that cell.
EVERY_AXIS_SUMMARY = [
    *("cell_id", "policy", "load", "speed", "engines", "deadline_s", "max_queue", "mix"),
    *("trace", "time_scale", "seed", "clients", "patience", "max_num_seqs", "kv_blocks"),
    *("chunked_prefill", "step", "tpot_slo_s", "prefix_caching", "system_prompt", "turns"),
    *("replicas", "router", "admission_at"),
]


@pytest.fixture(scope="module")
def configs(tmp_path_factory, azure_csv):
    tmp = tmp_path_factory.mktemp("ids")
    (tmp / "every_axis.toml").write_text(EVERY_AXIS)
    (tmp / "trace_axes.toml").write_text(TRACE_AXES)
    shutil.copy(azure_csv, tmp / "t.csv")  # a path relative to the sweep file: in its id
    return {name: config.load(name if "/" in name else tmp / name) for name in IDS}


@pytest.mark.parametrize("name", list(IDS))
def test_every_cell_keeps_its_id(configs, name):
    ids = [cell.id for cell in sweep.cells(configs[name])]
    digest = hashlib.sha256(" ".join(ids).encode()).hexdigest()[:16]
    assert (len(ids), ids[0], ids[len(ids) // 2], ids[-1], digest) == IDS[name]


def test_a_cell_keeps_its_fields_in_order():
    assert [f.name for f in dataclasses.fields(sweep.Cell)] == CELL_FIELDS
    assert list(dict.fromkeys(sweep.PARAMETERS)) == ["cell_id", *CELL_FIELDS]


def test_a_cells_rows_and_summary_keep_their_columns(configs):
    cfg = configs["every_axis.toml"]
    result = sweep.run_cell(cfg, sweep.cells(cfg)[-1])
    schema = pq.read_schema(io.BytesIO(result.parquet))
    cells = schema.names[schema.names.index("cell_id") :]
    assert [(n, str(schema.field(n).type)) for n in cells] == EVERY_AXIS_ROWS
    assert list(result.summary)[: len(EVERY_AXIS_SUMMARY)] == EVERY_AXIS_SUMMARY
    assert list(result.summary)[len(EVERY_AXIS_SUMMARY)] not in sweep.PARAMETERS


def test_a_cell_without_an_axis_has_a_typed_column(configs):
    """A trace cell has no load, a cell without clients none: their columns keep their axis's
    type, so a dataset of cells reads them beside another cell's."""
    cfg = configs["trace_axes.toml"]
    result = sweep.run_cell(cfg, sweep.cells(cfg)[0])
    schema = pq.read_schema(io.BytesIO(result.parquet))
    types = {n: str(schema.field(n).type) for n in ("load", "clients", "max_queue")}
    assert types == {"load": "double", "clients": "large_string", "max_queue": "int64"}
