"""Run under torchrun (2 gloo ranks) by tests/distributed/test_sharded_checkpoints.py: ``cadence train`` with the
arguments after ``--``, counting the micro-batches this rank computes; with STEP and MICRO given, rank 0 gets SIGTERM
once micro-batch MICRO of step STEP + 1 has started (every rank stops after it: the stop is agreed). Writes
{"status", "micro_batches"} to OUT/rank-RANK.json.

    python -m torch.distributed.run --nproc-per-node 2 mid_window_ranks.py OUT STEP MICRO -- train ...
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from cadence.cli import main as cadence_main
from cadence.training.progress import TrainProgress


def main() -> None:
    out, step, micro = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    argv = sys.argv[sys.argv.index("--") + 1:]
    rank = int(os.environ["RANK"])
    computed = [0]
    original = TrainProgress.micro_step

    def counting(progress: TrainProgress, at_step: int, at_micro: int, total: int | None = None) -> None:
        original(progress, at_step, at_micro, total)
        computed[0] += 1
        if rank == 0 and (at_step, at_micro) == (step, micro):
            os.kill(os.getpid(), signal.SIGTERM)

    TrainProgress.micro_step = counting  # type: ignore[method-assign]
    status = cadence_main(argv)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps({"status": status, "micro_batches": computed[0]}))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
