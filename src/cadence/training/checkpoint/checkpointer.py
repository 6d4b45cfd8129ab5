"""The owner of a run's checkpoints: which format it writes, and save, load and pruning in that format; and the one
reader of weights, a checkpoint's (any format) or a weights file's.

A checkpoint is one step-N folder (``layout``: staging, manifest, verification, pruning) in one format, a class
behind one protocol (``format``): ``files`` (one process, DDP: ``model.safetensors`` and the whole training state,
written by rank 0) or ``dcp`` (FSDP2: every rank writes its own shard with torch.distributed.checkpoint, nothing is
gathered, and each rank its own random generators; rank 0 adds the JSON training state and, once every rank has
written and checksummed its files, the manifest, then renames the folder into place).

With --async-checkpoint the state is copied and a thread of the Checkpointer's writes and seals it while training
goes on (see :class:`Checkpointer`).

The format a run writes is chosen from the run (:func:`~cadence.training.checkpoint.format.run_format`); the format a
checkpoint is read in, from its manifest. Either format resumes on any world size and strategy (DCP reshards; the
single file is loaded whole and FSDP2 keeps its shard), with the same effective batch (the resume refuses another).
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cadence.distributed.ranks import (
    Ranks,
    broadcast_from_main,
    full_model_state,
    like_parameter,
    unwrap,
    write_full_model_state,
)
from cadence.engine.step import PartialWindow
from cadence.records import CHECKPOINT_INFO
from cadence.training.checkpoint.files import read_weights_file
from cadence.training.checkpoint.format import Captured, run_format
from cadence.training.checkpoint.layout import (
    INFO_FILE,
    STATE_FILES,
    STATE_STEM,
    LoadedCheckpoint,
    checkpoint_format,
    checksums,
    prune_checkpoints,
    rank_state_stem,
    restore_rng_state,
    rng_state,
    seal,
    stage,
)
from cadence.training.components import Components
from cadence.training.run_dir import CHECKPOINTS_DIR, WEIGHTS_FILE, RunWriter, writing
from cadence.training.state_file import read_state, state_file_names, write_state


@dataclass(kw_only=True)
class _Capture:
    """What one checkpoint writes, taken from the live run (copied when it is written in the background)."""

    step: int
    staging: Path | None
    """The folder the ranks write into (rank 0 made it); None on ranks that write nothing of their own."""
    final: Path | None
    shared: dict[str, Any]
    """The training state rank 0 writes (scheduler, engine, data position, RNG, the interrupted window)."""
    info: dict[str, Any]
    captured: Captured
    """The model and optimizer as the run's format took them."""
    own: dict[str, Any] | None = None
    """This rank's own state when every rank writes one (sharded, or mid-window on several ranks)."""


