# make help: the commands of this project. `make run` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel on this machine's disk; a bare torch range would pull a multi-GB CUDA build first.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: help install services-install run test test-fast test-all bench lint format clean

help:  ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed  ## create .venv and install sage (editable) with the dev tools

services-install:  ## apt packages for the integration tests (SLURM, munge, slurmdbd, MariaDB)
	launchers/slurm_cluster.sh install

run: install  ## the embedded default end to end: build/reuse the tiny base model, GRPO, evaluate (ARGS=overrides)
	$(VENV)/bin/sage-train $(ARGS)

test: install services-install  ## the whole test suite, integration tests included (what CI runs)
	$(PY) -m pytest -q $(ARGS)

test-fast: install  ## unit tests only (no slow runs, no services)
	$(PY) -m pytest -q -m "not slow and not integration" $(ARGS)

test-all: test  ## alias of test: nothing is skipped

bench: install  ## speed/memory figures as `name: value` lines
	$(PY) -m sage.bench $(ARGS)

lint: install  ## ruff check + format check
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:  ## remove outputs (keeps the model cache in ~/.cache/sage)
	rm -rf outputs multirun .pytest_cache
