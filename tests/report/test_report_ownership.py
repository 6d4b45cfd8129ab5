"""Issue 44: ``cadence report DIR`` writes only into directories cadence wrote, and only over report files cadence
wrote (cadence.rebuild, cadence.report.document.write_report)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from cadence.cli import main
from cadence.report import render

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROWS = '{"step": 1, "window": 1, "loss": 2.0, "tokens": 10, "samples": 2}\n'
CADENCE_CONFIG = {"effective_batch_size": 8, "grad_accum_steps": 1, "world_size": 1, "data_fingerprint": "x",
                  "versions": {"cadence": "0"}}


def _png(software: str | None) -> bytes:
    """A 1x1 PNG, with a tEXt Software chunk when ``software`` is given (another tool's plot)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    text = chunk(b"tEXt", b"Software\x00" + software.encode()) if software else b""
    return (PNG_MAGIC + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)) + text
            + chunk(b"IDAT", zlib.compress(b"\x00\x00")) + chunk(b"IEND", b""))


def _without_text_chunks(data: bytes) -> bytes:
    """A PNG as cadence wrote them before its mark: no text chunk at all."""
    out, position = [data[:8]], 8
    while position < len(data):
        (length,) = struct.unpack(">I", data[position:position + 4])
        end = position + 12 + length
        if data[position + 4:position + 8] not in (b"tEXt", b"iTXt", b"zTXt"):
            out.append(data[position:end])
        position = end
    return b"".join(out)


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: a file's bytes, a link's target."""
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        found[name] = os.readlink(path) if path.is_symlink() else path.read_bytes() if path.is_file() else "dir"
    return found


def _plan_dir(root: Path) -> Path:
    root.mkdir()
    shutil.copy(FIXTURES / "plan" / "plan.json", root / "plan.json")
    return root


def _metrics_only(root: Path) -> Path:
    root.mkdir()
    (root / "metrics.jsonl").write_text(ROWS)
    (root / "report.md").write_text("# my notes\n")
    return root


def _foreign_config(root: Path) -> Path:
    _metrics_only(root)
    (root / "config.json").write_text(json.dumps({"lr": 0.1, "effective_batch_size": 8}))
    return root


def _foreign_plan(root: Path) -> Path:
    root.mkdir()
    (root / "plan.json").write_text(json.dumps({"version": 1, "steps": [1, 2]}))
    (root / "report.html").write_text("<p>mine</p>")
    return root


def _foreign_profile(root: Path) -> Path:
    root.mkdir()
    (root / "profile.json").write_text(json.dumps({"version": 1, "created": "today", "phases": {}}))
    return root


def _file_in_plan(name: str, content: bytes) -> Callable[[Path], Path]:
    def make(root: Path) -> Path:
        _plan_dir(root)
        (root / name).write_bytes(content)
        return root
    return make


def _linked_report(root: Path) -> Path:
    _plan_dir(root)
    (root.parent / "notes.md").write_text("# Plan report: my own notes\n")
    (root / "report.md").symlink_to(root.parent / "notes.md")
    return root


def _report_folder(root: Path) -> Path:
    _plan_dir(root)
    (root / "report-memory.png").mkdir()
    (root / "report-memory.png" / "keep.txt").write_text("mine")
    return root


@pytest.mark.parametrize(("make", "named", "said"), [
    (_metrics_only, "config.json", "is not a run cadence wrote"),
    (_foreign_config, "config.json", "is not one written by cadence train"),
    (_foreign_plan, "plan.json", "was not written by cadence plan"),
    (_foreign_profile, "profile.json", "was not written by cadence profile"),
    (_file_in_plan("report.md", b"# Notes\n\nmy own words\n"), "report.md", "was not written by cadence"),
    (_file_in_plan("report.html", b"<!DOCTYPE html>\n<p>mine</p>\n"), "report.html", "was not written by cadence"),
    (_file_in_plan("report-memory.png", _png("GIMP")), "report-memory.png", "was not written by cadence"),
    (_file_in_plan("report-loss.png", _png(None)), "report-loss.png", "was not written by cadence"),  # stale kind
    (_linked_report, "report.md", "is not a regular file"),
    (_report_folder, "report-memory.png", "is not a regular file"),
], ids=["metrics-without-config", "foreign-config", "foreign-plan", "foreign-profile", "user-report-md",
        "user-report-html", "user-plot", "user-plot-of-another-kind", "linked-report", "folder-named-as-a-plot"])
def test_report_writes_nothing_over_what_cadence_did_not_write(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                make: Callable[[Path], Path], named: str,
                                                                said: str) -> None:
    root = make(tmp_path / "dir")
    before = _snapshot(tmp_path)
    assert main(["report", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{root / named}" in err and said in err, err
    assert _snapshot(tmp_path) == before, "nothing may change"


def test_reports_cadence_wrote_are_rebuilt_with_and_without_the_mark(tmp_path: Path) -> None:
    """A report cadence wrote is rebuilt: its own, marked, and one written before the marks (its plots without text
    chunks, linked from its report.md), stale plots of such a report removed."""
    root = _plan_dir(tmp_path / "plan")
    assert main(["report", str(root)]) == 0
    md, page = (root / "report.md").read_text(), (root / "report.html").read_text()
    assert md.rstrip().endswith(render.MARKDOWN_MARK) and render.HTML_MARK in page.split("</head>")[0]
    plots = sorted(root.glob("report-*.png"))
    assert plots and all(b"tEXtSoftware\x00cadence" in path.read_bytes() for path in plots)
    assert main(["report", str(root)]) == 0  # rebuilt over its own files

    # As an older cadence wrote it: no marks, and a plot the plan no longer draws, linked from its markdown.
    (root / "report.md").write_text(md.replace(render.MARKDOWN_MARK, "") + "![loss](report-loss.png)\n")
    (root / "report.html").write_text(page.replace(render.HTML_MARK + "\n", ""))
    for path in plots:
        path.write_bytes(_without_text_chunks(path.read_bytes()))
    (root / "report-loss.png").write_bytes(_without_text_chunks(plots[0].read_bytes()))
    assert main(["report", str(root)]) == 0
    assert not (root / "report-loss.png").exists()
    assert (root / "report.md").read_text().rstrip().endswith(render.MARKDOWN_MARK)
