"""``cadence audit``: run someone else's training loop under a checker of the step chain's rules."""

from cadence.audit.checker import Audit, AuditReport, format_report
from cadence.audit.run import run_script

__all__ = ["Audit", "AuditReport", "format_report", "run_script"]
