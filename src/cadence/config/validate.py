"""Validation of a TrainConfig: every field and combination checked, ALL problems reported at once, each naming its
flag; also the helpers validation shares with the CLI (sizes, devices)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, get_type_hints

from cadence.config.schema import (
    DEVICE_CHOICES,
    FP32_MATMUL_CHOICES,
    LORA_BASE_PRECISIONS,
    MAX_SEED,
    STRATEGIES,
    TrainConfig,
    flag,
    hint_types,
    parse_size,
)
from cadence.data.choices import TOO_LONG_CHOICES
from cadence.data.hf import HF_DATA_PREFIX
from cadence.engine.adaptive_batch import BATCH_MODES, LORA_MAX_BATCH, AdaptiveBatch, parse_ramp_tokens
from cadence.engine.choices import BATCH_LR_SCALINGS, LAST_WINDOW_CHOICES, LR_SCHEDULES, PRECISIONS
from cadence.engine.cut import MICRO_BATCH_ORDER_CHOICES
from cadence.engine.objective import Objective
from cadence.engine.precision import precision_problem
from cadence.errors import Problem, UsageError
from cadence.memory.choices import CHECKPOINTING_MODES, OFFLOAD_MODES
from cadence.models.compile import compile_problem
from cadence.models.spec import ModelSpec
from cadence.optim.choices import OPTIMIZER_STATES, OPTIMIZERS
from cadence.optim.spec import OptimizerSpec
from cadence.records import RUN_CONFIG

if TYPE_CHECKING:
    import torch


def validate(config: TrainConfig, *, world_size: int = 1, launched: bool = False,
             cuda_available: bool | None = None) -> None:
    """Check every field and combination; raise one UsageError listing ALL problems, each naming its flag.

    ``launched``: this process was started by torchrun (or is about to start ``world_size`` of them)."""

    # A name the file system cannot hold makes every later check of it (exists, is_dir) raise ENAMETOOLONG: such
    # paths are reported first, alone.
    too_long = [Problem(where=flag(name), message=problem) for name in PATH_FIELDS
                if (problem := path_length_problem(getattr(config, name))) is not None]
    if too_long:
        raise UsageError(too_long)
    problems = [*_batch_shape_problems(config, world_size), *_adaptive_problems(config, world_size),
                *_value_problems(config), *_model_problems(config),
                *_run_problems(config), *_optimizer_problems(config, launched),
                *distributed_problems(config, world_size, launched),
                *_device_problems(config, cuda_available)]
    if problems:
        raise UsageError(problems)


def _optimizer_problems(config: TrainConfig, launched: bool) -> list[Problem]:
    """The optimizer's own checks, once its name and state are known: options that do not apply to it, its packages,
    what FSDP2 cannot shard."""
    if config.optimizer not in OPTIMIZERS or config.optimizer_state not in OPTIMIZER_STATES:
        return []  # named by _value_problems
    return OptimizerSpec.from_flags(config).problems(
        sharded=launched and config.strategy == "fsdp",
        lr_schedule=config.lr_schedule if config.lr_schedule in LR_SCHEDULES else None)


class _Checks:
    """One concern's problems with one config: each check adds a problem naming the field's flag."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.problems: list[Problem] = []

    def bad(self, name: str, message: str) -> None:
        self.problems.append(Problem(where=flag(name), message=message))

    def choice(self, name: str, allowed: tuple[str, ...]) -> None:
        value = getattr(self.config, name)
        if value not in allowed:
            self.bad(name, f"{value!r} is not one of {', '.join(allowed)}")

    def at_least(self, name: str, minimum: int) -> bool:
        value = getattr(self.config, name)
        if value is not None and value < minimum:
            self.bad(name, f"must be at least {minimum}, got {value}")
            return False
        return True

    def finite_range(self, name: str, low: float, high: float, *, low_open: bool = False,
                     high_open: bool = False) -> None:
        value = getattr(self.config, name)
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if not math.isfinite(value) or too_low or too_high:
            left, right = "(" if low_open else "[", ")" if high_open else "]"
            self.bad(name, f"must be in {left}{low:g}, {high:g}{right}, got {value:g}")


