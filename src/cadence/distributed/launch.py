"""``cadence train --nproc-per-node N``: start N ranks on this machine with torchrun's own launcher.

The same as ``torchrun --standalone --nproc-per-node N -m cadence train ...``: torch's elastic agent starts the
processes, watches them, and stops all of them as soon as one dies (so a dead rank never leaves the others hanging),
and this module turns its report into one clear line.

SIGTERM (a preemption) and SIGINT (Ctrl-C) are passed on to the ranks rather than handled by the agent: the ranks
agree to stop at the next window boundary, save a checkpoint and exit 0, exactly as one process does. (The agent's
own handling would tear them down and end in a SignalException traceback whatever they managed to save.) The agent
starts each rank in a session of its own, so a Ctrl-C at the terminal reaches the launcher alone, and the ranks hear
it from here once, not twice (a second signal stops a rank at once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from cadence.config import DEVICE_CHOICES, TrainConfig, validate
from cadence.data.sources import available_cores
from cadence.errors import Problem, UsageError

NPROC_FLAG = "--nproc-per-node"
RESTARTS_FLAG = "--max-restarts"
LAUNCHER_FLAGS = (NPROC_FLAG, RESTARTS_FLAG)
"""The launcher's own flags, each with a value: the ranks are started without them."""
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""Passed on to the ranks, which stop after the current window (training.resume.StopOnSignal)."""
INTERRUPTED = 130
"""A rank's exit status after a second Ctrl-C (its line says aborted)."""


def arguments_without_nproc(argv: list[str]) -> list[str]:
    """The train command's arguments minus ``--nproc-per-node N`` and ``--max-restarts K`` (the ranks must not
    launch again)."""
    kept: list[str] = []
    skip_next = False
    for argument in argv:
        if skip_next:
            skip_next = False
        elif argument in LAUNCHER_FLAGS:
            skip_next = True
        elif not argument.startswith(tuple(flag + "=" for flag in LAUNCHER_FLAGS)):
            kept.append(argument)
    return kept


