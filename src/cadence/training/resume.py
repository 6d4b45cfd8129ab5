"""Resume: continue a run exactly where its last checkpoint left it (the stop on a signal is ``stopping``'s).

A resumed run is indistinguishable from one that never stopped: the model, optimizer, scheduler, loss scaler,
counters and random generators come back from the checkpoint, the data order is the same per-epoch permutation
(seeded by --seed and the epoch) with the windows already done skipped, and metrics.jsonl loses the rows written
after the checkpoint (they are written again, identically).
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cadence.config.schema import MATH_FIELDS
from cadence.distributed.ranks import Ranks, broadcast_from_main, unwrap
from cadence.engine.cut import CUT_FLAG_DEFAULTS
from cadence.engine.schedules import lr_factor
from cadence.engine.step import PartialWindow
from cadence.errors import Problem, UsageError
from cadence.optim.spec import OptimizerSpec
from cadence.records import Record, RecordInvalid, integer
from cadence.training.checkpoint import (
    STATE_FILES,
    Checkpointer,
    CheckpointUnreadable,
    LoadedCheckpoint,
    checkpoint_dirs,
    load_checkpoint,
    newest_intact_checkpoint,
    verify_checkpoint,
)
from cadence.training.components import Components
from cadence.training.run_dir import (
    CHECKPOINTS_DIR,
    METRICS_FILE,
    RESUMED_ROW_REQUIRED,
    SUMMARY_FILE,
    MetricsUnreadable,
    read_metrics,
    read_summary,
    rewrite_metrics,
)

RESUME_CHECKED = (*MATH_FIELDS, "data_fingerprint", "data_store_digest")
"""What must match between the checkpoint's run and the resumed one: the fields that change the math or the data
order (``changes_math`` in the schema), and the data itself. The micro-batch split, the cut, recompute and offload
may change (they give the same gradient); so may logging. The data is compared by its content's fingerprint and the
token store's digest, not by the spelling of its path: the same file named another way (a relative path from
elsewhere, an absolute path, a link) resumes; other content under the same name is refused."""

_FLAG_OF = {"data_fingerprint": "--data", "data_store_digest": "--data"}

ADAPTIVE_FIELDS = ("min_effective_batch_size", "max_effective_batch_size", "batch_lr_scaling")
"""--effective-batch-size adaptive's own flags (None in a fixed-batch run's record)."""

BEFORE_THE_FLAG: dict[str, Any] = {"too_long": "truncate"}
"""What a run recorded before a math-changing flag existed did as that flag says: every example longer than
--seq-len was truncated then, so a resume of such a run with --too-long skip (now the default) is refused, not run on
fewer examples."""


@dataclass(kw_only=True)
class ResumePoint:
    checkpoint: Path
    step: int
    epoch: int
    windows_done_in_epoch: int
    kept_rows: list[dict[str, Any]]
    partial: PartialWindow | None = None
    """Set when the checkpoint was written mid-window: the window to continue, its gradients already restored."""
    partial_micro_batch_size: int | None = None
    saved_config: dict[str, Any] = field(default_factory=dict)
    """The resolved configuration the checkpoint's run recorded."""


