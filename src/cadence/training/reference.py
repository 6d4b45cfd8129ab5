"""The reference model a run's preference objective is scored against (dpo, ipo, kto), chosen from the flags:

- ``--reference-model DIR``: that model directory, loaded once and frozen (one more copy of its weights);
- under ``--lora-rank``: the policy itself with its adapters turned off, which is the base (no second copy);
- otherwise: a frozen copy of the starting weights, made before training (one more copy of the weights);
- with ``--reference-logprobs precomputed`` (full fine-tuning): that reference's log-probabilities of every train and
  validation sequence, computed in one no-gradient pass before step 1 (the starting weights scored by the policy
  itself before it trains: no copy) and kept beside the token store (:mod:`cadence.data.reference_logps`); no
  reference model in memory while training. A resume, or a later run on the same data and reference, finds them.

The other objectives (sft, simpo, orpo) have none.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from cadence.config import TrainConfig
from cadence.data.preference import PreferenceExample, PreferenceExamples, collate_preference
from cadence.data.progress import BuildProgress
from cadence.data.reference_logps import LogpsIdentity, ReferenceLogps, row_keys
from cadence.data.splits import DataSplits
from cadence.engine.objective import Objective
from cadence.engine.precision import Precision
from cadence.engine.reference import AdaptersOffReference, FrozenReference, PrecomputedReference, Reference
from cadence.errors import UsageError
from cadence.models.heads import chunking_problem
from cadence.models.spec import ModelSpec


def reference_problem(config: TrainConfig, policy_vocab: int) -> str | None:
    """Why ``--reference-model`` cannot score this run's data (its vocabulary is not the policy's), found before
    anything is written; None when it can, or when there is none."""
    if config.reference_model is None:
        return None
    try:
        recorded = json.loads((Path(config.reference_model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"{config.reference_model}/config.json cannot be read: {error}"
    vocab = recorded.get("vocab_size") if isinstance(recorded, dict) else None
    if vocab != policy_vocab:
        return (f"{config.reference_model} has a vocabulary of {vocab} tokens and {config.model} one of {policy_vocab}: "
                f"the reference must read the same token ids (the same tokenizer)")
    return None


def starting_copy(objective: Objective, config: TrainConfig, model: torch.nn.Module) -> torch.nn.Module | None:
    """The frozen copy of the starting weights the objective needs (taken before recompute, compilation and wrapping
    change the model), or None where the reference is something else."""
    if (not objective.needs_reference or config.reference_model is not None or config.lora_rank > 0
            or config.reference_logprobs == "precomputed"):
        return None
    frozen = copy.deepcopy(model)
    frozen.requires_grad_(False)
    return frozen.eval()


def build_reference(objective: Objective, config: TrainConfig, *, policy: torch.nn.Module,
                    starting: torch.nn.Module | None, device: torch.device, vocab_size: int) -> Reference | None:
    """The objective's reference (see the module docstring); ``policy``: the model as the engine runs it (wrapped);
    ``starting``: :func:`starting_copy`'s copy."""
    if not objective.needs_reference:
        return None
    if config.reference_model is not None:
        with torch.random.fork_rng(devices=[]):  # its build draws an initialisation the weights then replace
            loaded = ModelSpec.from_flags({"model": str(config.reference_model)}).build(seed=config.seed).module
        loaded = loaded.to(device)
        loaded.requires_grad_(False)
        return FrozenReference(model=loaded.eval(), targets_only=chunking_problem(loaded, vocab_size) is None,
                               description=f"the model {config.reference_model} (frozen)")
    if config.lora_rank > 0:
        return AdaptersOffReference(policy=policy, targets_only=objective.preference is not None and
                                    objective.preference.targets_only)
    if starting is None:
        raise UsageError.single("--objective", f"{objective.name} needs the starting weights as its reference, and "
                                               f"no copy was made")
    return FrozenReference(model=starting, targets_only=chunking_problem(starting, vocab_size) is None)


