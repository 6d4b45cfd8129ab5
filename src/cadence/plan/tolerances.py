"""The lossy levers' tolerances: how far a lower-precision optimizer state's, or an nf4 base's, losses may stray from
the exact configuration's before the plan refuses it (``cadence.plan.quality`` checks them; the candidates' notes
quote them)."""

from __future__ import annotations

STATE_TOLERANCE = 0.01
"""A lower-precision optimizer state is kept only when, over the quality check's steps, every loss is within 1%
(relative) of the same configuration's with fp32 state. Measured: gpt-small over 200 steps keeps the mean loss of its
last 20 steps within 0.1% (bf16) and 0.1% (8bit) of fp32's (BENCHMARKS.md); a slow test checks the same on gpt-tiny at 1%."""
BASE_TOLERANCE = 0.01
"""An nf4 base is kept only when, over the quality check's steps, every loss is within 1% (relative) of the same
configuration's with the full-precision base (as QLoRA's paper finds 4-bit NormalFloat matching 16-bit LoRA).
Measured: the 49.9M-parameter llama of BENCHMARKS.md ends 20 steps 0.17% from the fp32 base's loss."""
