"""What config.json records of a run: the resolved configuration (the flags as the run uses them, with the batch
arithmetic, the data's identity, the versions and torchrun's launch) and the model's parameter counts."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any

import torch

from cadence import __version__
from cadence.models.lora import parameter_counts
from cadence.training.prepare import Prepared
from cadence.training.restart import LAUNCH_FIELD, Launch


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """The run's resolved configuration (config.json, and every checkpoint's ``resolved_config``) and its model's
    parameters, trained and frozen (--lora-rank freezes the base)."""

    resolved: dict[str, Any]
    trained: int
    frozen: int

    @property
    def parameters(self) -> int:
        """Counted as weights, not as stored elements: an nf4 base packs two weights in each byte it holds."""
        return self.trained + self.frozen

    @classmethod
    def of(cls, prep: Prepared, model: torch.nn.Module, launch: Launch | None = None) -> RunRecord:
        trained, frozen = parameter_counts(model)
        return cls(resolved=resolved_config(prep, trained + frozen, launch), trained=trained, frozen=frozen)

    def describe(self) -> str:
        """The parameter counts, as the console's banner says them."""
        return f"{self.parameters:,} parameters" + (f": {self.trained:,} trained, {self.frozen:,} frozen"
                                                    if self.frozen else "")


def resolved_config(prep: Prepared, parameters: int, launch: Launch | None = None) -> dict[str, Any]:
    """config.json: the configuration with what the run resolved (``launch``: torchrun's, recorded when it started
    the run)."""
    return {
        **prep.config.to_json_dict(),
        "seq_len": prep.seq_len,
        "micro_batch_size": prep.micro_batch_size,
        "auto_micro_batch": prep.config.auto_micro_batch,
        "grad_accum_steps": prep.grad_accum_steps,
        "effective_batch_size": prep.effective_batch_size,
        "world_size": prep.world_size,
        "memory_budget_bytes": prep.memory_budget_bytes,
        "out": str(prep.out),
        "resolved_device": str(prep.device),
        "model_parameters": parameters,
        "data_description": prep.data.description,
        "data_fingerprint": prep.data.fingerprint,
        "data_store": str(prep.data.store) if prep.data.store else None,
        "data_store_digest": prep.data.store_digest,
        "train_sequences": len(prep.data.train),
        "val_sequences": 0 if prep.data.val is None else len(prep.data.val),
        "versions": {"cadence": __version__, "torch": torch.__version__, "python": platform.python_version()},
        **({LAUNCH_FIELD: launch.record()} if launch is not None else {}),
    }