def _value_problems(config: TrainConfig) -> list[Problem]:
    """Each number and choice on its own: the precision and memory levers, the cut, the optimizer and the schedule."""
    check = _Checks(config)
    check.at_least("seq_len", 2)
    allowed: tuple[str, ...]
    for name, allowed in (("too_long", TOO_LONG_CHOICES), ("precision", PRECISIONS),
                          ("activation_checkpointing", CHECKPOINTING_MODES), ("offload", OFFLOAD_MODES),
                          ("fp32_matmul", FP32_MATMUL_CHOICES)):
        check.choice(name, allowed)
    if check.at_least("prefetch_windows", 0) and config.prefetch_windows > MAX_PREFETCH_WINDOWS:
        check.bad("prefetch_windows", f"must be at most {MAX_PREFETCH_WINDOWS}, got {config.prefetch_windows} "
                                      f"(each window ahead waits collated in memory; 1 or 2 already hide the data's "
                                      f"preparation)")
    check.problems += Objective.problems(config)
    check.at_least("auto_grow_after", 1)
    if config.memory_budget is not None:
        try:
            if parse_size(config.memory_budget) <= 0:
                check.bad("memory_budget", "must be above 0")
        except ValueError as err:
            check.bad("memory_budget", str(err))
    for name, allowed in (("lr_schedule", LR_SCHEDULES), ("last_window", LAST_WINDOW_CHOICES),
                          ("micro_batch_order", MICRO_BATCH_ORDER_CHOICES)):
        check.choice(name, allowed)
    if check.at_least("micro_batch_tokens", 1) and config.micro_batch_tokens is not None:
        if config.seq_len is not None and config.micro_batch_tokens < config.seq_len:
            check.bad("micro_batch_tokens", f"{config.micro_batch_tokens} is below --seq-len {config.seq_len}: the "
                                            f"longest example must fit one micro-batch")
    check.choice("device", DEVICE_CHOICES)
    if not math.isfinite(config.max_grad_norm) or config.max_grad_norm < 0:
        check.bad("max_grad_norm", f"must be >= 0 (0 turns clipping off), got {config.max_grad_norm:g}")
    if not math.isfinite(config.lr) or config.lr <= 0:
        check.bad("lr", f"must be a positive number, got {config.lr:g}")
    check.finite_range("weight_decay", 0.0, 1.0)
    check.finite_range("adam_beta1", 0.0, 1.0, high_open=True)
    check.finite_range("adam_beta2", 0.0, 1.0, high_open=True)
    if config.momentum is not None:
        check.finite_range("momentum", 0.0, 1.0, high_open=True)
    check.choice("optimizer", OPTIMIZERS)
    check.choice("optimizer_state", OPTIMIZER_STATES)
    check.finite_range("min_lr_ratio", 0.0, 1.0)
    if config.val_fraction is not None:  # not given: held_out_fraction decides
        check.finite_range("val_fraction", 0.0, 0.5)
    check.finite_range("noise_scale_ema", 0.0, 1.0, high_open=True)
    if config.epochs is not None:
        check.at_least("epochs", 1)  # the steps follow from the data: warmup is checked against them once it is loaded
    elif check.at_least("max_steps", 1) and check.at_least("warmup_steps", 0) and \
            config.warmup_steps >= config.max_steps > 1:
        check.bad("warmup_steps", f"{config.warmup_steps} leaves no steps after warmup; must be below --max-steps "
                                  f"{config.max_steps}")
    if check.at_least("seed", 0) and config.seed > MAX_SEED:
        check.bad("seed", f"must be at most 2**64 - 1 = {MAX_SEED}, got {config.seed}")
    return check.problems


def _model_problems(config: TrainConfig) -> list[Problem]:
    """The model flags: the model's own rules (its family's, the LoRA flags'; :meth:`ModelSpec.problems`)."""
    check = _Checks(config)
    check.choice("lora_base_precision", LORA_BASE_PRECISIONS)
    return ModelSpec.problems(config) + check.problems


