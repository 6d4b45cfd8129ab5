"""Benchmark (issue 38, item 5): the summed peak host memory of 2 FSDP2 ranks loading a ~100M-parameter llama
directory, before (every rank ``from_pretrained`` the whole model in fp32, then FSDP2 keeps its half) and after (the
model built on the meta device, each rank reading only its own rows from the safetensors).

A llama of 106M parameters (width 768, 8 layers, MLP 2048, vocabulary 32,000, untied head) is saved in bf16, as real
checkpoints are. Each variant runs under ``torchrun --standalone --nproc-per-node 2`` (gloo, CPU): every rank calls
cadence's own ``prepare`` and ``build_components`` (what ``cadence train`` does before its first step), then reports
its ``VmHWM`` (the kernel's high-water mark of its resident memory) and the ``VmRSS`` it had just before the model
was built (the imports and the data; the same for both). "before" runs the source tree of an earlier commit
(``git archive COMMIT src``, by default the main commit before this change), "after" this tree. Variants alternate
over ``--rounds``; medians are reported.

    .venv/bin/python benchmarks/load_once.py [--before-commit a8437a3] [--rounds 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BEFORE_COMMIT = "a8437a3"
"""main before the load-once change: every FSDP2 rank reads the whole model with from_pretrained."""


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(model: Path, data: Path, out: Path, report: Path) -> None:
    """One rank: cadence's setup of an FSDP2 run on ``model`` (whichever cadence is on the path), then its memory."""
    from cadence.config import TrainConfig
    from cadence.distributed.ranks import start, stop
    from cadence.training.components import build_components
    from cadence.training.prepare import load_run_data, prepare

    ranks = start(device_type="cpu", strategy="fsdp", sync_every_micro_step=False, timeout_s=600)
    config = TrainConfig(model=str(model), data=data, seq_len=32, val_fraction=0.0, strategy="fsdp", out=out,
                         micro_batch_size=1, grad_accum_steps=1, too_long="truncate")
    load_run_data(config, 32, None, ranks=ranks)  # the store built and opened before the baseline is read
    baseline = status_kib("VmRSS")
    started = time.perf_counter()
    parts = build_components(prepare(config, ranks=ranks, out=out))
    seconds = time.perf_counter() - started
    held = sum(param.to_local().numel() if hasattr(param, "to_local") else param.numel()
               for param in parts.model.parameters())
    report.with_name(f"{report.name}.rank-{ranks.rank}.json").write_text(json.dumps({
        "rank": ranks.rank, "hwm_kib": status_kib("VmHWM"), "rss_before_model_kib": baseline,
        "rss_after_kib": status_kib("VmRSS"), "seconds": seconds, "parameters_held": held}))
    stop(ranks)


def make_model(directory: Path, *, quick: bool) -> int:
    import torch
    import transformers

    sizes = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=8000) if quick else \
        dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, vocab_size=32000)
    config = transformers.LlamaConfig(num_attention_heads=12 if not quick else 4, num_key_value_heads=4,
                                      max_position_embeddings=128, tie_word_embeddings=False, **sizes)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    count = sum(param.numel() for param in model.parameters())
    model.to(torch.bfloat16).save_pretrained(str(directory))
    return count


def source_tree(commit: str, into: Path) -> Path:
    """``src/`` of ``commit``, unpacked (read from the git objects; nothing is checked out)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "src.tar"
    with open(archive, "wb") as handle:
        subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], stdout=handle, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_variant(src: Path, model: Path, data: Path, root: Path, name: str) -> dict:
    report = root / name
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).resolve()), "--worker", str(model), str(data), str(root / f"run-{name}"),
               str(report)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    ranks = [json.loads(report.with_name(f"{report.name}.rank-{rank}.json").read_text()) for rank in range(2)]
    return {"ranks": ranks, "summed_hwm_kib": sum(rank["hwm_kib"] for rank in ranks),
            "summed_rss_before_model_kib": sum(rank["rss_before_model_kib"] for rank in ranks),
            "seconds": max(rank["seconds"] for rank in ranks)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*(Path(arg) for arg in sys.argv[2:6]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-commit", default=BEFORE_COMMIT)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a 5M-parameter model (a smoke run)")
    options = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from bench_env import environment, write_results

    load_before = os.getloadavg()[0]
    found: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        parameters = make_model(root / "llama", quick=options.quick)
        model_bytes = sum(path.stat().st_size for path in (root / "llama").glob("*.safetensors"))
        data = root / "data.txt"
        data.write_text("The quick brown fox jumps over the lazy dog. " * 400)
        trees = {"before": source_tree(options.before_commit, root / "before"), "after": ROOT / "src"}
        for round_index in range(options.rounds):
            for name in ("before", "after") if round_index % 2 == 0 else ("after", "before"):
                found[name].append(run_variant(trees[name], root / "llama", data, root, f"{name}-{round_index}"))
                print(name, json.dumps(found[name][-1]), flush=True)
    results = {name: {"summed_hwm_mib": statistics.median(run["summed_hwm_kib"] for run in runs) / 1024,
                      "summed_rss_before_model_mib":
                          statistics.median(run["summed_rss_before_model_kib"] for run in runs) / 1024,
                      "seconds": statistics.median(run["seconds"] for run in runs), "runs": runs}
               for name, runs in found.items()}
    write_results("load_once", {
        "environment": environment(("transformers",)), "parameters": parameters, "fp32_model_mib": parameters * 4 / 2**20,
        "file_mib": model_bytes / 2**20, "before_commit": options.before_commit, "rounds": options.rounds,
        "results": results, "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
    }, quick=options.quick)


if __name__ == "__main__":
    main()
