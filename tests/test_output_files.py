"""cadence's own output files: the default directory a command writes into when the user names none."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from cadence.output_files import timestamped_directory

NOW = datetime(2026, 12, 6, 13, 56, 1)


def test_a_default_directory_is_named_by_the_clock(tmp_path: Path) -> None:
    assert timestamped_directory(tmp_path, NOW) == tmp_path / "20261206-135601"


def test_two_commands_in_the_same_second_get_two_directories(tmp_path: Path) -> None:
    """The docs run their commands one after another, within a second: the second train was refused ("default
    runs/... already exists; give --out") before the name took a suffix."""
    (tmp_path / "20261206-135601").mkdir()
    assert timestamped_directory(tmp_path, NOW) == tmp_path / "20261206-135601-2"
    (tmp_path / "20261206-135601-2").mkdir()
    assert timestamped_directory(tmp_path, NOW) == tmp_path / "20261206-135601-3"
