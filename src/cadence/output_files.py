"""Writing cadence's own files so that a crash never leaves half of one: the one atomic writer of the package.

A file written once (config.json, summary.json, a store's store.json, a plan, a report, a checkpoint's manifest) is
written to a temporary sibling, flushed and fsynced, then renamed over its name: a reader sees the old file or all of
the new one, never a part, and a write that fails (a full disk) removes its temporary file. Files that are written
by another library (safetensors) are fsynced here before their rename, and a rename is made durable by fsyncing the
directory that holds it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` so that ``path`` holds either the old content or all of the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; cadence's files are meant to be read by others
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any, *, indent: int = 2, sort_keys: bool = False) -> None:
    """``obj`` as JSON, atomically; non-finite floats become null (JSON has no inf/nan, and other tools reject the
    invalid JSON that Python would write for them)."""
    text = json.dumps(finite(obj), indent=indent, sort_keys=sort_keys) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, through dicts, lists and tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def fsync_file(path: Path) -> None:
    """Flush a file that another library wrote to the disk (before it is renamed into place)."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_directory(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory descriptors
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["atomic_write_bytes", "atomic_write_json", "finite", "fsync_directory", "fsync_file"]


def timestamped_directory(root: Path, now: datetime) -> Path:
    """A directory name under ``root`` for an output the user named no place for: ``root/<date>-<time>``, or with
    ``-2``, ``-3``, ... after it when that name is taken (two commands started in the same second, as a script runs
    them, would otherwise collide and the second be refused)."""
    stem = now.strftime("%Y%m%d-%H%M%S")
    candidate, suffix = root / stem, 1
    while candidate.exists():
        suffix += 1
        candidate = root / f"{stem}-{suffix}"
    return candidate
