"""Checkpoints: every piece of state a run needs, written atomically into checkpoints/step-N/.

A checkpoint is assembled in a hidden temporary folder and renamed into place only when complete (rename is atomic
within a filesystem), so a crash mid-write leaves either no step-N folder or a whole one.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from cadence.run_dir import CHECKPOINTS_DIR, WEIGHTS_FILE, atomic_write_json, save_weights

STATE_FILE = "training_state.pt"
INFO_FILE = "checkpoint.json"


def rng_state() -> dict[str, Any]:
    """Every random generator a training step can touch."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(
    run_dir: Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    engine_state: dict[str, Any],
    data_position: dict[str, int],
    info: dict[str, Any],
) -> Path:
    """Write checkpoints/step-{step}/ (weights, optimizer, scheduler, precision, counters, RNG, data position)."""
    root = run_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".step-{step}."))
    try:
        save_weights(model, staging / WEIGHTS_FILE)
        state = {
            "optimizer": optimizer.state_dict(),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "engine": engine_state,
            "data_position": data_position,
            "rng": rng_state(),
        }
        with open(staging / STATE_FILE, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        atomic_write_json(staging / INFO_FILE, {"step": step, **info})
        if final.exists():  # same step written again (e.g. final save after a periodic one): replace whole
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def _fsync_dir(path: Path) -> None:
    """Make the rename itself durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
