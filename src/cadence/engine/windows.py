"""Accumulation windows: the micro-batches of one optimizer step, and how many loss-bearing targets they hold.

The target count of the whole window must be known BEFORE the first backward, because every micro-batch's loss is
divided by it: that is what makes any split (micro x accum x world) give the gradient of one big batch. Micro-batches
are small index tensors, so holding one window of them in memory costs nothing next to the activations.

How a window's samples are cut into micro-batches is a :class:`~cadence.engine.cut.Cut`; this module applies it: to a
dataset's epoch (:func:`epoch_windows`) and to a window again (:func:`recut`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from cadence.data.batching import IGNORE_INDEX, PAD_TOKEN_ID, Example, collate, epoch_order
from cadence.data.preference import PreferenceExample, collate_preference
from cadence.engine.cut import Cut, rank_bounds

Batch = Mapping[str, torch.Tensor]
"""A micro-batch: ``input_ids`` [B, T] and ``labels`` [B, T] (-100 = no loss), or anything a custom loss reads."""

from cadence.engine.choices import LastWindow


def count_targets(batch: Batch) -> int:
    """Loss-bearing targets of a micro-batch: labels != -100. A fully masked micro-batch has zero, not an error."""
    return int((batch["labels"] != IGNORE_INDEX).sum().item())


def count_tokens(batch: Batch) -> int:
    """Input tokens a micro-batch really carries: positions up to each row's last target (right padding excluded).

    Padded positions are computed but are not work the user asked for, so throughput counts real tokens only.
    """
    labels = batch["labels"]
    if labels.ndim != 2:
        return int(labels.numel())
    has_target = labels != IGNORE_INDEX
    length = labels.shape[1]
    # Index of the last target in each row, +1; rows with no target count their full length (they were read).
    last = length - torch.argmax(has_target.flip(1).to(torch.int8), dim=1)
    last = torch.where(has_target.any(dim=1), last, torch.full_like(last, length))
    return int(last.sum().item())


def count_samples(batch: Batch) -> int:
    return int(next(iter(batch.values())).shape[0])


def count_positions(batch: Batch) -> int:
    """Positions the forward computes: rows x width, padding included (0 for a batch without 2-D labels)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    return int(labels.numel()) if isinstance(labels, torch.Tensor) and labels.ndim == 2 else 0


@dataclass(kw_only=True)
class Window:
    """The micro-batches of one optimizer step."""

    micro_batches: list[Batch]
    """In order; the last one closes the window (and is the only one whose backward synchronises gradients)."""
    targets: int
    """Loss-bearing targets in this window on this process (the engine sums it over processes)."""
    tokens: int
    """Real input tokens in this window on this process."""
    samples: int
    """Sequences in this window on this process."""
    epoch: int = 0
    """The epoch the window belongs to (windows never span epochs)."""
    short: bool = False
    """True for an epoch's last window when it has fewer micro-batches or samples than a full one."""
    padding: int = 0
    """Trailing padding micro-batches (no targets) that keep this rank's micro-batch count equal to the others'."""
    largest_share: int | None = None
    """With several processes: the most samples any rank holds in this window; every rank runs as many
    micro-batches as that share needs (None: one process, this window is the whole window)."""
    positions: int = 0
    """Positions the forward computes over the real micro-batches (rows x width, right padding included); minus
    ``tokens``, the padding. 0 when unknown."""
    drawn: DrawnSamples | None = None
    """This process's samples as drawn from the dataset, for a window :func:`epoch_windows` cut: :func:`recut` plans
    a new cut from them (None: a window built from batches)."""

    def __len__(self) -> int:
        return len(self.micro_batches)


@dataclass(kw_only=True)
class WindowCounter:
    """Counts targets, tokens and samples; the default reads ``labels``, a user's loop may pass its own."""

    targets: Callable[[Batch], int] = count_targets
    tokens: Callable[[Batch], int] = count_tokens
    samples: Callable[[Batch], int] = count_samples


