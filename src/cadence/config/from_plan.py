"""``train --plan PLAN.json``: the configuration with a plan's decision, read through the typed plan record.

A plan's decision is a source of configuration like the TOML file and the flags: ``cadence train`` (and profile,
verify) read it while building their TrainConfig, so it is here, below every package that runs anything. What the
plan decided and measured (the split, the levers, the cut, the model, the sequence length, the data) becomes the run's
flags; a flag the user gives that contradicts it is a usage error naming the flag, and a cut that could raise the peak
the plan measured is refused saying why.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

from cadence.config.plan_file import CUT_FLAGS, PlanRecord, read_plan
from cadence.config.schema import TrainConfig
from cadence.engine.cut import CUT_FLAG_DEFAULTS
from cadence.errors import Problem, UsageError
from cadence.records import RecordInvalid


def apply_plan(config: TrainConfig, given: set[str], *, command: str = "train") -> TrainConfig:
    """The configuration with the plan's decision; a given flag that contradicts the plan is a usage error. An
    adaptive plan is trained by ``cadence train`` only (``command``: the one applying it)."""
    path = config.plan
    if path is None:
        raise ValueError("apply_plan needs config.plan")  # library misuse: the CLI calls it only with --plan
    plan = read_plan(path, where="--plan")  # every field it gives the run has the type of the flag it sets
    source = f"--plan {path}"
    if plan.adaptive_batch is not None and command != "train":
        raise UsageError.single("--plan", (
            f"{path} plans an adaptive effective batch, which only cadence train runs; cadence {command} takes a "
            f"fixed batch: give the plan's minimum instead (--micro-batch-size "
            f"{plan.choice.flags.get('micro_batch_size') if plan.choice else '?'} --effective-batch-size "
            f"{plan.effective_batch_size} with the plan's levers)"))
    if plan.choice is None:
        raise RecordInvalid(source, "choice", "is missing")
    if plan.model is None:
        raise RecordInvalid(source, "model", "is missing")
    decided: dict[str, Any] = {**plan.choice.flags, "model": plan.model, "seq_len": plan.seq_len,
                               "effective_batch_size": None}
    if plan.model_config:  # a Hugging Face model's --model-config overrides
        decided["model_config"] = plan.model_config
    decided.update(plan.lora or {})  # plans made before LoRA was recorded trained no adapters
    decided.update(plan.objective or {})  # plans made before the objective was recorded trained sft
    if plan.optimizer is not None:  # every candidate ran with it; the plan never chose another (issue 51)
        decided["optimizer"] = plan.optimizer
    _planned_data(config, given, plan, decided)
    problems = _adaptive_problems(given, plan, decided, path)
    if given & set(CUT_FLAGS):
        # A cut is an exact lever (the same samples per window): a cut that keeps the memory the plan measured is
        # accepted, one that might raise it is refused saying why.
        cut_flags, cut_problems = accepted_cut(config, given, decided, plan, path)
        decided.update(cut_flags)
        problems += cut_problems
    for name, value in decided.items():
        if name in CUT_FLAGS and name in given:
            continue  # decided above
        if name in given and value is not None and getattr(config, name) != value:
            problems.append(Problem(where="--" + name.replace("_", "-"),
                                    message=f"{getattr(config, name)!r} contradicts the plan's {value!r} ({path})"))
    if ("effective_batch_size" in given and plan.adaptive_batch is None
            and config.effective_batch_size != plan.effective_batch_size):
        problems.append(Problem(where="--effective-batch-size", message=f"{config.effective_batch_size} contradicts "
                                f"the plan's {plan.effective_batch_size} ({path})"))
    if problems:
        raise UsageError(problems)
    return dataclasses.replace(config, **decided)


def _adaptive_problems(given: set[str], plan: PlanRecord, decided: dict[str, Any], path: Path) -> list[Problem]:
    """An adaptive plan's policy into ``decided`` (the accumulation is then the run's own: its windows are the
    minimum's); a branch test the plan did not count in its memory is refused."""
    if plan.adaptive_batch is None:
        return []
    decided.update(plan.adaptive_batch.flags, grad_accum_steps=None)
    if "batch_branch_test" in given and "batch_branch_test" not in plan.adaptive_batch.flags:
        return [Problem(where="--batch-branch-test", message=(
            f"the plan ({path}) counted no branch-test snapshot (a second copy of the weights and the optimizer state) "
            f"in its memory; plan again with --batch-branch-test"))]
    return []


