"""The training configuration: the schema (one typed dataclass), its validation, and where values come from."""

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

__all__ = [
    "DEVICE_CHOICES", "FIELD_NAMES", "MAX_SEED", "STRATEGIES", "DeviceName", "Strategy", "TrainConfig",
    "distributed_problems", "field_help", "flag", "hint_types", "is_cadence_config", "parse_size", "read_field_docs",
    "resolve_device", "run_directory_problem", "validate",
]
