"""Data for training: the built-in corpus, text and JSONL sources, the token store they are read through, packing,
padding and micro-batch order.

Byte-level sources' tokens are bytes (0..255), so they work with the byte-level built-in GPT (vocab size 256);
:mod:`cadence.data.hf` adds datasets sources and real tokenizers, through the same store.
"""

from __future__ import annotations

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
from cadence.data.store import PackedSequences, StoredExamples, TokenStore
from cadence.data.text import pack_bytes, read_text_source
from cadence.data.too_long import TOO_LONG_CHOICES, LongExamples, TooLong

__all__ = [
    "BYTE_EOS_ID",
    "BYTES_TOKENIZER",
    "LongExamples",
    "TOO_LONG_CHOICES",
    "TooLong",
    "IGNORE_INDEX",
    "PackedSequences",
    "StoredExamples",
    "TokenStore",
    "byte_recipe",
    "default_cache_dir",
    "is_store",
    "open_prepared_store",
    "split_validation",
    "splits_from_store",
    "PAD_TOKEN_ID",
    "DataSplits",
    "bytes_fingerprint",
    "files_fingerprint",
    "Example",
    "TokenDataset",
    "collate",
    "corpus_bytes",
    "corpus_description",
    "corpus_files",
    "epoch_order",
    "iterate_micro_batches",
    "load_data",
    "make_example",
    "micro_batch_indices",
    "pack_bytes",
    "read_jsonl",
    "read_text_source",
    "stdlib_root",
]
