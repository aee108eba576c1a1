# One short command vocabulary; CI calls these verbatim (.ci/run).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test lint bench install clean

# The compiled core (setup.py) is rebuilt by the same install when its sources change.
$(BIN)/kvindex: pyproject.toml setup.py indexer/native/_core.pyx
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/kvindex

run: install ## the main job on the embedded store: the demo (replica-sims, indexer, API)
	$(BIN)/kvindex demo

test: install ## the whole test suite (starts its own redis-server and Redis Cluster on loopback)
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: install
	$(BIN)/python bench/ingest.py --quick

.PHONY: docs
docs: install ## the docs site into site/ (strict: a broken link or a missing page fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
