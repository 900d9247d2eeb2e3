VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ARGS ?=

.PHONY: setup serve test test-fast lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]' -e ./wrangler-mock
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/kumo serve $(ARGS)

# everything, as CI runs it (.ci/run)
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest $(ARGS)

# the inner loop: the unit tests of the packages, no end-to-end servers, benchmarks, Triton kernels in the
# interpreter or micro trainings (`slow`); `make lint` runs ruff and mypy
FAST_TESTS := tests/backend tests/gateway tests/models
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not slow and not gpu" $(FAST_TESTS) $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy schemas gateway backend

clean:
	rm -rf $(VENV) .kumo
