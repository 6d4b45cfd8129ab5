"""Issue 44 items 3 and 4: what a resume reads back from a run directory is checked like user input.

A checkpoint whose manifest verifies can still hold crafted contents (the manifest recomputed over edited files): a
step that is a string, an 8-bit state without its scales, a config with a string where a number belongs. Each is
refused in one line naming the file and the field, offering the next older intact checkpoint, with nothing changed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import sample_text, sigterm_at, train_args

from cadence.cli import main
from cadence.training.checkpoint import checkpoint_dirs
from cadence.training.state_file import read_state, write_state


def _reseal(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["sha256"] = {name: hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
                          for name in manifest["sha256"]}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """A finished 4-step run (checkpoints step-2 and step-4) per optimizer state, and one stopped mid-window after
    step 2, each made once; every test gets its own copy."""
    root = tmp_path_factory.mktemp("runs")
    data = root / "text.txt"
    data.write_bytes(sample_text(400 * 32 + 1))
    made: dict[str, Path] = {}

    def copy(kind: str) -> tuple[Path, Path]:
        if kind not in made:
            made[kind] = root / kind
            if kind == "mid-window":
                with sigterm_at(2, 1):
                    assert main(train_args(data, made[kind], "--checkpoint-mid-window", steps=4)) == 0
            else:
                assert main(train_args(data, made[kind], "--optimizer-state", kind, steps=4)) == 0
        target = root / f"copy-{len(list(root.glob('copy-*')))}"
        shutil.copytree(made[kind], target)
        return data, target
    return copy


def _state(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        state = read_state(checkpoint, "training_state")
        edit(state)
        write_state(checkpoint, "training_state", state)
    return damage


def _info(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        info = json.loads((checkpoint / "checkpoint.json").read_text())
        edit(info)
        (checkpoint / "checkpoint.json").write_text(json.dumps(info))
    return damage


def _first(state: dict[str, Any]) -> dict[str, Any]:
    return next(iter(state["optimizer"]["state"].values()))  # type: ignore[no-any-return]


def _largest_quantised(state: dict[str, Any]) -> dict[str, Any]:
    """The 8-bit state of the largest parameter (small ones keep fp32 moments)."""
    quantised = [entry["__bnb_optimizer_quant_state__"] for entry in state["optimizer"]["state"].values()]
    return max(quantised, key=lambda entry: entry["state1"].numel())


CHECKPOINT_CASES: list[tuple[str, str, Callable[[Path], None], str]] = [
    ("bf16 step a string", "bf16", _state(lambda s: _first(s).update(step="x")),
     "training_state.json: field 'optimizer.state[0].step' is 'x', not a count"),
    ("bf16 step negative", "bf16", _state(lambda s: _first(s).update(step=-5)),
     "field 'optimizer.state[0].step' is -5, not a count"),
    ("bf16 step a list", "bf16", _state(lambda s: _first(s).update(step=[1, 2])),
     "field 'optimizer.state[0].step' is [1, 2], not a count"),
    ("8bit without absmax", "8bit", _state(lambda s: _largest_quantised(s).pop("absmax1")),
     "__bnb_optimizer_quant_state__.absmax1' is missing"),
    ("8bit float state", "8bit", _state(lambda s: _largest_quantised(s).update(
        state1=_largest_quantised(s)["state1"].float())),
     "__bnb_optimizer_quant_state__.state2' is a uint8 tensor"),
    ("fp32 step a vector", "fp32", _state(lambda s: _first(s).update(step=torch.tensor([2.0, 2.0]))),
     "field 'optimizer.state[0].step' is a float32 tensor of shape (2,), not a step count"),
    ("config max_steps a string", "fp32", _info(lambda i: i["resolved_config"].update(max_steps="four")),
     "checkpoint.json: field 'resolved_config.max_steps' is 'four', not an integer"),
    ("config lr a string", "fp32", _info(lambda i: i["config"].update(lr="fast")),
     "checkpoint.json: field 'config.lr' is 'fast', not a number"),
    ("engine steps a string", "fp32", _state(lambda s: s["engine"].update(steps="2")),
     "field 'engine.steps' is '2', not a count"),
]


def _huge_nd(checkpoint: Path) -> None:
    """A NumPy array in the state's structure file holding a value far past its dtype (10**30 in uint32)."""
    path = checkpoint / "training_state.json"
    text = path.read_text()
    marker = '"data": ['
    at = text.index(marker, text.index('"__ndarray__"')) + len(marker)
    path.write_text(text[:at] + "1" + "0" * 30 + ", " + text[at:].split(",", 1)[1])


CHECKPOINT_CASES.append(("a huge value in an ndarray", "fp32", _huge_nd, "malformed __ndarray__"))


@pytest.mark.parametrize(("mode", "damage", "expected"), [case[1:] for case in CHECKPOINT_CASES],
                         ids=[case[0] for case in CHECKPOINT_CASES])
