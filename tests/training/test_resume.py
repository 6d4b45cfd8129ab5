"""Exact resume, preemption and divergence: nothing committed to disk is lost, and a resumed run is the same run."""

from __future__ import annotations

import ast
import hashlib
import json
import pickle
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import sample_text, spawn, train_args
from safetensors.torch import load_file

from cadence.cli import main
from cadence.training.checkpoint import checkpoint_dirs, load_checkpoint, prune_checkpoints, verify_checkpoint
from cadence.training.resume import incompatibilities, schedule_note
from cadence.training.run_dir import read_metrics


def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(sample_text(400 * 32 + 1))
    return path


def args(data: Path, out: Path, *extra: str, steps: int = 8) -> list[str]:
    return train_args(data, out, *extra, steps=steps)


def same_run(a: Path, b: Path) -> None:
    rows_a, rows_b = read_metrics(a), read_metrics(b)
    assert [(r["step"], r["window"], r["loss"], r["lr"]) for r in rows_a] == \
        [(r["step"], r["window"], r["loss"], r["lr"]) for r in rows_b]
    weights_a, weights_b = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)  # bitwise


def test_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "whole")) == 0
    assert main(args(data, tmp_path / "cut")) == 0
    for late in checkpoint_dirs(tmp_path / "cut")[1:]:  # as if killed right after step 2
        shutil.rmtree(late)
    assert main(args(data, tmp_path / "cut", "--resume")) == 0
    same_run(tmp_path / "cut", tmp_path / "whole")
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 8


@pytest.mark.parametrize("state", [["bf16"], ["8bit"], ["8bit", "--offload", "optimizer"]],
                         ids=["bf16", "8bit", "8bit-offloaded"])
def test_resume_with_low_precision_optimizer_state_is_bitwise_the_uninterrupted_run(tmp_path, state):
    """--optimizer-state bf16 (stochastically rounded moments, the bits seeded from the step) and 8bit
    (bitsandbytes' uint8 codes and fp32 scales, stored as tensors in the safetensors file): a run cut after step 2
    and resumed is the run that never stopped, bit for bit; so with the state offloaded to the host."""
    data = data_file(tmp_path)
    extra = ["--optimizer-state", *state]
    assert main(args(data, tmp_path / "whole", *extra, steps=6)) == 0
    assert main(args(data, tmp_path / "cut", *extra, steps=6)) == 0
    for late in checkpoint_dirs(tmp_path / "cut")[1:]:
        shutil.rmtree(late)
    assert main(args(data, tmp_path / "cut", *extra, "--resume", steps=6)) == 0
    same_run(tmp_path / "cut", tmp_path / "whole")
    tensors = load_file(str(checkpoint_dirs(tmp_path / "cut")[0] / "training_state.safetensors"))
    assert ({torch.uint8} if state[0] == "8bit" else {torch.bfloat16}) <= {t.dtype for t in tensors.values()}
    assert main(args(data, tmp_path / "cut", "--resume", "--optimizer-state", "fp32", steps=6)) == 2


@pytest.mark.slow
def test_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "whole")) == 0
    assert main(args(data, tmp_path / "cut", steps=8)) == 0
    newest = checkpoint_dirs(tmp_path / "cut")[-1]
    weights = newest / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF
    weights.write_bytes(bytes(blob))
    assert verify_checkpoint(newest) is not None
    assert main(args(data, tmp_path / "cut", "--resume")) == 0
    notice = [line for line in capsys.readouterr().err.splitlines() if "is damaged" in line]
    assert len(notice) == 1 and notice[0].startswith("cadence: warning: checkpoint") and "step-8" in notice[0]
    same_run(tmp_path / "cut", tmp_path / "whole")


def test_resume_refuses_a_configuration_that_changes_the_math(tmp_path, capsys):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "run", steps=4)) == 0
    assert main(args(data, tmp_path / "run", "--resume", "--lr", "0.01", steps=4)) == 2
    assert "--lr" in capsys.readouterr().err


