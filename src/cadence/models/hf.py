"""Hugging Face ``transformers`` causal LMs as cadence models, built offline.

``--model hf:TYPE`` builds a freshly initialised model of a transformers model type (``gpt2``, ``llama``, ``qwen2``,
``mistral``, ... anything ``AutoConfig.for_model`` knows that has a causal-LM head) from the config class's defaults
and the ``--model-config key=value`` overrides; ``--model DIR`` loads a directory written by ``save_pretrained``.
Nothing is ever downloaded (``local_files_only=True`` everywhere).

Default sizes are the families' full sizes (``hf:llama`` defaults to 6.7B parameters), so ``--model-config`` is how
a small model is asked for; a config over :data:`DEFAULT_MAX_PARAMETERS` is refused rather than allocated by accident.

The engine calls ``model(input_ids)`` and reads ``.logits``: the model is never given labels, so it never computes its
own mean loss; cadence sums the per-target losses itself (see :func:`cadence.engine.step.token_cross_entropy_sum`).
transformers is an optional dependency, imported only when one of these functions runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cadence.errors import UsageError
from cadence.models.lora import is_lora, write_adapter
from cadence.models.packed_attention import transformers_attention, use_packed_attention
from cadence.models.pretrained import SAFETENSORS_FILE, PretrainedFiles, parameters_on_meta
from cadence.models.safetensors_file import copy_tensors, read_header, read_tensor
from cadence.models.shape import ModelShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

HF_PREFIX = "hf:"
"""``--model hf:TYPE`` (and ``--data hf:PATH``) name Hugging Face things rather than built-in ones."""

DEFAULT_MAX_PARAMETERS = 2_000_000_000
"""Largest model built from a config (random init); above it ``--model-config`` must shrink it. 2B fp32 parameters
are 8 GB of weights and 32 GB with gradients and AdamW state: past that, building one is almost surely a mistake."""

BYTE_VOCAB = 256
"""Without a tokenizer cadence feeds raw bytes, so the model needs at least 256 token ids."""

_FALLBACK_CONTEXT_LENGTH = 2048
"""Context length reported for configs that declare none (recurrent models such as mamba have no position limit)."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
_SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Keys a user may not override: they identify the config rather than shape the model.
_RESERVED_KEYS = frozenset({"model_type", "transformers_version", "architectures", "_name_or_path"})
_SHRINK_HINT = (
    "--model-config hidden_size=256 --model-config num_hidden_layers=4 --model-config num_attention_heads=4 "
    "--model-config intermediate_size=1024 --model-config vocab_size=256"
)


@dataclass(kw_only=True)
class HFModel:
    """A transformers causal LM ready for cadence, and what the rest of cadence needs to know about it."""

    model: nn.Module
    """The ``PreTrainedModel`` (fp32 parameters, on the CPU); call it with ``input_ids`` only."""
    config: PretrainedConfig
    tokenizer: Any | None
    """The transformers tokenizer found next to a loaded model, or None: cadence then uses byte tokens (0..255)."""
    context_length: int
    """Longest sequence the model accepts (``max_position_embeddings`` or the family's equivalent)."""
    vocab_size: int
    shape: ModelShape
    source: str
    """One line saying what was built, for logs and reports."""
    pending: PretrainedFiles | None = None
    """Set when the parameters are still on the meta device (``build_hf_model(..., shard_later=True)``): FSDP2 shards
    the model as it is, then every rank reads its own rows from these files
    (:func:`cadence.models.pretrained.load_shards`)."""
    twin: nn.Module | None = None
    """A pending model's stand-in for the checks that run a forward (:attr:`probe`)."""
    notes: list[str] = field(default_factory=list)
    """Things worth telling the user (dropout that makes splits agree only in expectation, freshly initialised
    weights that a checkpoint lacked); the caller prints them."""

    @property
    def probe(self) -> tuple[nn.Module, int]:
        """What a check that runs a forward runs (the causal check, the output-head probe of
        :func:`cadence.models.heads.chunking_problem`), with its vocabulary size: the model itself, or for a pending
        model its twin of one layer and a small vocabulary, randomly initialised. The checks' verdicts depend on the
        family's code and settings, not on the weights or the depth."""
        if self.twin is not None:
            return self.twin, int(getattr(self.twin, "config").vocab_size)  # a transformers model's config
        return self.model, self.vocab_size


