# One place for the project's commands. `make run` and `make test` work on a fresh machine:
# they create .venv and install the pinned dependencies first (torch: the CPU build).
# `make run` installs only what the example sweep needs ([worker,report,example]); setup,
# test, lint and bench install everything (all extras, dev's tools).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXAMPLE ?= example
RESULTS ?= results

.PHONY: setup run example test test-fast lint bench clean

# Exact versions from constraints.txt (pyproject.toml holds only ranges). The full install
# holds the run's too, so it stamps both.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==26.3
	$(PY) -m pip install --quiet -c constraints.txt -e ".[worker,s3,kube,report,example,dev]"
	$(PY) -m pip check
	touch $@ $(VENV)/.installed-run

$(VENV)/.installed-run: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==26.3
	$(PY) -m pip install --quiet -c constraints.txt -e ".[worker,report,example]"
	$(PY) -m pip check
	touch $@

setup: $(VENV)/.installed

example: $(VENV)/.installed-run
	$(PY) examples/make_example.py $(EXAMPLE)

## The main job on the bundled example: build the offline example set, sweep it, show the summary.
run: example
	HF_HUB_OFFLINE=1 $(VENV)/bin/esd-sweep run --model-list $(EXAMPLE)/models.csv \
		--output-dir $(RESULTS)
	$(VENV)/bin/esd-sweep report --output-dir $(RESULTS)

# Two test processes (pytest-xdist), tests dealt as each finishes: the suite's tests wait on
# subprocesses and servers much of their time; 19 min -> 11 min on the 2-core machine.
test: setup
	$(PY) -m pytest -n 2 --dist worksteal

test-fast: setup
	$(PY) -m pytest -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(VENV)/bin/hadolint Dockerfile
	$(PY) .ci/check_sizes.py

bench: setup
	$(PY) benchmarks/bench_minilm_cpu.py
	$(PY) benchmarks/bench_plan.py
	$(PY) benchmarks/bench_dispatch.py
	$(PY) benchmarks/bench_refit.py
	$(PY) benchmarks/bench_sweep_cpu.py

clean:
	rm -rf $(VENV) $(EXAMPLE) $(RESULTS) .pytest_cache .mypy_cache .ruff_cache
