"""``cadence prepare-data``: tokenise a source into a token store ahead of training, and say what it holds.

The store goes into the cache (``--data-cache``), where ``cadence train --data SOURCE`` finds it again, or with
``--out DIR`` into a directory of its own that ``cadence train --data DIR`` reads directly (copy it to another
machine, share it between users). Given a store as ``--data``, it only describes it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, Any

from cadence.config import TrainConfig
from cadence.config.commands import PrepareDataOptions
from cadence.data import (
    DataSplits,
    TokenStore,
    default_cache_dir,
    is_store,
    open_prepared_store,
    splits_from_store,
)
from cadence.data.cache import open_or_build, write_store
from cadence.data.choices import TOO_LONG_CHOICES
from cadence.data.hf import ByteTokenizer, as_tokenizer
from cadence.data.preference import preference_splits
from cadence.data.source import Source, source_recipe
from cadence.errors import Problem, UsageError
from cadence.formatting import format_bytes
from cadence.models.spec import data_tokenizer


def _recipe(config: TrainConfig, tokenizer: Any | None, progress: IO[str] | None) -> Any:
    source = Source.from_flags(config)
    problems = source.problems(byte_level=tokenizer is None)
    if problems:
        raise UsageError(problems)
    return source_recipe(source, tokenizer, progress=progress)


def prepare_data(config: TrainConfig, options: PrepareDataOptions, *, stream: IO[str] | None = None,
                 progress: IO[str] | None = None) -> dict[str, Any]:
    """Build (or find) the store of ``config.data`` as ``config.model`` reads it; print and return its summary."""
    stream = stream or sys.stdout
    problems = []
    if config.seq_len is not None and config.seq_len < 1:
        problems.append(Problem(where="--seq-len", message=f"must be at least 1, got {config.seq_len}"))
    if config.too_long not in TOO_LONG_CHOICES:
        problems.append(Problem(where="--too-long", message=f"{config.too_long!r} is not one of "
                                                            f"{', '.join(TOO_LONG_CHOICES)}"))
    if problems:
        raise UsageError(problems)
    if config.model_config:
        # The tokens depend on the model's tokenizer only, which its config overrides never change.
        raise UsageError.single("--model-config", "changes the model, not its tokenizer: the tokens prepare-data "
                                                  "writes are the same without it (give it to cadence train)")
    started = time.perf_counter()
    recipe = None
    tokenizer = data_tokenizer(config.model)
    at_seq_len: list[DataSplits] = []
    given_store = config.data is not None and is_store(config.data)

    def accept(store: TokenStore) -> None:
        # With --seq-len the store must be usable at it (--too-long error refuses it), and is checked before it is
        # kept: a refused store is not left in --out or the cache.
        if config.seq_len is not None and store.meta.get("preference"):
            at_seq_len.append(preference_splits(store, seq_len=config.seq_len, val_fraction=0.0, from_cache=False,
                                                source=str(config.data), too_long=config.too_long,
                                                lines_of=None if given_store else config.data))
        elif config.seq_len is not None:
            at_seq_len.append(splits_from_store(store, seq_len=config.seq_len, val_fraction=0.0, from_cache=False,
                                                lines_of=None if given_store else config.data,
                                                too_long=config.too_long))

    if given_store and config.data is not None:  # (given_store says it is not None)
        if options.out is not None:
            raise UsageError.single("--out", f"{config.data} is already a token store; --out is for building one")
        store = open_prepared_store(config.data, expected_tokenizer=as_tokenizer(tokenizer).identity)
        accept(store)
        built = False
    else:
        recipe = _recipe(config, tokenizer, progress if progress is not None else sys.stderr)
        if options.out is not None:
            store, built = write_store(recipe, options.out, accept=accept), True
        else:
            opened = open_or_build(recipe, config.data_cache or default_cache_dir(), accept=accept)
            store, built = opened.store, opened.built
    seconds = time.perf_counter() - started
    summary: dict[str, Any] = {"store": str(store.path), "built": built, "seconds": round(seconds, 3),
                               **store.summary()}
    if recipe is not None:
        summary["source_bytes"] = recipe.source_bytes
        if built:
            summary["mb_per_s"] = round(recipe.source_bytes / 1e6 / max(seconds, 1e-9), 1)
    if at_seq_len:
        splits = at_seq_len[-1]
        long_examples = splits.long_examples
        summary["at_seq_len"] = {"seq_len": config.seq_len, "examples": len(splits.train),
                                 "targets": splits.train.num_targets, "too_long": config.too_long,
                                 "longer": long_examples.too_long if long_examples else 0,
                                 "truncated": splits.truncated,
                                 "note": long_examples.note() if long_examples else None}
    chat = store.meta.get("chat")
    if isinstance(chat, dict) and store.indexes.get("train") is not None and len(store.indexes["train"]):
        summary["chat"] = {**chat, "trained_share": chat["trained_tokens"] / max(1, chat["tokens"]),
                           "example": marked_example(store, as_tokenizer(tokenizer), colour=False)}
    preference = store.meta.get("preference")
    if isinstance(preference, dict) and store.indexes.get("train") is not None and len(store.indexes["train"]):
        summary["preference"] = preference_summary(store, as_tokenizer(tokenizer))
    if options.json:
        print(json.dumps(summary, indent=1), file=stream)
    else:
        text = describe(summary, train_data=options.out or config.data)
        if "chat" in summary and stream.isatty():
            # On a terminal the trained spans are coloured instead of bracketed.
            text = text.replace(summary["chat"]["example"], marked_example(store, as_tokenizer(tokenizer),
                                                                           colour=True))
        print(text, file=stream)
    return summary


TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"
"""How a file or a log marks the trained tokens of the example prepare-data shows."""
_GREEN, _RESET = "\033[32;1m", "\033[0m"


def preference_summary(store: TokenStore, tokenizer: Any) -> dict[str, Any]:
    """A preference store's samples: how many, the pairs skipped for an identical chosen and rejected, the lengths
    of each side (tokens per sequence), and the first sample's sequences with their trained tokens marked."""
    meta = dict(store.meta["preference"])
    meta.pop("labels", None)  # the bitmap: counted, not shown
    lengths = store.indexes["train"][:, 1]
    pairs = meta.get("format") == "pairs"
    sides = {"chosen": lengths[0::2], "rejected": lengths[1::2]} if pairs else {"completion": lengths}
    meta["lengths"] = {side: {"mean": round(float(values.mean()), 1), "min": int(values.min()),
                              "max": int(values.max())} for side, values in sides.items() if len(values)}
    meta["example"] = {side: marked_example(store, tokenizer, colour=False, index=k)
                       for k, side in enumerate(sides) if len(lengths) > k}
    return meta


