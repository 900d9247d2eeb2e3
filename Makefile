VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ARGS ?=

.PHONY: setup serve test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]' -e ./wrangler-mock
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/kumo serve $(ARGS)

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy schemas gateway backend

clean:
	rm -rf $(VENV) .kumo
