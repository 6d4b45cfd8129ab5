"""The built-in corpus: the Python standard library's own source, which every Python install has.

It needs no download and no data set, is tens of megabytes of real text, and is read in a fixed order, so a run
without ``--data`` is reproducible on any machine with the same Python version.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

_SKIPPED_DIRS = frozenset({"site-packages", "__pycache__"})
"""Directories under the stdlib that are not the standard library's source (installed packages, bytecode)."""


def stdlib_root() -> Path:
    """The directory that holds the standard library's ``.py`` files."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files() -> list[Path]:
    """Every ``*.py`` file under the stdlib (``site-packages`` excluded), sorted by '/'-separated relative path.

    ``os.walk`` does not follow symbolic links to directories, so a link cannot pull in outside files or loop.
    """
    root = stdlib_root()
    found: list[tuple[str, Path]] = []
    for directory, subdirs, files in os.walk(root):
        # Pruning in place stops os.walk from descending into installed packages at all (faster, and exact).
        subdirs[:] = [name for name in subdirs if name not in _SKIPPED_DIRS]
        for name in files:
            if name.endswith(".py"):
                path = Path(directory) / name
                found.append((path.relative_to(root).as_posix(), path))
    # Sorting by the relative path as a string (not by os.walk order, which depends on the file system) is what
    # makes the corpus identical on every machine with the same Python version.
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def corpus_bytes(max_bytes: int | None = None) -> bytes:
    """The corpus: the files of :func:`corpus_files` read as bytes, joined with ``b"\\n"``.

    With ``max_bytes``, reading stops as soon as that many bytes are gathered and the result is cut to exactly
    ``max_bytes`` (a prefix of the full corpus, so it is as deterministic as the full one).
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
    parts: list[bytes] = []
    size = 0
    for index, path in enumerate(corpus_files()):
        if max_bytes is not None and size >= max_bytes:
            break
        if index > 0:
            parts.append(b"\n")
            size += 1
        content = path.read_bytes()
        parts.append(content)
        size += len(content)
    data = b"".join(parts)
    return data if max_bytes is None else data[:max_bytes]


def corpus_description() -> str:
    """A one-line description for reports, e.g. ``"Python 3.11 standard library source, 1790 files"``."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"Python {version} standard library source, {len(corpus_files())} files"