def incompatibilities(saved: dict[str, Any], current: dict[str, Any]) -> list[Problem]:
    """The math-changing fields that differ, each named by its flag."""
    problems = []
    skipped: tuple[str, ...] = ()
    # An adaptive batch against a fixed one (either way round): one line, not one per adaptive flag.
    was, now = (record.get("min_effective_batch_size") is not None for record in (saved, current))
    if was != now:
        problems.append(Problem(where="--effective-batch-size", message=(
            "adaptive cannot continue a run trained at a fixed batch" if now else
            "a fixed batch cannot continue a run trained with --effective-batch-size adaptive")
            + " (the checkpoint's schedule counts other steps, and an adaptive run's state is its batch "
              "controller's); start a new --out"))
        skipped = ADAPTIVE_FIELDS
    for name in RESUME_CHECKED:
        if name in skipped:
            continue
        if name not in saved and name in BEFORE_THE_FLAG:
            saved = {**saved, name: BEFORE_THE_FLAG[name]}
        if name not in saved or _same(name, saved.get(name), current.get(name)):
            continue
        if name == "max_steps" and isinstance(current.get(name), int) and current[name] > int(saved[name]):
            continue  # training longer than planned: allowed (see schedule_note)
        if name == "data_fingerprint":
            message = (f"{current.get('data') or 'the built-in corpus'} does not hold the data the checkpoint was "
                       f"trained on (content {str(current.get(name))[:19]}... vs {str(saved.get(name))[:19]}...); "
                       f"resuming would mix other data into the run (start a new --out instead)")
        elif name == "data_store_digest":
            message = (f"the token store read now ({current.get('data_store')}) holds other tokens than the one the "
                       f"checkpoint was trained on ({saved.get('data_store')}): rebuilt another way or replaced; "
                       f"resuming would mix other tokens into the run (start a new --out instead)")
        elif name == "max_steps":
            message = (f"{current.get(name)!r} is below the checkpoint's {saved.get(name)!r}: a resume may train "
                       f"longer, not shorter (the schedule was decaying towards step {saved.get(name)}); stop the "
                       f"run early with a signal instead, or start a new --out")
        else:
            message = (f"{current.get(name)!r} differs from the checkpoint's {saved.get(name)!r}; resuming would "
                       f"change the math (start a new --out instead)")
        problems.append(Problem(where=_FLAG_OF.get(name, "--" + name.replace("_", "-")), message=message))
    return problems


def _same(name: str, saved: Any, current: Any) -> bool:
    if name == "model_config" and isinstance(saved, list) and isinstance(current, list):
        # KEY=VALUE overrides, the last of a key winning: given in another order, the same model.
        return dict(str(item).partition("=")[::2] for item in saved) == dict(
            str(item).partition("=")[::2] for item in current)
    return bool(saved == current)


def schedule_note(saved: dict[str, Any], current: dict[str, Any], steps_done: int) -> str | None:
    """What raising --max-steps on a resume does to the LR schedule, for the console (None when it was not raised).

    A decaying schedule (linear, cosine) is stretched to the new length from the next step on, so its LR rises
    back from where the shorter run had brought it: said with the figures, because it changes the run's course."""
    before, after = saved.get("max_steps"), current.get("max_steps")
    if before is None or after is None or after <= before:
        return None
    text = f"--max-steps raised from {before} to {after}"
    schedule = current.get("lr_schedule")
    if schedule == "constant" or steps_done < int(current.get("warmup_steps") or 0):
        return text + "; the LR schedule is unchanged up to here"
    shape: dict[str, Any] = {"schedule": schedule, "warmup_steps": int(current["warmup_steps"]),
             "min_lr_ratio": float(current["min_lr_ratio"])}
    old = lr_factor(steps_done, max_steps=int(before), **shape) * float(current["lr"])
    new = lr_factor(steps_done, max_steps=int(after), **shape) * float(current["lr"])
    new_text, old_text = distinct_figures(new, old)
    return (f"{text}: the {schedule} LR schedule now decays over {after} steps, so the LR after step {steps_done} "
            f"is {new_text} instead of {old_text}")


def distinct_figures(first: float, second: float) -> tuple[str, str]:
    """Two numbers with the fewest significant digits (3 at least) that tell them apart ("0.0002 instead of 0.0002"
    said nothing); equal numbers read alike."""
    for digits in range(3, 13):
        texts = (f"{first:.{digits}g}", f"{second:.{digits}g}")
        if texts[0] != texts[1] or first == second:
            return texts
    return f"{first!r}", f"{second!r}"


