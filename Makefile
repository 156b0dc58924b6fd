# trtllm-worker. Quick start: `make run` (a worker on the local RabbitMQ and Redis, echo
# engine) and `make test` (lint, types, and the whole test suite against real services).
#
# Every install comes from uv.lock (all dependencies, direct and transitive, pinned with
# hashes for Python 3.11 to 3.13), through uv, itself pinned with hashes in
# tools/uv-requirements.txt: a fresh clone installs what passed CI. `make lock` refreshes
# the lock; `make test-latest` runs the suite against the newest releases instead.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TOOLS  := .tools
UV     := $(TOOLS)/bin/uv
STAMP  := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
BENCH_STAMP := $(VENV)/.installed-bench
DOCS_STAMP := $(VENV)/.installed-docs
LATEST := .venv-latest
# uv finds $(PYTHON) on the PATH and never downloads an interpreter of its own
export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(VENV)
SYNC := $(UV) sync --locked --python $(PYTHON)

.PHONY: run test lint typecheck pytest unit format docs fuzz bench clean cluster-up \
	cluster-down lock test-latest test-servers

$(UV): tools/uv-requirements.txt
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet --require-hashes -r tools/uv-requirements.txt
	touch $@

$(STAMP): pyproject.toml uv.lock | $(UV)
	$(SYNC) --quiet
	touch $@

$(DEV_STAMP): pyproject.toml uv.lock | $(UV)
	$(SYNC) --quiet --extra dev
	touch $@ $(STAMP)

$(BENCH_STAMP): pyproject.toml uv.lock | $(UV)
	$(SYNC) --quiet --extra dev --extra bench
	touch $@ $(DEV_STAMP) $(STAMP)

$(DOCS_STAMP): pyproject.toml uv.lock | $(UV)
	$(SYNC) --quiet --extra dev --extra docs
	touch $@ $(DEV_STAMP) $(STAMP)

lock: | $(UV)  ## re-resolve uv.lock to the newest releases pyproject.toml allows
	$(UV) lock --upgrade --python $(PYTHON)

run: $(STAMP)  ## run a worker against the local RabbitMQ and Redis (echo engine)
	$(BIN)/trtllm-worker serve

lint: $(DEV_STAMP)
	$(BIN)/ruff check trtllm_worker tests bench tools docs/*.py docs/examples
	$(BIN)/ruff format --check trtllm_worker tests bench tools docs/*.py docs/examples
	$(BIN)/lint-imports  # the layers of pyproject.toml: imports point down

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

# The engine contract suite and the double's own tests once more with the double at the
# 1.4 API level (tests/doubles/__init__.py): the adapters are held to both lines.
DOUBLE_1_4 := 1.4.0rc1
LINE_TESTS := tests/engines tests/unit/test_trtllm_double.py tests/unit/test_trtllm_fields.py

pytest: $(DEV_STAMP)  ## every test, with branch coverage of trtllm_worker; then the TensorRT-LLM tests at the 1.4 level
	$(BIN)/pytest --cov --cov-report=term
	TRTLLM_DOUBLE_RELEASE=$(DOUBLE_1_4) $(BIN)/pytest -q --cov --cov-append --cov-report=term $(LINE_TESTS)

unit: $(DEV_STAMP)  ## tests/unit only: no RabbitMQ, Redis or Docker needed
	$(BIN)/pytest tests/unit

format: $(DEV_STAMP)  ## ruff format, then ruff check --fix
	$(BIN)/ruff format trtllm_worker tests bench tools docs/*.py docs/examples
	$(BIN)/ruff check --fix trtllm_worker tests bench tools docs/*.py docs/examples

docs: $(DOCS_STAMP)  ## docs/settings.md from the Settings class, then the site in build/site (warnings are errors)
	$(BIN)/python docs/gen_settings.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test: lint typecheck pytest  ## ruff, mypy --strict and every test (real RabbitMQ and Redis)

test-latest: | $(UV)  ## the same checks against the newest releases, ignoring uv.lock (in .venv-latest)
	rm -rf $(LATEST)
	$(UV) venv --quiet --python $(PYTHON) $(LATEST)
	VIRTUAL_ENV=$(LATEST) $(UV) pip install --quiet --upgrade -e '.[dev]'
	VIRTUAL_ENV=$(LATEST) $(UV) pip list --outdated 2>/dev/null || true
	touch $(LATEST)/.installed $(LATEST)/.installed-dev
	$(MAKE) VENV=$(LATEST) test

test-servers: | $(UV)  ## the integration suite on RabbitMQ 4.0, Redis 8.0, Valkey 8.1 and Python 3.13 (Debian 13 root)
	bash tools/test-servers.sh

fuzz: $(DEV_STAMP)  ## many more fuzzed messages against a running worker (FUZZ_EXAMPLES)
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-5000} $(BIN)/pytest tests/integration/test_fuzz.py -q -o timeout=1800

cluster-up:  ## a local Redis Cluster, a Sentinel-managed Redis and a RabbitMQ cluster to try (docs/scaling-out.md)
	bash tools/clusters.sh up

cluster-down:  ## stop what cluster-up started
	bash tools/clusters.sh down

bench: $(BENCH_STAMP)  ## every scenario; results in bench/results/ (BENCH_PROFILE=1: py-spy profiles)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/run.py $(SCENARIOS)

clean:
	rm -rf $(VENV) $(LATEST) $(TOOLS) tests/node/node_modules build/site .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info
