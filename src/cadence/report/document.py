"""What every report shares: the files a report is written as, scaled values, plot blocks. Its JSON inputs are read
through their typed records (``cadence.records``, ``cadence.config.plan_file``).

A report is one list of blocks (heading, paragraph, bullets, table, plot; see ``render``) built by whoever knows its
subject: runs here, plans in ``cadence.plan.report``, profiles in ``cadence.profiling.report``. ``write_report`` turns
it into report.md and a self-contained report.html, so the markdown and the HTML always say the same thing.

A report is written only over files cadence wrote: ``write_report`` first checks every report.md, report.html and
report-*.png it would replace or remove for cadence's mark (``render.MARKDOWN_MARK``, ``render.HTML_MARK``, the PNG's
Software chunk), and refuses, naming the file and changing nothing, when one lacks it. Reports written before the
marks existed are still known by their shape: the markdown's and the page's title line ("Run report: ", ...), and a
PNG without any text chunk that such a report links to.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from cadence.errors import UsageError
from cadence.formatting import finite
from cadence.output_files import atomic_write_bytes
from cadence.report import render as plots
from cadence.report.render import Plot, Report, to_html, to_markdown

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
RUN_PLOTS = ("report-loss.png", "report-lr.png", "report-throughput.png", "report-grad-norm.png",
             "report-loss-scale.png")
PLAN_PLOTS = ("report-diagnosis.png", "report-memory.png", "report-throughput.png", "report-quality.png")
WHERE = "RUN_DIR"
TITLES = ("Run report: ", "Plan report: ", "Profile report: ")
"""How the title of each report cadence writes begins (runs.py, plan/report.py, profiling/report.py): the mark of a
report written before the explicit marks."""
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEAD_BYTES = 4096
"""Where the marks are looked for: the HTML mark and the PNG's text chunks sit in the first bytes, the markdown mark
in the last ones; a report is never read whole just to be recognised."""


def write_report(report: Report, root: Path) -> list[Path]:
    """Write the report's files atomically; plots of an earlier build that this one lacks are removed.

    A file that cannot be written (a read-only or full disk) is a UsageError naming RUN_DIR: the user's to fix."""
    plotted = [block for block in report.blocks if isinstance(block, Plot)]
    written = [root / REPORT_MD, root / REPORT_HTML, *(root / plot.name for plot in plotted)]
    problem = foreign_report_file(root, [path.name for path in written] + sorted(set(RUN_PLOTS + PLAN_PLOTS)))
    if problem is not None:
        raise UsageError.single(WHERE, problem)
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


def foreign_report_file(root: Path, names: list[str]) -> str | None:
    """Why the report may not be written into ``root`` (one line naming the file), or None: one of ``names`` that is
    there but was not written by cadence: a file without cadence's mark, a link, a folder."""
    markdown = _own_markdown(root / REPORT_MD)
    for name in dict.fromkeys(names):
        path = root / name
        if not os.path.lexists(path):
            continue
        try:
            info = path.lstat()
        except OSError as err:
            return f"{path} cannot be checked ({err.strerror or err}); nothing was written"
        if not stat.S_ISREG(info.st_mode):
            return (f"{path} is not a regular file, so cadence did not write it; move it away to write the report "
                    f"here (nothing was written)")
        if name == REPORT_MD:
            own = markdown is not None
        elif name == REPORT_HTML:
            own = _own_html(_edges(path)[0])
        else:
            own = _own_png(_edges(path)[0], name, markdown)
        if not own:
            return (f"{path} was not written by cadence (it lacks cadence's mark); move it away to write the report "
                    f"here (nothing was written)")
    return None


def _edges(path: Path) -> tuple[bytes, bytes]:
    """The first and the last HEAD_BYTES of a regular file (empty when it cannot be read: then it is not known)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b"", b""
    try:
        size = os.fstat(descriptor).st_size
        return os.pread(descriptor, HEAD_BYTES, 0), os.pread(descriptor, HEAD_BYTES, max(0, size - HEAD_BYTES))
    except OSError:
        return b"", b""
    finally:
        os.close(descriptor)


def _own_markdown(path: Path) -> str | None:
    """The text of report.md (its first MiB) when cadence wrote it (its mark at the end, or an older report's title
    line), else None; an older report's plot links are looked for in it."""
    if not path.is_file() or path.is_symlink():
        return None
    head, tail = _edges(path)
    text = head.decode("utf-8", errors="replace")
    if plots.MARKDOWN_MARK.encode() in tail or any(text.startswith(f"# {title}") for title in TITLES):
        try:
            return path.read_bytes()[: 1 << 20].decode("utf-8", errors="replace")
        except OSError:
            return None
    return None


def _own_html(head: bytes) -> bool:
    text = head.decode("utf-8", errors="replace")
    if plots.HTML_MARK in text.split("</head>")[0]:
        return True
    start = '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>'
    return text.startswith(start) and any(text[len(start):].startswith(title) for title in TITLES)


def _own_png(head: bytes, name: str, markdown: str | None) -> bool:
    """A PNG with cadence's Software chunk, or (written before the mark) one with no text chunk at all that cadence's
    report.md links to."""
    if not head.startswith(PNG_MAGIC):
        return False
    if b"tEXtSoftware\x00" + plots.PNG_SOFTWARE.encode() in head:
        return True
    texts = (b"tEXt", b"iTXt", b"zTXt")
    return markdown is not None and f"]({name})" in markdown and not any(chunk in head for chunk in texts)


# ------------------------------------------------------------------------------------------------------ values
def times(value: Any, factor: float) -> Any:
    return value * factor if finite(value) else None


def plot_block(name: str, caption: str, figure: Any) -> Plot:
    """A Plot block from a figure; its title (the figure's own) becomes the image's alt text."""
    return Plot(name=name, title=figure.axes[0].get_title(), caption=caption, png=plots.png_bytes(figure))


