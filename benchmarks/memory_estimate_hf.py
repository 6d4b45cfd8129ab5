"""Benchmark: the memory estimate for transformers models against measurement, for every cut and recompute mode.

Issue 28 item 4. A tiny transformers llama (hidden 64, 2 layers, 4 query / 2 key-value heads, MLP 176, vocabulary
256) and gpt2 (hidden 64, 2 layers, 4 heads, dropout 0), trained by cadence's Engine for one measured step (after a
warm-up step that creates AdamW's state), with each cut the CLI makes:

- rows: 4 rows of 128 tokens (``--micro-batch-size 4``), every position a target;
- packed: 4 rows of 128 packed with three prompt/completion examples each and the padding (``--packing``, as
  ``collate_packed`` builds them: position_ids restart at each example, half of each example is prompt);
- budget: a token budget of 512 as 16 rows of 32 (``--micro-batch-tokens 512`` on short examples);

under fp32 and bf16 autocast and no, full and selective recompute. The measured peak is the profiler's memory
timeline (``cadence.memory.measure.measure_step``); the estimate is ``estimate_hf_step_memory`` with the cut's tokens,
targets and ``packed``. Writes benchmarks/results/memory_estimate_hf.json.

    .venv/bin/python benchmarks/memory_estimate_hf.py [--quick]
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_env import environment, write_results

from cadence.config import TrainConfig
from cadence.data.batching import Example
from cadence.engine.step import Engine
from cadence.engine.windows import collate_packed
from cadence.memory.estimate_hf import estimate_hf_step_memory
from cadence.memory.measure import measure_step
from cadence.memory.recompute import apply_activation_checkpointing
from cadence.models.hf import build_hf_model
from cadence.training.components import build_optimizer

MODELS = {
    "llama": ("hf:llama", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 256,
                           "max_position_embeddings": 256}),
    "gpt2": ("hf:gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 256,
                         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
}
CUTS = ("rows", "packed", "budget")
PRECISIONS = ("fp32", "bf16")
RECOMPUTES = ("none", "full", "selective")


def window(cut: str, seed: int) -> tuple[list[dict[str, torch.Tensor]], int, int, int]:
    """(micro-batches, rows, row length, target tokens) of one window of ``cut``."""
    generator = torch.Generator().manual_seed(seed)
    if cut == "packed":
        rows = []
        for _ in range(4):
            row = []
            for length in (40, 50, 30, 8):
                labels = torch.randint(0, 256, (length,), generator=generator)
                labels[: length // 2] = -100
                row.append(Example(input_ids=torch.randint(0, 256, (length,), generator=generator), labels=labels))
            rows.append(row)
        batch = collate_packed(rows)
        return [batch], 4, 128, int((batch["labels"] != -100).sum())
    count, length = (4, 128) if cut == "rows" else (16, 32)
    ids = torch.randint(0, 256, (count, length), generator=generator)
    labels = torch.randint(0, 256, (count, length), generator=generator)
    return [{"input_ids": ids, "labels": labels}], count, length, count * length


def measure(model_name: str, cut: str, precision: str, recompute: str) -> dict:
    spec, overrides = MODELS[model_name]
    torch.manual_seed(0)
    hf = build_hf_model(spec, overrides)
    apply_activation_checkpointing(hf.model, recompute)  # type: ignore[arg-type]
    optimizer = build_optimizer(hf.model, TrainConfig())
    Engine(hf.model, optimizer, precision="fp32", max_grad_norm=1.0).step(window(cut, 0)[0])
    engine = Engine(hf.model, optimizer, precision=precision, max_grad_norm=1.0)  # type: ignore[arg-type]
    batches, rows, length, targets = window(cut, 1)
    measured = measure_step(hf.model, optimizer, lambda: engine.step(batches), "cpu")
    predicted = estimate_hf_step_memory(hf.shape, style=hf.config.model_type, micro_batch_size=rows,
                                        seq_len=length, precision=precision, checkpointing=recompute,
                                        target_tokens=targets, packed=cut == "packed")
    return {"model": model_name, "cut": cut, "precision": precision, "recompute": recompute, "rows": rows,
            "row_length": length, "target_tokens": targets, "measured_peak_bytes": measured.peak_bytes,
            "estimated_peak_bytes": predicted.peak_bytes,
            "error": (predicted.peak_bytes - measured.peak_bytes) / measured.peak_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="llama only, fp32: a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the measurement is of tensors, not time: one thread keeps it quick and repeatable
    rows = []
    for model_name in ("llama",) if args.quick else tuple(MODELS):
        for cut in CUTS:
            for precision in ("fp32",) if args.quick else PRECISIONS:
                for recompute in RECOMPUTES:
                    row = measure(model_name, cut, precision, recompute)
                    rows.append(row)
                    print(f"{model_name:5s} {cut:6s} {precision} {recompute:9s} measured "
                          f"{row['measured_peak_bytes'] / 2**20:6.2f} MiB, estimated "
                          f"{row['estimated_peak_bytes'] / 2**20:6.2f} MiB ({row['error']:+.1%})", flush=True)
    worst = max(abs(row["error"]) for row in rows)
    print(f"worst error {worst:.1%} over {len(rows)} configurations")
    write_results("memory_estimate_hf", {"environment": environment(), "rows": rows, "worst_error": worst},
                  quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
