# The two commands of the README's quick start. Each creates the virtual environment .venv on first use (torch
# first, then this package with its extras) and reuses it afterwards.
#
#   make train                 the main job: GRPO with TreeGRPOTrainer on the embedded default (no download)
#   make test                  lint, then the test suite (what CI runs: .ci/run)
#
# Which torch build: TORCH is the pip requirement, TORCH_INDEX an optional package index to take it from.
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu                     CPU build (small, any machine)
#   make test TORCH=torch==2.11.0 TORCH_INDEX=https://download.pytorch.org/whl/cu130   a CUDA 13.0 build
# With no TORCH_INDEX, pip's own configuration decides (PyPI's Linux wheel of torch is the multi-GB CUDA build).
# Extra flags: make train ARGS="--max_steps 50"; make test PYTEST_ARGS="-k collator".

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
ARGS ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install train test clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[train,test,dev]"
	$(BIN)/python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|trl|accelerate|peft|datasets) ' || true
	touch $@

train: $(STAMP)
	HF_HUB_DISABLE_TELEMETRY=1 $(BIN)/accelerate launch trainers/grpo_tree.py $(ARGS)

# .venv/bin goes first on PATH, as if activated: the tests launch `accelerate` and `bash examples/*.sh`.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs
