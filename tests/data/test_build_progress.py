"""The progress of a long token-store build: silent for a moment, then throughput and ETA."""

from __future__ import annotations

import io

from cadence.data.progress import BuildProgress


def test_a_quick_build_prints_nothing() -> None:
    stream = io.StringIO()
    progress = BuildProgress("tokenising x", 1000, stream, delay=60.0)
    progress.advance(1000, 10)
    progress.close()
    assert stream.getvalue() == ""


def test_a_long_build_reports_throughput_and_eta_then_the_total() -> None:
    stream = io.StringIO()  # not a terminal: whole lines, no carriage returns
    progress = BuildProgress("tokenising data.jsonl", 4_000_000, stream, delay=0.0, log_every=0.0)
    progress.advance(1_000_000, 2_500)
    progress.advance(1_000_000, 2_500)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in stream.getvalue()
    assert lines[0].startswith("tokenising data.jsonl: 1.0/4.0 MB, ") and "MB/s" in lines[0] and "ETA" in lines[0]
    assert "2,500 examples" in lines[0] and "examples/s" not in lines[0].split("(")[0]
    assert "2.0/4.0 MB" in lines[-1] and "elapsed" in lines[-1] and "5,000 examples" in lines[-1]


def test_rows_are_counted_as_rows() -> None:
    stream = io.StringIO()
    progress = BuildProgress("tokenising saved dataset d (train)", 2048, stream, delay=0.0, log_every=0.0,
                             unit="rows")
    progress.advance(1024, 1024)
    assert stream.getvalue().startswith("tokenising saved dataset d (train): 1,024/2,048 rows, ")
