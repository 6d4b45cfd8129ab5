# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# This environment's CPU build of PyTorch; installed first so that the package's `torch>=2.4` then installs nothing.
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# A complete run directory in a few minutes on 2 CPU cores: gpt-tiny on the built-in corpus, accumulation, bf16.
demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/cadence train --model gpt-tiny --seq-len 256 --micro-batch-size 8 --grad-accum-steps 4 \
		--precision bf16 --max-steps 300 --warmup-steps 20 --lr 2e-3 --eval-every 50 --checkpoint-every 100 \
		--out runs/demo
	@echo "run directory: runs/demo (config.json, metrics.jsonl, summary.json, model.safetensors, tensorboard/)"

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache
