# Two set-up-to-result commands for a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.k3run-installed
DEV_STAMP := $(VENV)/.k3run-dev-installed

.PHONY: run test lint install clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first: on a machine without a GPU take the CPU wheel (torch==2.13.0 is a local file on the
# project's CPU machines); on a GPU machine the default build is the right one.
$(VENV)/.torch: | $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch present"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install "torch>=2.11"; \
	else $(PY) -m pip install torch==2.13.0; fi
	touch $@

$(STAMP): pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e .
	touch $@

$(DEV_STAMP): pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e ".[dev,serve]"
	touch $@

install: $(STAMP)

run: $(STAMP)
	$(PY) -m k3run.cli run-default

test: $(DEV_STAMP)
	$(PY) -m pytest

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests bench

clean:
	rm -rf $(VENV)
