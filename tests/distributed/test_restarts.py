"""Restarts that resume (issue 38 item 7): under ``torchrun --max-restarts K`` a rank killed mid-run costs only the
steps since the newest checkpoint, and the run ends by itself with the uninterrupted run's losses and weights.

The ranks are killed for real, from here, at moments read off the run directory as it grows (a metrics row, a
checkpoint folder): nothing in cadence knows it is being tested.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import rank_pids, relative_l2, write_jsonl
from safetensors.torch import load_file

from cadence.training.run_dir import read_metrics

STEPS = 10
# A checkpoint every 4 steps leaves 3 steps between the moment a kill is decided and the next checkpoint.
ARGS = ["--seq-len", "32", "--micro-batch-size", "2", "--grad-accum-steps", "2", "--max-steps", str(STEPS),
        "--lr", "3e-3", "--warmup-steps", "2", "--val-fraction", "0", "--checkpoint-every", "4", "--too-long",
        "truncate"]

# Real gloo processes, each case a minute of two ranks: make test-slow.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")]


def steps_recorded(out: Path) -> list[int]:
    try:
        return [row["step"] for row in read_metrics(out)]
    except (OSError, ValueError):  # not written yet, or caught between the truncation and the rewrite
        return []


def kill_when(agent: subprocess.Popen[str], ready, rank: int, *, besides: set[int]) -> set[int]:  # type: ignore[no-untyped-def]
    """SIGKILL rank ``rank`` of the agent's current workers (none of the pids ``besides``) once ``ready()``;
    returns the pids of the workers it found."""
    deadline = time.monotonic() + 120
    while True:
        assert agent.poll() is None, agent.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the moment to kill never came"
        pids = rank_pids(agent.pid)
        if sorted(pids) == [0, 1] and not set(pids.values()) & besides and ready():
            os.kill(pids[rank], signal.SIGKILL)
            return set(pids.values())
        time.sleep(0.01)


def under_restarts(max_restarts: int, train_args: list[str], kills: Callable[[subprocess.Popen[str]], object]) -> str:
    """``cadence train TRAIN_ARGS`` on 2 ranks under ``torchrun --max-restarts MAX_RESTARTS``, ``kills(agent)`` run
    while it trains; the agent must end with exit 0. Returns its standard error."""
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
         str(max_restarts), "--monitor-interval", "0.1", "-m", "cadence", "train", *train_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        kills(agent)
        _, stderr = agent.communicate(timeout=300)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    assert agent.returncode == 0, stderr[-4000:]
    return stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The data, and the run nothing interrupts: 2 ranks, 10 steps."""
    root = tmp_path_factory.mktemp("restarts")
    data = write_jsonl(root / "examples.jsonl")
    out = root / "uninterrupted"
    result = subprocess.run([sys.executable, "-m", "cadence", "train", "--nproc-per-node", "2", "--data", str(data),
                             "--out", str(out), *ARGS], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return data, out


def test_ranks_killed_under_max_restarts_resume_by_themselves_to_the_uninterrupted_run(
        uninterrupted: tuple[Path, Path], tmp_path: Path) -> None:
    """Acceptance (issue 38): two kills under ``torchrun --max-restarts 2``. Rank 1 dies after step 1, before any
    checkpoint: the restart starts over from step 0 in the same directory. Then rank 0 (the one holding the run
    directory's lock) dies after step 5, past the checkpoint of step 4: the restart resumes from step-4 and does
    step 5 (and whatever else had finished) again. No --resume is typed, and the run ends equal to the uninterrupted
    one."""
    data, reference = uninterrupted
    out = tmp_path / "run"
    def kills(agent: subprocess.Popen[str]) -> None:
        first = kill_when(agent, lambda: 1 in steps_recorded(out), 1, besides=set())
        kill_when(agent, lambda: (out / "checkpoints" / "step-4").is_dir() and 5 in steps_recorded(out), 0,
                  besides=first)

    stderr = under_restarts(2, ["--data", str(data), "--out", str(out), *ARGS], kills)
    lines = [line for line in stderr.splitlines() if line.startswith("restart ")]
    print("\n".join(lines))
    assert len(lines) == 2, stderr[-4000:]
    assert re.fullmatch(rf"restart 1 of 2: {re.escape(str(out))} has no checkpoint yet, so the run starts over from "
                        r"step 0; (step 1 is|steps 1-[23] are) done again", lines[0]), lines[0]
    assert re.fullmatch(rf"restart 2 of 2: resuming {re.escape(str(out))} from step-4; (step 5 is|steps 5-[67] are) "
                        r"done again", lines[1]), lines[1]

    rows, expected = read_metrics(out), read_metrics(reference)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # every step once: redone rows replaced
    worst = max(abs(mine["loss"] - theirs["loss"]) / theirs["loss"] for mine, theirs in zip(rows, expected, strict=True))
    weights = relative_l2(load_file(out / "model.safetensors"), load_file(reference / "model.safetensors"))
    print(f"largest relative loss difference {worst:.1e}, weights {weights:.1e}")
    assert worst <= 1e-6 and weights <= 1e-6
    assert json.loads((out / "config.json").read_text())["launch"]["restart"] == 2


def test_a_restart_continues_a_mid_window_checkpoint(uninterrupted: tuple[Path, Path], tmp_path: Path) -> None:
    """--checkpoint-mid-window on 2 ranks: a SIGTERM after micro-batch 1 of step 6 leaves a mid-window checkpoint
    (each rank's own gradients of that window). The run resumed under --max-restarts 1 loses rank 1 before its next
    checkpoint: the restart continues the mid-window checkpoint again, from its micro-batch, and the run still ends
    bitwise the uninterrupted one."""
    data, reference = uninterrupted
    out = tmp_path / "run"
    stopped = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).resolve().parent / "mid_window_ranks.py"), str(tmp_path / "counts"), "5", "1", "--",
         "train", "--data", str(data), "--out", str(out), "--checkpoint-mid-window", *ARGS],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    info = json.loads((out / "checkpoints" / "step-5" / "checkpoint.json").read_text())
    assert info["mid_window"]
    stderr = under_restarts(1, ["--data", str(data), "--out", str(out), "--checkpoint-mid-window", "--resume", *ARGS],
                            lambda agent: kill_when(agent, lambda: 6 in steps_recorded(out), 1, besides=set()))
    lines = [line for line in stderr.splitlines() if line.startswith("restart ")]
    print("\n".join(lines))
    assert len(lines) == 1 and re.fullmatch(
        rf"restart 1 of 1: resuming {re.escape(str(out))} from step-5 \(mid-window: 1 micro-batch\(es\) of step 6 "
        r"already done\); (step 6 is|steps 6-7 are) done again", lines[0]), stderr[-4000:]
    rows, expected = read_metrics(out), read_metrics(reference)
    assert [(row["step"], row["loss"]) for row in rows] == [(row["step"], row["loss"]) for row in expected]
    assert relative_l2(load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")) == 0.0
