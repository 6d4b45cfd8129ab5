"""--checkpoint-mid-window under FSDP2 (issue 38, item 6): with --sync-every-micro-step each rank holds its shard of
the window's gradient so far; a SIGTERM mid-window saves that shard in the rank's own file, and --resume puts it back
as the sharded gradient, so the run continues the window where it stopped: the uninterrupted run's losses and
weights, bit for bit, and no micro-batch computed twice. (Without --sync-every-micro-step the unsynchronised
gradients are inside FSDP2's own state and the flag is refused: tests/test_cli_errors.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ranks_counting, relative_l2, write_jsonl
from safetensors.torch import load_file

from cadence.training.checkpoint import checkpoint_dirs
from cadence.training.run_dir import read_metrics
from cadence.training.state_file import read_state

pytestmark = pytest.mark.slow  # real gloo processes

MID_WINDOW = ["--seq-len", "32", "--max-steps", "4", "--lr", "3e-3", "--val-fraction", "0", "--too-long", "truncate",
              "--micro-batch-size", "1", "--grad-accum-steps", "4", "--checkpoint-every", "100",
              "--checkpoint-mid-window", "--strategy", "fsdp", "--sync-every-micro-step"]


def test_a_mid_window_sigterm_on_two_fsdp2_ranks_resumes_without_computing_a_micro_batch_twice(
        tmp_path: Path) -> None:
    """Acceptance: SIGTERM after micro-batch 2 of step 3's 4 on 2 FSDP2 ranks; each rank saves its own shard of the
    gradient so far; resumed, the uninterrupted run bit for bit, each micro-batch computed once."""
    data = write_jsonl(tmp_path / "examples.jsonl")
    whole = ranks_counting(MID_WINDOW, tmp_path / "whole-counts", data, tmp_path / "whole", stop=(-1, -1))
    cut = ranks_counting(MID_WINDOW, tmp_path / "cut-counts", data, tmp_path / "cut", stop=(2, 2))
    (checkpoint,) = checkpoint_dirs(tmp_path / "cut")
    names = {path.name for path in checkpoint.iterdir()}
    assert {"rank-0.json", "rank-0.safetensors", "rank-1.json", "rank-1.safetensors", "__0_0.distcp",
            "__1_0.distcp", ".metadata"} <= names
    info = json.loads((checkpoint / "checkpoint.json").read_text())
    assert info["mid_window"] and info["step"] == 2 and info["format"] == "dcp"
    # Each rank's file holds its shard of each gradient: together, the whole gradient's rows, once each.
    grads = [read_state(checkpoint, f"rank-{rank}")["grads"] for rank in range(2)]
    final = load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert grads[0] and grads[0].keys() == grads[1].keys() <= final.keys()
    for name in grads[0]:
        assert grads[0][name].shape[0] + grads[1][name].shape[0] == final[name].shape[0], name
    rest = ranks_counting(MID_WINDOW, tmp_path / "rest-counts", data, tmp_path / "cut", stop=(-1, -1), resume=True)
    mine, theirs = read_metrics(tmp_path / "cut"), read_metrics(tmp_path / "whole")
    assert [(row["step"], row["loss"]) for row in mine] == [(row["step"], row["loss"]) for row in theirs]
    weights = relative_l2(load_file(str(tmp_path / "cut" / "model.safetensors")), final)
    assert weights == 0.0
    for rank in range(2):
        assert whole[rank]["micro_batches"] == 4 * 4
        assert cut[rank]["micro_batches"] + rest[rank]["micro_batches"] == 4 * 4, rank  # none computed twice
        assert cut[rank]["micro_batches"] == 2 * 4 + 2
    print(f"FSDP2 mid-window: micro-batches per rank {cut[0]['micro_batches']} before the stop + "
          f"{rest[0]['micro_batches']} after; losses and weights bit for bit")
