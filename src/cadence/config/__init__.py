"""The training configuration: the schema (one typed dataclass), its validation, and where values come from."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence.lazy import lazy_exports

if TYPE_CHECKING:  # the type checker's view of the names below (a test keeps the two the same)
    from cadence.config.schema import (
        DEVICE_CHOICES,
        FIELD_NAMES,
        MAX_SEED,
        STRATEGIES,
        DeviceName,
        Strategy,
        TrainConfig,
        field_help,
        flag,
        hint_types,
        parse_size,
        read_field_docs,
    )
    from cadence.config.validate import (
        distributed_problems,
        is_cadence_config,
        resolve_device,
        run_directory_problem,
        validate,
    )

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "cadence.config.schema": (
        "DEVICE_CHOICES", "FIELD_NAMES", "MAX_SEED", "STRATEGIES", "DeviceName", "Strategy", "TrainConfig",
        "field_help", "flag", "hint_types", "parse_size", "read_field_docs"),
    "cadence.config.validate": (
        "distributed_problems", "is_cadence_config", "resolve_device", "run_directory_problem", "validate"),
})