def test_resume_with_only_out_continues_the_recorded_run_and_may_train_longer(tmp_path, capsys):
    """`cadence train --resume --out DIR` alone takes every flag from the run's config.json (none typed again, none
    taken from the defaults); a flag given explicitly is still compared, and --max-steps may be raised: the resumed
    run is then bitwise the run that had asked for that many steps from the start (a constant schedule)."""
    data = data_file(tmp_path)
    constant = ("--lr-schedule", "constant", "--lr", "2e-3", "--micro-batch-order", "drawn")
    assert main(args(data, tmp_path / "whole", *constant, steps=6)) == 0
    assert main(args(data, tmp_path / "cut", *constant, steps=4)) == 0
    capsys.readouterr()
    resume = ["train", "--resume", "--out", str(tmp_path / "cut")]
    assert main([*resume, "--lr", "0.01"]) == 2
    assert "--lr: 0.01 differs from the checkpoint's 0.002" in capsys.readouterr().err
    assert main([*resume, "--max-steps", "3"]) == 2
    assert "--max-steps: 3 is below the checkpoint's 4" in capsys.readouterr().err
    assert main([*resume, "--max-steps", "6"]) == 0
    err = capsys.readouterr().err
    assert "resuming from" in err and "--max-steps raised from 4 to 6" in err
    same_run(tmp_path / "cut", tmp_path / "whole")
    recorded = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert (recorded["micro_batch_size"], recorded["grad_accum_steps"], recorded["seq_len"]) == (4, 2, 32)


def test_raising_max_steps_says_how_a_decaying_schedule_changes() -> None:
    saved = {"max_steps": 10, "lr_schedule": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.1, "lr": 1e-3}
    note = schedule_note(saved, {**saved, "max_steps": 20}, 10)
    assert note == ("--max-steps raised from 10 to 20: the cosine LR schedule now decays over 20 steps, so the LR "
                    "after step 10 is 0.00055 instead of 0.0001")
    assert schedule_note(saved, saved, 10) is None
    assert schedule_note({**saved, "lr_schedule": "constant"}, {**saved, "lr_schedule": "constant",
                                                               "max_steps": 20}, 10).endswith("unchanged up to here")


def test_resume_with_another_split_continues_the_same_math(tmp_path):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "whole")) == 0
    assert main(args(data, tmp_path / "cut", steps=8)) == 0
    for late in checkpoint_dirs(tmp_path / "cut")[1:]:
        shutil.rmtree(late)
    resumed = args(data, tmp_path / "cut", "--resume")
    resumed[resumed.index("--micro-batch-size") + 1], resumed[resumed.index("--grad-accum-steps") + 1] = "1", "8"
    assert main(resumed) == 0
    for got, want in zip(read_metrics(tmp_path / "cut"), read_metrics(tmp_path / "whole")):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_resuming_text_with_packing_added_is_bitwise_the_unpacked_run(tmp_path):
    """Issue 29: text is cut into full --seq-len sequences, so --packing holds one per row. Such a micro-batch is
    collated as the unpacked one (no position ids, the plain causal attention), so a run resumed with --packing
    added continues bit for bit (it once differed in the gradient norm's seventh digit)."""
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "whole")) == 0
    assert main(args(data, tmp_path / "cut")) == 0
    for late in checkpoint_dirs(tmp_path / "cut")[1:]:
        shutil.rmtree(late)
    assert main(args(data, tmp_path / "cut", "--resume", "--packing")) == 0
    rows = read_metrics(tmp_path / "cut")
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in read_metrics(tmp_path / "whole")]
    same_run(tmp_path / "cut", tmp_path / "whole")


def test_resume_without_a_checkpoint_starts_fresh(tmp_path):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "whole", steps=3)) == 0
    assert main(args(data, tmp_path / "new", "--resume", steps=3)) == 0
    same_run(tmp_path / "new", tmp_path / "whole")


