# Every target bootstraps .venv itself, so a fresh clone needs nothing but python3.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	mkdir -p var
	$(BIN)/fence-gateway serve

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m tests.bench

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) var
