"""The token store and its cache: the same examples as the in-memory readers, found again without reading the data,
never trusted half-built, built once for several processes."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import sample_text

from cadence.data import (
    load_data,
    open_prepared_store,
    pack_bytes,
    read_jsonl,
    read_text_source,
)
from cadence.data.cache import BuildResult, Recipe, open_or_build
from cadence.data.sources import jsonl_recipe, text_recipe
from cadence.data.splits import splits_from_store
from cadence.data.store import StoreDamaged, StoreWriter, TokenStore, file_sha256, token_dtype
from cadence.errors import UsageError


def as_lists(dataset) -> list[tuple[list[int], list[int]]]:
    return [(example.input_ids.tolist(), example.labels.tolist()) for example in dataset]


def stores(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "stores").iterdir() if not p.name.startswith("."))


# ------------------------------------------------------------------------------------------------ format
def test_token_dtype_is_the_smallest_that_holds_the_vocabulary() -> None:
    assert [token_dtype(n).name for n in (256, 257, 65_536, 65_537, 200_000)] == [
        "uint8", "uint16", "uint16", "uint32", "uint32"]


def test_examples_round_trip_in_a_wide_dtype(tmp_path: Path) -> None:
    writer = StoreWriter(tmp_path / "s", kind="examples", vocab_size=50_000)
    writer.add_example("train", [49_999, 7, 300, 12], loss_start=2, row=1)
    writer.add_example("train", [1, 2], loss_start=1, row=2)
    writer.add_example("val", [5, 6, 7], loss_start=1, row=1)
    writer.finish({"fingerprint": "sha256:x"})
    store = TokenStore.open(tmp_path / "s")
    assert store.tokens.dtype == np.uint16 and store.meta["splits"] == {"train": 2, "val": 1}
    splits = splits_from_store(store, seq_len=8, val_fraction=0.5, from_cache=False)
    # Position j predicts token j + 1, a target from loss_start on: the first label of example 0 is not a target.
    assert as_lists(splits.train) == [([49_999, 7, 300], [-100, 300, 12]), ([1], [2])]
    assert as_lists(splits.val) == [([5, 6], [6, 7])]
    short = splits_from_store(store, seq_len=2, val_fraction=0.0, from_cache=False, too_long="truncate")
    # Truncated to 3 tokens keeping the loss-bearing end: the first token (before the loss starts) goes.
    assert as_lists(short.train)[0] == ([7, 300], [300, 12]) and short.truncated == 1
    assert short.train.num_targets == 3 and short.train.max_length == 2


@pytest.mark.parametrize("damage", ["no meta", "short tokens", "other version", "not a store"])
def test_an_incomplete_store_is_never_opened(tmp_path: Path, damage: str) -> None:
    writer = StoreWriter(tmp_path / "s", kind="stream", vocab_size=256)
    writer.write_tokens(b"hello world")
    writer.finish({"fingerprint": "sha256:x"})
    meta_path = tmp_path / "s" / "store.json"
    meta = json.loads(meta_path.read_text())
    if damage == "no meta":
        meta_path.unlink()
    elif damage == "short tokens":
        (tmp_path / "s" / "tokens.bin").write_bytes(b"hello")
    else:
        meta["version" if damage == "other version" else "format"] = 99 if damage == "other version" else "other"
        meta_path.write_text(json.dumps(meta))
    with pytest.raises(StoreDamaged):
        TokenStore.open(tmp_path / "s")
    if damage != "no meta":  # (without store.json the directory is not taken for a store at all)
        with pytest.raises(UsageError) as excinfo:
            load_data(tmp_path / "s", 4, 0.0)
        assert excinfo.value.problems[0].where == "--data"


# ------------------------------------------------------------------------------------------------ same examples
def test_text_directory_store_equals_the_in_memory_reader(tmp_path: Path) -> None:
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_bytes(sample_text(700))
    (folder / "sub" / "b.py").write_bytes(sample_text(900)[::-1])
    (folder / "blob.bin").write_bytes(bytes(range(256)) * 4)  # not UTF-8: skipped, its bytes taken out again
    (folder / "empty.txt").write_text("")
    (folder / ".hidden").write_text("never")
    raw = read_text_source(folder)
    splits = load_data(folder, 32, 0.1, cache_dir=tmp_path / "cache")
    expected = pack_bytes(raw, 32)
    assert as_lists(splits.train) + as_lists(splits.val) == as_lists(expected)
    assert splits.fingerprint == "sha256:" + __import__("hashlib").sha256(raw).hexdigest()


def test_a_text_file_that_is_not_utf8_is_named_with_its_offset(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(b"fine text " * 3 + b"\xff" + b"more")
    with pytest.raises(UsageError) as excinfo:
        load_data(path, 4, 0.0, cache_dir=tmp_path / "cache")
    assert "offset 30" in str(excinfo.value) and stores(tmp_path / "cache") == []


BAD_LINES = {7: "{not json", 23: '{"text": 5}', 41: '["a list"]'}


def write_jsonl(path: Path, count: int, bad: dict[int, str] | None = None) -> Path:
    """Prompt/completion and text lines of varied length, blank lines between some, a BOM in front."""
    lines = []
    for i in range(1, count + 1):
        if bad and i in bad:
            lines.append(bad[i])
        elif i % 9 == 0:
            lines.append("")
        elif i % 2:
            lines.append(json.dumps({"prompt": f"question {i} " * (i % 5), "completion": f"answer {i} " * (1 + i % 7)}))
        else:
            lines.append(json.dumps({"text": f"plain text number {i} " * (1 + i % 4), "id": i}))
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    return path


def test_parallel_jsonl_store_equals_the_sequential_reader(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", 120)
    expected, truncated = read_jsonl(path, 80, too_long="truncate")
    # Ranges of ~300 bytes: dozens of worker tasks, each starting mid-file (line numbers carried across them).
    recipe = jsonl_recipe(path, None, workers=2, range_bytes=300)
    splits = splits_from_store(open_or_build(recipe, None).store, seq_len=80, val_fraction=0.0, from_cache=False,
                               too_long="truncate")
    assert as_lists(splits.train) == as_lists(expected) and splits.truncated == truncated > 0
    assert splits.train.num_targets == sum(e.num_targets for e in expected)
    assert splits.train.max_length == max(len(e.input_ids) for e in expected)


def test_parallel_jsonl_names_every_bad_line_as_the_sequential_reader_does(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", 60, BAD_LINES)
    with pytest.raises(UsageError) as sequential:
        read_jsonl(path, 80)
    with pytest.raises(UsageError) as parallel:
        open_or_build(jsonl_recipe(path, None, workers=2, range_bytes=200), tmp_path / "cache")
    where = [p.where for p in parallel.value.problems]
    assert where == [p.where for p in sequential.value.problems] == [f"{path}:{n}" for n in sorted(BAD_LINES)]
    assert stores(tmp_path / "cache") == [] and list((tmp_path / "cache" / "sources").iterdir()) == []


# ------------------------------------------------------------------------------------------------ the cache
def test_a_cached_store_opens_without_reading_the_data_and_a_rewrite_is_seen(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(sample_text(5000))
    cache = tmp_path / "cache"
    first = load_data(path, 64, 0.0, cache_dir=cache)
    recipe = text_recipe(path, None)

    def refuse(writer: StoreWriter) -> BuildResult:
        raise AssertionError("a cache hit must not read the source")

    again = open_or_build(Recipe(**{**recipe.__dict__, "build": refuse}), cache)
    assert not again.built and again.store.fingerprint == first.fingerprint
    # The same size, the mtime put back: the ctime still changes, so the new content is read and fingerprinted.
    stat = path.stat()
    path.write_bytes(sample_text(5000).upper())
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = load_data(path, 64, 0.0, cache_dir=cache)
    assert changed.fingerprint != first.fingerprint and "from the cache" not in changed.description
    assert len(stores(cache)) == 2


def _slow_recipe(marker: Path, counter: Path, seconds: float) -> Recipe:
    def build(writer: StoreWriter) -> BuildResult:
        with open(counter, "a") as handle:
            handle.write(f"{os.getpid()}\n")
        writer.write_tokens(b"x" * 1000)
        marker.touch()
        time.sleep(seconds)
        writer.write_tokens(b"y" * 1000)
        return BuildResult(fingerprint="sha256:slow")

    return Recipe(kind="stream", source="slow", stat_identity=["slow"], tokenizer="bytes", vocab_size=256,
                  options={}, build=build)


def _open_in_child(cache: Path, marker: Path, counter: Path, seconds: float, result: Path | None) -> None:
    opened = open_or_build(_slow_recipe(marker, counter, seconds), cache)
    if result is not None:
        result.write_text(f"{opened.store.path}\n{opened.built}")


def test_a_build_killed_by_sigkill_is_never_trusted(tmp_path: Path) -> None:
    cache, marker, counter = tmp_path / "cache", tmp_path / "building", tmp_path / "builds"
    child = multiprocessing.get_context("fork").Process(target=_open_in_child, args=(cache, marker, counter, 60, None))
    child.start()
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    leftovers = list((cache / "stores").glob(".build-*"))
    assert len(leftovers) == 1 and not (leftovers[0] / "store.json").exists()
    assert stores(cache) == [] and list((cache / "sources").iterdir()) == []
    # The next open builds afresh (the lock died with its holder) and clears the remains.
    opened = open_or_build(_slow_recipe(marker, counter, 0), cache)
    assert opened.built and len(opened.store.tokens) == 2000
    assert list((cache / "stores").glob(".build-*")) == []


def test_processes_that_need_the_same_store_build_it_once(tmp_path: Path) -> None:
    cache, marker, counter = tmp_path / "cache", tmp_path / "building", tmp_path / "builds"
    results = [tmp_path / f"result-{i}" for i in range(2)]
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=_open_in_child, args=(cache, marker, counter, 1.0, result))
                for result in results]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    assert len(counter.read_text().split()) == 1  # one build; the other process waited on the lock and opened it
    paths, built = zip(*(result.read_text().split("\n") for result in results))
    assert len(set(paths)) == 1 and sorted(built) == ["False", "True"]


def test_an_unwritable_cache_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(UsageError) as excinfo:
        load_data(None, 16, 0.0, max_corpus_bytes=1000, cache_dir=blocker / "cache")
    assert excinfo.value.problems[0].where == "--data-cache"


def test_a_store_for_another_tokenizer_is_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", 20)
    store = open_or_build(jsonl_recipe(path, None), tmp_path / "cache").store
    with pytest.raises(UsageError) as excinfo:
        open_prepared_store(store.path, expected_tokenizer="PreTrainedTokenizerFast:m:1000:abc")
    assert excinfo.value.problems[0].where == "--data" and "prepare-data" in excinfo.value.problems[0].message


# ------------------------------------------------------------------------------------------------ verified (issue 29)
def _examples_store(path: Path) -> Path:
    writer = StoreWriter(path, kind="examples", vocab_size=256)
    for i in range(20):
        writer.add_example("train", bytes(range(40, 60 + i)), loss_start=3, row=i + 1)
    writer.finish({"fingerprint": "sha256:x", "source": "test"})
    return path


def _reseal(store: Path) -> None:
    """Recompute store.json's checksums, as a crafted store would: only the content checks can catch it then."""
    meta = json.loads((store / "store.json").read_text())
    meta["sha256"] = {name: file_sha256(store / name) for name in meta["sha256"]}
    (store / "store.json").write_text(json.dumps(meta))


