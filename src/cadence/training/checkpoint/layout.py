"""A checkpoint folder, whatever its format: checkpoints/step-N/, staged, sealed by its manifest, verified, pruned.

A checkpoint is assembled in a hidden temporary folder, every file fsynced, a manifest of SHA-256 checksums written
last, and the folder renamed into place only then (rename is atomic within a filesystem): a crash mid-write leaves
either no step-N folder or a whole one. Reading verifies the manifest, so a folder damaged afterwards (a disk error,
a partial copy) is detected and the previous checkpoint is used instead, with a warning.

Nothing in a checkpoint is unpickled: the training state is JSON plus safetensors (``state_file``), and a sharded
checkpoint's DCP index is read through an allow-list (``sharded``), so a checkpoint from someone else can damage a
run at worst, never run code. The manifest guards against damage, not tampering
(anyone who edits a file can recompute its checksum); the pickle-free format is what guards against tampering.
"""

from __future__ import annotations

import hashlib
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

from cadence.config.sources import recorded_config
from cadence.errors import UsageError
from cadence.output_files import fsync_directory
from cadence.records import CHECKPOINT_INFO, MANIFEST, Record, integer, tensor_kind
from cadence.training.checkpoint.format import (
    FORMATS,
    UNNAMED,
    CheckpointFormat,
    CheckpointUnreadable,
    format_named,
)
from cadence.training.run_dir import CHECKPOINTS_DIR, RunDirectoryWriteFailed, run_folder
from cadence.training.state_file import read_state, state_file_names

STATE_STEM = "training_state"
STATE_FILES = state_file_names(STATE_STEM)
INFO_FILE = "checkpoint.json"
MANIFEST_FILE = "manifest.json"
_PLAIN_NAME = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.-]+$")
LEGACY_PICKLE_FILE = "training_state.pt"
"""What cadence before the pickle-free format wrote: never loaded, since unpickling it could run code."""
_STEP_DIR = re.compile(r"^step-(\d+)$")


def always_present(kind: CheckpointFormat) -> tuple[str, ...]:
    """The files a checkpoint of format ``kind`` always has: its manifest must vouch for each of them (and for any
    other file it lists: a sharded checkpoint's shards and per-rank states)."""
    return (*kind.files, *STATE_FILES, INFO_FILE)


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


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def stage(run_dir: Path, step: int) -> tuple[Path, Path]:
    """A new hidden staging folder for checkpoint ``step`` and the step-N folder it becomes (``seal``)."""
    root = run_folder(run_dir, CHECKPOINTS_DIR)
    return Path(tempfile.mkdtemp(dir=root, prefix=f".step-{step}.")), root / f"step-{step}"


