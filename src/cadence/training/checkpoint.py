"""Checkpoints: every piece of state a run needs, written atomically into checkpoints/step-N/, and read back.

A checkpoint is assembled in a hidden temporary folder, every file fsynced, a manifest of SHA-256 checksums written
last, and the folder renamed into place only then (rename is atomic within a filesystem): a crash mid-write leaves
either no step-N folder or a whole one. Reading verifies the manifest, so a folder damaged afterwards (a disk error,
a partial copy) is detected and the previous checkpoint is used instead, with a warning.

Nothing in a checkpoint is pickled: the training state is JSON plus safetensors (``state_file``), so a checkpoint
from someone else can damage a run at worst, never run code. The manifest guards against damage, not tampering
(anyone who edits a file can recompute its checksum); the pickle-free format is what guards against tampering.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from cadence.config.sources import recorded_config
from cadence.output_files import atomic_write_json, fsync_directory
from cadence.records import Record, integer, tensor_kind
from cadence.training.run_dir import (
    CHECKPOINTS_DIR,
    WEIGHTS_FILE,
    RunDirectoryWriteFailed,
    run_folder,
    save_weights,
    writing,
)
from cadence.training.state_file import read_state, state_file_names, write_state

STATE_STEM = "training_state"
STATE_FILES = state_file_names(STATE_STEM)
INFO_FILE = "checkpoint.json"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_FILES = (WEIGHTS_FILE, *STATE_FILES, INFO_FILE)
"""Every file of a checkpoint; the manifest must vouch for each of them."""
LEGACY_PICKLE_FILE = "training_state.pt"
"""What cadence before the pickle-free format wrote: never loaded, since unpickling it could run code."""
_STEP_DIR = re.compile(r"^step-(\d+)$")


def rng_state() -> dict[str, Any]:
    """Every random generator a training step can touch."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(
    run_dir: Path,
    *,
    step: int,
    weights: Mapping[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    engine_state: dict[str, Any],
    data_position: dict[str, int],
    info: dict[str, Any],
    keep: int = 0,
    partial_window: dict[str, Any] | None = None,
    known_intact: Collection[Path] = (),
) -> Path:
    """Write checkpoints/step-{step}/ (weights, optimizer, scheduler, precision, counters, RNG, data position);
    with ``keep`` > 0, delete all but the newest ``keep`` intact checkpoints afterwards (``prune_checkpoints``;
    ``known_intact``: checkpoints the caller knows are intact, which it need not hash again)."""
    state = {
        "optimizer": optimizer_state,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "engine": engine_state,
        "data_position": data_position,
        "rng": rng_state(),
        # --checkpoint-mid-window: the gradients of the micro-batches already done in the interrupted window
        "partial_window": partial_window,
    }
    with writing(f"checkpoint step-{step} in {run_dir / CHECKPOINTS_DIR}",
                 then="the checkpoints before it are intact: free space, then --resume"):
        final = _write_atomically(run_dir, step=step, weights=weights, state=state, info=info)
    if keep > 0:
        prune_checkpoints(run_dir, keep=keep, known_intact={*known_intact, final})
    return final


