# One short command vocabulary; CI calls these verbatim (.ci/run).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test lint bench install clean

# `make run` installs the service alone (its runtime dependencies); `make install` adds the
# dev extra (tests, linters, plots). Each step says what it does, and pip shows its own
# progress. The compiled core (setup.py) is rebuilt by either install when its sources change.
SOURCES := pyproject.toml setup.py $(wildcard indexer/native/*.pyx indexer/native/*.h)
# The package's bytecode written at install, as installing a wheel does: a process started
# with PYTHONDONTWRITEBYTECODE set (containers often set it) then reads it instead of
# compiling every module at each start.
COMPILE = $(BIN)/python -m compileall -q api indexer clients kvindex

$(BIN)/pip:
	@echo "==> creating the virtual environment $(VENV)"
	$(PY) -m venv $(VENV)
	@echo "==> upgrading pip"
	$(BIN)/pip install --upgrade pip

$(VENV)/.run-installed: $(SOURCES) | $(BIN)/pip
	@echo "==> installing kvindex and its runtime dependencies, compiling its core"
	$(BIN)/pip install -e .
	$(COMPILE)
	touch $@

$(VENV)/.dev-installed: $(SOURCES) | $(BIN)/pip
	@echo "==> installing kvindex with its dev extra (tests, linters, plots), compiling its core"
	$(BIN)/pip install -e '.[dev]'
	$(COMPILE)
	touch $@ $(VENV)/.run-installed

# The published schemas of the custom resources the Helm chart writes, from the npm registry
# (tests/unit/test_helm_chart.py; without npm, that check is skipped).
CRDS := tests/support/crds
$(CRDS)/node_modules/.installed: $(CRDS)/package.json $(CRDS)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		echo "==> installing the custom resources' schemas (npm ci in $(CRDS))"; \
		npm ci --prefix $(CRDS) --no-audit --no-fund && touch $@; \
	else echo "==> npm not found: the chart's custom resources get structural checks only"; fi

install: $(VENV)/.dev-installed $(CRDS)/node_modules/.installed

run: $(VENV)/.run-installed ## the main job on the embedded store: the demo (replica-sims, indexer, API)
	@echo "==> kvindex demo"
	$(BIN)/kvindex demo

# Three test files at a time (the suite mostly waits on the processes it starts; each worker
# hands out its own loopback ports), then the tests that bound a latency, alone.
test: install ## the whole test suite (starts its own redis-server and Redis Cluster on loopback)
	$(BIN)/pytest -q -n 3 --dist loadfile -m "not latency_bound"
	$(BIN)/pytest -q -m latency_bound

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: install
	$(BIN)/python bench/ingest.py --quick

# SGLang's own KV-event publisher for tests/integration/test_sglang_publisher.py: sglang
# without its dependencies (no torch, no GPU) and the four its event modules import.
SGLANG_VENV ?= .venv-sglang

$(SGLANG_VENV)/.installed:
	@echo "==> SGLang 0.5.23's KV-event publisher in $(SGLANG_VENV) (CPU only, no torch)"
	$(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/pip install pyzmq msgspec pydantic psutil
	touch $@

.PHONY: sglang-venv
sglang-venv: $(SGLANG_VENV)/.installed

.PHONY: docs
docs: install ## the docs site into site/ (strict: a broken link or a missing page fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .pytest_cache .mypy_cache .ruff_cache
