"""The run directory (docs/ARCHITECTURE.md, "The run directory"): config.json, metrics.jsonl, summary.json, model.safetensors, TensorBoard.

Files that are written once are written atomically (temporary file, fsync, rename), so a crash never leaves a
half-written config, summary or weights file. metrics.jsonl is appended and flushed one line per optimizer step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from cadence.config.sources import recorded_plan
from cadence.errors import CadenceFailure, UsageError
from cadence.output_files import atomic_write_bytes, finite, fsync_file
from cadence.records import BEST, METRICS_ROW, RUN_CONFIG, SUMMARY, NotJson, Record, RecordInvalid, parse_json

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
WEIGHTS_FILE = "model.safetensors"
BEST_DIR = "best"
"""--keep-best: the weights of the lowest validation loss, apart from checkpoints/ (never pruned)."""
BEST_FILE = "best.json"
CHECKPOINTS_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"


def weights_for_safetensors(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state_dict with every name kept, as contiguous CPU copies.

    safetensors refuses tensors that share storage (tied embeddings do); copying keeps the names exactly as the
    model has them, so ``model.load_state_dict(load_file(...))`` works without knowing about the tie.
    """
    return {name: tensor.detach().to("cpu").clone().contiguous() for name, tensor in weights.items()}


def save_weights(weights: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``weights`` is a state_dict (the whole model's: under FSDP2 the caller gathers it first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(weights_for_safetensors(weights), str(tmp), metadata=metadata)
        fsync_file(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not also leave half a weights file behind
        raise


class RunDirectoryWriteFailed(CadenceFailure):
    """A file of the run directory could not be written: a full disk, a file size limit, a read-only mount. What was
    already on disk is intact (every file is written whole or not at all), so the run can be resumed once the
    cause is fixed."""

    label = "training failed"


@contextlib.contextmanager
def writing(what: str, *, then: str = "") -> Iterator[None]:
    """Turn an OS error while writing ``what`` into one line for the user (``then``: what to do about it)."""
    try:
        yield
    except (OSError, SafetensorError) as err:
        # safetensors reports the OS error inside its own: "Error while serializing: I/O error: No space left ..."
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).rsplit("I/O error: ", 1)[-1]
        raise RunDirectoryWriteFailed(f"cannot write {what}: {reason}" + (f"; {then}" if then else "")) from err


def run_folder(root: Path, name: str) -> Path:
    """``root / name`` as a folder of the run directory, made if missing. A link there (or a file) is refused: writing
    through a symlinked ``best/`` or ``checkpoints/`` would overwrite the files of whatever it points at, which are not
    the run's. (Checked at each write: the folder may have been replaced while the run went on.)"""
    folder = root / name
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise RunDirectoryWriteFailed(
            f"{folder} is a link or a file, not the run's own folder, and cadence writes only inside the run "
            f"directory; nothing was written there: remove it, then --resume")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class RunWriter:
    """Writes one run directory. Created only after every input has been validated, so bad input writes nothing."""

    def __init__(self, root: Path, *, tensorboard: bool = True, config: dict[str, Any] | None = None) -> None:
        """``config``: the resolved configuration, written as config.json before any other file. It is what marks
        the directory as a cadence run (to --resume, and to a restart under torchrun, which would otherwise find a
        directory holding only a metrics.jsonl and refuse it)."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        if config is not None:
            self.write_config(config)
        self._metrics = open(root / METRICS_FILE, "a", encoding="utf-8")
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as missing:
                # A declared dependency, but an environment assembled by hand (a cluster image) may lack it: the
                # run's own files do not depend on it, so the run goes on, and says what is missing.
                warnings.warn(f"TensorBoard files are not written ({missing}); pip install tensorboard", stacklevel=2)
            else:
                self._tb = SummaryWriter(log_dir=str(root / TENSORBOARD_DIR))

    def write_config(self, resolved: dict[str, Any]) -> None:
        if resolved.get("resume") and resolved.get("plan") is None and (plan := recorded_plan(self.root)):
            # --plan is not given again at --resume: the plan the run started with stays on record (issue 41: the
            # report of a resumed run lost its comparison with the plan's prediction).
            resolved = {**resolved, "plan": plan}
        with writing(str(self.root / CONFIG_FILE)):
            RUN_CONFIG.write(self.root / CONFIG_FILE, resolved)

    def log_step(self, row: dict[str, Any]) -> None:
        with writing(str(self.root / METRICS_FILE), then="the checkpoints so far are intact: free space, then --resume"):
            self._metrics.write(json.dumps(finite(row)) + "\n")
            self._metrics.flush()
        if self._tb is not None:
            step = int(row["step"])
            for key in ("loss", "grad_norm", "lr", "loss_scale", "tokens_per_s", "step_time_s", "val_loss",
                        "val_perplexity", "grad_noise_scale", "grad_noise_scale_tokens"):
                value = row.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    name = {"val_loss": "val/loss", "val_perplexity": "val/perplexity"}.get(key, f"train/{key}")
                    self._tb.add_scalar(name, value, step)
            for key, value in row.items():  # a preference objective's metrics under TRL's names (rewards/margins)
                if "/" in key and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key.replace("val_", "val/", 1) if key.startswith("val_") else f"train/{key}",
                                        value, step)
            if row.get("peak_memory_bytes"):
                self._tb.add_scalar("train/peak_memory_mib", row["peak_memory_bytes"] / 2**20, step)
            if row.get("skipped"):
                self._tb.add_scalar("train/skipped", 1, step)

    def write_summary(self, summary: dict[str, Any]) -> None:
        with writing(str(self.root / SUMMARY_FILE)):
            SUMMARY.write(self.root / SUMMARY_FILE, summary)

    def save_model(self, weights: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        with writing(str(self.root / WEIGHTS_FILE), then="the checkpoints so far are intact: free space, then --resume"):
            save_weights(weights, self.root / WEIGHTS_FILE, metadata)

    def save_best(self, weights: Mapping[str, torch.Tensor], record: dict[str, Any]) -> None:
        """--keep-best: OUT/best/model.safetensors and best.json (its step and validation loss), each written whole;
        the weights first, so a best.json always describes the weights beside it or older ones being replaced."""
        folder = run_folder(self.root, BEST_DIR)
        with writing(str(folder / WEIGHTS_FILE), then="the checkpoints so far are intact: free space, then --resume"):
            save_weights(weights, folder / WEIGHTS_FILE)
            BEST.write(folder / BEST_FILE, record)

    def save_best_streamed(self, write: Callable[[Path | None], None], record: dict[str, Any]) -> None:
        """:meth:`save_best` with the weights written by ``write(path)`` (FSDP2: every rank calls it, the others with
        None, gathering one tensor at a time). If the folder cannot be made, ``write(None)`` still takes part in the
        gathers before the error is raised, so that the other ranks never wait for it."""
        try:
            folder = run_folder(self.root, BEST_DIR)
        except BaseException:
            write(None)
            raise
        with writing(str(folder / WEIGHTS_FILE), then="the checkpoints so far are intact: free space, then --resume"):
            write(folder / WEIGHTS_FILE)
            BEST.write(folder / BEST_FILE, record)

    def close(self) -> None:
        """Close metrics.jsonl and TensorBoard (a second call does nothing)."""
        self._metrics.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


class NoWriter(RunWriter):
    """What ranks other than 0 write: nothing (rank 0 alone writes the run directory)."""

    def __init__(self) -> None:  # no directory, no files
        pass

    def write_config(self, resolved: dict[str, Any]) -> None:
        pass

    def log_step(self, row: dict[str, Any]) -> None:
        pass

    def write_summary(self, summary: dict[str, Any]) -> None:
        pass

    def save_model(self, weights: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        pass

    def save_best(self, weights: Mapping[str, torch.Tensor], record: dict[str, Any]) -> None:
        pass

    def save_best_streamed(self, write: Callable[[Path | None], None], record: dict[str, Any]) -> None:
        write(None)  # this rank's part of the gathers

    def close(self) -> None:
        pass


class MetricsUnreadable(RecordInvalid):
    """A line of metrics.jsonl that is not a metrics row (and not the torn last line of a killed run): one line
    naming the file, the line and, for a field of the wrong type, the field."""

    def __init__(self, path: Path, line: int, reason: str, field: str = "") -> None:
        super().__init__(f"{path}:{line}", field, reason)
        self.path = path
        self.line = line
        self.reason = reason


ROW_REQUIRED = ("tokens",)
"""What every metrics row holds: the tokens are summed into every total a run reports."""
RESUMED_ROW_REQUIRED = ("tokens", "targets", "samples", "step_time_s")
"""What a resumed run's totals add up from each kept row."""


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """A run's summary.json, its totals and segments checked (``records.SUMMARY``); None when there is none.
    Anything else, a file that is not a JSON object or a total of the wrong type, is a ``RecordInvalid`` naming the
    file and the field (summary.json is written whole or not at all, so no damage is forgiven)."""
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        return None
    return dict(SUMMARY.read(path).data)


def kept_summary(run_dir: Path) -> dict[str, Any] | None:
    """The summary.json a run wrote, or None when it is missing or does not read as one (for what only a summary
    cadence wrote can say: the export it made, a run that had already ended)."""
    try:
        return read_summary(run_dir)
    except (OSError, UsageError):
        return None


def export_files(directory: Path) -> dict[str, list[int]] | None:
    """What is in an export directory now: each file's relative name with its size, modification time and inode, and
    the directory's own inode under "." (None when it is missing or cannot be read). summary.json records it after
    --save-hf writes the export, so that a resume replaces that export only while it holds exactly what this run
    wrote: a file added to it, a file changed in it, or another folder put in its place is the user's, and stays."""
    try:
        if directory.is_symlink() or not directory.is_dir():
            return None
        found = {".": [0, 0, directory.stat().st_ino]}
        for path in sorted(directory.rglob("*")):
            status = path.lstat()
            found[path.relative_to(directory).as_posix()] = [status.st_size if path.is_file() else -1,
                                                              status.st_mtime_ns, status.st_ino]
        return found
    except OSError:
        return None


def exported_before(run_dir: Path, directory: Path) -> bool:
    """Whether ``directory`` holds exactly the --save-hf export the run in ``run_dir`` wrote (its summary.json says
    where, and what files it held): a segment stopped by a signal exports too, and a resumed run replaces that export
    with its own. Anything else there (files added or changed since, an unrelated folder) is not the run's to
    replace."""
    summary = kept_summary(run_dir)
    if summary is None:
        return False
    recorded, files = summary.get("save_hf"), summary.get("save_hf_files")
    if not isinstance(recorded, str) or not recorded or not isinstance(files, dict):
        return False
    try:
        same_place = Path(recorded).resolve() == directory.resolve()
    except (OSError, RuntimeError):
        return False
    return same_place and export_files(directory) == files


def read_metrics(run_dir: Path, *, required: tuple[str, ...] = ROW_REQUIRED) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl, in order: the one reader of that file.

    A run killed mid-write can leave a torn last line (no newline, not valid JSON): the step it was writing did not
    finish, so that line is dropped. Any other line that is not a metrics row (a JSON object with a ``step`` and the
    ``required`` fields, each field of :data:`cadence.records.METRICS_ROW` of its type) raises :class:`MetricsUnreadable` naming
    the file, the line number and the field (``records.METRICS_ROW``: the fields' types). Blank lines are skipped.
    """
    path = run_dir / METRICS_FILE
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = parse_json(line, f"{path}:{number}")
        except NotJson as err:
            if number == len(lines) and not text.endswith("\n") and "valid JSON" in err.what:
                break  # torn by a kill mid-write
            raise MetricsUnreadable(path, number, err.what) from None
        if not isinstance(row, dict) or "step" not in row:
            raise MetricsUnreadable(path, number, "is not a metrics row (a JSON object with a step)")
        step = row["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            # A report of "x optimizer steps" is worse than none: the step is a count, or the row is not ours.
            raise MetricsUnreadable(path, number, f"has step {step!r}, not a count of optimizer steps")
        try:
            METRICS_ROW.check(Record(row, f"{path}:{number}"), required=required)
        except RecordInvalid as err:
            raise MetricsUnreadable(path, number, err.what, err.field) from None
        rows.append(row)
    return rows


def rewrite_metrics(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """Replace a run's metrics.jsonl with ``rows``, atomically (a resume drops the rows after its checkpoint)."""
    atomic_write_bytes(run_dir / METRICS_FILE, "".join(json.dumps(row) + "\n" for row in rows).encode("utf-8"))
