# trtllm-worker. Quick start: `make run` (a worker on the local RabbitMQ and Redis, echo
# engine) and `make test` (lint, types, and the whole test suite against real services).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: run test lint typecheck pytest fuzz bench clean cluster-up cluster-down

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

$(DEV_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@ $(STAMP)

$(BENCH_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $@ $(DEV_STAMP) $(STAMP)

run: $(STAMP)  ## run a worker against the local RabbitMQ and Redis (echo engine)
	$(BIN)/trtllm-worker serve

lint: $(DEV_STAMP)
	$(BIN)/ruff check worker tests bench
	$(BIN)/ruff format --check worker tests bench
	$(BIN)/lint-imports  # the layers of pyproject.toml: imports point down

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

pytest: $(DEV_STAMP)
	$(BIN)/pytest

test: lint typecheck pytest  ## ruff, mypy --strict and every test (real RabbitMQ and Redis)

fuzz: $(DEV_STAMP)  ## many more fuzzed messages against a running worker (FUZZ_EXAMPLES)
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-5000} $(BIN)/pytest tests/integration/test_fuzz.py -q -o timeout=1800

cluster-up:  ## a local Redis Cluster, a Sentinel-managed Redis and a RabbitMQ cluster to try (README: Scaling out)
	bash tools/clusters.sh up

cluster-down:  ## stop what cluster-up started
	bash tools/clusters.sh down

bench: $(BENCH_STAMP)  ## every scenario; results in bench/results/ (BENCH_PROFILE=1: py-spy profiles)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/run.py $(SCENARIOS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info