def restore(run_dir: Path, resolved_config: dict[str, Any], parts: Components, checkpointer: Checkpointer,
            micro_batch_size: int | None = None, cut: dict[str, Any] | None = None) -> ResumePoint | None:
    """Load the newest intact checkpoint of ``run_dir`` into ``parts`` with ``checkpointer`` (in the format the
    checkpoint was written in, whatever this run writes); None if there is none.

    Raises UsageError when the configuration changes the math, or when ``micro_batch_size`` or ``cut`` (the run's
    cut flags, if given: :meth:`cadence.engine.cut.Cut.flags`) differs from that of a window the checkpoint
    interrupted. Call before the run writer opens metrics.jsonl.
    Under several processes every rank calls it and all load the checkpoint rank 0 chose; rank 0 alone tidies the
    run directory.
    """
    main = parts.ranks.is_main
    rows, path = _checkpoint_to_resume(run_dir, parts.ranks)
    if path is None:  # a run killed before its first checkpoint starts over
        if main:
            _truncate_metrics(run_dir, rows, windows=0)
        return None
    try:
        checkpoint = load_checkpoint(path)
    except (CheckpointUnreadable, RecordInvalid) as err:
        raise _refused(path, run_dir, str(err)) from None
    problems = incompatibilities(checkpoint.info.get("resolved_config", {}), resolved_config)
    partial = checkpoint.state.get("partial_window")
    if partial:
        problems += _interrupted_window_problems(checkpoint, parts, resolved_config, micro_batch_size, cut or {})
    if problems:
        raise UsageError(problems)
    continued, windows_done, epoch, window_in_epoch = _load(checkpoint, parts, checkpointer, resolved_config)
    kept = _truncate_metrics(run_dir, rows, windows=windows_done) if main else []
    point = ResumePoint(checkpoint=checkpoint.path, step=checkpoint.step, epoch=epoch,
                        windows_done_in_epoch=window_in_epoch, kept_rows=kept,
                        saved_config=dict(checkpoint.info.get("resolved_config", {})))
    if partial:
        point.partial = continued
        point.partial_micro_batch_size = int(partial["micro_batch_size"])
    return point


def _checkpoint_to_resume(run_dir: Path, ranks: Ranks) -> tuple[list[dict[str, Any]], Path | None]:
    """Rank 0's metrics rows (the others': none) and the checkpoint every rank resumes from (None: a run killed
    before its first checkpoint, which starts over). Refused: unreadable metrics, checkpoints of which none is
    intact, a run that ended without any checkpoint, and a checkpoint without the metrics before it."""
    main = ranks.is_main
    rows, unreadable = _metrics_rows(run_dir) if main else ([], None)
    unreadable = broadcast_from_main(unreadable, ranks)  # every rank stops, not rank 0 alone
    if unreadable:
        raise UsageError([Problem(where="--resume", message=unreadable)])
    if main:
        for staging in (run_dir / CHECKPOINTS_DIR).glob(".step-*"):  # a write cut short by a kill: never renamed in
            shutil.rmtree(staging, ignore_errors=True)
    # All ranks decide together: rank 0's choice, even if a file changed between two ranks' checks.
    path = broadcast_from_main(newest_intact_checkpoint(run_dir) if main else None, ranks)
    if path is None:
        found = checkpoint_dirs(run_dir)
        if found:
            # Checkpoints exist but none can be used: starting over would silently throw the run away.
            raise UsageError([Problem(where="--resume", message=(
                f"no usable checkpoint in {run_dir / CHECKPOINTS_DIR}; "
                + "; ".join(f"{p.name}: {verify_checkpoint(p)}" for p in found)
                + " (nothing was changed; start a new --out to train from scratch)"))])
        # One that ended (it wrote its summary) without any checkpoint (--checkpoint-every 0) has nothing to continue
        # from, and starting over would replace its steps and final weights.
        if broadcast_from_main(main and (run_dir / SUMMARY_FILE).is_file(), ranks):
            raise UsageError([Problem(where="--resume", message=(
                f"{run_dir} holds a run that ended (it has a summary.json) without a checkpoint to continue from "
                f"(--checkpoint-every 0); nothing was changed: train a new --out to go on"))])
        return rows, None
    # A checkpoint without the history before it: the summary would count only the steps after the resume. Every
    # rank learns rank 0's finding, so that all stop together.
    if broadcast_from_main(main and not (run_dir / METRICS_FILE).is_file(), ranks):
        raise UsageError([Problem(where="--resume", message=(
            f"{run_dir / METRICS_FILE} is missing although {path.name} exists: the run's earlier steps would be lost "
            f"from its totals. Put the file back, or start a new --out (nothing was changed)"))])
    return rows, path


