"""Restarts under torchrun's elastic agent, the parts that need no second process group (issue 38 item 7): which
directory is a launch's own, what the console says, the lock a restart waits for, the store namespace the ranks of
one start agree on, and ``cadence train --max-restarts``. tests/distributed/test_restarts.py kills ranks for real."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from cadence.cli import main
from cadence.config import TrainConfig
from cadence.distributed.launch import arguments_without_nproc, elastic_config
from cadence.distributed.ranks import ATTEMPT_KEYS, attempt_store
from cadence.engine.step import PartialWindow
from cadence.errors import UsageError
from cadence.training.lock import RunDirectoryLock
from cadence.training.restart import Launch, restart_line
from cadence.training.resume import ResumePoint

LAUNCH = Launch(run_id="job-7", restart=1, max_restarts=3, agents=("node-a:100:5", "node-b:200:6"))


def run_with_launch(root: Path, launch: object) -> Path:
    """A directory holding a config.json as cadence writes it (the fields by which it knows its own), with
    ``launch`` recorded (left out when None)."""
    root.mkdir()
    config = {"effective_batch_size": 8, "grad_accum_steps": 2, "world_size": 2, "data_fingerprint": "sha256:x",
              "versions": {"cadence": "0.1.0"}}
    if launch is not None:
        config["launch"] = launch
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize(("recorded", "own"), [
    ({"run_id": "job-7", "agents": ["node-b:200:6"]}, True),  # an agent of this launch: an earlier attempt of it
    ({"run_id": "job-7", "agents": ["node-a:100:9"]}, False),  # the same pid started again later: another launch
    ({"run_id": "none", "agents": ["node-a:100:5"]}, False),  # another run id
    ({"run_id": "job-7", "agents": "node-a:100:5"}, False),  # not what cadence writes
    (None, False),  # a run started without torchrun's agent
])
def test_a_directory_is_a_launchs_own_only_with_its_run_id_and_one_of_its_agents(tmp_path: Path, recorded: object,
                                                                                 own: bool) -> None:
    out = run_with_launch(tmp_path / "run", recorded)
    assert LAUNCH.owns(out) is own
    assert not LAUNCH.owns(tmp_path / "missing")
    config = TrainConfig(out=out)
    resumed = Launch(**{**LAUNCH.__dict__, "own_run": own}).configured(config)
    assert resumed.resume is own  # its own run is continued as --resume would; anything else runs as given


def test_what_the_console_says_of_each_restart(tmp_path: Path) -> None:
    out = tmp_path / "run"
    own = Launch(**{**LAUNCH.__dict__, "own_run": True})

    def point(step: int, partial: PartialWindow | None = None) -> ResumePoint:
        return ResumePoint(checkpoint=out / "checkpoints" / f"step-{step}", step=step, epoch=0,
                           windows_done_in_epoch=step, kept_rows=[], partial=partial)

    first = Launch(**{**LAUNCH.__dict__, "restart": 0})
    assert restart_line(first, out, out_given=True, start=None, recorded=0) is None  # a first start says nothing
    assert restart_line(None, out, out_given=True, start=None, recorded=0) is None
    cases = [
        (own, point(4), 6, f"restart 1 of 3: resuming {out} from step-4; steps 5-6 are done again"),
        (own, point(4), 5, f"restart 1 of 3: resuming {out} from step-4; step 5 is done again"),
        (own, point(4), 4, f"restart 1 of 3: resuming {out} from step-4; no finished step is done again"),
        (own, point(4, PartialWindow(micro_batches_done=2, loss_sum=1.0)), 4,
         f"restart 1 of 3: resuming {out} from step-4 (mid-window: 2 micro-batch(es) of step 5 already done); no "
         f"finished step is done again"),
        (own, None, 3, f"restart 1 of 3: {out} has no checkpoint yet, so the run starts over from step 0; steps 1-3 "
                       f"are done again"),
        (own, None, 0, f"restart 1 of 3: {out} has no checkpoint yet, so the run starts over from step 0"),
        (LAUNCH, None, 0, f"restart 1 of 3: {out} holds nothing of this launch's run yet, so it starts from step 0"),
        (Launch(**{**own.__dict__, "restart": 0}), point(2), 2,
         f"torchrun restarted the workers (a node joined or left): resuming {out} from step-2; no finished step is "
         f"done again"),
    ]
    for launch, start, recorded, expected in cases:
        assert restart_line(launch, out, out_given=True, start=start, recorded=recorded) == expected
    assert restart_line(LAUNCH, out, out_given=False, start=None, recorded=0) == (
        f"restart 1 of 3: no --out was given, so this attempt starts a new run in {out} from step 0 (give --out to "
        f"have a restart resume its run)")


HOLD = """
import fcntl, os, sys, time
descriptor = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(descriptor, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_a_restart_waits_for_the_lock_of_the_attempt_going_away(tmp_path: Path) -> None:
    """The failed attempt's rank 0 may still hold the run directory (on a network file system, until its lease
    expires): a restart waits for it; a first start is refused at once, naming the holder."""
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out), "0.5"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(UsageError, match="is in use by another cadence run"):
            RunDirectoryLock(out).acquire()
        lock = RunDirectoryLock(out)
        lock.acquire(wait_s=30)  # the holder exits after 0.5 s, and its lock goes with it
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_the_ranks_of_a_start_never_read_a_failed_starts_keys(tmp_path: Path) -> None:
    """torch's elastic agent keeps one store for every start of a launch (pytorch#135712): here the store holds
    what a failed start left (rank 1's question and rank 0's answer, a namespace with its keys). The ranks of the
    new start agree on a namespace of their own all the same."""
    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
    address = ("127.0.0.1", server.port)
    server.set(f"{ATTEMPT_KEYS}/ask/1", "old-token")
    server.set(f"{ATTEMPT_KEYS}/answer/old-token", "old-namespace")
    server.set("old-namespace/has/1", "1")
    found: dict[int, dist.Store] = {}

    def join(rank: int) -> None:
        time.sleep(0.3 * (rank == 1))  # rank 0 first: it meets the old question before the new one
        found[rank] = attempt_store(address, rank, 2, timeout)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    found[0].set("written-by-0", "yes")
    assert found[1].get("written-by-0") == b"yes"  # one namespace, shared by both
    assert not server.check(["old-namespace/written-by-0"])  # and not the failed start's


def test_cadence_passes_max_restarts_to_torchs_agent_and_never_to_the_ranks(tmp_path: Path, capsys) -> None:
    assert elastic_config(2, max_restarts=3, forwarding=True).max_restarts == 3
    assert arguments_without_nproc(["--max-restarts", "2", "--lr", "1", "--max-restarts=4", "--nproc-per-node",
                                    "2"]) == ["--lr", "1"]
    out = tmp_path / "run"
    assert main(["train", "--max-restarts", "1", "--max-steps", "1", "--out", str(out)]) == 2
    assert main(["train", "--nproc-per-node", "1", "--max-restarts", "1", "--max-steps", "1", "--device",
                 "cpu"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "cadence: error: --max-restarts: restarts the ranks that --nproc-per-node starts; under torchrun give "
        "torchrun --max-restarts instead",
        "cadence: error: --max-restarts: needs --out: a restart resumes the run directory --out names (without it "
        "every restart would start a new run in a new directory)",
    ]
    assert not out.exists()
