"""Job config files: `load_config(path, overrides)` -> a validated `Config` (see `batchd._config`)."""

from batchd._config import (
    DROP,
    EXAMPLE,
    Config,
    ConfigError,
    CoordinatorConfig,
    DataConfig,
    LoggingConfig,
    PipelineConfig,
    RankConfig,
    SecurityConfig,
    build_config,
    example_config,
    load_config,
    read_config_file,
)
from batchd._logging import JsonFormatter

__all__ = [
    "DROP",
    "EXAMPLE",
    "Config",
    "ConfigError",
    "CoordinatorConfig",
    "DataConfig",
    "JsonFormatter",
    "LoggingConfig",
    "PipelineConfig",
    "RankConfig",
    "SecurityConfig",
    "build_config",
    "example_config",
    "load_config",
    "read_config_file",
]
