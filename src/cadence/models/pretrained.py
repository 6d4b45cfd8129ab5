"""A model directory's weights read once across the ranks of an FSDP2 run (issue 38): built on the meta device, then
each rank reads only its own shard's rows of every parameter from the directory's safetensors.

``from_pretrained`` on every rank holds N whole fp32 copies of the model in host memory before FSDP2 keeps 1/N of
each (pytorch#105840: 160 GB x 8 for a 40B model). Here the model is built with its parameters on the meta device
(:func:`parameters_on_meta`: no storage, no init) and its buffers real, sharded by ``fully_shard`` as it is, and only
then given storage for its shards (``to_empty``); :func:`load_shards` fills each rank's rows straight from the files
(the safetensors header says where each tensor's bytes are; only those rows are read), cast to fp32 as
``from_pretrained(dtype=float32)`` casts them. The summed host memory of the ranks is about one model, not N.

What ``from_pretrained`` does besides reading tensors, this does too: tied weights (the LM head IS the embedding's
parameter, filled once under whichever of its names the file has), the buffers the file does not hold (rotary
``inv_freq``, computed by the module's constructor: kept from the build, restored after ``to_empty``), and persistent
buffers the file does hold (read whole). A directory whose files do not name every parameter with its shape (key
renames between transformers versions, ``pytorch_model.bin`` only, a base model's prefix) is not read this way:
:meth:`PretrainedFiles.coverage_problem` says why, and the caller loads it with ``from_pretrained`` as before.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cadence.models.safetensors_file import StoredTensor, WeightsUnreadable, read_header, read_tensor

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
@dataclass(frozen=True)
class PretrainedFiles:
    """The tensors of a ``save_pretrained`` directory's safetensors, each with where its bytes are."""

    directory: Path
    tensors: dict[str, StoredTensor]

    @classmethod
    def from_directory(cls, directory: Path) -> PretrainedFiles | None:
        """The directory's safetensors (one file, or several listed by the index); None when it has neither or they
        do not read."""
        index = directory / SAFETENSORS_INDEX
        try:
            if index.is_file():
                listed = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
                files = sorted({directory / name for name in listed.values() if isinstance(name, str)
                                and "/" not in name})
            else:
                files = [directory / SAFETENSORS_FILE] if (directory / SAFETENSORS_FILE).is_file() else []
            tensors = {name: stored for file in files for name, stored in read_header(file).items()}
        except (OSError, ValueError, AttributeError, WeightsUnreadable):
            return None
        return cls(directory, tensors) if tensors else None

    def coverage_problem(self, model: nn.Module) -> str | None:
        """Why :func:`load_shards` cannot fill ``model`` from these files (None: it can): a parameter none of whose
        names is in the files with its shape."""
        for names, param in _parameters_by_identity(model):
            if not any(name in self.tensors and self.tensors[name].shape == tuple(param.shape) for name in names):
                return f"{names[0]} {tuple(param.shape)} is not in its safetensors under that name and shape"
        return None

    def read_rows(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` (None: all of it), as stored; only those bytes are read."""
        return read_tensor(self.tensors[name], rows)


def _parameters_by_identity(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Each distinct parameter with all its names (a tied LM head has two)."""
    named: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        named.setdefault(id(param), ([], param))[0].append(name)
    return list(named.values())


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and keep their buffers real.

    Every parameter is moved to meta as it is registered, so at most one layer's tensor is ever allocated and none
    is initialised afterwards (an init on a meta tensor does nothing). Buffers stay as the constructors computed them:
    non-persistent ones (rotary ``inv_freq``) are in no checkpoint, and a meta build would lose them."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(param)
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    # Patched through setattr: replacing a method of a class is what this does, not a mistake to type-check away.
    setattr(nn.Module, "register_parameter", on_meta)
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", register)


def _rows(param: Any) -> tuple[int, int] | None:
    """The rows of the whole tensor that this rank's shard of ``param`` holds, or None for a tensor held whole.

    FSDP2 shards dim 0 as ``torch.chunk`` does: ceil(rows / world) rows per rank, the last ranks' shards shorter or
    empty. Checked against the local shard's shape, so a layout other than that is an error, never wrong rows."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return None
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"a parameter is sharded as {param.placements}, not FSDP2's Shard(0)")
    rows, world, rank = param.shape[0], param.device_mesh.size(), param.device_mesh.get_local_rank()
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    stop = min(start + chunk, rows)
    if param.to_local().shape[0] != stop - start:
        raise ValueError(f"a shard has {param.to_local().shape[0]} rows where torch.chunk gives {stop - start}")
    return start, stop


@torch.no_grad()
def load_shards(model: nn.Module, files: PretrainedFiles, device: torch.device) -> None:
    """Give ``model`` (built under :func:`parameters_on_meta`, then sharded by FSDP2, or not sharded at all) storage
    on ``device`` and fill it from ``files``: each rank reads only its own rows of each parameter. Every rank calls
    it; it runs no collective."""
    from torch.distributed.tensor import DTensor

    buffers = {name: buffer for name, buffer in model.named_buffers() if buffer is not None}
    persistent = set(model.state_dict().keys())
    aliases = [names for names, _ in _parameters_by_identity(model) if len(names) > 1]
    model.to_empty(device=device)
    for names in aliases:  # to_empty gives each module a parameter of its own: tied weights are tied again
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, shared)
    for names, param in _parameters_by_identity(model):
        name = next(name for name in names if name in files.tensors)
        rows = _rows(param)
        local = param.to_local() if isinstance(param, DTensor) else param  # rows is None for a tensor held whole
        local.copy_(files.read_rows(name, rows))  # cast as from_pretrained(dtype=float32) casts
    for name, buffer in buffers.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        held = module._buffers[attr]
        if held is None:
            continue
        if name in persistent and name in files.tensors:
            held.copy_(files.read_rows(name, None))
        else:
            held.copy_(buffer)


__all__ = ["PretrainedFiles", "load_shards", "parameters_on_meta"]