def seal(staging: Path, final: Path, *, step: int, kind: str, checksums: Mapping[str, str]) -> Path:
    """Write the manifest (last: a folder with a valid manifest was complete when it was written) and rename the
    staging folder into place; the staging folder is removed whole on any failure."""
    try:
        MANIFEST.write(staging / MANIFEST_FILE, {"step": step, "format": kind, "sha256": dict(checksums)})
        if final.is_symlink() or final.is_file():
            # Not a checkpoint of this run's (it writes folders): never removed, and not replaced either.
            raise RunDirectoryWriteFailed(f"{final} is a link or a file, not one of the run's checkpoints; nothing "
                                          f"was written there: remove it, then --resume")
        if final.exists():  # the same step written again (a final save after a periodic one): replace it whole
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_directory(final.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def checksums(folder: Path, names: Collection[str]) -> dict[str, str]:
    """SHA-256 of each of ``names`` in ``folder``."""
    return {name: sha256(folder / name) for name in names}


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


def manifest_format(path: Path) -> str:
    """The name of the format a checkpoint's manifest states (``files`` for manifests written before there were
    two, and for one that cannot be read: verification refuses it)."""
    try:
        kind = MANIFEST.read(path / MANIFEST_FILE).get("format", UNNAMED)
    except (OSError, UsageError):
        return UNNAMED
    return kind if kind in FORMATS else UNNAMED


def checkpoint_format(path: Path) -> CheckpointFormat:
    """The format a (verified) checkpoint folder was written in, as its manifest says."""
    return format_named(manifest_format(path))


def verify_checkpoint(path: Path) -> str | None:
    """Why ``path`` is not a whole, intact checkpoint (None when it is): its manifest must name a known format, vouch
    for every file that format always has, and every file it lists must be there with its checksum."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        return "no manifest (the write did not finish)"
    if (path / LEGACY_PICKLE_FILE).exists():
        return (f"{LEGACY_PICKLE_FILE} is a pickle from an older cadence; loading it could run code, so it is not "
                f"read (start a new run, or resume with the cadence that wrote it)")
    try:
        manifest = MANIFEST.read(manifest_path)
        checksums, name = manifest.get("sha256"), manifest.get("format", UNNAMED)
        if not isinstance(checksums, dict):
            return "unreadable manifest (no checksum table)"
        if name not in FORMATS:
            return f"unknown checkpoint format {str(name)[:40]!r} in the manifest"
        kind = format_named(name)
        for needed in always_present(kind):
            if needed not in checksums:
                return f"the manifest does not vouch for {needed}"
        lacking = kind.problem([listed for listed in checksums if isinstance(listed, str)])
        if lacking is not None:
            return lacking
        for listed, digest in checksums.items():
            if not isinstance(listed, str) or not _PLAIN_NAME.match(listed):
                return f"the manifest lists {str(listed)[:60]!r}, not a file name of this folder"
            if not (path / listed).is_file():
                return f"{listed} is missing"
            if sha256(path / listed) != digest:
                return f"{listed} does not match its checksum"
    except (OSError, UsageError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        return f"unreadable manifest ({err})"
    return None


@dataclass(kw_only=True)
class LoadedCheckpoint:
    """A checkpoint's records: checkpoint.json (``info``) and the shared training state, checked; its model and
    optimizer are read by its format when it is loaded (``Checkpointer.load``)."""

    path: Path
    step: int
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


def rank_state_stem(rank: int) -> str:
    """The state one rank of a sharded checkpoint writes for itself: its random generators and, mid-window, its own
    not yet synchronised gradients."""
    return f"rank-{rank}"


def _warning_line(message: str) -> None:
    print(f"cadence: warning: {message}", file=sys.stderr, flush=True)


def load_checkpoint(path: Path) -> LoadedCheckpoint:
    """Read one checkpoint folder's checkpoint.json and training state (verify it first: ``newest_intact_checkpoint``);
    JSON and safetensors only.

    Raises ``CheckpointUnreadable`` when a file that matched its checksum still does not parse (a manifest recomputed
    over edited files)."""
    try:
        info_text = (path / INFO_FILE).read_bytes()
        state = read_state(path, STATE_STEM)
    except (OSError, ValueError, KeyError, TypeError, RecursionError, SafetensorError) as err:
        raise CheckpointUnreadable(f"{path}: unreadable checkpoint ({str(err)[:300]})") from err
    info = CHECKPOINT_INFO.parse(info_text, path / INFO_FILE)
    check_contents(path, info, state)
    return LoadedCheckpoint(path=path, step=info.count("step"), state=dict(state), info=dict(info.data))


def check_contents(path: Path, info: Record, state: Any) -> None:
    """The fields of checkpoint.json and of the training state that a resume reads, each of its type and range
    (``RecordInvalid`` naming the file and the field otherwise): a checkpoint whose manifest verifies may still
    have been edited (the manifest recomputed), and a string where a count belongs would otherwise end the resume
    in a traceback, or worse, mid-run. What each optimizer keeps per parameter is checked where the optimizer is
    known (``OptimizerSpec.check_saved``); shapes, once the state is loaded into the model's."""
    info.count("step")
    info.text("optimizer_format", default="by-index")
    for name in ("resolved_config", "config"):
        recorded_config(info.record(name, default=Record({}, info.source)))
    record = Record.of(state, path / STATE_FILES[0])
    optimizer = record.record("optimizer")
    optimizer.record("state")
    optimizer.records("param_groups")
    record.record("scheduler", default=None)
    batch = record.record("batch", default=None)
    if batch is not None:  # --effective-batch-size adaptive
        saved = batch.record("state")
        for name in ("multiple", "grow_streak", "shrink_streak", "switches"):
            saved.count(name)
        batch.records("switches")
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
        grads = partial.record("grads", default=Record({}, partial.source))  # a sharded format's: per rank
        for name in grads.data:
            grads.take(name, tensor_kind(words="a tensor of gradients"))