def weights_identity(model: torch.nn.Module) -> str:
    """A digest of a model's weights (every parameter and buffer, by name): the identity of a reference that is the
    starting weights."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return "weights:" + digest.hexdigest()


def directory_identity(directory: Path) -> str:
    """The identity of --reference-model's weights: its files' names, sizes and modification times (as the token
    store identifies a source file), without loading them."""
    files = sorted(path for path in Path(directory).iterdir() if path.is_file())
    entries = [[path.name, path.stat().st_size, path.stat().st_mtime_ns] for path in files]
    return "directory:" + hashlib.sha256(json.dumps([str(Path(directory).resolve()), entries]).encode()).hexdigest()


PASS_SAMPLES = 8
"""Samples per micro-batch of the pass before training (no gradients: small activations)."""


def _chunks(data: DataSplits) -> Iterator[list[PreferenceExample]]:
    samples: list[PreferenceExample] = []
    for split in (data.train, data.val):
        if isinstance(split, PreferenceExamples):  # the reference objectives train on preference samples only
            samples.extend(split[i] for i in range(len(split)))
    for start in range(0, len(samples), PASS_SAMPLES):
        yield samples[start:start + PASS_SAMPLES]


def precomputed_reference(objective: Objective, config: TrainConfig, *, starting: torch.nn.Module,
                          data: DataSplits, device: torch.device, vocab_size: int, main: bool = True
                          ) -> PrecomputedReference | None:
    """``--reference-logprobs precomputed``: the reference's log-probabilities of every sequence of the train and
    validation splits, read from beside the token store, those missing computed in one no-gradient pass (with a
    progress bar) and written back (by the main process: ``main``); None unless the flag asks for it.
    ``starting``: the policy with its starting weights, before recompute and wrapping (the reference when there is no
    --reference-model: scored as it is, no copy)."""
    if not objective.needs_reference or config.reference_logprobs != "precomputed":
        return None
    reference_dir = config.reference_model
    identity = LogpsIdentity(
        store_digest=str(data.store_digest or data.fingerprint),
        reference=directory_identity(reference_dir) if reference_dir is not None else weights_identity(starting),
        precision=config.precision, head="targets" if chunking_problem(starting, vocab_size) is None else "all")
    record = ReferenceLogps.read(data.store, identity) if data.store is not None else ReferenceLogps(identity=identity)
    batches = [collate_preference(chunk) for chunk in _chunks(data)]
    wanted = [batch for batch in batches if record.missing(row_keys(batch["input_ids"], batch["labels"]))]
    if wanted:
        record = record.with_rows(_score(wanted, config, starting, device, vocab_size, main=main))
        if data.store is not None and main:
            record.write(data.store)
    where = "the starting weights'" if reference_dir is None else f"{reference_dir}'s"
    found = len(batches) - len(wanted)
    return PrecomputedReference(record=record, description=(
        f"{where} log-probabilities, precomputed ({len(record.logps):,} sequences; {found} of {len(batches)} "
        f"batches found beside the token store; no model in memory)"))


def _score(batches: Sequence[dict[str, torch.Tensor]], config: TrainConfig, starting: torch.nn.Module,
           device: torch.device, vocab_size: int, *, main: bool) -> dict[bytes, float]:
    """The reference's log-probability of every row of ``batches``, by row key (the reference loaded here and let
    go after)."""
    if config.reference_model is not None:
        with torch.random.fork_rng(devices=[]):
            model = ModelSpec.from_flags({"model": str(config.reference_model)}).build(seed=config.seed).module
        model = model.to(device)
    else:
        model = starting
    was_training = model.training
    reference = FrozenReference(model=model.eval(), targets_only=chunking_problem(model, vocab_size) is None)
    precision = Precision(config.precision, device)
    bar = BuildProgress("reference log-probabilities before training", len(batches), sys.stderr if main else None,
                        unit="batches")
    scored: dict[bytes, float] = {}
    for batch in batches:
        on_device = {key: value.to(device) for key, value in batch.items()}
        with precision.autocast():
            logps = reference.row_logps(on_device).float().cpu().tolist()
        for key, value in zip(row_keys(batch["input_ids"], batch["labels"]), logps):
            if key is not None:
                scored[key] = value
        bar.advance(1)
    bar.close()
    model.train(was_training)
    return scored


__all__ = ["build_reference", "precomputed_reference", "reference_problem", "starting_copy", "weights_identity"]
