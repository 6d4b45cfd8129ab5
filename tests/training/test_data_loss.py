"""Issue 44, data loss first: nothing of the user's is deleted or overwritten by a run, a resume or an export.

Each test reproduces one case of the outside audit (main b9b2893) and fails without its fix."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from helpers import run_cli, sample_text, sigterm_at, train_args, write_jsonl
from safetensors.torch import load_file

from cadence.cli import main
from cadence.engine.step import Engine
from cadence.training.run_dir import RunDirectoryWriteFailed, RunWriter, read_metrics

LLAMA = ["--model", "hf:llama", "--model-config", "hidden_size=32", "--model-config", "intermediate_size=64",
         "--model-config", "num_hidden_layers=2", "--model-config", "num_attention_heads=4",
         "--model-config", "num_key_value_heads=2", "--model-config", "vocab_size=256",
         "--model-config", "max_position_embeddings=64"]


def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(sample_text(400 * 32 + 1))
    return path


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def stopped_export(tmp_path: Path) -> list[str]:
    """A run with --save-hf stopped by SIGTERM after step 2 (it exported), to be resumed: its command. (Made for each
    test: a copy would not be the export the run wrote, by design.)"""
    data = write_jsonl(tmp_path / "pc.jsonl", 32)
    common = ["train", *LLAMA, "--data", str(data), "--seq-len", "48", "--too-long", "truncate", "--max-steps", "4",
              "--val-fraction", "0", "--checkpoint-every", "100", "--save-hf", str(tmp_path / "case" / "export"),
              "--out", str(tmp_path / "case" / "run")]
    with sigterm_at(2, 1):
        assert main(common) == 0
    assert (tmp_path / "case" / "export" / "config.json").is_file()
    return common


@pytest.mark.parametrize("change", ["file added", "file changed", "another folder"])
def test_a_resume_never_replaces_an_export_holding_what_the_run_did_not_write(tmp_path, capsys, change):
    """`--resume` replaced whatever was at --save-hf once summary.json named the path: files the user added to the
    export, or an unrelated folder later put there, were deleted. Now only the export exactly as the run wrote it."""
    import shutil

    common = stopped_export(tmp_path)
    export = tmp_path / "case" / "export"
    if change == "file added":
        (export / "NOTES.md").write_text("my notes on this model\n")
    elif change == "file changed":
        (export / "config.json").write_text((export / "config.json").read_text() + "\n")
    else:
        shutil.rmtree(export)
        export.mkdir()
        (export / "weights.bin").write_bytes(b"someone else's model")
    before, run_before = snapshot(export), snapshot(tmp_path / "case" / "run")
    capsys.readouterr()
    assert main([*common, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--save-hf" in err and "not the export this run wrote" in err and "Traceback" not in err
    assert snapshot(export) == before and snapshot(tmp_path / "case" / "run") == run_before


def test_a_resume_replaces_the_export_it_wrote_itself(tmp_path):
    """The same export, untouched, is still replaced by the resumed run's final model (issue 30's case holds)."""
    common = stopped_export(tmp_path)
    assert main([*common, "--resume"]) == 0
    summary = json.loads((tmp_path / "case" / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["save_hf"] == str(tmp_path / "case" / "export")
    assert summary["save_hf_files"]["model.safetensors"][0] > 0


def test_an_export_that_fails_keeps_the_run_s_own_end(tmp_path, capsys, monkeypatch):
    """A full disk during --save-hf ended in a traceback after the last step, before summary.json was written. Now the
    final weights and the summary are written first, the failure is one line saying what was kept and how to export
    again (exit 1), and that command then exports without training again."""
    import cadence.training.loop as loop

    common = stopped_export(tmp_path)
    run = tmp_path / "case" / "run"
    export = tmp_path / "case" / "export"
    real_save_hf = loop.save_hf

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loop, "save_hf", full_disk)
    capsys.readouterr()
    assert main([*common, "--resume"]) == 1
    err = capsys.readouterr().err
    assert "cannot write the --save-hf export" in err and "No space left on device" in err and "Traceback" not in err
    assert f"cadence train --resume --out {run} --save-hf {export}" in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and (run / "model.safetensors").is_file()
    final = snapshot(run)
    monkeypatch.setattr(loop, "save_hf", real_save_hf)
    capsys.readouterr()
    assert main([*common, "--resume"]) == 0  # the export again: nothing is trained, the run's files are unchanged
    assert "nothing to train" in capsys.readouterr().err
    assert len(read_metrics(run)) == 4
    assert {k: v for k, v in snapshot(run).items() if k != "summary.json"} == \
        {k: v for k, v in final.items() if k != "summary.json"}
    exported = load_file(str(export / "model.safetensors"))
    weights = load_file(str(run / "model.safetensors"))
    assert all((exported[name] == weights[name]).all() for name in exported if name in weights)
    assert json.loads((run / "summary.json").read_text())["save_hf"] == str(export)


def test_resume_refuses_a_folder_holding_only_a_copied_config(tmp_path, capsys):
    """A cadence config.json copied into another folder made --resume write over it (the folder's own files)."""
    data = text_file(tmp_path)
    assert main(train_args(data, tmp_path / "run", steps=2)) == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_bytes((tmp_path / "run" / "config.json").read_bytes())
    (mine / "model.safetensors").write_bytes(b"my own weights")
    before = snapshot(mine)
    capsys.readouterr()
    assert main([*train_args(data, mine, steps=2), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "metrics.jsonl is missing" in err and snapshot(mine) == before


@pytest.mark.parametrize("inside", ["checkpoints/mine", "best", "checkpoints/step-2/x", "tensorboard/run2"])
def test_a_run_inside_another_run_s_folders_is_refused(tmp_path, capsys, inside):
    """A second run whose --out lay inside a first run's checkpoints/ or best/ was pruned or overwritten by it."""
    data = text_file(tmp_path)
    first = tmp_path / "first"
    assert main(train_args(data, first, "--val-fraction", "0", steps=2)) == 0
    before = snapshot(first)
    capsys.readouterr()
    assert main(train_args(data, first / inside, steps=2)) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "lies inside the cadence run directory" in err and "Traceback" not in err
    assert snapshot(first) == before and not (first / inside / "config.json").exists()


def test_keep_best_never_writes_through_a_linked_best_folder(tmp_path, capsys, monkeypatch):
    """--keep-best wrote through a symlinked OUT/best into its target, overwriting the target's files. A resume
    finds the link and refuses; a link made while the run goes on fails the write, the target untouched."""
    losses = iter([3.0, 2.0, 1.0, 0.5] * 4)
    monkeypatch.setattr(Engine, "evaluate", lambda self, batches: next(losses))
    data = write_jsonl(tmp_path / "data.jsonl", 64)
    out = tmp_path / "run"
    common = ["train", "--data", str(data), "--seq-len", "64", "--too-long", "truncate", "--micro-batch-size", "4",
              "--grad-accum-steps", "2", "--eval-every", "2", "--keep-best", "--checkpoint-every", "2",
              "--max-steps", "4", "--out", str(out)]
    with sigterm_at(2, 1):
        assert main(common) == 0
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"precious")
    (target / "best.json").write_text("{}")
    import shutil

    shutil.rmtree(out / "best")
    (out / "best").symlink_to(target)
    capsys.readouterr()
    assert main([*common, "--max-steps", "8", "--resume"]) == 2
    assert "is a link or a file" in capsys.readouterr().err
    assert (target / "model.safetensors").read_bytes() == b"precious"
    writer = RunWriter(out, tensorboard=False)
    try:
        with pytest.raises(RunDirectoryWriteFailed, match="is a link or a file"):
            writer.save_best({}, {"step": 9})
    finally:
        writer.close()
    assert (target / "model.safetensors").read_bytes() == b"precious" and (target / "best.json").read_text() == "{}"


def test_resuming_a_run_that_stopped_early_trains_nothing_more(tmp_path, capsys, monkeypatch):
    """A run stopped by --early-stop-after, resumed, trained one more step and replaced its final model."""
    losses = iter([3.0, 2.0, 2.5, 2.6, 2.7, 2.8, 2.9, 3.0])
    monkeypatch.setattr(Engine, "evaluate", lambda self, batches: next(losses))
    data = write_jsonl(tmp_path / "data.jsonl", 64)
    out = tmp_path / "run"
    common = ["train", "--data", str(data), "--seq-len", "64", "--too-long", "truncate", "--micro-batch-size", "4",
              "--grad-accum-steps", "2", "--eval-every", "2", "--early-stop-after", "2", "--checkpoint-every", "2",
              "--max-steps", "20", "--out", str(out)]
    assert main(common) == 0
    before = snapshot(out)
    assert json.loads((out / "summary.json").read_text())["steps"] == 8
    capsys.readouterr()
    assert main([*common, "--resume"]) == 0
    assert "nothing to train: the run had already ended at step 8 (early stop" in capsys.readouterr().err
    after = snapshot(out)
    assert after["model.safetensors"] == before["model.safetensors"] and len(read_metrics(out)) == 8
    assert json.loads(after["summary.json"])["steps"] == 8


def test_resuming_a_finished_run_without_checkpoints_changes_nothing(tmp_path, capsys):
    """A run that ended with --checkpoint-every 0 has nothing to continue from: resumed, it started over and replaced
    its steps and final weights."""
    data = text_file(tmp_path)
    out = tmp_path / "run"
    common = [*train_args(data, out, steps=2), "--checkpoint-every", "0"]
    assert main(common) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert main([*common, "--max-steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "without a checkpoint to continue from" in err
    assert snapshot(out) == before


@pytest.mark.parametrize("data", ["", "   ", 7, ["a"]])
def test_a_plan_whose_data_is_not_a_path_is_refused(tmp_path, data):
    """A plan.json whose data path was empty made `train --plan` read (and store) the whole current directory."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"choice": {"micro_batch_size": 2, "grad_accum_steps": 2, "precision": "fp32"},
                                "model": "gpt-tiny", "seq_len": 32, "effective_batch_size": 4,
                                "source": {"data": data}}))
    status, _, err = run_cli(["train", "--plan", str(plan), "--max-steps", "1", "--out", str(tmp_path / "run")])
    assert status == 2 and "--plan" in err and "field 'source.data'" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("target", ["checkpoint", "best", "final weights"])
def test_a_full_disk_at_a_later_write_keeps_the_previous_checkpoint_intact_and_resumable(tmp_path, capsys,
                                                                                          monkeypatch, target):
    """Issue 44 case 1: ENOSPC while writing a checkpoint, OUT/best or the final weights exits 1 in one line, and
    the checkpoint before it stays intact: --resume then finishes the run."""
    import cadence.training.checkpoint.files as checkpoint_module
    import cadence.training.run_dir as run_dir_module
    from cadence.training.checkpoint import verify_checkpoint

    losses = iter([3.0, 2.0, 1.0, 0.5, 0.25, 0.1] * 2)
    monkeypatch.setattr(Engine, "evaluate", lambda self, batches: next(losses))
    data = write_jsonl(tmp_path / "data.jsonl", 64)
    out = tmp_path / "run"
    common = ["train", "--data", str(data), "--seq-len", "64", "--too-long", "truncate", "--micro-batch-size", "4",
              "--grad-accum-steps", "2", "--eval-every", "2", "--keep-best", "--checkpoint-every", "2",
              "--max-steps", "4", "--out", str(out)]
    real = run_dir_module.save_weights

    def fills_up(weights, path, metadata=None):
        failing = {"checkpoint": ".step-4." in str(path), "best": path.parent == out / "best" and bool(seen),
                   "final weights": path == out / "model.safetensors"}[target]
        if path.parent == out / "best":
            seen.append(path)
        if failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(weights, path, metadata)

    seen: list[Path] = []
    monkeypatch.setattr(run_dir_module, "save_weights", fills_up)
    monkeypatch.setattr(checkpoint_module, "save_weights", fills_up)
    capsys.readouterr()
    assert main(common) == 1
    err = capsys.readouterr().err
    assert "cadence: training failed: cannot write" in err and "No space left on device" in err
    assert "Traceback" not in err
    assert verify_checkpoint(out / "checkpoints" / "step-2") is None
    assert not [p for p in out.rglob(".*") if p.name != ".gitkeep"]  # no staging folder, no temporary file
    monkeypatch.setattr(run_dir_module, "save_weights", real)
    monkeypatch.setattr(checkpoint_module, "save_weights", real)
    assert main([*common, "--resume"]) == 0
    assert [row["step"] for row in read_metrics(out)] == [1, 2, 3, 4]
