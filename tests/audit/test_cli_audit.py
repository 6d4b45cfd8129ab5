"""`cadence audit -- python train.py`: the CLI passes the script's status through, or 1 on an error-level rule."""

from __future__ import annotations

import json
from pathlib import Path

from cadence.cli import main

CASES = Path(__file__).parent / "cases"


def test_bad_loop_exits_1_with_rule_and_line(capsys):
    assert main(["audit", "--", "python", str(CASES / "bad_clip_before_unscale.py")]) == 1
    err = capsys.readouterr().err
    assert "CAD001" in err and "bad_clip_before_unscale.py:17" in err


def test_good_loop_exits_0_and_json(capsys):
    assert main(["audit", "--json", "--", "python", str(CASES / "good_fp16_scaler.py")]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.err[captured.err.index("{"):])
    assert report["findings"] == []


def test_missing_script_is_a_usage_error(capsys):
    assert main(["audit", "--", "python", "no_such_script.py"]) == 2
    assert "SCRIPT" in capsys.readouterr().err
