# Two commands for a fresh machine (see README): `make train` and `make test`.
# Both create .venv/ with the pinned CPU stack on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

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

test: $(STAMP)
	$(PY) -m pytest -q tests $(ARGS)

# Also the end-to-end variants marked slow (their path is covered by `make test`).
test-all: $(STAMP)
	$(PY) -m pytest -q tests -m "" $(ARGS)

# Every pinned version (CPU and GPU extras, Dockerfile, README) exists on the package index (CI runs it).
check-pins: $(STAMP)
	$(PY) tools/check_pins.py
