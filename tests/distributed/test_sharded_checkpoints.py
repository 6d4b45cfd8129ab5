"""Sharded checkpoints under FSDP2 (issue 38): every rank writes its own DCP shard, nothing is gathered, and a run
moves between world sizes on resume (2 ranks -> 1 process, 1 process -> 2 ranks) with the uninterrupted run's losses
and weights; the DCP index is read without unpickling anything outside an allow-list.
"""

from __future__ import annotations

import json
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ranks_counting, relative_l2, run_cli, sigterm_at, write_jsonl
from safetensors.torch import load_file

from cadence.cli import main
from cadence.training.checkpoint import checkpoint_dirs, verify_checkpoint
from cadence.training.checkpoint.sharded import MetadataRefused, read_metadata, read_model_tensors
from cadence.training.run_dir import read_metrics

pytestmark = pytest.mark.slow  # real gloo processes

STEPS = 8
ARGS = ["--seq-len", "32", "--max-steps", str(STEPS), "--lr", "3e-3", "--warmup-steps", "2", "--val-fraction", "0",
        "--too-long", "truncate", "--micro-batch-size", "2", "--effective-batch-size", "16", "--checkpoint-every", "2"]
"""Effective batch 16 on any world size: 2 ranks accumulate 4 micro-batches of 2, one process 8."""


