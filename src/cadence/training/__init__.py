"""``cadence train``: the training loop as a small run object, and everything around it (prepare, components,
auto micro-batch, progress, the run directory, checkpoints, resume)."""

from cadence.training.checkpoint import checkpoint_dirs, load_checkpoint, verify_checkpoint
from cadence.training.loop import TrainingFailed, train
from cadence.training.run_dir import read_metrics

__all__ = ["TrainingFailed", "checkpoint_dirs", "load_checkpoint", "read_metrics", "train", "verify_checkpoint"]