def test_resume_drops_a_torn_last_metrics_line(tmp_path):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "whole")) == 0
    assert main(args(data, tmp_path / "cut")) == 0
    for late in checkpoint_dirs(tmp_path / "cut")[1:]:
        shutil.rmtree(late)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 9, "wind')  # killed mid-write
    assert main(args(data, tmp_path / "cut", "--resume")) == 0
    same_run(tmp_path / "cut", tmp_path / "whole")


def test_resume_refuses_a_bad_metrics_line_that_is_not_the_torn_last_one(tmp_path, capsys):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "cut", steps=4)) == 0
    metrics = tmp_path / "cut" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join([lines[0], "not json\n", *lines[1:]]))
    before = metrics.read_text()
    assert main(args(data, tmp_path / "cut", "--resume", steps=6)) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "metrics.jsonl:2 is not valid JSON" in err and "Traceback" not in err
    assert metrics.read_text() == before  # nothing was changed


def test_keep_checkpoints(tmp_path):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "run", "--keep-checkpoints", "2", steps=8)) == 0
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-6", "step-8"]


def test_divergence_stops_after_max_skipped_steps(tmp_path, capsys):
    data = data_file(tmp_path)
    code = main(args(data, tmp_path / "run", "--lr", "1e30", "--max-skipped-steps", "3", steps=20))
    assert code == 1
    err = capsys.readouterr().err
    assert "3 optimizer steps in a row were skipped" in err and "non-finite gradients" in err
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["skipped"] and rows[-3]["skipped"]


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_equals_the_uninterrupted_run(tmp_path):
    data = data_file(tmp_path)
    whole = args(data, tmp_path / "whole", steps=24)
    whole[whole.index("--checkpoint-every") + 1] = "1"
    assert main(whole) == 0
    cut = [*whole[:-1], str(tmp_path / "cut")]
    rng = random.Random(5)
    kills = during_write = 0
    metrics = tmp_path / "cut" / "metrics.jsonl"
    for attempt in range(30):
        rows_before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        process = spawn([*cut, "--resume"] if attempt else cut)
        started = time.monotonic()
        # Kill once the run has made 1 to 5 new steps (each followed by a checkpoint with fsync), a random moment
        # after a step's row: counted in steps, not seconds, so that a faster machine still gets its kills.
        wanted = rows_before + rng.randint(1, 5)
        while process.poll() is None and (len(metrics.read_text().splitlines()) if metrics.exists() else 0) < wanted:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.04))
        if process.poll() is None and kills < 4:  # each kill costs a process start (torch import): 4 suffice
            process.send_signal(signal.SIGKILL)
            process.wait()
            kills += 1
            # a hidden staging folder left behind means this kill landed inside a checkpoint write
            during_write += bool(list((tmp_path / "cut" / "checkpoints").glob(".step-*")))
            continue
        assert process.wait(timeout=120) == 0, process.stderr.read() if process.stderr else ""
        if (tmp_path / "cut" / "summary.json").exists() and time.monotonic() > started:
            break
    assert kills >= 3
    print(f"{kills} kills, {during_write} of them during a checkpoint write")
    same_run(tmp_path / "cut", tmp_path / "whole")
    assert not list((tmp_path / "cut" / "checkpoints").glob(".step-*"))
    for path in checkpoint_dirs(tmp_path / "cut"):
        assert verify_checkpoint(path) is None, path


@pytest.mark.slow
def test_sigterm_finishes_the_window_checkpoints_and_exits_0(tmp_path):
    data = data_file(tmp_path)
    whole = args(data, tmp_path / "whole", steps=60)
    assert main(whole) == 0
    cut = [*whole[:-1], str(tmp_path / "cut")]
    cut[cut.index("--checkpoint-every") + 1] = "1000"  # only the signal makes a checkpoint
    process = spawn(cut)
    while not (tmp_path / "cut" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "cut"):
        time.sleep(0.05)
        assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert "stopped by SIGTERM" in process.stderr.read()
    done = read_metrics(tmp_path / "cut")[-1]["step"]
    assert 1 <= done < 60 and [p.name for p in checkpoint_dirs(tmp_path / "cut")] == [f"step-{done}"]
    assert main([*cut, "--resume"]) == 0
    same_run(tmp_path / "cut", tmp_path / "whole")


