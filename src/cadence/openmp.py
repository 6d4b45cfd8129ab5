"""How the command line asks torch's OpenMP runtime to wait: passively, set before torch is first imported.

Why (measured on a 2-core machine shared with other processes, docs/memory.md): torch's CPU kernels run in an
OpenMP team of one thread per core. Between two parallel regions GNU libgomp, the runtime torch ships on Linux,
busy-waits for ``GOMP_SPINCOUNT`` (300,000 by default) iterations before it sleeps; it shortens that to 1,000 only when
it manages more threads than the process has cores. Other processes are invisible to it, so on a shared machine a
team of two spinning threads competes with them for the cores, and every small op waits for a scheduler slice:
gpt-tiny's step took 2-12 s instead of 0.1-0.3 s. Whether a run suffered depended on an accident: a shuffle of more
than 32,768 examples (the built-in corpus, any large ``--data``) runs ``torch.randperm`` in parallel in the prefetch
thread, which gives that thread a second team, so libgomp counted four threads on two cores and throttled its spin;
a small ``.txt`` file never did. A passive wait (threads sleep at once, as OpenMP's standard ``OMP_WAIT_POLICY``
allows) makes every run behave as the large-data runs already did, whatever the data.

libgomp reads its settings once, when torch loads it, so only a process that has not imported torch yet can choose;
a library user's own loop has imported torch before cadence and keeps its settings. A user's own choice of either
variable wins: it is OpenMP's configuration, not cadence's, and is never read for anything else.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""What sets how OpenMP threads wait (the standard name and libgomp's own); one set by the user is left alone."""


def prefer_passive_wait() -> bool:
    """Ask OpenMP for a passive wait in this process and the ones it starts (torchrun's ranks inherit it).

    Returns whether it was set: False when the user chose a wait policy, or when torch (and so its OpenMP runtime)
    is already loaded and the setting could no longer take effect."""
    if "torch" in sys.modules or any(name in os.environ for name in WAIT_POLICY_VARIABLES):
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


__all__ = ["WAIT_POLICY_VARIABLES", "prefer_passive_wait"]