def shift_hf_labels(batch: Batch) -> Batch:
    """A Hugging Face style batch in cadence's convention.

    cadence's ``labels[t]`` is the target of position t: the token AFTER ``input_ids[t]`` (collate and packing make
    them so). A Hugging Face collator instead copies ``labels`` from ``input_ids`` (with -100 where no loss is wanted)
    and the model shifts them inside its own loss. Given such a batch unchanged, cadence would train the model to copy
    its current token. This returns the same batch with ``labels`` moved one position left (the last position then
    has no target); every other key (``attention_mask``, ``position_ids``) is kept.

    A position whose input is padding (``attention_mask`` 0) gets no target either. With left padding the last pad
    would otherwise be asked to predict the row's first token from no context at all, a target transformers' own
    loss does count: here each example has exactly the targets it has alone.
    """
    labels = batch["labels"]
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[..., :-1] = labels[..., 1:]
    mask = batch.get("attention_mask")
    if mask is not None:
        shifted = shifted.masked_fill(mask == 0, IGNORE_INDEX)
    return {**batch, "labels": shifted}


def make_window(micro_batches: Sequence[Batch], *, epoch: int = 0, short: bool = False,
                counter: WindowCounter | None = None, hf_labels: bool = False) -> Window:
    """Wrap a list of micro-batches as a window, counting what it holds. ``hf_labels``: the batches carry Hugging
    Face style labels (equal to ``input_ids``), shifted here with :func:`shift_hf_labels` before anything counts
    them."""
    counter = counter or WindowCounter()
    batches = [shift_hf_labels(b) for b in micro_batches] if hf_labels else list(micro_batches)
    if not batches:
        raise ValueError("a window needs at least one micro-batch")
    return Window(
        micro_batches=batches,
        targets=sum(counter.targets(b) for b in batches),
        tokens=sum(counter.tokens(b) for b in batches),
        samples=sum(counter.samples(b) for b in batches),
        epoch=epoch,
        short=short,
        positions=sum(count_positions(b) for b in batches),
    )


def iter_windows(
    micro_batches: Iterable[Batch],
    grad_accum_steps: int,
    *,
    micro_batch_size: int | None = None,
    last_window: LastWindow = "step",
    epoch: int = 0,
    counter: WindowCounter | None = None,
    hf_labels: bool = False,
) -> Iterator[Window]:
    """Group one epoch's micro-batches into windows of ``grad_accum_steps``.

    ``hf_labels=True`` for batches from a Hugging Face collator (``labels`` equal to ``input_ids``): each is shifted
    into cadence's convention (:func:`shift_hf_labels`), so the targets are counted and the loss computed as
    ``transformers`` would.

    The epoch's last window may be short: fewer micro-batches, or a smaller last micro-batch (``micro_batch_size``
    tells what full is). ``last_window="step"`` yields it, and because the engine divides by the window's OWN target
    count it is normalised correctly (a fixed divisor would under-weight it); ``"drop"`` discards it.
    """
    if grad_accum_steps < 1:
        raise ValueError("grad_accum_steps must be >= 1")
    pending: list[Batch] = []
    for batch in micro_batches:
        pending.append(batch)
        if len(pending) == grad_accum_steps:
            short = micro_batch_size is not None and count_samples(pending[-1]) < micro_batch_size
            if not (short and last_window == "drop"):
                yield make_window(pending, epoch=epoch, short=short, counter=counter, hf_labels=hf_labels)
            pending = []
    if pending and last_window == "step":
        yield make_window(pending, epoch=epoch, short=True, counter=counter, hf_labels=hf_labels)


