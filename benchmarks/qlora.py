"""Benchmark (issue 39 item 2): QLoRA, --lora-base-precision nf4.

(a) The estimate for the Llama-3.1-8B shape (32 layers, hidden 4096, 32 query / 8 key-value heads, MLP 14336,
vocabulary 128,256, untied head; built on the meta device) at seq 2048, bf16 autocast, full recompute, LoRA rank 16
on all linear layers, on CUDA: the bf16 base against the nf4 base, with and without --loss-chunk-tokens 1024, at
micro-batch 1, 2 and 4, and which fit 24 GiB. An estimate, not a run.

(b) A CPU measurement: `cadence train` of a transformers llama whose linear layers dominate (SIZES below), LoRA rank
16 on all linear layers, once per base: peak memory (summary.json's, the profiler's replay) and tokens/s. fp32
compute (fp32 base against nf4), and bf16 compute (bf16 base against nf4) only where this CPU multiplies bf16 in
hardware: elsewhere torch emulates bf16 at a tenth of fp32's speed (the CPU flags are recorded).

    .venv/bin/python benchmarks/qlora.py
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_env import cpu_bf16, environment, write_results

from cadence.memory.estimate_hf import estimate_hf_step_memory
from cadence.models.hf import model_shape
from cadence.models.lora import LoraSettings, apply_lora, hold_base_in_bf16, lora_shape, planned_nf4

LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 131072,
            "tie_word_embeddings": False, "head_dim": 128}
SEQ_LEN = 2048
MICRO_BATCHES = (1, 2, 4)
BUDGET = 24 * 2**30
SIZES = {"hidden_size": 768, "num_hidden_layers": 7, "num_attention_heads": 12, "intermediate_size": 2048,
         "vocab_size": 256, "max_position_embeddings": 256}
"""The CPU model: about 50M parameters, nearly all of them the blocks' linear layers (the issue's size; on a quiet
2-core CPU a step of micro-batch 4 x 128 tokens takes 2-3 s)."""
GIB = 2**30


def estimate_8b() -> tuple[int, list[dict]]:
    import transformers

    config = transformers.LlamaConfig(**LLAMA_8B)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    shape = model_shape(model, config)
    apply_lora(model, LoraSettings(rank=16, targets=("all-linear",)))
    hold_base_in_bf16(model)
    bf16 = lora_shape(model)
    assert bf16 is not None
    # The nf4 base of the same model: what quantize_base_nf4 would quantise, counted (meta tensors cannot be).
    nf4 = planned_nf4(bf16, model)
    nf4 = type(nf4)(**{**nf4.__dict__, "bf16_base_parameters": 0})
    rows = []
    for base, lora in (("bf16", bf16), ("nf4", nf4)):
        for chunk in (0, 1024):
            for micro in MICRO_BATCHES:
                estimate = estimate_hf_step_memory(shape, style="llama", micro_batch_size=micro,
                                                   seq_len=SEQ_LEN, precision="bf16", checkpointing="full",
                                                   device_type="cuda", lora=lora, loss_chunk_tokens=chunk)
                rows.append({"base": base, "loss_chunk_tokens": chunk, "micro_batch_size": micro,
                             "peak_bytes": estimate.peak_bytes, "by_category": estimate.by_category,
                             "fits_24_gib": estimate.peak_bytes <= BUDGET})
                print(f"{base} chunk {chunk:4d} micro {micro}: {estimate.peak_bytes / GIB:6.2f} GiB")
    return shape.num_parameters, rows


def cpu_model_parameters() -> tuple[int, int]:
    """The CPU model's parameters, and those of its blocks' linear layers (what an nf4 base quantises)."""
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    linear = sum(module.weight.numel() for name, module in model.named_modules()
                 if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}")
    return sum(parameter.numel() for parameter in model.parameters()), linear


def train(base: str, precision: str, root: Path, steps: int) -> dict:
    from cadence.cli import main

    data = root / "data.jsonl"
    out = root / f"{base}-{precision}"
    argv = ["train", "--model", "hf:llama", *[x for k, v in SIZES.items() for x in ("--model-config", f"{k}={v}")],
            "--data", str(data), "--data-cache", str(root / "cache"), "--seq-len", "128", "--micro-batch-size", "4",
            "--grad-accum-steps", "1", "--max-steps", str(steps), "--val-fraction", "0", "--lr", "1e-3",
            "--precision", precision, "--lora-rank", "16", "--lora-targets", "all-linear",
            "--lora-base-precision", base, "--checkpoint-every", "1000", "--out", str(out)]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        status = main(argv)
    if status != 0:
        raise SystemExit(err.getvalue())
    summary = json.loads((out / "summary.json").read_text())
    return {"peak_memory_bytes": summary["peak_memory_bytes"], "tokens_per_s": summary["tokens_per_s"],
            "final_loss": summary["final_loss"], "base": base, "precision": precision}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    parameters, rows = estimate_8b()
    measured = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from helpers import write_jsonl

        write_jsonl(root / "data.jsonl", 256)
        pairs = [("fp32", "fp32"), ("nf4", "fp32")]
        if cpu_bf16() == "native":
            pairs += [("bf16", "bf16"), ("nf4", "bf16")]
        for base, precision in pairs:
            start = time.perf_counter()
            measured.append(train(base, precision, root, args.steps))
            print(f"{base} base, {precision}: {measured[-1]} ({time.perf_counter() - start:.0f} s)")
    torch.manual_seed(0)
    output = {"environment": environment(("transformers", "peft", "bitsandbytes")), "model": LLAMA_8B,
              "parameters": parameters, "seq_len": SEQ_LEN, "budget_bytes": BUDGET, "rows": rows,
              "cpu_model": SIZES, "cpu_parameters": cpu_model_parameters(), "cpu_steps": args.steps, "cpu_seq_len": 128, "cpu_micro_batch_size": 4,
              "cpu_bf16": cpu_bf16(), "measured": measured, "load_average_before": load_before,
              "load_average_after": os.getloadavg()[0]}
    write_results("qlora", output, quick=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
