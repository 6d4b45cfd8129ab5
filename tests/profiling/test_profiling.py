"""Profiling: phases that add up to the step, the verdicts, a valid Chrome trace, and no cost when off."""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers import sample_text, tiny_model, write_jsonl

from cadence import Engine, iter_windows
from cadence.cli import main
from cadence.data import iterate_micro_batches, pack_bytes
from cadence.engine.step import NO_PHASE
from cadence.profiling.profiler import PHASES, ProfileSettings, StepProfiler, verdict


def slow(items, seconds: float):
    for item in items:
        time.sleep(seconds)  # a deliberately slow dataset: the accelerator (here the CPU) waits for it
        yield item


def profile_own_loop(tmp_path, *, delay: float = 0.0, active: int = 4):
    dataset = pack_bytes(sample_text(200 * 32 + 1), 32)
    model = tiny_model()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), max_grad_norm=1.0)
    settings = ProfileSettings(active=active, tokens_per_step=16 * 32, model_flops_per_token=1e5, peak_flops=1e11)
    micro_batches = iterate_micro_batches(dataset, 8, 0, 0)
    with StepProfiler(engine, out=tmp_path / "profile", settings=settings) as profiler:
        for window in iter_windows(slow(micro_batches, delay) if delay else micro_batches, 2):
            engine.step(window)
            with profiler.phase("logging_checkpointing"):
                pass
            profiler.step()
            if profiler.done:
                break
    assert engine.phases is None  # detached when done: no cost afterwards
    return profiler.result


def test_python_api_phases_add_up_to_the_step(tmp_path):
    result = profile_own_loop(tmp_path)
    assert set(PHASES) <= set(result["phases"])
    # The phases cover the step: a phase left out would miss a fifth of it or more. The margin is 15%, not 5%: on 2
    # cores shared with other work, the load stretched the gaps between phases to 5.7% (a fresh clone, 2026-12-03)
    # and to 11.6% (a load average of 11, 2026-12-04) although no phase was missing.
    assert abs(result["phase_shares_sum"] - 1.0) <= 0.15
    assert len(result["step_times_s"]) == 4
    for name in ("forward", "backward", "optimizer_step"):
        assert result["phases"][name]["mean_s"] > 0
    assert result["phase_peak_memory_bytes"]["backward"] > 0
    assert result["top_operators"] and result["top_operators"][0]["self_time_s"] > 0
    assert (tmp_path / "profile" / "profile.json").exists()
    assert (tmp_path / "profile" / "report.html").exists()  # the same report as `cadence profile`


def test_slow_dataset_is_data_bound(tmp_path):
    result = profile_own_loop(tmp_path, delay=0.05)  # 2 micro-batches x 50 ms of waiting per step
    assert result["verdict"]["kind"] == "data-bound"
    assert "waiting for data" in result["verdict"]["figure"]


def test_builtin_default_on_cpu_is_compute_bound_and_trace_is_valid(tmp_path):
    out = tmp_path / "profile"
    assert main(["profile", "--steps", "3", "--out", str(out)]) == 0
    profile = json.loads((out / "profile.json").read_text())
    assert profile["verdict"]["kind"] == "compute-bound"
    assert abs(profile["phase_shares_sum"] - 1.0) <= 0.05
    assert profile["tokens_per_s"] > 0 and 0 < profile["mfu"] < 1.5
    trace = json.loads((out / "trace.json").read_text())  # valid Chrome trace JSON
    names = {event.get("name") for event in trace["traceEvents"]}
    for phase in ("forward", "backward", "unscale_clip", "optimizer_step", "zero_grad_scheduler"):
        assert f"cadence.{phase}" in names
    assert (out / "report.md").exists() and (out / "report.html").exists()


def result_with(shares: dict[str, float], world: int = 1, peak: int | None = None) -> dict:
    phases = {name: {"share": shares.get(name, 0.0), "mean_s": 0.0} for name in (*PHASES, "other")}
    return {"phases": phases, "world_size": world, "peak_memory_bytes": peak, "mfu": 0.3}