def _run_problems(config: TrainConfig) -> list[Problem]:
    """What the run reads and writes, and when: evaluation, checkpoints, --data, --plan, --out and --resume."""
    check = _Checks(config)
    for name, minimum in (("eval_batches", 0), ("checkpoint_every", 0), ("log_every", 1)):
        check.at_least(name, minimum)
    if check.at_least("eval_every", 0) and config.eval_every > 0 and config.val_fraction == 0 and \
            config.eval_data is None:
        check.bad("eval_every", "needs a validation split; set --val-fraction above 0 or give --eval-data")
    if check.at_least("early_stop_after", 0) and config.early_stop_after > 0 and config.eval_every <= 0:
        check.bad("early_stop_after", "counts evaluations: give --eval-every N too")
    if config.keep_best and config.eval_every <= 0:
        check.bad("keep_best", "keeps the best evaluation's weights: give --eval-every N too")
    if config.eval_data is not None and not config.eval_data.is_file():
        check.bad("eval_data", f"{config.eval_data} is not a file")
    if config.plan is not None and not config.plan.is_file():
        check.bad("plan", f"{config.plan} is not a file; give the plan.json that cadence plan wrote")
    if config.data is not None and str(config.data).startswith(HF_DATA_PREFIX):
        if not Path(str(config.data)[len(HF_DATA_PREFIX):]).exists():
            check.bad("data", f"{str(config.data)[len(HF_DATA_PREFIX):]} does not exist (hf:PATH is a dataset saved "
                              f"by save_to_disk)")
    elif config.data is not None and not config.data.exists():
        check.bad("data", f"{config.data} does not exist")
    if config.out is not None and (problem := run_directory_problem(config.out, resume=config.resume)):
        check.bad("out", problem)
    if config.resume and config.out is None:
        check.bad("resume", "needs --out: the run directory to continue")
    check.at_least("keep_checkpoints", 0)
    if config.checkpoint_mid_window and config.micro_batch_size == "auto":
        check.bad("checkpoint_mid_window", "needs a fixed --micro-batch-size (auto may re-cut the window it would "
                                           "continue)")
    check.at_least("max_skipped_steps", 1)
    return check.problems


def _device_problems(config: TrainConfig, cuda_available: bool | None) -> list[Problem]:
    """The device, and what only a real op on it tells: whether it runs the precision and torch.compile."""
    check = _Checks(config)
    device_ok = config.device in DEVICE_CHOICES
    if config.device == "cuda" and not (_cuda_available() if cuda_available is None else cuda_available):
        check.bad("device", "cuda was asked for but this machine has no usable CUDA device; use cpu or auto")
        device_ok = False
    if device_ok and config.precision in PRECISIONS:
        # Only a real op tells whether this build and device run the precision (fp16 on some CPUs, bf16 on old GPUs).
        reason = precision_problem(config.precision, resolve_device(config.device))
        if reason is not None:
            check.bad("precision", reason)
    if config.compile and device_ok and (reason := compile_problem(resolve_device(config.device))) is not None:
        check.bad("compile", reason)  # where torch.compile cannot run here
    return check.problems


def _batch_shape_problems(config: TrainConfig, world_size: int) -> list[Problem]:
    """--micro-batch-size, --grad-accum-steps and --effective-batch-size: each valid, and consistent together."""
    problems: list[Problem] = []

    def bad(name: str, message: str) -> None:
        problems.append(Problem(where=flag(name), message=message))

    micro = config.micro_batch_size
    if isinstance(micro, str) and micro != "auto":
        bad("micro_batch_size", f"{micro!r} is neither a whole number nor auto")
    elif isinstance(micro, int) and micro < 1:
        bad("micro_batch_size", f"must be at least 1 (or auto), got {micro}")
    accum, effective = config.grad_accum_steps, config.effective_batch_size
    if effective in BATCH_MODES:
        return problems  # its bounds and what does not combine with it: _adaptive_problems
    if isinstance(effective, str):
        bad("effective_batch_size", f"{effective!r} is measured only by cadence plan (--effective-batch-size auto "
                                    f"chooses it from the gradient noise scale); give a whole number here"
            if effective == "auto" else f"{effective!r} is not a whole number")
        return problems
    if accum is not None and accum < 1:
        bad("grad_accum_steps", f"must be at least 1, got {accum}")
    if effective is not None and effective < 1:
        bad("effective_batch_size", f"must be at least 1, got {effective}")
    if problems:
        return problems
    if micro == "auto":
        if effective is None:
            bad("micro_batch_size", "auto needs --effective-batch-size (the batch that auto keeps fixed)")
        elif effective % ((accum or 1) * world_size) != 0:
            bad("effective_batch_size", f"{effective} is not divisible by --grad-accum-steps x processes = "
                                        f"{(accum or 1) * world_size}")
        return problems
    if effective is not None:
        per_step = int(micro) * world_size
        if effective % per_step != 0:
            bad("effective_batch_size", f"{effective} is not divisible by --micro-batch-size x processes = "
                                        f"{per_step}; use a multiple of {per_step}")
        elif accum is not None and accum * per_step != effective:
            bad("effective_batch_size", f"{effective} contradicts --grad-accum-steps {accum} x --micro-batch-size "
                                        f"{micro} x {world_size} process(es); give one of the two")
    return problems


