"""Reports as markdown and self-contained HTML: the block document, its rendering and plots, and the run report."""

from cadence.report.document import write_report
from cadence.report.render import Report
from cadence.report.runs import run_report

__all__ = ["Report", "run_report", "write_report"]
