"""One run at a time in a run directory: an exclusive lock that the operating system releases when the process ends.

Two runs writing the same --out at once would interleave their metrics and overwrite each other's checkpoints, and
both would exit 0. The lock is ``fcntl.flock`` on the run directory itself (a directory can be locked like a file):
held for the whole run, released by the OS when the process exits in any way (SIGKILL included), so no stale lock
can ever block a later --resume, and no lock file is left in the user's directory. The refusal names the holder,
found in ``/proc/locks`` (the kernel's table of held locks) by the directory's inode.

The lock is claimed before the run reads its data or builds its model, and the check that the directory may be
written (empty for a new run, cadence's own for --resume) is made again under it: a check made before the lock
would let a run whose data takes minutes to load train into a directory that a faster second run filled meanwhile.
A directory the claim created is removed again when the run ends without writing anything into it (bad input found
after the claim), so bad input still leaves nothing behind.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

from cadence.config import run_directory_problem
from cadence.distributed.ranks import Ranks, any_rank
from cadence.errors import UsageError
from cadence.process_locks import lock_holder

LOCK_POLL_S = 0.1
"""How often a claim that waits (a restart's) tries the lock again."""


class RunDirectoryLock:
    """``with RunDirectoryLock(run_dir):`` holds the run directory (which must exist) for this process, or raises
    UsageError naming the process that holds it (``where`` is the flag the user gave the directory with)."""

    def __init__(self, run_dir: Path, *, where: str = "--out", created: tuple[Path, ...] = ()) -> None:
        self.run_dir = run_dir
        self.where = where
        self.created = created
        """The directories (``run_dir`` and missing parents, innermost first) made for this run: removed on release
        while they are still empty."""
        self._descriptor: int | None = None

    def acquire(self, *, wait_s: float = 0.0) -> None:
        """Hold the directory, waiting up to ``wait_s`` seconds for a holder to let go (0: refuse at once)."""
        descriptor = os.open(self.run_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(LOCK_POLL_S)
                    continue
            holder = lock_holder(self.run_dir)
            os.close(descriptor)
            raise UsageError.single(self.where, (
                f"{self.run_dir} is in use by another cadence run ({holder}); wait for it to finish or stop it, or "
                f"choose another directory")) from None
        self._descriptor = descriptor

    def release(self) -> None:
        if self._descriptor is not None:
            # Still holding the lock, so no other run can have started writing here: an empty directory this run
            # made is one it never used (it stopped on bad input), and goes, as if it had never been claimed.
            for directory in self.created:
                try:
                    directory.rmdir()  # only ever removes an empty directory
                except OSError:
                    break
            self.created = ()
            os.close(self._descriptor)  # closing the descriptor releases the lock
            self._descriptor = None

    def __enter__(self) -> "RunDirectoryLock":
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


def claim_run_directory(out: Path, *, resume: bool, ranks: Ranks, wait_s: float = 0.0) -> RunDirectoryLock | None:
    """Rank 0 (the one that writes) creates ``out`` if needed, locks it, and only then checks that this run may write
    it; every rank learns whether it could, so that none goes on alone. Returns rank 0's held lock (None on other
    ranks); a refusal is a UsageError naming --out, and leaves nothing created.

    ``wait_s``: how long to wait for another holder to let go. A restart under torchrun waits: the agent stops the
    failed attempt's processes before it starts new ones, and the kernel releases their lock with them, but a lock
    on a network file system held by a node that died lasts until the server's lease on it expires."""
    lock, error = None, None
    if ranks.is_main:
        try:
            lock = _lock_and_check(out, resume=resume, wait_s=wait_s)
        except UsageError as err:
            lock, error = None, err
    if any_rank(error is not None, ranks):
        raise error or UsageError.single("--out", "rank 0 could not hold the run directory")
    return lock


def _lock_and_check(out: Path, *, resume: bool, wait_s: float) -> RunDirectoryLock:
    missing = []
    ancestor = out
    while not ancestor.exists() and ancestor != ancestor.parent:
        missing.append(ancestor)
        ancestor = ancestor.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError.single("--out", f"cannot create {out}: {err.strerror or err}") from None
    lock = RunDirectoryLock(out, created=tuple(missing))
    lock.acquire(wait_s=wait_s)  # refused: another run holds it, and what is in it is that run's, not ours to remove
    problem = run_directory_problem(out, resume=resume)
    if problem:
        lock.release()
        raise UsageError.single("--out", problem)
    return lock
