"""Write BENCHMARKS.md from the JSON the benchmark scripts leave in benchmarks/results/ (issue 9).

`make bench` runs the benchmarks and then this script, so BENCHMARKS.md always shows the numbers on disk: the machine
and versions each result recorded, the targets of issue 9 judged from the overhead JSON, and one section per
benchmark with its reproduce command, tables and plots. A result whose JSON is missing gets a section that says so
and names the command that produces it. The markdown depends on the JSON only (same JSON, byte-identical output), so
``tests/test_benchmarks_report.py`` can check that the checked-in BENCHMARKS.md is neither hand-edited nor stale.

    .venv/bin/python benchmarks/write_report.py [--results benchmarks/results] [--out BENCHMARKS.md] [--check]

``*_quick.json`` files (from `make bench-quick`) are never shown: quick numbers must not pass for the real ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
OUTPUT = HERE.parent / "BENCHMARKS.md"
OVERHEAD_PLOT = "overhead_ratios.png"


def _load_sibling(name: str) -> types.ModuleType:
    """Import ``benchmarks/<name>.py`` by path: benchmarks/ is not a package, and the test imports this file by path."""
    spec = importlib.util.spec_from_file_location(f"_cadence_bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


sections = _load_sibling("report_sections")


@dataclass(frozen=True)
class Section:
    """One benchmark: its JSON file, heading, the command that produces the JSON, and its renderer."""

    file: str
    title: str
    command: str
    render: Callable[[dict], list[str]]
    uses: tuple[str, ...] = ()  # libraries besides torch whose versions matter to the numbers
    in_make_bench: bool = False  # refreshed by every `make bench`; the others only by their own command
    optional: bool = False  # left out of BENCHMARKS.md altogether (no "missing" row or section) while its JSON is absent

    def reproduce(self) -> str:
        return f"`{self.command}`" + (" (part of `make bench`)" if self.in_make_bench else "")


SECTIONS = (
    Section("overhead.json", "The engine against a hand-written loop, Accelerate and Lightning Fabric",
            ".venv/bin/python benchmarks/overhead.py", sections.render_overhead, ("accelerate", "lightning"), True),
    Section("memory_and_modes.json", "Memory flatness, recompute and offload costs, MFU",
            ".venv/bin/python benchmarks/memory_and_modes.py", sections.render_memory_and_modes, in_make_bench=True),
    Section("memory_estimate.json", "Memory estimate against measurement",
            ".venv/bin/python benchmarks/memory_estimate.py", sections.render_memory_estimate, in_make_bench=True),
    Section("memory_estimate_hf.json", "Memory estimate of transformers models: every cut and recompute mode (issue 28)",
            ".venv/bin/python benchmarks/memory_estimate_hf.py", sections.render_memory_estimate_hf, ("transformers",),
            optional=True),
    Section("plan_vs_sweep.json", "cadence plan against an exhaustive sweep",
            ".venv/bin/python benchmarks/plan_vs_sweep.py --budget 64MiB --effective-batch-size 32",
            sections.render_plan_vs_sweep),
    Section("plan_time.json", "The plan's time on issue 54's case: before and after the estimate's trust and the rounds",
            ".venv/bin/python benchmarks/plan_time.py --label after (and --label before --cadence OTHER/cadence)",
            sections.render_plan_time, optional=True),
    Section("plan_prediction.json", "Does a plan predict its training? Quiet and beside a CPU-bound process (issue 28)",
            ".venv/bin/python benchmarks/plan_prediction.py", sections.render_plan_prediction,
            optional=True),
    Section("plan_prediction_loaded.json", "Three plans beside a CPU-bound process: the same decision, or a tie stated? "
            "(issue 43)",
            ".venv/bin/python benchmarks/plan_prediction.py --model gpt-tiny --seq-len 128 --batch 16 --budget 160MiB "
            "--time-budget 60 --train-steps 10 --conditions loaded loaded loaded --result "
            "plan_prediction_loaded.json", sections.render_plan_prediction, optional=True),
    Section("plan_prediction_heavy.json", "Three plans beside eight CPU-bound processes on two cores: does the "
            "--time-budget bound the command? (issue 43)",
            ".venv/bin/python benchmarks/plan_prediction.py --model gpt-tiny --seq-len 128 --batch 16 --budget 160MiB "
            "--time-budget 60 --train-steps 10 --conditions loaded loaded loaded --burners 8 --result "
            "plan_prediction_heavy.json", sections.render_plan_prediction, optional=True),
    Section("phase_overhead.json", "Cost of the phase annotations when profiling is off",
            ".venv/bin/python benchmarks/phase_overhead.py", sections.render_phase_overhead),
    Section("audit_overhead.json", "Cost of `cadence audit` on a correct loop",
            ".venv/bin/python benchmarks/audit_overhead.py", sections.render_audit_overhead,
            uses=("accelerate", "lightning")),
    Section("noise_scale.json", "The gradient noise scale: its cost per optimizer step (issue 27)",
            ".venv/bin/python benchmarks/noise_scale.py", sections.render_noise_scale),
    Section("data_store.json", "Data at scale: memory and start-up against the size of the data (issue 14)",
            "make bench-data", lambda data: render_data_store(data), optional=True),  # defined further down
    Section("padding.json", "Padding: length-aware micro-batches against the padded baseline (issue 15)",
            ".venv/bin/python benchmarks/padding.py", lambda data: render_padding(data), optional=True),
    Section("packing_hf.json", "Packing on a transformers model: before and after per-example attention (issue 30)",
            ".venv/bin/python benchmarks/packing_hf.py", sections.render_packing_hf, ("transformers",), optional=True),
    Section("input_overlap.json", "Input that overlaps compute: --prefetch-windows on a slow dataset (issue 16)",
            ".venv/bin/python benchmarks/input_overlap.py", lambda data: render_input_overlap(data), optional=True),
    Section("compile.json", "torch.compile: --compile against eager on this machine (issue 16)",
            ".venv/bin/python benchmarks/compile.py", lambda data: render_compile(data), optional=True),
    Section("loss_chunking.json", "Chunked LM head and loss: --loss-chunk-tokens (issue 26)",
            ".venv/bin/python benchmarks/loss_chunking.py", lambda data: render_loss_chunking(data), ("transformers",),
            optional=True),
    Section("targets_only_head.json", "Targets only through the LM head: the default loss on chat data (issue 37)",
            ".venv/bin/python benchmarks/targets_only_head.py", sections.render_targets_only_head, ("transformers",),
            optional=True),
    Section("optimizer_state.json", "Smaller optimizer state and LoRA: --optimizer-state, --lora-rank (issue 26)",
            ".venv/bin/python benchmarks/optimizer_state.py", lambda data: render_optimizer_state(data),
            ("transformers", "peft", "bitsandbytes"), optional=True),
    Section("qlora.json", "QLoRA: an 8B model on a 24 GB GPU with a 4-bit base, --lora-base-precision nf4 (issue 39)",
            ".venv/bin/python benchmarks/qlora.py", lambda data: render_qlora(data),
            uses=("transformers", "peft", "bitsandbytes"), optional=True),
    Section("estimate_1b.json", "A 1B model on a 24 GB GPU: the estimate before and after the memory levers (issue 26)",
            ".venv/bin/python benchmarks/estimate_1b.py", lambda data: render_estimate_1b(data),
            ("transformers", "peft"), optional=True),
    Section("preference_accumulation.json", "Preference tuning under accumulation: TRL's gradient and cadence's "
            "against one big batch; the LoRA reference against a frozen copy (issue 52)",
            ".venv/bin/python benchmarks/preference_accumulation.py", sections.render_preference_accumulation,
            ("transformers", "trl", "peft"), optional=True),
    Section("reference_modes.json", "The DPO reference in full fine-tuning: a frozen copy against precomputed "
            "log-probabilities, --reference-logprobs (issue 52)", ".venv/bin/python benchmarks/reference_modes.py",
            sections.render_reference_modes, ("transformers",), optional=True),
    Section("adaptive_batch.json", "The adaptive effective batch: steps and tokens to a validation loss against "
            "fixed batches (issue 53)", ".venv/bin/python benchmarks/adaptive_batch.py",
            sections.render_adaptive_batch, optional=True),
    Section("noise_geometry.json", "The noise scale's geometry for AdamW: plain against preconditioned, as "
            "predictors of the critical batch measured by branching (issue 53)",
            ".venv/bin/python benchmarks/noise_geometry.py", sections.render_noise_geometry, optional=True),
    Section("checkpoint_async.json", "Checkpoints in the background: --async-checkpoint (issue 38)",
            ".venv/bin/python benchmarks/checkpoint_async.py", sections.render_checkpoint_async, optional=True),
    # Shown only once a GPU run left gpu.json: the dry run writes gpu_quick.json, which is never shown.
    Section("gpu.json", "GPU: the CUDA path on one device (issue 16)", "make bench-gpu", sections.render_gpu,
            ("accelerate", "lightning"), optional=True),
    Section("openmp_wait.json", "CPU training on a shared machine: OpenMP's busy wait against a passive one (a small "
            "--data was 10-40x slower)", ".venv/bin/python benchmarks/openmp_wait.py", sections.render_openmp_wait,
            optional=True),
    Section("cli_help.json", "`cadence --help` without torch: time to answer (issue 41)",
            ".venv/bin/python benchmarks/cli_help.py", sections.render_cli_help, optional=True),
    Section("demo.json", "The demo", "make demo && .venv/bin/python benchmarks/record_demo.py", sections.render_demo),
    Section("demo_load.json", "The demo on a busy CPU: quiet and beside one CPU-bound process (issue 41)",
            ".venv/bin/python benchmarks/demo_load.py", sections.render_demo_load, optional=True),
    Section("load_once.json", "Pretrained weights loaded once under FSDP2: summed peak host memory of 2 ranks "
                              "(issue 38)",
            ".venv/bin/python benchmarks/load_once.py", sections.render_load_once, ("transformers",), optional=True),
    # Issue 51: the optimizers.
    Section("optimizers.json", "Optimizers: step time, state and validation loss against AdamW; Muon's clipping "
            "(issue 51)", ".venv/bin/python benchmarks/optimizers.py", sections.render_optimizers, ("transformers",),
            optional=True),
    Section("memory_estimate_optimizers.json", "Memory estimate of every optimizer against measurement (issue 51)",
            ".venv/bin/python benchmarks/memory_estimate_optimizers.py", sections.render_memory_estimate_optimizers,
            ("transformers",), optional=True),
)
VERSION_COLUMNS = ("python", "torch", "cadence", "accelerate", "lightning")
# Shown only while some result predates machine recording: the earlier hand-written BENCHMARKS.md's description of
# the development machine, quoted as such so a reader still learns what those numbers ran on.
LEGACY_MACHINE = ("AMD EPYC (x86_64, avx512_bf16), 2 cores, 24 GiB, no GPU; Python 3.11.7, torch 2.13.0+cpu")


def load_results(results: Path) -> dict[str, dict]:
    """Every JSON in ``results`` by file name, quick runs left out; unknown ones are reported on stderr, not shown."""
    known = {section.file for section in SECTIONS}
    loaded = {}
    for path in sorted(results.glob("*.json")):
        if path.name.endswith("_quick.json"):
            continue
        if path.name not in known:
            print(f"write_report: {path.name} has no section in BENCHMARKS.md; not shown", file=sys.stderr)
            continue
        loaded[path.name] = json.loads(path.read_text())
    return loaded


def recorded_versions(data: dict) -> dict[str, str | None]:
    """Versions from ``environment`` (current scripts) or the top-level / ``versions`` keys older JSON used."""
    env = data.get("environment", {}).get("versions", {})
    old = {**data.get("versions", {}), **{k: data[k] for k in VERSION_COLUMNS if isinstance(data.get(k), str)}}
    return {name: env.get(name, old.get(name)) for name in VERSION_COLUMNS}


def describe_machine(data: dict) -> str:
    """The machine in words from what the JSON recorded; the parts it did not record are named as such."""
    env = data.get("environment")
    if env is None:
        recorded = data.get("machine")
        prefix = f"{recorded}; " if recorded else ""
        return f"{prefix}CPU model, memory and GPU not recorded"
    arch = env.get("arch")
    if env.get("cpu_bf16") == "emulated":
        arch = f"{arch}, no bf16 instructions"
    elif env.get("cpu_bf16") == "native":
        arch = f"{arch}, bf16 instructions"
    parts = [f"{env.get('cpu_model') or 'CPU model not recorded'} ({arch})"]
    cores = f"{env['cpu_count']} cores" if env.get("cpu_count") else "cores not recorded"
    if env.get("torch_threads"):
        cores += f" ({env['torch_threads']} torch thread{'s' if env['torch_threads'] > 1 else ''})"
    parts.append(cores)
    total, limit = env.get("memory_total_bytes"), env.get("memory_limit_bytes")
    memory = f"{total / 2**30:.1f} GiB" if total else "memory not recorded"
    if limit and (not total or limit < total):
        memory += f" (cgroup limit {limit / 2**30:.1f} GiB)"
    parts.append(memory)
    parts.append(f"GPU {env['gpu']}" if env.get("gpu") else "no GPU")
    return ", ".join(parts)


def measured_at(data: dict) -> str:
    stamp = data.get("environment", {}).get("measured_at")
    return stamp.replace("T", " ").replace("Z", " UTC") if stamp else "not recorded"


def render_header(results: dict[str, dict]) -> list[str]:
    lines = ["# Benchmarks", "",
             "<!-- Generated by benchmarks/write_report.py from benchmarks/results/*.json: do not edit by hand. -->", ""]
    lines += sections.para(
        "Written by `benchmarks/write_report.py` from the JSON in `benchmarks/results/`. `make bench` reruns the "
        "overhead, memory and estimate benchmarks and then rewrites this file; the other sections name the command "
        "that refreshes their JSON (then run `.venv/bin/python benchmarks/write_report.py`). Numbers are from one run "
        "each unless stated; the commands reproduce them.")
    lines += ["## Targets (issue 9)", ""] + render_targets(results.get("overhead.json")) + [""]
    lines += ["## Machine and versions", ""]
    lines += sections.para("As each result recorded them; \"not recorded\" marks results measured before the "
                           "scripts recorded it, and n/a a library the benchmark does not use.")
    rows = []
    for section in SECTIONS:
        data = results.get(section.file)
        if data is None and section.optional:
            continue
        if data is None:
            rows.append([f"`{section.file}`", "missing"] + [""] * (1 + len(VERSION_COLUMNS)))
            continue
        versions = recorded_versions(data)
        cells = [versions[name] or ("n/a" if name in ("accelerate", "lightning") and name not in section.uses
                                    else "not recorded") for name in VERSION_COLUMNS]
        rows.append([f"`{section.file}`", measured_at(data), describe_machine(data)] + cells)
    lines += sections.table(["result", "measured", "machine", "Python", "torch", "cadence", "accelerate", "lightning"],
                            rows)
    if any("environment" not in data for data in results.values()):
        lines += sections.para("The earlier hand-written BENCHMARKS.md described the development machine those older "
                               f"results ran on as: {LEGACY_MACHINE}.")
    return lines


def render_targets(data: dict | None) -> list[str]:
    """One line per target of issue 9, judged from the overhead JSON: met / NOT met, with the figures."""
    speed = f"cadence >= {sections.SPEED_TARGET} x the hand-written loop's tokens/s (median of paired runs)"
    memory = f"peak memory within {sections.MEMORY_TARGET:.0%} of it"
    if data is None:
        missing = "not measured (`benchmarks/results/overhead.json` is missing; run `make bench`)"
        return [f"- {speed}: {missing}", f"- {memory}: {missing}"]
    judged = sections.overhead_targets(data)
    speed_all = all(t["speed_met"] for t in judged.values())
    memory_all = all(t["memory_met"] for t in judged.values())
    speed_figures = "; ".join(f"{p} {t['ratio']:.3f} ({sections.verdict(t['speed_met'])})" for p, t in judged.items())
    memory_figures = "; ".join(
        f"{p} {sections.mib(t['peak'])} vs {sections.mib(t['plain_peak'])} MiB "
        + (f"({t['memory']:+.2%}, {sections.verdict(t['memory_met'])})" if t["memory"] is not None else "(NOT met)")
        for p, t in judged.items())
    return [f"- {speed}: **{sections.verdict(speed_all)}**. {speed_figures}; each the median of {data['rounds']} "
            "paired rounds.",
            f"- {memory}: **{sections.verdict(memory_all)}**. {memory_figures}."]


def render(results_dir: Path = RESULTS) -> str:
    """The whole BENCHMARKS.md for the JSON in ``results_dir``."""
    results = load_results(results_dir)
    lines = render_header(results)
    for section in SECTIONS:
        data = results.get(section.file)
        if data is None and section.optional:
            continue
        lines += [f"## {section.title}", ""]
        if data is None:
            lines += sections.para(f"Not measured: `benchmarks/results/{section.file}` is missing. Produce it with "
                                   f"{section.reproduce()}, then run `.venv/bin/python benchmarks/write_report.py`.")
            continue
        lines += sections.para(f"Reproduce: {section.reproduce()}. Raw: `benchmarks/results/{section.file}`. "
                               f"Measured: {measured_at(data)}.")
        lines += section.render(data)
    return "\n".join(lines).rstrip("\n") + "\n"


# ---------------------------------------------------------------------------------------- data store (issue 14)

DATA_TOLERANCE = 300 * sections.MiB  # issue 14: peak RSS within 300 MB of the same run on the small input
DATA_STARTUP_S = 3.0  # issue 14: the 200k-example JSONL's second start-up (store cached) under 3 s to the first step
DATA_RANKS = 1.3  # issue 14: two ranks' summed RSS grows by less than 1.3x the one-process run's growth
DATA_NOISE = 50 * sections.MiB  # a one-process growth under this is noise: two ranks are judged against this floor
RUNS = ("first", "second")


def _mb(value: float | None, sign: bool = False) -> str:
    """MB (2**20 bytes, as benchmarks/data_store.py counts them) with thousands separators."""
    return "-" if value is None else f"{value / sections.MiB:{'+' if sign else ''},.0f}"


def _size(value: int | None) -> str:
    """An input's size in MB: one decimal below 10 MB, so that a small input does not read as 0."""
    return "-" if value is None else f"{value / sections.MiB:,.1f}" if value < 10 * sections.MiB else _mb(value)


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _measured(entry: dict | None, which: str) -> dict | None:
    """The run ``which`` of a case when it ran and succeeded; None when skipped or failed."""
    run = (entry or {}).get(which)
    return run if run is not None and "error" not in run else None