def _adaptive_problems(config: TrainConfig, world_size: int) -> list[Problem]:
    """--effective-batch-size adaptive: its bounds, its LR scaling, and what it does not combine with (its flags
    without it are refused too)."""
    check = _Checks(config)
    own = ("min_effective_batch_size", "max_effective_batch_size", "batch_lr_scaling", "batch_branch_test",
           "batch_branch_tolerance")
    mode = config.effective_batch_size
    if mode not in BATCH_MODES:
        for name in own:
            if getattr(config, name) is not None:
                check.bad(name, "applies only with --effective-batch-size adaptive (or ramp)")
        if config.batch_ramp_tokens:
            check.bad("batch_ramp_tokens", "applies only with --effective-batch-size ramp")
        return check.problems
    ramp = mode == "ramp"
    check.problems += _ramp_problems(config)
    low, high = config.min_effective_batch_size, config.max_effective_batch_size
    if low is None:
        if high is None:
            check.bad("effective_batch_size", (
                f"{mode} runs between --min-effective-batch-size and --max-effective-batch-size (give them: cadence "
                f"train and cadence plan take them); cadence profile and verify take a fixed batch (a whole number)"))
        else:
            check.bad("min_effective_batch_size", f"is required with --effective-batch-size {mode}: the starting "
                                                  "and smallest batch")
        return check.problems
    if high is None and not config.lora_rank:
        check.bad("max_effective_batch_size", f"is required with --effective-batch-size {mode} (a LoRA run "
                                              f"defaults to {LORA_MAX_BATCH})")
    if config.grad_accum_steps is not None:
        check.bad("grad_accum_steps", f"contradicts --effective-batch-size {mode}, which sets the accumulation "
                                      "itself; leave it out")
    micro = config.micro_batch_size
    if micro == "auto":
        check.bad("micro_batch_size", f"auto does not combine with --effective-batch-size {mode} (which changes the "
                                      "accumulation, never the micro-batch): give a whole number")
    elif isinstance(micro, int) and micro >= 1 and low >= 1:
        per_window = micro * world_size
        if low % per_window != 0:
            check.bad("min_effective_batch_size", f"{low} is not a multiple of --micro-batch-size x processes = "
                                                  f"{per_window}")
        elif low == per_window and world_size == 1 and not ramp:
            check.bad("min_effective_batch_size", (
                f"{low} is one micro-batch per window on one process, and the noise scale adaptive decides from "
                f"needs two sizes: give at least {2 * per_window} (2 x --micro-batch-size)"))
    if config.noise_scale_ema == 0 and not ramp:
        check.bad("noise_scale_ema", "0 turns off the gradient noise scale that --effective-batch-size adaptive "
                                     "decides from")
    if config.checkpoint_mid_window:
        check.bad("checkpoint_mid_window", f"does not combine with --effective-batch-size {mode} (a window it would "
                                           "continue may be regrouped)")
    if ramp and config.batch_branch_test is not None:
        check.bad("batch_branch_test", "tests the measured rule's grows (--effective-batch-size adaptive); a preset "
                                       "ramp grows when its token counts say")
    else:
        check.problems += _branch_test_problems(config, world_size)
    if config.batch_lr_scaling is not None and config.batch_lr_scaling not in BATCH_LR_SCALINGS:
        check.choice("batch_lr_scaling", BATCH_LR_SCALINGS)
    elif high is not None:
        tokens = parse_ramp_tokens(config.batch_ramp_tokens) if ramp else ()
        check.problems += AdaptiveBatch(minimum=low, maximum=high, ramp_tokens=tokens or ()).problems()
    return check.problems


def _ramp_problems(config: TrainConfig) -> list[Problem]:
    """--batch-ramp-tokens: given with ramp only, whole numbers (the policy checks their order and count)."""
    check = _Checks(config)
    given = config.batch_ramp_tokens
    if config.effective_batch_size != "ramp":
        if given:
            check.bad("batch_ramp_tokens", "applies only with --effective-batch-size ramp")
    elif not given:
        check.bad("batch_ramp_tokens", "is required with --effective-batch-size ramp: the token counts at which the "
                                       "batch doubles, e.g. 65536,131072")
    elif not parse_ramp_tokens(given):
        check.bad("batch_ramp_tokens", f"{','.join(given)} is not a list of whole token counts (e.g. 65536,131072)")
    return check.problems


