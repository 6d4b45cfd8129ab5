"""The run directory is the user's data (issue 17 item 2): one run at a time, the data compared by content, and a
refused resume writes nothing."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CADENCE, sample_text, train_args

from cadence.cli import main
from cadence.errors import UsageError
from cadence.training.checkpoint import checkpoint_dirs
from cadence.training.lock import RunDirectoryLock
from cadence.training.run_dir import read_metrics
from cadence.training.state_file import read_state, write_state


def data_file(tmp_path: Path, name: str = "text.txt", seed_bytes: bytes = b"") -> Path:
    path = tmp_path / name
    path.write_bytes(seed_bytes + sample_text(400 * 32 + 1)[len(seed_bytes):])
    return path


def args(data: Path | str, out: Path, *extra: str, steps: int = 4) -> list[str]:
    return train_args(data, out, *extra, steps=steps)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_second_lock_on_the_same_directory_is_refused_naming_the_holder(tmp_path):
    with RunDirectoryLock(tmp_path):
        with pytest.raises(UsageError) as refused:
            RunDirectoryLock(tmp_path).acquire()
    message = str(refused.value)
    assert "--out" in message and "in use by another cadence run" in message and f"pid {os.getpid()}" in message
    with RunDirectoryLock(tmp_path):  # released on exit: the next run gets it
        pass


@pytest.mark.slow  # two processes of its own, one killed
def test_a_second_run_on_a_busy_directory_is_refused_and_a_killed_one_leaves_no_stale_lock(tmp_path, capsys):
    data, out = data_file(tmp_path), tmp_path / "run"
    first = subprocess.Popen([CADENCE, *args(data, out, steps=400)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        while not (out / "metrics.jsonl").exists() or not read_metrics(out):
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.05)
        config = (out / "config.json").read_bytes()
        assert main(args(data, out, "--resume", steps=400)) == 2
        err = capsys.readouterr().err
        assert f"pid {first.pid}" in err and "in use by another cadence run" in err and "--out" in err
        # The live run keeps writing metrics, events and checkpoints; the refused one would have rewritten
        # config.json first (with resume=true): it is the first run's still.
        assert (out / "config.json").read_bytes() == config and b'"resume": false' in config
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    # SIGKILL: the OS released the lock with the process (the resume itself is tested after SIGKILLs in test_resume).
    with RunDirectoryLock(out):
        pass
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no lock file or other leftover


def test_resume_compares_the_data_by_content_not_by_path(tmp_path, monkeypatch, capsys):
    data, out = data_file(tmp_path), tmp_path / "run"
    assert main(args(data, out)) == 0
    shutil.rmtree(checkpoint_dirs(out)[-1])  # as if killed after step 2
    # The same file given another way: a relative path from another working directory.
    monkeypatch.chdir(tmp_path)
    assert main(args(Path("text.txt"), out, "--resume")) == 0
    shutil.rmtree(checkpoint_dirs(out)[-1])
    # The same name with other content: refused, naming --data, and nothing written.
    data.write_bytes(b"different " + data.read_bytes()[10:])
    before = snapshot(out)
    assert main(args(data, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert "--data" in err and "does not hold the data the checkpoint was trained on" in err
    assert snapshot(out) == before


def test_a_refused_mid_window_resume_writes_nothing(tmp_path, capsys):
    data, out = data_file(tmp_path), tmp_path / "run"
    assert main(args(data, out)) == 0
    checkpoint = checkpoint_dirs(out)[-1]
    # Make the newest checkpoint one written mid-window (micro-batch 4), resealed as a real one is.
    state = read_state(checkpoint, "training_state")
    state["partial_window"] = {"micro_batches_done": 1, "loss_sum": 1.0, "micro_batch_size": 4, "grads": {}}
    write_state(checkpoint, "training_state", state)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["sha256"] = {name: hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
                          for name in manifest["sha256"]}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(out)
    other_split = args(data, out, "--resume")
    other_split[other_split.index("--micro-batch-size") + 1], other_split[other_split.index("--grad-accum-steps") + 1] \
        = "2", "4"
    assert main(other_split) == 2
    assert "--micro-batch-size" in capsys.readouterr().err
    assert snapshot(out) == before  # config.json, metrics.jsonl, checkpoints: all as they were


def test_a_missing_metrics_file_is_reported_not_silently_restarted(tmp_path, capsys):
    data, out = data_file(tmp_path), tmp_path / "run"
    assert main(args(data, out)) == 0
    (out / "metrics.jsonl").unlink()
    before = snapshot(out)
    assert main(args(data, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "metrics.jsonl is missing" in err
    assert snapshot(out) == before


def _limited(limit_bytes: int):
    """A child process whose files cannot grow past ``limit_bytes`` (RLIMIT_FSIZE): a write past it fails with
    EFBIG, as a full disk fails with ENOSPC. SIGXFSZ is ignored so that the error reaches Python."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return apply


@pytest.mark.parametrize("what, extra", [
    ("checkpoint step-2", ["--checkpoint-every", "2"]),
    pytest.param("model.safetensors", ["--checkpoint-every", "0"], marks=pytest.mark.slow),  # a process of its own
])
def test_a_write_that_fails_for_want_of_space_is_one_line_and_leaves_no_debris(tmp_path, what, extra):
    data, out = data_file(tmp_path), tmp_path / "run"
    argv = args(data, out, steps=2)
    argv[argv.index("--checkpoint-every"):argv.index("--checkpoint-every") + 2] = extra
    # gpt-tiny's weights are 4.2 MB: config.json, metrics.jsonl and TensorBoard's events fit in 1 MiB, they do not.
    result = subprocess.run([CADENCE, *argv], capture_output=True, text=True, timeout=300,
                            preexec_fn=_limited(1 << 20))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("cadence: training failed:")]
    assert "cannot write" in line and what in line
    assert "File too large" in line and "--resume" in line
    leftovers = [p.name for p in out.rglob(".*")]
    assert leftovers == []  # no staging folder, no temporary weights file
    assert not checkpoint_dirs(out)


