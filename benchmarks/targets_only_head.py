"""Benchmark (issue 37 item 7): peak memory and tokens/s of the default loss before and after it gathers the target
positions before the LM head, on assistant-only chat-like data (about a fifth of the positions carry a target) and on
text where every position does, for a transformers llama of a few million parameters with a 32,000-token vocabulary.

"full": every position's logits (``token_cross_entropy_sum``, the default loss until issue 37); "gathered": the
hidden states of the positions with a target gathered before the head (``TargetsOnlyCrossEntropy``, what
``build_loss`` picks for ``--loss-chunk-tokens 0`` now, asserted). Per data set, one engine per loss is built as
`cadence train` builds it (same seed, AdamW, clipping at 1.0) and trained on the same windows (micro-batches of 4 x
up to 512 tokens, 2 per window, the examples' own lengths right-padded as collate pads them): step 1 warms up
(AdamW's state), step 2 is measured by cadence's own memory meter (the profiler's allocation replay on CPU, the peak
`summary.json` reports), then rounds step both losses once on the round's window (alternating which goes first).
Reported: the median tokens/s (real input tokens of the window over its step time, and over the step's CPU time:
what a quiet core gives, whatever else shares the machine), the median of each round's step time (wall, and the
process's CPU time, one torch thread) over the full-logits step of the same round, every loss's largest relative
difference between the two, and the two runs' final weights' relative L2 distance. fp32 (a CPU without bf16
instructions would time the emulation). The load average is recorded before and after.

The data: each example is a system prompt, then 1-3 user turns each answered by an assistant turn, 384-512 tokens in
all; the assistant replies (each with its end-of-turn token) are the trained tokens, 15-25% of the example, the rest
(system, user turns, the padding of a micro-batch) has no target, as `--train-on assistant` chat data has it. Random
token ids: a step's cost depends on the shapes and the target positions only.

    .venv/bin/python benchmarks/targets_only_head.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import time

import torch
from bench_env import environment, write_results

from cadence.config import TrainConfig
from cadence.data import TokenDataset, make_example
from cadence.engine import Cut, Engine, TargetsOnlyCrossEntropy, Window, epoch_windows, token_cross_entropy_sum
from cadence.models.hf import build_hf_model
from cadence.training.components import build_loss, build_optimizer

LLAMA = {"vocab_size": 32000, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 4, "intermediate_size": 344, "max_position_embeddings": 512}
"""A llama of small width (128, 4 layers: 8.9M parameters, 8.2M of them the embedding and the head) with the
32,000-token vocabulary of Llama 1 and 2: the logits are most of a step's memory, as they are for small models with
large vocabularies."""
QUICK_LLAMA = {**LLAMA, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 2,
               "num_key_value_heads": 2}
LOSSES = ("full", "gathered")
MICRO, ACCUM = 4, 2


def chat_like(count: int, *, seq_len: int, vocab: int, seed: int) -> TokenDataset:
    """Assistant-only examples: system prompt, then user / assistant turns; only the assistant replies are trained
    (15-25% of each example's positions)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        length = rng.randint(int(0.75 * seq_len), seq_len)
        trained = round(length * rng.uniform(0.15, 0.25))
        turns = rng.randint(1, 3)
        replies = [trained // turns + (1 if turn < trained % turns else 0) for turn in range(turns)]
        untrained = length - trained
        system = untrained // (turns + 1)  # the system prompt; the rest is the user turns
        users = [(untrained - system) // turns + (1 if turn < (untrained - system) % turns else 0)
                 for turn in range(turns)]
        tokens = [rng.randrange(vocab) for _ in range(length + 1)]
        mask = [False] * system
        for user, reply in zip(users, replies, strict=True):
            mask += [False] * user + [True] * reply
        labels = [tokens[i + 1] if mask[i] else -100 for i in range(length)]
        examples.append(make_example(tokens[:length], labels))
    return TokenDataset(examples)


def text_like(count: int, *, seq_len: int, vocab: int, seed: int) -> TokenDataset:
    """Rows of text, every position a target (pretraining): nothing for the gather to leave out."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (seq_len + 1,), generator=generator).tolist()
        examples.append(make_example(tokens[:-1], tokens[1:]))
    return TokenDataset(examples)


def engine(loss: str, overrides: dict) -> Engine:
    torch.manual_seed(0)
    model = build_hf_model("hf:llama", overrides).model
    config = TrainConfig(lr=1e-3)
    chosen = build_loss(config, model, vocab_size=overrides["vocab_size"])  # what cadence train picks for this model
    assert isinstance(chosen, TargetsOnlyCrossEntropy), chosen
    loss_fn = chosen if loss == "gathered" else token_cross_entropy_sum
    return Engine(model, build_optimizer(model, config), precision="fp32", max_grad_norm=1.0, loss_fn=loss_fn)


def measure(name: str, dataset: TokenDataset, overrides: dict, *, rounds: int) -> dict:
    windows: list[Window] = list(itertools.islice(
        epoch_windows(dataset, cut=Cut(micro_batch_size=MICRO), grad_accum_steps=ACCUM, seed=0, epoch=0), 2 + rounds))
    assert len(windows) == 2 + rounds, "not enough examples for the rounds"
    runs = {loss: engine(loss, overrides) for loss in LOSSES}
    losses: dict[str, list[float]] = {loss: [] for loss in LOSSES}
    peaks = {}
    for loss, run in runs.items():
        losses[loss].append(run.step(windows[0]).loss)  # AdamW allocates its state in the first step
        result = run.step(windows[1], measure_memory=True)
        losses[loss].append(result.loss)
        peaks[loss] = result.peak_memory_bytes
    wall: dict[str, list[float]] = {loss: [] for loss in LOSSES}
    cpu: dict[str, list[float]] = {loss: [] for loss in LOSSES}
    for round_index, window in enumerate(windows[2:]):
        for loss in LOSSES if round_index % 2 == 0 else LOSSES[::-1]:  # alternating which goes first
            started = time.process_time()
            result = runs[loss].step(window)
            cpu[loss].append(time.process_time() - started)
            wall[loss].append(result.step_time_s)
            losses[loss].append(result.loss)
        print(f"{name} round {round_index + 1}/{rounds}: " + ", ".join(
            f"{loss} {wall[loss][-1]:.2f} s" for loss in LOSSES), flush=True)
    measured = windows[2:]
    tokens = statistics.median(window.tokens for window in measured)
    positions = statistics.median(window.positions for window in measured)
    targets = statistics.median(window.targets for window in measured)
    weights = {loss: torch.cat([p.detach().flatten() for p in runs[loss].model.parameters()]) for loss in LOSSES}
    results = {}
    for loss in LOSSES:
        # Paired with the full-logits step of the same round: a busy moment of the machine slows both sides.
        wall_ratio = statistics.median(mine / base for mine, base in zip(wall[loss], wall["full"], strict=True))
        cpu_ratio = statistics.median(mine / base for mine, base in zip(cpu[loss], cpu["full"], strict=True))
        results[loss] = {
            "peak_memory_bytes": peaks[loss], "peak_vs_full": peaks[loss] / peaks["full"],
            "tokens_per_s": tokens / statistics.median(wall[loss]),
            # Per second of the process's own CPU time (one thread): what the wall time would give on a quiet core.
            "tokens_per_cpu_s": tokens / statistics.median(cpu[loss]),
            "step_time_s": wall[loss], "cpu_time_s": cpu[loss],
            "time_vs_full": wall_ratio, "cpu_time_vs_full": cpu_ratio,
            "max_loss_difference": max(abs(a - b) / abs(b) for a, b in zip(losses[loss], losses["full"], strict=True)),
            "losses": losses[loss],
        }
        row = results[loss]
        print(f"{name} {loss}: peak {peaks[loss] / 2**20:,.1f} MiB ({row['peak_vs_full']:.2f}x), "
              f"{row['tokens_per_s']:,.0f} tok/s ({row['tokens_per_cpu_s']:,.0f} per CPU second), "
              f"step time {wall_ratio:.2f}x, CPU time {cpu_ratio:.2f}x, "
              f"max loss difference {row['max_loss_difference']:.1e}", flush=True)
    distance = float((weights["gathered"] - weights["full"]).norm() / weights["full"].norm())
    print(f"{name}: final weights {distance:.1e} apart (relative L2)", flush=True)
    return {"micro_batch_size": MICRO, "grad_accum_steps": ACCUM, "window_tokens": tokens,
            "window_positions": positions, "window_targets": targets, "target_share": targets / positions,
            "weights_relative_l2": distance, "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a width-64 llama, sequences of 128, 2 rounds: a smoke run")
    args = parser.parse_args()
    overrides = QUICK_LLAMA if args.quick else LLAMA
    seq_len = 128 if args.quick else 512
    rounds = 2 if args.quick else 6  # 6: about 2.5 minutes of CPU time in all on one core
    count = MICRO * ACCUM * (2 + rounds)
    vocab = overrides["vocab_size"]
    # One thread: on 2 cores shared with other work, a second OpenMP thread spin-waits for a busy core and turns
    # every timing into noise. The process's CPU time is reported beside the wall time: it counts the work done,
    # whatever else the machine ran meanwhile.
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    started = time.perf_counter()
    data = {"assistant-only chat": chat_like(count, seq_len=seq_len, vocab=vocab, seed=0),
            "text (every position a target)": text_like(count, seq_len=seq_len, vocab=vocab, seed=1)}
    measured = {name: measure(name, dataset, overrides, rounds=rounds) for name, dataset in data.items()}
    torch.manual_seed(0)
    parameters = sum(p.numel() for p in build_hf_model("hf:llama", overrides).model.parameters())
    output = {
        "environment": environment(("transformers",)),
        "command": ".venv/bin/python benchmarks/targets_only_head.py" + (" --quick" if args.quick else ""),
        "precision": "fp32", "rounds": rounds, "torch_threads": torch.get_num_threads(), "seq_len": seq_len,
        "llama_config": overrides, "parameters": parameters, "wall_s": time.perf_counter() - started,
        "load_average_before": load_before[0], "load_average_after": os.getloadavg()[0], "data": measured,
    }
    write_results("targets_only_head", output, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
