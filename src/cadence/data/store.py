"""The token store: tokens in one flat file, examples as rows of a memory-mapped index, never as Python objects.

A store is a directory::

    store.json    what it holds: kind, token dtype, counts, the source's content fingerprint, tokenizer, options
    tokens.bin    every token id, little-endian, in the smallest dtype the vocabulary fits (uint8, uint16, uint32)
    train.idx     int64 rows (offset, length, loss_start, row) per example; "examples" stores only
    val.idx       the same for a source's own validation split, when it has one
    train.spans   int64 rows (example, start, end), in example order: the trained tokens of examples whose loss is
                  not one run from ``loss_start`` to the end (a chat's assistant turns); "examples" stores only
    val.spans     the same for the validation split

Two kinds:

- ``stream``: one long text (a .txt file, a directory, the built-in corpus). Examples are cut from it at training
  time by arithmetic (:class:`~cadence.data.store_datasets.PackedSequences`), so one store serves every ``--seq-len``.
- ``examples``: one example per row of the source (JSONL, datasets). Example i is
  ``tokens[offset : offset + length]`` untruncated; position j predicts token j + 1 and carries a loss only when
  ``j + 1 >= loss_start``. What happens to an example longer than ``--seq-len`` is decided when the examples are read
  (:mod:`cadence.data.too_long`, :class:`~cadence.data.store_datasets.StoredExamples`), so again one store serves every ``--seq-len``. ``row``
  is the source's line (JSONL) or row number, for messages. An example listed in the split's spans file is trained on
  exactly its spans instead: token k of it is a target (of position k - 1) when ``start <= k < end`` for one of its
  rows (any number of them); its ``loss_start`` is then its first span's start, so that truncation, which never
  drops the token before the first target, treats it as any other example.

``store.json`` is written last, and a store only becomes visible by renaming its finished directory into place, so a
build killed at any point leaves nothing that :meth:`TokenStore.open` accepts.

A store is verified before it is trusted, in two parts:

- What keeps a run from crashing, checked at every open and never skipped: store.json's fields, each file's size,
  and every index row (offset and length inside the token file, a length of at least one token, the loss starting
  within the example), a pass over the memory-mapped index in blocks (32 bytes per example). Token ids are checked
  where they are read: every slice :class:`TokenFile` reads is checked against the vocabulary (a ``max`` over the
  micro-batch's few thousand ids), so a crafted store ends in one line (:class:`TokensOutOfRange`), never in an
  embedding's index error.
- What proves the content is the one built: the SHA-256 of every file, recorded in store.json at build time, and a
  scan of every token id, streamed (about 1 GB/s, so a 3 GB store opens in seconds).

The second part is skipped when a memo says it passed and nothing changed since. ``.verified.json`` holds the ``stat``
identity of the store's files (size, mtime, ctime, inode, device) as they were when they passed, and an HMAC-SHA256 of
those identities and of store.json's checksum table under a per-user secret key (``~/.cache/cadence/store-memo.key``:
32 random bytes, created 0600 by the first open, used only if it is a regular file of this user that nobody else may
read or write). So a memo cannot be written by hand (no key), copied from another store (other inodes) or kept
across a change (any write moves a file's ctime, a time no user can set back); another user's memo, made under another
key, does not match either, and then the store is simply verified again. Without a usable key (a read-only home) no
memo is trusted and every open verifies. A store that fails is :class:`StoreDamaged`: the cache rebuilds it from its
source, ``--data STORE`` refuses it naming the store.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from cadence.errors import CadenceFailure
from cadence.output_files import atomic_write_json

STORE_FORMAT = "cadence-token-store"
"""The ``format`` field of every store.json: how a directory given to ``--data`` is recognised as a store."""

STORE_VERSION = 3
"""Bumped whenever the layout or the meaning of a field changes, so that an old store is rebuilt, never misread.
(2: store.json holds the SHA-256 of every file; 3: "examples" stores have a spans file per split.)"""

META_FILE = "store.json"
TOKENS_FILE = "tokens.bin"
VERIFIED_FILE = ".verified.json"
"""The stat identity of the store's files when their checksums were last found right, under an HMAC (see the module
docstring)."""
MEMO_KEY_FILE = "store-memo.key"
"""The per-user key of the memos, in cadence's cache directory (:func:`cadence_cache_root`)."""
MEMO_KEY_BYTES = 32
MEMO_LIMIT = 1 << 20
"""The most bytes of a memo read: a store has a handful of files."""
INDEX_BLOCK_ROWS = 1 << 20
"""Index rows checked at a time at every open: 32 MiB of index, whatever the store's size."""
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
_HASH_CHUNK = 8 << 20
INDEX_COLUMNS = 4
"""offset, length, loss_start, row."""
SPAN_COLUMNS = 3
"""example (its row number in the split's index), start, end: token positions within the example, end excluded."""