def _growth(entry: dict | None, base: dict | None, which: str, key: str = "peak_rss_bytes") -> int | None:
    run, ref = _measured(entry, which), _measured(base, which)
    return None if run is None or ref is None else run[key] - ref[key]


def _why_not(entry: dict | None) -> str:
    if entry is None:
        return "not in the JSON"
    if "skipped" in entry:
        return entry["skipped"]
    failed = [f"{w} run: {entry[w]['error']}" for w in RUNS if w in entry and "error" in entry[w]]
    return "; ".join(failed) or "not measured"


def data_store_targets(data: dict) -> list[tuple[str, bool | None, str]]:
    """Issue 14's targets judged from data_store.json: (target, met / not met / None when not judged, figures).

    The inputs are compared with the first (smallest) of their kind in the JSON, so a --quick JSON is judged on its
    own sizes; each target must hold for the first run (empty --data-cache, building the store) and the second.
    """
    judged: list[tuple[str, bool | None, str]] = []
    tolerance = _mb(DATA_TOLERANCE)
    text = data.get("text", [])
    for entry in text[1:]:
        target = f"{entry['label']} text: peak RSS within {tolerance} MB of the {text[0]['label']} run"
        growths = {w: _growth(entry, text[0], w) for w in RUNS}
        if any(g is None for g in growths.values()):
            missing = entry if any(_measured(entry, w) is None for w in RUNS) else text[0]
            judged.append((target, None, f"not measured: {_why_not(missing)}"))
            continue
        figures = "; ".join(
            f"{w} {_mb(g, True)} MB ({_mb(entry[w]['peak_rss_bytes'])} vs {_mb(text[0][w]['peak_rss_bytes'])} MB; "
            f"PSS {_mb(_growth(entry, text[0], w, 'peak_pss_bytes'), True)} MB)" for w, g in growths.items())
        judged.append((target, all(g <= DATA_TOLERANCE for g in growths.values()), figures))
    jsonl = data.get("jsonl", [])
    if len(jsonl) > 1:
        base, large = jsonl[0], jsonl[-1]
        second = _measured(large, "second")
        target = f"{large['label']}-example JSONL: second start-up under {DATA_STARTUP_S:g} s to the first step"
        if second is None or second.get("first_step_s") is None:
            judged.append((target, None, f"not measured: {_why_not(large)}"))
        else:
            first = _measured(large, "first") or {}
            judged.append((target, second["first_step_s"] < DATA_STARTUP_S,
                           f"{_secs(second['first_step_s'])} s (first run {_secs(first.get('first_step_s'))} s; "
                           f"{base['label']} examples: {_secs((_measured(base, 'second') or {}).get('first_step_s'))} "
                           "s)"))
        target = f"{large['label']}-example JSONL: peak RSS within {tolerance} MB of {base['label']} examples"
        growths = {w: _growth(large, base, w) for w in RUNS}
        if any(g is None for g in growths.values()):
            judged.append((target, None, f"not measured: {_why_not(large)}"))
        else:
            figures = "; ".join(f"{w} {_mb(g, True)} MB (PSS {_mb(_growth(large, base, w, 'peak_pss_bytes'), True)} "
                                "MB)" for w, g in growths.items())
            judged.append((target, all(g <= DATA_TOLERANCE for g in growths.values()), figures))
    ranks = data.get("ranks", {})
    runs = ranks.get("runs", [])
    processes = ranks.get("processes", 2)
    target = (f"{processes} ranks: summed RSS grows by less than {DATA_RANKS:g}x the one-process growth "
              f"(growth under {_mb(DATA_NOISE)} MB counts as {_mb(DATA_NOISE)} MB)")
    by_label = {entry["label"]: entry for entry in text}
    if len(runs) < 2:
        judged.append((target, None, f"not measured: {ranks.get('skipped', 'not in the JSON')}"))
    else:
        base, large = runs[0], runs[-1]
        one_base, one_large = by_label.get(base["label"]), by_label.get(large["label"])
        figures, met = [], True
        for w in RUNS:
            many, one = _growth(large, base, w), _growth(one_large, one_base, w)
            if many is None or one is None:
                figures, met = [f"not measured: {_why_not(large if many is None else one_large)}"], None
                break
            many_pss, one_pss = _growth(large, base, w, "peak_pss_bytes"), _growth(one_large, one_base, w,
                                                                                   "peak_pss_bytes")
            # Judged (and shown) against the floored one-process growth: the ratio of two growths of a few MB each
            # is noise (it even comes out negative), not a measure of sharing.
            ratio = f"{many / max(one, DATA_NOISE):.2f}x of max(one-process growth, {_mb(DATA_NOISE)} MB)"
            pss_ratio = f"{many_pss / max(one_pss, DATA_NOISE):.2f}x" if one_pss is not None else "n/a"
            figures.append(f"{w} {ratio} ({large['label']} over {base['label']}: {processes} ranks "
                           f"{_mb(many, True)} MB, one process {_mb(one, True)} MB; PSS {pss_ratio})")
            met = met and many < DATA_RANKS * max(one, DATA_NOISE)
        judged.append((target, met, "; ".join(figures)))
    prepare = data.get("prepare_data", {})
    target = "Tokenisation throughput of `cadence prepare-data`, first build vs cached"
    if "skipped" in prepare or not prepare.get("runs"):
        judged.append((target, None, f"not measured: {prepare.get('skipped', 'not in the JSON')}"))
    else:
        figures = []
        for entry in prepare["runs"]:
            rates = [f"{(_measured(entry, w) or {}).get('mb_per_s', '-')} MB/s {w}" for w in RUNS]
            size = "" if entry["label"].endswith(" text") else f" ({_size(entry.get('bytes'))} MB)"
            figures.append(f"{entry['label']}{size}: {', '.join(rates)}")
        judged.append((target, None, "reported (no threshold): " + "; ".join(figures) + "; wall time including the "
                       f"command's start-up ({_secs(prepare.get('help_s'))} s for `prepare-data --help`)"))
    return judged


