"""Run under torchrun (2 gloo ranks) by tests/training/test_branch_test_ranks.py: ``cadence train`` with the arguments
after ``--``, recording every verdict of --batch-branch-test this rank took (the decision and reason the controller
returned, and the test's figures but its wall time, which is each rank's own). Writes {"status", "verdicts"} to
OUT/rank-RANK.json.

    python -m torch.distributed.run --standalone --nproc-per-node 2 branch_ranks.py OUT -- train ...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from cadence.cli import main as cadence_main
from cadence.engine.adaptive_batch import BatchState
from cadence.training.adaptive_batch import BatchController


def main() -> None:
    out = Path(sys.argv[1])
    argv = sys.argv[sys.argv.index("--") + 1:]
    rank = int(os.environ["RANK"])
    verdicts: list[dict[str, Any]] = []
    original = BatchController._branch_test

    def recording(controller: BatchController, earlier: BatchState, step: int, reason: str) -> tuple[Any, str]:
        before = len(controller.branch_tests)
        decision, why = original(controller, earlier, step, reason)
        tested = controller.branch_tests[before:]  # none: the grow was kept untested (no room for a branch)
        figures = {key: value for key, value in tested[0].items() if key != "time_s"} if tested else None
        verdicts.append({"step": step, "decision": decision, "reason": why, "test": figures})
        return decision, why

    BatchController._branch_test = recording  # type: ignore[method-assign]
    status = cadence_main(argv)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps({"status": status, "verdicts": verdicts}))


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown, which torch's gloo threads sometimes abort under load (as noise_scale_ranks.py).
    sys.stdout.flush()
    os._exit(0)