def is_hf_model(spec: str) -> bool:
    """True when ``--model`` names a Hugging Face model: ``hf:TYPE`` or an existing directory.

    Check built-in names first: a directory that happens to be called ``gpt-tiny`` should not shadow the built-in.
    """
    return spec.startswith(HF_PREFIX) or Path(spec).is_dir()


def parse_model_overrides(items: list[str]) -> dict[str, Any]:
    """Parse ``--model-config key=value`` items into config overrides.

    Values are JSON when they parse as JSON (``64``, ``1e-5``, ``true``, ``null``, ``[1, 2]``, ``"text"``) and plain
    strings otherwise (``hidden_act=silu``). A later item overrides an earlier one with the same key.
    """
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or not key.isidentifier():
            raise UsageError.single("--model-config", f"{item!r} is not key=value (e.g. hidden_size=64)")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        overrides[key] = value
    return overrides


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars and warnings for the duration, then restore what was set.

    Its logger and bars are process-wide; restoring them keeps this from changing anything for the caller. What the
    warnings would say that matters (missing weights, non-causal models) cadence checks and reports itself.
    """
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise UsageError.single("--model", "Hugging Face models need transformers: pip install 'cadence[hf]'") from None
    return transformers


def _one_line(error: BaseException) -> str:
    """An exception as one line (transformers' validation errors span several)."""
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return text if len(text) <= 300 else text[:297] + "..."


def _valid_keys(config: PretrainedConfig) -> set[str]:
    keys = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    if dataclasses.is_dataclass(config):
        keys |= {f.name for f in dataclasses.fields(config)}
    return {key for key in keys if not key.startswith("_")} - _RESERVED_KEYS


_SIZE_KEY = re.compile(r"^(num_|n_)|(_size|_dim|_embd|_positions|_embeddings|_heads|_layers|_layer|_head|_ctx)$")
"""Config keys that are counts or sizes (hidden_size, num_hidden_layers, max_position_embeddings, n_embd, ...)."""


def _check_override_values(config: PretrainedConfig, overrides: dict[str, Any]) -> None:
    """transformers accepts a negative or fractional size and fails later, deep inside a layer (or never): a size
    the family defines as a positive whole number must be given as one."""
    for key, value in overrides.items():
        default = getattr(config, key, None)
        is_size = _SIZE_KEY.search(key) and isinstance(default, int) and not isinstance(default, bool) and default > 0
        if is_size and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UsageError.single("--model-config", f"{key}={value!r}: must be a whole number of at least 1")


def _check_override_keys(config: PretrainedConfig, overrides: dict[str, Any], model_type: str) -> None:
    """transformers accepts unknown config kwargs silently (they become attributes nothing reads): refuse them."""
    valid = _valid_keys(config)
    unknown = [key for key in overrides if key not in valid]
    if not unknown:
        _check_override_values(config, overrides)
        return
    key = unknown[0]
    close = difflib.get_close_matches(key, sorted(valid), n=4, cutoff=0.5)
    common: list[str] = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                          "vocab_size", "max_position_embeddings") if k in valid]
    suggestions = list(dict.fromkeys(close + common))[:8]
    message = f"{model_type} configs have no key {key!r}; valid keys include {', '.join(suggestions)}"
    raise UsageError.single("--model-config", message)