@pytest.mark.slow
def test_sigterm_mid_window_keeps_the_accumulated_gradients(tmp_path):
    data = data_file(tmp_path)
    base = ["train", "--data", str(data), "--seq-len", "32", "--micro-batch-size", "1", "--grad-accum-steps", "16",
            "--max-steps", "12", "--val-fraction", "0", "--checkpoint-mid-window"]
    assert main([*base, "--out", str(tmp_path / "whole")]) == 0
    rng = random.Random(3)
    for attempt in range(4):
        out = tmp_path / f"cut{attempt}"
        process = spawn([*base, "--out", str(out)])
        while not (out / "metrics.jsonl").exists() or not read_metrics(out):
            time.sleep(0.02)
            assert process.poll() is None
        time.sleep(rng.uniform(0.0, 0.2))  # somewhere inside a window of 16 micro-batches
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        (checkpoint,) = checkpoint_dirs(out)
        state = load_checkpoint(checkpoint).state
        partial = state["partial_window"]
        assert main([*base, "--out", str(out), "--resume"]) == 0
        same_run(out, tmp_path / "whole")  # bitwise, whether or not the signal landed mid-window
        if partial is not None:
            assert 1 <= partial["micro_batches_done"] < 16 and partial["grads"]
            return
    pytest.fail("no SIGTERM landed inside a window in 4 tries")


def test_mid_window_checkpoints_need_a_fixed_micro_batch(tmp_path, capsys):
    code = main(["train", "--micro-batch-size", "auto", "--effective-batch-size", "8", "--checkpoint-mid-window",
                 "--out", str(tmp_path / "run")])
    assert code == 2 and "--checkpoint-mid-window" in capsys.readouterr().err


def _reseal(checkpoint: Path) -> None:
    """Recompute the manifest over the files as they are now: what anyone who tampers with a checkpoint can do."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["sha256"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in checkpoint.iterdir()
                          if p.name != "manifest.json"}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


class _RunsCode:
    """Unpickling this runs ``touch MARKER``: a planted training state."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (subprocess.call, (["touch", str(self.marker)],))


def test_a_planted_pickle_in_a_checkpoint_never_runs(tmp_path, capsys):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "run", steps=2)) == 0
    (checkpoint,) = checkpoint_dirs(tmp_path / "run")
    marker = tmp_path / "pwned"
    # The layout cadence used to write: the state as a pickle, with a manifest that vouches for it.
    with open(checkpoint / "training_state.pt", "wb") as handle:
        pickle.dump({"optimizer": _RunsCode(marker)}, handle)
    _reseal(checkpoint)
    code = main(args(data, tmp_path / "run", "--resume", steps=4))
    err = capsys.readouterr().err
    assert not marker.exists()
    assert code == 2 and "--resume" in err and "training_state.pt" in err and "could run code" in err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]  # the run was not restarted over itself


def test_an_edited_training_state_with_a_resealed_manifest_is_refused(tmp_path, capsys):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "run", steps=2)) == 0
    (checkpoint,) = checkpoint_dirs(tmp_path / "run")
    (checkpoint / "training_state.json").write_text(
        json.dumps({"format": "cadence-state/1", "state": {"__reduce__": ["os.system", ["touch pwned"]]}}))
    _reseal(checkpoint)
    assert main(args(data, tmp_path / "run", "--resume", steps=4)) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "unknown marker" in err and "Traceback" not in err