def _add_one_to_every_token(store: Path) -> None:
    tokens = store / "tokens.bin"
    tokens.write_bytes(bytes((b + 1) % 256 for b in tokens.read_bytes()))


def _random_index(store: Path) -> None:
    index = store / "train.idx"
    index.write_bytes(np.random.default_rng(0).integers(0, 256, index.stat().st_size, dtype=np.uint8).tobytes())


def _object_dtype(store: Path) -> None:
    meta = json.loads((store / "store.json").read_text())
    meta["dtype"] = "object"
    (store / "store.json").write_text(json.dumps(meta))


def _offset_past_the_end(store: Path) -> None:
    rows = np.fromfile(store / "train.idx", dtype="<i8").reshape(-1, 4)
    rows[3, 0] = 10**9
    rows.tofile(store / "train.idx")
    _reseal(store)


def _negative_offset(store: Path) -> None:
    rows = np.fromfile(store / "train.idx", dtype="<i8").reshape(-1, 4)
    rows[5, 0] = -7
    rows.tofile(store / "train.idx")
    _reseal(store)


def _ids_outside_the_vocabulary(store: Path) -> None:
    tokens = np.fromfile(store / "tokens.bin", dtype=np.uint8).astype("<u2")
    tokens[10] = 300  # a byte store whose ids no longer fit bytes
    tokens.tofile(store / "tokens.bin")
    meta = json.loads((store / "store.json").read_text())
    meta.update(dtype="uint16")
    rows = np.fromfile(store / "train.idx", dtype="<i8")
    (store / "store.json").write_text(json.dumps(meta))
    rows.tofile(store / "train.idx")
    _reseal(store)