def launch(command: str, config: TrainConfig, nproc_per_node: int, rank_arguments: list[str], *,
           max_restarts: int = 0) -> int:
    """``cadence COMMAND`` on ``nproc_per_node`` ranks: validate for that many processes, run them, and return the
    exit status (0; 1 for a failure; 2 for bad input). ``max_restarts``: how many times torch's elastic agent starts
    all the ranks again after one fails (each restart of ``train`` resumes its run directory by itself).

    Bad flags are reported here, once, before any process starts; problems only the ranks can find (a malformed data
    file) are reported by rank 0.
    """
    problems: list[Problem] = []
    try:
        validate(config, world_size=nproc_per_node, launched=True)
    except UsageError as err:
        problems = list(err.problems)
    too_many = nproc_problem(config, nproc_per_node)
    if too_many is not None:
        problems.append(too_many)
    if max_restarts and config.out is None:
        problems.append(Problem(where=RESTARTS_FLAG, message=(
            "needs --out: a restart resumes the run directory --out names (without it every restart would start a "
            "new run in a new directory)")))
    if problems:
        raise UsageError(problems)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun's convention (one thread per rank unless told), but sharing the cores rather than using one:
        # N ranks each spawning a thread per core would oversubscribe the CPU N times.
        os.environ["OMP_NUM_THREADS"] = str(max(1, available_cores() // nproc_per_node))
    forwarding = Path("/proc").is_dir()  # the ranks are found as this process's children in /proc (Linux)
    launch_config = elastic_config(nproc_per_node, max_restarts=max_restarts, forwarding=forwarding)
    previous = {number: signal.signal(number, _forward_to_ranks) for number in FORWARDED_SIGNALS} if forwarding else {}
    try:
        with torch_launcher_logs_held():
            elastic_launch(launch_config, sys.executable)("-m", "cadence", command, *rank_arguments)
    except ChildFailedError as failed:
        codes = {rank: failure.exitcode for rank, failure in failed.failures.items()}
        if len(set(codes.values())) == 1 and next(iter(codes.values())) in (1, 2, INTERRUPTED):
            # Every rank ended the same way (bad input, a failed verify, an agreed divergence, a second Ctrl-C):
            # rank 0 has said why.
            return next(iter(codes.values()))
        what = "training" if command == "train" else command
        print(f"cadence: {what} failed: {describe_failures(codes)}; the other ranks were stopped",
              file=sys.stderr, flush=True)
        return 1
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    return 0


def elastic_config(nproc_per_node: int, *, max_restarts: int, forwarding: bool) -> Any:
    """What torch's elastic agent is given: ``torchrun --standalone --nproc-per-node N --max-restarts K``, checking
    on the ranks every 0.1 s, and (``forwarding``) leaving SIGTERM and SIGINT to :func:`launch`."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node, run_id=f"cadence-{uuid.uuid4().hex[:12]}",
        # torchrun --standalone: a rendezvous on this machine, on a free port.
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
        # Check on the ranks every 0.1 s: a rank that dies brings the others down within seconds.
        monitor_interval=0.1,
        signals_to_handle="SIGHUP,SIGQUIT" if forwarding else "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    )


TORCH_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")
"""The loggers of torch's elastic agent and launcher, which log each rank's exit as an error line."""


class _Held(logging.Handler):
    """Keeps the records it is given instead of printing them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def torch_launcher_logs_held() -> Iterator[list[logging.LogRecord]]:
    """Hold what torch's launcher logs while it runs the ranks. Its lines ("failed (exitcode: 2) local_rank: 0 ...")
    said again, in torch's words, what the ranks and :func:`launch` say in one cadence line, after it. They are
    printed only if the launcher itself fails (not a rank: then its traceback needs them)."""
    held = _Held()
    loggers = [logging.getLogger(name) for name in TORCH_LAUNCHER_LOGGERS]
    propagating = [logger.propagate for logger in loggers]
    for logger in loggers:
        # Not passed up to torch's handler; a handler here also keeps Python's last-resort printer from them.
        logger.addHandler(held)
        logger.propagate = False
    try:
        yield held.records
    except Exception as err:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if not isinstance(err, ChildFailedError):
            for record in held.records:
                print(logging.Formatter("%(levelname)s:%(name)s: %(message)s").format(record), file=sys.stderr)
        raise
    finally:
        for logger, propagate in zip(loggers, propagating, strict=True):
            logger.removeHandler(held)
            logger.propagate = propagate


def nproc_problem(config: TrainConfig, nproc_per_node: int) -> Problem | None:
    """Why this machine cannot run ``nproc_per_node`` ranks, or None: a CUDA run takes one GPU per rank, a CPU run
    at most one rank per usable core. Checked before torch's launcher sees the number: asked for 10**20 processes,
    it grew by gigabytes and ignored SIGTERM; asked for more ranks than cores, it started them all to crawl."""
    if config.device not in DEVICE_CHOICES:
        return None  # validate names the device
    import torch

    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        gpus = torch.cuda.device_count()
        if 0 < gpus < nproc_per_node:  # no GPU at all: validate says --device cuda cannot run here
            return Problem(where=NPROC_FLAG, message=(
                f"{nproc_per_node} is more than the {gpus} GPU(s) of this machine (each rank takes its own GPU); "
                f"give at most {gpus}"))
        return None
    cores = available_cores()
    if nproc_per_node > cores:
        return Problem(where=NPROC_FLAG, message=(
            f"{nproc_per_node} is more than the {cores} CPU core(s) this process may use (a CPU run takes one core "
            f"per rank); give at most {cores}"))
    return None


def _forward_to_ranks(number: int, frame: FrameType | None) -> None:
    """Pass the signal to every child process (the ranks); the agent keeps watching them finish."""
    ranks = child_pids(os.getpid())
    if not ranks and number == signal.SIGINT:
        # No rank started yet (or all gone): nobody to stop at a window boundary, and a Ctrl-C must not be lost.
        raise KeyboardInterrupt
    for pid in ranks:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


def child_pids(parent: int) -> list[int]:
    """Processes whose parent is ``parent``, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:  # after the command name: state, then the parent's pid
            found.append(int(entry.name))
    return found


def describe_failures(codes: dict[int, int]) -> str:
    """'rank 1 was killed by SIGKILL', 'rank 0 exited with status 1 (its message is above)', ...

    Ranks ended by SIGTERM were stopped by the launcher after the first failure: they are named only when nothing
    else failed, so that the line points at the cause."""
    causes = {rank: code for rank, code in codes.items() if code != -signal.SIGTERM} or codes
    parts = []
    for rank, code in sorted(causes.items()):
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            parts.append(f"rank {rank} was killed by {name}")
        else:
            parts.append(f"rank {rank} exited with status {code} (its message is above)")
    return ", ".join(parts)
