"""How each byte-level source becomes a token store: text files, directories, the built-in corpus, JSONL.

Every recipe streams its source (a few megabytes in memory at a time, whatever the size) and hashes the content as
it goes; the hash is the store's fingerprint, which a resume compares. JSONL files are parsed by all cores, each
worker taking a range of lines; text needs no parsing (bytes are the tokens), only a UTF-8 check.
"""

from __future__ import annotations

import codecs
import ctypes
import hashlib
import multiprocessing
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from cadence.data.cache import BuildResult, Recipe
from cadence.data.corpus import corpus_description, corpus_files
from cadence.data.jsonl import RangeResult, TextFields, parse_range, problems_error
from cadence.data.progress import BuildProgress
from cadence.data.store import StoreWriter, token_dtype
from cadence.data.text import directory_files
from cadence.data.tokenizer import ByteTokenizer, Tokenizer
from cadence.errors import Problem, UsageError
from cadence.input_files import os_error_message, read_regular_file_chunks, regular_file_problem

BYTES_TOKENIZER = "bytes"
"""The tokenizer identity of byte-level stores (ids 0..255, what the built-in models read)."""

JSONL_RANGE_BYTES = 8 << 20
"""Bytes of JSONL per worker task: small enough to balance the cores and show progress, large enough that a task
is not dominated by its start-up."""


def available_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _stat_identity(files: list[tuple[str, Path]]) -> list[Any]:
    """Relative name, size, mtime, ctime and inode of each file: a rewrite changes at least one of them (ctime
    even when a tool restores the mtime)."""
    identity = []
    for name, path in files:
        info = path.stat()
        identity.append([name, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino])
    return identity


