"""Issue 50 item 6: checkpoint formats are classes behind one protocol, and every read of saved weights goes through
the Checkpointer. A new format is one class (here, in this module) and one registry entry: with them a run writes
its checkpoints in it, resumes from them bitwise, and ``cadence sample`` reads their weights, with no other change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_cli, sample_text, train_args
from safetensors.torch import load_file

from cadence.cli import main
from cadence.distributed.ranks import SINGLE, Ranks
from cadence.training.checkpoint import (
    FORMATS,
    Checkpointer,
    WeightsUnreadable,
    checkpoint_dirs,
    checkpoint_format,
    format_named,
    run_format,
    verify_checkpoint,
)
from cadence.training.checkpoint import checkpointer as checkpointer_module
from cadence.training.checkpoint.files import WholeFiles, read_weights_file
from cadence.training.checkpoint.format import Captured
from cadence.training.run_dir import save_weights

TOY_WEIGHTS = "toy-weights.safetensors"


class ToyFormat(WholeFiles):
    """A format of its own: the whole state, its weights under another file name."""

    name = "toy"
    files = (TOY_WEIGHTS,)

    def describe(self) -> str:
        return "toy: the weights in toy-weights.safetensors"

    def write(self, folder: Path, captured: Captured, ranks: Ranks, group: Any) -> list[str]:
        if not ranks.is_main or captured.tensors is None:
            return []
        save_weights(captured.tensors, folder / TOY_WEIGHTS)
        return [TOY_WEIGHTS]

    def weights_at(self, folder: Path) -> Path:
        return folder / TOY_WEIGHTS

    def read_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        return read_weights_file(folder / TOY_WEIGHTS)


FORMAT = ToyFormat()


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(sample_text(200 * 32 + 1))
    return path


def test_every_registered_format_implements_the_protocol() -> None:
    for name in FORMATS:
        kind = format_named(name)
        assert kind.name == name and kind.files and isinstance(kind.every_rank_writes, bool)
        for method in ("describe", "problem", "capture", "write", "load", "weights_at", "read_weights"):
            assert callable(getattr(kind, method)), (name, method)
    assert run_format(SINGLE).name == "files"
    assert run_format(Ranks(rank=0, world_size=2, local_rank=0, launched=True, strategy="fsdp")).name == "dcp"


def test_a_new_format_is_one_class_and_a_registry_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FORMATS, FORMAT.name, __name__)  # the registry entry: this module holds FORMAT
    monkeypatch.setattr(checkpointer_module, "run_format", lambda ranks: FORMAT)  # the format runs write
    data = _data(tmp_path)
    for run in ("whole", "cut"):
        assert main(train_args(data, tmp_path / run, steps=4)) == 0
    step2 = tmp_path / "cut" / "checkpoints" / "step-2"
    assert verify_checkpoint(step2) is None and checkpoint_format(step2) is FORMAT
    assert json.loads((step2 / "manifest.json").read_text())["format"] == "toy"
    assert (step2 / TOY_WEIGHTS).is_file() and not (step2 / "model.safetensors").exists()
    # Resumed from the toy checkpoint of step 2: the uninterrupted run, bit for bit.
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-4")
    assert main(train_args(data, tmp_path / "cut", "--resume", steps=4)) == 0
    whole, resumed = (load_file(str(run / "model.safetensors")) for run in (tmp_path / "whole", tmp_path / "cut"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[name], resumed[name]) for name in whole)
    # Verification asks the format for the files it always has.
    shutil.copytree(step2, tmp_path / "damaged")
    (tmp_path / "damaged" / TOY_WEIGHTS).unlink()
    assert verify_checkpoint(tmp_path / "damaged") == f"{TOY_WEIGHTS} is missing"
    # cadence sample reads the toy checkpoint's weights through the Checkpointer, and names the file it read.
    status, text, err = run_cli(["sample", str(tmp_path / "whole"), "--weights", "step-4", "--prompt", "The ",
                                 "--max-new-tokens", "4", "--temperature", "0"])
    assert status == 0 and f"checkpoints/step-4/{TOY_WEIGHTS}" in err, err
    assert text == run_cli(["sample", str(tmp_path / "whole"), "--prompt", "The ", "--max-new-tokens", "4",
                            "--temperature", "0"])[1]  # step 4 is the final model


def test_the_checkpointer_reads_any_weights_and_names_what_it_cannot(tmp_path: Path) -> None:
    data = _data(tmp_path)
    assert main(train_args(data, tmp_path / "run", steps=2)) == 0
    checkpoint = checkpoint_dirs(tmp_path / "run")[-1]
    reader = Checkpointer(tmp_path / "run", SINGLE)
    final = reader.read_weights(tmp_path / "run" / "model.safetensors")
    saved = reader.read_weights(checkpoint)
    assert final.keys() == saved.keys() and all(torch.equal(final[name], saved[name]) for name in final)
    assert reader.weights_at(checkpoint) == checkpoint / "model.safetensors"
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(WeightsUnreadable) as info:
        reader.read_weights(tmp_path / "garbage.safetensors")
    assert info.value.path == tmp_path / "garbage.safetensors" and "unreadable weights" in str(info.value)
