"""Benchmark (issue 26 item 1): peak memory and tokens/s of `--loss-chunk-tokens` at 0 (all logits at once), 256,
1024 and 4096, on the byte-level gpt-small (vocabulary 256) and on a transformers llama of small width with a
32,000-token vocabulary, where the logits are most of the step's memory.

Per model, one engine per chunk size is built as `cadence train` builds it (same seed, AdamW, clipping at 1.0, the
loss `build_loss` picks for the flag) and trained on the same windows of the built-in corpus: step 1 warms up
(AdamW's state), step 2 is measured by cadence's own memory meter (the profiler's allocation replay on CPU, the
peak `summary.json` reports), then rounds step every chunk size once on the round's window (rotating which goes
first). Reported: the median tokens/s, the median of each round's step time (wall, and the process's CPU time, one
torch thread) over the whole-logits step of the same round, and every loss's largest relative difference from the
whole-logits run. fp32: this CPU has no bf16 instructions (bf16 would time the emulation). The load average is
recorded before and after: on a shared machine it says how much to trust the wall times.

    .venv/bin/python benchmarks/loss_chunking.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import torch
from bench_env import environment, write_results

from cadence.config import TrainConfig
from cadence.data import iterate_micro_batches, load_data
from cadence.engine.step import Engine
from cadence.engine.windows import iter_windows
from cadence.models import build_model
from cadence.models.hf import build_hf_model
from cadence.training.components import build_loss, build_optimizer

CHUNKS = (0, 256, 1024, 4096)
LLAMA = {"vocab_size": 32000, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "intermediate_size": 688, "max_position_embeddings": 512}
"""A llama of small width (256, 4 layers: 19.5M parameters, 16.4M of them the embedding and the head) with the
32,000-token vocabulary of Llama 1 and 2."""
QUICK_LLAMA = {**LLAMA, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}


def build(model: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if model == "gpt-small" or model == "gpt-tiny":
        return build_model(model)
    overrides = QUICK_LLAMA if model == "llama-64" else LLAMA
    return build_hf_model("hf:llama", overrides).model


def engine(model: str, chunk: int) -> Engine:
    net = build(model)
    config = TrainConfig(lr=1e-3, loss_chunk_tokens=chunk)
    return Engine(net, build_optimizer(net, config), precision="fp32", max_grad_norm=1.0, loss_fn=build_loss(config))


def measure(model: str, *, seq_len: int, micro: int, rounds: int) -> dict:
    data = load_data(None, seq_len, 0.0, max_corpus_bytes=4_000_000)
    windows = list(itertools.islice(iter_windows(iterate_micro_batches(data.train, micro, 0, 0), 1), 2 + rounds))
    runs = {chunk: engine(model, chunk) for chunk in CHUNKS}
    losses: dict[int, list[float]] = {chunk: [] for chunk in CHUNKS}
    peaks = {}
    for chunk, run in runs.items():
        losses[chunk].append(run.step(windows[0]).loss)  # AdamW allocates its state in the first step
        result = run.step(windows[1], measure_memory=True)
        losses[chunk].append(result.loss)
        peaks[chunk] = result.peak_memory_bytes
    wall: dict[int, list[float]] = {chunk: [] for chunk in CHUNKS}
    cpu: dict[int, list[float]] = {chunk: [] for chunk in CHUNKS}
    for round_index, window in enumerate(windows[2:]):
        # Every chunk size steps once on the round's window, in a rotating order.
        for chunk in CHUNKS[round_index % len(CHUNKS):] + CHUNKS[:round_index % len(CHUNKS)]:
            started = time.process_time()
            result = runs[chunk].step(window)
            cpu[chunk].append(time.process_time() - started)
            wall[chunk].append(result.step_time_s)
            losses[chunk].append(result.loss)
        print(f"{model} round {round_index + 1}/{rounds}: " + ", ".join(
            f"{chunk} {wall[chunk][-1]:.2f} s" for chunk in CHUNKS), flush=True)
    tokens = seq_len * micro
    results = {}
    for chunk in CHUNKS:
        # Each round's step time against the whole-logits step of the same round: paired, so that a busy moment of
        # the machine slows both sides of a ratio.
        wall_ratio = statistics.median(mine / base for mine, base in zip(wall[chunk], wall[0], strict=True))
        cpu_ratio = statistics.median(mine / base for mine, base in zip(cpu[chunk], cpu[0], strict=True))
        results[str(chunk)] = {
            "peak_memory_bytes": peaks[chunk], "peak_vs_whole": peaks[chunk] / peaks[0],
            "tokens_per_s": tokens / statistics.median(wall[chunk]), "step_time_s": wall[chunk],
            "cpu_time_s": cpu[chunk], "time_vs_whole": wall_ratio, "cpu_time_vs_whole": cpu_ratio,
            "max_loss_difference": max(abs(a - b) / abs(b) for a, b in zip(losses[chunk], losses[0], strict=True)),
        }
        row = results[str(chunk)]
        print(f"{model} chunk {chunk}: peak {peaks[chunk] / 2**20:,.1f} MiB ({row['peak_vs_whole']:.2f}x), "
              f"{row['tokens_per_s']:,.0f} tok/s, step time {wall_ratio:.2f}x, CPU time {cpu_ratio:.2f}x, "
              f"max loss difference {row['max_loss_difference']:.1e}", flush=True)
    net = runs[0].model
    vocab = int(getattr(getattr(net, "config", None), "vocab_size", 0))
    return {"seq_len": seq_len, "micro_batch_size": micro, "tokens_per_micro_batch": tokens,
            "vocab_size": vocab, "parameters": sum(p.numel() for p in net.parameters()), "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt-tiny and a width-64 llama, 2 rounds: a smoke run")
    args = parser.parse_args()
    models = (("gpt-tiny", 256, 4), ("llama-64", 512, 2)) if args.quick else (("gpt-small", 512, 4),
                                                                           ("llama-256", 512, 4))
    rounds = 2 if args.quick else 8
    # One thread: on 2 cores shared with other work, a second OpenMP thread spin-waits for a busy core and turns
    # every timing into noise. The process's CPU time is reported beside the wall time: it counts the work done,
    # whatever else the machine ran meanwhile.
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    started = time.perf_counter()
    measured = {name: measure(name, seq_len=seq, micro=micro, rounds=rounds) for name, seq, micro in models}
    output = {
        "environment": environment(("transformers",)),
        "command": ".venv/bin/python benchmarks/loss_chunking.py" + (" --quick" if args.quick else ""),
        "precision": "fp32", "chunks": list(CHUNKS), "rounds": rounds, "torch_threads": torch.get_num_threads(),
        "llama_config": QUICK_LLAMA if args.quick else LLAMA, "wall_s": time.perf_counter() - started,
        "load_average_before": load_before[0], "load_average_after": os.getloadavg()[0], "models": measured,
    }
    write_results("loss_chunking", output, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
