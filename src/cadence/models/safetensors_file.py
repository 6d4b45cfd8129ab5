"""The safetensors format read and written a tensor at a time: what a sharded model's load and save need and the
``safetensors`` package does not offer (it reads through a mapping of the whole file, whose pages count in the
resident memory of every process reading it, and writes from a dict of every tensor at once).

A file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte range
(``data_offsets``, relative to the end of the header), and the tensors' bytes, back to back. :func:`read_header`
reads the header and :func:`read_tensor` a tensor or some of its rows; :func:`write_streamed` writes the header first
(every tensor's dtype and shape are known before any is gathered), then each tensor's bytes as it arrives, so a
writer holds one tensor at a time.
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

_HEADER_LIMIT = 100 * 2**20
"""A safetensors header past this is not a model's (a 100k-tensor model's header is a few MB)."""
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class WeightsUnreadable(ValueError):
    """A safetensors file whose header does not describe its tensors as the format says."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes start (in the file), its dtype and shape."""

    file: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, from its header: an 8-byte little-endian length, then JSON."""
    with open(file, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        if not 0 < size <= _HEADER_LIMIT:
            raise WeightsUnreadable(f"{file.name}: a header of {size} bytes")
        header = json.loads(handle.read(size))
    if not isinstance(header, dict):
        raise WeightsUnreadable(f"{file.name}: its header is not a JSON object")
    found: dict[str, StoredTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = _DTYPES[entry["dtype"]], tuple(int(n) for n in entry["shape"]), \
                entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise WeightsUnreadable(f"{file.name}: {str(name)[:80]} is not described as a tensor cadence reads") \
                from None
        if int(end) - int(begin) != math.prod(shape) * dtype.itemsize or int(begin) < 0:
            raise WeightsUnreadable(f"{file.name}: {str(name)[:80]}'s bytes do not match its shape")
        found[name] = StoredTensor(file, 8 + size + int(begin), dtype, shape)
    return found


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The header's name for ``dtype``."""
    for name, known in _DTYPES.items():
        if known == dtype:
            return name
    raise WeightsUnreadable(f"{dtype} has no safetensors name")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, dtype and shape (its bytes come later)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def _header(specs: list[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for spec in specs:
        size = math.prod(spec.shape) * spec.dtype.itemsize
        entries[spec.name] = {"dtype": safetensors_dtype(spec.dtype), "shape": list(spec.shape),
                              "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors start 8-byte aligned, as the safetensors package writes them
    return len(text).to_bytes(8, "little") + text


def write_streamed(path: Path | None, specs: list[TensorSpec], tensors: Iterable[torch.Tensor],
                   metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (one per spec, in order, each dropped once written) as the safetensors file ``path``,
    whole or not at all (a temporary sibling, fsync, rename). ``path`` None: the tensors are only consumed (a rank
    that takes part in gathering them and writes nothing). A failed write still consumes every tensor before it
    raises, so that ranks gathering them together all finish the gathers."""
    if len({spec.name for spec in specs}) != len(specs):
        raise ValueError("two tensors with one name")
    stream = iter(tensors)
    if path is None:
        _drain(stream)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(_header(specs, metadata))
            for spec in specs:
                tensor = next(stream).detach().to("cpu").contiguous()
                if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                    raise ValueError(f"{spec.name} arrived as {tensor.dtype} {tuple(tensor.shape)}, not as announced")
                handle.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
                del tensor
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        _drain(stream)  # the other ranks' gathers complete
        raise


def _drain(stream: Iterator[torch.Tensor]) -> None:
    """Consume the rest of ``stream``, each tensor dropped as it comes (a loop variable would keep the previous
    one alive while the next is gathered)."""
    collections.deque(stream, maxlen=0)


def read_tensor(stored: StoredTensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Rows ``[start, stop)`` of a stored tensor (None: all of it), as stored: only those bytes are read, into this
    process's memory (no mapping of the file)."""
    shape = stored.shape
    start, stop = rows if rows is not None else (0, shape[0] if shape else 1)
    row_bytes = math.prod(shape[1:]) * stored.dtype.itemsize
    buffer = bytearray((stop - start) * row_bytes)
    with open(stored.file, "rb") as handle:
        handle.seek(stored.offset + start * row_bytes)
        view, filled = memoryview(buffer), 0
        while filled < len(buffer):
            count = handle.readinto(view[filled:])
            if not count:
                raise WeightsUnreadable(f"{stored.file.name} ends before a tensor's bytes do")
            filled += count
    if not buffer:
        return torch.empty((0, *shape[1:]), dtype=stored.dtype)
    return torch.frombuffer(buffer, dtype=stored.dtype).reshape((stop - start, *shape[1:]) if shape else ())


def copy_tensors(source: Path, target: Path, names: list[str], metadata: dict[str, str] | None = None) -> None:
    """The tensors ``names`` of the safetensors file ``source`` as the file ``target``, read and written one at a
    time."""
    stored = read_header(source)
    missing = [name for name in names if name not in stored]
    if missing:
        raise WeightsUnreadable(f"{source.name} has no {missing[0]}")
    specs = [TensorSpec(name, stored[name].dtype, stored[name].shape) for name in names]
    write_streamed(target, specs, (read_tensor(stored[name]) for name in names), metadata)


__all__ = ["StoredTensor", "copy_tensors", "TensorSpec", "WeightsUnreadable", "read_header", "read_tensor", "safetensors_dtype",
           "write_streamed"]
