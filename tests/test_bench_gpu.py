"""`make bench-gpu`'s dry run (issue 16): benchmarks/gpu.py runs every section end to end on the CPU at tiny sizes, so
the GPU check cannot rot while no GPU runs it. The run is a subprocess, as a user starts it, with src/ on PYTHONPATH
as on the GPU machine. No timing is asserted: the figures a CPU computes must exist and be judged, and the ones whose
meaning does not depend on the hardware (memory, budgets, verify) must pass.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
SECTIONS = ("peak_flops", "paired_base", "paired_1b", "verify", "memory_estimate", "train_vs_engine", "compile", "plan",
            "auto_oom", "pytest_gpu")
# Judged on a CPU too (what they measure is there); compile is skipped in the dry run and the GPU tests skip.
CPU_JUDGED = ("speed", "mfu", "estimate", "plan", "verify_fp16", "verify_bf16", "auto_oom")
# ... and of those, the ones that hold whatever the machine's speed: memory, budgets and gradients, not timings.
MUST_PASS = ("estimate", "plan", "verify_fp16", "verify_bf16", "auto_oom")


def load_by_path(name: str) -> ModuleType:
    """A benchmarks/ script imported by path (benchmarks/ is not a package); sys.path is left as it was."""
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location(f"cadence_test_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]  (dataclasses look their module up)
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.path[:] = saved
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    out = tmp_path_factory.mktemp("bench-gpu") / "gpu.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    yield json.loads(out.read_text())


@pytest.mark.slow
def test_dry_run_runs_every_section_and_judges_what_a_cpu_can(dry_run: dict) -> None:
    assert dry_run["dry_run"] is True and dry_run["device"] == "cpu"
    assert tuple(dry_run["sections"]) == SECTIONS
    for name, entry in dry_run["sections"].items():
        assert entry["status"] in ("ok", "skipped"), (name, entry.get("error"), entry.get("traceback"))
        assert entry.get("results") or entry.get("reason"), name
    assert "dry run" in dry_run["sections"]["compile"]["reason"]
    judged = {item["id"]: item for item in dry_run["acceptance"]}
    for key in CPU_JUDGED:
        assert judged[key]["value"] is not None and judged[key]["passed"] is not None, judged[key]
    for key in MUST_PASS:
        assert judged[key]["passed"] is True, judged[key]
    assert judged["compile"]["passed"] is None and "dry run" in judged["compile"]["why"]
    results = {name: entry.get("results") for name, entry in dry_run["sections"].items()}
    paired = results["paired_base"]["implementations"]
    assert {"plain", "cadence"} <= set(paired)
    missing = set(results["paired_base"]["not_run"])  # Accelerate / Fabric: run when installed, else said why
    assert set(paired) | missing == {"plain", "cadence", "accelerate", "fabric"}
    assert results["paired_1b"]["mfu"] > 0
    estimate = results["memory_estimate"]["rows"]
    assert {(r["precision"], r["recompute"], r["grad_accum_steps"]) for r in estimate} == {
        (p, r, a) for p in ("fp32", "bf16") for r in ("none", "selective", "full") for a in (1, 4)}
    assert results["auto_oom"]["oom_retries"] >= 1
    assert results["train_vs_engine"]["ratio"] > 0
    assert results["pytest_gpu"]["counts"].get("failed", 0) == 0


@pytest.mark.slow
def test_dry_run_is_never_shown_as_gpu_results(dry_run: dict, tmp_path: Path) -> None:
    report = load_by_path("write_report")
    (tmp_path / "gpu_quick.json").write_text(json.dumps(dry_run))  # where the dry run writes by default
    assert "issue 16" not in report.render(tmp_path)
    (tmp_path / "gpu.json").write_text(json.dumps(dry_run))  # even under the GPU run's name
    text = report.render(tmp_path)
    assert "is a dry run" in text and "| paired_base |" not in text
    # The same JSON as a GPU run would write it renders every figure, judged.
    real = {**dry_run, "dry_run": False, "gpu": "NVIDIA test device (x1)"}
    (tmp_path / "gpu.json").write_text(json.dumps(real))
    text = report.render(tmp_path)
    for item in real["acceptance"]:
        state = "not judged" if item["passed"] is None else "met" if item["passed"] else "NOT met"
        assert f"- {item['target']}: **{state}**." in text
    assert "| paired_base | ok |" in text and "| compile | skipped |" in text


def test_a_broken_section_is_recorded_and_the_rest_still_runs(tmp_path: Path) -> None:
    gpu = load_by_path("gpu")
    out = tmp_path / "gpu.json"
    seen: list[str] = []

    def broken(ctx: object) -> dict:
        raise RuntimeError("boom")

    def after(ctx: object) -> dict:
        seen.append(json.loads(out.read_text())["sections"]["broken"]["status"])  # written before this one ran
        return {"figure": 1.0}

    def dependent(ctx: object) -> dict:
        return ctx.results("broken")  # type: ignore[attr-defined]

    sizes = dataclasses.replace(gpu.DRY, expected_s={"late": 10.0**6})
    ctx = gpu.Context(sizes=sizes, device=torch.device("cpu"), dry_run=True, work=tmp_path, budget_s=600.0,
                      with_compile=False)
    document: dict = {"sections": {}}
    gpu.run_sections(ctx, (gpu.Section("broken", "raises", broken), gpu.Section("after", "fine", after),
                           gpu.Section("dependent", "needs broken", dependent),
                           gpu.Section("late", "does not fit", after)), document, out)
    saved = json.loads(out.read_text())["sections"]
    assert seen == ["error"]
    assert saved["broken"]["status"] == "error" and "RuntimeError: boom" in saved["broken"]["error"]
    assert saved["after"] == {**saved["after"], "status": "ok", "results": {"figure": 1.0}}
    assert saved["dependent"]["status"] == "skipped" and "needs section broken" in saved["dependent"]["reason"]
    assert saved["late"]["status"] == "skipped" and "time budget" in saved["late"]["reason"]
    # A dry run never takes the GPU run's file.
    assert gpu.main(["--dry-run", "--out", str(ROOT / "benchmarks" / "results" / "gpu.json")]) == 2
