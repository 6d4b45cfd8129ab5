"""The token-store cache: one store per (content, tokenizer, options), found again without reading the data.

Layout of a cache directory (``--data-cache``, by default ``~/.cache/cadence/data``)::

    stores/<key>/      a finished store; <key> hashes the content fingerprint, tokenizer and options
    stores/<key>/.sources/<id>   the source ids whose content was hashed and found to be this store's
    sources/<id>.json  which store a source had when its files had this path, size, mtime, ctime and inode
    build.lock         held (flock) by the one process building; every other process waits on it, then opens

A store is verified when opened (data/store.py: checksums, token range, index bounds); a cached store that fails, or
a sources entry that points at a store not built from that source, is built again from the source, with a warning.

Finding a store again costs a ``stat`` of the source's files, not a hash of its content: a 3 GB text opens in
milliseconds. Any rewrite of a file changes its mtime, ctime or size, so the stat identity misses, the content is
hashed again while the store is rebuilt, and the new fingerprint is what a resume compares against.

Ranks of one machine share one store: the first to take the lock builds it, the others wait on the lock and then
map the same files, so the operating system's page cache holds one copy for all. A build is written into
``stores/.build-*`` and renamed into place when complete: a process killed mid-build (even by SIGKILL) leaves a
``.build-*`` directory that no reader trusts and that the next build removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cadence.data.store import STORE_VERSION, StoreDamaged, StoreKind, StoreWriter, TokenStore, cadence_cache_root
from cadence.errors import CadenceFailure, UsageError
from cadence.output_files import atomic_write_json
from cadence.process_locks import lock_holder

STORES = "stores"
SOURCES = "sources"
LOCK_FILE = "build.lock"
BUILD_PREFIX = ".build-"
BUILT_FOR = ".sources"
"""In a cached store: one empty file per source id whose content was hashed and found to be this store's."""


def default_cache_dir() -> Path:
    """``~/.cache/cadence/data``: beside the caches of pip, torch and Hugging Face. Its parent also holds the
    per-user key of the stores' verification memos (data/store.py), which a ``--data-cache`` shared with others never
    does."""
    return cadence_cache_root() / "data"


@dataclass(frozen=True, kw_only=True)
class BuildResult:
    """What a build function reports besides the tokens it wrote."""

    fingerprint: str
    """``sha256:...`` of the source's content."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Extra store.json fields (counts, descriptions)."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """How to build one source's store, and what identifies it.

    ``stat_identity`` must change whenever the content may have (paths, sizes, times, inodes of every file);
    ``tokenizer`` and ``options`` whenever the same content would give other tokens."""

    kind: StoreKind
    source: str
    """One line naming the source, for messages and store.json."""
    stat_identity: list[Any]
    tokenizer: str
    vocab_size: int
    options: dict[str, Any]
    build: Callable[[StoreWriter], BuildResult]
    source_bytes: int = 0
    """The source's size on disk (for throughput figures)."""


def _digest(content: Any) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:32]


def store_key(recipe: Recipe, fingerprint: str) -> str:
    return _digest([STORE_VERSION, recipe.kind, fingerprint, recipe.tokenizer, recipe.options])


def _source_id(recipe: Recipe) -> str:
    return _digest([STORE_VERSION, recipe.kind, recipe.stat_identity, recipe.tokenizer, recipe.options])


@dataclass(frozen=True, kw_only=True)
class Opened:
    store: TokenStore
    built: bool
    """True when this call tokenised the source (False: found in the cache)."""


Accept = Callable[[TokenStore], None]
"""A check of a store before it is kept (``cadence prepare-data --seq-len``): raising leaves nothing written."""


def _accepted(store: TokenStore, accept: Accept | None) -> TokenStore:
    if accept is not None:
        accept(store)
    return store


