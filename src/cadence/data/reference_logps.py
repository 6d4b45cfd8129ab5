"""A reference model's log-probabilities computed once and kept beside the token store (``--reference-logprobs
precomputed``): one record, one reader and one writer.

A row is found by what it is, not where it sits: its key is a digest of its token ids and labels up to its last
target (:func:`row_keys`). A causal model's log-probability of a row's targets depends on nothing after the last one,
so the right padding a micro-batch adds, the split, the micro-batch size, the rank and a KTO example's mismatched
sequence (built when it is read) all find the same key, and one file serves every cut of the same data.

The file is ``<store>/reference-logps/<identity>.safetensors``: ``keys`` ([N, 16] uint8) and ``logps`` ([N] fp32),
its metadata the identity it was computed under (the store's digest, the reference weights' identity, the precision
and how the head ran). Another store, other reference weights or another precision is another file; a run that
finds its rows already there computes nothing (a resume, a later run on the same data and reference).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from cadence.data.batching import IGNORE_INDEX
from cadence.output_files import atomic_write_bytes

KEY_BYTES = 16
FOLDER = "reference-logps"
_FORMAT = "cadence-reference-logps/1"


def row_keys(input_ids: torch.Tensor, labels: torch.Tensor) -> list[bytes | None]:
    """Each row's key (see the module docstring); None for a row without a target (it scores 0)."""
    ids, targets = input_ids.detach().cpu().numpy(), labels.detach().cpu().numpy()
    keys: list[bytes | None] = []
    for row_ids, row_labels in zip(ids, targets):
        trained = np.flatnonzero(row_labels != IGNORE_INDEX)
        if not len(trained):
            keys.append(None)
            continue
        end = int(trained[-1]) + 1
        digest = hashlib.blake2b(digest_size=KEY_BYTES)
        digest.update(np.ascontiguousarray(row_ids[:end], dtype=np.int64).tobytes())
        digest.update(np.ascontiguousarray(row_labels[:end], dtype=np.int64).tobytes())
        keys.append(digest.digest())
    return keys


@dataclass(frozen=True, kw_only=True)
class LogpsIdentity:
    """What a file of reference log-probabilities was computed from; another value is another file."""

    store_digest: str
    """The token store's digest (which tokens exactly)."""
    reference: str
    """The reference weights' identity (a digest of the starting weights, or of --reference-model's files)."""
    precision: str
    """The autocast the reference ran under (fp32, bf16, fp16): its log-probabilities round differently."""
    head: str
    """How the head ran: "targets" (the target positions only) or "all" (every position's logits)."""

    def as_dict(self) -> dict[str, str]:
        return {"store_digest": self.store_digest, "reference": self.reference, "precision": self.precision,
                "head": self.head}

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:24]

    def path(self, store: Path) -> Path:
        """Where the file of this identity lives beside the token store ``store``."""
        return store / FOLDER / f"{self.digest}.safetensors"


@dataclass(frozen=True, kw_only=True)
class ReferenceLogps:
    """The record: each row's summed reference log-probability, by row key."""

    identity: LogpsIdentity
    logps: Mapping[bytes, float] = field(default_factory=dict)

    def missing(self, keys: Iterable[bytes | None]) -> list[bytes]:
        """The keys (rows with a target) the record does not hold yet, each once."""
        return list(dict.fromkeys(key for key in keys if key is not None and key not in self.logps))

    def with_rows(self, logps: Mapping[bytes, float]) -> ReferenceLogps:
        return ReferenceLogps(identity=self.identity, logps={**self.logps, **logps})

    @property
    def held_bytes(self) -> int:
        """What the record holds in memory: a key and an fp32 value per row."""
        return len(self.logps) * (KEY_BYTES + 4)

    # ------------------------------------------------------------------------------------------------ reader, writer
    def write(self, store: Path) -> Path:
        """The record into its file beside ``store`` (atomically: a reader never sees half of one)."""
        path = self.identity.path(store)
        path.parent.mkdir(parents=True, exist_ok=True)
        keys = list(self.logps)
        tensors = {"keys": torch.tensor(np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), KEY_BYTES)
                                        if keys else np.zeros((0, KEY_BYTES), dtype=np.uint8)),
                   "logps": torch.tensor([self.logps[key] for key in keys], dtype=torch.float32)}
        atomic_write_bytes(path, save(tensors, metadata={"format": _FORMAT, **self.identity.as_dict()}))
        return path

    @classmethod
    def read(cls, store: Path, identity: LogpsIdentity) -> ReferenceLogps:
        """The record of ``identity`` beside ``store``; empty when there is none yet, or when the file is not one
        (it is then computed again and replaced)."""
        path = identity.path(store)
        try:
            data = path.read_bytes()
            tensors = load(data)
            metadata = json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__") or {}
        except (OSError, SafetensorError, ValueError):
            return cls(identity=identity)
        keys, values = tensors.get("keys"), tensors.get("logps")
        if (metadata.get("format") != _FORMAT or {k: metadata.get(k) for k in identity.as_dict()} != identity.as_dict()
                or keys is None or values is None or keys.shape != (len(values), KEY_BYTES)):
            return cls(identity=identity)
        raw = keys.numpy().tobytes()
        logps = {raw[i * KEY_BYTES:(i + 1) * KEY_BYTES]: float(v) for i, v in enumerate(values.tolist())}
        return cls(identity=identity, logps=logps)


__all__ = ["FOLDER", "KEY_BYTES", "LogpsIdentity", "ReferenceLogps", "row_keys"]
