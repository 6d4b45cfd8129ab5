"""``python -m cadence``: the same as the ``cadence`` command (torchrun starts ranks this way: ``-m cadence``)."""

import os
import sys
import traceback

from cadence.cli import main
from cadence.distributed.torchrun import torchrun_ranks

if torchrun_ranks() is None:
    sys.exit(main())
try:
    status = main()
except Exception:  # an unexpected error: its traceback, then the same hard exit as below
    traceback.print_exc()
    status = 1
# A rank's work is done and written (files closed, process group left). The interpreter's own teardown is skipped:
# under load, torch's gloo threads sometimes abort it ("terminate called without an active exception", SIGABRT), which
# would turn a clean exit into a crash after everything succeeded.
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
