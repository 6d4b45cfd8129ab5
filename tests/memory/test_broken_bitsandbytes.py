"""Issue 44 item 6: bitsandbytes installed but failing (its native library missing: an OSError at import; a symbol
missing: an AttributeError) made --optimizer-state 8bit and LoRA runs (peft reaches for bitsandbytes) end in a
traceback. Now one line names the package and the repair, before any run directory is made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import sample_text

SRC = Path(__file__).resolve().parents[2] / "src"
LLAMA = ["--model", "hf:llama", *[item for key, value in {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
    "vocab_size": 256, "max_position_embeddings": 128}.items() for item in ("--model-config", f"{key}={value}")]]
BROKEN = {
    "native library missing": ('raise OSError("libbitsandbytes_cpu.so: cannot open shared object file")\n',
                               "OSError: libbitsandbytes_cpu.so: cannot open shared object file"),
    "symbols missing": ("optim = None\n", "AttributeError: "),
}


# Each case is a process of its own importing torch: one in make test, the other three in make test-slow.
@pytest.mark.parametrize("broken", [pytest.param(name, marks=pytest.mark.slow) if name != "native library missing"
                                    else name for name in BROKEN])
@pytest.mark.parametrize("use", ["8bit", pytest.param("lora", marks=pytest.mark.slow)])
def test_a_broken_bitsandbytes_is_named_with_its_repair_before_anything_is_written(tmp_path: Path, broken, use):
    pytest.importorskip("peft")
    package = tmp_path / "site" / "bitsandbytes"
    package.mkdir(parents=True)
    source, reason = BROKEN[broken]
    (package / "__init__.py").write_text(source)
    data = tmp_path / "text.txt"
    data.write_bytes(sample_text(400 * 32 + 1))
    out = tmp_path / "run"
    flags = ["--optimizer-state", "8bit"] if use == "8bit" else [*LLAMA, "--lora-rank", "8"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(SRC)])}
    done = subprocess.run([sys.executable, "-m", "cadence", "train", "--data", str(data), "--seq-len", "32",
                           "--max-steps", "2", "--val-fraction", "0", *flags, "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and "bitsandbytes is installed but fails to import" in lines[0] and reason in lines[0]
    assert "pip install --force-reinstall bitsandbytes" in lines[0]
    if use == "lora":
        assert lines[0].startswith("cadence: error: --lora-rank: LoRA needs peft") and "pip uninstall bitsandbytes" \
            in lines[0]
    else:
        assert lines[0].startswith("cadence: error: --optimizer-state: 8bit needs bitsandbytes")
    assert not out.exists()
