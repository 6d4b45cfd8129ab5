"""What torchrun tells a process it started: its rank variables, the only environment variables cadence reads.

Kept apart from ranks.py (which needs torch) because the command line asks it before anything else, `--help`
included, and must answer that without importing torch (issue 41).
"""

from __future__ import annotations

import os


def torchrun_ranks() -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) when torchrun started this process, else None."""
    try:
        return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