def cadence(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cadence", *args], capture_output=True, text=True, timeout=240)


def two_ranks(data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    result = cadence("train", "--nproc-per-node", "2", "--strategy", "fsdp", "--data", str(data), *ARGS,
                     "--out", str(out), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the data, the 2-rank FSDP2 run no signal stopped)."""
    root = tmp_path_factory.mktemp("sharded")
    data = write_jsonl(root / "examples.jsonl")
    two_ranks(data, root / "whole")
    return data, root / "whole"


def _same_run(resumed: Path, whole: Path) -> tuple[float, float]:
    """(the largest relative loss difference, the weights' relative L2 difference), asserted within 1e-5."""
    mine, theirs = read_metrics(resumed), read_metrics(whole)
    assert [row["step"] for row in mine] == list(range(1, STEPS + 1))
    assert [row["samples"] for row in mine] == [row["samples"] for row in theirs]  # the same windows
    loss = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(mine, theirs, strict=True))
    weights = relative_l2(load_file(str(resumed / "model.safetensors")), load_file(str(whole / "model.safetensors")))
    assert loss <= 1e-5 and weights <= 1e-5, (loss, weights)
    return loss, weights


def test_each_rank_writes_its_own_shard_and_the_index_is_read_through_an_allow_list(
        uninterrupted: tuple[Path, Path], tmp_path: Path) -> None:
    _, whole = uninterrupted
    checkpoint = checkpoint_dirs(whole)[-1]
    assert verify_checkpoint(checkpoint) is None
    names = sorted(path.name for path in checkpoint.iterdir())
    assert [name for name in names if name.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]
    assert ".metadata" in names and "model.safetensors" not in names  # nothing was gathered into one file
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["format"] == "dcp" and {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(manifest["sha256"])
    metadata = read_metadata(checkpoint)
    # FSDP2 shards every parameter on dim 0: rank r's rows are in the file DCP named after its writer, rank r.
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith("model.") or len(entry.size) == 0 or entry.size[0] < 2:
            continue
        files = {chunk.offsets[0]: metadata.storage_data[_index(metadata, key, chunk.offsets)].relative_path
                 for chunk in entry.chunks}
        assert files[0] == "__0_0.distcp" and files[max(files)] == "__1_0.distcp", (key, files)
    # A .metadata naming anything outside the allow-list is refused before it is called (in a copy: the run's
    # checkpoints serve the other tests).
    crafted = tmp_path / "crafted"
    shutil.copytree(checkpoint, crafted)
    (crafted / ".metadata").write_bytes(pickle.dumps(subprocess.Popen))
    with pytest.raises(MetadataRefused, match="subprocess.Popen"):
        read_metadata(crafted)


def test_a_sharded_checkpoint_s_weights_assemble_in_one_process_and_sample(uninterrupted: tuple[Path, Path]) -> None:
    """`cadence sample --weights step-N` of a sharded checkpoint: its shards assembled without a process group are
    the weights FSDP2 gathered into model.safetensors at the same step, bit for bit, and sample the same text."""
    _, whole = uninterrupted
    assembled = read_model_tensors(whole / "checkpoints" / f"step-{STEPS}")
    final = load_file(str(whole / "model.safetensors"))
    assert assembled.keys() == final.keys() and all(torch.equal(assembled[key], final[key]) for key in final)
    texts = [run_cli(["sample", str(whole), "--weights", which, "--prompt", "The ", "--max-new-tokens", "12"])
             for which in ("final", f"step-{STEPS}")]
    assert texts[0][0] == texts[1][0] == 0 and texts[0][1] == texts[1][1], texts  # the same text on stdout
    assert f"checkpoints/step-{STEPS}" in texts[1][2]  # stderr names the weights used


def _index(metadata, key: str, offsets):  # type: ignore[no-untyped-def]
    return next(index for index in metadata.storage_data if index.fqn == key and tuple(index.offset) == tuple(offsets))


def test_two_ranks_stopped_by_sigterm_resume_on_one_process(uninterrupted: tuple[Path, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Acceptance: 2 FSDP2 ranks, SIGTERM, resumed on 1 process (accumulation 8 instead of 4, DCP reshards the model
    and optimizer): the uninterrupted 2-rank run's losses and weights."""
    data, whole = uninterrupted
    out = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "cadence", "train", "--nproc-per-node", "2", "--strategy",
                                 "fsdp", "--data", str(data), *ARGS, "--out", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, stderr[-3000:]
    stopped_at = len(read_metrics(out))
    assert stopped_at < STEPS, "the signal came too late to test a resume"
    assert main(["train", "--data", str(data), *ARGS, "--out", str(out), "--resume"]) == 0
    assert f"(step {stopped_at})" in capsys.readouterr().err
    loss, weights = _same_run(out, whole)
    print(f"2 ranks -> 1 process after step {stopped_at}: loss {loss:.1e}, weights {weights:.1e}")


def test_one_process_resumes_on_two_fsdp2_ranks(uninterrupted: tuple[Path, Path], tmp_path: Path) -> None:
    """A one-process checkpoint (the single-file format) continues on 2 FSDP2 ranks, which keep their shards of it
    and write sharded checkpoints from then on, here in the background (--async-checkpoint: DCP over a process group
    of its own while training goes on)."""
    data, whole = uninterrupted
    out = tmp_path / "run"
    with sigterm_at(3, 5):  # mid-step 4: the run stops after it, with its step-4 checkpoint
        assert main(["train", "--data", str(data), *ARGS, "--out", str(out)]) == 0
    assert len(read_metrics(out)) == 4
    result = two_ranks(data, out, "--resume", "--async-checkpoint")
    assert "(step 4)" in result.stderr
    formats = [json.loads((path / "manifest.json").read_text()).get("format") for path in checkpoint_dirs(out)]
    assert formats[0] == "files" and formats[-1] == "dcp"
    assert [path.name for path in checkpoint_dirs(out)] == ["step-2", "step-4", "step-6", "step-8"]
    assert all(verify_checkpoint(path) is None for path in checkpoint_dirs(out))
    loss, weights = _same_run(out, whole)
    print(f"1 process -> 2 ranks after step 4: loss {loss:.1e}, weights {weights:.1e}")


def test_a_resume_that_would_change_the_effective_batch_is_refused(uninterrupted: tuple[Path, Path],
                                                                   tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    data, whole = uninterrupted
    out = tmp_path / "run"
    shutil.copytree(whole, out)
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS}")
    changed = [arg if arg != "16" else "8" for arg in ARGS]
    assert main(["train", "--data", str(data), *changed, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--effective-batch-size" in err and "differs from the checkpoint's 16" in err


MID_WINDOW = ["--seq-len", "32", "--max-steps", "4", "--lr", "3e-3", "--val-fraction", "0", "--too-long", "truncate",
              "--micro-batch-size", "1", "--grad-accum-steps", "4", "--checkpoint-every", "100",
              "--checkpoint-mid-window"]


def test_a_mid_window_sigterm_on_two_ranks_resumes_without_computing_a_micro_batch_twice(tmp_path: Path) -> None:
    """Acceptance: --checkpoint-mid-window on 2 DDP ranks, SIGTERM after micro-batch 2 of step 3's 4: each rank
    saves its own not yet all-reduced gradients and share of the loss; resumed, the run is the uninterrupted one bit
    for bit, and the two segments together computed each micro-batch once."""
    data = write_jsonl(tmp_path / "examples.jsonl")
    whole = ranks_counting(MID_WINDOW, tmp_path / "whole-counts", data, tmp_path / "whole", stop=(-1, -1))
    cut = ranks_counting(MID_WINDOW, tmp_path / "cut-counts", data, tmp_path / "cut", stop=(2, 2))
    (checkpoint,) = checkpoint_dirs(tmp_path / "cut")
    names = {path.name for path in checkpoint.iterdir()}
    assert {"rank-0.json", "rank-0.safetensors", "rank-1.json", "rank-1.safetensors"} <= names
    info = json.loads((checkpoint / "checkpoint.json").read_text())
    assert info["mid_window"] and info["step"] == 2
    rest = ranks_counting(MID_WINDOW, tmp_path / "rest-counts", data, tmp_path / "cut", stop=(-1, -1), resume=True)
    mine, theirs = read_metrics(tmp_path / "cut"), read_metrics(tmp_path / "whole")
    assert [(row["step"], row["loss"]) for row in mine] == [(row["step"], row["loss"]) for row in theirs]
    weights = relative_l2(load_file(str(tmp_path / "cut" / "model.safetensors")),
                          load_file(str(tmp_path / "whole" / "model.safetensors")))
    assert weights == 0.0
    for rank in range(2):
        assert whole[rank]["micro_batches"] == 4 * 4
        assert cut[rank]["micro_batches"] + rest[rank]["micro_batches"] == 4 * 4, rank  # none computed twice
        assert cut[rank]["micro_batches"] == 2 * 4 + 2
    print(f"micro-batches per rank: {cut[0]['micro_batches']} before the stop + {rest[0]['micro_batches']} after")
