"""``cadence export CHECKPOINT --out DIR``: any checkpoint of a run on a transformers model, whole or sharded, as a
``save_pretrained`` directory (the adapter alone under --lora-rank), loadable with ``from_pretrained``.

The model is built as the checkpoint's run built it (its recorded configuration), its weights read from the
checkpoint (a sharded one's shards assembled in this process, no process group), and written by ``save_hf``, the
writer of ``--save-hf``: with the run's tokenizer and, for chat data, the template its conversations were rendered
with.
"""

from __future__ import annotations

from pathlib import Path

from cadence.config import TrainConfig
from cadence.config.sources import recorded_config
from cadence.data.chat_store import chat_template_for
from cadence.data.hf import as_tokenizer
from cadence.data.source import Source
from cadence.distributed.ranks import SINGLE
from cadence.errors import UsageError
from cadence.models.hf import save_hf, save_hf_problem
from cadence.models.spec import ModelSpec
from cadence.records import Record, RecordInvalid
from cadence.training.checkpoint import (
    Checkpointer,
    CheckpointUnreadable,
    WeightsUnreadable,
    load_checkpoint,
    verify_checkpoint,
)
from cadence.training.run_dir import export_files


def export_checkpoint(checkpoint: Path, out: Path) -> list[str]:
    """Write ``checkpoint``'s model into ``out`` (new or empty); the names of the files written."""
    if not checkpoint.is_dir():
        raise UsageError.single("CHECKPOINT", f"{checkpoint} is not a checkpoint folder (a run's checkpoints/step-N)")
    problem = verify_checkpoint(checkpoint)
    if problem is not None:
        raise UsageError.single("CHECKPOINT", f"{checkpoint} is not an intact checkpoint ({problem})")
    problem = save_hf_problem(out)
    if problem is not None:
        raise UsageError.single("--out", problem)
    try:
        loaded = load_checkpoint(checkpoint)
        config = TrainConfig(**recorded_config(Record(loaded.info.get("config", {}), checkpoint / "checkpoint.json",
                                                      "config")))
    except (CheckpointUnreadable, RecordInvalid, TypeError) as err:
        raise UsageError.single("CHECKPOINT", f"{checkpoint}: {str(err).splitlines()[0][:300]}") from None
    spec = ModelSpec.from_flags(config)
    if not spec.exports_pretrained:
        raise UsageError.single("CHECKPOINT", f"{checkpoint} holds cadence's built-in {config.model}, which has no "
                                              f"transformers format: export a run on a transformers model")
    built = spec.build(seed=config.seed, precision=config.precision, base_precision=config.lora_base_precision)
    try:
        # In the checkpoint's own format (a sharded one's shards assembled in this process, no process group).
        weights = Checkpointer(checkpoint.parent.parent, SINGLE).read_weights(checkpoint)
    except WeightsUnreadable as err:
        raise UsageError.single("CHECKPOINT", str(err)[:300]) from None
    try:
        built.module.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise UsageError.single("CHECKPOINT", f"{checkpoint} does not fit {config.model} as its run recorded it "
                                              f"({str(err).splitlines()[0][:200]})") from None
    chat_template = None
    if Source.from_flags(config).kind == "chat":
        chat_template = chat_template_for(built.tokenizer, config.chat_template)[0].source
    save_hf(built.module, out, as_tokenizer(built.tokenizer), chat_template=chat_template)
    return sorted(name for name in export_files(out) or {} if name != ".")