def _config_from_type(model_type: str, overrides: dict[str, Any]) -> PretrainedConfig:
    transformers = _import_transformers()
    try:
        defaults = transformers.AutoConfig.for_model(model_type)
    except ValueError:
        raise UsageError.single("--model", (
            f"{HF_PREFIX}{model_type}: unknown transformers model type; give a type such as hf:gpt2, hf:llama, "
            f"hf:qwen2 or hf:mistral, or a local model directory")) from None
    _check_override_keys(defaults, overrides, model_type)
    kwargs = dict(overrides)
    vocab = kwargs.get("vocab_size", getattr(defaults, "vocab_size", None))
    if isinstance(vocab, int):
        # A shrunk vocabulary leaves the family's special-token ids (gpt2: 50256) out of range; with byte tokens they
        # mean nothing, so drop them rather than keep a config transformers calls invalid.
        for key in _SPECIAL_TOKEN_KEYS:
            value = getattr(defaults, key, None)
            ids = value if isinstance(value, list) else [value]
            if key not in kwargs and any(isinstance(i, int) and i >= vocab for i in ids):
                kwargs[key] = None
    try:
        # Overrides go through the constructor (not setattr) so derived fields such as head_dim follow them.
        return transformers.AutoConfig.for_model(model_type, **kwargs)
    except Exception as error:  # noqa: BLE001 - strict-dataclass validation raises several types; all are bad input
        raise UsageError.single("--model-config", f"{HF_PREFIX}{model_type}: {_one_line(error)}") from None


def _on_meta(config: PretrainedConfig, flag: str) -> nn.Module:
    """The model ``config`` describes, built on the meta device (no memory, no init: 7B in < 1 s); a config that is
    no causal LM, or does not build, is a UsageError naming ``flag``."""
    transformers = _import_transformers()
    try:
        with torch.device("meta"):
            model: nn.Module = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return model
    except ValueError as error:
        if "Unrecognized configuration class" in str(error):
            raise UsageError.single("--model", (
                f"{config.model_type} is not a causal language model (transformers has no AutoModelForCausalLM "
                f"for it); cadence trains next-token prediction: use a decoder such as gpt2, llama, qwen2, mistral"
            )) from None
        raise UsageError.single(flag, f"{config.model_type}: {_one_line(error)}") from None
    except Exception as error:  # noqa: BLE001 - a shape that does not build (heads not dividing the width, ...)
        raise UsageError.single(flag, f"{config.model_type}: {_one_line(error)}") from None


def _count_on_meta(config: PretrainedConfig, flag: str) -> int:
    """Parameters of the model ``config`` describes, counted on the meta device."""
    return sum(p.numel() for p in _on_meta(config, flag).parameters())


