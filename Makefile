# txsink: `make help` lists the targets. Every target sets up what it needs and is idempotent.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.txsink-installed
ZK_JAR := /usr/share/java/zookeeper.jar
export PYSPARK_PYTHON := $(abspath $(PY))
export PYSPARK_DRIVER_PYTHON := $(abspath $(PY))

.DEFAULT_GOAL := help
.PHONY: help setup zookeeper dist test test-slow test-matrix test-unit test-integration test-realserver lint typecheck docs demo bench bench-counts bench-shapes chaos clean embedded-up embedded-down

help: ## List the targets with what they do
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-18s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (Python >= 3.11 is required)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,bench,connect,embedded]'
	touch $(STAMP)

setup: $(STAMP) zookeeper ## Create .venv, install txsink with dev extras, install ZooKeeper if missing

zookeeper: ## Install Debian's zookeeper package when it is missing (needs root or sudo)
	@if [ -f $(ZK_JAR) ]; then echo "zookeeper: present ($(ZK_JAR))"; else \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q zookeeper >/dev/null 2>&1 || { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q zookeeper; }; \
	  test -f $(ZK_JAR) || { echo "error: zookeeper package did not install $(ZK_JAR)"; exit 1; }; fi
	@command -v java >/dev/null || { echo "error: java not found: ZooKeeper needs Java 17 (apt-get install openjdk-17-jre-headless)"; exit 1; }

LINT_PATHS := txsink tests scripts $(wildcard benchmarks)

lint: setup ## ruff check + ruff format --check
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

typecheck: setup ## mypy (strict for txsink.protocol and txsink.ports; tests/typing: the public API as users' checkers see it)
	$(VENV)/bin/mypy txsink tests/typing

docs: setup ## Regenerate the generated tables of docs/options.md (options registry), docs/types.md (type contract), docs/cli.md (exit statuses), docs/api.md (Python API), txsink/writer_options.py (typed options)
	$(PY) -m txsink.options_doc

test-unit: setup ## Unit tests only (no services)
	$(PY) -m pytest tests/unit -q

test-integration: setup ## Integration tests on the embedded stack (real ClickHouse engine, ZooKeeper, Spark)
	$(PY) -m pytest tests/integration -q

test-realserver: setup ## Tests against a real ClickHouse (TXSINK_REAL_URL/KEEPER: docker compose up -d) and a real 2x2 cluster (TXSINK_CLUSTER_*: docker-compose.cluster.yml)
	$(PY) -m pytest tests/realserver -q -rs

test: setup ## Everything CI runs: lint, typecheck, unit and integration tests (not the `slow` ones; the Spark ones beside the others: scripts/pytest_pair.py)
	$(MAKE) --no-print-directory lint typecheck
	$(PY) scripts/pytest_pair.py --durations=25

test-slow: setup ## Not in `test`: every-point crash matrices, long fault runs, repeated scenarios (tests marked `slow`; the finisher race 30 times)
	$(PY) -m pytest tests -q -m slow
	TXSINK_RACE_TRIALS=30 $(PY) -m pytest -q tests/integration/nemesis/test_batch_finishers.py -k two_finishers

dist: setup ## Build the wheel and the sdist into dist/ (what docs/install.md installs on a cluster)
	rm -rf dist build && $(PY) -m build --wheel --sdist --outdir dist .
	rm -rf build txsink.egg-info
	@ls -1 dist

test-matrix: setup ## Slow, not in `test`: the built wheel in fresh venvs: Python 3.11/3.12/3.13, and pyspark 3.5/4.0/4.x installed before it (unchanged by it); unit + end-to-end tests in each
	$(PY) scripts/test_matrix.py

demo: setup ## Run the main job: streaming into ClickHouse with injected crashes, then verify
	$(VENV)/bin/txsink demo --shards 3

CHAOS_MINUTES ?= 15
CHAOS_SEED ?=
chaos: setup ## Not in `test`: stream for CHAOS_MINUTES (15) while random faults (seed CHAOS_SEED) hit ClickHouse, ZooKeeper, network, job; verdict table
	$(PY) -m tests.nemesis.chaos --minutes $(CHAOS_MINUTES) $(if $(CHAOS_SEED),--seed $(CHAOS_SEED)) --json .txsink/chaos.json

bench: setup ## Run benchmarks/ and write docs/benchmarks.md + benchmarks/results.json
	$(PY) benchmarks/run.py

BENCH_COUNTS_ARGS ?=
bench-counts: setup ## Per micro-batch statements, Keeper requests and parts added at 4x1, 200x1, 20x50 tasks x partition values (issue 39; BENCH_COUNTS_ARGS, e.g. --json)
	$(PY) -m benchmarks.counts $(BENCH_COUNTS_ARGS)

BENCH_SHAPES_ARGS ?=
bench-shapes: setup ## Batch save() wall time, baseline vs attach, and parts added at 200x1 and 20x50 tasks x partition values (issue 39; BENCH_SHAPES_ARGS, e.g. --reps 1 --json)
	$(PY) -m benchmarks.shapes $(BENCH_SHAPES_ARGS)

embedded-up: setup ## Start the embedded ClickHouse + ZooKeeper stack in .txsink/embedded
	$(VENV)/bin/txsink embedded up

embedded-down: ## Stop the embedded stack
	$(VENV)/bin/txsink embedded down

clean: ## Stop the embedded stack and remove build artifacts (keeps .venv)
	-$(VENV)/bin/txsink embedded down 2>/dev/null
	rm -rf .txsink build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache spark-warehouse
