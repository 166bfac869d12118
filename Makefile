# Two set-up-to-result commands for a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.k3run-installed
DEV_STAMP := $(VENV)/.k3run-dev-installed

.PHONY: run test lint install clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Without a GPU every install is pinned by constraints-cpu.txt (torch 2.13.0 there is the CPU wheel, a local
# file on the project's CPU machines); on a GPU machine the default torch build and pyproject's ranges.
CONSTRAINTS := $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints-cpu.txt)

# torch first, so that the CPU wheel is the one the later installs see
$(VENV)/.torch: constraints-cpu.txt | $(PY)
	$(PY) -m pip install -q $(CONSTRAINTS) "torch>=2.11"
	touch $@

$(STAMP): pyproject.toml constraints-cpu.txt $(VENV)/.torch
	$(PY) -m pip install -q $(CONSTRAINTS) -e .
	touch $@

$(DEV_STAMP): pyproject.toml constraints-cpu.txt $(VENV)/.torch
	$(PY) -m pip install -q $(CONSTRAINTS) -e ".[dev,serve]"
	touch $@

install: $(STAMP)

run: $(STAMP)
	$(PY) -m k3run.cli run-default

test: $(DEV_STAMP)
	$(PY) -m pytest

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)