# ------------------------------------------------------------------------------------------------ issue 29 items 1-2
def test_a_run_still_loading_its_data_holds_its_directory_against_a_faster_second_run(tmp_path, monkeypatch, capsys):
    """Issue 29 item 1: the lock is claimed before the data is read. The second run starts while the first is still
    preparing (the moment an uncached 565 MB JSONL took minutes): it is refused, and the first trains alone."""
    from cadence.training import loop

    data, out = data_file(tmp_path), tmp_path / "run"
    real_prepare = loop.prepare
    second: list[int] = []

    def slow_prepare(config, **options):
        if not second:  # the first run is reading its data: a second run on the same --out starts now
            second.append(main(args(data, out, steps=2)))
        return real_prepare(config, **options)

    monkeypatch.setattr(loop, "prepare", slow_prepare)
    assert main(args(data, out)) == 0
    assert second == [2]
    err = capsys.readouterr().err
    assert "in use by another cadence run" in err and f"pid {os.getpid()}" in err
    assert [row["step"] for row in read_metrics(out)] == [1, 2, 3, 4]  # one run's rows, not [1, 1, 2, ...]
    assert json.loads((out / "config.json").read_text())["max_steps"] == 4


def test_bad_data_found_after_the_claim_leaves_no_directory_behind(tmp_path, capsys):
    """The claim creates --out (and its missing parents) before the data is read; bad data found then removes them."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txet": "no text field"}\n')
    out = tmp_path / "new" / "deeper" / "run"
    assert main(args(bad, out)) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def _foreign_checkpoints(out: Path) -> None:
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "epoch=0.ckpt").write_bytes(b"another framework's checkpoint")


def _empty_checkpoints(out: Path) -> None:
    (out / "checkpoints").mkdir()


def _metrics_with_a_step(out: Path) -> None:
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')


def _config_not_by_cadence(out: Path) -> None:
    (out / "config.json").write_text(json.dumps({"effective_batch_size": 8, "grad_accum_steps": 2, "world_size": 1}))


@pytest.mark.parametrize("plant", [_foreign_checkpoints, _empty_checkpoints, _metrics_with_a_step,
                                   _config_not_by_cadence], ids=lambda plant: plant.__name__.strip("_"))
def test_resume_refuses_a_directory_cadence_did_not_write_and_touches_nothing(tmp_path, capsys, plant):
    """Issue 29 item 2: a checkpoints/ folder or a metrics.jsonl row is no proof of a cadence run; only the
    config.json that cadence train writes before its first step is."""
    data, out = data_file(tmp_path), tmp_path / "theirs"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the user's own weights")
    (out / "summary.json").write_text('{"mine": true}')
    plant(out)
    before = snapshot(out)
    assert main(args(data, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "not a cadence run directory" in err
    assert snapshot(out) == before


def test_resume_still_continues_cadence_s_own_runs_and_starts_an_empty_directory(tmp_path):
    data = data_file(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(args(data, empty, "--resume", steps=2)) == 0  # an empty directory is a fresh start
    shutil.rmtree(checkpoint_dirs(empty)[-1])
    (empty / "model.safetensors").unlink()
    (empty / "summary.json").unlink()  # a run killed before any checkpoint wrote no summary either
    assert main(args(data, empty, "--resume", steps=2)) == 0  # killed before any checkpoint: starts over
    assert [row["step"] for row in read_metrics(empty)] == [1, 2]


def _reseal(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["sha256"] = {name: hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
                          for name in manifest["sha256"]}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _weights_of_another_size(checkpoint: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(checkpoint / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name].flatten()[:-1].clone()
    save_file(weights, str(checkpoint / "model.safetensors"))


def _moments_of_another_size(checkpoint: Path) -> None:
    state = read_state(checkpoint, "training_state")
    moments = next(iter(state["optimizer"]["state"].values()))
    moments["exp_avg"] = moments["exp_avg"].flatten()[:3].clone()
    write_state(checkpoint, "training_state", state)


def _no_param_groups(checkpoint: Path) -> None:
    state = read_state(checkpoint, "training_state")
    state["optimizer"]["param_groups"] = []
    write_state(checkpoint, "training_state", state)


def _engine_without_steps(checkpoint: Path) -> None:
    state = read_state(checkpoint, "training_state")
    del state["engine"]["steps"]
    write_state(checkpoint, "training_state", state)


@pytest.mark.parametrize("damage", [_weights_of_another_size, _moments_of_another_size, _no_param_groups,
                                    _engine_without_steps], ids=lambda damage: damage.__name__.strip("_"))
def test_a_checkpoint_that_verifies_but_does_not_fit_is_refused_in_one_line(tmp_path, capsys, damage):
    """Issue 29 item 13: a valid manifest over wrong contents used to end in a ValueError or KeyError traceback."""
    data, out = data_file(tmp_path), tmp_path / "run"
    assert main(args(data, out)) == 0
    checkpoint = checkpoint_dirs(out)[-1]
    damage(checkpoint)
    _reseal(checkpoint)
    before = snapshot(out)
    capsys.readouterr()
    assert main(args(data, out, "--resume")) == 2
    err = capsys.readouterr().err
    # Issue 44: a field the typed reader checks is named as such ("field 'engine.steps' is missing").
    assert "--resume" in err and ("does not fit this run" in err or "is missing" in err) and "Traceback" not in err
    assert snapshot(out) == before
