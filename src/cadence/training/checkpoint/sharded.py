"""The sharded format (``dcp``, FSDP2): every rank writes its own shard of the model and optimizer state with
torch.distributed.checkpoint (DCP), and nothing is gathered; loading reshards to whatever world size reads it, and one
process assembles the whole model's weights without a process group (``cadence sample``, ``cadence export``).

DCP writes one ``__RANK_0.distcp`` per rank (``single_file_per_rank``: the writer's rank is the file's prefix) and rank 0
a ``.metadata`` index. Only tensors go through DCP: the optimizer's non-tensor state (its param groups, a Python step
count) is returned to the caller for the JSON training state, so no object DCP would store as pickled bytes is ever
written, and none is read.

What guards a checkpoint from someone else. DCP reads the ``.metadata`` with ``pickle.load``, and a byte item with
``torch.load(weights_only=False)``: either could run code. Here the ``.metadata`` is read by :class:`SafeReader`
through an unpickler that resolves only an allow-list of DCP's own metadata classes, ``torch.Size``, dtypes, layouts
and paths (anything else is refused before it is called), and the index must describe tensors only, each stored in
a ``.distcp`` of this folder: a byte item (``BytesStorageMetadata``) or a path elsewhere is refused. The tensors
themselves DCP reads with ``torch.load(weights_only=True)``, torch's own pickle-free-of-code loader. So, as with the
single-file format, a checkpoint from someone else can damage a run at worst, never run code in it.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from cadence.distributed.ranks import Ranks, unwrap
from cadence.training.checkpoint.format import BY_NAME, Captured, WeightsUnreadable
from cadence.training.components import Components

DCP_METADATA_FILE = ".metadata"
SHARD_SUFFIX = ".distcp"
_SHARD_NAME = re.compile(r"^__\d+_\d+" + re.escape(SHARD_SUFFIX) + "$")
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    *((_METADATA_MODULE, name) for name in ("Metadata", "MetadataIndex", "ChunkStorageMetadata",
                                            "TensorStorageMetadata", "TensorProperties", "StorageMeta",
                                            "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch.strided and the like by name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}
"""Every global a ``.metadata`` written by DCP's FileSystemWriter names (found by unpickling one with every lookup
recorded), besides torch's dtypes."""


class MetadataRefused(ValueError):
    """A ``.metadata`` that names something outside the allow-list, or that describes more than tensors in shards."""


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise MetadataRefused(f"{DCP_METADATA_FILE} names {module}.{name}, which a DCP index never holds: not read "
                              f"(unpickling it could run code)")


def read_metadata(path: Path) -> Metadata:
    """The ``.metadata`` of a DCP checkpoint folder, through the allow-list, checked to index tensors in shards only."""
    with open(path / DCP_METADATA_FILE, "rb") as handle:
        try:
            metadata = _AllowListUnpickler(io.BytesIO(handle.read())).load()
        except MetadataRefused:
            raise
        except Exception as err:  # a damaged pickle raises whatever its opcodes lead to
            raise MetadataRefused(f"{DCP_METADATA_FILE} does not parse ({str(err)[:200]})") from err
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise MetadataRefused(f"{DCP_METADATA_FILE} is not a DCP index")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise MetadataRefused(f"{DCP_METADATA_FILE} stores {str(key)[:80]} as {type(entry).__name__}, not a "
                                  f"tensor (cadence writes tensors only; a byte item would be unpickled)")
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or not _SHARD_NAME.match(relative):
            raise MetadataRefused(f"{DCP_METADATA_FILE} points at {str(relative)[:80]!r}, not a shard of this folder")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader with the ``.metadata`` read by :func:`read_metadata` (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise MetadataRefused("per-rank metadata files are not written by cadence")
        metadata = read_metadata(Path(self.path))
        storage = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id
        metadata.storage_meta = storage
        return metadata


def _split_optimizer_state(state: object) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizer's per-parameter state (``get_optimizer_state_dict``'s ``state``: an entry per parameter name)
    as (tensors for DCP, everything else for the JSON state)."""
    tensors: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for name, entry in cast(dict[str, dict[str, Any]], state).items():
        for key, value in entry.items():
            (tensors if isinstance(value, torch.Tensor) else scalars).setdefault(name, {})[key] = value
    return tensors, scalars


_ONE_PROCESS_WARNING = ".*assuming the intent is to"
"""DCP warns on every call without a process group that it assumes one process: that is what is meant."""


def shard_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's shards of the model and optimizer tensors (DTensors under FSDP2: views of the live state), and
    the optimizer's non-tensor state (``param_groups`` keyed by parameter name, per-parameter ``scalars``) for the
    JSON training state. Every rank calls it (FSDP2 takes part)."""
    module = unwrap(model)
    model_state = get_model_state_dict(module)
    optimizer_state = get_optimizer_state_dict(module, optimizer)
    tensors, scalars = _split_optimizer_state(optimizer_state["state"])
    return ({"model": model_state, "optimizer": tensors},
            {"param_groups": optimizer_state["param_groups"], "scalars": scalars, "has_state": bool(tensors)})