@pytest.mark.parametrize("shares, world, peak, limit, kind", [
    ({"data_wait": 0.3, "forward": 0.3, "backward": 0.4}, 1, None, None, "data-bound"),
    ({"gradient_sync": 0.3, "forward": 0.3, "backward": 0.4}, 2, None, None, "communication-bound"),
    ({"forward": 0.4, "backward": 0.6}, 1, 95, 100, "memory-bound"),
    ({"optimizer_step": 0.3, "forward": 0.3, "backward": 0.4}, 1, None, None, "optimizer-bound"),
    ({"forward": 0.35, "backward": 0.6}, 1, 50, 100, "compute-bound"),
])
def test_verdict_rules(shares, world, peak, limit, kind):
    found = verdict(result_with(shares, world, peak), limit)
    assert found["kind"] == kind and found["figure"] and found["advice"]


@pytest.mark.parametrize("order, fix", [("drawn", "--micro-batch-order by-length"),
                                        ("by-length", "--micro-batch-tokens")])
def test_a_padding_bound_step_is_named_with_its_fix(order, fix):
    result = {**result_with({"forward": 0.4, "backward": 0.6}), "padding_fraction": 0.42,
              "config": {"micro_batch_order": order}}
    found = verdict(result, None)
    assert found["kind"] == "padding-bound" and "42%" in found["figure"] and fix in found["advice"]
    assert verdict({**result, "padding_fraction": 0.1}, None)["kind"] == "compute-bound"


@pytest.mark.slow
def test_profile_reports_the_padding_of_variable_length_data(tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl")
    for name, extra in (("drawn", ["--micro-batch-order", "drawn"]), ("sorted", [])):  # by-length: the default
        assert main(["profile", "--steps", "2", "--data", str(data), "--seq-len", "48", "--micro-batch-size", "4",
                     "--grad-accum-steps", "2", "--out", str(tmp_path / name), *extra]) == 0
    drawn, ordered = (json.loads((tmp_path / name / "profile.json").read_text())["padding_fraction"]
                      for name in ("drawn", "sorted"))
    assert 0 < ordered < drawn < 1


def test_no_profiler_means_the_shared_no_op():
    model = tiny_model()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert engine.phases is None and engine._phase("forward") is NO_PHASE


def test_profile_bad_input(tmp_path, capsys):
    assert main(["profile", "--steps", "0", "--out", str(tmp_path / "p")]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["profile", "--max-steps", "3"]) == 2  # not a profile flag: it would do nothing
    assert "--max-steps" in capsys.readouterr().err


@pytest.mark.parametrize(("config", "named", "not_named"), [
    ({"precision": "fp32", "activation_checkpointing": "none"}, ["bf16", "--compile"], ["recompute"]),
    ({"precision": "bf16", "activation_checkpointing": "full", "compile": True}, ["less recompute than full"],
     ["bf16", "--compile"]),
    ({"precision": "bf16", "activation_checkpointing": "none", "compile": True}, ["a larger micro-batch"],
     ["recompute", ", or"]),
])
def test_compute_bound_advice_names_only_levers_the_run_has_left(config, named, not_named):
    """The advice once suggested "less recompute" to a run that recomputed nothing."""
    result = {**result_with({"forward": 0.35, "backward": 0.6}), "config": config}
    advice = verdict(result, None)["advice"]
    assert all(word in advice for word in named), advice
    assert not any(word in advice for word in not_named), advice


@pytest.mark.slow
def test_profile_reports_the_noise_scale_against_the_effective_batch(tmp_path, capsys):
    """Issue 27: profile.json, the printed line and the report hold the gradient noise scale over the profiled
    windows, and where the effective batch stands against it."""
    data = tmp_path / "words.txt"
    data.write_bytes(sample_text(40_000))
    out = tmp_path / "profile"
    assert main(["profile", "--steps", "3", "--data", str(data), "--seq-len", "8", "--micro-batch-size", "4",
                 "--grad-accum-steps", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().err
    profile = json.loads((out / "profile.json").read_text())
    value = profile["grad_noise_scale"]
    assert value > 0 and profile["grad_noise_scale_windows"] == 5  # wait + warm-up + 3 active windows
    assert f"gradient noise scale: {value:,.3g} sequences" in printed and f"({16 / value:.2g}x)" in printed
    report = (out / "report.md").read_text()
    assert "## Effective batch and the gradient noise scale" in report
    assert f"is {16 / value:.2g}x the gradient noise scale" in report