def render_padding(data: dict) -> list[str]:
    """Issue 15's benchmark: real tokens/s, real-token share, peak memory and loss agreement per cut, per precision."""
    schedule = "; ".join(f"{precision} {plan['rounds']} rounds of {plan['steps_per_round']} timed step"
                         f"{'s' if plan['steps_per_round'] > 1 else ''}"
                         for precision, plan in data.get("schedule", {}).items())
    lines = sections.para(
        f"{data['model']} (its shape, with a position table of {data['seq_len']}), seq {data['seq_len']}, micro "
        f"{data['micro_batch_size']} x accum {data['grad_accum_steps']}, {data['examples']} prompt/completion "
        f"examples of the issue's length spread (gamma-distributed, mean {data.get('mean_length', 0):.0f} tokens, "
        f"longest 930); the same windows cut four ways, each with its own model from the same seed, alternating "
        f"rounds ({schedule}); median tokens/s of real tokens. The token budget (also used to cut packed rows) is "
        f"{data.get('micro_batch_tokens', 0):,} positions, micro x the longest example: the baseline's own worst "
        "case. Packed rows attend example by example (causal kernel per example, no T x T mask). Targets (issue 15): "
        "sorted >= 1.4x, packing >= 1.7x, peak memory not above the baseline.")
    for precision, why in (data.get("skipped") or {}).items():
        lines += [f"{precision} was not measured: {why}.", ""]
    lines += ["| precision | cut | real tokens/s | vs drawn | real-token share | peak memory | max loss difference |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for precision, modes in data["results"].items():
        for mode, row in modes.items():
            lines.append(f"| {precision} | {mode} | {row['tokens_per_s']:,.0f} | {row['ratio']:.2f}x | "
                         f"{row['real_share']:.2f} | {row['peak_bytes'] / 2**20:.1f} MiB | "
                         f"{row['max_loss_difference']:.1e} |")
    lines.append("")
    for precision, modes in data["results"].items():
        base = modes["drawn"]
        sorted_met = modes["by-length"]["ratio"] >= 1.4
        packing_met = modes.get("packing", {}).get("ratio", 0) >= 1.7
        over = [mode for mode, row in modes.items() if row["peak_bytes"] and base["peak_bytes"]
                and row["peak_bytes"] > base["peak_bytes"]]
        lines.append(
            f"- {precision}: sorted >= 1.4x **{'met' if sorted_met else 'NOT met'}** "
            f"({modes['by-length']['ratio']:.2f}x), packing >= 1.7x **{'met' if packing_met else 'NOT met'}** "
            f"({modes.get('packing', {}).get('ratio', 0):.2f}x), peak memory not above the baseline "
            f"**{'met' if not over else 'NOT met (' + ', '.join(over) + ')'}**; the baseline computes "
            f"{1 - base['real_share']:.0%} padding (real share {base['real_share']:.2f})")
    return lines + [""]


def render_compile(data: dict) -> list[str]:
    """Issue 16's compile benchmark: eager against compiled tokens/s per recompute mode, compile time apart."""
    lines = sections.para(
        f"{data['model']} fp32, seq {data['seq_len']}, micro {data['micro_batch_size']} x accum "
        f"{data['grad_accum_steps']}, packed text: an eager engine and one whose blocks are compiled as `cadence "
        f"train --compile` compiles them, same seed, same windows, alternating rounds ({data['rounds']} rounds of "
        f"{data['steps_per_round']} steps after a compiling step and a warm-up step); median tokens/s. Compile time "
        "is dynamo's own accounting of the first step: cold with an empty inductor cache (the first mode measured; "
        "the second reuses the kernels the two share), warm as a later run finds it (dynamo traces again, inductor "
        "reuses its kernels). Break-even: cold compile time over the time saved per step. Load average "
        f"{data['load_average_before']:.1f} before, {data['load_average_after']:.1f} after (2 cores: above 2, "
        "other work shared the machine).")
    rows = []
    for mode, row in data["results"].items():
        even = row["break_even_steps"]
        rows.append([mode, f"{row['eager']['tokens_per_s']:,.0f}", f"{row['compiled']['tokens_per_s']:,.0f}",
                     f"{row['ratio']:.2f}x", f"{row['compile_cold_s']:.1f} s", f"{row['compile_warm_s']:.1f} s",
                     str(row["compiled_graphs"]), "never" if even is None else f"{even:,.0f}",
                     f"{row['max_loss_difference']:.1e}"])
    lines += sections.table(["recompute", "eager tokens/s", "compiled tokens/s", "compiled / eager", "compile (cold)",
                             "compile (warm cache)", "graphs", "break-even steps", "max loss difference"], rows)
    lines += sections.para(
        "Compiling fuses the cheap ops around the matrix multiplies (layer norms, GELU, residual adds, and with "
        "recompute the forward run again in the backward) into a few generated kernels; the fp32 matmuls themselves "
        "stay the library calls eager makes. On a CPU those matmuls are most of a step, so the gain is what the "
        "fused ops cost eagerly; on a GPU, where each small op is a kernel launch and a round trip through memory, "
        "the same fusion is worth more (`make bench-gpu` measures it there).")
    return lines


def render_optimizer_state(data: dict) -> list[str]:
    """Issue 26 items 2 and 3: the optimizer state's bytes, the peak against the estimate, the loss over 200 steps;
    LoRA against training the whole model."""
    states, adapters = data["optimizer_state"], data["lora"]
    versions = data["environment"]["versions"]
    lines = sections.para(
        f"`cadence train --model {states['model']} --seq-len {states['seq_len']} --micro-batch-size "
        f"{states['micro_batch_size']} --max-steps {states['steps']}` on the built-in corpus (lr 1e-3, warmup "
        f"{states['steps'] // 10}, fp32 compute), once per `--optimizer-state`: the same data and seed, only the "
        "moments' storage differs. State: summary.json's `optimizer_state_bytes` (the state tensors' bytes). Peak: "
        "summary.json's `peak_memory_bytes` (the profiler's allocation replay of window 2), against "
        f"`estimate_step_memory(..., optimizer=OptimizerSpec(state=...))`. Loss: the mean of the last {states['last_steps_averaged']} "
        f"steps. bitsandbytes {versions.get('bitsandbytes')}; load average {data['load_average_before']:.1f} before, "
        f"{data['load_average_after']:.1f} after (2 cores: tokens/s are those of a shared machine).")
    rows = [[name, f"{sections.mib(run['optimizer_state_bytes'])} MiB", f"{run['state_vs_fp32']:.3f}x",
             f"{sections.mib(run['peak_memory_bytes'])} MiB", f"{run['estimate_error']:+.1%}",
             f"{run['final_loss']:.4f}", f"{run['loss_vs_fp32']:+.2%}", f"{run['max_step_loss_difference']:.1%}",
             f"{run['tokens_per_s']:,.0f}"] for name, run in states["runs"].items()]
    lines += sections.table(["--optimizer-state", "state", "vs fp32", "peak", "estimate vs peak",
                             f"loss (last {states['last_steps_averaged']})", "vs fp32", "largest step's loss vs fp32",
                             "tokens/s"], rows)
    runs = states["runs"]
    lines.append(f"- bf16 keeps {runs['bf16']['state_vs_fp32']:.2f}x and 8bit {runs['8bit']['state_vs_fp32']:.2f}x "
                 f"of fp32's state; after {states['steps']} steps their loss is {runs['bf16']['loss_vs_fp32']:+.2%} "
                 f"and {runs['8bit']['loss_vs_fp32']:+.2%} from fp32's (the slow test's tolerance: 1%)")
    lines.append(f"- their cost on this CPU: {runs['bf16']['tokens_per_s'] / runs['fp32']['tokens_per_s']:.2f}x and "
                 f"{runs['8bit']['tokens_per_s'] / runs['fp32']['tokens_per_s']:.2f}x fp32's tokens/s (bf16: the "
                 "rounding's random bits and the fp32 working copies; 8bit: bitsandbytes' CPU update dequantises and "
                 "requantises every tensor in its C library); not measured on a GPU here")
    lines.append("")
    llama = adapters["llama_config"]
    lines += sections.para(
        f"LoRA: `cadence train --model hf:llama` (width {llama['hidden_size']}, {llama['num_hidden_layers']} layers, "
        f"vocabulary {llama['vocab_size']}; transformers {versions.get('transformers')}, peft {versions.get('peft')}), "
        f"micro-batch {adapters['micro_batch_size']} x {adapters['seq_len']}, {adapters['steps']} steps, trained "
        "whole, with `--lora-rank 8` (peft's default targets for llama: q_proj and v_proj), and with `--lora-rank 8 "
        "--precision bf16 --lora-base-precision bf16`; the peak against `estimate_hf_step_memory(..., lora=...)`.")
    rows = [[name, f"{run['trainable_parameters']:,}", f"{run['frozen_parameters']:,}",
             f"{run['optimizer_state_bytes'] / 1024:,.0f} KiB", f"{sections.mib(run['peak_memory_bytes'])} MiB",
             f"{run['peak_vs_full']:.2f}x", f"{run['estimate_error']:+.1%}", f"{run['tokens_per_s']:,.0f}"]
            for name, run in adapters["runs"].items()]
    lines += sections.table(["run", "trained", "frozen", "state", "peak", "vs full", "estimate vs peak", "tokens/s"],
                            rows)
    worst = max(abs(run["estimate_error"]) for group in (states, adapters) for run in group["runs"].values())
    lines.append(f"- the estimate is within {worst:.1%} of every measured peak above")
    lines.append("")
    return lines


def render_qlora(data: dict) -> list[str]:
    """Issue 39 item 2: the Llama-3.1-8B estimate with a bf16 and an nf4 base; the CPU measurement of both bases."""
    model, gib = data["model"], 2**30
    lines = sections.para(
        f"`estimate_hf_step_memory` for the Llama-3.1-8B shape ({model['num_hidden_layers']} layers, hidden "
        f"{model['hidden_size']}, {model['num_attention_heads']} query / {model['num_key_value_heads']} key-value "
        f"heads, MLP {model['intermediate_size']}, vocabulary {model['vocab_size']:,}, untied head; "
        f"{data['parameters'] / 1e9:.2f}B parameters, on the meta device) at seq {data['seq_len']}, bf16 autocast, "
        "full recompute, on CUDA, LoRA rank 16 on all linear layers. nf4: the blocks' linear layers at about 0.52 "
        "bytes a weight; the embeddings (1.05B parameters) and the LM head (another 0.53B) stay fp32, about 4 GiB "
        "of the nf4 figures. An estimate, not a run (the CUDA context and the allocator's reserve come on top).")
    cells: dict[tuple[str, int], dict[int, dict]] = {}
    for row in data["rows"]:
        cells.setdefault((row["base"], row["loss_chunk_tokens"]), {})[row["micro_batch_size"]] = row
    micro_sizes = sorted({row["micro_batch_size"] for row in data["rows"]})
    budget = data["budget_bytes"] / gib
    rows = [[f"--lora-base-precision {base}" + (f" --loss-chunk-tokens {chunk}" if chunk else ""),
             *[f"{by[m]['peak_bytes'] / gib:.2f} GiB" + (" (fits)" if by[m]["fits_24_gib"] else "")
               for m in micro_sizes]] for (base, chunk), by in cells.items()]
    lines += sections.table(["base", *[f"micro-batch {m}" for m in micro_sizes]], rows)
    lines.append(f"- (fits): within {budget:.0f} GiB.")
    lines.append("")
    llama = data["cpu_model"]
    lines += sections.para(
        f"CPU: `cadence train --model hf:llama` (hidden {llama['hidden_size']}, {llama['num_hidden_layers']} "
        f"layers, MLP {llama['intermediate_size']}, vocabulary {llama['vocab_size']}: "
        f"{data.get('cpu_parameters', [13.9e6, 13.6e6])[0] / 1e6:.1f}M parameters, the blocks' linear layers "
        f"{data.get('cpu_parameters', [13.9e6, 13.6e6])[1] / 1e6:.1f}M of them), seq {data['cpu_seq_len']}, micro-batch {data['cpu_micro_batch_size']}, "
        f"{data['cpu_steps']} steps, LoRA rank 16 on all linear layers. bf16 on this CPU: {data['cpu_bf16']} "
        "(emulated: bf16 runs only where the CPU multiplies bf16 natively, so fp32 compute here). Load average "
        f"{data['load_average_before']:.1f} before, {data['load_average_after']:.1f} after (2 shared cores).")
    reference = {run["precision"]: run for run in data["measured"] if run["base"] != "nf4"}
    rows = []
    for run in data["measured"]:
        ref = reference[run["precision"]]
        rows.append([f"{run['base']} base, --precision {run['precision']}", f"{sections.mib(run['peak_memory_bytes'])} MiB",
                     f"{run['peak_memory_bytes'] / ref['peak_memory_bytes']:.2f}x", f"{run['final_loss']:.4f}",
                     f"{run['final_loss'] / ref['final_loss'] - 1:+.2%}", f"{run['tokens_per_s']:,.0f}",
                     f"{run['tokens_per_s'] / ref['tokens_per_s']:.2f}x"])
    lines += sections.table(["run", "peak", "vs full-precision base", f"loss after {data['cpu_steps']} steps",
                             "vs full-precision base", "tokens/s", "vs full-precision base"], rows)
    return lines


def render_estimate_1b(data: dict) -> list[str]:
    """Issue 26 item 6: the Llama-3.2-1B-shaped estimate at seq 2048, before and after each lever."""
    model = data["model"]
    lines = sections.para(
        f"`estimate_hf_step_memory` for a Llama-3.2-1B-shaped model ({model['num_hidden_layers']} layers, hidden "
        f"{model['hidden_size']}, {model['num_attention_heads']} query / {model['num_key_value_heads']} key-value "
        f"heads, MLP {model['intermediate_size']}, vocabulary {model['vocab_size']:,}, tied embeddings; "
        f"{data['parameters'] / 1e9:.2f}B parameters, built on the meta device) at seq {data['seq_len']}, "
        f"{data['precision']} autocast, recompute {data['checkpointing']}, on CUDA. An estimate, not a measurement "
        "(its error against the CPU measurement is in the sections above; the CUDA context and the allocator's "
        "reserve come on top). LoRA: rank 16 on peft's default targets (q_proj, v_proj).")
    micro_sizes = sorted({row["micro_batch_size"] for row in data["rows"]})
    by_lever: dict[str, dict[int, dict]] = {}
    for row in data["rows"]:
        by_lever.setdefault(row["levers"], {})[row["micro_batch_size"]] = row
    gib = 2**30
    rows = []
    for lever, cells in by_lever.items():
        first = cells[micro_sizes[0]]["by_category"]
        rows.append([lever, *(f"{cells[m]['peak_bytes'] / gib:.2f} GiB" for m in micro_sizes),
                     f"{first.get('optimizer_state', 0) / gib:.2f} GiB", f"{first.get('gradients', 0) / gib:.2f} GiB"])
    lines += sections.table(["levers", *(f"micro-batch {m}" for m in micro_sizes), "optimizer state (micro 1)",
                             "gradients (micro 1)"], rows)
    before, chunked = by_lever[next(iter(by_lever))], by_lever["--loss-chunk-tokens 1024"]
    states = by_lever["--loss-chunk-tokens 1024 --optimizer-state bf16"]
    top = micro_sizes[-1]
    lines.append(f"- chunking the loss flattens the peak over the micro-batch ({before[top]['peak_bytes'] / gib:.1f} -> "
                 f"{chunked[top]['peak_bytes'] / gib:.1f} GiB at micro-batch {top}): the logits' fp32 gradient was the "
                 "growth; what is left is the optimizer step's (parameters, gradients, AdamW's two moments)")
    lines.append(f"- bf16 optimizer state then brings micro-batch {top} to {states[top]['peak_bytes'] / gib:.1f} GiB, "
                 "inside a 24 GB GPU with no offload; 8bit state and LoRA go further (table)")
    lines.append("")
    return lines


def render_loss_chunking(data: dict) -> list[str]:
    """Issue 26's chunked loss: peak memory and time per chunk size and model, and what they say about the default."""
    models = data["models"]
    llama = data["llama_config"]
    transformers_version = data["environment"]["versions"].get("transformers")
    lines = sections.para(
        f"One engine per chunk size, each built as `cadence train` builds it (same seed, AdamW, clipping at 1.0), on "
        f"the same windows of the built-in corpus, {data['precision']}, one torch thread: step 1 warms up, step 2 "
        "is measured by cadence's own memory meter (the peak `summary.json` reports), then "
        f"{data['rounds']} rounds step every chunk size once on the round's window, in a rotating order. Time: the "
        "median over rounds of each step's time over the whole-logits step of the same round, as wall time and as "
        "the process's CPU time (the work done, whatever else ran on the machine). 0 is all logits at once. The "
        f"llama (transformers {transformers_version}) has width {llama['hidden_size']}, "
        f"{llama['num_hidden_layers']} layers and a vocabulary of {llama['vocab_size']:,}; gpt-small reads bytes "
        f"(vocabulary 256). Load average {data['load_average_before']:.1f} before, "
        f"{data['load_average_after']:.1f} after (2 cores: above 2, other work shared the machine and the wall times "
        "are noisier than the CPU times).")
    for name, model in models.items():
        lines += sections.para(
            f"**{name}** ({model['parameters'] / 1e6:.1f}M parameters, vocabulary {model['vocab_size']:,}), micro "
            f"{model['micro_batch_size']} x {model['seq_len']} = {model['tokens_per_micro_batch']:,} target tokens:")
        rows = [[chunk, f"{sections.mib(row['peak_memory_bytes'])} MiB", f"{row['peak_vs_whole']:.2f}x",
                 f"{row['tokens_per_s']:,.0f}", f"{row['time_vs_whole']:.2f}x", f"{row['cpu_time_vs_whole']:.2f}x",
                 f"{row['max_loss_difference']:.1e}"] for chunk, row in model["results"].items()]
        lines += sections.table(["--loss-chunk-tokens", "peak", "vs 0", "tokens/s", "step time vs 0",
                                 "CPU time vs 0", "max loss difference vs 0"], rows)
    chunked = [(name, chunk, row) for name, model in models.items() for chunk, row in model["results"].items()
               if chunk != "0"]
    worst_loss = max(row["max_loss_difference"] for _, _, row in chunked)
    lines.append(f"- every chunked run has the whole-logits losses to {worst_loss:.0e} relative (rounding: the chunks "
                 "sum in another order)")
    for name, model in models.items():
        results = {chunk: row for chunk, row in model["results"].items() if chunk != "0"}
        best = min(results, key=lambda chunk: results[chunk]["peak_vs_whole"])
        saved = 1 - results[best]["peak_vs_whole"]
        cost = max(row["cpu_time_vs_whole"] for row in results.values()) - 1
        if saved < 0.02:
            lines.append(f"- {name}: chunking saves nothing measurable ({saved:.0%} of the peak at best: the logits "
                         f"of a {model['vocab_size']:,}-token vocabulary are a small part of it); CPU time "
                         f"{cost:+.0%} at most")
        else:
            largest = max(results, key=int)
            lines.append(f"- {name}: {best} cuts the peak to {results[best]['peak_vs_whole']:.2f}x, for "
                         f"{results[best]['cpu_time_vs_whole'] - 1:+.0%} CPU time (the head's matmul again in the "
                         "backward, chunk by chunk); a chunk at least as large as the micro-batch's targets is not "
                         f"recomputed, so {largest} (one chunk: the target gathering alone) keeps the whole peak at "
                         f"{results[largest]['cpu_time_vs_whole'] - 1:+.0%} CPU time")
    lines.append("")
    lines += sections.para(
        "The default stays 0 (the logits at once): chunking is a memory lever that costs compute wherever the logits "
        "are large enough for it to save memory, and saves nothing where they are small. It is the lever to pull "
        "when the logits dominate the peak (large vocabularies, long micro-batches), as the other memory levers are. "
        "0 in this table is every position's logits; since issue 37 the default gathers the target positions before "
        "the head first (the next section), which is the same as the full logits where every position is a target, "
        "as in this benchmark's text.")
    return lines


def render_input_overlap(data: dict) -> list[str]:
    """Issue 16's overlapped input: the data-wait share and tokens/s per prefetch depth, and the target judged."""
    lines = sections.para(
        f"The slow-dataset case of `cadence profile`: {data['model']} on packed text, seq {data['seq_len']}, micro "
        f"{data['micro_batch_size']} x accum {data['grad_accum_steps']}, windows cut by `epoch_windows` as `cadence "
        f"train` cuts them, each micro-batch then {data['delay_per_micro_batch_s'] * 1000:.0f} ms late (a sleep: "
        "slow storage, not a slow CPU), every window run through `Engine.step` under `StepProfiler`, the windows "
        "prepared by `prefetch` at each depth (0: in the loop's own thread, as before `--prefetch-windows`). Median "
        f"of {data['rounds']} rounds of {data['profiled_steps']} profiled steps, rounds rotating which depth goes "
        "first; tokens/s over whole steps, data wait included. Target (issue 16): the data-wait share drops.")
    rows = [[depth, f"{row['data_wait_share']:.1%}", f"{row['tokens_per_s']:,.0f}", f"{row['speedup']:.2f}x",
             f"{row['step_time_s'] * 1000:.0f} ms", "yes" if row["same_losses_as_depth_0"] else "NO"]
            for depth, row in data["results"].items()]
    lines += sections.table(["--prefetch-windows", "data wait (share of the step)", "tokens/s", "vs 0",
                             "median step", "same losses as 0"], rows)
    base = data["results"]["0"]["data_wait_share"]
    best = min(row["data_wait_share"] for depth, row in data["results"].items() if depth != "0")
    lines.append(f"- the data-wait share drops **{sections.verdict(best < base)}** ({base:.1%} at 0, {best:.1%} "
                 "prefetching)")
    return lines + [""]


def render_data_store(data: dict) -> list[str]:
    """The data-store section: what ran, issue 14's targets judged (met / NOT met), then every run's figures."""
    code = data.get("code", {})
    commit = code["git_commit"][:10] if code.get("git_commit") else f"`{code.get('package')}` (not this checkout)"
    modified = {True: ", with uncommitted changes under src/", False: ""}.get(code.get("src_modified"), "")
    loader = ("the token store (`--data-cache`, a fresh one per first run, reused by the second; tokens read with "
              "pread, the index memory-mapped)"
              if data.get("store_supported") else
              "the loader that reads every source into memory (`cadence train` had no `--data-cache`; the second run "
              "repeats the first)")
    lines = sections.para(
        f"`cadence train {' '.join(data['train_flags'])} --data FILE --out DIR`, cadence {code.get('cadence')} at "
        f"{commit}{modified}, measured {loader}. Inputs are generated from the standard library's .py source "
        "(repeated to size; JSONL examples cut from it at random) and deleted afterwards. Memory is that of the whole "
        "process tree (cadence, torchrun, every rank and worker), summed and sampled every "
        f"{data['sample_interval_s'] * 1000:.0f} ms from /proc: peak RSS, and peak PSS, which splits a shared page "
        "between the processes that map it (the honest total for pages shared through the page cache); the kernel's per-"
        "process peak (VmHWM, summed) cross-checks the sampling. Times are from the process start: to the banner "
        "(data loaded) and to the first row of metrics.jsonl (the first optimizer step). MB = 2**20 bytes. Every "
        "command line is in the JSON.")
    lines += ["Targets (issue 14):", ""]
    for target, met, figures in data_store_targets(data):
        state = "reported" if met is None and figures.startswith("reported") else (
            "not measured" if met is None else sections.verdict(met))
        figures = figures.removeprefix("reported (no threshold): ").removeprefix("not measured: ")
        lines.append(f"- {target}: **{state}**. {figures}")
    lines.append("")

    def rows(entries: list[dict], label: str, base: dict | None) -> list[list[str]]:
        out = []
        for entry in entries:
            if "skipped" in entry:
                out.append([label.format(**entry), "-", "skipped", entry["skipped"]] + [""] * 6)
                continue
            for w in RUNS:
                run = entry.get(w, {})
                if "error" in run:
                    out.append([label.format(**entry), _size(entry.get("bytes")), w, f"FAILED: {run['error']}"]
                               + [""] * 6)
                    continue
                growth = _growth(entry, base, w) if base is not None and entry is not base else None
                out.append([label.format(**entry), _size(entry.get("bytes")), w, _secs(run.get("wall_s")),
                            _secs(run.get("data_ready_s")), _secs(run.get("first_step_s")),
                            _mb(run.get("peak_rss_bytes")), _mb(run.get("peak_pss_bytes")),
                            _mb(growth, True) if growth is not None else "", _size(run.get("cache_bytes"))])
        return out

    header = ["data", "size MB", "run", "wall s", "data loaded s", "first step s", "peak RSS MB", "peak PSS MB",
              "RSS growth MB", "store MB"]
    text = data.get("text", [])
    lines += sections.para("Text (one process); growth is against the first row's size, same run:")
    lines += sections.table(header, rows(text, "{label} text", text[0] if text else None))
    jsonl = data.get("jsonl", [])
    if jsonl:
        spread = (f"prompts {jsonl[0]['prompt_bytes'][0]}-{jsonl[0]['prompt_bytes'][1]} bytes, completions "
                  f"{jsonl[0]['completion_bytes'][0]}-{jsonl[0]['completion_bytes'][1]} bytes, uniform")
        lines += sections.para(f"Prompt/completion JSONL ({spread}; a prompt stays within --seq-len so every example "
                               "keeps a target):")
        lines += sections.table(header, rows(jsonl, "{examples:,} examples", jsonl[0]))
    ranks = data.get("ranks", {})
    if ranks.get("runs"):
        lines += sections.para(f"Text with `--nproc-per-node {ranks['processes']}` (memory summed over the tree):")
        lines += sections.table(header, rows(ranks["runs"], "{label} text", ranks["runs"][0]))
    prepare = data.get("prepare_data", {})
    if prepare.get("runs"):
        lines += sections.para("`cadence prepare-data` (MB/s = input size / wall time, start-up included):")
        prepare_rows = []
        for entry in prepare["runs"]:
            for w in RUNS:
                run = entry.get(w)
                if run is None:
                    prepare_rows.append([entry["label"], _size(entry.get("bytes")), w, entry.get("skipped", "-"), "",
                                         "", ""])
                    continue
                if "error" in run:
                    prepare_rows.append([entry["label"], _size(entry.get("bytes")), w, f"FAILED: {run['error']}", "",
                                         "", ""])
                    continue
                prepare_rows.append([entry["label"], _size(entry.get("bytes")), w, _secs(run.get("wall_s")),
                                     f"{run['mb_per_s']:,.1f}", _mb(run.get("peak_rss_bytes")),
                                     _size(run.get("cache_bytes"))])
        lines += sections.table(["data", "size MB", "run", "wall s", "MB/s", "peak RSS MB", "store MB"], prepare_rows)
    notes = list(data.get("notes", []))  # what was skipped is said in the targets above
    if data.get("quick"):
        notes.append("A --quick run: small sizes only, not the issue's.")
    for note in notes:
        lines += sections.para(note)
    return lines


def plot_overhead(data: dict, path: Path) -> None:
    """Each implementation's paired tokens/s ratio to the hand-written loop, per precision, with the 0.98 target."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 3.6))
    FigureCanvasAgg(figure)  # Agg only: no display, and the same bytes from the same data
    axes = figure.add_subplot()
    names = [n for n in sections.IMPLEMENTATIONS if n != "plain"]
    precisions = list(data["precisions"])
    offset = 0.25 / len(precisions)
    lowest = 1.0
    for index, precision in enumerate(precisions):
        per = data["precisions"][precision]
        ratios = [sections.paired_ratios(per, name) for name in names]
        medians = [statistics.median(r) for r in ratios]
        low = [m - min(r) for m, r in zip(medians, ratios)]
        high = [max(r) - m for m, r in zip(medians, ratios)]
        lowest = min([lowest] + [min(r) for r in ratios])
        positions = [i + (2 * index - len(precisions) + 1) * offset for i in range(len(names))]
        # Points, not bars: the axis does not start at 0, and a bar's length would then mean nothing.
        axes.errorbar(positions, medians, yerr=[low, high], fmt="o", capsize=4, label=f"{precision}: median, min-max")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.axhline(sections.SPEED_TARGET, color="red", linestyle="--", linewidth=1, label="target 0.98 (cadence)")
    axes.set_xticks(range(len(names)), [sections.IMPLEMENTATIONS[n] for n in names])
    axes.set_xlim(-0.5, len(names) - 0.5)
    axes.set_ylim(min(0.9, lowest - 0.04), None)  # room for the legend below the lowest whisker
    axes.set_ylabel("tokens/s / hand-written (paired)")
    axes.set_title(f"{data['model']}, seq {data['seq_len']}: {data['rounds']} rounds, paired with the hand-written loop")
    axes.grid(alpha=0.3, axis="y")
    axes.legend(fontsize=8, loc="lower left", ncols=3)
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={"Software": None})  # no matplotlib version: reruns give the same file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=OUTPUT)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out differs from a render")
    args = parser.parse_args()
    text = render(args.results)
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        print(f"{args.out}: {'up to date' if current == text else 'STALE: rerun benchmarks/write_report.py'}")
        return 0 if current == text else 1
    overhead = args.results / "overhead.json"
    if overhead.exists():
        plot_overhead(json.loads(overhead.read_text()), args.results / OVERHEAD_PLOT)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
