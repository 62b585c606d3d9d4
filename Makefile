VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup setup-test demo test test-slow test-all lint format images docs
DEPS := pyproject.toml $(wildcard plugins/*/*/pyproject.toml) scripts/install.sh
setup: $(VENV)/.installed  ## what turnout needs to run
$(VENV)/.installed: $(DEPS)
	VENV=$(VENV) bash scripts/install.sh
	touch $@
setup-test: $(VENV)/.installed-test  ## and the test tools, Triton and Ray
$(VENV)/.installed-test: $(DEPS)
	VENV=$(VENV) bash scripts/install.sh --test
	touch $@ $(VENV)/.installed

demo: setup  ## the main job: turnout generate on the embedded SmolLM2-135M-Instruct
	$(BIN)/turnout generate --chat --max-tokens 96 --prompt "What is a railway turnout? Answer in two sentences."

# pytest-xdist workers for make test; the tests of one file run on one worker, sharing its module fixtures
WORKERS ?= 2
test: setup-test lint  ## the CI suite: ruff, the import contracts, the CPU tests but the slow ones, on $(WORKERS) workers
	$(BIN)/python -m pytest -q -m "not gpu and not slow" -n $(WORKERS) --dist loadfile

test-slow: setup-test  ## the slow CPU tests (servers under faults, Chromium, Ray, fuzzing, TP runs), one at a time
	$(BIN)/python -m pytest -q -m "slow and not gpu"

test-all: setup-test  ## everything, GPU tests included (on a CUDA machine)
	$(BIN)/python -m pytest -q

lint: setup-test  ## ruff, and the import contracts of pyproject.toml (plugins use only the core's facades)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PYTHONPATH=examples/turnout-example-backend:examples/turnout-example-model:examples/turnout-example-gemma2 $(BIN)/lint-imports

docs: setup  ## the generated docs: the attention order in docs/writing-a-plugin.md, the results index, docs/performance.md
	$(BIN)/python scripts/attention_order.py
	$(BIN)/python benchmarks/index.py
	$(BIN)/python benchmarks/report.py

images: setup-test  ## the README's screenshots of the chat page, taken by tests/test_web_page.py
	WEB_PAGE_IMAGES=docs/images $(BIN)/python -m pytest -q tests/test_web_page.py

format: setup-test
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
