# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# This environment's CPU build of PyTorch; installed first so that the package's `torch>=2.4` then installs nothing.
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow test-all lint typecheck clean bench bench-quick bench-data bench-gpu flags

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# Bytecode for cadence's own modules, written even where PYTHONDONTWRITEBYTECODE is set: compiling them on every
	# start costs about 0.3 s of each command's start-up (an edited module is recompiled in memory, still correct).
	$(BIN)/python -m compileall -q src > /dev/null
	touch $(STAMP)

install: $(STAMP)

# A complete run directory in a few minutes on 2 CPU cores: gpt-tiny on the built-in corpus, accumulation, and bf16
# where the CPU multiplies bf16 in hardware (avx512_bf16 / amx_bf16); elsewhere bf16 is emulated, 5-10x slower than
# fp32 (issue 41: an ETA of 3 h on an AVX2-only machine), so the demo trains in fp32 there. Its evaluations use 25
# micro-batches (200 examples, as the console says): the whole held-out 5% (6,158 examples) six times took 6 of the
# demo's 11 minutes on that machine.
DEMO_PRECISION ?= $(shell grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null && echo bf16 || echo fp32)

demo: $(STAMP)
	@# An earlier demo, and any report built in it, is moved aside under its time, never deleted.
	@if [ -e runs/demo ]; then kept=runs/demo-$$(date +%Y%m%d-%H%M%S); mv runs/demo $$kept; \
		echo "the earlier runs/demo is kept as $$kept"; fi
	$(BIN)/cadence train --model gpt-tiny --seq-len 256 --micro-batch-size 8 --grad-accum-steps 4 \
		--precision $(DEMO_PRECISION) --max-steps 300 --warmup-steps 20 --lr 2e-3 --eval-every 50 --eval-batches 25 --checkpoint-every 100 \
		--out runs/demo
	@echo "run directory: runs/demo (config.json, metrics.jsonl, summary.json, model.safetensors, tensorboard/)"
	@echo "cadence and tensorboard are in .venv: run '. .venv/bin/activate' first (or type .venv/bin/cadence)"

# pytest-xdist: one worker per core (-n auto), each computing with one thread (tests/conftest.py); tests that share a
# module fixture run on one worker (--dist loadgroup). PYTEST_WORKERS=0 runs in this process (a debugger).
# Two tiers, so that the everyday check stays under 10 minutes on 2 cores:
#   make test       ruff, mypy (make typecheck), every test not marked slow: the units, the step-chain rules, parity,
#                   bad-input tables, the CLI (about 1,450 tests): the everyday check
#   make test-slow  the tests marked slow: real multi-process runs (gloo ranks, torchrun agents, signals, kills),
#                   long quality checks, the biggest built-in models (about 20 minutes here: run it before a merge
#                   that touches distributed, resume, plan or memory code, and before every release)
#   make test-all   ruff, mypy and both tiers in one run: what CI runs (.ci/run)
# --durations: every run lists its slowest tests, where the time goes.
PYTEST_WORKERS ?= auto
PYTEST := $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup
MYPY := $(BIN)/python -m mypy

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(MYPY)
	$(PYTEST) -m "not slow" --durations=15

test-slow: $(STAMP)
	$(PYTEST) -m slow --durations=25

test-all: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(MYPY)
	$(PYTEST) --durations=25

# docs/FLAGS.md, the flag reference, generated from the schema (tests/config/test_reference.py fails when it drifts).
flags: $(STAMP)
	$(BIN)/python -m cadence.config.reference > docs/FLAGS.md

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples

# The type checker on src/cadence, configured in pyproject.toml ([tool.mypy]); make test and make test-all run it.
# Incremental (.mypy_cache): about 40 s of CPU on a fresh clone, seconds after that.
typecheck: $(STAMP)
	$(MYPY)

# Issue 9: the engine against a hand-written loop, Accelerate and Lightning Fabric (benchmarks/overhead.py), then
# memory flatness, recompute/offload costs and MFU (benchmarks/memory_and_modes.py), then the memory estimate against
# measurement (benchmarks/memory_estimate.py); benchmarks/write_report.py then rewrites BENCHMARKS.md from every
# benchmarks/results/*.json (plus the overhead plot), so BENCHMARKS.md is generated, never edited by hand.
# The `bench` extra (accelerate, lightning) goes into .venv only for these targets; `make test` never needs it.
# Both accept the installed torch: pip keeps $(TORCH_PIN) (checked with accelerate 1.15.0, lightning 2.6.6).
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]' $(TORCH_PIN)
	touch $(BENCH_STAMP)

# Full: 8 rounds x 4 timed steps per implementation and precision (about 4 minutes on 2 CPU cores), then about 2 and
# 1 minutes for the other two; the plan, phase, audit and demo results keep their JSON (see their sections' commands).
bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/memory_and_modes.py
	$(BIN)/python benchmarks/memory_estimate.py
	$(BIN)/python benchmarks/write_report.py

# Under 3 minutes on 2 CPU cores (about 1): 3 rounds x 2 timed steps; prints the overhead ratios and writes
# benchmarks/results/overhead_quick.json only. It does NOT touch BENCHMARKS.md, and write_report.py never shows
# *_quick.json, so quick numbers cannot pass for the full run's.
bench-quick: $(BENCH_STAMP)
	$(BIN)/python benchmarks/overhead.py --quick

# Issue 14: peak RSS/PSS of the whole process tree, start-up to the first step and wall time of `cadence train` on
# 3 MB, 323 MB and 3 GB of text (3 GB only with the token store and 8 GiB free), 1k and 200k prompt/completion
# examples, two ranks, and `cadence prepare-data` throughput; inputs are generated in a temporary directory and
# deleted. Writes benchmarks/results/data_store.json (then run benchmarks/write_report.py). About 3 minutes on 2 cores
# with the loader that reads everything into memory (the 3 GB case is then skipped), plus the 3 GB case's two runs
# with the store; `.venv/bin/python benchmarks/data_store.py --quick` is a one-minute smoke run (data_store_quick.json).
bench-data: $(STAMP)
	$(BIN)/python -m compileall -q src > /dev/null
	$(BIN)/python benchmarks/data_store.py

# Issue 16: everything the CUDA path must show, in one command under 8 minutes on one GPU (benchmarks/gpu.py): the
# paired comparison (gpt-base, and a ~1B model for MFU), `cadence train` against the engine, --compile on/off, the
# memory estimate against torch.cuda.max_memory_allocated, plan and auto micro-batch under a budget, verify fp16 and
# bf16, then pytest -m gpu; the issue's GPU figures judged pass/fail. Writes benchmarks/results/gpu.json (then run
# benchmarks/write_report.py). Without CUDA it runs its dry run instead (tiny sizes on the CPU, under a minute, into
# gpu_quick.json), as tests/test_bench_gpu.py does in `make test-slow`. On a machine with its own torch, accelerate and
# lightning and no install of cadence (src/ is put on the path by the script itself):
#   make bench-gpu GPU_PYTHON=python3 GPU_ARGS="--out $$OUT/gpu.json"
# or simply `python3 benchmarks/gpu.py --out $OUT/gpu.json`.
GPU_PYTHON ?=
GPU_ARGS ?=
bench-gpu: $(if $(GPU_PYTHON),,$(BENCH_STAMP))
	$(or $(GPU_PYTHON),$(BIN)/python) benchmarks/gpu.py $(GPU_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
