"""Benchmark (issue 52 item 3): the peak memory of a full fine-tuning's DPO reference as a frozen copy of the starting
weights (``--reference-logprobs live``) against its log-probabilities precomputed before training
(``--reference-logprobs precomputed``: no reference model in memory while training), and what the pass costs.

`cadence train --objective dpo` (full fine-tuning) of a llama of about 30M parameters whose tokenizer has no merges,
16 preference pairs of uneven lengths, 3 steps of 2 x 2 pairs at sequences up to 128 tokens, fp32 on CPU, each run in
a process of its own: live; precomputed with an empty token-store cache (the pass runs before step 1, its file is
written beside the token store); precomputed again on the same cache (the file is found: nothing is scored). Peak:
the steps' peak from summary.json (the profiler's allocation replay on CPU, a frozen copy's weights counted as live);
RSS: the process's peak resident memory; wall: the whole command. The LoRA reference (the base with the adapters off)
against a frozen copy is measured by benchmarks/preference_accumulation.py.

    .venv/bin/python benchmarks/reference_modes.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_env import environment, write_results
from preference_accumulation import byte_llama, rows

RUNS = (("live", "live", "cache-live"), ("precomputed (the pass)", "precomputed", "cache-precomputed"),
        ("precomputed (found)", "precomputed", "cache-precomputed"))


def run(work: Path, base: Path, data: Path, name: str, mode: str, cache: str) -> dict[str, Any]:
    out = work / name.replace(" ", "-").replace("(", "").replace(")", "")
    started = time.perf_counter()
    # A process of its own: its peak RSS is this run's alone.
    result = subprocess.run([sys.executable, "-m", "cadence", "train", "--model", str(base), "--data", str(data),
                             "--data-cache", str(work / cache), "--objective", "dpo", "--reference-logprobs", mode,
                             "--seq-len", "128", "--micro-batch-size", "2", "--grad-accum-steps", "2",
                             "--max-steps", "3", "--out", str(out)], check=True, capture_output=True, text=True)
    wall = time.perf_counter() - started
    summary = json.loads((out / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    said = next((line for line in (result.stdout + result.stderr).splitlines() if line.startswith("objective:")), "")
    return {"peak_memory_bytes": summary["peak_memory_bytes"], "max_rss_bytes": summary["max_rss_bytes"],
            "losses": losses, "wall_s": wall, "objective": said}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = byte_llama(work / "base", hidden=64 if args.quick else 384, layers=2 if args.quick else 6)
        data = work / "pairs.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows("dpo", 16)))
        found = {name: run(work, base, data, name, mode, cache) for name, mode, cache in RUNS}
        for name, measured in found.items():
            print(name, measured, flush=True)
        from transformers import AutoModelForCausalLM

        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(base).parameters())
    output = {"environment": environment(("transformers",)), "parameters": parameters, "runs": found,
              "load_average": os.getloadavg()}
    write_results("reference_modes", output, quick=args.quick)


if __name__ == "__main__":
    main()