def _first_int(config: PretrainedConfig, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_shape(model: nn.Module, config: PretrainedConfig) -> ModelShape:
    """Read the sizes of a built transformers model (attribute_map makes gpt2's n_embd answer to hidden_size)."""
    hidden = _first_int(config, "hidden_size", "d_model", "n_embd") or 0
    heads = _first_int(config, "num_attention_heads", "n_head")
    kv_heads = _first_int(config, "num_key_value_heads", "n_kv_heads") or heads
    head_dim = _first_int(config, "head_dim") or (hidden // heads if heads else None)
    intermediate = _first_int(config, "intermediate_size", "n_inner", "ffn_dim", "d_ff")
    if intermediate is None and getattr(config, "model_type", "") in ("gpt2", "gpt_neo", "gptj", "gpt_bigcode"):
        intermediate = 4 * hidden  # these families store None and mean 4 x width
    transformers_model: Any = model  # its methods are transformers', not nn.Module's
    inputs, outputs = transformers_model.get_input_embeddings(), transformers_model.get_output_embeddings()
    tied = outputs is not None and inputs is not None and outputs.weight is inputs.weight
    context = _first_int(config, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
    return ModelShape(
        num_layers=_first_int(config, "num_hidden_layers", "n_layer", "num_layers") or 0, hidden_size=hidden,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        vocab_size=int(config.vocab_size), context_length=context or _FALLBACK_CONTEXT_LENGTH,
        num_parameters=sum(p.numel() for p in model.parameters()), tied_embeddings=tied,
    )


def _dropout_note(config: PretrainedConfig) -> list[str]:
    """Dropout makes each forward random, so micro x accum splits agree only in expectation, not exactly."""
    active = {
        key: value for key, value in config.to_dict().items()
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value > 0
        and not key.startswith("summary_")  # gpt2's summary head belongs to the double-heads model, not the LM
    }
    if not active:
        return []
    settings = " ".join(f"--model-config {key}=0" for key in sorted(active))
    listed = ", ".join(f"{key}={value}" for key, value in sorted(active.items()))
    return [f"the model trains with dropout ({listed}): splits agree only in expectation; {settings} turns it off"]


def _check_causal(model: nn.Module, vocab_size: int, flag: str) -> None:
    """Refuse a model whose early logits depend on later tokens (bert's LM head without is_decoder, for example).

    Such a model would see the token it is asked to predict, and right padding would change real positions' logits.
    A local generator keeps the probe from consuming the caller's seeded RNG.
    """
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (1, 6), generator=generator)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % vocab_size
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            a = model(input_ids=ids).logits[0, :-1]
            b = model(input_ids=changed).logits[0, :-1]
    finally:
        model.train(was_training)
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
        hint = " (for bert-like models: --model-config is_decoder=true)" if flag == "--model-config" else ""
        raise UsageError.single("--model", (
            f"the model is not causal: earlier positions see later tokens{hint}; cadence needs a decoder-only "
            f"causal LM such as gpt2, llama, qwen2 or mistral"))


def _check_byte_vocab(vocab_size: int, flag: str) -> None:
    if vocab_size < BYTE_VOCAB:
        message = f"vocab_size is {vocab_size}, but without a tokenizer cadence feeds bytes: it needs >= {BYTE_VOCAB}"
        raise UsageError.single(flag, message)


def _type_config(model_type: str, overrides: dict[str, Any], max_parameters: int | None) -> PretrainedConfig:
    """The config of ``hf:TYPE`` with ``overrides``, checked: byte tokens fit its vocabulary, and it is a causal LM of
    at most ``max_parameters`` (None: any size)."""
    config = _config_from_type(model_type, overrides)
    flag = "--model-config" if overrides else "--model"
    _check_byte_vocab(int(config.vocab_size), "--model-config")
    count = _count_on_meta(config, flag)
    if max_parameters is not None and count > max_parameters:
        sizes = "these settings" if overrides else "its default sizes"
        raise UsageError.single("--model", (
            f"{HF_PREFIX}{model_type} with {sizes} has {count / 1e9:.2f}B parameters, more than the "
            f"{max_parameters / 1e9:g}B cadence builds from a config (random init); shrink it with --model-config, "
            f"e.g. {_SHRINK_HINT}"))
    return config


def _build_from_type(model_type: str, overrides: dict[str, Any], max_parameters: int | None) -> HFModel:
    transformers = _import_transformers()
    config = _type_config(model_type, overrides, max_parameters)
    flag = "--model-config" if overrides else "--model"
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001 - the meta build succeeded, so this is the config's values
        raise UsageError.single(flag, f"{model_type}: {_one_line(error)}") from None
    listed = f" with {', '.join(f'{k}={v}' for k, v in overrides.items())}" if overrides else ""
    return _finish(model, config, None, flag, f"{HF_PREFIX}{model_type}{listed}, random init", [])


def _finish(model: nn.Module, config: PretrainedConfig, tokenizer: Any | None, flag: str, what: str,
            notes: list[str], pending: PretrainedFiles | None = None, twin: nn.Module | None = None) -> HFModel:
    """The checks every model gets (vocabulary fits the tokens, causal), then the :class:`HFModel`."""
    vocab = int(config.vocab_size)
    if tokenizer is None:
        _check_byte_vocab(vocab, flag)
    elif len(tokenizer) > vocab:
        raise UsageError.single("--model", f"{what}: the tokenizer has {len(tokenizer)} tokens, the model {vocab}")
    # A model still on the meta device is checked on its twin (HFModel.probe).
    _check_causal(*((twin, int(getattr(twin, "config").vocab_size)) if twin is not None else (model, vocab)), flag)
    # Training never generates: a KV cache would keep every layer's keys and values alive until the step ends
    # (defeating activation checkpointing) and grow again in each recompute (which breaks selective recompute). Off on
    # the model's own config too: from_pretrained(config=...) keeps a copy of it (a save_pretrained directory with
    # "use_cache": true failed selective recompute with a "not found in storage" error).
    held: Any  # a transformers config, or None where there is none
    for held in (config, getattr(model, "config", None), getattr(twin, "config", None)):
        if getattr(held, "use_cache", None):
            held.use_cache = False
    # Packed rows (--packing) attend example by example instead of through a dense mask (issue 30: transformers'
    # mask made packing slower than padding); every other batch runs transformers' SDPA as before.
    for built in (model, twin) if twin is not None else (model,):
        use_packed_attention(built)
    shape = model_shape(model, config)
    tokens = f"tokenizer with {len(tokenizer)} tokens" if tokenizer is not None else "byte tokens"
    return HFModel(
        model=model, config=config, tokenizer=tokenizer, context_length=shape.context_length, vocab_size=vocab,
        shape=shape, source=f"{what} ({shape.num_parameters:,} parameters, {tokens})",
        notes=_dropout_note(config) + notes, pending=pending, twin=twin,
    )


def _directory_config(path: Path, overrides: dict[str, Any]) -> PretrainedConfig:
    """The config of the model directory ``path`` with ``overrides``, checked to be a causal LM."""
    transformers = _import_transformers()
    if not (path / "config.json").is_file():
        raise UsageError.single("--model", f"{path} has no config.json; give a save_pretrained directory or hf:TYPE")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # noqa: BLE001 - unreadable or unknown config.json
        raise UsageError.single("--model", f"{path}/config.json: {_one_line(error)}") from None
    if overrides:
        _check_override_keys(config, overrides, config.model_type)
        try:
            config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, **overrides)
        except Exception as error:  # noqa: BLE001
            raise UsageError.single("--model-config", _one_line(error)) from None
    _count_on_meta(config, "--model")  # refuses non-causal-LM types with the same message as hf:TYPE
    return config


def _build_from_directory(path: Path, overrides: dict[str, Any], *, shard_later: bool = False) -> HFModel:
    transformers = _import_transformers()
    config = _directory_config(path, overrides)
    if shard_later and (deferred := _build_on_meta(path, config)) is not None:
        return deferred
    try:
        # dtype fp32: transformers 5 would otherwise load a bf16 checkpoint in bf16, and cadence keeps fp32 master
        # weights (mixed precision is autocast's job).
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), config=config, local_files_only=True, dtype=torch.float32, output_loading_info=True
        )
    except Exception as error:  # noqa: BLE001 - missing or mismatched weight files, custom code, ...
        if overrides and "mismatched" in str(error):
            raise UsageError.single("--model-config", (
                f"{path}: the saved weights do not fit the config with {', '.join(overrides)} overridden; override "
                f"only settings that keep the weights' shapes (dropout, rope scaling, ...)")) from None
        raise UsageError.single("--model", f"{path}: {_one_line(error)}") from None
    fresh = sorted(info.get("missing_keys", ())) + sorted(str(k) for k in info.get("mismatched_keys", ()))
    shown = ", ".join(fresh[:5]) + (f" and {len(fresh) - 5} more" if len(fresh) > 5 else "")
    notes = [f"{len(fresh)} weights were not in the checkpoint and start from random init: {shown}"] if fresh else []
    return _finish(model, config, _load_tokenizer(path), "--model", f"{config.model_type} from {path}", notes)


