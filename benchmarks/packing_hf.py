"""Benchmark (issue 30 item 5): --packing on a transformers llama against by-length, before and after cadence's
per-example attention.

Issue 30 measured packing at 1,392 tokens/s against by-length's 2,464 on a transformers llama on CPU, with more
memory, although packing computed 8% padding against 43%. The cause: transformers keeps packed examples apart with a
dense block-diagonal mask, so SDPA computes attention over whole rows (no causal skipping) and, as its grouped-query
path takes no mask, repeats k and v to the query heads first. ``cadence_sdpa`` (cadence.models.packed_attention) runs
one causal SDPA per example instead.

The same windows as benchmarks/padding.py (prompt/completion examples cut from the standard library, lengths 24-930,
micro 8 x accum 4, seq 1024) on a transformers llama (hidden 128, 4 layers, 4 query / 2 key-value heads, MLP 352,
byte vocabulary), three ways, each with its own model (same seed): by length (``--micro-batch-order by-length``),
packed with transformers' SDPA attention (before), packed with cadence's (after). Rounds alternate the modes; the
median real tokens/s per mode, its ratio to by-length, the measured peak and the losses (packed before and after
must agree to float rounding). Writes benchmarks/results/packing_hf.json.

    .venv/bin/python benchmarks/packing_hf.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_env import environment, write_results
from padding import alternating_rounds, dataset, warmed_up

from cadence.config import TrainConfig
from cadence.engine.cut import Cut
from cadence.engine.step import Engine
from cadence.engine.windows import epoch_windows
from cadence.models.hf import build_hf_model
from cadence.models.packed_attention import ATTENTION_NAME
from cadence.training.components import build_optimizer

LLAMA = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 352, "vocab_size": 256, "max_position_embeddings": 1024}
MODES = {  # mode -> (micro-batch order, packed, attention implementation)
    "by-length": ("by-length", False, ATTENTION_NAME),
    "packing, transformers' attention (before)": ("drawn", True, "sdpa"),
    "packing, cadence's attention (after)": ("drawn", True, ATTENTION_NAME),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 256, 2 layers, 1 round: a smoke run")
    args = parser.parse_args()
    seq_len, rounds, steps = (256, 1, 1) if args.quick else (1024, 5, 2)
    overrides = {**LLAMA, "num_hidden_layers": 2} if args.quick else LLAMA
    micro, accum = 8, 4
    data = dataset(micro * accum * (rounds * steps + 2) * 2, seq_len)
    budget = micro * max(len(example.input_ids) for example in data)
    runs: dict[str, dict] = {}
    for mode, (order, packed, attention) in MODES.items():
        torch.manual_seed(0)
        hf = build_hf_model("hf:llama", overrides)
        hf.model.set_attn_implementation(attention)
        engine = Engine(hf.model, build_optimizer(hf.model, TrainConfig(lr=1e-3)), precision="fp32",
                        max_grad_norm=1.0)
        cut = Cut(micro_batch_size=micro, order=order, micro_batch_tokens=budget if packed else None,
                  pack_length=seq_len if packed else None)
        windows = epoch_windows(data, cut=cut, grad_accum_steps=accum, seed=0, epoch=0)
        runs[mode] = warmed_up(engine, windows)
    alternating_rounds(runs, rounds, steps)
    base = statistics.median(runs["by-length"]["rates"])
    before, after = runs["packing, transformers' attention (before)"], runs["packing, cadence's attention (after)"]
    results = {mode: {
        "tokens_per_s": statistics.median(run["rates"]), "ratio": statistics.median(run["rates"]) / base,
        "real_share": run["tokens"] / (run["tokens"] + run["padded"]), "peak_bytes": run["peak_bytes"],
        "losses": run["losses"],
    } for mode, run in runs.items()}
    difference = max(abs(a - b) / abs(b) for a, b in zip(after["losses"], before["losses"], strict=True))
    for mode, row in results.items():
        print(f"{mode}: {row['tokens_per_s']:,.0f} tok/s ({row['ratio']:.2f}x by-length), real share "
              f"{row['real_share']:.2f}, peak {row['peak_bytes'] / 2**20:.1f} MiB", flush=True)
    print(f"packed losses, cadence's attention against transformers': largest relative difference {difference:.1e}")
    output = {
        "environment": environment(),
        "command": ".venv/bin/python benchmarks/packing_hf.py" + (" --quick" if args.quick else ""),
        "model": {"spec": "hf:llama", **overrides}, "seq_len": seq_len, "micro_batch_size": micro,
        "grad_accum_steps": accum, "micro_batch_tokens": budget, "rounds": rounds, "steps_per_round": steps,
        "examples": len(data), "mean_length": statistics.fmean(len(e.input_ids) for e in data),
        "results": results, "packed_loss_difference": difference,
    }
    write_results("packing_hf", output, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