# ------------------------------------------------------------------------------------------------ text
def _copy_text(writer: StoreWriter, path: Path, digest: Any, progress: BuildProgress) -> int | None:
    """Append one file's bytes to the store while checking they are UTF-8 and hashing them; returns the offset of
    the first bad byte (the bytes written are then the caller's to drop), or None when the file is text."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    consumed = 0
    for chunk in read_regular_file_chunks(path, where="--data"):
        pending = len(decoder.getstate()[0])
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError as error:
            return consumed - pending + error.start
        writer.write_tokens(chunk)
        digest.update(chunk)
        consumed += len(chunk)
        progress.advance(len(chunk))
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as error:
        return consumed - len(decoder.getstate()[0]) + error.start
    return None


def text_recipe(path: Path, stream: IO[str] | None) -> Recipe:
    """A .txt file, or every UTF-8 text file under a directory joined with ``b"\\n"`` (see :mod:`cadence.data.text`
    for which files count), as one token stream."""
    if path.is_dir():
        files = [(path_.relative_to(path).as_posix(), path_) for path_ in directory_files(path)]
    else:
        problem = regular_file_problem(path)
        if problem is not None:
            raise UsageError.single("--data", problem)
        files = [("", path)]
    kind = "directory" if path.is_dir() else "text file"

    def build(writer: StoreWriter) -> BuildResult:
        digest = hashlib.sha256()
        progress = BuildProgress(f"reading {path}", sum(p.stat().st_size for _, p in files), stream)
        included = 0
        for _, file in files:
            start, before = writer.num_tokens, digest.copy()
            if included:
                writer.write_tokens(b"\n")
                digest.update(b"\n")
            bad = _copy_text(writer, file, digest, progress)
            if bad is not None and not path.is_dir():
                raise UsageError.single("--data", f"{path} is not UTF-8 text (invalid byte at offset {bad}); "
                                                  f"give a UTF-8 .txt file")
            if bad is not None or writer.num_tokens == start + (1 if included else 0):
                # Binary or empty: not the user's text. Its bytes (and separator) come out again.
                writer.truncate_tokens(start)
                digest = before
                continue
            included += 1
        progress.close()
        if not included:
            raise UsageError.single("--data", (
                f"directory {path} has no non-empty UTF-8 text files (binary and hidden files are skipped)"
                if path.is_dir() else f"{path} is empty; it needs text to train on"))
        return BuildResult(fingerprint="sha256:" + digest.hexdigest(),
                           meta={"description": f"{kind} {path}", "files": included})

    identity = _stat_identity(files)
    return Recipe(kind="stream", source=f"{kind} {path.resolve()}", stat_identity=[str(path.resolve()), identity],
                  tokenizer=BYTES_TOKENIZER, vocab_size=256, options={}, build=build,
                  source_bytes=sum(entry[1] for entry in identity))


def corpus_recipe(stream: IO[str] | None) -> Recipe:
    """The built-in corpus (the standard library's source, files joined with ``b"\\n"``) as one token stream."""
    files = corpus_files()
    root = files[0].parent if files else Path()

    def build(writer: StoreWriter) -> BuildResult:
        digest = hashlib.sha256()
        progress = BuildProgress("reading the built-in corpus", sum(p.stat().st_size for p in files), stream)
        for index, file in enumerate(files):
            if index:
                writer.write_tokens(b"\n")
                digest.update(b"\n")
            try:
                content = file.read_bytes()
            except OSError as error:
                raise UsageError.single("--data", os_error_message(file, error)) from None
            writer.write_tokens(content)
            digest.update(content)
            progress.advance(len(content))
        progress.close()
        return BuildResult(fingerprint="sha256:" + digest.hexdigest(), meta={"description": corpus_description()})

    identity = _stat_identity([(file.as_posix(), file) for file in files])
    return Recipe(kind="stream", source=f"built-in corpus {root}", stat_identity=identity,
                  tokenizer=BYTES_TOKENIZER, vocab_size=256, options={}, build=build,
                  source_bytes=sum(entry[1] for entry in identity))


# ------------------------------------------------------------------------------------------------ JSONL
def _line_ranges(path: Path, size: int, start: int, range_bytes: int) -> list[tuple[int, int]]:
    """Cut ``[start, size)`` into ranges of about ``range_bytes`` that end just after a line break."""
    bounds = [start]
    with open(path, "rb") as handle:
        while bounds[-1] + range_bytes < size:
            offset = bounds[-1] + range_bytes
            handle.seek(offset)
            cut = -1
            while cut < 0:  # a line can be long (a 1 MB document): read on until it ends
                block = handle.read(1 << 16)
                if not block:
                    break
                found = block.find(b"\n")
                cut = offset + found + 1 if found >= 0 else -1
                offset += len(block)
            if cut < 0 or cut >= size:
                break
            bounds.append(cut)
    bounds.append(size)
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a] or [(start, start)]


_Task = tuple[Path, int, int, Path, TextFields, Tokenizer, str]


def _parse_task(task: _Task) -> RangeResult:
    return parse_range(*task)


def _results(tasks: list[_Task], workers: int) -> Iterator[RangeResult]:
    """Each range's result in file order: in this process for one range, by ``workers`` processes otherwise."""
    if workers <= 1 or len(tasks) == 1:
        yield from map(_parse_task, tasks)
        return
    # fork: the workers need nothing but this module's functions, and start in milliseconds (spawn would import
    # torch again in each). They touch no torch state, so forking a process that has used torch is safe here.
    with multiprocessing.get_context("fork").Pool(min(workers, len(tasks)), initializer=_quiet_worker) as pool:
        yield from pool.imap(_parse_task, tasks)


