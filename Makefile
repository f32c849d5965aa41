# Two commands for a fresh machine (see README): `make train` and `make test`.
# Both create .venv/ with the pinned CPU stack on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=
# Test processes (pytest-xdist): most tests wait on a training subprocess of one thread, so two run well on
# two cores (the suite: 643-712 s against 869-1,078 s in one process, 2026-11-27); TEST_WORKERS=0 runs them in this one.
# --dist loadfile: a file's tests on one worker (the cluster tests, the wheel builds: each file's run one at a time;
# pytest 9.2 no longer honours xdist_group under loadgroup, pytest-xdist issue 1386). The shared locks stay.
# --no-loadscope-reorder: files go out in the order tests/conftest.py gives them, the longest first. Three workers on
# two cores were slower (898 s against 832 s, 2026-11-29: the suite keeps both cores busy).
TEST_WORKERS ?= 2

$(STAMP): pyproject.toml tools/fbgemm_gpu_shim/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The shim on the same command line makes pip take it for torchrec's `fbgemm-gpu` requirement.
	$(PY) -m pip install --quiet ./tools/fbgemm_gpu_shim -e ".[cpu,dev]"
	$(PY) -c "import torchrec, fbgemm_gpu, lightning, hydra, mlflow"
	touch $(STAMP)

.PHONY: install train test test-all check-pins
install: $(STAMP)

train: $(STAMP)
	$(PY) -m pipeline.commands.train $(ARGS)

# --durations=10: the 10 slowest tests at the end of every run (CI's too), so the next regression shows.
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10 tests $(ARGS)

# Also the end-to-end variants marked slow (their path is covered by `make test`).
test-all: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests -m "" $(ARGS)

# Every pinned version (CPU and GPU extras, Dockerfile, README) exists on the package index (CI runs it).
check-pins: $(STAMP)
	$(PY) tools/check_pins.py