def recut(window: Window, cut: Cut, *, world_size: int = 1, rank: int = 0,
          counter: WindowCounter | None = None) -> Window:
    """The same window cut again by ``cut`` (and, when ``world_size`` > 1, rank ``rank``'s share of it): the same
    samples, so the same gradient; only the micro-batches change. This is what lets ``cadence verify`` and
    ``cadence plan`` compare cuts and splits on one window, and ``--micro-batch-size auto`` halve a window that ran
    out of memory.

    A window cut from a dataset (:func:`epoch_windows`) keeps its samples' indices, so it is planned again from
    them and collated once, exactly as :func:`epoch_windows` would have cut it. A window built from batches
    (:func:`iter_windows`) has its examples taken back out of them (:func:`window_examples`: rows trimmed after
    their last target, packed rows split where their position ids restart); in drawn order, rows keep every key
    they had (an attention mask, position ids).

    ``world_size`` > 1 takes the rank's contiguous share of a whole window, padded to the micro-batch count of the
    rank that needs the most (every rank computes every rank's cut, so they agree without talking). A window that is
    already one rank's share (``largest_share`` set) is cut with ``world_size`` 1; how many micro-batches the other
    ranks' shares need is then the caller's to agree on (:func:`pad_to_micro_batches`)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError("world_size must be >= 1 and 0 <= rank < world_size")
    if world_size > 1 and window.largest_share is not None:
        raise ValueError("cutting one rank's share of a window needs the whole window")
    drawn = window.drawn
    if drawn is not None:
        bounds = rank_bounds(len(drawn.ids), world_size)
        shares = [drawn.ids[bounds[r]:bounds[r + 1]] for r in range(world_size)]
        return _window_of_shares(drawn.source, shares, cut, rank=rank, epoch=window.epoch, short=window.short,
                                 counter=counter, largest_share=window.largest_share if world_size == 1 else
                                 (bounds[1] - bounds[0]))
    if not cut.by_length:
        return _resplit_rows(window, cut.micro_batch_size, world_size=world_size, rank=rank, counter=counter)
    examples = window_examples(window)
    if cut.pack_length is not None and any(set(example) != {"input_ids", "labels"} for example in examples):
        raise ValueError("packing re-cuts batches of input_ids and labels only (an attention_mask or other "
                         "per-position input would have to be packed too)")
    bounds = rank_bounds(len(examples), world_size)
    plans = [cut.plan([int(e["labels"].shape[0]) for e in examples[bounds[r]:bounds[r + 1]]])
             for r in range(world_size)]
    mine = examples[bounds[rank]:bounds[rank + 1]]
    batches: list[Batch] = [_collate_rows([[mine[k] for k in row] for row in rows]) for rows in plans[rank]]
    samples = window.samples if world_size == 1 else len(mine)
    return _assembled(batches, most=max(len(plan) for plan in plans), samples=samples, window=window,
                      largest_share=window.largest_share if world_size == 1 else bounds[1] - bounds[0],
                      counter=counter)


def _resplit_rows(window: Window, micro_batch_size: int, *, world_size: int, rank: int,
                  counter: WindowCounter | None) -> Window:
    """A window built from batches, its rows (rank ``rank``'s contiguous share of them) in drawn order in
    micro-batches of ``micro_batch_size``. Rows are right-padded to a common width (input 0, label -100), then each
    micro-batch is trimmed after its last target column: with a causal model neither changes any target's loss."""
    real = window.micro_batches[:len(window.micro_batches) - window.padding]
    chunks: list[Batch] = []
    if real:
        merged = _merged_rows(real)
        bounds = rank_bounds(int(merged["labels"].shape[0]), world_size)
        mine = {key: value[bounds[rank]:bounds[rank + 1]] for key, value in merged.items()}
        total = bounds[rank + 1] - bounds[rank]
        chunks = [_trim_after_last_target({key: value[at:at + micro_batch_size] for key, value in mine.items()})
                  for at in range(0, total, micro_batch_size)]
        largest = bounds[1] - bounds[0]
        samples = window.samples if world_size == 1 else total
    else:  # this rank holds no sample of the window: padding only
        largest, samples = 0, 0
    if world_size > 1:
        most = -(-largest // micro_batch_size)
        share: int | None = largest
    else:
        most, share = len(chunks), window.largest_share
    return _assembled(chunks, most=most, samples=samples, window=window, largest_share=share, counter=counter)


def _assembled(batches: list[Batch], *, most: int, samples: int, window: Window, largest_share: int | None,
               counter: WindowCounter | None, drawn: DrawnSamples | None = None) -> Window:
    """``batches`` counted, with padding micro-batches up to ``most``, as a window in ``window``'s place."""
    counted = make_window(batches, counter=counter) if batches else None
    padding = [padding_micro_batch() for _ in range(most - len(batches))]
    return Window(micro_batches=[*batches, *padding], targets=counted.targets if counted else 0,
                  tokens=counted.tokens if counted else 0, samples=samples if counted else 0,
                  positions=counted.positions if counted else 0, epoch=window.epoch, short=window.short,
                  padding=len(padding), largest_share=largest_share, drawn=drawn)


def merge_windows(windows: Sequence[Window]) -> Window:
    """One window of ``windows``' micro-batches, in their order (the same examples in the same order, grouped into a
    larger window: an adaptive batch's accumulation grows, the micro-batch does not). Its counts are their sums, so
    the engine divides every micro-batch's loss by the whole group's targets: the one-big-batch gradient of all their
    examples. All of one epoch (windows never span epochs); trailing padding is the last window's."""
    if not windows:
        raise ValueError("merge_windows needs at least one window")
    if len({window.epoch for window in windows}) != 1:
        raise ValueError("windows of different epochs cannot be merged: a window never spans epochs")
    if len(windows) == 1:
        return windows[0]
    shares = [window.largest_share for window in windows]
    return Window(micro_batches=[batch for window in windows for batch in window.micro_batches],
                  targets=sum(window.targets for window in windows), tokens=sum(window.tokens for window in windows),
                  samples=sum(window.samples for window in windows), epoch=windows[0].epoch,
                  short=any(window.short for window in windows), padding=windows[-1].padding,
                  largest_share=None if None in shares else sum(share or 0 for share in shares),
                  positions=sum(window.positions for window in windows), drawn=None)


def pad_to_micro_batches(window: Window, count: int) -> Window:
    """``window`` with padding micro-batches appended up to ``count`` micro-batches (what the rank with the most
    needs: DDP and FSDP2 pair their collectives by order). The real ones are kept; nothing is counted twice."""
    real = window.micro_batches[:len(window.micro_batches) - window.padding]
    if count < len(real):
        raise ValueError(f"cannot pad {len(real)} micro-batches down to {count}")
    padding = [padding_micro_batch() for _ in range(count - len(real))]
    return dataclasses.replace(window, micro_batches=[*real, *padding], padding=len(padding))


def window_examples(window: Window) -> list[dict[str, torch.Tensor]]:
    """The examples in this process's real micro-batches, in order, each a dict of 1-D tensors: a row trimmed after
    its last target (a row without one keeps one position), or, for packed rows (``position_ids`` restarting at 0),
    each example of the row; the filler of a packed row, which has no target, is not an example."""
    examples: list[dict[str, torch.Tensor]] = []
    for batch in window.micro_batches[:len(window.micro_batches) - window.padding]:
        labels = batch["labels"]
        width = int(labels.shape[1])
        per_position = {key: value for key, value in batch.items() if value.ndim == 2 and value.shape[1] == width}
        for row in range(int(labels.shape[0])):
            if "position_ids" in per_position:
                positions = per_position["position_ids"][row]
                begins = (positions == 0).nonzero().flatten().tolist()
                begins = begins if begins and begins[0] == 0 else [0, *begins]
                for begin, end in zip(begins, [*begins[1:], width]):
                    if bool((labels[row, begin:end] != IGNORE_INDEX).any()):
                        example = {key: value[row, begin:end] for key, value in per_position.items()
                                   if key != "position_ids"}
                        examples.append(_trimmed(example))
            else:
                examples.append(_trimmed({key: value[row] for key, value in per_position.items()}))
    return examples


def _trimmed(example: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An example cut after its last target (positions after it are seen by no target of a causal model)."""
    targets = (example["labels"] != IGNORE_INDEX).nonzero()
    width = int(targets[-1]) + 1 if len(targets) else 1
    return {key: value[:width] for key, value in example.items()}


def _collate_rows(rows: Sequence[Sequence[dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """A micro-batch from rows of examples: one example per row right-padded (input 0, label -100, any other
    per-position input 0), or several packed one after another with ``position_ids`` as :func:`collate_packed`."""
    if all(len(row) == 1 for row in rows) and not any("position_ids" in row[0] for row in rows):
        width = max(int(row[0]["labels"].shape[0]) for row in rows)
        return {key: torch.stack([torch.nn.functional.pad(row[0][key], (0, width - int(row[0][key].shape[0])),
                                                          value=IGNORE_INDEX if key == "labels" else 0)
                                  for row in rows])
                for key in rows[0][0]}
    return collate_packed([[Example(input_ids=e["input_ids"], labels=e["labels"]) for e in row] for row in rows])


def _merged_rows(batches: Sequence[Batch]) -> dict[str, torch.Tensor]:
    """All rows of ``batches`` in one batch, right-padded to a common width (input 0, label -100)."""
    width = max(int(b["labels"].shape[1]) for b in batches)
    padded = [_pad_to_width(batch, width) for batch in batches]
    return {key: torch.cat([batch[key] for batch in padded]) for key in padded[0]}


def _pad_to_width(batch: Batch, width: int) -> dict[str, torch.Tensor]:
    current = int(batch["labels"].shape[1])
    if current == width:
        return dict(batch)
    out = {}
    for key, value in batch.items():
        if value.ndim == 2 and value.shape[1] == current and key == "position_ids":
            # Packed rows: the padding is one more example of its own (positions 0, 1, ...), not one per position.
            filler = torch.arange(width - current, dtype=value.dtype).expand(value.shape[0], -1)
            value = torch.cat([value, filler], dim=1)
        elif value.ndim == 2 and value.shape[1] == current:
            fill = IGNORE_INDEX if key == "labels" else 0
            value = torch.nn.functional.pad(value, (0, width - current), value=fill)
        out[key] = value
    return out


def _trim_after_last_target(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    labels = batch["labels"]
    columns = (labels != IGNORE_INDEX).any(dim=0).nonzero()
    width = int(columns[-1]) + 1 if len(columns) else 1
    if width == labels.shape[1]:
        return batch
    full = labels.shape[1]
    return {key: (value[:, :width] if value.ndim == 2 and value.shape[1] == full else value)
            for key, value in batch.items()}


def epoch_windows(
    examples: Sequence[Example],
    *,
    cut: Cut,
    grad_accum_steps: int,
    seed: int,
    epoch: int,
    world_size: int = 1,
    rank: int = 0,
    last_window: LastWindow = "step",
) -> Iterator[Window]:
    """This process's windows of one epoch: its disjoint share of each global window, cut into micro-batches by
    ``cut`` (:class:`~cadence.engine.cut.Cut`).

    A global window is the next ``cut.micro_batch_size x grad_accum_steps x world_size`` samples of the epoch's
    permutation (the same permutation for every split), so window by window the union over ranks is exactly what
    one process sees with the same effective batch. Each rank takes a contiguous slice of it: equal slices, or, in
    the epoch's short last window, slices that differ by at most one sample.

    How a rank's slice is cut changes nothing but the cost, because the loss is normalised by the whole window's
    target count: in drawn order, longest first, by a token budget, or packed into rows (each example restarting
    its ``position_ids`` at 0, which the model turns into attention that never crosses from one example into
    another). The window's samples, and so its gradient, are the same.

    Every rank must run the same number of micro-batches per window (DDP and FSDP2 pair their collectives by
    order), so a rank whose slice needs fewer gets *padding micro-batches*: one position with no target. They add
    nothing to the loss, the gradient or the counts, and keep the collectives in step. Every rank computes every
    rank's cut (they all hold the permutation and the lengths), so they agree on that number without talking.

    Each window keeps its samples' indices (``window.drawn``), so :func:`recut` cuts it again from them.
    """
    if grad_accum_steps < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError("grad_accum_steps and world_size must be >= 1, and 0 <= rank < world_size")
    # The permutation stays one integer tensor (4 bytes per example, not a Python int each): with millions of
    # examples it is the only per-example state in memory. Only the current window becomes a Python list.
    permutation = epoch_order(len(examples), seed, epoch)
    per_window = cut.micro_batch_size * grad_accum_steps * world_size
    for start in range(0, len(permutation), per_window):
        window_ids = permutation[start:start + per_window].tolist()
        short = len(window_ids) < per_window
        if short and last_window == "drop":
            return
        bounds = rank_bounds(len(window_ids), world_size)
        shares = [window_ids[bounds[r]:bounds[r + 1]] for r in range(world_size)]
        yield _window_of_shares(examples, shares, cut, rank=rank, epoch=epoch, short=short, counter=None,
                                largest_share=bounds[1] - bounds[0] if world_size > 1 else None)


class DrawnSamples:
    """The samples of a window cut from a dataset: their indices (in drawn order) and the dataset. A plain class,
    not a dataclass or a sequence, so that prefetch's pinning leaves the dataset alone."""

    __slots__ = ("ids", "source")

    def __init__(self, ids: Sequence[int], source: Sequence[Example]) -> None:
        self.ids = list(ids)
        self.source = source


def _window_of_shares(source: Sequence[Example], shares: Sequence[Sequence[int]], cut: Cut, *, rank: int, epoch: int,
                      short: bool, counter: WindowCounter | None, largest_share: int | None) -> Window:
    """Rank ``rank``'s window from every rank's share of dataset indices: each share planned by ``cut`` (every rank
    computes every rank's plan, to pad to the largest count), this rank's collated once."""
    plans = [cut.plan(example_lengths(source, share) if cut.by_length else [0] * len(share)) for share in shares]
    mine = list(shares[rank])
    # A micro-batch whose packed rows each hold one example is an unpacked micro-batch: collated as one, with no
    # position ids, it runs the plain causal attention bit for bit (text of full --seq-len sequences packs so, and a
    # run resumed with --packing added then continues exactly).
    batches: list[Batch] = [collate_samples([source[mine[row[0]]] for row in rows]) if all(len(row) == 1 for row in rows)
               else collate_packed([[source[mine[k]] for k in row] for row in rows]) for rows in plans[rank]]
    window = Window(micro_batches=[], targets=0, tokens=0, samples=0, epoch=epoch, short=short)
    # Samples are examples, not packed rows.
    return _assembled(batches, most=max(len(plan) for plan in plans), samples=len(mine), window=window,
                      largest_share=largest_share, counter=counter, drawn=DrawnSamples(mine, source))


def collate_samples(samples: Sequence[Example] | Sequence[PreferenceExample]) -> dict[str, torch.Tensor]:
    """A micro-batch of one sample per row: examples right-padded (:func:`cadence.data.batching.collate`), or
    preference samples as their two sequences' rows (:func:`cadence.data.preference.collate_preference`)."""
    if samples and isinstance(samples[0], PreferenceExample):
        return collate_preference(cast(Sequence[PreferenceExample], samples))
    return collate(cast(Sequence[Example], samples))


def collate_packed(rows: Sequence[Sequence[Example]]) -> dict[str, torch.Tensor]:
    """Packed rows as one micro-batch: each row's examples one after another, ``position_ids`` restarting at 0 for
    each (the model's cue for where an example starts), right-padded to the fullest row. The padding forms a last
    "example" of its own, with no targets, so no real position attends to it or it to them."""
    width = max(sum(len(example.input_ids) for example in row) for row in rows)
    input_ids = torch.full((len(rows), width), PAD_TOKEN_ID, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for example in row:
            length = len(example.input_ids)
            input_ids[r, at:at + length] = example.input_ids
            labels[r, at:at + length] = example.labels
            position_ids[r, at:at + length] = torch.arange(length)
            at += length
        position_ids[r, at:] = torch.arange(width - at)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def example_lengths(examples: Sequence[Example], indices: Sequence[int]) -> list[int]:
    """Input length of each of ``examples[indices]``: from the dataset's index when it has one (a token store
    answers without reading a token), else from the examples themselves."""
    lengths = getattr(examples, "lengths", None)
    if callable(lengths):
        return list(lengths(indices))
    return [len(examples[i].input_ids) for i in indices]


def count_examples(batch: Batch) -> int:
    """Examples in a micro-batch: its rows, or, for packed rows (``position_ids`` restarting at 0), the examples in
    them that have a target (a packed row's filler is not one)."""
    positions = batch.get("position_ids")
    if positions is None or positions.ndim != 2:
        return count_samples(batch)
    labels = batch["labels"]
    count = 0
    for row in range(int(labels.shape[0])):
        begins = (positions[row] == 0).nonzero().flatten().tolist()
        begins = begins if begins and begins[0] == 0 else [0, *begins]
        ends = [*begins[1:], int(labels.shape[1])]
        count += sum(bool((labels[row, b:e] != IGNORE_INDEX).any()) for b, e in zip(begins, ends))
    return count


def padding_micro_batch() -> dict[str, torch.Tensor]:
    """One position, no target: runs the forward and backward the collectives need and contributes exactly zero
    (its summed loss is 0, so is its gradient)."""
    return {"input_ids": torch.full((1, 1), PAD_TOKEN_ID, dtype=torch.long),
            "labels": torch.full((1, 1), IGNORE_INDEX, dtype=torch.long)}
