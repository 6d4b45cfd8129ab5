"""The options each command has beyond train's flags: typed dataclasses, one field a flag, the field's docstring its
help (the command line builds each command's flags from them, as it builds train's from TrainConfig).

They live in config/, beside the schema and away from the modules that run the commands, because `cadence COMMAND
--help` lists them and must answer without importing torch (issue 41).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class PrepareDataOptions:
    """Options of ``cadence prepare-data`` beyond the train flags it shares."""

    out: Path | None = None
    """Write the store into this new directory (then train with --data DIR) instead of the --data-cache."""
    json: bool = False
    """Print what the store holds as JSON."""


@dataclass(kw_only=True)
class SampleOptions:
    """What ``cadence sample`` generates."""

    prompt: str = ""
    """The text to continue (a prompt/completion run: the prompt, as its data had it)."""
    message: list[str] | None = None
    """A chat message to answer (a chat-trained run), ROLE:TEXT (system, user, assistant, tool) or TEXT for a user
    message; repeat for a conversation. Rendered with the run's chat template and its generation prompt; generation
    stops at the end of the assistant's turn."""
    messages_file: Path | None = None
    """A JSON file holding the conversation to answer: a list of {role, content} messages, or {"messages": [...]}."""
    max_new_tokens: int = 200
    """Tokens generated at most (fewer when the model ends the sequence); at most 16384."""
    temperature: float = 0.8
    """Softmax temperature, 0.001 or more; 0 picks the most likely token every time (greedy, the same text on every
    call)."""
    top_k: int = 50
    """Sample among the k most likely tokens only (0: all of them)."""
    seed: int = 0
    """Seed of the sampling, 0 to 2**64 - 1: the same seed, prompt and weights give the same text."""
    weights: str = "final"
    """Whose weights: final (the run's model.safetensors), best (the checkpoint --keep-best kept) or step-N (that
    checkpoint)."""


@dataclass(kw_only=True)
class ProfileOptions:
    """What `cadence profile` measures."""

    steps: int = 5
    """Optimizer steps profiled (after one wait and one warm-up step, which are not)."""
    peak_flops: float | None = None
    """Peak FLOP/s of the device for MFU; default: measured by a short matmul benchmark in the run's precision."""


@dataclass(kw_only=True)
class VerifyOptions:
    """What `cadence verify` checks beyond the gradient of one window."""

    steps: int = 0
    """Also train K optimizer steps with the configuration and with the reference, and compare the parameters."""


@dataclass(kw_only=True)
class PlanOptions:
    """How much measuring a plan does."""

    trial_steps: int = 4
    """Optimizer steps per measured trial: one warm-up, one measured for memory, the rest timed."""
    max_trials: int = 10
    """Candidates measured at most; 0 measures every candidate (an exhaustive sweep)."""
    quality_steps: int = 6
    """Optimizer steps of the loss comparison against fp32."""
    rounds: int = 3
    """Alternating rounds (A B C A B C ...) in which the front-runners, and the cuts, are timed again; each one's
    median decides, and two within the rounds' noise band are a tie, decided by the lower peak memory."""
    time_budget: float = 120.0
    """Seconds the plan may take, counted from the command's start. Memory is measured only where the estimate's
    measured error cannot decide it, and the contenders' alternating rounds stop when one is clear or the budget is
    spent, keeping time for the quality check and the report; the first round and the quality check always run. The
    plan says what it did not measure, and plan.json's time_spent_s where the time went (start-up, probe, memory,
    rounds, cuts, quality)."""
    noise_scale_windows: int = 8
    """With --effective-batch-size auto: windows over which the gradient noise scale is measured at the start of
    training (more: a smaller standard error, recorded in plan.json)."""
    noise_scale_training: bool = False
    """With --effective-batch-size auto: measure the gradient noise scale while training through the run's own start
    (--lr, --warmup-steps: as the run would) instead of at the weights the run starts from (the default: the whole
    step chain at learning rate 0, no optimizer step, so a loaded model is measured as loaded, not after the jolt of
    its first updates)."""
    lr_reference_batch: int | None = None
    """With --effective-batch-size auto: the effective batch --lr was tuned at, for the plan's advice on scaling it
    (advice only: the plan never changes --lr)."""
