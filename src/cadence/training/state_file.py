"""Nested training state (optimizer, scheduler, scaler, counters, RNG) written and read without pickle.

A checkpoint travels: it is shared, downloaded, copied off clusters. Unpickling one (``torch.load`` with
``weights_only=False``) runs whatever code its author put in it, and the checksum manifest beside it cannot help, since
whoever edits the state can recompute the manifest too. So the state is split into two files that can only hold data:

- ``NAME.json``: the structure (dicts, lists, tuples, numbers, strings, None) with every tensor replaced by a reference;
- ``NAME.safetensors``: the tensors, by reference name.

Reading them parses JSON and safetensors and nothing else; an unknown marker or a malformed file is a ``StateFileError``,
never an import or a call. The encoding is exact for what PyTorch, NumPy and Python keep in a state dict: tuples stay
tuples (``random.setstate`` insists), integer dict keys stay integers (``Optimizer.state_dict`` uses them), NumPy arrays
come back as NumPy arrays of their dtype (NumPy's RNG state), and floats round-trip bit for bit, inf and nan included.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from cadence.output_files import fsync_file
from cadence.records import NotJson, parse_json

STRUCTURE_SUFFIX = ".json"
TENSORS_SUFFIX = ".safetensors"
_FORMAT = "cadence-state/1"

# One-key JSON objects with these keys stand for a value JSON cannot hold directly. A plain dict whose keys are all
# strings not starting with "__" is written as a JSON object; any other dict goes through "__items__", so a user's
# key can never be mistaken for a marker.
_TENSOR, _TUPLE, _ITEMS, _NDARRAY = "__tensor__", "__tuple__", "__items__", "__ndarray__"
_NDARRAY_KINDS = "biuf"
"""NumPy dtype kinds a stored array may have: bool, signed and unsigned integers, floats."""


class StateFileError(ValueError):
    """The state files are malformed (damaged or not written by cadence)."""


def state_file_names(stem: str) -> tuple[str, str]:
    """The two file names a state called ``stem`` is written as."""
    return stem + STRUCTURE_SUFFIX, stem + TENSORS_SUFFIX


def write_state(folder: Path, stem: str, state: Any) -> None:
    """Write ``state`` as ``folder/stem.json`` and ``folder/stem.safetensors``, each fsynced."""
    tensors: dict[str, torch.Tensor] = {}
    structure = {"format": _FORMAT, "state": _encode(state, tensors, "state")}
    structure_name, tensors_name = state_file_names(stem)
    # safetensors refuses tensors that share storage and non-contiguous ones: each gets its own compact copy.
    save_file({key: value.detach().to("cpu").contiguous().clone() for key, value in tensors.items()},
              str(folder / tensors_name))
    fsync_file(folder / tensors_name)
    with open(folder / structure_name, "w", encoding="utf-8") as handle:
        json.dump(structure, handle, allow_nan=True)
        handle.flush()
        os.fsync(handle.fileno())


def read_state(folder: Path, stem: str) -> Any:
    """The state written by ``write_state``; ``StateFileError`` when either file is malformed."""
    structure_name, tensors_name = state_file_names(stem)
    try:
        structure = parse_json((folder / structure_name).read_bytes(), folder / structure_name)
        tensors = load_file(str(folder / tensors_name))
    except (OSError, NotJson, ValueError, SafetensorError) as err:
        raise StateFileError(f"{folder / structure_name}: unreadable training state ({err})") from err
    if not isinstance(structure, dict) or structure.get("format") != _FORMAT or "state" not in structure:
        raise StateFileError(f"{folder / structure_name}: not a cadence training state ({_FORMAT})")
    try:
        return _decode(structure["state"], tensors)
    except RecursionError as err:
        raise StateFileError(f"{folder / structure_name}: training state nested too deeply") from err


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value
        return {_TENSOR: key}
    if isinstance(value, np.ndarray):
        return {_NDARRAY: {"dtype": value.dtype.str, "shape": list(value.shape), "data": value.ravel().tolist()}}
    if isinstance(value, np.generic):  # a NumPy scalar: its Python value is exact for the types state dicts use
        return _encode(value.item(), tensors, where)
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(item, tensors, f"{where}[{i}]") for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(item, tensors, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(key, str) and not key.startswith("__") for key in value):
            return {key: _encode(item, tensors, f"{where}.{key}") for key, item in value.items()}
        return {_ITEMS: [[_encode(key, tensors, where), _encode(item, tensors, f"{where}[{key!r}]")]
                         for key, item in value.items()]}
    raise TypeError(f"{where}: a {type(value).__name__} cannot be stored in a training state without pickle")


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    if not isinstance(value, dict):
        return value  # None, bool, int, float, str: JSON gives them back as they were
    if len(value) == 1:
        ((marker, inner),) = value.items()
        if marker == _TENSOR:
            if not isinstance(inner, str) or inner not in tensors:
                raise StateFileError(f"the structure refers to a tensor {inner!r} that the tensor file lacks")
            return tensors[inner]
        if marker == _TUPLE:
            return tuple(_decode(item, tensors) for item in _expect_list(inner, marker))
        if marker == _ITEMS:
            pairs = [_expect_list(pair, marker) for pair in _expect_list(inner, marker)]
            if any(len(pair) != 2 for pair in pairs):
                raise StateFileError(f"{marker} holds something other than key/value pairs")
            return {_hashable(_decode(key, tensors)): _decode(item, tensors) for key, item in pairs}
        if marker == _NDARRAY:
            return _decode_ndarray(inner)
    if any(key.startswith("__") for key in value):
        raise StateFileError(f"unknown marker among {sorted(value)[:3]}")
    return {key: _decode(item, tensors) for key, item in value.items()}


def _decode_ndarray(spec: Any) -> np.ndarray:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data"}:
        raise StateFileError(f"{_NDARRAY} needs dtype, shape and data")
    try:
        dtype = np.dtype(spec["dtype"])
        # Numbers only: an object array would be pickle again by another name, and a string or void dtype of a
        # crafted width (<U2000000000) would allocate gigabytes for one element. (NumPy's RNG state is uint32.)
        if dtype.kind not in _NDARRAY_KINDS:
            raise StateFileError(f"{_NDARRAY} of dtype {dtype.str!r}: only numeric arrays are stored, never an "
                                 f"object or string array")
        if not isinstance(spec["shape"], list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                          for n in spec["shape"]):
            raise StateFileError(f"{_NDARRAY} shape {str(spec['shape'])[:40]} is not a list of sizes")
        return np.asarray(spec["data"], dtype=dtype).reshape(spec["shape"])
    except (TypeError, ValueError, OverflowError) as err:
        # OverflowError: a number too large for the dtype (a huge value in a uint32 array)
        raise StateFileError(f"malformed {_NDARRAY} ({str(err)[:200]})") from err


def _expect_list(value: Any, marker: str) -> list[Any]:
    if not isinstance(value, list):
        raise StateFileError(f"{marker} must hold a list")
    return value


def _hashable(key: Any) -> Any:
    if isinstance(key, list):  # a tuple key decodes through _TUPLE; a bare list cannot be a dict key
        raise StateFileError("a dict key is a list")
    return key
