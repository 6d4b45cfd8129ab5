"""Run under torchrun (2 gloo ranks) by tests/distributed/test_save_hf_sharded.py: ``cadence train`` with the
arguments after ``--``, measuring what this rank gathers whole. Writes to OUT/rank-RANK.json: "status"; "gathers", the
bytes of each tensor ``DTensor.full_tensor`` made whole; "peak_live_bytes", the most bytes of such tensors alive at
once (each counted from its creation until the tensor object is collected: weakref.finalize); "whole_state_calls",
the calls of ``full_model_state`` (the gather of the whole state dict onto rank 0) made by the Checkpointer, which
reads the live weights for the final file, --save-hf and --keep-best.

    python -m torch.distributed.run --nproc-per-node 2 save_hf_ranks.py OUT -- train ...
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any

from torch.distributed.tensor import DTensor

from cadence.cli import main as cadence_main
from cadence.training.checkpoint import checkpointer


def main() -> None:
    out = Path(sys.argv[1])
    argv = sys.argv[sys.argv.index("--") + 1:]
    rank = int(os.environ["RANK"])
    live, peak, gathers, whole_calls = [0], [0], [], [0]
    full_tensor, whole_state = DTensor.full_tensor, checkpointer.full_model_state

    def release(size: int) -> None:
        live[0] -= size

    def tracked(self: DTensor, *args: Any, **kwargs: Any) -> Any:
        tensor = full_tensor(self, *args, **kwargs)
        size = tensor.numel() * tensor.element_size()
        gathers.append(size)
        live[0] += size
        peak[0] = max(peak[0], live[0])
        weakref.finalize(tensor, release, size)
        return tensor

    def counted(*args: Any, **kwargs: Any) -> Any:
        whole_calls[0] += 1
        return whole_state(*args, **kwargs)

    DTensor.full_tensor = tracked  # type: ignore[method-assign]
    checkpointer.full_model_state = counted  # type: ignore[assignment]
    status = cadence_main(argv)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps({"status": status, "gathers": gathers,
                                                        "peak_live_bytes": peak[0],
                                                        "whole_state_calls": whole_calls[0]}))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
