"""What a checkpoint format is (one protocol, :class:`CheckpointFormat`) and which formats there are (the registry,
:data:`FORMATS`).

Every step-N folder has the same frame whatever its format (``layout``): checkpoint.json, the JSON training state
(scheduler, engine counters, data position, random generators, the interrupted window, and the optimizer entry its
format hands over), each rank's own state where every rank writes, and the manifest written last. A format decides
the rest, which is how the model and the optimizer are held:

- what it takes from the live run (:meth:`CheckpointFormat.capture`: gathered whole, or each rank's shard; a
  collective), and the files it writes from that (:meth:`CheckpointFormat.write`);
- loading them back into a run of any strategy and world size (:meth:`CheckpointFormat.load`);
- the whole model's weights in one process without a process group (:meth:`CheckpointFormat.read_weights`), which is
  how ``cadence sample`` and ``cadence export`` read a checkpoint whatever its format.

A format is named in the manifest (``format``); :func:`checkpoint_format` gives the one a folder was written in, and
:func:`run_format` the one a run writes. Adding a format is one module holding a class that implements the protocol
(its instance in ``FORMAT``) and its entry in :data:`FORMATS`.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the formats' modules import torch; the registry itself is read without it
    import torch

    from cadence.distributed.ranks import Ranks
    from cadence.training.components import Components

FORMATS: dict[str, str] = {
    "files": "cadence.training.checkpoint.files",
    "dcp": "cadence.training.checkpoint.sharded",
}
"""The registry: each format's name (as a manifest states it) and the module holding it (its ``FORMAT``). A module is
imported when a checkpoint of its format is written or read, never before: importing torch.distributed.checkpoint
costs every command about 2 s of start-up (issue 38)."""
UNNAMED = "files"
"""The format of a manifest that names none: cadence wrote only whole checkpoints before there were two."""
BY_INDEX, BY_NAME = "by-index", "by-name"
"""How the optimizer's per-parameter state is keyed in the training state (checkpoint.json's ``optimizer_format``):
by parameter index (torch's own ``state_dict``) or by parameter name (FSDP2's state dicts)."""


class CheckpointUnreadable(ValueError):
    """A checkpoint's files verify against its manifest but do not parse as a cadence checkpoint."""


class WeightsUnreadable(CheckpointUnreadable):
    """The weights at ``path`` cannot be read (``reason``: what the reader said, in one line)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: unreadable weights ({reason})")
        self.path, self.reason = path, reason


@dataclass(kw_only=True)
class Captured:
    """What a format took from the live run for one checkpoint (copied as a whole when it is written in the
    background)."""

    optimizer: dict[str, Any]
    """The optimizer's entry of the JSON training state, which rank 0 writes: the whole state, or the part of it that
    is not in the format's own files."""
    tensors: dict[str, Any] | None = None
    """What this rank writes into the format's files (None: nothing)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Fields the format adds to checkpoint.json."""


class CheckpointFormat(Protocol):
    """How a checkpoint holds the model and the optimizer (see the module docstring)."""

    name: str
    """The manifest's ``format``."""
    files: tuple[str, ...]
    """The files every checkpoint of this format has besides the training state and checkpoint.json: the manifest
    must vouch for each."""
    every_rank_writes: bool
    """Every rank writes files of its own into the folder (and its own state: random generators, gradients)."""

    def describe(self) -> str:
        """In words, for the console and the docs."""
        ...

    def problem(self, listed: Collection[str]) -> str | None:
        """What a manifest listing ``listed`` lacks for this format beyond :attr:`files` (None: nothing)."""
        ...

    def capture(self, parts: Components, ranks: Ranks) -> Captured:
        """The model's and optimizer's state as this format writes it, read from the run now: every rank calls it
        (FSDP2 gathers or hands out its shards)."""
        ...

    def write(self, folder: Path, captured: Captured, ranks: Ranks, group: Any) -> list[str]:
        """Write this rank's files of ``captured`` into ``folder`` (rank 0's staging folder); their names, which this
        rank hashes. ``group``: the process group of a background write (None: the default one)."""
        ...

    def load(self, folder: Path, saved: dict[str, Any], info: Mapping[str, Any], parts: Components) -> None:
        """Load the model and optimizer of ``folder`` into ``parts`` (every rank calls it); ``saved``: the training
        state's optimizer entry, ``info``: checkpoint.json. Raises ValueError (or KeyError, RuntimeError) when the
        state does not fit this run."""
        ...

    def weights_at(self, folder: Path) -> Path:
        """Where the weights of ``folder`` are, for a message: a file, or the folder of shards."""
        ...

    def read_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        """The whole model's weights of ``folder``, by the model's state_dict names, in this one process; raises
        :class:`WeightsUnreadable`."""
        ...


def format_named(name: str) -> CheckpointFormat:
    """The registered format ``name`` (a KeyError for another name: ``verify_checkpoint`` refuses such a manifest)."""
    return importlib.import_module(FORMATS[name]).FORMAT


def run_format(ranks: Ranks) -> CheckpointFormat:
    """The format a run writes: sharded under FSDP2 (no rank holds the whole state), whole otherwise (every rank
    does anyway)."""
    return format_named("dcp" if ranks.launched and ranks.strategy == "fsdp" else "files")
