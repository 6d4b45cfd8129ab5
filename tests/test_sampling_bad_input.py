"""Issue 44: ``cadence sample`` on bad input (weights that are garbage, of another model or shape, damaged or a pickle;
a prompt that is not UTF-8; a temperature, seed or token count out of range) is one line naming the flag or file and
exit 2, never a traceback or a run that ends only when killed."""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import write_jsonl
from safetensors.torch import load_file, save_file

from cadence.cli import main
from cadence.errors import UsageError
from cadence.sampling import MAX_NEW_TOKENS, SEED_LIMIT, TEMPERATURE_FLOOR, SampleOptions, sample


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step gpt-tiny run with a best checkpoint and checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("sample-bad")
    data = write_jsonl(root / "data.jsonl", 32)
    assert main(["train", "--data", str(data), "--seq-len", "64", "--too-long", "truncate", "--micro-batch-size", "4",
                 "--max-steps", "4", "--eval-every", "2", "--keep-best", "--checkpoint-every", "2",
                 "--out", str(root / "run")]) == 0
    return root / "run"


def _replace(path: Path, data: bytes) -> None:
    path.unlink()  # the copy's files are links to the fixture's: a new file, never a write through the link
    path.write_bytes(data)


def _weights(run: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> bytes:
    scratch = run.parent / "scratch.safetensors"
    save_file(edit(load_file(str(run / "model.safetensors"))), str(scratch))
    data = scratch.read_bytes()
    scratch.unlink()
    return data


def _garbage(run: Path) -> None:
    _replace(run / "best" / "model.safetensors", os.urandom(4096))


def _other_shape(run: Path) -> None:
    _replace(run / "best" / "model.safetensors",
             _weights(run, lambda state: {name: torch.zeros(3, *tensor.shape) for name, tensor in state.items()}))


def _other_model(run: Path) -> None:
    _replace(run / "best" / "model.safetensors", _weights(run, lambda _: {"model.embed_tokens.weight":
                                                                             torch.zeros(256, 32)}))


def _not_finite(run: Path) -> None:
    _replace(run / "best" / "model.safetensors",
             _weights(run, lambda state: {name: torch.full_like(tensor, float("nan")) for name, tensor in state.items()}))


def _damaged_checkpoint(run: Path) -> None:
    path = run / "checkpoints" / "step-2" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-64:] = b"\xff" * 64
    _replace(path, bytes(data))


def _pickle(run: Path) -> None:
    _replace(run / "model.safetensors", pickle.dumps({"weight": [1.0, 2.0]}))


def _nothing(run: Path) -> None:
    pass


CASES = [
    ("best-garbage", _garbage, ["--weights", "best"], "--weights", "best/model.safetensors is not a safetensors file"),
    ("best-other-shape", _other_shape, ["--weights", "best"], "--weights", "does not fit gpt-tiny"),
    ("best-other-model", _other_model, ["--weights", "best"], "--weights", "does not fit gpt-tiny"),
    ("best-not-finite", _not_finite, ["--weights", "best"], "--weights", "holds values that are not finite"),
    ("damaged-checkpoint", _damaged_checkpoint, ["--weights", "step-2"], "--weights",
     "checkpoints/step-2 is damaged (model.safetensors does not match its checksum); give another: final, best, step-4"),
    ("pickle-as-weights", _pickle, [], "--weights", "model.safetensors is not a safetensors file"),
    ("prompt-not-utf8", _nothing, ["--prompt", "def \udcff\udcfe"], "--prompt",
     "is not UTF-8 text (byte 0xff at character 4)"),
    ("temperature-1e-300", _nothing, ["--temperature", "1e-300"], "--temperature", "from 0.001 on"),
    ("temperature-1e-45", _nothing, ["--temperature", "1e-45"], "--temperature", "from 0.001 on"),
    ("temperature-nan", _nothing, ["--temperature", "nan"], "--temperature", "from 0.001 on"),
    ("seed-2**64", _nothing, ["--seed", str(2**64)], "--seed", "must be 0 to 2**64 - 1"),
    ("seed-2**70", _nothing, ["--seed", str(2**70)], "--seed", "must be 0 to 2**64 - 1"),
    ("max-new-tokens-10**23", _nothing, ["--max-new-tokens", str(10**23)], "--max-new-tokens", "must be 1 to 16,384"),
    ("max-new-tokens-1e23", _nothing, ["--max-new-tokens", "1e23"], "--max-new-tokens", "is not a valid integer"),
]


@pytest.mark.parametrize(("damage", "extra", "flag", "said"), [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_bad_sample_input_is_one_line_naming_the_flag_or_file(run: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str],
                                                               damage: Callable[[Path], None], extra: list[str],
                                                               flag: str, said: str) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy, copy_function=os.link)
    damage(copy)
    capsys.readouterr()
    status = main(["sample", str(copy), "--prompt", "def ", "--max-new-tokens", "4", *extra])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith(f"cadence: error: {flag}: ") and said in err, err


def test_the_bounds_themselves_are_accepted(run: Path) -> None:
    text, _, _ = sample(run, SampleOptions(prompt="def ", max_new_tokens=3, temperature=TEMPERATURE_FLOOR,
                                           seed=SEED_LIMIT - 1))
    assert isinstance(text, str)
    with pytest.raises(UsageError) as refused:
        sample(run, SampleOptions(prompt="def ", max_new_tokens=MAX_NEW_TOKENS + 1))
    assert "--max-new-tokens" in str(refused.value)