StoreKind = Literal["stream", "examples"]


class StoreDamaged(Exception):
    """A store directory that is not a complete store of this version (a cache rebuilds it; ``--data`` refuses it)."""


class TokensOutOfRange(StoreDamaged, CadenceFailure):
    """A token id read from a store is outside its vocabulary: the store changed, or was crafted, after it was
    verified. A StoreDamaged (train stops with what it kept) and a CadenceFailure (any other command prints its one
    line and exits 1), never an embedding's index error."""


def cadence_cache_root() -> Path:
    """``~/.cache/cadence``: cadence's per-user cache (the token stores' default cache is its ``data`` folder)."""
    return Path.home() / ".cache" / "cadence"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below ``vocab_size``: bytes stay 1 byte per token, and a
    50k-token BPE vocabulary takes 2 bytes per token instead of the 8 of int64."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"a vocabulary of {vocab_size} ids does not fit 32 bits")


def index_file(split: str) -> str:
    return f"{split}.idx"


def spans_file(split: str) -> str:
    return f"{split}.spans"


def store_files(kind: str, splits: Sequence[str]) -> list[str]:
    """The files of a store besides store.json (each has its SHA-256 in store.json)."""
    spans = [spans_file(split) for split in splits] if kind == "examples" else []
    return [TOKENS_FILE, *(index_file(split) for split in splits), *spans]


