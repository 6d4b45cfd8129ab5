"""The model seam: what ``--model`` (with ``--model-config`` and the LoRA flags) is, as one frozen value.

As :class:`cadence.engine.cut.Cut` is for the window and :class:`cadence.data.source.Source` for the data,
:class:`ModelSpec` is for the model: made once per command from the flags (:meth:`ModelSpec.from_flags`: its family
found in the registry :data:`FAMILIES`, and what the model is without its weights resolved), turned back into flags
(:meth:`ModelSpec.flags`), said in words (:meth:`ModelSpec.describe`), checked (:meth:`ModelSpec.problems`: the model
flags' rules, before anything is built, as ``validate`` checks them; :meth:`ModelSpec.run_problems`: the run flags the
resolved model cannot take), and built (:meth:`ModelSpec.build`: seeded, LoRA, the nf4 base, FSDP2's meta-device
build). It knows the model's shape, vocabulary and context, what it supports (packed attention, repeated blocks for
recompute, --compile and FSDP2, LoRA targets, nf4-quantisable layers) and which memory estimator replays its step
(:func:`cadence.memory.estimate_for.estimate_for` chooses by that value).

No code outside ``models/`` asks which family a model is (``tests/test_architecture.py`` fails if some does): a new
family is a :class:`~cadence.models.family.ModelFamily` in a module of its own and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cadence.errors import Problem, UsageError
from cadence.models.builtin import BuiltInGPT
from cadence.models.family import BuiltModel, Estimator, ModelFamily, Supports
from cadence.models.lora import LoraSettings, LoraShape, peft_problem, split_targets
from cadence.models.quantized import bitsandbytes_problem, nf4_bytes
from cadence.models.shape import ModelShape
from cadence.models.transformers_family import Transformers

FAMILIES: tuple[ModelFamily, ...] = (BuiltInGPT(), Transformers())
"""Every model family, in the order they are asked whether a --model name is theirs (the built-in names first: a
directory called gpt-tiny does not shadow the built-in model)."""

DEFAULT_MODEL = "gpt-tiny"
"""--model when it is not given (TrainConfig's default)."""

Flags = Callable[[str, Any], Any]
"""A flag's value by its TrainConfig name, with the default for a record that lacks it."""

FEATURES: dict[str, tuple[str, Callable[[Flags], bool]]] = {
    "model_config": ("--model-config", lambda get: bool(get("model_config", None))),
    "save_hf": ("--save-hf", lambda get: get("save_hf", None) is not None),
    "lora": ("--lora-rank", lambda get: (get("lora_rank", 0) or 0) > 0),
    "nf4": ("--lora-base-precision", lambda get: get("lora_base_precision", "fp32") == "nf4"
            and (get("lora_rank", 0) or 0) > 0),
    "compiled_packing": ("--compile", lambda get: bool(get("compile", False)) and bool(get("packing", False))),
}
"""The features a family may not take (:attr:`~cadence.models.family.ModelFamily.refuses`): the flag that asks for
each, and when it is asked for."""


def family_of(name: str) -> ModelFamily | None:
    """The family whose model --model ``name`` names, or None."""
    return next((family for family in FAMILIES if family.claims(name)), None)


def data_tokenizer(name: str) -> Any | None:
    """The tokenizer --model ``name`` reads its data with, without building the model (None: bytes)."""
    family = family_of(name)
    return family.data_tokenizer(name) if family is not None else None


def _getter(flags: Any) -> Flags:
    return flags.get if isinstance(flags, Mapping) else lambda name, default: getattr(flags, name, default)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What --model is (see the module docstring)."""

    name: str
    """--model as given: a built-in name, hf:TYPE or a model directory."""
    family: str
    """The family's key (:data:`FAMILIES`): for reading, never for branching outside models/."""
    overrides: tuple[str, ...] = ()
    """--model-config key=value items."""
    lora: LoraSettings | None = None
    """The LoRA adapters --lora-rank asks for (None: the whole model trains)."""
    architecture: str
    """The model's class (GPT, LlamaForCausalLM, ...)."""
    shape: ModelShape
    supports: Supports
    estimator: Estimator | None
    """The memory estimator that replays its step; None: none does (``no_estimate`` says why)."""
    no_estimate: str | None = None
    matmul_weights: int
    """Weights every token multiplies through: the 6N of MFU's model FLOPs."""
    adapters: LoraShape | None = None
    """The adapters as injected on a full-precision base (:meth:`adapters_for` other bases)."""

    # ------------------------------------------------------------------------------------------------ flags
    @classmethod
    def from_flags(cls, flags: Any) -> ModelSpec:
        """The model of train's flags (a TrainConfig, or a record's mapping with the same names), resolved without
        its weights. Bad --model, --model-config or LoRA flags are a UsageError naming the flag."""
        get = _getter(flags)
        name = str(get("model", DEFAULT_MODEL))
        family = family_of(name)
        if family is None:
            raise UsageError([cls._unknown(name)])
        overrides = tuple(str(item) for item in get("model_config", None) or ())
        rank = int(get("lora_rank", 0) or 0)
        lora = None if rank <= 0 else LoraSettings(
            rank=rank, alpha=get("lora_alpha", None), targets=split_targets(get("lora_targets", None)),
            dropout=float(get("lora_dropout", 0.0)))
        resolved = family.resolve(name, overrides, lora)
        return cls(name=name, family=family.key, overrides=overrides, lora=lora, **vars(resolved))

    def flags(self) -> dict[str, Any]:
        """The spec as train's flags (the run record's names)."""
        lora = self.lora
        return {"model": self.name, "model_config": list(self.overrides) or None,
                "lora_rank": lora.rank if lora else 0, "lora_alpha": lora.alpha if lora else None,
                "lora_targets": list(lora.targets) if lora and lora.targets else None,
                "lora_dropout": lora.dropout if lora else 0.0}

    def describe(self) -> str:
        """In words, for the console and the report."""
        settings = f" with {', '.join(self.overrides)}" if self.overrides else ""
        words = (f"{self.name}{settings}: {self.architecture}, {self.shape.num_parameters:,} parameters, "
                 f"{self.shape.num_layers} blocks of width {self.shape.hidden_size}, vocabulary "
                 f"{self.shape.vocab_size:,}, context {self.shape.context_length:,}")
        if self.lora is not None and self.adapters is not None:
            targets = ", ".join(self.lora.targets) if self.lora.targets else "peft's default layers"
            words += f"; LoRA rank {self.lora.rank} on {targets} ({self.adapters.adapter_parameters:,} trained)"
        return words

    # ------------------------------------------------------------------------------------------------ checks
    @staticmethod
    def _unknown(name: str) -> Problem:
        return Problem(where="--model", message=f"unknown model {name!r}; "
                                                 f"{', or '.join(family.offered for family in FAMILIES)}")

    @classmethod
    def problems(cls, flags: Any) -> list[Problem]:
        """The model flags' problems, each naming its flag, found without building anything (``validate`` reports
        them with every other flag's): an unknown --model, a flag its family does not take, --seq-len above a
        context known from the name, and the LoRA flags' rules."""
        get = _getter(flags)
        name = str(get("model", DEFAULT_MODEL))
        family = family_of(name)
        if family is None:
            return [cls._unknown(name), *lora_problems(get, adapters=True)]
        problems = [Problem(where=FEATURES[feature][0], message=message.format(model=name))
                    for feature, message in family.refuses.items() if FEATURES[feature][1](get)]
        context, seq_len = family.context_length(name), get("seq_len", None)
        if context is not None and isinstance(seq_len, int) and 2 <= seq_len and seq_len > context:
            problems.append(Problem(where="--seq-len",
                                    message=f"{seq_len} is above {name}'s context length of {context}"))
        return problems + lora_problems(get, adapters="lora" not in family.refuses)

    def run_problems(self, flags: Any, *, fsdp: bool = False) -> list[Problem]:
        """The run flags this model cannot take, found once it is resolved: --packing where its attention cannot keep
        packed examples apart, and recompute, --compile and FSDP2 (``fsdp``) on a model without repeated blocks."""
        get = _getter(flags)
        problems = []
        if get("packing", False) and self.supports.packing == "none":
            problems.append(Problem(where="--packing", message=f"{self.supports.packing_problem}; use "
                                                               f"--micro-batch-order by-length instead"))
        if not self.supports.blocks:
            units = [("--compile", bool(get("compile", False)), "--compile compiles a model block by block"),
                     ("--activation-checkpointing", get("activation_checkpointing", "none") != "none",
                      "recompute works block by block"),
                     ("--strategy", fsdp, "FSDP2 shards a model block by block")]
            problems += [Problem(where=where, message=f"{self.supports.blocks_problem}; {why}")
                         for where, asked, why in units if asked]
        return problems

    def _family(self) -> ModelFamily:
        return next(family for family in FAMILIES if family.key == self.family)

    def takes(self, feature: str) -> bool:
        """Whether the model's family takes ``feature`` (a key of :data:`FEATURES`)."""
        return feature not in self._family().refuses

    @property
    def pretrained(self) -> bool:
        """Whether the model starts from trained weights read from a directory (not a random initialisation)."""
        return self._family().pretrained(self.name)

    @property
    def exports_pretrained(self) -> bool:
        """Whether a run of it can be written as a ``save_pretrained`` directory (--save-hf, ``cadence export``)."""
        return self._family().exports_pretrained

    # ------------------------------------------------------------------------------------------------ building
    def build(self, *, seed: int, precision: str = "fp32", base_precision: str = "fp32", shard_later: bool = False,
              warn: bool = False) -> BuiltModel:
        """A fresh model with the seed's initial weights (the same in every build): LoRA's adapters injected on a
        base held in ``base_precision`` (fp32, bf16, or nf4 computing in ``precision``); ``shard_later`` (FSDP2): a
        model directory without LoRA is left on the meta device, each rank reading its own shard once it is sharded
        (``BuiltModel.pending``); ``warn``: its notes (dropout left on, ...) said as warnings, once per run."""
        return self._family().build(self.name, self.overrides, self.lora, seed=seed, precision=precision,
                            base_precision=base_precision, shard_later=shard_later, warn=warn)

    def adapters_for(self, base_precision: str, precision: str = "fp32") -> LoraShape | None:
        """The adapters as a base held in ``base_precision`` has them (what an estimate of that base needs, without
        building it): a bf16 base holds its frozen linear layers in bf16; an nf4 base holds the blocks' linear
        layers in 4 bits, their biases in the compute dtype (``precision``), the rest of the base in fp32."""
        if self.adapters is None or base_precision == "fp32":
            return self.adapters
        if base_precision == "bf16":
            return dataclasses.replace(self.adapters, bf16_base_parameters=self.supports.bf16_base_elements)
        sizes = self.supports.nf4_linears
        return dataclasses.replace(self.adapters, nf4_base_parameters=sum(sizes), nf4_base_bytes=nf4_bytes(sizes),
                                   bf16_base_parameters=self.supports.nf4_bias_elements if precision == "bf16" else 0)


def lora_problems(get: Flags, *, adapters: bool) -> list[Problem]:
    """--lora-rank and its companions: peft installed (``adapters``: the model's family takes LoRA; where it does not,
    the family's refusal says so), sane values, no companion without a rank, and what each base precision needs."""
    problems: list[Problem] = []

    def bad(name: str, message: str) -> None:
        problems.append(Problem(where="--" + name.replace("_", "-"), message=message))

    rank, alpha, dropout = get("lora_rank", 0) or 0, get("lora_alpha", None), get("lora_dropout", 0.0)
    base, precision = get("lora_base_precision", "fp32"), get("precision", "fp32")
    if rank < 0:
        bad("lora_rank", f"must be at least 0 (0: no LoRA), got {rank}")
    elif rank > 0:
        if adapters and (reason := peft_problem()) is not None:
            bad("lora_rank", f"LoRA {reason}")
    else:
        for name, value, unset in (("lora_alpha", alpha, None), ("lora_targets", get("lora_targets", None), None),
                                   ("lora_dropout", dropout, 0.0)):
            if value not in (unset, [], ()):
                bad(name, "needs --lora-rank above 0 (LoRA is off)")
    if alpha is not None and (not math.isfinite(alpha) or alpha <= 0):
        bad("lora_alpha", f"must be a positive number, got {alpha:g}")
    if not math.isfinite(dropout) or not 0 <= dropout < 1:
        bad("lora_dropout", f"must be in [0, 1), got {dropout:g}")
    if base == "bf16":
        if rank <= 0:
            bad("lora_base_precision", "needs --lora-rank above 0 (only a frozen base can be held in bf16)")
        elif precision != "bf16":
            bad("lora_base_precision", f"bf16 needs --precision bf16 (got {precision}): only under bf16 autocast is a "
                                       f"bf16 base the same math as the fp32 one")
    elif base == "nf4":
        if rank <= 0:
            bad("lora_base_precision", "nf4 needs --lora-rank above 0 (only a frozen base can be held in 4 bits)")
        if (reason := bitsandbytes_problem(needs=("nn.Linear4bit",))) is not None:
            bad("lora_base_precision", f"nf4 {reason}")
        if precision not in ("bf16", "fp32"):
            bad("lora_base_precision", f"nf4 computes in bf16 or fp32 (--precision bf16 or fp32), got {precision}")
        if get("strategy", "ddp") == "fsdp":
            bad("lora_base_precision", "nf4 does not work with --strategy fsdp (FSDP2 shards parameters as DTensors, "
                                       "which bitsandbytes' packed 4-bit weights are not); use --strategy ddp")
    targets = get("lora_targets", None)
    if targets is not None and not split_targets(targets):
        bad("lora_targets", "names no layer; give module names such as q_proj,v_proj (or all-linear)")
    return problems


__all__ = ["DEFAULT_MODEL", "FAMILIES", "FEATURES", "ModelSpec", "data_tokenizer", "family_of", "lora_problems"]
