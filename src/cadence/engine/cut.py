"""How a window is cut into micro-batches: one frozen value, decided once from the flags and used by every command.

A window is the samples of one optimizer step; its cut (rows per micro-batch or a token budget, the order, packing)
decides only how many micro-batches it takes and how much padding they compute. The gradient never changes with it,
because the engine normalises every micro-batch by the whole window's target count. So the cut is the one thing
``cadence train``, ``plan``, ``profile``, ``verify``, resume and ``--micro-batch-size auto`` must agree on, and they all
take this value: from the flags (:meth:`Cut.from_flags`), back to the flags and the run record (:meth:`Cut.flags`), in
words (:meth:`Cut.describe`), resized (``--micro-batch-size auto``: :meth:`Cut.resized`), and as a plan of one rank's
samples (:meth:`Cut.plan`; :func:`cadence.engine.windows.epoch_windows` and :func:`~cadence.engine.windows.recut` apply
it to a dataset or a window).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

MicroBatchOrder = Literal["drawn", "by-length"]
MICRO_BATCH_ORDER_CHOICES: tuple[MicroBatchOrder, ...] = ("drawn", "by-length")

CUT_FLAG_DEFAULTS: dict[str, Any] = {"micro_batch_order": "drawn", "micro_batch_tokens": None, "packing": False}
"""The cut flags (beyond the micro-batch size) of a window cut as cadence cut every window before cuts existed: a
record without them (an older plan.json or checkpoint) means these."""

MicroBatchPlan = list[list[list[int]]]
"""Micro-batches of rows of positions: ``plan[m][r]`` lists the samples (positions in the rank's share) of row ``r`` of
micro-batch ``m``; a row holds one sample, or several packed one after another."""


@dataclass(frozen=True, kw_only=True)
class Cut:
    """How one rank's share of a window is cut into micro-batches (see the module docstring)."""

    micro_batch_size: int
    """Rows per micro-batch (samples, or packed rows); with a token budget, the window's samples per micro-batch
    slot (micro x accumulation x processes samples make a window) but no longer a limit per micro-batch."""
    order: MicroBatchOrder = "drawn"
    """drawn: the share in the epoch's order; by-length: longest first (stable), so a micro-batch pads little.
    The library's default is drawn, so that a loop's micro-batches are consecutive slices of its permutation (what a
    hand-written loop would cut); ``cadence train``'s ``--micro-batch-order`` defaults to by-length, measured faster
    on variable-length data and identical on text of one length."""
    micro_batch_tokens: int | None = None
    """A budget of padded positions (rows x longest row) per micro-batch instead of a row count (sorted by length)."""
    pack_length: int | None = None
    """The samples packed into rows of at most this many positions (first-fit, longest first), or None."""

    def __post_init__(self) -> None:
        # Library misuse, not user input: the flags are validated (naming them) before a Cut is made.
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.order not in MICRO_BATCH_ORDER_CHOICES:
            raise ValueError(f"order must be one of {', '.join(MICRO_BATCH_ORDER_CHOICES)}, got {self.order!r}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.pack_length is not None and self.pack_length < 1:
            raise ValueError(f"pack_length must be >= 1, got {self.pack_length}")

    # ------------------------------------------------------------------------------------------------ from and to flags
    @classmethod
    def from_flags(cls, flags: Any, *, micro_batch_size: int, seq_len: int) -> Cut:
        """The cut of train's flags: ``flags`` has ``micro_batch_order``, ``micro_batch_tokens`` and ``packing``
        (a TrainConfig, or a record's mapping); ``--packing`` packs rows of the sequence length."""
        get = flags.get if isinstance(flags, Mapping) else lambda name, default: getattr(flags, name, default)
        return cls(micro_batch_size=micro_batch_size,
                   order=get("micro_batch_order", CUT_FLAG_DEFAULTS["micro_batch_order"]),
                   micro_batch_tokens=get("micro_batch_tokens", None),
                   pack_length=seq_len if get("packing", False) else None)

    def flags(self) -> dict[str, Any]:
        """The cut as train's flags beyond the micro-batch size (the run record's, plan.json's and a mid-window
        checkpoint's keys); ``packing`` is a switch whose row length is the sequence length."""
        return {"micro_batch_order": self.order, "micro_batch_tokens": self.micro_batch_tokens,
                "packing": self.pack_length is not None}

    def command_line(self, *, default_order: MicroBatchOrder | None = None) -> list[str]:
        """The cut as train's flags beyond ``--micro-batch-size``, as a command would be typed; the order is left out
        when it is ``default_order`` (the default of the command the flags are for)."""
        flags = [] if self.order == default_order else ["--micro-batch-order", self.order]
        if self.micro_batch_tokens is not None:
            flags += ["--micro-batch-tokens", str(self.micro_batch_tokens)]
        return flags + (["--packing"] if self.pack_length is not None else [])

    @property
    def by_length(self) -> bool:
        """Whether the cut reads the samples' lengths (anything but rows in drawn order)."""
        return self.order != "drawn" or self.micro_batch_tokens is not None or self.pack_length is not None

    def describe(self) -> str:
        """The cut beyond its micro-batch size in words, e.g. "order by-length, budget 2048 positions", "packed into
        rows of 256"; "" for rows in drawn order (the plain cut)."""
        parts = [] if self.order == "drawn" else [f"order {self.order}"]
        if self.micro_batch_tokens is not None:
            parts.append(f"budget {self.micro_batch_tokens} positions")
        if self.pack_length is not None:
            parts.append(f"packed into rows of {self.pack_length}")
        return ", ".join(parts)

    # --------------------------------------------------------------------------------------------- --micro-batch-size auto
    @property
    def size(self) -> int:
        """What limits a micro-batch: the token budget when there is one, else the rows."""
        return self.micro_batch_tokens if self.micro_batch_tokens is not None else self.micro_batch_size

    def resized(self, size: int) -> Cut:
        """The same cut with ``size`` as its limit (what ``--micro-batch-size auto`` halves and grows back). With a
        token budget below the packed row length, rows are packed to the budget, so a window of long packed rows can
        still shrink to one sample per micro-batch."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if self.micro_batch_tokens is None:
            return replace(self, micro_batch_size=size)
        pack_length = min(self.pack_length, size) if self.pack_length is not None else None
        return replace(self, micro_batch_tokens=size, pack_length=pack_length)

    # ------------------------------------------------------------------------------------------------------- planning
    def plan(self, lengths: Sequence[int]) -> MicroBatchPlan:
        """One rank's share of a window (the samples' input lengths, in drawn order) as micro-batches of rows of
        positions into ``lengths``. Rows in drawn order read no length (any values do)."""
        if self.pack_length is not None:
            rows = pack_rows(lengths, self.pack_length)
            groups = _groups_by_length([sum(lengths[k] for k in row) for row in rows],
                                       rows=self.micro_batch_size, tokens=self.micro_batch_tokens)
            return [[rows[k] for k in group] for group in groups]
        if not self.by_length:
            return [[[k] for k in range(at, min(at + self.micro_batch_size, len(lengths)))]
                    for at in range(0, len(lengths), self.micro_batch_size)]
        groups = _groups_by_length(lengths, rows=self.micro_batch_size, tokens=self.micro_batch_tokens)
        return [[[k] for k in group] for group in groups]


def rank_bounds(samples: int, world_size: int) -> list[int]:
    """Where each rank's contiguous share of a window of ``samples`` begins (and, last, where the window ends):
    equal shares, or shares that differ by at most one sample (the epoch's short last window)."""
    base, extra = divmod(samples, world_size)
    return [r * base + min(r, extra) for r in range(world_size + 1)]


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Positions of ``lengths`` packed into rows of at most ``capacity``: first-fit, longest first (a stable sort,
    so equal lengths keep their order). A sample longer than ``capacity`` gets a row of its own."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for k in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for row, used in enumerate(fill):
            if used + lengths[k] <= capacity:
                rows[row].append(k)
                fill[row] += lengths[k]
                break
        else:
            rows.append([k])
            fill.append(lengths[k])
    return rows


def _groups_by_length(lengths: Sequence[int], *, rows: int, tokens: int | None) -> list[list[int]]:
    """Positions of ``lengths``, longest first (stable, so the largest micro-batch comes first and a window that does
    not fit fails before any backward), in groups of ``rows``, or of at most ``tokens`` padded positions (rows x
    the group's longest)."""
    ranked = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    if tokens is None:
        return [ranked[at:at + rows] for at in range(0, len(ranked), rows)]
    groups: list[list[int]] = []
    for k in ranked:
        # Longest first: a group's width is its first item's length, so it holds budget // width rows (at least
        # one: an item longer than the budget runs alone rather than not at all).
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= tokens:
            groups[-1].append(k)
        else:
            groups.append([k])
    return groups


__all__ = ["CUT_FLAG_DEFAULTS", "MICRO_BATCH_ORDER_CHOICES", "Cut", "MicroBatchOrder", "MicroBatchPlan", "pack_rows",
           "rank_bounds"]
