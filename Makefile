# The project's contract: `make install`, `make test`, `make lint`, `make serve`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test lint format serve clean

install: $(STAMP)

# torch is installed first and pinned: the project's range is then satisfied
# by the local CPU wheel, and nothing pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install --disable-pip-version-check -q -e ".[dev]"
	if [ -f client/pyproject.toml ]; then $(BIN)/pip install --disable-pip-version-check -q -e ./client; fi
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy scheduler

format: install
	$(BIN)/ruff format .

serve: install
	$(BIN)/iterserve serve

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