# ------------------------------------------------------------------------------------------------ writing
class StoreWriter:
    """Appends tokens and index rows to a new store directory; :meth:`finish` writes store.json last.

    Nothing is held in memory beyond a small buffer of index rows: the tokens go to disk as they come."""

    _FLUSH_ROWS = 65_536

    def __init__(self, directory: Path, *, kind: StoreKind, vocab_size: int) -> None:
        directory.mkdir(parents=True, exist_ok=False)
        self.directory = directory
        self.kind = kind
        self.vocab_size = vocab_size
        self.dtype = token_dtype(vocab_size)
        self.num_tokens = 0
        self._tokens = open(directory / TOKENS_FILE, "wb")
        self._pending: dict[str, list[tuple[int, int, int, int]]] = {}
        self._indexes: dict[str, Any] = {}
        self._rows: dict[str, int] = {}
        self._spans: dict[str, list[tuple[int, int, int]]] = {}

    # -- tokens
    def write_tokens(self, ids: bytes | np.ndarray | Sequence[int]) -> int:
        """Append token ids; returns the offset (in tokens) where they start."""
        offset = self.num_tokens
        if isinstance(ids, (bytes, bytearray, memoryview)):
            if self.dtype != np.uint8:
                ids = np.frombuffer(ids, dtype=np.uint8).astype(self.dtype)
            else:
                self._tokens.write(ids)
                self.num_tokens += len(ids)
                return offset
        array = np.asarray(ids, dtype=self.dtype) if not isinstance(ids, np.ndarray) or ids.dtype != self.dtype \
            else ids
        self._tokens.write(array.tobytes())
        self.num_tokens += len(array)
        return offset

    def truncate_tokens(self, num_tokens: int) -> None:
        """Drop every token from ``num_tokens`` on (a directory's file turned out not to be text)."""
        self._tokens.flush()
        self._tokens.truncate(num_tokens * self.dtype.itemsize)
        self._tokens.seek(num_tokens * self.dtype.itemsize)
        self.num_tokens = num_tokens

    def append_token_file(self, path: Path) -> int:
        """Append the raw tokens of a part file written by a worker (same dtype); returns their first offset."""
        offset = self.num_tokens
        self._tokens.flush()
        size = path.stat().st_size
        with open(path, "rb") as part:
            # sendfile copies inside the kernel: a part of hundreds of megabytes never passes through Python.
            sent = 0
            while sent < size:
                done = os.sendfile(self._tokens.fileno(), part.fileno(), sent, size - sent)
                if done == 0:
                    break
                sent += done
        self._tokens.seek(0, os.SEEK_END)
        self.num_tokens += size // self.dtype.itemsize
        return offset

    # -- examples
    def add_example(self, split: str, ids: bytes | np.ndarray | Sequence[int], *, loss_start: int, row: int,
                    spans: Sequence[tuple[int, int]] | None = None) -> None:
        """Append one example: its tokens (inputs and the last target), where its loss starts, its source row.

        ``spans``: the trained tokens when they are not one run from ``loss_start`` to the end: half-open ranges of
        token positions, in order, not overlapping, each inside the example (``loss_start`` is then ignored: the
        first span's start is recorded)."""
        if spans is not None:
            spans = [(int(a), int(b)) for a, b in spans if b > a]
            length = len(ids)
            if not spans or spans[0][0] < 1 or spans[-1][1] > length \
                    or any(b1 > a2 for (_, b1), (a2, _) in zip(spans[:-1], spans[1:])):
                raise ValueError(f"spans {spans} are not ordered ranges of trained tokens within 1..{length}")
            number = self.rows(split)
            self._spans.setdefault(split, []).extend((number, a, b) for a, b in spans)
            loss_start = spans[0][0]
        offset = self.write_tokens(ids)
        self.add_rows(split, [(offset, self.num_tokens - offset, loss_start, row)])

    def add_rows(self, split: str, rows: Sequence[tuple[int, int, int, int]] | np.ndarray) -> None:
        """Append index rows (offset, length, loss_start, row) whose tokens are already written."""
        if isinstance(rows, np.ndarray):
            self._flush(split)
            self._index(split).write(np.ascontiguousarray(rows, dtype="<i8").tobytes())
            self._rows[split] = self._rows.get(split, 0) + len(rows)
            return
        pending = self._pending.setdefault(split, [])
        pending.extend(rows)
        if len(pending) >= self._FLUSH_ROWS:
            self._flush(split)

    def rows(self, split: str) -> int:
        return self._rows.get(split, 0) + len(self._pending.get(split, ()))

    def _index(self, split: str) -> Any:
        if split not in self._indexes:
            self._indexes[split] = open(self.directory / index_file(split), "wb")
        return self._indexes[split]

    def _flush(self, split: str) -> None:
        pending = self._pending.get(split)
        if pending:
            self._index(split).write(np.asarray(pending, dtype="<i8").reshape(-1, INDEX_COLUMNS).tobytes())
            self._rows[split] = self._rows.get(split, 0) + len(pending)
            pending.clear()

    # -- the end
    def finish(self, meta: dict[str, Any]) -> None:
        """Flush and sync every file, then write store.json: only a store with its store.json is ever opened."""
        for split in list(self._pending):
            self._flush(split)
        splits = sorted(set(self._rows) | set(self._indexes))
        if self.kind == "examples":
            for split in splits:
                # A handful of int64 triples per example at most (the turns of a conversation): kept until here.
                spans = np.asarray(self._spans.get(split, []), dtype="<i8").reshape(-1, SPAN_COLUMNS)
                with open(self.directory / spans_file(split), "wb") as handle:
                    handle.write(spans.tobytes())
                    handle.flush()
                    os.fsync(handle.fileno())
        for handle in [self._tokens, *self._indexes.values()]:
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        # Hashed from the files as they are on disk (read back once), so the checksum is of what a reader will see.
        names = store_files(self.kind, splits)
        checksums = {name: file_sha256(self.directory / name) for name in names}
        full = {
            **meta,
            "format": STORE_FORMAT,
            "version": STORE_VERSION,
            "kind": self.kind,
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "tokens": self.num_tokens,
            "splits": {split: self._rows.get(split, 0) for split in splits},
            "spans": {split: len(self._spans.get(split, [])) for split in splits} if self.kind == "examples" else {},
            "sha256": checksums,
        }
        atomic_write_json(self.directory / META_FILE, full, indent=1, sort_keys=True)
        _remember_verified(self.directory, names, checksums)

    def abort(self) -> None:
        for handle in [self._tokens, *self._indexes.values()]:
            handle.close()


