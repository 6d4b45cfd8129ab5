"""``cadence train``: the training loop as a small run object, and everything around it (prepare, components,
auto micro-batch, progress, the run directory, checkpoints, resume, the gradient noise scale of a prepared run)."""

from cadence.training.checkpoint import checkpoint_dirs, load_checkpoint, verify_checkpoint
from cadence.training.loop import TrainingFailed, train
from cadence.training.noise_scale import NoiseScaleMeasurement, measure_noise_scale
from cadence.training.run_dir import read_metrics

__all__ = ["NoiseScaleMeasurement", "TrainingFailed", "checkpoint_dirs", "load_checkpoint", "measure_noise_scale",
           "read_metrics", "train", "verify_checkpoint"]
