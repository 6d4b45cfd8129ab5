"""Tokenizers behind one protocol: text to ids, and the special tokens an example gets.

:class:`ByteTokenizer` (UTF-8 bytes as ids 0..255, for the built-in models) and :class:`HFTokenizer` (a transformers
tokenizer) are read by every data route alike (JSONL, datasets, chat): a format's rows become ids through this
protocol whatever the model, so a format is one function. ``transformers`` and ``tokenizers`` are imported only when
used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from cadence.data.batching import BYTE_EOS_ID, PAD_TOKEN_ID


@runtime_checkable
class Tokenizer(Protocol):
    """Text to ids. Each example gets ``bos_id`` in front and ``eos_id`` at the end, when they are not None (a
    tokenizer whose ``eos_on_text`` attribute is False, as :class:`ByteTokenizer`'s, ends only completions with it)."""

    # Read-only, as a frozen tokenizer's fields are.
    @property
    def vocab_size(self) -> int: ...  # every id is below this

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def identity(self) -> str: ...  # changes whenever the ids of some text could change (the cache key uses it)

    @property
    def name(self) -> str: ...  # short, for descriptions

    def encode(self, text: str) -> list[int]: ...  # without special tokens

    def encode_batch(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]: ...


@dataclass(frozen=True, kw_only=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: the built-in data's tokens, for models without a tokenizer.

    No BOS: 256 ids leave no room for special tokens. The end of sequence is the control byte
    :data:`cadence.data.batching.BYTE_EOS_ID`, after each completion only (``eos_on_text`` False), which keeps
    examples byte-identical to what :func:`cadence.data.read_jsonl` makes from the same records.
    """

    vocab_size: int = 256
    bos_id: int | None = None
    eos_id: int | None = BYTE_EOS_ID
    eos_on_text: bool = False
    """A text row gets no end of sequence (it is a document, continued as packed text is); a completion does."""
    identity: str = "bytes"
    name: str = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
        return [list(text.encode("utf-8")[:max_length]) for text in texts]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """The bytes of ``text`` and, for each, the index of the character it belongs to (a chat template's
        rendering is cut into turns by characters: :mod:`cadence.data.chat`)."""
        ids = list(text.encode("utf-8"))
        if len(ids) == len(text):  # ASCII: one byte per character
            return ids, list(range(len(text)))
        offsets = [index for index, char in enumerate(text) for _ in range(len(char.encode("utf-8")))]
        return ids, offsets

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Strings kept whole as one token: none (every id is a byte)."""
        return ()

    @property
    def hf_tokenizer(self) -> Any:
        """These bytes as a transformers tokenizer (``save_pretrained`` writes it; ``AutoTokenizer`` loads it back),
        for a byte-level model exported with ``--save-hf``: see :func:`byte_level_hf_tokenizer`."""
        return byte_level_hf_tokenizer()

    @property
    def config_token_ids(self) -> dict[str, int | None]:
        """The special-token ids an exported byte-level model's config must carry: a family's defaults (llama's BOS 1
        and EOS 2) mean nothing in bytes, and ``generate`` would stop at byte 0x02."""
        return {"bos_token_id": None, "eos_token_id": self.eos_id, "pad_token_id": PAD_TOKEN_ID}


def byte_level_hf_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` whose ids are the UTF-8 bytes of the text, exactly as cadence reads byte-level
    data: ``encode(text) == list(text.encode())`` for every text, ``decode`` the inverse; EOS is
    :data:`BYTE_EOS_ID` and the pad token :data:`PAD_TOKEN_ID`, no BOS.

    The ``tokenizers`` library (a dependency of transformers) describes it as a BPE without merges whose vocabulary
    holds the 128 ASCII characters as themselves (ids 0..127) and ``<0x80>``..``<0xFF>`` (ids 128..255), with byte
    fallback: every non-ASCII character becomes the bytes of its UTF-8 encoding, all of them 0x80 or above. No
    normaliser and no pre-tokenizer, so no byte is ever changed or dropped. The special tokens are the control
    characters themselves, so they take the ids of their bytes (text holding byte 4 reads it as the end, the same
    id cadence trained on)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {(chr(byte) if byte < 0x80 else f"<0x{byte:02X}>"): byte for byte in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])

    def special(byte: int) -> Any:
        return AddedToken(chr(byte), special=True, normalized=False)

    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=special(BYTE_EOS_ID),
                                   pad_token=special(PAD_TOKEN_ID), clean_up_tokenization_spaces=False)


class HFTokenizer:
    """A transformers tokenizer, encoding without special tokens; cadence adds BOS/EOS itself, per example.

    EOS is appended to every example (and so is a target) when the tokenizer has one: a model fine-tuned without it
    never learns where a text or completion ends. BOS is prepended only when the tokenizer itself adds it by default
    (Llama-style tokenizers), so examples start the way the model saw text in pretraining; gpt2 and qwen2 add none.
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        self.eos_id: int | None = hf_tokenizer.eos_token_id
        bos = hf_tokenizer.bos_token_id
        with_special, without = (hf_tokenizer.encode("a", add_special_tokens=flag) for flag in (True, False))
        self.bos_id: int | None = bos if bos is not None and with_special[:1] == [bos] != without[:1] else None
        # The serialised fast tokenizer is the whole vocabulary, merges and normalisation: hashing it catches a
        # retrained tokenizer saved under the same name.
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        digest = hashlib.sha256(backend.to_str().encode()).hexdigest()[:16] if backend is not None else "slow"
        self.identity = (f"{type(hf_tokenizer).__name__}:{hf_tokenizer.name_or_path}:{self.vocab_size}:{digest}"
                         f":bos={self.bos_id}:eos={self.eos_id}")
        self.name = f"{hf_tokenizer.name_or_path or type(hf_tokenizer).__name__} ({self.vocab_size} tokens)"

    def encode(self, text: str) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
        # Truncating inside the tokenizer keeps a 10 MB document from being tokenised in full to keep 512 tokens.
        limits = {"truncation": True, "max_length": max_length} if max_length is not None else {}
        return [list(ids) for ids in self.hf_tokenizer(list(texts), add_special_tokens=False, **limits)["input_ids"]]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """The ids of ``text`` without special tokens added, and the index of each token's first character (a chat
        template's rendering is cut into turns by characters: :mod:`cadence.data.chat`). Needs a fast tokenizer."""
        if not getattr(self.hf_tokenizer, "is_fast", False):
            raise ValueError(f"{self.name}: chat data needs a fast tokenizer (character offsets of its tokens)")
        encoded = self.hf_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [start for start, _ in encoded["offset_mapping"]]

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The strings the tokenizer keeps whole as one token: its added tokens (``<|im_end|>``, ``<tool_call>``)
        and its special tokens (BOS, EOS, ...); where a chat template's turn ends is among them."""
        decoder = getattr(self.hf_tokenizer, "added_tokens_decoder", {})
        added = [getattr(token, "content", str(token)) for token in decoder.values()]
        names = [*added, *getattr(self.hf_tokenizer, "all_special_tokens", [])]
        return tuple(name for name in dict.fromkeys(names) if name)


def as_tokenizer(tokenizer: Any | None) -> Tokenizer:
    """None -> :class:`ByteTokenizer`; a cadence tokenizer as is; a transformers tokenizer -> :class:`HFTokenizer`."""
    if tokenizer is None:
        return ByteTokenizer()
    return tokenizer if isinstance(tokenizer, Tokenizer) else HFTokenizer(tokenizer)


__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "as_tokenizer", "byte_level_hf_tokenizer"]