def file_sha256(path: Path, *, each_chunk: Any = None) -> str:
    """The SHA-256 of a file, read in chunks of 8 MiB (``each_chunk(bytes)`` sees every chunk as it goes by)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
            if each_chunk is not None:
                each_chunk(chunk)
    return digest.hexdigest()


def _stat_identity(path: Path) -> list[int]:
    status = os.stat(path)
    return [status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino, status.st_dev]


_keys: dict[Path, bytes | None] = {}
"""The memo key of each cache root this process used (read once; HOME does not change under a run)."""


def memo_key() -> bytes | None:
    """This user's secret memo key, created on first use; None when there is no usable one (then no memo is
    trusted, and every open verifies the store in full)."""
    path = cadence_cache_root() / MEMO_KEY_FILE
    if path not in _keys:
        _keys[path] = _read_key(path) or _create_key(path)
    return _keys[path]


def _read_key(path: Path) -> bytes | None:
    """The key in ``path`` if it is this user's private regular file of the right size (not a link someone planted,
    not one others may read or write), else None."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        info = os.fstat(descriptor)
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077
                or info.st_size != MEMO_KEY_BYTES):
            return None
        key = os.pread(descriptor, MEMO_KEY_BYTES + 1, 0)
        return key if len(key) == MEMO_KEY_BYTES else None
    except OSError:
        return None
    finally:
        os.close(descriptor)


def _create_key(path: Path) -> bytes | None:
    """A new random key, written 0600 beside its final name and linked into place (``link`` fails if another process
    made one first: then that one is read, so every process of this user agrees on one key)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            return None  # there but unusable (another owner, readable by others): refused, not replaced
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(secrets.token_bytes(MEMO_KEY_BYTES))
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temporary, path)
            except FileExistsError:
                pass
        finally:
            temporary.unlink(missing_ok=True)
    except OSError:
        return None
    return _read_key(path)


def _memo_mac(key: bytes, directory: Path, names: Sequence[str], checksums: dict[str, str]) -> str:
    """The HMAC of the files' stat identities as they are now and of the checksums store.json records."""
    body = {"memo": 1, "files": {name: _stat_identity(directory / name) for name in [META_FILE, *names]},
            "sha256": checksums}
    return hmac.new(key, json.dumps(body, sort_keys=True).encode("utf-8"), hashlib.sha256).hexdigest()


def _remember_verified(directory: Path, names: Sequence[str], checksums: dict[str, str]) -> None:
    """Record that ``names`` (and store.json) were found right as they are now; best effort (without a key, or in a
    read-only store, the store is simply verified at every open)."""
    key = memo_key()
    if key is None:
        return
    try:
        atomic_write_json(directory / VERIFIED_FILE, {"mac": _memo_mac(key, directory, names, checksums)})
    except OSError:
        pass