ALLOW_LIST_UNPICKLER = Path("training/checkpoint/sharded.py")
"""The one module that imports pickle: DCP's .metadata is a pickle, read there by an Unpickler whose find_class
resolves an allow-list only (checked below: pickle is used for nothing else there)."""


def test_no_module_of_cadence_unpickles():
    """The class, not the example: no torch.load without weights_only=True, no pickle module (but the allow-list
    unpickler of DCP's index), no allow_pickle."""
    source = Path(__file__).resolve().parents[2] / "src" / "cadence"
    offenders = []
    tree = ast.parse((source / ALLOW_LIST_UNPICKLER).read_text(encoding="utf-8"))
    uses = {ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and ast.unparse(node.value) == "pickle"}
    assert uses == {"pickle.Unpickler"}
    unpicklers = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                  and any(ast.unparse(base) == "pickle.Unpickler" for base in node.bases)]
    assert unpicklers and all(any(isinstance(item, ast.FunctionDef) and item.name == "find_class"
                                  for item in node.body) for node in unpicklers)
    for path in source.rglob("*.py"):
        exempt = path.relative_to(source) == ALLOW_LIST_UNPICKLER  # its pickle import only: checked above
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(source)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] + ([node.module] if isinstance(node, ast.ImportFrom)
                                                                 and node.module else [])
                offenders += [f"{where}: imports {n}" for n in names if n.split(".")[0] in
                              {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
                              and not (exempt and n == "pickle")]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                keywords = {k.arg: k.value for k in node.keywords}
                safe = isinstance(keywords.get("weights_only"), ast.Constant) and keywords["weights_only"].value is True
                if node.func.attr == "load" and ast.unparse(node.func.value) == "torch" and not safe:
                    offenders.append(f"{where}: torch.load without weights_only=True")
                pickles = keywords.get("allow_pickle")
                if pickles is not None and not (isinstance(pickles, ast.Constant) and pickles.value is False):
                    offenders.append(f"{where}: allow_pickle")
    assert offenders == []


def _damage(checkpoint: Path) -> None:
    weights = checkpoint / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF
    weights.write_bytes(bytes(blob))


def test_pruning_keeps_intact_checkpoints_not_the_highest_steps(tmp_path):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "whole")) == 0
    assert main(args(data, tmp_path / "run")) == 0
    _damage(checkpoint_dirs(tmp_path / "run")[-1])  # step-8
    deleted = prune_checkpoints(tmp_path / "run", keep=1)
    assert [p.name for p in deleted] == ["step-2", "step-4"]
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-6", "step-8"]  # the damaged one is left
    assert main(args(data, tmp_path / "run", "--resume", "--keep-checkpoints", "1")) == 0
    same_run(tmp_path / "run", tmp_path / "whole")
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-8"]  # rewritten whole, the old ones pruned


def test_a_resume_that_finds_only_damaged_checkpoints_stops(tmp_path, capsys):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "run", steps=4)) == 0
    for checkpoint in checkpoint_dirs(tmp_path / "run"):
        _damage(checkpoint)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    assert main(args(data, tmp_path / "run", "--resume", steps=4)) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "no usable checkpoint" in err and "step-2" in err and "step-4" in err
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == metrics  # nothing restarted over the run


@pytest.mark.parametrize("manifest", [{}, {"step": 2, "sha256": {}}, {"step": 2, "sha256": []}, "[[[["])
def test_a_manifest_that_vouches_for_less_than_every_file_is_damage(tmp_path, manifest):
    data = data_file(tmp_path)
    assert main(args(data, tmp_path / "run", steps=2)) == 0
    (checkpoint,) = checkpoint_dirs(tmp_path / "run")
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    (checkpoint / "manifest.json").write_text(text)
    assert verify_checkpoint(checkpoint) is not None
    real = json.loads(text) if not isinstance(manifest, str) else None
    if real is not None and real.get("sha256") == {}:
        assert "does not vouch for" in verify_checkpoint(checkpoint)