def test_crafted_checkpoint_contents_are_refused_naming_the_file_and_the_older_checkpoint(runs, capsys, mode, damage,
                                                                                          expected):
    data, out = runs(mode)
    newest = checkpoint_dirs(out)[-1]
    damage(newest)
    _reseal(newest)
    before = _snapshot(out)
    capsys.readouterr()
    assert main(train_args(data, out, "--optimizer-state", mode, "--resume", steps=6)) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert expected in lines[0] and str(newest) in lines[0], lines[0]
    assert f"step-2 is the next older intact checkpoint: remove {newest} to resume from it" in lines[0]
    assert _snapshot(out) == before


def _partial(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return _state(lambda state: edit(state["partial_window"]))


def _grad_name(partial: dict[str, Any]) -> str:
    return next(iter(partial["grads"]))


PARTIAL_CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("more micro-batches done than a window has", _partial(lambda p: p.update(micro_batches_done=10**6)),
     "field 'partial_window.micro_batches_done' is 1000000, not a count from 1 to 1"),
    ("micro-batches done a string", _partial(lambda p: p.update(micro_batches_done="x")),
     "field 'partial_window.micro_batches_done' is 'x', not a count"),
    ("loss sum a string", _partial(lambda p: p.update(loss_sum="x")),
     "field 'partial_window.loss_sum' is 'x', not a finite number"),
    ("a gradient of another shape", _partial(lambda p: p["grads"].update(
        {_grad_name(p): p["grads"][_grad_name(p)].flatten()[:3].clone()})),
     "has shape (3,), not its parameter's"),
    ("a gradient of no parameter", _partial(lambda p: p["grads"].update(nope=torch.zeros(3))),
     "field 'partial_window.grads.nope' is the gradient of no trained parameter of this model"),
    ("gradients a list", _partial(lambda p: p.update(grads=[1])),
     "field 'partial_window.grads' is [1], not an object"),
    ("partial window a list", _state(lambda s: s.update(partial_window=[1, 2])),
     "field 'partial_window' is [1, 2], not an object"),
]


@pytest.mark.parametrize(("damage", "expected"), [case[1:] for case in PARTIAL_CASES],
                         ids=[case[0] for case in PARTIAL_CASES])
def test_a_partial_window_that_does_not_fit_is_refused_in_one_line(runs, capsys, damage, expected):
    data, out = runs("mid-window")
    (newest,) = checkpoint_dirs(out)
    damage(newest)
    _reseal(newest)
    before = _snapshot(out)
    capsys.readouterr()
    assert main(train_args(data, out, "--checkpoint-mid-window", "--resume", steps=4)) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert expected in lines[0] and "training_state.json" in lines[0], lines[0]
    assert "there is no older intact checkpoint: start a new --out" in lines[0]
    assert _snapshot(out) == before


def _row(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """Edit the first row of metrics.jsonl."""
    def damage(out: Path) -> None:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        row = json.loads(lines[0])
        edit(row)
        (out / "metrics.jsonl").write_text("\n".join([json.dumps(row), *lines[1:]]) + "\n")
    return damage


def _summary(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(out: Path) -> None:
        summary = json.loads((out / "summary.json").read_text())
        edit(summary)
        (out / "summary.json").write_text(json.dumps(summary))
    return damage


RECORD_CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("a row without tokens", _row(lambda row: row.pop("tokens")), "metrics.jsonl:1: field 'tokens' is missing"),
    ("a string window", _row(lambda row: row.update(window="1")),
     "metrics.jsonl:1: field 'window' is '1', not a count"),
    ("a float tokens", _row(lambda row: row.update(tokens=256.5)),
     "metrics.jsonl:1: field 'tokens' is 256.5, not a count"),
    ("a string val_loss", _row(lambda row: row.update(val_loss="low")),
     "metrics.jsonl:1: field 'val_loss' is 'low', not a finite number"),
    ("a string total in summary.json", _summary(lambda summary: summary.update(tokens="1024")),
     "summary.json: field 'tokens' is '1024', not a count"),
    ("a string segment bound in summary.json", _summary(lambda summary: summary["segments"][0].update(to_step="4")),
     "summary.json: field 'segments[0].to_step' is '4', not a count"),
]


@pytest.mark.parametrize(("damage", "expected"), [case[1:] for case in RECORD_CASES],
                         ids=[case[0] for case in RECORD_CASES])
def test_a_resumed_runs_records_of_the_wrong_type_are_refused_on_resume_and_report(runs, capsys, damage, expected):
    """Issue 44 item 4: each ended in a traceback on --resume (and on cadence report)."""
    data, out = runs("fp32")
    damage(out)
    before = _snapshot(out)
    capsys.readouterr()
    for command in (train_args(data, out, "--resume", steps=6), ["report", str(out)]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert expected in lines[0] and str(out) in lines[0], lines[0]
        assert _snapshot(out) == before
