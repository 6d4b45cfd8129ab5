"""Reading the user's input files without hanging, exhausting memory or raising a traceback.

Everything cadence reads on a user's say-so (``--data``, ``--config``) goes through here, as one class of rules rather
than one fix per symptom:

- regular files only: a named pipe would block forever and ``/dev/zero`` (or a link to it) would read until memory
  runs out, so the file is opened without blocking and its kind checked on the open descriptor (no race between a
  check and the open);
- bounded reads where a size limit makes sense (a configuration file is small);
- every OS error (permission denied, a file that vanished, an I/O error) is one line naming the flag and the file.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from cadence.errors import UsageError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def os_error_message(path: Path, err: OSError) -> str:
    """``PATH cannot be read: permission denied`` and the like, for any OS error."""
    reason = (err.strerror or str(err)).lower() if not isinstance(err, PermissionError) else "permission denied"
    return f"{path} cannot be read: {reason}"


def not_regular(mode: int) -> str | None:
    """What a file of this mode is, when it is not a regular file (None when it is one)."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


@contextlib.contextmanager
def _opened(path: Path, *, where: str, limit: int | None = None) -> Iterator[tuple[int, os.stat_result]]:
    """(descriptor, status) of ``path`` opened for reading, once it is known to be a regular file (within
    ``limit`` bytes); every refusal and every OS error, while opening or while the caller reads, is a UsageError."""
    problem = regular_file_problem(path, limit=limit)
    if problem is not None:
        raise UsageError.single(where, problem)
    try:
        # O_NONBLOCK: opening a named pipe with no writer would otherwise wait forever, before any check could run.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise UsageError.single(where, os_error_message(path, err)) from None
    try:
        info = os.fstat(descriptor)
        kind = not_regular(info.st_mode)  # checked again on what was opened: the path may have changed since
        if kind is not None:
            raise UsageError.single(where, f"{path} is {kind}, not a regular file")
        if limit is not None and info.st_size > limit:
            raise UsageError.single(where, f"{path} is {info.st_size:,} bytes; at most {limit:,} are read")
        yield descriptor, info
    except OSError as err:
        raise UsageError.single(where, os_error_message(path, err)) from None
    finally:
        os.close(descriptor)


def read_regular_file(path: Path, *, where: str, limit: int | None = None) -> bytes:
    """The bytes of ``path`` (a regular file, or a link to one); ``UsageError`` naming ``where`` otherwise.

    ``limit``: the most bytes the file may hold; a larger file is refused before it is read."""
    with _opened(path, where=where, limit=limit) as (descriptor, info):
        chunks, total = [], 0
        bound = info.st_size if limit is None else limit
        while True:
            chunk = os.read(descriptor, max(1 << 20, bound + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if limit is not None and total > limit:  # it grew while being read
                raise UsageError.single(where, f"{path} holds more than {limit:,} bytes; at most {limit:,} are read")
        return b"".join(chunks)


def regular_file_problem(path: Path, *, limit: int | None = None) -> str | None:
    """Why ``path`` cannot be read as a regular file (None when it can), from its status, without opening it."""
    try:
        info = os.stat(path)  # follows links: a link to a regular file is fine, a link to /dev/zero is not
    except FileNotFoundError:
        return f"{path} does not exist" if not os.path.lexists(path) else f"{path} is a broken link"
    except OSError as err:
        return os_error_message(path, err)
    kind = not_regular(info.st_mode)
    if kind is not None:
        return f"{path} is {kind}, not a regular file"
    if limit is not None and info.st_size > limit:
        return f"{path} is {info.st_size:,} bytes; at most {limit:,} are read"
    return None



def read_regular_file_chunks(path: Path, *, where: str, chunk_bytes: int = 4 << 20,
                             start: int = 0, end: int | None = None) -> Iterator[bytes]:
    """The bytes of ``path`` (a regular file) from ``start`` to ``end`` in chunks, never the whole file at once:
    a 3 GB text is tokenised with a few megabytes in memory. The same rules and messages as :func:`read_regular_file`."""
    with _opened(path, where=where) as (descriptor, _):
        position = start
        while end is None or position < end:
            chunk = os.pread(descriptor, chunk_bytes if end is None else min(chunk_bytes, end - position), position)
            if not chunk:
                break
            position += len(chunk)
            yield chunk
