"""inputs.run_axes: a run's axes declared once, by group; a sweep's cell is them flat."""

from __future__ import annotations

import dataclasses

import pytest

from experiments import config, config_grid, sweep
from inputs import run_axes

#: The axes whose None a cell's id leaves out (a compatibility contract, as the ids are).
OPTIONAL = [
    *("clients", "retry", "patience", "estimator", "cancel_at_deadline", "used", "speed_schedule"),
    *("fixed_estimate", "max_num_seqs", "kv_blocks", "chunked_prefill", "step", "ttft_slo_s"),
    *("tpot_slo_s", "arrivals", "policy_args", "prefix_caching", "system_prompt", "turns"),
    *("replicas", "router", "rate", "admission_at"),
]


def test_a_cells_groups_hold_each_field_once_and_make_the_cell():
    cell = sweep.cells(config.load("docs/examples/fleet.toml"))[-1]
    groups = {name: dataclasses.asdict(cell.group(name)) for name in run_axes.GROUPS}
    flat = {k: v for values in groups.values() for k, v in values.items()}
    assert sum(map(len, groups.values())) == len(flat) == len(dataclasses.fields(sweep.Cell))
    assert sweep.Cell(**flat) == cell
    assert cell.group("fleet") == run_axes.FleetAxes(replicas=8, router="central")


def test_the_sweeps_lists_of_axes_are_the_declarations():
    assert list(sweep.OPTIONAL_AXES) == OPTIONAL
    assert set(config_grid.GRID_KEYS) == set(run_axes.CELL_ORDER) - {"seed", "policy_args"}
    assert config_grid.GRID_KEYS["max_queue"] is int and config_grid.GRID_KEYS["load"] is float
    estimation = ("estimator", "cancel_at_deadline", "used", "speed_schedule", "fixed_estimate")
    assert sweep.ESTIMATION_AXES == estimation


def test_an_axis_missing_from_the_cells_order_is_refused(monkeypatch):
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extra:
        warmup_s: float | None = run_axes.axis(float, "seconds before the counting starts")

    monkeypatch.setitem(run_axes.GROUPS, "extra", Extra)
    with pytest.raises(RuntimeError, match="warmup_s"):
        run_axes._fields()
