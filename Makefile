# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# This environment's CPU build of PyTorch; installed first so that the package's `torch>=2.4` then installs nothing.
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint clean bench bench-quick

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

# Issue 9: the engine against a hand-written loop, Accelerate and Lightning Fabric (benchmarks/overhead.py), then
# memory flatness, recompute/offload costs and MFU (benchmarks/memory_and_modes.py).
# The `bench` extra (accelerate, lightning) goes into .venv only for these targets; `make test` never needs it.
# Both accept the installed torch: pip keeps $(TORCH_PIN) (checked with accelerate 1.15.0, lightning 2.6.6).
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]' $(TORCH_PIN)
	touch $(BENCH_STAMP)

# Full: 8 rounds x 4 timed steps per implementation and precision (about 4 minutes on 2 CPU cores).
bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/memory_and_modes.py

# Under 3 minutes on 2 CPU cores (about 1): 3 rounds x 2 timed steps; writes benchmarks/results/overhead_quick.json.
bench-quick: $(BENCH_STAMP)
	$(BIN)/python benchmarks/overhead.py --quick

clean:
	rm -rf $(VENV) runs .pytest_cache
