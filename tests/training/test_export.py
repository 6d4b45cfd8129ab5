"""`cadence export CHECKPOINT --out DIR` (issue 38): a checkpoint of a transformers run as a save_pretrained directory;
the adapter alone under --lora-rank. (A sharded checkpoint's export: tests/distributed/test_distributed.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_cli
from safetensors.torch import load_file
from test_train_hf import LLAMA, uneven_jsonl

from cadence.cli import main


def test_a_lora_checkpoint_exports_its_adapter_as_save_hf_does_and_bad_input_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    data = uneven_jsonl(tmp_path / "pc.jsonl")
    out = tmp_path / "run"
    assert main(["train", *LLAMA, "--data", str(data), "--seq-len", "48", "--max-steps", "2", "--val-fraction", "0",
                 "--lr", "3e-3", "--lora-rank", "2", "--checkpoint-every", "2", "--micro-batch-size", "4",
                 "--grad-accum-steps", "2", "--save-hf", str(tmp_path / "saved"), "--out", str(out)]) == 0
    status, stdout, _ = run_cli(["export", str(out / "checkpoints" / "step-2"), "--out", str(tmp_path / "exported")])
    assert status == 0 and "adapter_model.safetensors" in stdout
    exported = load_file(str(tmp_path / "exported" / "adapter_model.safetensors"))
    saved = load_file(str(tmp_path / "saved" / "adapter_model.safetensors"))  # --save-hf at the same step
    assert exported.keys() == saved.keys() and all(torch.equal(exported[key], saved[key]) for key in saved)
    assert json.loads((tmp_path / "exported" / "adapter_config.json").read_text())["r"] == 2
    assert not (tmp_path / "exported" / "model.safetensors").exists()  # the adapter alone
    for argv, where in ((["export", str(out), "--out", str(tmp_path / "x")], "CHECKPOINT"),
                        (["export", str(out / "checkpoints" / "step-2"), "--out", str(tmp_path / "exported")],
                         "--out")):
        status, _, err = run_cli(argv)
        assert status == 2 and err.count("\n") == 1 and where in err, err
