"""--compile with --lora-base-precision nf4 (issue 39): the blocks, their bitsandbytes 4-bit layers and peft's adapters
inside, compile as any block does (dynamo traces bitsandbytes' dequantise and 4-bit matmul, registered torch ops, with
no graph break) and train to eager's losses.

Tolerance: 1e-4 relative, as tests/models/test_compile.py allows for fp32 (inductor fuses and reorders fp32 sums);
measured on this CPU: the same losses to the bit over 4 steps. Slow as the other compile tests: inductor builds C++
kernels for the block's graph (a minute or more cold on a loaded 2-core CPU; its on-disk cache makes a repeat cheaper).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch._dynamo
from helpers import sample_text

from cadence.cli import main
from cadence.training.run_dir import read_metrics

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
         "vocab_size": 256, "max_position_embeddings": 128}
LLAMA = ["--model", "hf:llama", *[item for key, value in SIZES.items() for item in ("--model-config", f"{key}={value}")]]
RELATIVE = 1e-4


@pytest.mark.slow
def test_compiled_nf4_blocks_give_the_eager_losses(tmp_path: Path, one_thread: None) -> None:
    data = tmp_path / "text.txt"
    data.write_bytes(sample_text(200 * 32 + 1))  # text of one length: the block compiles once
    torch._dynamo.reset()  # compile here, whatever an earlier test in this process compiled
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        runs[name] = tmp_path / name
        assert main(["train", *LLAMA, "--data", str(data), "--seq-len", "32", "--micro-batch-size", "2",
                     "--grad-accum-steps", "2", "--max-steps", "4", "--val-fraction", "0", "--lr", "5e-3",
                     "--lora-rank", "8", "--lora-base-precision", "nf4", "--out", str(runs[name]), *extra]) == 0
    eager, compiled = ([row["loss"] for row in read_metrics(runs[name])] for name in ("eager", "compiled"))
    print(f"eager {eager}\ncompiled {compiled}")
    assert len(compiled) == 4 and compiled == pytest.approx(eager, rel=RELATIVE)
    summary = json.loads((runs["compiled"] / "summary.json").read_text())
    assert summary["compiled_graphs"] >= 1 and summary["graph_breaks"] == 0 and summary["compile_time_s"] > 0
    config = json.loads((runs["compiled"] / "config.json").read_text())
    assert config["compile"] and config["lora_base_precision"] == "nf4"