def _branch_test_problems(config: TrainConfig, world_size: int) -> list[Problem]:
    """--batch-branch-test and its tolerance (with --effective-batch-size adaptive)."""
    check = _Checks(config)
    windows, tolerance = config.batch_branch_test, config.batch_branch_tolerance
    if windows is None:
        if tolerance is not None:
            check.bad("batch_branch_tolerance", "applies only with --batch-branch-test")
        return check.problems
    if windows < 1:
        check.bad("batch_branch_test", f"must be at least 1 window, got {windows}")
    if tolerance is not None and not math.isfinite(tolerance):
        check.bad("batch_branch_tolerance", f"must be a finite number, got {tolerance}")
    if config.eval_every <= 0:
        check.bad("batch_branch_test", "compares the branches on validation micro-batches: give --eval-every (and "
                                       "a validation split)")
    return check.problems


MAX_COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600
"""The longest --collective-timeout: a week is longer than any collective should wait, and far inside the limits of
the timedelta and the milliseconds torch converts it to."""

MAX_PREFETCH_WINDOWS = 64
"""The most --prefetch-windows: every window ahead holds its collated micro-batches (pinned, on CUDA) until the loop
takes it, so a million grew memory without bound; a few already keep the accelerator fed."""

PATH_FIELDS: tuple[str, ...] = tuple(name for name, hint in get_type_hints(TrainConfig).items()
                                    if Path in hint_types(hint))
"""The TrainConfig fields that name a file or directory (typed Path: a new one is checked as these are)."""


def path_length_problem(path: Path | None) -> str | None:
    """Why the file system cannot take ``path`` as a name (a component over NAME_MAX bytes, the whole over
    PATH_MAX), or None."""
    if path is None:
        return None
    try:
        name_max, path_max = os.pathconf("/", "PC_NAME_MAX"), os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf here: the common Linux limits
        name_max, path_max = 255, 4096
    encoded = os.fsencode(path)
    if len(encoded) >= path_max:
        return f"the path is {len(encoded):,} bytes long; this system takes at most {path_max - 1:,}"
    longest = max((len(part) for part in encoded.split(b"/")), default=0)
    if longest > name_max:
        return (f"a name in {str(path)[:60]}... is {longest} bytes long; this file system takes at most {name_max} "
                f"bytes per name")
    return None


RUN_FOLDERS = ("checkpoints", "best", "tensorboard")
"""The folders of a run directory (training/run_dir.py writes them); a resume refuses one that is a link."""


def is_cadence_config(path: Path) -> bool:
    """Whether ``path`` is a config.json that cadence train wrote: a JSON object with the resolved batch fields, the
    data's fingerprint and cadence's version (``versions.cadence``), the mark by which --resume knows its own runs."""
    return RUN_CONFIG.holds(path)  # its marks (records.RUN_CONFIG), read as any record cadence reads back


def run_directory_problem(out: Path, *, resume: bool) -> str | None:
    """Why a run may not write ``out``, or None: a new run needs a directory it can create, or an empty one; --resume
    needs an empty directory (a fresh start) or one that cadence train wrote. Checked by validate() up front, and again
    by the run holding the directory's lock, since another run may have written it in between."""
    inside = enclosing_run(out)
    if inside is not None:
        # Its checkpoints/, best/ and tensorboard/ belong to that run, which replaces and prunes them: a run kept
        # there would be deleted or overwritten by it (and a run's own folders are not a place for another run).
        return (f"{out} lies inside the cadence run directory {inside}, whose folders that run replaces and prunes; "
                f"choose a directory outside it")
    if resume and out.is_dir():
        return _resume_problem(out)
    return _out_problem(out)


def enclosing_run(path: Path) -> Path | None:
    """The cadence run directory (one holding a config.json that cadence train wrote) that ``path`` lies inside,
    the nearest first, or None. ``path`` itself does not count: a run resumed in place is its own."""
    try:
        ancestors = path.resolve().parents
    except (OSError, RuntimeError):  # a symlink loop: the path is refused elsewhere
        return None
    for ancestor in ancestors:
        if is_cadence_config(ancestor / "config.json"):
            return ancestor
    return None


