"""Data for training: the built-in corpus, text and JSONL sources, the token store they are read through, packing,
padding and micro-batch order.

Byte-level sources' tokens are bytes (0..255), so they work with the byte-level built-in GPT (vocab size 256);
:mod:`cadence.data.hf` adds datasets sources and real tokenizers, through the same store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence.lazy import lazy_exports

if TYPE_CHECKING:  # the type checker's view of the names below (a test keeps the two the same)
    from cadence.data.batching import (
        BYTE_EOS_ID,
        IGNORE_INDEX,
        PAD_TOKEN_ID,
        Example,
        TokenDataset,
        collate,
        epoch_order,
        iterate_micro_batches,
        make_example,
        micro_batch_indices,
    )
    from cadence.data.cache import default_cache_dir
    from cadence.data.choices import TOO_LONG_CHOICES, TooLong
    from cadence.data.corpus import corpus_bytes, corpus_description, corpus_files, stdlib_root
    from cadence.data.jsonl import read_jsonl
    from cadence.data.load import (
        byte_recipe,
        bytes_fingerprint,
        files_fingerprint,
        is_store,
        load_data,
        open_prepared_store,
    )
    from cadence.data.sources import BYTES_TOKENIZER
    from cadence.data.splits import DataSplits, split_validation, splits_from_store
    from cadence.data.store import TokenStore
    from cadence.data.store_datasets import PackedSequences, StoredExamples
    from cadence.data.text import pack_bytes, read_text_source
    from cadence.data.too_long import LongExamples

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "cadence.data.batching": (
        "BYTE_EOS_ID", "IGNORE_INDEX", "PAD_TOKEN_ID", "Example", "TokenDataset", "collate", "epoch_order",
        "iterate_micro_batches", "make_example", "micro_batch_indices"),
    "cadence.data.cache": ("default_cache_dir",),
    "cadence.data.corpus": ("corpus_bytes", "corpus_description", "corpus_files", "stdlib_root"),
    "cadence.data.jsonl": ("read_jsonl",),
    "cadence.data.load": (
        "byte_recipe", "bytes_fingerprint", "files_fingerprint", "is_store", "load_data", "open_prepared_store"),
    "cadence.data.sources": ("BYTES_TOKENIZER",),
    "cadence.data.splits": ("DataSplits", "split_validation", "splits_from_store"),
    "cadence.data.store": ("TokenStore",),
    "cadence.data.store_datasets": ("PackedSequences", "StoredExamples"),
    "cadence.data.text": ("pack_bytes", "read_text_source"),
    "cadence.data.choices": ("TOO_LONG_CHOICES", "TooLong"),
    "cadence.data.too_long": ("LongExamples",),
})
