"""Issue 44: a forged or copied ``.verified.json`` cannot make a token store skip its checks. The memo is an HMAC under
a per-user key (cadence.data.store); the index bounds are checked at every open, the token ids at every read."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from cadence.cli import main
from cadence.data.store import (
    MEMO_KEY_FILE,
    StoreDamaged,
    StoreWriter,
    TokensOutOfRange,
    TokenStore,
    cadence_cache_root,
    file_sha256,
    memo_key,
)
from cadence.data.store import _remember_verified as remember_verified  # noqa: PLC2701 - a sealed memo, as cadence's

NAMES = ["tokens.bin", "train.idx", "train.spans"]


def _examples_store(path: Path, *, vocab_size: int = 256) -> Path:
    writer = StoreWriter(path, kind="examples", vocab_size=vocab_size)
    for i in range(20):
        writer.add_example("train", bytes(range(40, 60 + i)), loss_start=3, row=i + 1)
    writer.finish({"fingerprint": "sha256:x", "source": "test", "tokenizer": "bytes"})
    return path


def _identity(path: Path) -> list[int]:
    status = os.stat(path)
    return [status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino, status.st_dev]


def _memo_by_hand(store: Path) -> None:
    """What anyone can write: the files' stat identity as they are now (the memo's old format), and a made-up MAC."""
    files = {name: _identity(store / name) for name in ["store.json", *NAMES]}
    (store / ".verified.json").write_text(json.dumps({"files": files, "mac": "0" * 64}))


def _reseal(store: Path) -> None:
    """Recompute store.json's checksums, as a crafted store would: only the content checks can catch it then."""
    meta = json.loads((store / "store.json").read_text())
    meta["sha256"] = {name: file_sha256(store / name) for name in meta["sha256"]}
    (store / "store.json").write_text(json.dumps(meta))


def _edit_index(column: int, row: int, value: int) -> Callable[[Path], None]:
    def edit(store: Path) -> None:
        rows = np.fromfile(store / "train.idx", dtype="<i8").reshape(-1, 4)
        rows[row, column] = value
        rows.tofile(store / "train.idx")
    return edit


def _wide_ids(store: Path) -> None:
    """A byte store whose ids no longer fit bytes: uint16 on disk, one id 300."""
    tokens = np.fromfile(store / "tokens.bin", dtype=np.uint8).astype("<u2")
    tokens[45] = 300
    tokens.tofile(store / "tokens.bin")
    meta = json.loads((store / "store.json").read_text())
    meta["dtype"] = "uint16"
    (store / "store.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(("damage", "says"), [
    (_edit_index(0, 3, 10**9), "train.idx row 3 points outside tokens.bin"),
    (_edit_index(0, 5, -7), "train.idx row 5 points outside tokens.bin"),
    (_edit_index(1, 4, -3), "train.idx row 4 points outside tokens.bin"),
    (_edit_index(1, 2, 2**62), "train.idx row 2 points outside tokens.bin"),
    (_edit_index(2, 6, 500), "train.idx row 6 starts its loss at 500, outside its 26 tokens"),
    (_wide_ids, "tokens.bin holds token id 300, outside the vocabulary of 256"),
], ids=["offset-past-the-end", "negative-offset", "negative-length", "huge-length", "loss-past-the-end",
        "ids-past-the-vocabulary"])
@pytest.mark.parametrize("memo", ["by-hand", "copied-from-another-store"])
def test_a_forged_memo_skips_no_check(tmp_path: Path, damage: Callable[[Path], None], says: str, memo: str) -> None:
    store = _examples_store(tmp_path / "s")
    TokenStore.open(store)
    damage(store)
    _reseal(store)
    if memo == "by-hand":
        _memo_by_hand(store)
    else:  # another store's genuine memo, sealed by this user's cadence: bound to that store's files
        other = _examples_store(tmp_path / "other")
        shutil.copy(other / ".verified.json", store / ".verified.json")
    with pytest.raises(StoreDamaged, match=says):
        TokenStore.open(store)


def test_a_crafted_store_is_refused_before_the_run_directory_is_written(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44 item 5: index offsets past the end under a forged memo failed mid-run with a traceback and left a
    half-written run directory."""
    store = _examples_store(tmp_path / "s")
    _edit_index(0, 3, 10**9)(store)
    _reseal(store)
    _memo_by_hand(store)
    assert main(["train", "--data", str(store), "--seq-len", "64", "--micro-batch-size", "2", "--grad-accum-steps",
                 "1", "--max-steps", "4", "--val-fraction", "0", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"--data: {store / 'train.idx'} row 3 points outside tokens.bin" in err
    assert not (tmp_path / "run").exists()


def test_ids_past_the_vocabulary_are_caught_where_they_are_read(tmp_path: Path) -> None:
    """Even under a memo that really was sealed for these files (a change that kept every file's stat identity
    cannot be made without root, but the reads do not rely on that), a bad id is one line, not an index error."""
    store = _examples_store(tmp_path / "s")
    _wide_ids(store)
    _reseal(store)
    checksums = json.loads((store / "store.json").read_text())["sha256"]
    remember_verified(store, NAMES, checksums)
    opened = TokenStore.open(store)  # the memo spares the scan of the ids
    offset, length = (int(v) for v in opened.indexes["train"][0, :2])
    assert opened.tokens[offset:offset + length].max() < 256  # the ids before the bad one read as ever
    with pytest.raises(TokensOutOfRange, match=r"tokens.bin holds token id 300 at token 45, outside the vocabulary"):
        opened.tokens[40:60]


def test_the_memo_key_is_private_and_another_key_means_verify_again(tmp_path: Path, monkeypatch) -> None:
    import cadence.data.store as store_module

    store = _examples_store(tmp_path / "s")
    key = cadence_cache_root() / MEMO_KEY_FILE
    assert memo_key() is not None and stat.S_IMODE(key.stat().st_mode) == 0o600
    hashed: list[str] = []
    real = store_module.file_sha256
    monkeypatch.setattr(store_module, "file_sha256", lambda path, **kw: hashed.append(path.name) or real(path, **kw))
    TokenStore.open(store)
    assert hashed == []  # its own memo, sealed when it was built
    monkeypatch.setattr(store_module, "_keys", {key: b"k" * 32})  # another user's key, or a new one
    TokenStore.open(store)
    assert sorted(hashed) == NAMES
    os.chmod(key, 0o644)  # a key others may read seals nothing
    monkeypatch.setattr(store_module, "_keys", {})
    assert memo_key() is None
    TokenStore.open(store)
    assert len(hashed) == 2 * len(NAMES)
    os.chmod(key, 0o600)
