"""measure_noise_scale: a stated number of windows of a prepared run, at fixed weights or training (issue 27; what
`cadence plan --effective-batch-size auto` builds on), and the fields and words the commands share."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import sample_text

from cadence.config import TrainConfig
from cadence.engine.noise_scale import ONE_SIZE
from cadence.training.noise_scale import batch_against_noise_scale, batch_side, measure_noise_scale
from cadence.training.prepare import Prepared, prepare


def prepared(tmp_path: Path, **changes: object) -> Prepared:
    data = tmp_path / "words.txt"
    if not data.exists():
        data.write_bytes(sample_text(40_000))
    settings = {"data": data, "seq_len": 8, "micro_batch_size": 4, "grad_accum_steps": 4, "val_fraction": 0.0,
                "data_cache": tmp_path / "cache", "out": tmp_path / "unused", **changes}
    return prepare(TrainConfig(**settings))  # type: ignore[arg-type]


def test_a_measurement_at_fixed_weights_runs_the_windows_it_is_asked_for(tmp_path: Path, one_thread: None) -> None:
    prep = prepared(tmp_path)
    fixed = measure_noise_scale(prep, windows=12)
    assert fixed.windows == fixed.windows_run == 12 and fixed.fixed_weights and fixed.unmeasured is None
    assert fixed.sequences is not None and fixed.sequences > 0 and 0 < fixed.sequences_error < fixed.sequences
    assert fixed.tokens == pytest.approx(8 * fixed.sequences) and fixed.targets == pytest.approx(8 * fixed.sequences)
    # The weights stay as prepared: the same windows measure the same again; training them moves the value.
    assert measure_noise_scale(prep, windows=12) == fixed
    trained = measure_noise_scale(prep, windows=12, train=True)
    assert not trained.fixed_weights and trained.sequences != fixed.sequences


def test_one_micro_batch_per_window_is_no_measurement_and_says_why(tmp_path: Path) -> None:
    measurement = measure_noise_scale(prepared(tmp_path, micro_batch_size=16, grad_accum_steps=1), windows=3)
    assert measurement.sequences is None and measurement.windows == 0 and measurement.unmeasured == ONE_SIZE


@pytest.mark.parametrize(("effective", "side", "said"), [
    (64, "above", "above the critical batch"), (4, "below", "below the critical batch"),
    (16, "near", "near the critical batch")])
def test_the_words_say_which_side_and_what_it_costs(effective: int, side: str, said: str) -> None:
    """McCandlish et al.'s model: tokens 1 + B / B_noise, steps 1 + B_noise / B, relative to the fewest."""
    assert batch_side(effective, 12.0) == side
    text = batch_against_noise_scale(effective, 12.0, windows=40)
    assert said in text and "over 40 windows" in text
    if side == "above":
        assert f"about {1 + effective / 12:.2g}x the fewest tokens" in text
    if side == "below":
        assert f"about {1 + 12 / effective:.2g}x the fewest steps" in text