def _planned_data(config: TrainConfig, given: set[str], plan: PlanRecord, decided: dict[str, Any]) -> None:
    """The data the plan measured, into ``decided`` unless --data is given (other data is said on the console)."""
    source = plan.source
    if source is None or not source.given:  # plans written before sources were recorded have none
        return
    if "data" not in given:
        # The plan measured this data: training on other data would train with a decision made for that one.
        decided["data"] = source.data
        # How its rows became examples (fields, chat template, what is trained).
        decided.update({name: value for name, value in source.fields.items() if name not in given})
        return
    planned = str(source.data) if source.data is not None else "the built-in corpus"
    given_data = str(config.data.resolve()) if config.data is not None else "the built-in corpus"
    if given_data != planned:
        warnings.warn(f"training on --data {config.data or 'the built-in corpus'}, while the plan {config.plan} was "
                      f"made on {planned}: its decision was measured on that data", stacklevel=2)


def accepted_cut(config: TrainConfig, given: set[str], decided: dict[str, Any], plan: PlanRecord,
                 path: Path) -> tuple[dict[str, Any], list[Problem]]:
    """The cut flags train --plan runs with when the user gives some (``given``) beside the plan: every cut gives the
    same gradient, so what decides is the memory. Accepted: the plan's own cut; a cut the plan measured on its
    longest window and found within the budget (plan.json's cuts); and, where the plan cut rows by a row count
    (no token budget, no packing), either order of those rows, whose longest micro-batch is the same rows (the
    micro-batch size's longest examples, what the plan measured). Anything else might raise the peak the plan
    measured, and is refused saying why."""
    wanted = {name: getattr(config, name) for name in CUT_FLAGS if name in given}
    if all(decided.get(name) == value for name, value in wanted.items()):
        return {}, []
    for row in plan.cuts:
        if row.fits and all(row.flags[name] == value for name, value in wanted.items()):
            return dict(row.flags), []
    rows_cut = decided.get("micro_batch_tokens") is None and not decided.get("packing")
    if rows_cut and set(wanted) == {"micro_batch_order"}:
        return wanted, []
    micro, seq_len = decided.get("micro_batch_size"), plan.seq_len
    longest = plan.longest_example or seq_len
    measured = f"the plan measured {micro} rows of at most {longest} positions per micro-batch ({path})"
    problems = []
    if "packing" in wanted and wanted["packing"] != decided.get("packing"):
        problems.append(Problem(where="--packing" if wanted["packing"] else "--no-packing", message=(
            f"could raise the peak the plan measured: packed rows of --seq-len {seq_len} fill each row with examples "
            f"(up to {micro} x {seq_len} positions per micro-batch, every one a real token and most of them "
            f"targets), where {measured}, and the plan measured no packed cut that fits; plan again with --packing")
            if wanted["packing"] else (
            f"the plan chose packed rows; unpacked micro-batches of {micro} examples pad to their "
            f"longest and were not measured; plan again without --packing")))
    if "micro_batch_tokens" in wanted and wanted["micro_batch_tokens"] != decided.get("micro_batch_tokens"):
        problems.append(Problem(where="--micro-batch-tokens", message=(
            f"{wanted['micro_batch_tokens']} could raise the peak the plan measured: a token budget cuts micro-batches "
            f"by positions, in as many rows as fit, not by {micro} rows, where {measured} and no cut with this budget; "
            f"plan again with --micro-batch-tokens {wanted['micro_batch_tokens']}")))
    if not problems:  # the order alone, under a cut by a token budget or packing
        problems.append(Problem(where="--micro-batch-order", message=(
            f"{wanted.get('micro_batch_order')!r}: the plan's cut ({decided.get('micro_batch_tokens')} positions per "
            f"micro-batch, packing {decided.get('packing', CUT_FLAG_DEFAULTS['packing'])}) was measured in its own "
            f"order only; plan again with it")))
    return {}, problems