@pytest.mark.parametrize("damage, says", [
    (_add_one_to_every_token, "tokens.bin does not match the checksum"),
    (_random_index, "train.idx does not match the checksum"),
    (_object_dtype, "dtype 'object'"),
    (_offset_past_the_end, "train.idx row 3 points outside tokens.bin"),
    (_negative_offset, "train.idx row 5 points outside tokens.bin"),
    (_ids_outside_the_vocabulary, "token id 300, outside the vocabulary of 256"),
], ids=lambda value: value.__name__.strip("_") if callable(value) else "")
def test_a_damaged_or_crafted_store_is_refused_naming_the_store(tmp_path: Path, damage, says) -> None:
    """Issue 29 items 3 and 12: opening checks every file's checksum, the token range and the index bounds."""
    store = _examples_store(tmp_path / "s")
    TokenStore.open(store)  # whole, and remembered as verified
    damage(store)
    with pytest.raises(StoreDamaged, match=says):
        TokenStore.open(store)
    with pytest.raises(UsageError) as refused:
        load_data(store, 16, 0.0)
    assert refused.value.problems[0].where == "--data" and str(store) in refused.value.problems[0].message


def test_a_store_whose_files_are_unchanged_is_not_hashed_again(tmp_path: Path, monkeypatch) -> None:
    store = _examples_store(tmp_path / "s")
    import cadence.data.store as store_module

    hashed: list[str] = []
    real = store_module.file_sha256
    monkeypatch.setattr(store_module, "file_sha256", lambda path, **kw: hashed.append(path.name) or real(path, **kw))
    TokenStore.open(store)
    assert hashed == []  # the build verified it as it wrote it
    os.utime(store / "tokens.bin")  # any change to a file's status (here only its times) means: verify again
    TokenStore.open(store)
    assert sorted(hashed) == ["tokens.bin", "train.idx", "train.spans"]
    TokenStore.open(store)
    assert len(hashed) == 3