def write_shards(folder: Path, tensors: dict[str, Any], *, group: Any = None) -> None:
    """Every rank writes its shards (:func:`shard_state`) into ``folder``: a collective over ``group`` (the default
    process group when None; a background save runs over a group of its own, so that it never meets the training's
    collectives)."""
    writer = FileSystemWriter(str(folder), single_file_per_rank=True, thread_count=1, sync_files=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS_WARNING)
        dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=not dist.is_initialized())


def read_shards(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                saved: dict[str, Any]) -> None:
    """Load what :func:`write_shards` wrote into this run's model and optimizer, resharded to its world size (every
    rank calls it; one process reads without a process group). ``saved``: the non-tensor state it returned."""
    module = unwrap(model)
    model_state = get_model_state_dict(module)
    optimizer_state: dict[str, Any] | None = None
    tensors: dict[str, Any] = {}
    if saved.get("has_state"):  # a mid-window checkpoint before the first step has no optimizer state yet
        optimizer_state = get_optimizer_state_dict(module, optimizer)  # builds the state to load into
        tensors, _ = _split_optimizer_state(optimizer_state["state"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS_WARNING)
        dcp.load({"model": model_state, "optimizer": tensors}, storage_reader=SafeReader(str(folder)),
                 no_dist=not dist.is_initialized())
    set_model_state_dict(module, model_state)
    if optimizer_state is None:
        return
    state: dict[str, Any] = {name: dict(entry) for name, entry in tensors.items()}
    for name, entry in dict(saved.get("scalars") or {}).items():
        state.setdefault(name, {}).update(entry)
    set_optimizer_state_dict(module, optimizer, {"state": state, "param_groups": saved["param_groups"]})


def read_model_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights of a sharded checkpoint, assembled from every rank's shard in this one process
    without a process group (``cadence sample --weights step-N``): what ``model.safetensors`` holds in the
    single-file format, by the same names."""
    metadata = read_metadata(folder)
    weights = {key.removeprefix("model."): torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
               for key, entry in metadata.state_dict_metadata.items()
               if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS_WARNING)
        dcp.load({"model": weights}, storage_reader=SafeReader(str(folder)), no_dist=True)
    return weights


def shard_files(folder: Path, rank: int) -> list[str]:
    """The shard files ``rank`` wrote into ``folder`` (DCP names them after their writer's rank)."""
    return sorted(path.name for path in folder.glob(f"__{rank}_*{SHARD_SUFFIX}"))


class Sharded:
    """:class:`~cadence.training.checkpoint.format.CheckpointFormat` ``dcp``: one DCP shard per rank and the
    ``.metadata`` index rank 0 writes; the optimizer's non-tensor state goes into the JSON training state."""

    name = "dcp"
    files = (DCP_METADATA_FILE,)
    every_rank_writes = True

    def describe(self) -> str:
        return "sharded: one torch.distributed.checkpoint shard per rank (.distcp) and a .metadata index"

    def problem(self, listed: Collection[str]) -> str | None:
        if not any(name.endswith(SHARD_SUFFIX) for name in listed):
            return f"the manifest lists no {SHARD_SUFFIX} shard"
        return None

    def capture(self, parts: Components, ranks: Ranks) -> Captured:
        tensors, rest = shard_state(parts.model, parts.optimizer)
        return Captured(tensors=tensors, optimizer={"state": {}, **rest}, info={"optimizer_format": BY_NAME})

    def write(self, folder: Path, captured: Captured, ranks: Ranks, group: Any) -> list[str]:
        write_shards(folder, captured.tensors or {}, group=group)  # every rank its own shard; rank 0 the index
        return [*shard_files(folder, ranks.rank), *((DCP_METADATA_FILE,) if ranks.is_main else ())]

    def load(self, folder: Path, saved: dict[str, Any], info: Mapping[str, Any], parts: Components) -> None:
        try:
            read_shards(folder, parts.model, parts.optimizer, saved)
        except CheckpointException as err:  # a BaseException: a state that does not fit, said as the others are
            raise ValueError((str(err).splitlines() or [""])[0][:300]) from None

    def weights_at(self, folder: Path) -> Path:
        return folder

    def read_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        try:
            return read_model_tensors(folder)
        except (MetadataRefused, OSError, ValueError, RuntimeError, CheckpointException) as err:
            raise WeightsUnreadable(folder, str(err).splitlines()[0] if str(err) else type(err).__name__) from None


FORMAT = Sharded()
