"""``python -m cadence``: the same as the ``cadence`` command (torchrun starts ranks this way: ``-m cadence``)."""

import sys

from cadence.cli import main

sys.exit(main())
