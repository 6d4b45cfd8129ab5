"""What torchrun tells a process it started: its rank variables and which start of the workers this is
(``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``), the only environment
variables cadence reads.

Kept apart from ranks.py (which needs torch) because the command line asks it before anything else, `--help`
included, and must answer that without importing torch (issue 41).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path


def torchrun_ranks() -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) when torchrun started this process, else None."""
    try:
        return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True, kw_only=True)
class ElasticAttempt:
    """Which start of its workers torch's elastic agent (torchrun) is on: ``restart`` counts the restarts so far (0:
    the first start), up to ``max_restarts`` (torchrun --max-restarts), within the launch ``run_id`` (torchrun
    --rdzv-id; a fresh id per --standalone launch, but "none" by default on several nodes). ``agent`` names the
    agent process that started this one (host, pid and start time): it lives across the restarts of one launch,
    and no later launch has it."""

    run_id: str
    restart: int
    max_restarts: int
    agent: str


def torchrun_attempt() -> ElasticAttempt | None:
    """This process's :class:`ElasticAttempt` when torch's elastic agent started it, else None."""
    try:
        restart, most = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
    except (KeyError, ValueError):
        return None
    return ElasticAttempt(run_id=run_id, restart=restart, max_restarts=most, agent=parent_process_identity())


def parent_process_identity() -> str:
    """host:pid:start of this process's parent. The start time (clock ticks since boot, from /proc) tells the agent
    apart from a later process that got the same pid; without /proc the pid alone is used."""
    parent = os.getppid()
    try:
        # The fields after the command name (which may hold spaces and parentheses): the start time is the 20th.
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"
    return f"{socket.gethostname()}:{parent}:{started}"


def agent_store_address() -> tuple[str, int] | None:
    """(host, port) of the elastic agent's own store when the ranks are to share it (TORCHELASTIC_USE_AGENT_STORE,
    with MASTER_ADDR and MASTER_PORT naming it), else None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        return None
