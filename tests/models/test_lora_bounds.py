"""Issue 44 item 5: --lora-rank past every layer's width is refused in one line before peft allocates anything (a
rank of 10**9 asked the allocator for terabytes, 2**63 overflowed: both tracebacks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import sample_text

from cadence.cli import main

pytest.importorskip("peft")

LLAMA = ["--model", "hf:llama", *[item for key, value in {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
    "vocab_size": 256, "max_position_embeddings": 128}.items() for item in ("--model-config", f"{key}={value}")]]


@pytest.mark.parametrize("rank", [65, 10**9, 2**63])
def test_a_lora_rank_above_the_layers_width_is_refused(tmp_path: Path, capsys, rank):
    data = tmp_path / "text.txt"
    data.write_bytes(sample_text(400 * 32 + 1))
    out = tmp_path / "run"
    assert main(["train", *LLAMA, "--data", str(data), "--seq-len", "32", "--max-steps", "2", "--val-fraction", "0",
                 "--lora-rank", str(rank), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"cadence: error: --lora-rank: {rank} is more than the layer's width: the widest linear layer of this model "
        f"has 64 on its smaller side, and a rank above that adds nothing (give at most 64; 8 to 64 is usual)"]
    assert not out.exists()