def _interrupted_window_problems(checkpoint: LoadedCheckpoint, parts: Components, resolved: dict[str, Any],
                                 micro_batch_size: int | None, cut: dict[str, Any]) -> list[Problem]:
    """Why this run cannot continue the window ``checkpoint`` interrupted (mid-window): its record must fit the
    model, and the world size, the micro-batch size and the cut must be the ones it was cut by."""
    path, partial = checkpoint.path, checkpoint.state["partial_window"]
    try:
        _check_partial_window(Record(partial, path / STATE_FILES[0], "partial_window"), parts.model,
                              most=_micro_batches_at_most(resolved, cut))
    except RecordInvalid as err:
        raise _refused(path, path.parent.parent, str(err)) from None
    problems = []
    saved_world = checkpoint.info.get("world_size", checkpoint.info.get("resolved_config", {}).get("world_size", 1))
    if saved_world != parts.ranks.world_size:
        problems.append(Problem(where="--nproc-per-node", message=(
            f"{parts.ranks.world_size} process(es) cannot continue the window the checkpoint interrupted on "
            f"{saved_world}: each rank holds its own gradients of that window (resume on {saved_world})")))
    if micro_batch_size is not None and int(partial["micro_batch_size"]) != micro_batch_size:
        problems.append(Problem(where="--micro-batch-size", message=(
            f"{micro_batch_size} differs from the {int(partial['micro_batch_size'])} of the window the checkpoint "
            f"interrupted")))
    for name, value in cut.items():
        # A mid-window checkpoint records the cut its window was cut by (the same keys), so that window is
        # continued from the micro-batch it stopped at, which is only the right one under the same cut. (Between
        # windows the cut is free to change: it changes the cost, not the math.) Older checkpoints lack the keys:
        # their windows were all drawn, unbudgeted and unpacked.
        saved = partial.get(name, CUT_FLAG_DEFAULTS[name])
        if saved != value:
            problems.append(Problem(where="--" + name.replace("_", "-"), message=(
                f"{value!r} differs from the {saved!r} of the window the checkpoint interrupted: that window must be "
                f"cut into micro-batches as it was to continue it (resume with {saved!r})")))
    return problems


def _load(checkpoint: LoadedCheckpoint, parts: Components, checkpointer: Checkpointer,
          resolved: dict[str, Any]) -> tuple[PartialWindow | None, int, int, int]:
    """Load ``checkpoint`` into ``parts``: the window it interrupted (None between windows), the windows done, the
    epoch and the windows done in it. Whatever does not fit this run is one refusal, before the metrics (the only
    file a resume changes) are touched."""
    state, path = checkpoint.state, checkpoint.path
    try:
        # A checkpoint whose manifest verifies can still hold states that do not fit this run (crafted, or written
        # by another model): each load below raises on its own terms.
        # The optimizer the run records is the one this run builds (its flags change the math: checked above).
        optimizer = OptimizerSpec.from_flags(resolved)
        optimizer.check_saved(Record(state["optimizer"], path / STATE_FILES[0], "optimizer"))
        continued = checkpointer.load(checkpoint, parts)
        optimizer.check_loaded(parts.optimizer)
        position = state["data_position"]
        return (continued, int(state["engine"]["windows"]), int(position["epoch"]),
                int(position["window_in_epoch"]))
    except (RecordInvalid, CheckpointUnreadable) as err:  # its weights do not parse, or a field is of a wrong kind
        raise _refused(path, path.parent.parent, str(err)) from None
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError, OverflowError) as err:
        what = f"missing {err}" if isinstance(err, KeyError) else (str(err).splitlines() or [""])[0][:300]
        raise _refused(path, path.parent.parent, f"{path} verifies against its manifest but does not fit this run "
                                                 f"({what})") from None


