# GraniKV reproduction suite. `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
# extra pip arguments for the torch install, e.g. TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
# where the default index serves a CUDA build
TORCH_INDEX ?=

.DEFAULT_GOAL := help
.PHONY: help setup test smoke

help: ## List the targets and what each does
	@grep -E '^[a-z][a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "  make %-12s %s\n", $$1, $$2}'

setup: $(STAMP) ## Create .venv: torch==2.13.0 (CPU build) first, then the project with its dev extra

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH_PIN) $(TORCH_INDEX)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# pytest-xdist worker processes for `make test`; each test file runs whole in one worker (its module
# fixtures are built once), files handed out in name order (xdist's default, most tests first, would start
# the one-test files last, the whole-analysis regeneration among them); TEST_WORKERS=0: one process
TEST_WORKERS ?= 2

test: setup ## Run the CPU test suite, in TEST_WORKERS processes (default 2; installs what it needs on a bare machine)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

smoke: setup ## CPU multirun (tiny model, 2 systems x 2 Lp) into a temp folder, then the analysis on it
	@d=$$(mktemp -d -t granikv-smoke.XXXXXX) && \
	$(BIN)/python -m runners.run -m sweep=smoke results_dir=$$d/raw && \
	if [ -f analysis/reproduce.py ]; then $(BIN)/python -m analysis.reproduce --results $$d/raw --out $$d; \
	else echo "(analysis not present yet: raw cells only)"; fi && \
	echo "smoke results: $$d"

# --- analysis (helper ANALYSIS): raw results -> tables, figures, REPORT.md ---------------------
RESULTS_RAW ?= results/raw
RESULTS_OUT ?= results
.PHONY: reproduce tables figures

reproduce: setup ## Regenerate results/tables, results/figures and results/REPORT.md from results/raw (CPU only, ~3 min after setup)
	$(BIN)/python -m analysis.reproduce --results $(RESULTS_RAW) --out $(RESULTS_OUT)

tables: setup ## Regenerate only results/tables (CSV + Markdown) and results/REPORT.md, no figures
	$(BIN)/python -m analysis.reproduce --results $(RESULTS_RAW) --out $(RESULTS_OUT) --only tables

figures: setup ## Regenerate results/figures (PNG + PDF) and the tables they are drawn from, no report
	$(BIN)/python -m analysis.reproduce --results $(RESULTS_RAW) --out $(RESULTS_OUT) --only figures

.PHONY: coverage
coverage: setup ## Print what each campaign item (conf/campaign.yaml) has measured and misses, with the command for the rest
	$(BIN)/python -m analysis.coverage --results $(RESULTS_RAW)
