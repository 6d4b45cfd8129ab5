"""A model directory on 2 FSDP2 ranks, loaded once (issue 38, item 5: each rank reads its own rows) and exported with
--save-hf without a gather (item 4): the one-process run's losses, and the final weights are streamed into
model.safetensors a tensor at a time (every rank gathers one tensor, rank 0 writes it, it is dropped) and the export
is copied from that file a tensor at a time; it loads in transformers with the one-process export's logits.

The measure of "no rank holds the whole model": on each rank, the bytes of tensors made whole by
``DTensor.full_tensor`` that are alive at once (tests/distributed/save_hf_ranks.py), against the model's bytes; and
the training loop's whole-state gather (``full_model_state``) is never called."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import relative_l2, write_jsonl
from safetensors import safe_open
from safetensors.torch import load_file
from test_load_once import llama_directory

from cadence.cli import main
from cadence.training.run_dir import read_metrics

pytestmark = pytest.mark.slow  # real gloo processes
transformers = pytest.importorskip("transformers")

ARGS = ["--seq-len", "32", "--max-steps", "2", "--lr", "3e-3", "--val-fraction", "0.1", "--eval-every", "1",
        "--keep-best", "--too-long", "truncate", "--micro-batch-size", "2", "--effective-batch-size", "8"]
"""--keep-best too: its weights are written a tensor at a time under FSDP2 as well."""


def _names(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as handle:
        return set(handle.keys())


def test_two_fsdp2_ranks_load_a_directory_once_train_its_losses_and_save_hf_without_a_gather(
        tmp_path: Path) -> None:
    """Acceptance: a tied llama directory on 2 FSDP2 ranks, each reading its own rows, trains the losses of one
    process loading it with from_pretrained (1e-6); its --save-hf export, streamed, loads in transformers with the
    one-process export's logits (1e-5), and no rank held the whole model (--keep-best's saves included)."""
    directory = llama_directory(tmp_path / "llama", tied=True)
    data = write_jsonl(tmp_path / "examples.jsonl")
    assert main(["train", "--model", str(directory), "--data", str(data), *ARGS, "--out", str(tmp_path / "one"),
                 "--save-hf", str(tmp_path / "one-hf")]) == 0
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).resolve().parent / "save_hf_ranks.py"), str(tmp_path / "counts"), "--", "train",
         "--strategy", "fsdp", "--model", str(directory), "--data", str(data), *ARGS, "--out", str(tmp_path / "two"),
         "--save-hf", str(tmp_path / "two-hf")], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / "counts" / f"rank-{rank}.json").read_text()) for rank in range(2)]
    assert [rank["status"] for rank in ranks] == [0, 0], result.stderr[-3000:]
    assert "each of the 2 ranks reading only its own shard" in result.stderr
    rows = [read_metrics(tmp_path / name) for name in ("one", "two")]
    assert len(rows[0]) == len(rows[1]) == 2
    losses = max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(*rows, strict=True))
    assert losses <= 1e-6, rows

    # The export: the files and tensor names save_pretrained writes (the tied head once), and the same logits.
    one, two = tmp_path / "one-hf", tmp_path / "two-hf"
    assert sorted(path.name for path in one.iterdir()) == sorted(path.name for path in two.iterdir())
    assert _names(one / "model.safetensors") == _names(two / "model.safetensors")
    assert "lm_head.weight" not in _names(two / "model.safetensors")
    ids = torch.arange(3, 40).reshape(1, -1)
    logits = []
    for exported in (one, two):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), local_files_only=True)
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    difference = ((logits[0] - logits[1]).abs().max() / logits[0].abs().max()).item()
    assert difference <= 1e-5, difference

    best = [load_file(str(tmp_path / name / "best" / "model.safetensors")) for name in ("one", "two")]
    assert best[0].keys() == best[1].keys() and relative_l2(best[1], best[0]) <= 1e-5

    # No rank held the whole model: the state dict's bytes against what each rank had whole at once.
    with safe_open(str(tmp_path / "two" / "model.safetensors"), framework="pt") as handle:
        sizes = [handle.get_slice(name).get_shape() for name in handle.keys()]
    whole = sum(4 * torch.Size(shape).numel() for shape in sizes)
    largest = max(4 * torch.Size(shape).numel() for shape in sizes)
    for rank in ranks:
        assert rank["whole_state_calls"] == 0
        assert len(rank["gathers"]) >= len(sizes)  # every tensor of the state dict gathered on every rank
        assert rank["peak_live_bytes"] <= largest < whole, (rank["peak_live_bytes"], largest, whole)
    print(f"2 FSDP2 ranks reading their own shards: losses within {losses:.1e} of one process; --save-hf: logits "
          f"within {difference:.1e} of the one-process export; at most "
          f"{max(rank['peak_live_bytes'] for rank in ranks):,} bytes gathered whole at once on a rank (the largest "
          f"tensor: {largest:,}; the whole model: {whole:,})")
