"""Benchmark (issue 26 item 6): cadence's memory estimate for a Llama-3.2-1B-shaped model on one CUDA device, before
and after the memory levers of large vocabularies and optimizer states.

The shape: 16 layers, hidden 2048, 32 query / 8 key-value heads, MLP 8192, vocabulary 128,256, tied embeddings
(1.24B parameters). The model is built on the meta device (no memory, no init), its shape read as `cadence plan`
reads it, LoRA injected by peft as `--lora-rank` injects it; every figure is
`cadence.memory.estimate_hf.estimate_hf_step_memory` at seq 2048, bf16 autocast, full recompute, device cuda. An
estimate, not a measurement: the estimate's error against CPU measurement is in "Memory estimate against
measurement" and the lever sections; on a GPU the CUDA context and the allocator's reserve come on top.

    .venv/bin/python benchmarks/estimate_1b.py
"""

from __future__ import annotations

import argparse

import torch
from bench_env import environment, write_results

from cadence.memory.estimate_hf import estimate_hf_step_memory
from cadence.models.hf import model_shape
from cadence.models.lora import LoraSettings, apply_lora, hold_base_in_bf16, lora_shape

LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 131072,
            "tie_word_embeddings": True, "head_dim": 64}
SEQ_LEN = 2048
MICRO_BATCHES = (1, 4, 8)
LEVERS = (
    ("before: fp32 AdamW state, all logits at once", {}, None),
    ("--loss-chunk-tokens 1024", {"loss_chunk_tokens": 1024}, None),
    ("--loss-chunk-tokens 1024 --optimizer-state bf16", {"loss_chunk_tokens": 1024, "optimizer_state": "bf16"}, None),
    ("--loss-chunk-tokens 1024 --optimizer-state 8bit", {"loss_chunk_tokens": 1024, "optimizer_state": "8bit"}, None),
    ("--loss-chunk-tokens 1024 --lora-rank 16", {"loss_chunk_tokens": 1024}, "fp32"),
    ("--loss-chunk-tokens 1024 --lora-rank 16 --lora-base-precision bf16", {"loss_chunk_tokens": 1024}, "bf16"),
)
GIB = 2**30


def build(lora_base: str | None) -> tuple[object, object]:
    """The 1B model on the meta device and its shape, with LoRA (rank 16, peft's default targets) when asked."""
    import transformers

    config = transformers.LlamaConfig(**LLAMA_1B)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    shape = model_shape(model, config)
    lora = None
    if lora_base is not None:
        apply_lora(model, LoraSettings(rank=16, alpha=None, targets=None, dropout=0.0, base_name_or_path=None))
        if lora_base == "bf16":
            hold_base_in_bf16(model)
        lora = lora_shape(model)
    return shape, lora


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    rows = []
    shapes = {base: build(base) for base in (None, "fp32", "bf16")}
    for name, levers, lora_base in LEVERS:
        shape, lora = shapes[lora_base]
        for micro in MICRO_BATCHES:
            estimate = estimate_hf_step_memory(shape, style="llama", micro_batch_size=micro, seq_len=SEQ_LEN,
                                               precision="bf16", checkpointing="full", device_type="cuda", lora=lora,
                                               **levers)
            rows.append({"levers": name, "micro_batch_size": micro, "peak_bytes": estimate.peak_bytes,
                         "by_category": estimate.by_category, "peak_phase": estimate.peak_phase})
            print(f"{name:70s} micro {micro}: {estimate.peak_bytes / GIB:6.2f} GiB "
                  + " ".join(f"{k} {v / GIB:.2f}" for k, v in estimate.by_category.items() if v))
    output = {"environment": environment(("transformers", "peft")), "model": LLAMA_1B, "seq_len": SEQ_LEN,
              "parameters": shapes[None][0].num_parameters, "precision": "bf16", "checkpointing": "full",
              "rows": rows}
    write_results("estimate_1b", output, quick=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