def test_a_damaged_cached_store_is_rebuilt_from_its_source(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", 60)
    cache = tmp_path / "cache"
    first = as_lists(load_data(path, 64, 0.0, cache_dir=cache).train)
    (store,) = stores(cache)
    for damage in (_add_one_to_every_token, _random_index):
        damage(store)
        with pytest.warns(UserWarning, match="not usable .* building it again from the source"):
            again = load_data(path, 64, 0.0, cache_dir=cache)
        assert as_lists(again.train) == first and "from the cache" not in again.description


def test_a_sources_entry_pointing_at_another_store_is_not_followed(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    one, other = tmp_path / "one.txt", tmp_path / "other.txt"
    one.write_bytes(sample_text(3000))
    other.write_bytes(sample_text(3000).upper())
    expected = as_lists(load_data(one, 32, 0.0, cache_dir=cache).train)
    other_store = load_data(other, 32, 0.0, cache_dir=cache)
    entries = {json.loads(p.read_text())["source"]: p for p in (cache / "sources").iterdir()}
    (entry,) = [p for source, p in entries.items() if "one.txt" in source]
    # Edited to point at the other store, its fingerprint copied too so that the entry is self-consistent.
    forged = json.loads(entry.read_text())
    forged.update(store=other_store.store.name, fingerprint=other_store.fingerprint)
    entry.write_text(json.dumps(forged))
    with pytest.warns(UserWarning, match="not built from this source"):
        assert as_lists(load_data(one, 32, 0.0, cache_dir=cache).train) == expected


def _hold_the_build_lock(cache: Path, ready: Path) -> None:
    import fcntl

    with open(cache / "build.lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        ready.touch()
        os.kill(os.getpid(), signal.SIGSTOP)  # a prepare-data stopped mid-build: alive, holding the lock


def test_waiting_on_a_stopped_build_names_its_holder_and_gives_up(tmp_path: Path, monkeypatch) -> None:
    """Issue 29 item 5: the wait used to print nothing and never end."""
    import cadence.data.cache as cache_module

    cache, ready = tmp_path / "cache", tmp_path / "ready"
    (cache / "stores").mkdir(parents=True)
    (cache / "sources").mkdir()
    holder = multiprocessing.get_context("fork").Process(target=_hold_the_build_lock, args=(cache, ready))
    holder.start()
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        monkeypatch.setattr(cache_module, "BUILD_LOCK_WAIT_S", 0.5)
        monkeypatch.setattr(cache_module, "BUILD_LOCK_NOTICE_S", 0.1)
        path = tmp_path / "t.txt"
        path.write_bytes(sample_text(2000))
        with pytest.warns(UserWarning, match=f"waiting for another process .*pid {holder.pid}"):
            with pytest.raises(UsageError) as gave_up:
                load_data(path, 32, 0.0, cache_dir=cache)
        problem = gave_up.value.problems[0]
        assert problem.where == "--data-cache" and f"pid {holder.pid}" in problem.message
        assert "still locked by another build after" in problem.message
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()


def test_a_byte_store_with_ids_beyond_the_model_s_vocabulary_is_refused_before_training(tmp_path: Path, capsys) -> None:
    """Issue 29 item 12: a crafted byte store (resealed, ids >= 256 under a wider dtype) used to fail mid-run."""
    from cadence.cli import main

    store = _examples_store(tmp_path / "s")
    tokens = np.fromfile(store / "tokens.bin", dtype=np.uint8).astype("<u2")
    tokens[10] = 300
    tokens.tofile(store / "tokens.bin")
    meta = json.loads((store / "store.json").read_text())
    meta.update(dtype="uint16", vocab_size=512, tokenizer="bytes")
    (store / "store.json").write_text(json.dumps(meta))
    _reseal(store)
    assert main(["train", "--data", str(store), "--seq-len", "64", "--micro-batch-size", "2", "--grad-accum-steps",
                 "1", "--max-steps", "1", "--val-fraction", "0", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--data" in err and "beyond gpt-tiny's vocabulary of 256" in err and not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ spans (issue 37)
def _span_store(path: Path) -> TokenStore:
    writer = StoreWriter(path, kind="examples", vocab_size=256)
    # Tokens 10..21; trained: tokens 3..5 and 8..10 (a chat's two assistant turns), not the rest.
    writer.add_example("train", list(range(10, 22)), loss_start=0, row=1, spans=[(3, 5), (8, 11)])
    writer.add_example("train", [1, 2, 3, 4], loss_start=2, row=2)  # one run from loss_start, as before
    writer.finish({"fingerprint": "sha256:x"})
    return TokenStore.open(path)


def test_an_example_trains_exactly_its_spans_whatever_their_number(tmp_path: Path) -> None:
    store = _span_store(tmp_path / "s")
    assert store.meta["spans"] == {"train": 2} and store.meta["version"] == 3
    splits = splits_from_store(store, seq_len=16, val_fraction=0.0, from_cache=False)
    (ids, labels), (ids2, labels2) = as_lists(splits.train)
    assert ids == list(range(10, 21))
    # Position j predicts token j + 1: tokens 3, 4 (ids 13, 14) and 8, 9, 10 (ids 18, 19, 20) are the targets.
    assert labels == [-100, -100, 13, 14, -100, -100, -100, 18, 19, 20, -100]
    assert labels2 == [-100, 3, 4]
    assert splits.train.num_targets == 5 + 2


def test_truncating_an_example_with_spans_keeps_its_trained_end(tmp_path: Path) -> None:
    store = _span_store(tmp_path / "s")
    short = splits_from_store(store, seq_len=7, val_fraction=0.0, from_cache=False, too_long="truncate")
    ids, labels = as_lists(short.train)[0]
    # 12 tokens to 8: shifted by 2 (never past the token before the first target, token 2), so tokens 2..9 are kept;
    # token 10 (the second turn's end) is lost with the end.
    assert ids == list(range(12, 19)) and labels == [13, 14, -100, -100, -100, 18, 19]
    assert short.train.num_targets == 4 + 2
    assert sum(int((example.labels != -100).sum()) for example in short.train) == short.train.num_targets


@pytest.mark.parametrize("spans", [[(0, 2)], [(3, 13)], [(5, 7), (4, 6)], [(8, 11), (3, 5)]])
def test_spans_outside_their_example_or_out_of_order_are_refused_when_written(tmp_path: Path, spans) -> None:
    writer = StoreWriter(tmp_path / "s", kind="examples", vocab_size=256)
    with pytest.raises(ValueError, match="spans"):
        writer.add_example("train", list(range(10, 22)), loss_start=0, row=1, spans=spans)


def test_a_crafted_spans_file_is_refused_when_opened(tmp_path: Path) -> None:
    _span_store(tmp_path / "s")
    rows = np.fromfile(tmp_path / "s" / "train.spans", dtype="<i8").reshape(-1, 3)
    rows[1, 2] = 99  # past its example's 12 tokens
    rows.tofile(tmp_path / "s" / "train.spans")
    _reseal(tmp_path / "s")
    (tmp_path / "s" / ".verified.json").unlink(missing_ok=True)
    with pytest.raises(StoreDamaged, match="train.spans row 1"):
        TokenStore.open(tmp_path / "s")


def test_a_store_of_the_previous_version_is_not_misread(tmp_path: Path) -> None:
    _span_store(tmp_path / "s")
    meta = json.loads((tmp_path / "s" / "store.json").read_text())
    meta["version"] = 2
    (tmp_path / "s" / "store.json").write_text(json.dumps(meta))
    with pytest.raises(StoreDamaged, match="version 2"):
        TokenStore.open(tmp_path / "s")


def test_truncation_says_how_many_trained_tokens_it_lost(tmp_path: Path) -> None:
    store = _span_store(tmp_path / "s")
    short = splits_from_store(store, seq_len=7, val_fraction=0.0, from_cache=False, too_long="truncate")
    # The chat example's 5 trained tokens keep 4 (token 10 was cut with the end); the plain one fits.
    assert short.long_examples.targets_lost == 1
    assert "1 trained tokens were lost with what was cut" in short.long_examples.note()