def test_a_run_recorded_before_too_long_existed_truncated_its_long_examples() -> None:
    """Issue 30: such a run truncated every example longer than --seq-len; resuming it with --too-long skip (the new
    default) would train on fewer examples, so it is refused, and --too-long truncate resumes it."""
    old_record = {"model": "gpt-tiny", "seq_len": 48}
    (problem,) = incompatibilities(old_record, {**old_record, "too_long": "skip"})
    assert problem.where == "--too-long" and "'skip' differs from the checkpoint's 'truncate'" in problem.message
    assert incompatibilities(old_record, {**old_record, "too_long": "truncate"}) == []


def test_the_schedule_note_tells_two_close_learning_rates_apart():
    """Issue 30: a note read "is 0.0002 instead of 0.0002": both rounded to 3 digits. The figures now carry the
    digits that differ."""
    from cadence.training.resume import distinct_figures

    assert distinct_figures(0.00020004, 0.00020001) == ("0.00020004", "0.00020001")
    assert distinct_figures(0.5, 0.25) == ("0.5", "0.25")
    assert distinct_figures(0.1, 0.1) == ("0.1", "0.1")
    saved = {"max_steps": 1000, "lr_schedule": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.1, "lr": 2e-4}
    note = schedule_note(saved, {**saved, "max_steps": 1001}, 1)
    new, old = note.rsplit(" is ", 1)[1].split(" instead of ")
    assert new != old, note


def test_the_done_line_names_no_validation_loss_when_there_is_none(tmp_path, capsys):
    from cadence.cli import main

    assert main(["train", "--seq-len", "16", "--micro-batch-size", "2", "--max-steps", "1", "--val-fraction", "0",
                 "--out", str(tmp_path / "run")]) == 0
    done = [line for line in capsys.readouterr().err.splitlines() if line.startswith("done:")]
    assert done and "val loss" not in done[0]


@pytest.mark.parametrize("killed", [False, True], ids=["stopped", "killed"])
def test_a_resumed_run_reports_its_segments_and_the_whole_run(tmp_path, capsys, killed):
    """Issue 30 item 3: the summary and report of a resumed run put this segment's wall time beside the whole run's
    tokens, and said nothing of the resume. Now summary.json's segments give each process's steps, tokens, step
    time and wall time (none for one killed before its summary), the whole run's wall time when every segment's is
    known, and the report and the done line say where it resumed."""
    from cadence.report.render import to_markdown
    from cadence.report.runs import run_report

    data = data_file(tmp_path)
    out = tmp_path / "run"
    assert main(args(data, out, "--lr-schedule", "constant", steps=4)) == 0
    first = json.loads((out / "summary.json").read_text())
    if killed:  # as a SIGKILL leaves it: the checkpoint and the metrics, no summary
        (out / "summary.json").unlink()
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "6"]) == 0
    done = [line for line in capsys.readouterr().err.splitlines() if line.startswith("done:")][0]
    assert "(this segment, resumed from step 4)" in done
    summary = json.loads((out / "summary.json").read_text())
    earlier, current = summary["segments"]
    assert (earlier["from_step"], earlier["to_step"], current["from_step"], current["to_step"]) == (0, 4, 4, 6)
    assert earlier["tokens"] + current["tokens"] == summary["tokens"] and current["tokens"] > 0
    assert current["wall_time_s"] == summary["wall_time_s"]
    if killed:
        assert earlier["wall_time_s"] is None and summary["run_wall_time_s"] is None
    else:
        assert earlier["wall_time_s"] == first["wall_time_s"]
        assert summary["run_wall_time_s"] == pytest.approx(first["wall_time_s"] + summary["wall_time_s"])
    report = to_markdown(run_report(out))
    assert "**Resumed:** 1 time(s), last from step 4" in report and "steps 0-4:" in report
    assert "in this last segment; the whole run " + ("unknown" if killed else "") in report
