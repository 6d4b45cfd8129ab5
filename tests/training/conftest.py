"""Fixtures shared by tests/training's modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import sample_text


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16,000 bytes of sample text in a .txt file, once per test module (the adaptive batch's and the ramp's runs)."""
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_bytes(sample_text(16000))
    return path
