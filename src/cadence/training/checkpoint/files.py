"""The whole format (``files``: one process, DDP; and every checkpoint cadence wrote before the sharded one): the whole
model in ``model.safetensors``, written by rank 0, and the whole optimizer state in the JSON training state.

The optimizer state is keyed by parameter index (torch's own ``state_dict``), or, in a checkpoint an FSDP2 run wrote
before FSDP2 got the sharded format, by parameter name (the gathered full state). Either loads into either kind of
run: the keys are translated through the optimizer's parameter order, so a checkpoint moves between one process, DDP
and FSDP2, and between world sizes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from cadence.distributed.ranks import Ranks, full_model_state, unwrap
from cadence.training.checkpoint.format import BY_INDEX, BY_NAME, Captured, WeightsUnreadable
from cadence.training.components import Components
from cadence.training.run_dir import WEIGHTS_FILE, save_weights


class WholeFiles:
    """:class:`~cadence.training.checkpoint.format.CheckpointFormat` ``files``: gathered whole, written by rank 0."""

    name = "files"
    files = (WEIGHTS_FILE,)
    every_rank_writes = False

    def describe(self) -> str:
        return "whole: model.safetensors and the training state, written by rank 0"

    def problem(self, listed: Collection[str]) -> str | None:
        return None

    def capture(self, parts: Components, ranks: Ranks) -> Captured:
        # Gathered by every rank together under FSDP2 (a run that chose this format itself), keyed by name there.
        fsdp = ranks.launched and ranks.strategy == "fsdp"
        return Captured(tensors=full_model_state(parts.model, ranks),
                        optimizer=full_optimizer_state(parts.model, parts.optimizer, ranks),
                        info={"optimizer_format": BY_NAME if fsdp else BY_INDEX})

    def write(self, folder: Path, captured: Captured, ranks: Ranks, group: Any) -> list[str]:
        if not ranks.is_main or captured.tensors is None:
            return []
        save_weights(captured.tensors, folder / WEIGHTS_FILE)
        return [WEIGHTS_FILE]

    def load(self, folder: Path, saved: dict[str, Any], info: Mapping[str, Any], parts: Components) -> None:
        load_files_state(parts.model, parts.optimizer, parts.ranks, self.read_weights(folder), saved,
                         str(info.get("optimizer_format", BY_INDEX)))

    def weights_at(self, folder: Path) -> Path:
        return folder / WEIGHTS_FILE

    def read_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        return read_weights_file(folder / WEIGHTS_FILE)


FORMAT = WholeFiles()


def read_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` (a checkpoint's, the run's final or best weights): safetensors
    only, so a pickle or garbage is refused without being run; :class:`WeightsUnreadable` otherwise."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise WeightsUnreadable(path, str(err).splitlines()[0] if str(err) else type(err).__name__) from None


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks) -> dict[str, Any]:
    """The optimizer's whole state as rank 0 saves it, by index; under FSDP2 gathered (a collective) and by name."""
    if ranks.launched and ranks.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str] | None:
    """The optimizer's parameters by name, in its order (the order torch's index keys count in); None when one of
    them is no parameter of the model (an optimizer over copies: --offload optimizer)."""
    name_of = {id(parameter): name for name, parameter in unwrap(model).named_parameters()}
    names = [name_of.get(id(parameter)) for group in optimizer.param_groups for parameter in group["params"]]
    return None if None in names else [name for name in names if name is not None]


def _rekeyed(state: dict[str, Any], key_of: Mapping[Any, Any]) -> dict[str, Any]:
    return {"state": {key_of[key]: value for key, value in state["state"].items()},
            "param_groups": [{**group, "params": [key_of[key] for key in group["params"]]}
                             for group in state["param_groups"]]}


def load_files_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks,
                     weights: Mapping[str, torch.Tensor], optimizer_state: dict[str, Any], saved_format: str) -> None:
    """Load a single-file checkpoint's weights and optimizer state (every rank reads the whole checkpoint; FSDP2 keeps
    each rank's shard of it). Raises ValueError when the optimizer's keys cannot be translated."""
    fsdp = ranks.launched and ranks.strategy == "fsdp"
    wanted = BY_NAME if fsdp else BY_INDEX
    if saved_format != wanted:
        names = _parameter_names(model, optimizer)
        if names is None:
            raise ValueError(f"the optimizer state is keyed {saved_format} and this run's optimizer keeps copies of "
                             f"the parameters (--offload optimizer): resume with the strategy it was saved with")
        index_of = {name: index for index, name in enumerate(names)}
        optimizer_state = _rekeyed(optimizer_state, dict(enumerate(names)) if wanted == BY_NAME else index_of)
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, dict(weights), options=options)
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
        return
    unwrap(model).load_state_dict(weights)
    optimizer.load_state_dict(optimizer_state)