def _build_on_meta(path: Path, config: PretrainedConfig) -> HFModel | None:
    """The model of directory ``path`` with its parameters on the meta device, to be read shard by shard once FSDP2
    has sharded it; None when its files cannot be read that way (the caller then loads it whole)."""
    transformers = _import_transformers()
    files = PretrainedFiles.from_directory(path)
    if files is None:
        return None
    try:
        with parameters_on_meta():
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        twin = _probe_twin(config)
    except Exception:  # noqa: BLE001 - whatever does not build this way loads as before (from_pretrained says why)
        return None
    if files.coverage_problem(model) is not None:
        return None
    # What from_pretrained also reads from the directory: the generation settings a --save-hf export carries on.
    if (path / "generation_config.json").is_file():
        with contextlib.suppress(Exception):
            model.generation_config = transformers.GenerationConfig.from_pretrained(str(path), local_files_only=True)
    model.eval()  # as from_pretrained returns it; the engine sets train mode for its steps
    return _finish(model, config, _load_tokenizer(path), "--model", f"{config.model_type} from {path}", [],
                   pending=files, twin=twin)


_TWIN_VOCAB = 512
"""The twin's vocabulary (at least the 256 byte tokens the causal check may draw)."""


def _probe_twin(config: PretrainedConfig) -> nn.Module:
    """The same family with the same settings at one layer and a vocabulary of :data:`_TWIN_VOCAB`, randomly
    initialised in an RNG of its own (the run's seeded draws are untouched): a few MB, where the model's own probe
    under FSDP2 would gather its embeddings and head whole. Raises whatever a family refuses (the caller then loads
    the model whole, as before)."""
    transformers = _import_transformers()
    twin = copy.deepcopy(config)
    twin.num_hidden_layers = 1
    if isinstance(getattr(twin, "layer_types", None), list):
        twin.layer_types = twin.layer_types[:1]
    twin.vocab_size = min(int(config.vocab_size), _TWIN_VOCAB)
    for key in _SPECIAL_TOKEN_KEYS:  # an id past the small vocabulary would be an embedding's invalid padding index
        value = getattr(twin, key, None)
        if isinstance(value, int) and value >= twin.vocab_size:
            setattr(twin, key, None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(twin, dtype=torch.float32)
    model.eval()
    return model


def _load_tokenizer(path: Path) -> Any | None:
    """The tokenizer saved next to the model, or None when there is none, or when it is the byte-level one that
    ``--save-hf`` writes for a model trained on bytes (cadence then uses bytes, as it did for that model)."""
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    transformers = _import_transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # noqa: BLE001 - e.g. a sentencepiece model without the sentencepiece package
        raise UsageError.single("--model", f"{path}: could not load its tokenizer: {_one_line(error)}") from None
    return None if _reads_bytes(tokenizer) else tokenizer


_BYTE_PROBE = "Bytes: é, ü, 日本, 🙂\n\t<0x41> ~ \x7f"
"""ASCII, two-, three- and four-byte UTF-8, control bytes and a spelling of a byte-fallback token."""


def _reads_bytes(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is byte-level as cadence is: 256 ids, each text's ids its UTF-8 bytes, nothing added.
    Reading such a model's data through it instead would make it a tokenizer model (packed text refused, an EOS
    after every text), unlike the byte-level run that trained it."""
    try:
        return len(tokenizer) == BYTE_VOCAB and list(tokenizer(_BYTE_PROBE)["input_ids"]) == list(_BYTE_PROBE.encode())
    except Exception:  # noqa: BLE001 - any tokenizer that cannot say is not cadence's bytes
        return False


def packed_attention_supported() -> bool:
    """Whether this transformers keeps packed examples apart: given ``position_ids`` that restart at 0 and no
    attention mask, its causal mask becomes block-diagonal (``masking_utils.find_packed_sequence_indices``). Without
    it, packed rows would attend across examples, silently: --packing is then refused."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


def model_tokenizer(spec: str) -> Any | None:
    """The tokenizer ``--model`` reads its data with, without building the model: a model directory's own, or None
    (byte tokens) for ``hf:TYPE`` and the built-in models."""
    if spec.startswith(HF_PREFIX) or not Path(spec).is_dir():
        return None
    with quiet_transformers():
        return _load_tokenizer(Path(spec))


def meta_model(spec: str, overrides: dict[str, Any], *,
               max_parameters: int | None = DEFAULT_MAX_PARAMETERS) -> tuple[nn.Module, PretrainedConfig]:
    """The model ``spec`` names (``hf:TYPE`` or a model directory, with ``overrides``) and its config, built on the
    meta device: every module and parameter shape, no memory, no initialisation, no weights read. Bad input is the
    UsageError :func:`build_hf_model` would raise for it."""
    with quiet_transformers():
        if spec.startswith(HF_PREFIX):
            model_type = spec[len(HF_PREFIX):].strip()
            if not model_type:
                raise UsageError.single("--model", "hf: needs a model type, e.g. hf:llama or hf:gpt2")
            config = _type_config(model_type, overrides, max_parameters)
            return _on_meta(config, "--model-config" if overrides else "--model"), config
        path = Path(spec)
        if not path.is_dir():
            raise UsageError.single("--model", f"{spec} is neither hf:TYPE nor an existing model directory")
        config = _directory_config(path, overrides)
        return _on_meta(config, "--model"), config


def build_hf_model(
    spec: str, overrides: dict[str, Any], *, max_parameters: int | None = DEFAULT_MAX_PARAMETERS,
    shard_later: bool = False,
) -> HFModel:
    """Build ``hf:TYPE`` (random init from the config defaults + ``overrides``) or load a ``save_pretrained`` directory.

    Seed the global RNG first for reproducible random weights. ``max_parameters`` (None: no limit) applies to
    ``hf:TYPE`` only: loading a directory is an explicit choice of size. Every problem is a :class:`UsageError`
    naming ``--model`` or ``--model-config``. ``shard_later`` (FSDP2): a directory whose safetensors name every
    parameter is built on the meta device and its weights left to each rank's shard (``HFModel.pending``).
    """
    with quiet_transformers():
        if spec.startswith(HF_PREFIX):
            model_type = spec[len(HF_PREFIX):].strip()
            if not model_type:
                raise UsageError.single("--model", "hf: needs a model type, e.g. hf:llama or hf:gpt2")
            return _build_from_type(model_type, overrides, max_parameters)
        path = Path(spec)
        if not path.is_dir():
            raise UsageError.single("--model", f"{spec} is neither hf:TYPE nor an existing model directory")
        return _build_from_directory(path, overrides, shard_later=shard_later)


def _unwrap(model: nn.Module) -> nn.Module:
    """The PreTrainedModel inside DDP (``.module``) or torch.compile (``._orig_mod``) wrappers."""
    while not hasattr(model, "save_pretrained"):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def save_hf(model: nn.Module, directory: Path, tokenizer: Any | None = None,
            weights: Mapping[str, torch.Tensor] | None = None, *, replace: bool = False,
            chat_template: str | None = None, weights_file: Path | None = None) -> None:
    """Write ``model`` (and its tokenizer) with ``save_pretrained``; ``AutoModelForCausalLM.from_pretrained`` loads it.
    A model with LoRA adapters (--lora-rank) writes the adapter alone, as ``PeftModel.save_pretrained`` does:
    ``peft.PeftModel.from_pretrained(base, directory)`` loads it onto its base.

    The files are written into a temporary sibling directory and renamed into place, so ``directory`` never holds a
    half-written model. ``tokenizer`` may be a transformers tokenizer, a wrapper with a ``.hf_tokenizer`` attribute
    (``cadence.data.hf.HFTokenizer``; ``cadence.data.hf.ByteTokenizer`` for a byte-level model, whose wrapper also
    gives the ``config_token_ids`` the saved config and generation config must carry, in place of the model family's
    defaults), or None (nothing to save). ``weights`` replaces the model's own state_dict (FSDP2 shards the model's
    parameters; the caller gathers them whole). ``replace``: ``directory`` holds this run's own earlier export (a
    segment stopped by a signal exports too); it is swapped for the new one only once the new one is complete.
    ``chat_template``: the Jinja template a chat-trained model was trained under, saved with the tokenizer, so that
    ``apply_chat_template`` renders conversations as the model learned them. ``weights_file``: a safetensors file
    of the model's whole state dict (an FSDP2 run's final weights, written a tensor at a time), copied into the
    export a tensor at a time under the names ``save_pretrained`` writes (each tied tensor once), in place of
    ``weights``: nothing holds the whole model.
    """
    inner: Any = _unwrap(model)  # a transformers (or peft) model: its methods are not nn.Module's
    if not hasattr(inner, "save_pretrained"):
        message = "only Hugging Face models (--model hf:TYPE or a model directory) can be saved this way"
        raise UsageError.single("--save-hf", message)
    if not replace:
        export_problem = save_hf_problem(directory)
        if export_problem is not None:
            raise UsageError.single("--save-hf", export_problem)
    token_ids: Mapping[str, int | None] = getattr(tokenizer, "config_token_ids", None) or {}
    tokenizer = getattr(tokenizer, "hf_tokenizer", tokenizer)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
    try:
        with quiet_transformers(), transformers_attention(inner):
            if is_lora(inner):
                write_adapter(inner, staging, weights if weights_file is None else _adapter_tensors(weights_file))
            elif weights_file is not None:
                inner.save_pretrained(str(staging), safe_serialization=True, state_dict={})  # config files only
                copy_tensors(weights_file, staging / SAFETENSORS_FILE, _saved_names(inner), {"format": "pt"})
            else:
                inner.save_pretrained(str(staging), safe_serialization=True,
                                      state_dict=None if weights is None else dict(weights))
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                if chat_template is not None:
                    tokenizer.chat_template = chat_template
                tokenizer.save_pretrained(str(staging))
        _set_token_ids(staging, token_ids)
        os.chmod(staging, 0o755)  # mkdtemp makes 0700; a saved model is meant to be shared
        earlier = None
        if directory.exists() and replace and any(directory.iterdir()):
            # The earlier export steps aside only now, and is removed once the new one is in place.
            earlier = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.earlier."))
            os.replace(directory, earlier / "export")
        elif directory.exists():
            directory.rmdir()  # empty (checked above): os.replace cannot replace a directory
        os.replace(staging, directory)
        if earlier is not None:
            shutil.rmtree(earlier, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _saved_names(model: nn.Module) -> list[str]:
    """The tensors ``save_pretrained`` writes: the state dict's, a tied tensor once, under its first name."""
    seen: set[int] = set()
    names = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.append(name)
    return names


def _adapter_tensors(weights_file: Path) -> dict[str, torch.Tensor]:
    """The LoRA tensors of a whole state dict's file (cadence's adapters have no bias and no saved modules: the
    adapter is exactly its ``lora_`` tensors), read alone."""
    stored = read_header(weights_file)
    return {name: read_tensor(entry) for name, entry in stored.items() if "lora_" in name}


def save_hf_problem(directory: Path) -> str | None:
    """Why ``directory`` cannot take a new --save-hf export (None: it can): a file, or a directory with files."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        return f"{directory} already exists and is not empty; give a new directory"
    return None


def _set_token_ids(directory: Path, token_ids: Mapping[str, int | None]) -> None:
    """Give the saved config.json and generation_config.json these special-token ids (the model in memory keeps its
    own): ``generate`` reads its EOS from the generation config."""
    for name in ("config.json", "generation_config.json"):
        path = directory / name
        if not token_ids or not path.is_file():
            continue
        content = json.loads(path.read_text(encoding="utf-8"))
        content.update(token_ids)
        path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")


__all__ = [
    "BYTE_VOCAB", "DEFAULT_MAX_PARAMETERS", "HFModel", "HF_PREFIX", "ModelShape", "build_hf_model", "is_hf_model",
    "meta_model", "model_shape", "model_tokenizer", "packed_attention_supported", "parse_model_overrides", "quiet_transformers", "save_hf",
    "save_hf_problem",
]