def _quiet_worker() -> None:
    """A parsing worker leaves signals to its parent: Ctrl-C is the parent's to handle (it ends the pool), and a
    worker whose parent is gone (SIGTERM, SIGKILL) dies with it instead of finishing its range and printing a
    BrokenPipeError traceback for a result nobody reads."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux): killed the moment the parent dies
    except (OSError, AttributeError):  # not Linux: the pool's own shutdown still ends the workers
        pass
    if os.getppid() == 1:  # the parent died before the line above took effect
        os._exit(0)


def jsonl_recipe(path: Path, stream: IO[str] | None, *, tokenizer: Tokenizer | None = None,
                 fields: TextFields | None = None, workers: int | None = None,
                 range_bytes: int = JSONL_RANGE_BYTES) -> Recipe:
    """A .jsonl file of text or prompt/completion rows, one example per line (:mod:`cadence.data.jsonl`'s rules),
    read with ``tokenizer`` (None: bytes); every bad line is reported as ``file:line`` and nothing is stored.

    Bytes are parsed by ``workers`` processes in parallel, ranges of ``range_bytes``; a real tokenizer encodes in
    this process, a batch of rows per call (a fast tokenizer is parallel itself, and a forked copy of one that has
    already run would give up its threads)."""
    tokenizer = tokenizer or ByteTokenizer()
    fields = fields or TextFields()
    byte_level = tokenizer.identity == "bytes"
    problem = regular_file_problem(path)
    if problem is not None:
        raise UsageError.single("--data", f"{problem}; give a .jsonl file with one JSON object per line")
    dtype = token_dtype(tokenizer.vocab_size).name

    def build(writer: StoreWriter) -> BuildResult:
        digest = hashlib.sha256()
        head = b""
        for chunk in read_regular_file_chunks(path, where="--data"):
            head = head or chunk[:3]
            digest.update(chunk)
        size = path.stat().st_size
        # A UTF-8 byte order mark (some Windows editors write one) is not part of the first record.
        start = 3 if head.startswith(codecs.BOM_UTF8) else 0
        parts = writer.directory / "parts"
        parts.mkdir()
        tasks: list[_Task] = [(path, a, b, parts / f"{i:06d}", fields, tokenizer, dtype)
                              for i, (a, b) in enumerate(_line_ranges(path, size, start, range_bytes))]
        progress = BuildProgress(f"tokenising {path}", size, stream)
        problems: list[Problem] = []
        problem_count, line_base = 0, 0
        for task, result in zip(tasks, _results(tasks, (workers or available_cores()) if byte_level else 1)):
            problem_count += result.problem_count
            problems += [Problem(where=f"{path}:{line_base + line}", message=message)
                         for line, message in result.problems]
            if not problem_count:
                rows = np.fromfile(task[3].with_suffix(".idx"), dtype="<i8").reshape(-1, 4)
                rows[:, 0] += writer.append_token_file(task[3].with_suffix(".tok"))
                rows[:, 3] += line_base
                writer.add_rows("train", rows)
            for suffix in (".tok", ".idx"):
                task[3].with_suffix(suffix).unlink(missing_ok=True)
            line_base += result.newlines
            progress.advance(task[2] - task[1], result.examples)
        progress.close()
        parts.rmdir()
        if problem_count:
            raise problems_error(path, problems, problem_count)
        if not writer.rows("train"):
            raise UsageError.single("--data", f"{path} has no examples (it is empty or only blank lines)")
        return BuildResult(fingerprint="sha256:" + digest.hexdigest(),
                           meta={"description": f"JSONL file {path}", "source_format": "jsonl", "path": str(path),
                                 "tokenizer_name": tokenizer.name})

    identity = _stat_identity([("", path)])
    options: dict[str, Any] = {}
    if not fields.is_default():
        options["fields"] = [fields.text, fields.prompt, fields.completion]
    if tokenizer.eos_id is not None and not getattr(tokenizer, "eos_on_text", True):
        # The end of sequence after each completion is part of the tokens, so of the store's key: a store of this
        # file built before completions ended with it is not reused.
        options["completion_eos"] = tokenizer.eos_id
    if tokenizer.bos_id is not None:
        options["bos_id"] = tokenizer.bos_id  # how splits_from_store knows that examples start with a BOS to keep
    return Recipe(kind="examples", source=f"JSONL file {path.resolve()}", stat_identity=[str(path.resolve()), identity],
                  tokenizer=tokenizer.identity, vocab_size=tokenizer.vocab_size, options=options, build=build,
                  source_bytes=identity[0][1])


__all__ = ["BYTES_TOKENIZER", "available_cores", "corpus_recipe", "jsonl_recipe", "text_recipe"]
