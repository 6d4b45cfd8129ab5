"""cadence audit on the loops people run (issue 42): small scripts on transformers.Trainer, TRL's SFTTrainer,
Accelerate, PyTorch Lightning and cadence's own Engine (tests/audit/real_loops/, a tiny llama and tokenizer built
offline), each in a correct and a broken form. The broken ones exit 1 with the rule that names their bug; the
correct ones give no finding; every finding names the script's own line first, the library's call after it. Each
library's cases are skipped when it is not installed."""

from __future__ import annotations

import importlib.util
import io
import json
import os
from pathlib import Path

import pytest

from cadence.audit.run import run_script

LOOPS = Path(__file__).parent / "real_loops"

# (script, arguments, libraries it needs, exit status, rule ids, a measurement the finding must state)
CASES = [
    ("hf_trainer.py", ["--equal"], ["transformers", "datasets"], 0, set(), None),
    ("hf_trainer.py", [], ["transformers", "datasets"], 0, set(), None),
    ("hf_trainer.py", ["--broken"], ["transformers", "datasets"], 1, {"CAD018"}, "2.00x"),
    ("trl_sft.py", [], ["trl", "datasets"], 0, set(), None),
    ("trl_sft.py", ["--broken"], ["trl", "datasets"], 1, {"CAD018"}, None),
    ("accelerate_loop.py", [], ["accelerate", "transformers"], 0, set(), None),
    ("accelerate_loop.py", ["--broken"], ["accelerate", "transformers"], 1, {"CAD021"}, "0.50x"),
    ("lightning_loop.py", [], ["pytorch_lightning", "transformers"], 0, set(), None),
    ("lightning_loop.py", ["--broken"], ["pytorch_lightning", "transformers"], 1, {"CAD007"}, None),
    # Lightning divides every loss by accumulate_grad_batches, also in the window of 1 that ends an epoch of 9
    ("lightning_loop.py", ["--short"], ["pytorch_lightning", "transformers"], 1, {"CAD021"}, "0.50x"),
    ("cadence_loop.py", [], ["transformers"], 0, set(), None),
    # issue 52: TRL's preference trainers, the right way and the buggy way
    ("trl_preference.py", ["dpo"], ["trl", "datasets"], 0, set(), None),
    ("trl_preference.py", ["dpo", "--broken"], ["trl", "datasets"], 1, {"CAD025"}, "2.00x"),
    ("trl_preference.py", ["orpo"], ["trl", "datasets"], 0, set(), None),
    ("trl_preference.py", ["orpo", "--broken"], ["trl", "datasets"], 1, {"CAD026"}, None),
    ("trl_preference.py", ["kto"], ["trl", "datasets"], 0, set(), None),
    ("trl_preference.py", ["kto", "--broken"], ["trl", "datasets"], 1, {"CAD027"}, "2 micro-batches"),
]


@pytest.fixture(autouse=True)
def environment_restored():  # type: ignore[no-untyped-def]
    """The loops run in this process: what the libraries set in os.environ on import (TORCHINDUCTOR_CACHE_DIR, ...)
    must not reach the tests that run after them in the same worker."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def case_id(case: tuple) -> str:
    return Path(case[0]).stem + ("-" + "-".join(arg.strip("-") for arg in case[1]) if case[1] else "-correct")


@pytest.mark.filterwarnings("ignore")  # the libraries' own deprecation and CPU warnings
@pytest.mark.parametrize("case", CASES, ids=[case_id(case) for case in CASES])
def test_real_loop(case: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str]) -> None:
    script, args, needs, want_status, want_rules, measured = case
    for name in needs:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing downloads: the model and tokenizer are built in the script
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    argv = [str(LOOPS / script), *([str(tmp_path / "out")] if script not in ("accelerate_loop.py",
                                                                               "cadence_loop.py") else []), *args]
    status = run_script(["python", *argv], as_json=True, out=out)
    capsys.readouterr()
    report = json.loads(out.getvalue())
    found = {f["rule"] for f in report["findings"]}
    assert (status, found) == (want_status, want_rules), json.dumps(report["findings"], indent=1)
    for finding in report["findings"]:
        # the user's line first (the script: trainer.train(), accelerator.backward(loss), trainer.fit(...)), then
        # the library's frame that made the call
        assert Path(finding["file"]).resolve() == (LOOPS / script).resolve(), finding["where"]
        assert finding["via_file"] is not None and "site-packages" in finding["via_file"].split(os.sep), finding
        library = finding["where"].split(" via ")[1]  # as imported: accelerate/accelerator.py:2767
        assert library.split("/")[0] in {"accelerate", "transformers", "trl", "pytorch_lightning"}, finding["where"]
        if measured is not None:
            assert measured in finding["detail"], finding["detail"]
    print(f"{case_id(case)}: exit {status}, " + (", ".join(f"{f['rule']} {f['where']} {f['detail']}".strip()
                                                           for f in report["findings"]) or "no finding"))
