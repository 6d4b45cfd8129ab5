"""Plain text sources (a ``.txt`` file or a directory) and packing bytes into fixed-length sequences."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np

from cadence.data.batching import TokenDataset
from cadence.data.store import TokenFile
from cadence.data.store_datasets import PackedSequences
from cadence.errors import Problem, UsageError
from cadence.input_files import os_error_message, read_regular_file


def pack_bytes(data: bytes, seq_len: int) -> TokenDataset:
    """Cut ``data`` into examples of ``seq_len`` inputs and ``seq_len`` next-byte labels.

    Chunks of ``seq_len + 1`` bytes start every ``seq_len`` bytes, so consecutive chunks share one byte (the last
    label of one is the first input of the next) and every byte after the first is a target exactly once. The
    final incomplete chunk is dropped: padding it would make one example unlike all others for a few bytes.
    """
    return pack_tokens(np.frombuffer(bytes(data), dtype=np.uint8), seq_len)


def pack_tokens(tokens: np.ndarray | TokenFile, seq_len: int) -> PackedSequences:
    """:func:`pack_bytes` over a token array or a store's token file: nothing is read until an example is."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    needed = seq_len + 1
    if len(tokens) < needed:
        raise UsageError.single(
            "--data",
            f"the text has {len(tokens)} bytes, but one sequence of --seq-len {seq_len} needs {needed} "
            f"(--seq-len + 1); use a smaller --seq-len or more text",
        )
    return PackedSequences(tokens, seq_len)


def _is_hidden(relative: Path) -> bool:
    """Whether any component of a relative path starts with '.' (``.git``, ``.DS_Store``, editor files)."""
    return any(part.startswith(".") for part in relative.parts)


def _read_utf8(path: Path) -> bytes | None:
    """The file's bytes if they decode as UTF-8, else None (a binary file). An unreadable file is a UsageError."""
    content = read_regular_file(path, where="--data")
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return content


def directory_files(root: Path) -> list[Path]:
    """Regular files under ``root``, recursively, hidden ones excluded, sorted by '/'-separated relative path.

    Named pipes, devices and sockets are not text to train on and are passed over, like hidden files; a directory or
    file that cannot be read is a UsageError naming it (all of them at once), never silently left out."""
    found: list[tuple[str, Path]] = []
    problems: list[Problem] = []

    def unreadable(err: OSError) -> None:
        problems.append(Problem(where="--data", message=os_error_message(Path(err.filename or root), err)))

    for directory, subdirs, files in os.walk(root, onerror=unreadable):
        subdirs[:] = sorted(name for name in subdirs if not name.startswith("."))
        for name in files:
            path = Path(directory) / name
            relative = path.relative_to(root)
            if _is_hidden(relative):
                continue
            try:
                mode = os.stat(path).st_mode
            except OSError as err:
                problems.append(Problem(where="--data", message=os_error_message(path, err)))
                continue
            if stat.S_ISREG(mode):
                found.append((relative.as_posix(), path))
    if problems:
        raise UsageError(problems)
    # A fixed order (not the file system's) makes the packed data identical on every machine.
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def read_text_source(path: Path) -> bytes:
    """The bytes of a UTF-8 text file, or of every UTF-8 text file under a directory joined with ``b"\\n"``.

    In a directory, files that are not valid UTF-8 (images, archives, bytecode) and empty files are skipped, as are
    hidden files and directories (names starting with '.', e.g. ``.git``), which are not the user's text.
    """
    if not path.exists():
        raise UsageError.single("--data", f"{path} does not exist; give a .txt file, a directory or a .jsonl file")
    if path.is_dir():
        parts = [content for file in directory_files(path) if (content := _read_utf8(file))]
        if not parts:
            raise UsageError.single(
                "--data", f"directory {path} has no non-empty UTF-8 text files (binary and hidden files are skipped)"
            )
        return b"\n".join(parts)
    content = read_regular_file(path, where="--data")
    if not content:
        raise UsageError.single("--data", f"{path} is empty; it needs text to train on")
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError.single(
            "--data", f"{path} is not UTF-8 text (invalid byte at offset {error.start}); give a UTF-8 .txt file"
        ) from None
    return content
