VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-all lint format
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml $(wildcard plugins/*/*/pyproject.toml) scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh
	touch $@

demo: setup  ## the main job: turnout generate on the embedded SmolLM2-135M-Instruct
	$(BIN)/turnout generate --chat --max-tokens 96 --prompt "What is a railway turnout? Answer in two sentences."

test: setup lint  ## the CI suite: CPU tests (GPU tests skip without CUDA), ruff
	$(BIN)/python -m pytest -q -m "not gpu"

test-all: setup  ## everything, GPU tests included (on a CUDA machine)
	$(BIN)/python -m pytest -q

lint: setup  ## ruff, and the import contracts of pyproject.toml (plugins use only the core's facades)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PYTHONPATH=examples/turnout-example-backend:examples/turnout-example-model $(BIN)/lint-imports

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
