# Every target bootstraps .venv itself, so a fresh clone needs nothing but python3.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The lowest aiohttp pyproject.toml allows: `make test-floor` runs the suite on it, in a venv
# of its own, with the lowest MCP SDK and HTTP clients the test extra allows.
AIOHTTP_FLOOR := 3.14.4
CLIENT_FLOORS := mcp==2.0.0 httpx==0.27.0 httpx2==2.7.0 requests==2.32.3
FLOOR_VENV := .venv-floor
FLOOR_BIN := $(FLOOR_VENV)/bin
FLOOR_STAMP := $(FLOOR_VENV)/.installed

.PHONY: run test test-floor bench soak lint docs docs-serve clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,speed]'
	touch $(STAMP)

$(FLOOR_STAMP): pyproject.toml Makefile
	$(PY) -m venv $(FLOOR_VENV)
	$(FLOOR_BIN)/pip install -q --upgrade pip
	$(FLOOR_BIN)/pip install -q -e '.[test]' 'aiohttp==$(AIOHTTP_FLOOR)' $(CLIENT_FLOORS)
	touch $(FLOOR_STAMP)

run: $(STAMP)
	mkdir -p var
	$(BIN)/fence-gateway serve

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

# The high-availability tests and the documentation's examples check the store and the pages,
# not these libraries' versions: they run once, in `make test`.
test-floor: $(FLOOR_STAMP)
	$(FLOOR_BIN)/python -m pytest -q --ignore=tests/ha --ignore=tests/docs

bench: $(STAMP)
	$(BIN)/python -m tests.bench

# The long soak: DURATION seconds on SQLite, then as long on PostgreSQL (two replicas).
DURATION ?= 300
soak: $(STAMP)
	$(BIN)/python -m tests.soak --duration $(DURATION)

# The documentation site (mkdocs.yml), into site/; --strict: a broken link or anchor fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(FLOOR_VENV) var site
