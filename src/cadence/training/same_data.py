"""The ranks train on the same data: checked once every rank has opened its token store.

On several nodes each node may hold its own data cache on a local disk (``--data-cache`` names a directory on each
node): each builds or opens its own store, and nothing but the content says that they hold the same tokens. Ranks
with different data would each take their slices of different windows, so the run would be neither the run asked
for nor one that a resume could reproduce, without any error. So the ranks exchange what identifies their data (the
store's digest over its files' checksums, the source's content fingerprint, the examples of each split) and all stop,
before anything is written, when one differs from rank 0's, naming the rank, its node and its store.
"""

from __future__ import annotations

import socket
from typing import NamedTuple

from cadence.data import DataSplits
from cadence.distributed.ranks import Ranks, gather_from_all
from cadence.errors import UsageError


class DataIdentity(NamedTuple):
    """What one rank's data is, and where it was read: enough to tell two ranks' data apart and to find the store."""

    rank: int
    host: str
    store: str
    """The token store the rank read (or its data's description, for data built in memory)."""
    digest: str | None
    """The store's digest (:attr:`cadence.data.store.TokenStore.digest`): which tokens exactly."""
    fingerprint: str
    """The source content's fingerprint."""
    examples: tuple[int, int]
    """Training and validation examples at this run's sequence length."""

    def same_data(self, other: DataIdentity) -> bool:
        return (self.digest, self.fingerprint, self.examples) == (other.digest, other.fingerprint, other.examples)

    def describe(self) -> str:
        what = self.digest or self.fingerprint
        return (f"rank {self.rank} on {self.host} ({self.store}: {what[:19]}..., {self.examples[0]:,} training and "
                f"{self.examples[1]:,} validation examples)")


def data_identity(data: DataSplits, ranks: Ranks) -> DataIdentity:
    return DataIdentity(rank=ranks.rank, host=socket.gethostname(),
                        store=str(data.store) if data.store is not None else data.description,
                        digest=data.store_digest, fingerprint=data.fingerprint,
                        examples=(len(data.train), 0 if data.val is None else len(data.val)))


def different_data(found: list[DataIdentity]) -> str | None:
    """Why the ranks ``found`` do not hold the same data (each differing rank against rank 0), or None."""
    first = found[0]
    others = [identity for identity in found[1:] if not identity.same_data(first)]
    if not others:
        return None
    return ("the ranks do not hold the same data, so they would train on slices of different windows: "
            + " and ".join(identity.describe() for identity in others)
            + f" {'holds' if len(others) == 1 else 'hold'} other data than {first.describe()}. Each node's token "
            f"store must be built from the same data with the same tokenizer: give every node the same --data, or a "
            f"--data-cache on a file system they share")


def check_same_data(data: DataSplits, ranks: Ranks) -> None:
    """Every rank calls this once its data is open (and only then: it is a collective); raises the same
    UsageError on every rank when their data differ."""
    if not ranks.launched or ranks.world_size == 1:
        return
    problem = different_data([DataIdentity(*found) for found in gather_from_all(tuple(data_identity(data, ranks)),
                                                                                 ranks)])
    if problem is not None:
        raise UsageError.single("--data", problem)