def marked_example(store: TokenStore, tokenizer: Any, *, colour: bool, index: int = 0) -> str:
    """The store's first training example (or the one at ``index``) as text, its trained tokens marked (``[[...]]``,
    or green on a terminal): what the loss is on, to be seen before training."""
    offset, length = (int(v) for v in store.indexes["train"][index, :2])
    ids = [int(v) for v in store.tokens[offset:offset + length]]
    spans = store.spans.get("train")
    listed = [] if spans is None else [(int(a), int(b)) for example, a, b in spans if int(example) == index]
    if not listed:
        listed = [(max(1, int(store.indexes["train"][index, 2])), length)]
    pieces, at = [], 0
    for start, end in listed:
        pieces.append(_decode(tokenizer, ids[at:start]))
        trained = _decode(tokenizer, ids[start:end])
        pieces.append(f"{_GREEN}{trained}{_RESET}" if colour else f"{TRAINED_OPEN}{trained}{TRAINED_CLOSE}")
        at = end
    pieces.append(_decode(tokenizer, ids[at:]))
    return "".join(pieces)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None and not isinstance(tokenizer, ByteTokenizer):
        return str(hf.decode(ids, skip_special_tokens=False))
    return bytes(ids).decode("utf-8", errors="replace")


def describe(summary: dict[str, Any], *, train_data: Path | None) -> str:
    """The summary for people: where the store is, how it was made, what it holds, and how to train on it."""
    itemsize = {"uint8": 1, "uint16": 2, "uint32": 4}.get(summary["dtype"], 4)
    how = (f"built in {summary['seconds']:.1f} s" + (f", {summary['mb_per_s']:,.1f} MB/s of source" if "mb_per_s"
                                                     in summary else "")) if summary["built"] else \
        f"found in the cache, opened in {summary['seconds']:.2f} s"
    lines = [f"token store: {summary['store']} ({how})",
             f"source: {summary['source']}" + (f", {format_bytes(summary['source_bytes'])}"
                                               if summary.get("source_bytes") else ""),
             f"content: {summary['fingerprint']}",
             f"tokens: {summary['tokens']:,} {summary['dtype']} ({format_bytes(summary['tokens'] * itemsize)} mapped, "
             f"not loaded)"]
    if summary["kind"] == "stream":
        lines.append(f"text stream: {summary['targets']:,} targets; cut into --seq-len sequences when training")
    for split in ("train", "val"):
        part = summary.get(split)
        if not part:
            continue
        lines.append(f"{split}: {part['examples']:,} examples, {part['tokens']:,} tokens, {part['targets']:,} targets")
        histogram = part["length_histogram"]
        widest = max((bucket["examples"] for bucket in histogram), default=1) or 1
        for bucket in histogram:
            bar = "#" * max(1 if bucket["examples"] else 0, round(30 * bucket["examples"] / widest))
            lines.append(f"  {bucket['from']:>7,}-{bucket['to']:<7,} {bar:<30} {bucket['examples']:,}")
    chat = summary.get("chat")
    if chat:
        lines.append(f"chat: {chat['conversations']:,} conversations, {chat['assistant_turns']:,} assistant turns, "
                     f"{chat['trained_tokens']:,} of {chat['tokens']:,} tokens trained ({chat['trained_share']:.1%}; "
                     f"--train-on {chat['train_on']}), template {chat['template']}")
        lines.append(f"the first example, its trained tokens in {TRAINED_OPEN} {TRAINED_CLOSE}:")
        lines.append(chat["example"])
    preference = summary.get("preference")
    if preference:
        what = "pairs" if preference["format"] == "pairs" else "unpaired rows (KTO)"
        line = f"preference: {preference['samples']:,} {what}"
        if preference.get("identical_skipped"):
            line += f", {preference['identical_skipped']:,} pairs skipped (chosen equal to rejected)"
        if "desirable" in preference:
            line += f", {preference['desirable']:,} desirable"
        lines.append(line + f"; {preference['trained_tokens']:,} of {preference['tokens']:,} tokens trained")
        for side, numbers in preference["lengths"].items():
            lines.append(f"  {side}: {numbers['mean']:,} tokens a sequence on average ({numbers['min']:,} to "
                         f"{numbers['max']:,})")
        lines.append(f"the first sample, its trained tokens in {TRAINED_OPEN} {TRAINED_CLOSE}:")
        lines += [f"  {side}: {text}" for side, text in preference["example"].items()]
    at = summary.get("at_seq_len")
    if at:
        lines.append(f"at --seq-len {at['seq_len']}: {at['examples']:,} training examples, {at['targets']:,} targets"
                     + (f", {at['truncated']:,} truncated" if at["truncated"] else ""))
        if at.get("note"):
            lines.append(f"note: {at['note']}")
    if train_data is not None:
        lines.append(f"train on it: cadence train --data {train_data} ...")
    return "\n".join(lines)


__all__ = ["PrepareDataOptions", "describe", "prepare_data"]