def _refused(checkpoint: Path, run_dir: Path, what: str) -> UsageError:
    """A checkpoint whose files verify but whose contents cannot be resumed: one line saying what is wrong, and the
    checkpoint to resume from instead. It is not passed over silently as a damaged one is: its manifest vouches for
    it, so the user decides whether to drop it (and the steps since the older one)."""
    older = next((found for found in reversed(checkpoint_dirs(run_dir))
                  if _step_of(found) < _step_of(checkpoint) and verify_checkpoint(found) is None), None)
    instead = (f"{older.name} is the next older intact checkpoint: remove {checkpoint} to resume from it, or start "
               f"a new --out" if older is not None else "there is no older intact checkpoint: start a new --out")
    return UsageError([Problem(where="--resume", message=f"{what}; nothing was changed: {instead}")])


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.rpartition("-")[2])


def _micro_batches_at_most(resolved: dict[str, Any], cut: dict[str, Any]) -> int:
    """The most micro-batches a window of this run has on one process: the accumulation for a cut by rows, at most
    one per sample of the window when a token budget or packing decides."""
    accumulation, batch = resolved.get("grad_accum_steps"), resolved.get("effective_batch_size")
    world = resolved.get("world_size") or 1
    if not cut.get("micro_batch_tokens") and not cut.get("packing") and isinstance(accumulation, int):
        return max(accumulation, 1)
    return max(batch // world, 1) if isinstance(batch, int) and isinstance(world, int) else 1 << 62


def _check_partial_window(partial: Record, model: Any, *, most: int) -> None:
    """An interrupted window's record must fit this run: a stop comes between two micro-batches, so fewer than the
    window's micro-batches are done (more would skip the whole window, and its gradient with it), and each saved
    gradient is that of a trained parameter, of its shape (torch refuses another shape only at the assignment)."""
    partial.take("micro_batches_done", integer(1, most - 1, words=f"a count from 1 to {most - 1} (the micro-batches "
                                                                  f"done of a window of {most})"))
    trained = {name: parameter for name, parameter in unwrap(model).named_parameters() if parameter.requires_grad}
    grads = partial.record("grads", default=Record({}, partial.source))  # per rank: checked as each rank loads
    for name, grad in grads.data.items():
        if name not in trained:
            raise grads.invalid(name, "is the gradient of no trained parameter of this model")
        if tuple(grad.shape) != tuple(trained[name].shape):
            raise grads.invalid(name, f"has shape {tuple(grad.shape)}, not its parameter's "
                                      f"{tuple(trained[name].shape)}")


def _metrics_rows(run_dir: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The run's metrics rows (none when it has no metrics.jsonl yet), or why they cannot be read: only a torn last
    line, cut short by the kill, is dropped; any other bad line stops the resume before anything is changed."""
    try:
        # summary.json too, before anything is changed: the resumed run adds its segments and totals to its own.
        read_summary(run_dir)
    except RecordInvalid as err:
        return [], f"{err} (nothing was changed)"
    if not (run_dir / METRICS_FILE).is_file():
        return [], None
    try:
        return read_metrics(run_dir, required=RESUMED_ROW_REQUIRED), None
    except MetricsUnreadable as err:
        return [], f"{err}; only a torn last line (a run killed mid-write) is dropped (nothing was changed)"


def _truncate_metrics(run_dir: Path, rows: list[dict[str, Any]], *, windows: int) -> list[dict[str, Any]]:
    """Keep the metrics rows of the first ``windows`` windows (rows after the checkpoint are written again)."""
    if not (run_dir / METRICS_FILE).is_file():
        return []
    kept = list(itertools.takewhile(lambda row: int(row.get("window", 0)) <= windows, rows))
    rewrite_metrics(run_dir, kept)
    return kept