class Checkpointer:
    """Saves the run's state into checkpoints/step-N/ in the run's format and loads any checkpoint back into it;
    prunes to the newest ``keep`` intact ones. Every rank holds one and calls :meth:`save` together.

    It is also where weights are read, in both directions: the live model's, for a checkpoint (:meth:`save`), the
    final file and --save-hf (:meth:`gathered_weights`, :meth:`save_final`) and --keep-best (:meth:`save_best`); and
    saved ones (:meth:`load`, :meth:`read_weights`). Weights that a reader should see other than the training ones
    (an optimizer that evaluates on averaged weights) are swapped in here, and in ``Evaluation.run`` for evaluation.

    With ``background`` (--async-checkpoint) a save copies the state (to the CPU, where it already is on CPU) and
    returns; a thread writes and seals it while training goes on. One write is in flight at most: the next save, the
    end of the run and a stop wait for it (:meth:`wait`). It counts only once sealed (the manifest is written last
    and the folder renamed into place), and pruning runs after the seal, so the newest complete checkpoint is never
    the one removed. A mid-window save is written at once (the run stops after it anyway)."""

    def __init__(self, run_dir: Path, ranks: Ranks, *, keep: int = 0, background: bool = False,
                 known_intact: Collection[Path] = ()) -> None:
        self.run_dir = run_dir
        self.ranks = ranks
        self.keep = keep
        self.format = run_format(ranks)
        self.intact: set[Path] = set(known_intact)
        """Checkpoints known to be whole (written by this run, or verified to resume from): pruning skips hashing
        them again."""
        self.saved_windows: int | None = None
        """The windows done at the last checkpoint this run saved or resumed from: one window boundary is never
        checkpointed twice."""
        self.background = background
        self._writer: ThreadPoolExecutor | None = None
        self._in_flight: Future[Path | None] | None = None
        self._group: Any = None
        if background:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cadence-checkpoint")
            if ranks.launched:  # every rank builds its Checkpointer at the same point, so all create it together
                self._group = dist.new_group(backend="gloo")

    # ------------------------------------------------------------------------------------------------------- save
    def save(self, parts: Components, *, data_position: dict[str, int], info: dict[str, Any],
             partial_window: dict[str, Any] | None = None) -> Path | None:
        """Write checkpoints/step-{step}/ with the weights, optimizer, scheduler, precision, counters, RNG, data
        position (and, mid-window, the gradients so far); a collective. The folder on rank 0 once written, None
        elsewhere and when it is written in the background."""
        self.wait()
        self.saved_windows = parts.engine.windows
        in_background = self.background and partial_window is None
        capture = self._capture(parts, copy=in_background, shared={
            "scheduler": None if parts.scheduler is None else parts.scheduler.state_dict(),
            "engine": parts.engine.state_dict(),
            # --effective-batch-size adaptive: the controller's multiple, streaks and switches
            "batch": None if parts.batch is None else parts.batch.state_dict(),
            "data_position": data_position,
            "rng": rng_state(),
            # --checkpoint-mid-window: the gradients of the micro-batches already done in the interrupted window
            "partial_window": partial_window,
        }, info=info)
        if in_background and self._writer is not None:
            self._in_flight = self._writer.submit(self._commit, capture, self._group)
            return None
        return self._commit(capture, None)

    def resumed_from(self, checkpoint: Path, *, windows: int) -> None:
        """The checkpoint this run resumed from (``windows`` done): known intact, so pruning does not hash it
        again, and not written again at the same window boundary."""
        self.intact.add(checkpoint)
        self.saved_windows = windows

    def wait(self) -> Path | None:
        """Wait for the write in flight (if any); what it wrote, or its failure raised here."""
        in_flight, self._in_flight = self._in_flight, None
        return None if in_flight is None else in_flight.result()

    def close(self) -> None:
        """Wait for the write in flight, then stop the writing thread (a failure of that write is not raised: the
        run is ending on another one)."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the failure being handled already says what went wrong
            pass
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _capture(self, parts: Components, *, copy: bool, shared: dict[str, Any], info: dict[str, Any]) -> _Capture:
        """Everything the checkpoint holds, read from the run now (collectives on the default group, by every
        rank): what the format takes (gathered whole, or this rank's shards) and the training state."""
        ranks, kind, step = self.ranks, self.format, parts.engine.steps
        partial = shared["partial_window"]
        capture = _Capture(step=step, staging=None, final=None, shared=shared, captured=kind.capture(parts, ranks),
                           info={"step": step, **info, "format": kind.name, "world_size": ranks.world_size})
        if kind.every_rank_writes or (partial is not None and ranks.world_size > 1):
            # Mid-window each rank has its own gradients and its own share of the window's loss so far.
            capture.own = {"rng": shared["rng"], "grads": (partial or {}).get("grads", {}),
                           "loss_sum": (partial or {}).get("loss_sum")}
        with writing(f"checkpoint step-{step} in {self.run_dir / CHECKPOINTS_DIR}",
                     then="the checkpoints before it are intact: free space, then --resume"):
            staging, capture.final = stage(self.run_dir, step) if ranks.is_main else (None, None)
        # One folder for all: rank 0 made it (a shared file system, as for the run directory itself).
        capture.staging = broadcast_from_main(staging, ranks) if capture.own is not None else staging
        if copy:  # the live tensors go on changing while the copy is written
            capture.shared, capture.own = _copied((capture.shared, capture.own))
            capture.captured = dataclasses.replace(capture.captured, tensors=_copied(capture.captured.tensors),
                                                   optimizer=_copied(capture.captured.optimizer))
        return capture

    def _commit(self, capture: _Capture, group: Any) -> Path | None:
        """Write, hash and seal what ``capture`` holds. The format's files are written by the ranks it says (rank 0,
        or every rank its shard); where every rank writes, each also writes its own state (its RNG and gradients)
        into rank 0's staging folder, and hashes its files. Rank 0 adds the shared state and, last, the manifest of
        all of them. Then pruning."""
        ranks, kind, staging = self.ranks, self.format, capture.staging
        with writing(f"checkpoint step-{capture.step} in {self.run_dir / CHECKPOINTS_DIR}",
                     then="the checkpoints before it are intact: free space, then --resume"):
            try:
                written: list[str] = []
                if capture.own is not None and staging is not None:
                    write_state(staging, rank_state_stem(ranks.rank), capture.own)
                    written += state_file_names(rank_state_stem(ranks.rank))
                if staging is not None:
                    written += kind.write(staging, capture.captured, ranks, group)
                mine = checksums(staging, written) if staging is not None else {}
                # Each rank hashes what it wrote; where every rank writes, rank 0 gathers the checksums.
                digests = _gathered(mine, ranks, group) if capture.own is not None else [mine]
                if not ranks.is_main or staging is None or capture.final is None:
                    return None
                shared = dict(capture.shared)
                if capture.own is not None and shared["partial_window"] is not None:  # the grads are per rank
                    shared["partial_window"] = {key: value for key, value in shared["partial_window"].items()
                                                if key != "grads"}
                write_state(staging, STATE_STEM, {"optimizer": capture.captured.optimizer, **shared})
                CHECKPOINT_INFO.write(staging / INFO_FILE, {**capture.info, **capture.captured.info})
                table = {name: digest for found in digests for name, digest in found.items()}
                table.update(checksums(staging, (*STATE_FILES, INFO_FILE)))
            except BaseException:
                if staging is not None and ranks.is_main:
                    _remove(staging)
                raise
            written_folder = seal(staging, capture.final, step=capture.step, kind=kind.name, checksums=table)
            self.intact.add(written_folder)
            if self.keep > 0:
                prune_checkpoints(self.run_dir, keep=self.keep, known_intact=self.intact)
        return written_folder

    # ------------------------------------------------------------------------------------------------------- load
    def load(self, checkpoint: LoadedCheckpoint, parts: Components) -> PartialWindow | None:
        """Load ``checkpoint`` (verified and read: ``layout.load_checkpoint``) into this run's model, optimizer,
        scheduler, precision state, counters and random generators; mid-window, this rank's gradients so far, and
        the window to continue (this rank's micro-batches done and loss so far) is returned. Every rank calls it. Raises what a state that does not fit raises (KeyError, ValueError, RuntimeError)."""
        state, path = checkpoint.state, checkpoint.path
        checkpoint_format(path).load(path, state["optimizer"], checkpoint.info, parts)
        if state["scheduler"] is not None:
            parts.scheduler.load_state_dict(state["scheduler"])
        parts.engine.load_state_dict(state["engine"])
        if parts.batch is not None and state.get("batch") is not None:
            parts.batch.load_state_dict(state["batch"])
        own = self._rank_state(path)
        restore_rng_state(own["rng"] if own is not None else state["rng"])
        partial = state.get("partial_window")
        if not partial:
            return None
        # The interrupted window's accumulated gradients go back exactly where they were.
        grads = own["grads"] if own is not None else partial.get("grads", {})
        trained = {name: parameter for name, parameter in unwrap(parts.model).named_parameters()
                   if parameter.requires_grad}
        restored = {}
        for name, grad in grads.items():  # under FSDP2 each rank's own shard, back into a sharded gradient
            if name not in trained:
                raise ValueError(f"a saved gradient {name!r} fits no trained parameter")
            try:
                restored[name] = like_parameter(grad, trained[name])
            except ValueError as err:
                raise ValueError(f"a saved gradient {name!r} fits no trained parameter: {err}") from None
        for name, grad in restored.items():
            trained[name].grad = grad
        loss_sum = own.get("loss_sum") if own is not None else None
        return PartialWindow(micro_batches_done=int(partial["micro_batches_done"]),
                             loss_sum=float(partial["loss_sum"] if loss_sum is None else loss_sum))

    # ---------------------------------------------------------------------------------------------------- weights
    @property
    def streams_weights(self) -> bool:
        """Under FSDP2 the whole weights are written a tensor at a time, never gathered whole onto one rank."""
        return self.ranks.launched and self.ranks.strategy == "fsdp"

    def gathered_weights(self, parts: Components) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0, for the final file and --save-hf (every rank calls it: FSDP2 would
        gather); empty where they are streamed instead (:attr:`streams_weights`)."""
        return {} if self.streams_weights else full_model_state(parts.model, self.ranks)

    def save_final(self, parts: Components, writer: RunWriter, weights: dict[str, torch.Tensor],
                   metadata: dict[str, str]) -> None:
        """OUT/model.safetensors, the final weights: ``weights`` as :meth:`gathered_weights` gave them, or (FSDP2)
        streamed by every rank together, rank 0 writing one gathered tensor at a time."""
        if not self.streams_weights:
            writer.save_model(weights, metadata=metadata)
            return
        path = self.run_dir / WEIGHTS_FILE
        with writing(str(path), then="the checkpoints so far are intact: free space, then --resume"):
            write_full_model_state(parts.model, self.ranks, path if self.ranks.is_main else None, metadata)

    def save_best(self, parts: Components, writer: RunWriter, record: dict[str, Any]) -> None:
        """--keep-best: the model's weights into OUT/best with ``record`` (its step and validation loss); every rank
        gathers its part, rank 0 writes; under FSDP2 one tensor at a time."""
        if self.streams_weights:
            writer.save_best_streamed(lambda path: write_full_model_state(parts.model, self.ranks, path), record)
            return
        writer.save_best(full_model_state(parts.model, self.ranks), record)

    def weights_at(self, path: Path) -> Path:
        """Where the weights of ``path`` (a checkpoint folder, or a weights file) are, for a message."""
        return checkpoint_format(path).weights_at(path) if path.is_dir() else path

    def read_weights(self, path: Path) -> dict[str, torch.Tensor]:
        """The whole model's weights, in this process: of a checkpoint folder (verified by the caller) in its format
        (a sharded one's shards assembled without a process group), or of a weights file (the final model, best/).
        Every reader of saved weights reads them here (resume through :meth:`load`, ``cadence sample``,
        ``cadence export``); raises ``WeightsUnreadable``."""
        return checkpoint_format(path).read_weights(path) if path.is_dir() else read_weights_file(path)

    def _rank_state(self, path: Path) -> dict[str, Any] | None:
        """This rank's own state (its RNG; mid-window, its gradients) in a checkpoint every rank wrote into: the one
        its rank wrote, or none when the checkpoint had fewer ranks or only rank 0 wrote (rank 0's RNG is used)."""
        if not (path / state_file_names(rank_state_stem(self.ranks.rank))[0]).is_file():
            return None
        own = read_state(path, rank_state_stem(self.ranks.rank))
        return own if isinstance(own, dict) else None


def _gathered(value: dict[str, str], ranks: Ranks, group: Any) -> list[dict[str, str]]:
    """Every rank's ``value``, in rank order (on every rank), over ``group`` (None: the default group)."""
    if not ranks.launched:
        return [value]
    found: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(found, value, group=group)
    return found


def _copied(value: Any) -> Any:
    """``value`` with every tensor copied (detached; DTensors stay DTensors) and every container rebuilt: what a
    background write may read while training changes the originals."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(item) for item in value)
    return copy.deepcopy(value)


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
