"""Tests of the built-in corpus (the standard library's source)."""

from __future__ import annotations

import sys

from cadence.data import corpus_bytes, corpus_description, corpus_files, stdlib_root


def test_files_sorted_and_without_site_packages() -> None:
    files = corpus_files()
    assert len(files) > 100
    relative = [f.relative_to(stdlib_root()).as_posix() for f in files]
    assert relative == sorted(relative)
    assert all(r.endswith(".py") for r in relative)
    assert not any("site-packages" in r.split("/") for r in relative)
    assert "os.py" in relative


def test_prefix_is_deterministic_and_respects_max_bytes() -> None:
    small = corpus_bytes(10_000)
    assert len(small) == 10_000
    assert small == corpus_bytes(10_000)
    larger = corpus_bytes(50_000)
    assert len(larger) == 50_000 and larger.startswith(small)
    first = corpus_files()[0].read_bytes()
    assert larger.startswith(first[:50_000])
    assert corpus_bytes(0) == b""


def test_full_corpus_is_large_and_text() -> None:
    data = corpus_bytes()
    assert len(data) > 1_000_000
    assert b"def " in data and b"import " in data


def test_description() -> None:
    text = corpus_description()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert text == f"Python {version} standard library source, {len(corpus_files())} files"
