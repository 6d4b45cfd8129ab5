"""Several processes for real: `cadence train --nproc-per-node 2` starts 2 gloo ranks with torchrun's launcher.

Acceptance (issue 7): world 2 x micro 2 x accum 4 gives the losses and weights of one process at 2 x 8 and at
16 x 1, on prompt/completion data where the two ranks hold different target counts in every window; FSDP2 gives
DDP's losses; one gradient all-reduce per optimizer step; a rank that dies stops the others within 60 s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import rank_pids, relative_l2, write_jsonl
from safetensors.torch import load_file

from cadence.cli import main
from cadence.data import load_data
from cadence.engine.cut import Cut
from cadence.engine.windows import epoch_windows
from cadence.training.run_dir import read_metrics

STEPS = 6
# --too-long truncate: about half of write_jsonl's 48 examples are longer than 32 bytes; all 48 make the windows below.
COMMON = ["--seq-len", "32", "--max-steps", str(STEPS), "--lr", "3e-3", "--warmup-steps", "2", "--val-fraction", "0",
          "--checkpoint-every", "3", "--too-long", "truncate"]
TESTS = Path(__file__).resolve().parent

# Every test here starts real gloo processes: make test-slow (and make test-all), left out of make test.
pytestmark = pytest.mark.slow


def cadence(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The cadence command in a fresh process (the launcher starts its ranks as further processes)."""
    return subprocess.run([sys.executable, "-m", "cadence", *args], capture_output=True, text=True, timeout=timeout)


