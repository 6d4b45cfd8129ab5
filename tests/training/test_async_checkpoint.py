"""--async-checkpoint (issue 38): the state is copied and written by a thread while training goes on; a checkpoint
counts only once complete, a stop waits for the write in flight, pruning keeps the newest complete ones, and the run
and its resume are the synchronous run's, bit for bit."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import sample_text, sigterm_at, train_args
from safetensors.torch import load_file

import cadence.training.checkpoint.files as files_module
from cadence.cli import main
from cadence.distributed.ranks import SINGLE
from cadence.engine.step import Engine
from cadence.training.checkpoint import Checkpointer, checkpoint_dirs, load_checkpoint, verify_checkpoint
from cadence.training.run_dir import read_metrics


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(sample_text(400 * 32 + 1))
    return path


def _same(a: Path, b: Path) -> None:
    assert [row["loss"] for row in read_metrics(a)] == [row["loss"] for row in read_metrics(b)]
    mine, theirs = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert all(torch.equal(mine[name], theirs[name]) for name in theirs)


def test_a_background_checkpoint_is_the_synchronous_one_and_counts_only_once_complete(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    data = _data(tmp_path)
    assert main(train_args(data, tmp_path / "sync", "--checkpoint-every", "1", steps=5)) == 0
    real_save = files_module.save_weights
    writer_threads: set[str] = set()

    def slow_save(weights, path, metadata=None):  # type: ignore[no-untyped-def]
        writer_threads.add(threading.current_thread().name)
        time.sleep(0.3)  # a slow disk: the training thread must not wait for it
        return real_save(weights, path, metadata)

    seen: list[tuple[list[str], bool]] = []  # at each step: the step-N folders there, and whether a write was staged
    real_step = Engine.step

    def watching(engine, window, **options):  # type: ignore[no-untyped-def]
        root = tmp_path / "async" / "checkpoints"
        found = checkpoint_dirs(tmp_path / "async")
        seen.append(([path.name for path in found], root.is_dir() and any(root.glob(".step-*"))))
        assert all(verify_checkpoint(path) is None for path in found)  # only complete checkpoints are listed
        return real_step(engine, window, **options)

    monkeypatch.setattr(files_module, "save_weights", slow_save)
    monkeypatch.setattr(Engine, "step", watching)
    assert main(train_args(data, tmp_path / "async", "--checkpoint-every", "1", "--keep-checkpoints", "2",
                           "--async-checkpoint", steps=5)) == 0
    assert writer_threads and all(name.startswith("cadence-checkpoint") for name in writer_threads)
    assert any(staged for _, staged in seen), "no step ran while a checkpoint was being written"
    _same(tmp_path / "async", tmp_path / "sync")
    # Pruned to the newest 2 complete ones; each holds exactly what the synchronous save wrote.
    assert [path.name for path in checkpoint_dirs(tmp_path / "async")] == ["step-4", "step-5"]
    for name in ("step-4", "step-5"):
        mine, theirs = (load_checkpoint(run / "checkpoints" / name) for run in (tmp_path / "async", tmp_path / "sync"))
        weights, expected = (Checkpointer(run, SINGLE).read_weights(run / "checkpoints" / name)
                             for run in (tmp_path / "async", tmp_path / "sync"))
        assert weights.keys() == expected.keys() and all(torch.equal(weights[key], expected[key]) for key in expected)
        assert mine.state["engine"] == theirs.state["engine"] and mine.state["data_position"] == \
            theirs.state["data_position"]


def test_a_stop_waits_for_the_write_in_flight_and_the_resume_is_exact(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = _data(tmp_path)
    assert main(train_args(data, tmp_path / "whole", "--async-checkpoint", steps=6)) == 0
    cut = train_args(data, tmp_path / "cut", "--async-checkpoint", steps=6)
    with sigterm_at(2, 1):  # during step 3: the run stops after it and saves step-3 in the background
        assert main(cut) == 0
    assert "stopped by SIGTERM after step 3" in capsys.readouterr().err
    assert [path.name for path in checkpoint_dirs(tmp_path / "cut")] == ["step-2", "step-3"]
    assert all(verify_checkpoint(path) is None for path in checkpoint_dirs(tmp_path / "cut"))
    assert main([*cut, "--resume"]) == 0
    _same(tmp_path / "cut", tmp_path / "whole")


def test_only_a_sharded_checkpoint_imports_torch_distributed_checkpoint() -> None:
    """DCP's import costs every command about 2 s of start-up (it pulls torch.distributed.tensor): the training loop,
    the checkpointer, resume and the plan import it only when a sharded checkpoint is written or read."""
    code = ("import sys; import cadence.training.loop, cadence.training.checkpoint, cadence.training.resume, "
            "cadence.plan.planner; print('torch.distributed.checkpoint' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