def _verified_before(directory: Path, names: Sequence[str], checksums: dict[str, str]) -> bool:
    """Whether the memo was made under this user's key for exactly these files (same stat identities) and
    checksums: only then may the hashing be skipped."""
    key = memo_key()
    if key is None:
        return False
    try:
        descriptor = os.open(directory / VERIFIED_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                return False
            memo = json.loads(os.pread(descriptor, MEMO_LIMIT, 0).decode("utf-8"))
        finally:
            os.close(descriptor)
        mac = memo["mac"]
        return isinstance(mac, str) and hmac.compare_digest(mac, _memo_mac(key, directory, names, checksums))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return False


# ------------------------------------------------------------------------------------------------ reading
class TokenFile:
    """The token ids of a store, read a slice at a time (``tokens[a:b]`` is an array of those ids).

    Read with ``pread``, not through a memory map: a memory-mapped page stays in the process's resident set once
    touched, and on this kernel a touch maps a whole 2 MB folio, so a run's RSS grew by 2 MB per example read and
    would end an epoch at the corpus's size (nanoGPT re-creates its np.memmap every batch for this reason). Read
    this way, the file's pages live in the page cache alone, shared by every rank and run on the machine, and the
    process holds only the micro-batch it is collating. A read is one system call of a few hundred bytes."""

    def __init__(self, path: Path, dtype: np.dtype, count: int, *, start: int = 0,
                 vocab_size: int | None = None) -> None:
        self.path = path
        self.dtype = dtype
        self._count = count
        self._start = start
        # Checked on every read only when the dtype can hold an id past the vocabulary (not bytes in uint8).
        self._vocab_size = vocab_size if vocab_size is not None and vocab_size <= np.iinfo(dtype).max else None
        self._descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        weakref.finalize(self, os.close, self._descriptor)  # closed with the object, or at exit

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("token files are read by contiguous slices")
        start, stop, _ = index.indices(self._count)
        size = max(0, stop - start) * self.dtype.itemsize
        data = os.pread(self._descriptor, size, (self._start + start) * self.dtype.itemsize) if size else b""
        if len(data) != size:
            raise StoreDamaged(f"{self.path} is shorter than its store.json says (was it changed in place?)")
        ids = np.frombuffer(data, dtype=self.dtype)
        if self._vocab_size is not None and len(ids) and int(ids.max()) >= self._vocab_size:
            at = start + int(np.argmax(ids >= self._vocab_size))
            raise TokensOutOfRange(f"{self.path} holds token id {int(ids.max())} at token {at:,}, outside the "
                                   f"vocabulary of {self._vocab_size} (changed or crafted since it was verified); "
                                   f"build the store again with cadence prepare-data")
        return ids

    def prefix(self, count: int) -> TokenFile:
        """The first ``count`` tokens, as a file of their own (nothing read)."""
        view = TokenFile.__new__(TokenFile)
        view.path, view.dtype, view._start, view._vocab_size = self.path, self.dtype, self._start, self._vocab_size
        view._count = max(0, min(count, self._count))
        view._descriptor = os.dup(self._descriptor)
        weakref.finalize(view, os.close, view._descriptor)
        return view


@dataclass(frozen=True, kw_only=True)
class TokenStore:
    """An opened store: its metadata, its tokens (read by slices) and each split's index (memory-mapped).

    Opening reads store.json and maps the index; it reads no token, so it costs the same for 3 MB and 3 GB. The
    index is what counts and lengths are computed from, 32 bytes per example."""

    path: Path
    meta: dict[str, Any]
    tokens: TokenFile
    indexes: dict[str, np.ndarray]
    spans: dict[str, np.ndarray]
    """Each split's (example, start, end) rows (empty when every example trains from its loss_start on)."""

    @property
    def kind(self) -> StoreKind:
        return self.meta["kind"]

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    @classmethod
    def open(cls, path: Path) -> TokenStore:
        """Open the store in ``path``; :class:`StoreDamaged` says why it is not a usable store."""
        try:
            meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise StoreDamaged(f"{path} has no {META_FILE} (not a token store, or one whose build was interrupted)")
        except (OSError, ValueError) as error:
            raise StoreDamaged(f"{path / META_FILE} cannot be read: {error}") from None
        if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
            raise StoreDamaged(f"{path} is not a cadence token store")
        if meta.get("version") != STORE_VERSION:
            raise StoreDamaged(f"{path} is a token store of version {meta.get('version')}, this cadence reads "
                               f"version {STORE_VERSION}; build it again with cadence prepare-data")
        try:
            if meta["dtype"] not in TOKEN_DTYPES or meta["kind"] not in ("stream", "examples"):
                raise ValueError(f"dtype {meta['dtype']!r} / kind {meta['kind']!r} is not one a store is written in")
            dtype = np.dtype(meta["dtype"])
            vocab_size = int(meta["vocab_size"])
            if not 0 < vocab_size <= np.iinfo(dtype.name).max + 1:
                raise ValueError(f"vocab_size {vocab_size} does not fit {dtype.name}")
            splits = {str(split): int(rows) for split, rows in meta["splits"].items()}
            checksums = meta["sha256"]
            names = store_files(meta["kind"], list(splits))
            if not isinstance(checksums, dict) or sorted(checksums) != sorted(names):
                raise ValueError("its sha256 table does not list the store's files")
            _check_size(path / TOKENS_FILE, int(meta["tokens"]) * dtype.itemsize)
            indexes = {split: _map(path / index_file(split), np.dtype("<i8"), rows, (INDEX_COLUMNS,))
                       for split, rows in splits.items()}
            span_counts = {str(split): int(rows) for split, rows in meta["spans"].items()} \
                if meta["kind"] == "examples" else {}
            spans = {split: _map(path / spans_file(split), np.dtype("<i8"), span_counts.get(split, 0),
                                 (SPAN_COLUMNS,)) for split in splits if meta["kind"] == "examples"}
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise StoreDamaged(f"{path / META_FILE} is incomplete or inconsistent: {error}") from None
        if meta["kind"] == "examples" and "train" not in indexes:
            raise StoreDamaged(f"{path} holds no training examples")
        if not _verified_before(path, names, checksums):
            _verify(path, checksums, dtype=dtype, vocab_size=vocab_size)
            _check_index(path, int(meta["tokens"]), indexes, spans)
            _remember_verified(path, names, checksums)
        else:
            # Never skipped: what would crash a run mid-way (the memo spares only the hashing and the token scan).
            _check_index(path, int(meta["tokens"]), indexes, spans)
        tokens = TokenFile(path / TOKENS_FILE, dtype, int(meta["tokens"]), vocab_size=vocab_size)
        return cls(path=path, meta=meta, tokens=tokens, indexes=indexes, spans=spans)

    @property
    def digest(self) -> str:
        """``sha256:...`` over the checksums of the store's files: which tokens exactly a run read (a resume compares
        it, so that a store rebuilt differently, or another store, is never mixed into a run)."""
        table = json.dumps(self.meta["sha256"], sort_keys=True).encode("utf-8")
        return "sha256:" + hashlib.sha256(table).hexdigest()

    def summary(self) -> dict[str, Any]:
        """Counts for ``cadence prepare-data``: examples, tokens, targets, and a histogram of example lengths."""
        out: dict[str, Any] = {"kind": self.kind, "dtype": self.meta["dtype"], "tokens": int(self.meta["tokens"]),
                               "fingerprint": self.fingerprint, "source": self.meta.get("source", "")}
        if self.kind == "stream":
            out["targets"] = max(0, int(self.meta["tokens"]) - 1)
            return out
        for split, index in self.indexes.items():
            lengths = index[:, 1]
            targets = np.maximum(0, lengths - np.maximum(index[:, 2], 1))
            spans = self.spans.get(split)
            if spans is not None and len(spans):
                # Examples with spans train exactly those: their targets are the spans' lengths.
                listed = np.unique(spans[:, 0])
                targets[listed] = np.bincount(spans[:, 0], weights=spans[:, 2] - spans[:, 1],
                                              minlength=len(index))[listed].astype(np.int64)
            out[split] = {"examples": len(index), "tokens": int(lengths.sum()), "targets": int(targets.sum()),
                          "length_histogram": length_histogram(lengths)}
        return out


def _verify(path: Path, checksums: dict[str, str], *, dtype: np.dtype, vocab_size: int) -> None:
    """Every file against its checksum and every token id below ``vocab_size``; :class:`StoreDamaged` naming the
    first thing wrong."""
    highest = [-1]

    def note_highest(chunk: bytes) -> None:
        if len(chunk) % dtype.itemsize == 0 and chunk:
            highest[0] = max(highest[0], int(np.frombuffer(chunk, dtype=dtype).max()))

    for name, expected in checksums.items():
        try:
            found = file_sha256(path / name, each_chunk=note_highest if name == TOKENS_FILE else None)
        except OSError as error:
            raise StoreDamaged(f"{path / name} cannot be read: {error.strerror or error}") from None
        if found != expected:
            raise StoreDamaged(f"{path / name} does not match the checksum store.json recorded when it was built "
                               f"(changed or damaged since)")
    if highest[0] >= vocab_size:
        raise StoreDamaged(f"{path / TOKENS_FILE} holds token id {highest[0]}, outside the vocabulary of {vocab_size}")


def _check_index(path: Path, tokens: int, indexes: dict[str, np.ndarray], spans: dict[str, np.ndarray]) -> None:
    """Every index row inside the token file (offset at least 0, length at least 1, the end at most ``tokens``) with
    its loss starting within the example (0 to its length), and every span of trained tokens inside its example, in
    example order; :class:`StoreDamaged` naming the file and the first bad row. The index is read in blocks, so that
    a huge index is checked in bounded memory (spans are a few rows per chat example)."""
    for split, index in indexes.items():
        for first in range(0, len(index), INDEX_BLOCK_ROWS):
            block = np.asarray(index[first:first + INDEX_BLOCK_ROWS])
            offsets, lengths, loss_starts = block[:, 0], block[:, 1], block[:, 2]
            # tokens - lengths, not offsets + lengths: crafted values near 2**63 must not wrap around.
            outside = (offsets < 0) | (lengths < 1) | (offsets > tokens - lengths)
            bad = outside | (loss_starts < 0) | (loss_starts > lengths)
            if bad.any():
                at = int(np.flatnonzero(bad)[0])
                offset, length, loss_start = (int(v) for v in block[at, :3])
                what = (f"points outside {TOKENS_FILE} (offset {offset}, length {length}, of {tokens} tokens)"
                        if outside[at] else f"starts its loss at {loss_start}, outside its {length} tokens")
                raise StoreDamaged(f"{path / index_file(split)} row {first + at} {what}; build the store again with "
                                   f"cadence prepare-data")
    for split, rows in spans.items():
        if not len(rows):
            continue
        index = indexes[split]
        examples, starts, ends = rows[:, 0], rows[:, 1], rows[:, 2]
        inside = (examples >= 0) & (examples < len(index))
        lengths = np.where(inside, index[np.clip(examples, 0, max(len(index) - 1, 0)), 1], 0)
        ordered = np.concatenate([[True], examples[1:] >= examples[:-1]])
        bad = ~inside | (starts < 1) | (ends <= starts) | (ends > lengths) | ~ordered
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise StoreDamaged(f"{path / spans_file(split)} row {row} is not a span of trained tokens inside its "
                               f"example (example {int(examples[row])}, {int(starts[row])}..{int(ends[row])})")


def _check_size(path: Path, expected: int) -> None:
    try:
        size = path.stat().st_size
    except OSError as error:
        raise StoreDamaged(f"{path} cannot be read: {error.strerror or error}") from None
    if size != expected:
        raise StoreDamaged(f"{path} holds {size:,} bytes, store.json says {expected:,}")


def _map(path: Path, dtype: np.dtype, count: int, row_shape: tuple[int, ...]) -> np.ndarray:
    """Memory-map ``count`` rows of ``dtype``; the file must hold exactly that many bytes."""
    _check_size(path, count * dtype.itemsize * int(np.prod(row_shape, dtype=np.int64)))
    if count == 0:
        return np.zeros((0, *row_shape), dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count, *row_shape))


def length_histogram(lengths: np.ndarray, bins: int = 8) -> list[dict[str, int]]:
    """Example counts in ``bins`` equal-width length ranges (``[{"from": a, "to": b, "examples": n}]``)."""
    if len(lengths) == 0:
        return []
    low, high = int(lengths.min()), int(lengths.max())
    width = max(1, -(-(high - low + 1) // bins))
    counts = np.bincount((lengths - low) // width, minlength=bins)
    return [{"from": low + i * width, "to": low + (i + 1) * width - 1, "examples": int(n)}
            for i, n in enumerate(counts) if low + i * width <= high]



__all__ = [
    "INDEX_COLUMNS", "META_FILE", "SPAN_COLUMNS", "STORE_FORMAT", "STORE_VERSION", "TOKENS_FILE", "VERIFIED_FILE",
    "StoreDamaged", "TokensOutOfRange", "cadence_cache_root", "file_sha256", "memo_key",
    "StoreKind", "StoreWriter", "TokenFile", "TokenStore", "length_histogram", "token_dtype",
]
