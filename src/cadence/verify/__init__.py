"""``cadence verify``: is a configuration (split, precision, recompute, offload, ranks) the same training?"""

from cadence.verify.check import VerifyFailed, VerifyOptions, run_verify, verify
from cadence.verify.equivalence import Setup, compare_gradients, compare_losses

__all__ = ["Setup", "VerifyFailed", "VerifyOptions", "compare_gradients", "compare_losses", "run_verify", "verify"]