def open_or_build(recipe: Recipe, cache_dir: Path | None, *, accept: Accept | None = None) -> Opened:
    """The store of ``recipe`` from ``cache_dir``, built first (once, under the cache's lock) when missing.

    ``cache_dir`` None: build into a temporary directory that is removed as soon as the store is open (the open
    token file and the index's mapping keep the files alive until the process lets go of them), for library calls
    that want no cache. ``accept`` sees the store (found, or built and not yet in the cache) and may refuse it by
    raising: a store it refuses is not added to the cache."""
    if cache_dir is None:
        folder = Path(tempfile.mkdtemp(prefix="cadence-store-"))
        try:
            return Opened(store=_accepted(_build(recipe, folder / "store"), accept), built=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    _prepare(cache_dir)
    source_file = cache_dir / SOURCES / f"{_source_id(recipe)}.json"
    found, _ = _known(cache_dir, source_file, recipe)
    if found is not None:
        return Opened(store=_accepted(found, accept), built=False)
    with _build_lock(cache_dir, recipe.source):
        found, damage = _known(cache_dir, source_file, recipe)  # another process may have built it meanwhile
        if found is not None:
            return Opened(store=_accepted(found, accept), built=False)
        if damage:
            warnings.warn(f"the cached token store of {recipe.source} is not usable ({damage}); building it again "
                          f"from the source", stacklevel=2)
        for stale in (cache_dir / STORES).glob(f"{BUILD_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)  # a killed build's remains: nobody else builds while we hold it
        building = cache_dir / STORES / f"{BUILD_PREFIX}{os.getpid()}"
        try:
            store = _accepted(_build(recipe, building), accept)
            final = cache_dir / STORES / store_key(recipe, store.fingerprint)
            if _open_quietly(final) is None:  # the same content may already be there under another source id
                shutil.rmtree(final, ignore_errors=True)
                os.rename(building, final)
            else:
                shutil.rmtree(building, ignore_errors=True)
            # The store's own record that this source's content hashed to its fingerprint: an entry in sources/
            # pointing at a store without it was not written by a build of this source, and is not followed.
            (final / BUILT_FOR).mkdir(exist_ok=True)
            (final / BUILT_FOR / source_file.stem).touch()
            atomic_write_json(source_file, {"store": final.name, "source": recipe.source,
                                            "fingerprint": store.fingerprint})
        except BaseException as failure:
            shutil.rmtree(building, ignore_errors=True)
            if isinstance(failure, OSError):  # the source's own read errors are UsageErrors by now: this is a write
                reason = (failure.strerror or str(failure)).lower()
                raise StoreWriteFailed(f"cannot write the token store of {recipe.source} in {cache_dir}: {reason}; "
                                       f"free space there, or give --data-cache a directory with room") from None
            raise
        return Opened(store=TokenStore.open(final), built=True)


class StoreWriteFailed(CadenceFailure):
    """A token store could not be written (a full disk, a file size limit): nothing of the build is left behind, and
    the next run builds it again."""

    label = "data failed"


def _prepare(cache_dir: Path) -> None:
    try:
        (cache_dir / STORES).mkdir(parents=True, exist_ok=True)
        (cache_dir / SOURCES).mkdir(exist_ok=True)
    except OSError as error:
        raise UsageError.single("--data-cache", f"{cache_dir} cannot be created: {(error.strerror or str(error)).lower()};"
                                                f" give --data-cache a writable directory") from None
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        raise UsageError.single("--data-cache", f"{cache_dir} is not writable; give --data-cache a writable directory")


def _known(cache_dir: Path, source_file: Path, recipe: Recipe) -> tuple[TokenStore | None, str | None]:
    """The store this source id points to, when both exist, the store verifies, and it is the store of this recipe
    (its kind, tokenizer and options, under the name its fingerprint gives): an entry edited to point at another
    store is not followed. Returns (store, None), or (None, why the entry's store was not used) (None, None: none)."""
    try:
        entry = json.loads(source_file.read_text(encoding="utf-8"))
        name, fingerprint = entry["store"], entry["fingerprint"]
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"{source_file} is unreadable"
    if not isinstance(name, str) or "/" in name or name.startswith(".") or not isinstance(fingerprint, str):
        return None, f"{source_file} does not name a store"
    try:
        store = TokenStore.open(cache_dir / STORES / name)
    except StoreDamaged as damage:
        return None, str(damage)
    meta = store.meta
    if (store.fingerprint != fingerprint or store_key(recipe, fingerprint) != name or meta.get("kind") != recipe.kind
            or meta.get("tokenizer") != recipe.tokenizer or meta.get("options") != _as_json(recipe.options)
            or not (store.path / BUILT_FOR / source_file.stem).is_file()):
        return None, f"{source_file} points at a store that was not built from this source"
    return store, None


def _as_json(value: Any) -> Any:
    """``value`` as store.json holds it after a round trip through JSON (tuples become lists)."""
    return json.loads(json.dumps(value, default=str))


def _open_quietly(path: Path) -> TokenStore | None:
    try:
        return TokenStore.open(path)
    except StoreDamaged:
        return None


def _build(recipe: Recipe, directory: Path) -> TokenStore:
    writer = StoreWriter(directory, kind=recipe.kind, vocab_size=recipe.vocab_size)
    try:
        result = recipe.build(writer)
        writer.finish({**result.meta, "fingerprint": result.fingerprint, "source": recipe.source,
                       "tokenizer": recipe.tokenizer, "options": recipe.options})
    except BaseException:
        writer.abort()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return TokenStore.open(directory)


BUILD_LOCK_NOTICE_S = 5.0
"""A wait for another process's build longer than this is said on the console, naming the holder."""
BUILD_LOCK_WAIT_S = 3600.0
"""How long a process waits for another's store build before giving up: an hour is several 3 GB builds, while a
holder that was stopped (SIGSTOP, a suspended terminal) would otherwise keep every later run waiting forever."""


@contextlib.contextmanager
def _build_lock(cache_dir: Path, source: str) -> Iterator[None]:
    """An exclusive flock on the cache's lock file. The kernel releases it when its holder dies, however it dies.
    A wait says who holds it, and ends after :data:`BUILD_LOCK_WAIT_S` with an error naming the holder."""
    with open(cache_dir / LOCK_FILE, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            started = time.monotonic()
            deadline, said = started + BUILD_LOCK_WAIT_S, False
            while True:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    # The ranks of one run wait on each other's build for moments: only a longer wait is news.
                    if not said and time.monotonic() - started >= BUILD_LOCK_NOTICE_S:
                        said = True
                        warnings.warn(f"waiting for another process to finish building a token store in {cache_dir} "
                                      f"({lock_holder(cache_dir / LOCK_FILE)}); giving up after "
                                      f"{BUILD_LOCK_WAIT_S / 60:g} minutes", stacklevel=3)
                    if time.monotonic() >= deadline:
                        raise UsageError.single("--data-cache", (
                            f"{cache_dir} is still locked by another build after {BUILD_LOCK_WAIT_S / 60:g} minutes "
                            f"({lock_holder(cache_dir / LOCK_FILE)}); stop that process, or give another "
                            f"--data-cache to build {source} there")) from None
                    time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def write_store(recipe: Recipe, target: Path, *, accept: Accept | None = None) -> TokenStore:
    """Build ``recipe`` into ``target`` (``cadence prepare-data --out``), atomically: a sibling directory renamed
    into place, so an interrupted build, or one that ``accept`` refuses (by raising), leaves no directory at
    ``target``."""
    if target.exists():
        raise UsageError.single("--out", f"{target} already exists; give a new directory for the token store")
    building = target.with_name(f"{BUILD_PREFIX}{target.name}-{os.getpid()}")
    for stale in target.parent.glob(f"{BUILD_PREFIX}{target.name}-*"):
        if not _alive(stale.name.rsplit("-", 1)[-1]):  # a killed build of the same target: its remains go
            shutil.rmtree(stale, ignore_errors=True)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _accepted(_build(recipe, building), accept)
        os.rename(building, target)
    except OSError as error:
        shutil.rmtree(building, ignore_errors=True)
        raise UsageError.single("--out", f"{target} cannot be written: {(error.strerror or str(error)).lower()}") \
            from None
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return TokenStore.open(target)


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ValueError:
        return False
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


__all__ = ["BuildResult", "Opened", "Recipe", "StoreWriteFailed", "default_cache_dir", "open_or_build", "store_key",
           "write_store"]
