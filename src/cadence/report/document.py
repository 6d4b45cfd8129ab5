"""What every report shares: the files a report is written as, reading its JSON inputs, plot blocks.

A report is one list of blocks (heading, paragraph, bullets, table, plot; see ``render``) built by whoever knows its
subject: runs here, plans in ``cadence.plan.report``, profiles in ``cadence.profiling.report``. ``write_report`` turns
it into report.md and a self-contained report.html, so the markdown and the HTML always say the same thing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cadence.errors import UsageError
from cadence.formatting import finite
from cadence.input_files import read_regular_file
from cadence.output_files import atomic_write_bytes
from cadence.report import render as plots
from cadence.report.render import Plot, Report, to_html, to_markdown

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
RUN_PLOTS = ("report-loss.png", "report-lr.png", "report-throughput.png", "report-grad-norm.png",
             "report-loss-scale.png")
PLAN_PLOTS = ("report-diagnosis.png", "report-memory.png", "report-throughput.png", "report-quality.png")
WHERE = "RUN_DIR"


def write_report(report: Report, root: Path) -> list[Path]:
    """Write the report's files atomically; plots of an earlier build that this one lacks are removed.

    A file that cannot be written (a read-only or full disk) is a UsageError naming RUN_DIR: the user's to fix."""
    plotted = [block for block in report.blocks if isinstance(block, Plot)]
    written = [root / REPORT_MD, root / REPORT_HTML, *(root / plot.name for plot in plotted)]
    try:
        for plot in plotted:
            atomic_write_bytes(root / plot.name, plot.png)
        for stale in set(RUN_PLOTS + PLAN_PLOTS) - {plot.name for plot in plotted}:
            (root / stale).unlink(missing_ok=True)  # e.g. a loss-scale plot from before the run was re-made in bf16
        atomic_write_bytes(root / REPORT_MD, to_markdown(report).encode("utf-8"))
        atomic_write_bytes(root / REPORT_HTML, to_html(report).encode("utf-8"))
    except OSError as err:
        raise UsageError.single(WHERE, f"cannot write the report into {root}: {err.strerror or err}") from None
    return written


# ----------------------------------------------------------------------------------------------------- reading
def read_json_object(path: Path, where: str = WHERE) -> dict[str, Any]:
    """A JSON file that must hold an object; any problem is a UsageError naming ``where``. Read as the user's other
    inputs are: a regular file only, at most 256 MiB (a named pipe or a link to a device is refused, not read)."""
    content = read_regular_file(path, where=where, limit=256 << 20)
    try:
        value = json.loads(content.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UsageError.single(where, f"{path} cannot be read: {err}") from None
    except json.JSONDecodeError as err:
        raise UsageError.single(where, f"{path} is not valid JSON ({err.msg}, line {err.lineno})") from None
    except RecursionError:
        raise UsageError.single(where, f"{path} is not valid JSON (nested too deeply)") from None
    if not isinstance(value, dict):
        raise UsageError.single(where, f"{path} should hold a JSON object, not {type(value).__name__}")
    return value


def times(value: Any, factor: float) -> Any:
    return value * factor if finite(value) else None


def plot_block(name: str, caption: str, figure: Any) -> Plot:
    """A Plot block from a figure; its title (the figure's own) becomes the image's alt text."""
    return Plot(name=name, title=figure.axes[0].get_title(), caption=caption, png=plots.png_bytes(figure))


