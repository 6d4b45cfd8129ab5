"""The single-file format (one process, DDP; and every checkpoint cadence wrote before the sharded one): the whole
model in ``model.safetensors`` and the whole optimizer state in the JSON training state, written by rank 0.

The optimizer state is keyed by parameter index (torch's own ``state_dict``), or, in a checkpoint an FSDP2 run wrote
before FSDP2 got the sharded format, by parameter name (the gathered full state). Either loads into either kind of
run: the keys are translated through the optimizer's parameter order, so a checkpoint moves between one process, DDP
and FSDP2, and between world sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cadence.distributed.ranks import Ranks, unwrap
from cadence.training.checkpoint.layout import STATE_STEM
from cadence.training.run_dir import WEIGHTS_FILE, save_weights
from cadence.training.state_file import write_state

BY_INDEX, BY_NAME = "by-index", "by-name"


def write_files(folder: Path, weights: Mapping[str, torch.Tensor], state: dict[str, Any]) -> None:
    """The weights and the training state (the optimizer's whole state inside it) into ``folder``."""
    save_weights(weights, folder / WEIGHTS_FILE)
    write_state(folder, STATE_STEM, state)


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
