"""Job config files: `load_config(path, overrides)` -> a validated `Config` (see `batchd._config`)."""

from batchd._config import (
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

__all__ = [
    "EXAMPLE",
    "Config",
    "ConfigError",
    "CoordinatorConfig",
    "DataConfig",
    "LoggingConfig",
    "PipelineConfig",
    "RankConfig",
    "SecurityConfig",
    "build_config",
    "example_config",
    "load_config",
    "read_config_file",
]