def _resume_problem(out: Path) -> str | None:
    """--resume writes into an existing directory: refuse one that holds files but is not a cadence run, so that
    a mistyped --out never overwrites someone's config.json or model.safetensors. Only cadence's own config.json
    counts (it is written before any step): a checkpoints/ folder or a metrics.jsonl alone may be another tool's."""
    try:
        entries = {entry.name for entry in out.iterdir()}
    except OSError as err:
        return f"{out} cannot be read: {err.strerror or err}"
    if not entries:
        return None if os.access(out, os.W_OK) else f"{out} is not writable"
    if is_cadence_config(out / "config.json"):
        # A copied config.json alone does not make a folder a run: cadence writes metrics.jsonl beside it before
        # any step, and a run's own folders are folders, never links that would carry its writes elsewhere.
        if not (out / "metrics.jsonl").is_file() or (out / "metrics.jsonl").is_symlink():
            return (f"{out} has a cadence config.json but its metrics.jsonl is missing, so it is not (or no longer) a "
                    f"whole run directory: --resume would lose the run's earlier steps or write into a folder that is "
                    f"not a run. Put the file back, or start a new --out (nothing was changed)")
        for name in RUN_FOLDERS:
            if (out / name).is_symlink() or ((out / name).exists() and not (out / name).is_dir()):
                return (f"{out / name} is a link or a file, not the run's own folder; cadence writes only inside the "
                        f"run directory: remove it, or start a new --out (nothing was changed)")
        return None if os.access(out, os.W_OK) else f"{out} is not writable"
    return (f"{out} holds files but is not a cadence run directory (it has no config.json written by cadence "
            f"train); --resume would write into it. Give the run's directory, or a new --out (nothing was changed)")


def _out_problem(out: Path) -> str | None:
    """Why the run directory cannot be created there, or None. Checked up front so nothing is half-written."""
    try:
        os.fsencode(out).decode("utf-8")
    except UnicodeDecodeError:
        # The run's files record the path and TensorBoard insists on UTF-8 names: refuse before anything is created.
        return f"{os.fsencode(out)!r} is not a UTF-8 name; choose a name in UTF-8"
    if out.exists():
        if not out.is_dir():
            return f"{out} is a file; give a directory to create"
        if any(out.iterdir()):
            return f"{out} already exists and is not empty; choose a new directory"
        return None if os.access(out, os.W_OK) else f"{out} is not writable"
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot create {out}: {ancestor} is a file"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot create {out}: {ancestor} is not writable"
    return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device(name: str) -> "torch.device":
    """auto -> cuda when available, else cpu."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def distributed_problems(config: TrainConfig, world_size: int, launched: bool) -> list[Problem]:
    """--strategy and its companions: meaningful only with several processes, and only in combinations that work."""

    problems: list[Problem] = []

    def bad(name: str, message: str) -> None:
        problems.append(Problem(where=flag(name), message=message))

    if config.strategy not in STRATEGIES:
        bad("strategy", f"{config.strategy!r} is not one of {', '.join(STRATEGIES)}")
    elif not launched and config.strategy != "ddp" and not config.resume:
        # A resume on one process may continue a run of several (its recorded strategy comes with it): one process
        # shares the model with nobody, so the strategy decides nothing there, and its checkpoints load either way.
        bad("strategy", f"{config.strategy} needs several processes: add --nproc-per-node N or start with torchrun")
    if config.sync_every_micro_step and config.strategy != "fsdp":
        bad("sync_every_micro_step", "only helps --strategy fsdp (DDP keeps whole gradients on every rank either way, "
                                     "so syncing every micro-batch would only add communication)")
    if not math.isfinite(config.collective_timeout) or not 0 < config.collective_timeout <= MAX_COLLECTIVE_TIMEOUT_S:
        # torch turns the timeout into a timedelta (and its C++ into milliseconds): 1e30 s overflowed both.
        bad("collective_timeout", f"must be a positive number of seconds up to {MAX_COLLECTIVE_TIMEOUT_S:,} (7 days), "
                                  f"got {config.collective_timeout:g}")
    if launched:
        if config.checkpoint_mid_window and world_size > 1 and config.strategy == "fsdp" \
                and not config.sync_every_micro_step:
            bad("checkpoint_mid_window", "under --strategy fsdp needs --sync-every-micro-step: without it a rank's "
                                         "not yet synchronised gradients of a window are inside FSDP2's own state, "
                                         "which has no public accessor to save them from; with it each rank holds "
                                         "its shard of the window's gradient so far, and saves that")
        if config.strategy == "fsdp" and config.precision == "fp16":
            bad("precision", "fp16 with --strategy fsdp is not supported: each rank would find inf/nan in its own "
                             "gradient shard and skip steps alone; use bf16")
    return problems
