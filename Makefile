# Two commands: `make demo` and `make test`. Each creates .venv if absent and installs qlab into it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.qlab-installed

.PHONY: demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Reinstall when the project's dependencies change.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	touch $@

# The main job on embedded defaults: every closed form against the simulator,
# then one simulation per policy at 1.3x capacity on the reference mix.
demo: $(STAMP)
	$(BIN)/qlab theory
	@for p in none bounded bounded-deadline predictive; do \
		echo; echo "== qlab simulate --policy $$p --load 1.3 --seconds 600 --seed 1"; \
		$(BIN)/qlab simulate --policy $$p --load 1.3 --seconds 600 --seed 1 || exit 1; \
	done

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_qsim.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