def _write_atomically(run_dir: Path, *, step: int, weights: Mapping[str, torch.Tensor], state: dict[str, Any],
                      info: dict[str, Any]) -> Path:
    """Assemble the checkpoint in a hidden staging folder and rename it into place (removed whole on any failure)."""
    root = run_folder(run_dir, CHECKPOINTS_DIR)
    final = root / f"step-{step}"
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".step-{step}."))
    try:
        save_weights(weights, staging / WEIGHTS_FILE)
        write_state(staging, STATE_STEM, state)
        atomic_write_json(staging / INFO_FILE, {"step": step, **info})
        # The manifest is written last: a folder with a valid manifest was complete when it was written.
        manifest = {name: _sha256(staging / name) for name in CHECKPOINT_FILES}
        atomic_write_json(staging / MANIFEST_FILE, {"step": step, "sha256": manifest})
        if final.is_symlink() or final.is_file():
            # Not a checkpoint of this run's (it writes folders): never removed, and not replaced either.
            raise RunDirectoryWriteFailed(f"{final} is a link or a file, not one of the run's checkpoints; nothing "
                                          f"was written there: remove it, then --resume")
        if final.exists():  # the same step written again (a final save after a periodic one): replace it whole
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_directory(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final



def prune_checkpoints(run_dir: Path, *, keep: int, known_intact: Collection[Path] = ()) -> list[Path]:
    """Delete all but the newest ``keep`` INTACT checkpoints; return what was deleted.

    A damaged checkpoint is never one of the kept: after a resume fell back from a damaged newest checkpoint, keeping
    "the highest steps" would keep the damaged one and delete every good one. Damaged checkpoints newer than the
    oldest kept one are left for the user to look at; everything older than it goes. ``known_intact`` (the folders
    this run wrote or resumed from) are not hashed again: with them, a save hashes no other checkpoint once the run
    has written ``keep`` of its own."""
    kept: list[Path] = []
    found = checkpoint_dirs(run_dir)
    for path in reversed(found):
        if len(kept) == keep:
            break
        if path in known_intact or verify_checkpoint(path) is None:
            kept.append(path)
    if len(kept) < keep:
        return []  # fewer intact checkpoints than asked to keep: nothing is old enough to go
    oldest_kept = found.index(kept[-1])
    deleted = found[:oldest_kept]
    for old in deleted:
        shutil.rmtree(old, ignore_errors=True)
    return deleted


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The step-N folders of a run, oldest first (hidden staging folders of interrupted writes are not included)."""
    root = run_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [path for _, path in sorted(found)]


def verify_checkpoint(path: Path) -> str | None:
    """Why ``path`` is not a whole, intact checkpoint (None when it is)."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        return "no manifest (the write did not finish)"
    if (path / LEGACY_PICKLE_FILE).exists():
        return (f"{LEGACY_PICKLE_FILE} is a pickle from an older cadence; loading it could run code, so it is not "
                f"read (start a new run, or resume with the cadence that wrote it)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        checksums = manifest["sha256"]
        if not isinstance(checksums, dict):
            return "unreadable manifest (no checksum table)"
        for name in CHECKPOINT_FILES:
            if name not in checksums:
                return f"the manifest does not vouch for {name}"
            if not (path / name).is_file():
                return f"{name} is missing"
            if _sha256(path / name) != checksums[name]:
                return f"{name} does not match its checksum"
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
        return f"unreadable manifest ({err})"
    return None


@dataclass(kw_only=True)
class LoadedCheckpoint:
    path: Path
    step: int
    weights: dict[str, torch.Tensor]
    state: dict[str, Any]
    info: dict[str, Any]


def latest_checkpoint(run_dir: Path) -> LoadedCheckpoint | None:
    """The newest checkpoint that verifies; damaged newer ones are skipped with a warning. None when there is none."""
    path = newest_intact_checkpoint(run_dir)
    return None if path is None else load_checkpoint(path)


def newest_intact_checkpoint(run_dir: Path, *, notice: Callable[[str], None] | None = None) -> Path | None:
    """The newest step-N folder whose files match their manifest. Each damaged newer one is skipped and told to
    ``notice`` (default: a ``cadence: warning:`` line on stderr)."""
    say = notice or _warning_line
    for path in reversed(checkpoint_dirs(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        say(f"checkpoint {path} is damaged ({problem}); trying the one before it")
    return None


def _warning_line(message: str) -> None:
    print(f"cadence: warning: {message}", file=sys.stderr, flush=True)


def load_checkpoint(path: Path) -> LoadedCheckpoint:
    """Read one checkpoint folder (verify it first: ``newest_intact_checkpoint``); JSON and safetensors only.

    Raises ``CheckpointUnreadable`` when a file that matched its checksum still does not parse (a manifest recomputed
    over edited files)."""
    try:
        info_text = (path / INFO_FILE).read_bytes()
        state = read_state(path, STATE_STEM)
        weights = load_file(str(path / WEIGHTS_FILE))
    except (OSError, ValueError, KeyError, TypeError, RecursionError, SafetensorError) as err:
        raise CheckpointUnreadable(f"{path}: unreadable checkpoint ({str(err)[:300]})") from err
    info = Record.parse(info_text, path / INFO_FILE)
    check_contents(path, info, state)
    return LoadedCheckpoint(path=path, step=info.count("step"), weights=weights, state=dict(state), info=dict(info.data))


def check_contents(path: Path, info: Record, state: Any) -> None:
    """The fields of checkpoint.json and of the training state that a resume reads, each of its type and range
    (``RecordInvalid`` naming the file and the field otherwise): a checkpoint whose manifest verifies may still
    have been edited (the manifest recomputed), and a string where a count belongs would otherwise end the resume
    in a traceback, or worse, mid-run. What each optimizer keeps per parameter is checked where the optimizer is
    known (``optimizer_state.check_saved_state``); shapes, once the state is loaded into the model's."""
    info.count("step")
    info.text("optimizer_format", default="by-index")
    for name in ("resolved_config", "config"):
        recorded_config(info.record(name, default=Record({}, info.source)))
    record = Record.of(state, path / STATE_FILES[0])
    optimizer = record.record("optimizer")
    optimizer.record("state")
    optimizer.records("param_groups")
    record.record("scheduler", default=None)
    engine = record.record("engine")
    for name in ("steps", "skipped_steps", "windows"):
        engine.count(name)
    position = record.record("data_position")
    position.count("epoch")
    # -1: a mid-window checkpoint of an epoch's first window records the window before it
    position.take("window_in_epoch", integer(-1))
    record.record("rng")
    partial = record.record("partial_window", default=None)
    if partial is not None:
        partial.count("micro_batches_done")
        partial.number("loss_sum")
        partial.take("micro_batch_size", integer(1))
        grads = partial.record("grads")
        for name in grads.data:
            grads.take(name, tensor_kind(words="a tensor of gradients"))


class CheckpointUnreadable(ValueError):
    """A checkpoint's files verify against its manifest but do not parse as a cadence checkpoint."""
