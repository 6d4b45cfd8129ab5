"""Checkpoints and their one owner, the ``Checkpointer``: the folder layout (staging, manifest, verification,
pruning: ``layout``), the formats behind one protocol and their registry (``format``): the whole format (``files``)
and the sharded DCP one (``sharded``), and which a run writes (``checkpointer``)."""

from cadence.training.checkpoint.checkpointer import Checkpointer
from cadence.training.checkpoint.format import (
    FORMATS,
    CheckpointFormat,
    CheckpointUnreadable,
    WeightsUnreadable,
    format_named,
    run_format,
)
from cadence.training.checkpoint.layout import (
    INFO_FILE,
    MANIFEST_FILE,
    STATE_FILES,
    LoadedCheckpoint,
    checkpoint_dirs,
    checkpoint_format,
    latest_checkpoint,
    load_checkpoint,
    newest_intact_checkpoint,
    prune_checkpoints,
    rng_state,
    verify_checkpoint,
)

__all__ = ["FORMATS", "INFO_FILE", "MANIFEST_FILE", "STATE_FILES", "CheckpointFormat", "CheckpointUnreadable",
           "Checkpointer", "LoadedCheckpoint", "WeightsUnreadable", "checkpoint_dirs", "checkpoint_format",
           "format_named", "latest_checkpoint", "load_checkpoint", "newest_intact_checkpoint", "prune_checkpoints",
           "rng_state", "run_format", "verify_checkpoint"]
