"""Who holds a lock: the process behind an ``flock`` on a file or directory, named for the user who waits on it.

Both of cadence's locks (one run per run directory; one build per token-store cache) are ``flock`` locks, which the
kernel releases when their holder dies; a live holder that never lets go (a stopped process) is named in the
message, so the user knows what to stop.
"""

from __future__ import annotations

import os
from pathlib import Path


def lock_holder(path: Path) -> str:
    """``pid 1234: cadence train ...`` for the process holding a flock on ``path``, as far as this machine can tell."""
    try:
        inode = os.stat(path).st_ino
        with open("/proc/locks", encoding="ascii", errors="replace") as table:
            for line in table:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234567 0 EOF": the pid, then major:minor:inode
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
                    return f"pid {fields[4]}: {_command(fields[4])}"
    except OSError:
        pass
    return "a process this machine cannot name"


def _command(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            words = handle.read().split(b"\0")
    except OSError:
        return "command unknown"
    text = " ".join(word.decode("utf-8", "replace") for word in words if word)
    return text if len(text) <= 160 else text[:157] + "..."


__all__ = ["lock_holder"]