def train_two_ranks(out: Path, data: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    result = cadence("train", "--nproc-per-node", "2", "--data", str(data), "--micro-batch-size", "2",
                     "--grad-accum-steps", "4", "--out", str(out), *COMMON, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def train_one_process(out: Path, data: Path, micro: int, accum: int, *extra: str) -> None:
    assert main(["train", "--data", str(data), "--micro-batch-size", str(micro), "--grad-accum-steps", str(accum),
                 "--out", str(out), *COMMON, *extra]) == 0


def run_rank_script(name: str, out: Path) -> dict:
    """A script of tests/distributed/ on 2 gloo ranks under torchrun itself; returns the JSON rank 0 wrote."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(TESTS / name), str(out)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same 6 steps of effective batch 16 as DDP 2x2x4, FSDP2 2x2x4, and one process at 2x8 and 16x1. The FSDP2
    run also compiles its blocks (--compile, issue 16): each rank compiles on its own, FSDP2's gathers stay eager
    around the compiled blocks, and it still matches eager DDP and the one process (compiled against eager differ by
    about 1e-7 in the loss here). Only this run compiles: a cold compile costs tens of seconds per run here."""
    root = tmp_path_factory.mktemp("distributed")
    data = write_jsonl(root / "examples.jsonl")
    found = {"data": data, "root": root}
    found["ddp"] = root / "ddp"
    found["ddp_log"] = Path(root / "ddp.log")
    # Its own token-store cache: the two ranks start together on an empty one (see the test of the shared store).
    # In drawn order (not the default by-length): the reference for the budget run's padding below.
    found["ddp_log"].write_text(train_two_ranks(found["ddp"], data, "--data-cache", str(root / "cache"),
                                                "--micro-batch-order", "drawn").stderr)
    train_two_ranks(root / "fsdp", data, "--strategy", "fsdp", "--compile")
    found["fsdp"] = root / "fsdp"
    # Each rank cuts its share of every window by a token budget (issue 15): the ranks need different numbers of
    # micro-batches and pad to the larger, with the one-process math.
    found["ddp_budget"] = root / "ddp-budget"
    train_two_ranks(found["ddp_budget"], data, "--micro-batch-tokens", "64")
    for micro, accum in ((2, 8), (16, 1)):
        found[f"{micro}x{accum}"] = root / f"one-{micro}x{accum}"
        train_one_process(found[f"{micro}x{accum}"], data, micro, accum)
    return found


def test_two_ranks_give_the_one_process_losses_and_weights(runs: dict[str, Path]) -> None:
    ddp = read_metrics(runs["ddp"])
    assert [row["step"] for row in ddp] == list(range(1, STEPS + 1))
    ddp_weights = load_file(str(runs["ddp"] / "model.safetensors"))
    for name in ("2x8", "16x1"):
        rows = read_metrics(runs[name])
        for mine, theirs in zip(ddp, rows, strict=True):
            # Global counts: the all-reduced target count normalises every rank's loss.
            assert (mine["targets"], mine["samples"], mine["tokens"]) == (
                theirs["targets"], theirs["samples"], theirs["tokens"])
            assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * theirs["loss"], (name, mine["step"])
            assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-12)
        assert relative_l2(ddp_weights, load_file(str(runs[name] / "model.safetensors"))) < 1e-4, name
    assert len({row["targets"] for row in ddp}) > 1  # the windows really differ in length


def test_a_token_budget_under_two_ranks_gives_the_one_process_losses(runs: dict[str, Path]) -> None:
    budget, whole = read_metrics(runs["ddp_budget"]), read_metrics(runs["2x8"])
    for mine, theirs in zip(budget, whole, strict=True):
        assert (mine["targets"], mine["samples"], mine["tokens"]) == (theirs["targets"], theirs["samples"],
                                                                      theirs["tokens"])
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * theirs["loss"]
    assert relative_l2(load_file(str(runs["ddp_budget"] / "model.safetensors")),
                       load_file(str(runs["2x8"] / "model.safetensors"))) < 1e-4
    drawn = read_metrics(runs["ddp"])
    assert sum(row["padded_positions"] for row in budget) < sum(row["padded_positions"] for row in drawn)


def test_the_two_ranks_read_one_token_store(runs: dict[str, Path]) -> None:
    """Both ranks needed the store at once: one built it, the other waited and mapped the same files (the build
    itself is counted in tests/data/test_store.py); nothing half-built is left."""
    stores = list((runs["root"] / "cache" / "stores").iterdir())
    assert len(stores) == 1 and (stores[0] / "store.json").is_file()
    config = json.loads((runs["ddp"] / "config.json").read_text())
    assert config["data_store"] == str(stores[0])


def test_the_two_ranks_hold_different_target_counts_in_every_window(runs: dict[str, Path]) -> None:
    """What makes the test above sharp: a per-rank normalisation would get each of these windows wrong."""
    train = load_data(runs["data"], 32, 0.0, too_long="truncate").train
    per_rank = [[window.targets for epoch in (0, 1)  # 48 examples: 3 windows of 16 per epoch
                 for window in epoch_windows(train, cut=Cut(micro_batch_size=2), grad_accum_steps=4, seed=0,
                                             epoch=epoch, world_size=2, rank=rank)]
                for rank in (0, 1)]
    assert len(per_rank[0]) == STEPS
    assert all(a != b for a, b in zip(*per_rank)), per_rank
    totals = [row["targets"] for row in read_metrics(runs["ddp"])]
    assert [a + b for a, b in zip(*per_rank)] == totals


def test_effective_batch_counts_the_processes(runs: dict[str, Path]) -> None:
    config = json.loads((runs["ddp"] / "config.json").read_text())
    assert (config["world_size"], config["effective_batch_size"], config["strategy"]) == (2, 16, "ddp")
    log = runs["ddp_log"].read_text()
    assert "effective batch = 2 micro-batch x 4 accumulation x 2 process(es) = 16 sequences" in log
    assert log.count("effective batch =") == 1  # rank 0 alone prints
    summary = json.loads((runs["ddp"] / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["peak_memory_of"] == "the busiest rank"


def test_fsdp2_gives_the_ddp_losses(runs: dict[str, Path]) -> None:
    fsdp, ddp = read_metrics(runs["fsdp"]), read_metrics(runs["ddp"])
    for mine, theirs in zip(fsdp, ddp, strict=True):
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * theirs["loss"], mine["step"]
    # The gathered full state dict: the user's parameter names, the DDP run's values.
    fsdp_weights = load_file(str(runs["fsdp"] / "model.safetensors"))
    assert relative_l2(fsdp_weights, load_file(str(runs["ddp"] / "model.safetensors"))) < 1e-4
    compiled = json.loads((runs["fsdp"] / "summary.json").read_text())  # its blocks were compiled (--compile)
    assert compiled["compile_time_s"] > 0 and compiled["compiled_graphs"] >= 1


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_under_two_ranks_equals_the_uninterrupted_run(runs: dict[str, Path], strategy: str) -> None:
    """Cut the run back to its step-3 checkpoint and resume it with 2 ranks: the last 3 steps come out the same."""
    run = runs["root"] / f"resumed-{strategy}"
    shutil.copytree(runs[strategy], run)
    shutil.rmtree(run / "checkpoints" / "step-6")
    (run / "model.safetensors").unlink()
    extra = ["--strategy", "fsdp", "--compile"] if strategy == "fsdp" else []  # as the run it continues
    result = cadence("train", "--nproc-per-node", "2", "--data", str(runs["data"]), "--micro-batch-size", "2",
                     "--grad-accum-steps", "4", "--out", str(run), "--resume", *COMMON, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stderr and "(step 3)" in result.stderr
    resumed, original = read_metrics(run), read_metrics(runs[strategy])
    assert [row["loss"] for row in resumed] == pytest.approx([row["loss"] for row in original], rel=1e-6)
    assert relative_l2(load_file(str(run / "model.safetensors")),
                       load_file(str(runs[strategy] / "model.safetensors"))) < 1e-6


@pytest.mark.parametrize(("strategy", "state"), [("fsdp", "bf16"), ("ddp", "8bit")])
def test_low_precision_optimizer_state_resumes_bitwise_on_two_ranks(tmp_path: Path, strategy: str,
                                                                    state: str) -> None:
    """--optimizer-state bf16 under FSDP2 (the moments are DTensor shards, updated through their local tensors and
    gathered whole into the checkpoint) and 8bit under DDP (each rank quantises the same all-reduced gradients the
    same way): cut back to step 3 and resumed, the run is the uninterrupted one bit for bit."""
    data = write_jsonl(tmp_path / "examples.jsonl")
    extra = ["--strategy", strategy, "--optimizer-state", state]
    train_two_ranks(tmp_path / "whole", data, *extra)
    # The uninterrupted run cut back to its step-3 checkpoint: the same files a stop there would have left (training
    # the first 3 steps again would cost another launch of both ranks for nothing the test looks at).
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-6")
    (tmp_path / "cut" / "model.safetensors").unlink()
    result = train_two_ranks(tmp_path / "cut", data, *extra, "--resume")
    assert "(step 3)" in result.stderr
    assert [row["loss"] for row in read_metrics(tmp_path / "cut")] == \
        [row["loss"] for row in read_metrics(tmp_path / "whole")]
    mine, theirs = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("cut", "whole"))
    assert all(torch.equal(mine[name], theirs[name]) for name in theirs)
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["optimizer_state_bytes"] < 0.3 * 8 * summary["parameters"]  # per rank: a shard, or 8-bit codes


def test_a_one_process_checkpoint_resumes_on_two_ranks(runs: dict[str, Path]) -> None:
    """The windows are the same for any split of the effective batch, so a run may move to more processes."""
    run = runs["root"] / "one-to-two"
    shutil.copytree(runs["2x8"], run)
    shutil.rmtree(run / "checkpoints" / "step-6")
    train_two_ranks(run, runs["data"], "--resume")
    assert [row["loss"] for row in read_metrics(run)] == pytest.approx(
        [row["loss"] for row in read_metrics(runs["2x8"])], rel=1e-5)


def test_one_gradient_all_reduce_per_optimizer_step(tmp_path: Path) -> None:
    """A DDP communication hook counts the all-reduces: none during the first 3 micro-batches of a window, one with
    the last (the tiny model's gradients fit one bucket)."""
    counts = run_rank_script("count_allreduce.py", tmp_path / "count.json")
    assert counts["optimizer_steps"] == 3
    assert counts["all_reduces"] == 3
    assert counts["windows_at_call"] == [0, 1, 2]  # each during its own window
    # Before micro-batch i of window w, exactly w all-reduces have happened: none inside a window's first three.
    assert counts["before_micro_batch"] == [[i, w] for w in range(3) for i in range(4)]


def test_fsdp2_under_bf16_gathers_bf16_parameters_and_reduces_fp32_gradients(tmp_path: Path) -> None:
    """--precision bf16 with --strategy fsdp: the blocks compute with bf16 copies gathered from fp32 shards (half the
    all-gather traffic), the optimizer sees fp32 gradients on fp32 shards, and the losses stay within 1e-3 relative
    of gathering fp32 parameters and letting autocast cast them (measured: 1.6e-5 on this tiny model, CPU)."""
    found = run_rank_script("fsdp_mixed_precision.py", tmp_path / "mixed.json")
    bf16, fp32 = found["bf16"], found["fp32"]
    assert bf16["forward_weight_dtypes"] == ["torch.bfloat16"] and fp32["forward_weight_dtypes"] == ["torch.float32"]
    for run in (bf16, fp32):
        assert run["grad_dtypes"] == ["torch.float32"] and run["sharded_param_dtypes"] == ["torch.float32"]
    for mine, theirs in zip(bf16["losses"], fp32["losses"], strict=True):
        assert mine == pytest.approx(theirs, rel=1e-3)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc (Linux)")
def test_a_rank_that_dies_stops_the_others_with_a_clear_message(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "examples.jsonl")
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cadence", "train", "--nproc-per-node", "2", "--data", str(data), "--seq-len", "32",
         "--micro-batch-size", "2", "--grad-accum-steps", "4", "--max-steps", "100000", "--val-fraction", "0",
         "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        pids = rank_pids(launcher.pid, "LOCAL_RANK")
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = launcher.communicate(timeout=60)
        elapsed = time.monotonic() - killed
    finally:
        if launcher.poll() is None:
            launcher.kill()
    print(f"all ranks gone {elapsed:.1f} s after rank 1 was killed")
    assert launcher.returncode == 1, stderr[-3000:]
    assert elapsed < 60
    assert "rank 1 was killed by SIGKILL" in stderr, stderr[-3000:]
    for pid in pids.values():  # no rank is left behind
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_gradients_of_padding_micro_batches_are_zero() -> None:
    """The short last window's padding runs a forward and backward for the collectives and adds nothing."""
    from helpers import tiny_model

    from cadence.engine.step import token_cross_entropy_sum
    from cadence.engine.windows import padding_micro_batch

    model = tiny_model()
    loss = token_cross_entropy_sum(model, padding_micro_batch())
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_launcher_arguments_and_failure_lines() -> None:
    from cadence.distributed.launch import arguments_without_nproc, describe_failures

    assert arguments_without_nproc(["--nproc-per-node", "2", "--lr", "1", "--nproc-per-node=4", "--resume"]) == [
        "--lr", "1", "--resume"]
    assert describe_failures({0: -signal.SIGTERM, 1: -signal.SIGKILL}) == "rank 1 was killed by SIGKILL"
    assert describe_failures({0: 1, 1: 1}) == ("rank 0 exited with status 1 (its message is above), "
                                               "rank 1 exited with status 1 (its message is above)")
    assert describe_failures({1: -signal.SIGTERM}) == "rank 1 was killed by SIGTERM"


SIGNAL_ARGS = ["--seq-len", "32", "--max-steps", "30", "--lr", "3e-3", "--val-fraction", "0", "--micro-batch-size",
               "2", "--grad-accum-steps", "4"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank run of SIGNAL_ARGS that no signal stopped: what every interrupted and resumed run must end as."""
    root = tmp_path_factory.mktemp("uninterrupted")
    data = write_jsonl(root / "examples.jsonl")
    assert cadence("train", "--nproc-per-node", "2", "--data", str(data), *SIGNAL_ARGS,
                   "--out", str(root / "run")).returncode == 0
    return root / "run"


@pytest.mark.parametrize(("name", "to_group"), [("SIGTERM", False), ("SIGINT", True), ("SIGINT", False)],
                         ids=["sigterm-to-the-launcher", "ctrl-c-to-the-group", "sigint-to-the-launcher"])
def test_a_signal_stops_every_rank_at_a_window_boundary_with_a_checkpoint(tmp_path: Path, uninterrupted: Path,
                                                                          name: str, to_group: bool) -> None:
    """Preemption (SIGTERM) and Ctrl-C (SIGINT to the terminal's process group, issue 29 item 8): the launcher passes
    the signal on; the ranks agree on the window to stop after, save, exit 0 as one process does (Ctrl-C used to end
    in torch's SignalException traceback, exit 1); the resumed run ends where an uninterrupted one does."""
    data = write_jsonl(tmp_path / "examples.jsonl")
    out = tmp_path / "run"
    args = ["--data", str(data), *SIGNAL_ARGS]
    # A session of its own, as a shell gives a foreground job: the group's signal reaches the launcher and nothing
    # of pytest's.
    launcher = subprocess.Popen([sys.executable, "-m", "cadence", "train", "--nproc-per-node", "2", *args,
                                 "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.1)
        number = signal.Signals[name]
        if to_group:
            os.killpg(launcher.pid, number)
        else:
            launcher.send_signal(number)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    assert f"stopped by {name} after step" in stderr
    stopped_at = len(read_metrics(out))
    assert stopped_at < 30 and (out / "checkpoints" / f"step-{stopped_at}").is_dir()
    assert cadence("train", "--nproc-per-node", "2", *args, "--out", str(out), "--resume").returncode == 0
    # Exact: the checkpoint holds the whole state, and gloo sums the same two gradients in the same order.
    assert [row["loss"] for row in read_metrics(out)] == [row["loss"] for row in read_metrics(uninterrupted)]
    assert relative_l2(load_file(str(out / "model.safetensors")),
                       load_file(str(uninterrupted / "model.safetensors"))) == 0.0


def test_auto_micro_batch_under_two_ranks_halves_on_every_rank_together(tmp_path: Path) -> None:
    """Budget 30 MiB per rank fits micro-batch 4 but not 8 (gpt-tiny, seq 64): both ranks retry the window at 4,
    together, and train exactly like one process at 4 x 8."""
    common = ["--seq-len", "64", "--max-steps", "5", "--val-fraction", "0"]
    auto = tmp_path / "auto"
    result = cadence("train", "--nproc-per-node", "2", *common, "--micro-batch-size", "auto",
                     "--effective-batch-size", "32", "--grad-accum-steps", "2", "--memory-budget", "30MiB",
                     "--auto-grow-after", "2", "--out", str(auto))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "out of memory at micro-batch 8: retrying the window as 4 x 4" in result.stderr
    fixed = tmp_path / "fixed"
    assert main(["train", *common, "--micro-batch-size", "4", "--grad-accum-steps", "8", "--out", str(fixed)]) == 0
    auto_rows, fixed_rows = read_metrics(auto), read_metrics(fixed)
    assert auto_rows[0]["oom_retries"] == 1 and [row["micro_steps"] for row in auto_rows] == [4] * 5
    assert any(row["oom_retries"] == 1 for row in auto_rows[1:]), "it tried growing back to 8"
    for got, want in zip(auto_rows, fixed_rows, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    summary = json.loads((auto / "summary.json").read_text())
    assert summary["final_micro_batch_size"] == 4 and summary["peak_memory_bytes"] <= 30 * 2**20


def test_auto_with_a_token_budget_under_two_ranks_halves_the_budget_on_both(tmp_path: Path) -> None:
    """Each rank re-cuts its own 32 examples by the halved budget (1536 -> 768 -> 384 positions; one micro-batch of
    1536 peaks at ~42 MiB on gpt-tiny, 384 at ~27 MiB) and the ranks agree on the larger micro-batch count: the
    losses are one process's at the same effective batch."""
    data = write_jsonl(tmp_path / "data.jsonl", count=128)
    common = ["--data", str(data), "--seq-len", "48", "--max-steps", "2", "--val-fraction", "0"]
    auto = tmp_path / "auto"
    result = cadence("train", "--nproc-per-node", "2", *common, "--micro-batch-size", "auto",
                     "--effective-batch-size", "64", "--grad-accum-steps", "1", "--micro-batch-tokens", "1536",
                     "--memory-budget", "30MiB", "--auto-grow-after", "50", "--out", str(auto))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "out of memory at a budget of 1536 positions per micro-batch" in result.stderr
    fixed = tmp_path / "fixed"
    assert main(["train", *common, "--micro-batch-size", "32", "--grad-accum-steps", "2", "--out", str(fixed)]) == 0
    for got, want in zip(read_metrics(auto), read_metrics(fixed), strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert (got["tokens"], got["targets"], got["samples"]) == (want["tokens"], want["targets"], want["samples"])
    summary = json.loads((auto / "summary.json").read_text())
    assert summary["final_micro_batch_tokens"] <= 768 and summary["peak_memory_bytes"] <= 30 * 2**20


def test_an_out_of_memory_on_one_rank_makes_every_rank_retry_the_window(tmp_path: Path) -> None:
    """Rank 1 alone runs out of memory above micro-batch 2: without the engine's agreement rank 0 would go on into
    the all-reduce and wait for it (until the collective timeout); with it both retry at 2 and stay identical."""
    seen = run_rank_script("oom_agreement.py", tmp_path / "agreement.json")
    assert seen["retries"] == [1, 0, 0] and seen["final_micro_batch_size"] == 2 and seen["steps"] == 3
    assert seen["weight_checksums"][0] == seen["weight_checksums"][1]


LLAMA = ["--model", "hf:llama", "--model-config", "hidden_size=64", "--model-config", "num_hidden_layers=2",
         "--model-config", "num_attention_heads=4", "--model-config", "intermediate_size=128",
         "--model-config", "vocab_size=256"]


def test_hugging_face_model_under_fsdp2_validates_and_saves_like_one_process(tmp_path: Path) -> None:
    """A transformers llama sharded per decoder layer: the same training and validation losses as one process
    (the validation micro-batches are shared out over the ranks, padded), and --save-hf writes the gathered weights."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    data = write_jsonl(tmp_path / "examples.jsonl")
    common = [*LLAMA, "--data", str(data), "--seq-len", "32", "--max-steps", "4", "--lr", "3e-3",
              "--val-fraction", "0.1", "--eval-every", "2"]
    sharded, saved = tmp_path / "fsdp", tmp_path / "saved-hf"
    result = cadence("train", "--nproc-per-node", "2", "--strategy", "fsdp", *common, "--micro-batch-size", "2",
                     "--grad-accum-steps", "2", "--save-hf", str(saved), "--checkpoint-every", "4",
                     "--out", str(sharded))
    assert result.returncode == 0, result.stderr[-3000:]
    single = tmp_path / "single"
    assert main(["train", *common, "--micro-batch-size", "2", "--grad-accum-steps", "4", "--out", str(single)]) == 0
    rows, reference = read_metrics(sharded), read_metrics(single)
    assert sum(row.get("val_loss") is not None for row in reference) == 2  # steps 2 and 4
    for got, want in zip(rows, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert (got.get("val_loss") is None) == (want.get("val_loss") is None)
        if want.get("val_loss") is not None:
            assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
    reloaded = AutoModelForCausalLM.from_pretrained(str(saved))
    weights = load_file(str(sharded / "model.safetensors"))
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    # Issue 38: `cadence export` of the sharded (DCP) step-4 checkpoint, its shards assembled in one process, loads in
    # transformers with the logits of the --save-hf export of the same step.
    exported = tmp_path / "exported"
    assert main(["export", str(sharded / "checkpoints" / "step-4"), "--out", str(exported)]) == 0
    assert (sharded / "checkpoints" / "step-4" / "__1_0.distcp").is_file()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(str(exported))(ids).logits, reloaded(ids).logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_cuda_ranks_with_nccl_match_one_process_in_bf16(tmp_path: Path, strategy: str) -> None:
    """The CUDA path: nccl, one GPU per rank (all GPUs, at most 2; FSDP2 also runs as a single rank), bf16 autocast."""
    ranks = min(2, torch.cuda.device_count())
    data = write_jsonl(tmp_path / "examples.jsonl")
    common = ["--data", str(data), "--device", "cuda", "--precision", "bf16", "--seq-len", "32", "--max-steps", "4",
              "--val-fraction", "0", "--lr", "3e-3"]
    launched = tmp_path / "launched"
    result = cadence("train", "--nproc-per-node", str(ranks), "--strategy", strategy, *common, "--micro-batch-size",
                     "2", "--grad-accum-steps", str(8 // ranks), "--out", str(launched))
    assert result.returncode == 0, result.stderr[-3000:]
    single = tmp_path / "single"
    assert main(["train", *common, "--micro-batch-size", "2", "--grad-accum-steps", "8", "--out", str(single)]) == 0
    for got, want in zip(read_metrics(launched), read_metrics(single), strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-2)  # bf16: summation order moves the rounding
        assert got["peak_memory_bytes"] > 0


def test_commands_other_than_train_refuse_to_run_under_torchrun(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Each rank would write the same plan or profile directory at once: only train knows how to share the work."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)  # what torchrun gives each rank
    assert main(["plan", "--memory-budget", "1GiB", "--effective-batch-size", "8"]) == 2
    assert "cadence plan runs in one process" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_verify_on_two_ranks_gives_the_big_batch_gradient(tmp_path: Path, strategy: str) -> None:
    """cadence verify with the configuration really distributed: each rank runs its share of the window through
    DDP or FSDP2; the synchronised gradient (and the weights after 2 steps) match one process's whole batch."""
    data = write_jsonl(tmp_path / "examples.jsonl")
    result = cadence("verify", "--nproc-per-node", "2", "--strategy", strategy, "--data", str(data), "--seq-len", "32",
                     "--micro-batch-size", "2", "--grad-accum-steps", "4", "--steps", "2", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads(result.stdout)  # rank 0 alone prints
    assert payload["passed"] and payload["world_size"] == 2 and payload["effective_batch_size"] == 16
    assert payload["grad_accum_steps"] == 4 and payload["relative_error"] < 1e-5
    assert payload["parameters_after_steps"]["relative_distance"] < 1e-4


def test_bad_data_found_by_the_ranks_is_reported_once_and_nothing_is_written(tmp_path: Path) -> None:
    """The flags pass the launcher's check; the malformed line is found by every rank while loading, and rank 0
    alone reports it (the ranks agree first, so none goes on alone). Nothing else reaches stderr: torch's launcher
    logged each rank's exit after cadence's line (issue 29 item 15)."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "completion": "bc"}\n{oops\n')
    out = tmp_path / "run"
    result = cadence("train", "--nproc-per-node", "2", "--data", str(data), "--seq-len", "32", "--max-steps", "2",
                     "--out", str(out))
    assert result.returncode == 2, result.stderr[-3000:]
    errors = result.stderr.splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"cadence: error: {data}:2: not valid JSON"), errors
    assert result.stdout == ""
    assert not out.exists()


@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes_train_like_two_local_ranks(runs: dict[str, Path], tmp_path: Path) -> None:
    """Several machines, as torchrun runs them: one agent per node meeting at a c10d rendezvous (here both on this
    machine, on loopback). World size 2 across the two agents gives the single-agent 2-rank run's losses, and only
    the process with global rank 0 writes the run directory, whichever agent it landed on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "two-nodes"
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "-m", "cadence", "train", "--data", str(runs["data"]), "--micro-batch-size", "2", "--grad-accum-steps", "4",
         "--out", str(out), *COMMON],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    ) for node in (0, 1)]
    results = [agent.communicate(timeout=300) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], [err[-2000:] for _, err in results]
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2 and config["effective_batch_size"] == 16
    two_nodes, one_node = read_metrics(out), read_metrics(runs["ddp"])
    assert [(r["step"], r["targets"]) for r in two_nodes] == [(r["step"], r["targets"]) for r in one_node]
    for mine, theirs in zip(two_nodes, one_node, strict=True):
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * theirs["loss"]
    # One process (global rank 0) speaks for the run: the start line is printed once across both agents.
    assert sum(err.count("effective batch = ") for _, err in results) == 1


def test_two_ranks_measure_the_noise_scale_one_process_measures_for_the_same_windows(tmp_path: Path) -> None:
    """Issue 27: at fixed weights, for the same windows, two DDP ranks report what one process reports. Each rank's
    first micro-batch is a small batch of its own, and the ranks average their two estimates: so window by window the
    two-rank estimates are the mean of one process's over the two orders of the window that put each rank's first
    micro-batch first. With one micro-batch per rank that is the local gradient (taken by DDP's communication hook
    before the all-reduce) against the all-reduced one; with two, the unsynchronised first micro-batch. FSDP2 with
    --sync-every-micro-step measures the reduced first micro-batches of both ranks together (one process: a window
    whose first micro-batch holds both); FSDP2 without it says why it measures nothing. Both ranks agree."""
    from helpers import tiny_model, variable_text_dataset

    from cadence.data import collate
    from cadence.engine.noise_scale import GradientNoiseScale
    from cadence.engine.step import Engine
    from cadence.engine.windows import make_window

    found = run_rank_script("noise_scale_ranks.py", tmp_path / "ranks.json")
    assert json.loads((tmp_path / "ranks.json.rank1").read_text()) == found  # every rank reports the same
    dataset = variable_text_dataset(count=64)
    ids = [window.drawn.ids for window in epoch_windows(dataset, cut=Cut(micro_batch_size=8), grad_accum_steps=1,
                                                        seed=0, epoch=0)]

    def one_process(orders: list[list[list[int]]]) -> tuple[list[tuple[float, float]], list[float | None]]:
        """Per window, the mean over ``orders`` (each the window's micro-batches as sample positions) of one
        process's two estimates at the same weights; and the moving average of those means after each window."""
        model = tiny_model()
        engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1.0,
                        noise_scale=GradientNoiseScale())
        averaged = GradientNoiseScale(ema=0.9)  # the script's EMA
        out, estimates = [], []
        for window_ids in ids:
            terms = []
            for order in orders:
                window = make_window([collate([dataset[window_ids[k]] for k in part]) for part in order])
                engine.step(window)
                terms.append((engine.noise_scale.last.trace, engine.noise_scale.last.grad_sq))
            out.append((sum(t for t, _ in terms) / len(terms), sum(g for _, g in terms) / len(terms)))
            averaged.add_window([1.0, *out[-1]], samples=window.samples, targets=window.targets,
                                tokens=window.tokens)
            estimate = averaged.estimate()
            estimates.append(estimate.sequences if estimate else None)
        return out, estimates

    a, b = [0, 1, 2, 3], [4, 5, 6, 7]  # rank 0's and rank 1's contiguous shares of each window of 8
    references = {
        "ddp_accum1": one_process([[a, b], [b, a]]),
        "ddp_accum2": one_process([[a[:2], a[2:], b[:2], b[2:]], [b[:2], b[2:], a[:2], a[2:]]]),
        "fsdp_sync_every_accum2": one_process([[a[:2] + b[:2], a[2:] + b[2:]]]),
    }
    for name, (reference, estimates) in references.items():
        measured = found[name]["terms"]
        assert len(measured) == len(reference) == 8, name
        for (trace, grad_sq), (want_trace, want_grad_sq) in zip(measured, reference, strict=True):
            scale = abs(want_trace) * 1e-4 + 1e-6
            assert abs(trace - want_trace) <= scale, (name, trace, want_trace)
            # |G|^2 is a difference of two nearly equal terms: compared at the precision of the larger of them.
            assert abs(grad_sq - want_grad_sq) <= 1e-4 * max(abs(want_trace) / 8, abs(want_grad_sq)), name
        assert [e is None for e in found[name]["estimates"]] == [e is None for e in estimates], name
        assert [e for e in found[name]["estimates"] if e] == pytest.approx([e for e in estimates if e], rel=1e-3)
        assert all(e is not None and e > 0 for e in estimates), name  # resolved at every window: a real check
    assert found["ddp_accum1"]["terms"] != found["ddp_accum2"]["terms"]  # different small batches, really
    assert found["fsdp_accum2"]["estimates"] == [None] * 8 and "FSDP2" in found["fsdp_accum2"]["why_none"]
