"""Checkpoints and their one owner, the ``Checkpointer``: the folder layout (staging, manifest, verification,
pruning: ``layout``), the single-file format (``files``), the sharded DCP format (``sharded``), and which a run
writes (``checkpointer``)."""

from cadence.training.checkpoint.checkpointer import Checkpointer, CheckpointFormat
from cadence.training.checkpoint.layout import (
    INFO_FILE,
    MANIFEST_FILE,
    STATE_FILES,
    CheckpointUnreadable,
    LoadedCheckpoint,
    checkpoint_dirs,
    latest_checkpoint,
    load_checkpoint,
    newest_intact_checkpoint,
    prune_checkpoints,
    rng_state,
    verify_checkpoint,
)

__all__ = ["INFO_FILE", "MANIFEST_FILE", "STATE_FILES", "CheckpointFormat", "CheckpointUnreadable", "Checkpointer",
           "LoadedCheckpoint", "checkpoint_dirs", "latest_checkpoint", "load_checkpoint", "newest_intact_checkpoint",
           "prune_checkpoints", "rng_state", "verify_checkpoint"]
