"""Restarts that resume: under ``torchrun --max-restarts K``, restarted workers continue the run of their launch.

When a rank dies, torch's elastic agent stops the other ranks and starts all of them again with the same command line,
``TORCHELASTIC_RESTART_COUNT`` one higher. They meet --out holding what the failed attempt wrote. A first start
refuses such a directory (a user's run is never trained over); a restart continues it as ``--resume`` would, from its
newest complete checkpoint (a mid-window one included), so only the work since that checkpoint is lost, and the console
says which steps are done again. A restart before the first checkpoint starts over from step 0 in the same directory.

A directory is the launch's own when its config.json records the launch (``launch``: torchrun's run id and the agent
of every node) and this attempt has the same run id and at least one of those agents. The run id alone would not do:
on several nodes it is "none" unless --rdzv-id is given, the same for every launch, and a first start refused on an
earlier launch's directory would, restarted, continue that run. An agent (host, pid, start time) lives only as long as
its launch, and on every node across its restarts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cadence.config import TrainConfig, is_cadence_config
from cadence.distributed.ranks import Ranks, broadcast_from_main, gather_from_all
from cadence.distributed.torchrun import torchrun_attempt
from cadence.errors import UsageError
from cadence.records import RUN_CONFIG, TEXT, Record, list_of
from cadence.training.resume import ResumePoint
from cadence.training.run_dir import CONFIG_FILE, MetricsUnreadable, read_metrics

LAUNCH_FIELD = "launch"
"""config.json's record of the launch that last wrote the run (:meth:`Launch.record`)."""

RESTART_LOCK_WAIT_S = 60.0
"""How long a restart waits for the run directory's lock (see :func:`cadence.training.lock.claim_run_directory`)."""


@dataclass(frozen=True, kw_only=True)
class Launch:
    """The torchrun launch this process belongs to: its run id, this attempt (the most restarts any node's agent has
    made: an agent whose own workers stayed healthy restarts them without counting), the most restarts it allows,
    the agents (one per node) that started this attempt's ranks, and whether --out holds this launch's own run."""

    run_id: str
    restart: int
    max_restarts: int
    agents: tuple[str, ...]
    own_run: bool = False
    """--out holds the run an earlier attempt of this launch wrote: this attempt continues it."""

    def record(self) -> dict[str, Any]:
        """What config.json records of the launch."""
        return {"run_id": self.run_id, "restart": self.restart, "max_restarts": self.max_restarts,
                "agents": list(self.agents)}

    def owns(self, out: Path) -> bool:
        """Whether ``out`` holds a run that this launch wrote (an earlier attempt of it)."""
        recorded = recorded_launch(out)
        if recorded is None:
            return False
        try:
            run_id, agents = recorded.text("run_id"), recorded.take("agents", list_of(TEXT))
        except UsageError:  # not a record cadence wrote: not this launch's
            return False
        return run_id == self.run_id and bool(set(agents) & set(self.agents))

    def configured(self, config: TrainConfig) -> TrainConfig:
        """The configuration this attempt runs: its own run resumed (as if --resume were given), else as given."""
        return dataclasses.replace(config, resume=True) if self.own_run and not config.resume else config

    def describe(self) -> str:
        return (f"restart {self.restart} of {self.max_restarts}" if self.restart
                else "torchrun restarted the workers (a node joined or left)")


def this_launch(config: TrainConfig, ranks: Ranks) -> Launch | None:
    """The launch this process was started in by torch's elastic agent, or None without one. Every rank calls this:
    the agents and their restart counts are gathered from all ranks, and rank 0 decides for all whether --out holds
    this launch's own run. A first start never does (its agents are new), so it is refused a directory in use as
    ever; so is a restart meeting a directory another launch wrote."""
    attempt = torchrun_attempt()
    if attempt is None or not ranks.launched:
        return None
    gathered = gather_from_all((attempt.agent, attempt.restart), ranks)
    launch = Launch(run_id=attempt.run_id, restart=max(restart for _, restart in gathered),
                    max_restarts=attempt.max_restarts, agents=tuple(sorted({agent for agent, _ in gathered})))
    own = config.out is not None and broadcast_from_main(ranks.is_main and launch.owns(config.out), ranks)
    return dataclasses.replace(launch, own_run=own)


def recorded_launch(out: Path) -> Record | None:
    """The launch record of ``out``'s config.json; None when there is none (no run, another tool's file, a run
    started without torchrun's agent)."""
    path = out / CONFIG_FILE
    try:
        if not is_cadence_config(path):
            return None
        record = RUN_CONFIG.read(path)
        return record.record(LAUNCH_FIELD, default=None)
    except (OSError, UsageError):  # a name too long to stat, a file replaced meanwhile: not this launch's run
        return None


def last_recorded_step(out: Path) -> int:
    """The last step metrics.jsonl records (0 when none): read before a resume drops the rows after its checkpoint,
    so that the console can say which steps are done again. A file that cannot be read counts as none (the resume
    itself names what is wrong with it)."""
    try:
        rows = read_metrics(out)
    except (OSError, MetricsUnreadable):
        return 0
    return max((int(row["step"]) for row in rows), default=0)


def restart_line(launch: Launch | None, out: Path, *, out_given: bool, start: ResumePoint | None,
                 recorded: int) -> str | None:
    """What a restart does, for the console (None on a first start): the checkpoint it resumes from and the steps
    done again (``recorded``: the last step metrics.jsonl held before the resume), or that it starts over."""
    if launch is None or not (launch.restart or launch.own_run):
        return None
    where = launch.describe()
    if not out_given:
        return (f"{where}: no --out was given, so this attempt starts a new run in {out} from step 0 (give --out "
                f"to have a restart resume its run)")
    if not launch.own_run:
        return f"{where}: {out} holds nothing of this launch's run yet, so it starts from step 0"
    if start is None:
        return (f"{where}: {out} has no checkpoint yet, so the run starts over from step 0"
                + (f"; {_steps(1, recorded)} done again" if recorded else ""))
    partial = (f" (mid-window: {start.partial.micro_batches_done} micro-batch(es) of step {start.step + 1} already "
               f"done)" if start.partial is not None else "")
    again = (f"{_steps(start.step + 1, recorded)} done again" if recorded > start.step
             else "no finished step is done again")
    return f"{where}: resuming {out} from {start.checkpoint.name}{partial}; {again}"


def _steps(first: int, last: int) -> str:
    return f"step {first} is" if first == last else f"steps {first}-{last} are"
