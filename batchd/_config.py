"""The job config file: one TOML (or YAML) file for the coordinator, every rank service and the client side.

A file has up to seven sections; every key is optional except `job.world_size` and `job.token_budget`
(which may also come from the command line). Unknown sections or keys are errors, not silently ignored:
a typo such as `token_buget` would otherwise run a job with the default budget.

    [job]          the `batchd.core.JobSpec` every party must agree on: its top-level fields, and its
                   parts as tables [job.policy], [job.cost], [job.phases], [job.updates]
                   (batchd._job_keys; a flat [job] of the first drafts migrates, with a warning)
    [data]         where a rank service's samples come from: dataset | lengths, Ray actors, quarantine
    [pipeline]     the preprocessing chain: template, tokenizer, vision, augmentation, cutoff; or processor
    [coordinator]  listen address, the address ranks dial, lease and start-up timeout, journal, metrics port
    [rank]         listen host, base port (rank r listens on base_port + r), state dir, metrics base port
    [security]     TLS certificate/key/CA, mutual TLS, a shared bearer token (from a file)
    [logging]      level and format (text | json)

Precedence: built-in defaults < the file < command-line flags (`load_config(path, overrides)`; the CLI
passes every flag the user gave as an override keyed `section.key`). Validation runs once, up front, on
the merged result, and every error names the field, the bad value and the file, e.g.
``batchd.toml: job.token_budget must be a positive integer, got job.token_budget='8k'``.

Paths are resolved relative to the config file's directory. With `check_files=True` (the default;
the services use it) the files a party will open (dataset, lengths, tokenizer, processor, TLS material,
token) must exist when the config is loaded, so a wrong path fails at start-up rather than minutes into
a job; the deployment-file tests load configs written for another machine with `check_files=False`.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchd._job_keys import job_spec, migrate_job, place_key
from batchd.core import (
    JobSpec,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_str,
    parse_bytes,
)
from batchd.proto import Security

SECTIONS = ("job", "data", "pipeline", "coordinator", "rank", "security", "logging")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
VISIONS = ("qwen2_vl", "llava", "none")
TRUNCATE_POLICIES = ("truncate", "reject")


DROP = object()  # an override with this value removes the key (e.g. `--lengths` drops the file's dataset)


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field and the bad value."""


# The validators are batchd.core's (the ones JobSpec uses); a field's name is its "section.key".
def _port(field: str, value: Any) -> int:
    return check_int(field, value, 0, 65535)


def _opt_port(field: str, value: Any) -> int | None:
    return None if value is None else _port(field, value)


def _address(field: str, value: Any) -> str | None:
    if value is None:
        return None
    text = check_str(field, value)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field} must be HOST:PORT with a port in 1..65535, got {field}={value!r}")
    return text


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """A rank service's data source. Neither dataset nor lengths: producers push samples through Ingest."""

    dataset: str | None = None
    lengths: str | None = None
    num_actors: int = 2
    ray_address: str | None = None
    quarantine: str | None = None
    stats_file: str | None = None
    memory_budget: int | str = "2GiB"
    max_bad_fraction: float = 0.1

    def __post_init__(self) -> None:
        check_str("data.dataset", self.dataset, optional=True)
        check_str("data.lengths", self.lengths, optional=True)
        if self.dataset is not None and self.lengths is not None:
            raise ConfigError(
                f"data.dataset and data.lengths are exclusive, got data.dataset={self.dataset!r} "
                f"and data.lengths={self.lengths!r}"
            )
        check_int("data.num_actors", self.num_actors, lo=1)
        check_str("data.ray_address", self.ray_address, optional=True)
        check_str("data.quarantine", self.quarantine, optional=True)
        check_str("data.stats_file", self.stats_file, optional=True)
        try:
            parse_bytes(self.memory_budget)
        except ValueError as exc:
            raise ConfigError(f"data.memory_budget: {exc}") from None
        f = self.max_bad_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f <= 1:
            raise ConfigError(
                f"data.max_bad_fraction must be a number in [0, 1], got data.max_bad_fraction={f!r}"
            )

    def source_options(self) -> dict[str, Any]:
        """`RaySource` keywords of this section (besides where the data is)."""
        return {
            "memory_budget": parse_bytes(self.memory_budget),
            "max_bad_fraction": float(self.max_bad_fraction),
        }


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The preprocessing chain run by a rank service's Ray actors (`batchd.preprocess.default_stages`)."""

    tokenizer: str | None = None
    processor: str | None = None
    template: str = "qwen2"
    vision: str = "qwen2_vl"
    augment: bool = False
    cutoff: int | None = None
    truncate: str = "truncate"
    min_pixels: int = 56 * 56
    max_pixels: int = 14 * 14 * 4 * 1280

    def __post_init__(self) -> None:
        check_str("pipeline.tokenizer", self.tokenizer, optional=True)
        check_str("pipeline.processor", self.processor, optional=True)
        check_str("pipeline.template", self.template)
        check_choice("pipeline.vision", self.vision, VISIONS)
        check_bool("pipeline.augment", self.augment)
        if self.cutoff is not None:
            check_int("pipeline.cutoff", self.cutoff, lo=1)
        check_choice("pipeline.truncate", self.truncate, TRUNCATE_POLICIES)
        check_int("pipeline.min_pixels", self.min_pixels, lo=1)
        check_int("pipeline.max_pixels", self.max_pixels, lo=self.min_pixels)

    def stage_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `default_stages` (tokenizer and cutoff are passed separately); qwen2_vl's
        pixel bounds as its `Qwen2VLImageConfig`."""
        from batchd.service.preprocess import Qwen2VLImageConfig  # lazily: numpy, PIL

        vision: str | Qwen2VLImageConfig | None = None if self.vision == "none" else self.vision
        if vision == "qwen2_vl":
            vision = Qwen2VLImageConfig(self.min_pixels, self.max_pixels)
        return {
            "processor": self.processor,
            "template": self.template,
            "vision": vision,
            "augment": self.augment,
            "policy": self.truncate,
        }


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    """Where the coordinator listens, where ranks reach it, its liveness timeouts and its journal.

    `lease_s`: a party silent this long is gone (the job fails naming it); `startup_timeout_s`: how long
    the coordinator waits for every rank to register, and a rank service for the coordinator to answer
    (parties start in any order); `state_dir`: the coordinator's journal (restartable)."""

    host: str = "127.0.0.1"
    port: int = 0
    address: str | None = None
    lease_s: float = 60.0
    startup_timeout_s: float = 600.0
    state_dir: str | None = None
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        check_str("coordinator.host", self.host)
        _port("coordinator.port", self.port)
        _address("coordinator.address", self.address)
        check_number("coordinator.lease_s", self.lease_s)
        check_number("coordinator.startup_timeout_s", self.startup_timeout_s)
        check_str("coordinator.state_dir", self.state_dir, optional=True)
        _opt_port("coordinator.metrics_port", self.metrics_port)

    def dial_address(self) -> str | None:
        """The address rank services dial: `address`, else this host's port when it is fixed."""
        if self.address is not None:
            return self.address
        if self.port:
            host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]") else self.host
            return f"{host}:{self.port}"
        return None


@dataclasses.dataclass(frozen=True)
class RankConfig:
    """Rank services: rank r listens on `base_port + r` (0: a free port) and serves metrics on
    `metrics_base_port + r` when that is set."""

    host: str = "127.0.0.1"
    base_port: int = 0
    metrics_base_port: int | None = None
    state_dir: str | None = None
    client_grace_s: float = 600.0
    trainer_timeout_s: float = 1800.0
    retain_mb: float = 2048.0  # memory per rank for consumed batches held for a rewind to a checkpoint

    def __post_init__(self) -> None:
        check_str("rank.host", self.host)
        _port("rank.base_port", self.base_port)
        _opt_port("rank.metrics_base_port", self.metrics_base_port)
        check_str("rank.state_dir", self.state_dir, optional=True)
        check_number("rank.client_grace_s", self.client_grace_s)
        check_number("rank.trainer_timeout_s", self.trainer_timeout_s)
        check_number("rank.retain_mb", self.retain_mb, gt=-1e-9)

    def port_of(self, rank: int) -> int:
        return self.base_port + rank if self.base_port else 0

    def metrics_port_of(self, rank: int) -> int | None:
        return None if self.metrics_base_port is None else self.metrics_base_port + rank


@dataclasses.dataclass(frozen=True)
class SecurityConfig:
    """TLS material and the shared bearer token (read from `token_file`; never written in the config)."""

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    client_auth: bool = False
    token_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_ca", "token_file"):
            check_str(f"security.{name}", getattr(self, name), optional=True)
        check_bool("security.client_auth", self.client_auth)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(
                "security.tls_cert and security.tls_key go together, got "
                f"security.tls_cert={self.tls_cert!r} and security.tls_key={self.tls_key!r}"
            )
        if self.client_auth and (self.tls_ca is None or self.tls_cert is None):
            raise ConfigError(
                "security.client_auth (mutual TLS) needs security.tls_ca and a certificate, got "
                f"security.tls_ca={self.tls_ca!r} and security.tls_cert={self.tls_cert!r}"
            )

    @property
    def enabled(self) -> bool:
        return any(getattr(self, n) is not None for n in ("tls_cert", "tls_ca", "token_file"))


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    level: str = "INFO"
    format: str = "text"

    def __post_init__(self) -> None:
        level = self.level.upper() if isinstance(self.level, str) else self.level
        object.__setattr__(self, "level", check_choice("logging.level", level, LOG_LEVELS))
        check_choice("logging.format", self.format, LOG_FORMATS)


_SECTION_TYPES = {
    "data": DataConfig,
    "pipeline": PipelineConfig,
    "coordinator": CoordinatorConfig,
    "rank": RankConfig,
    "security": SecurityConfig,
    "logging": LoggingConfig,
}
PATH_FIELDS = {
    "data": ("dataset", "lengths", "quarantine", "stats_file"),
    "pipeline": ("tokenizer", "processor"),
    "rank": ("state_dir",),
    "coordinator": ("state_dir",),
    "security": ("tls_cert", "tls_key", "tls_ca", "token_file"),
}
MUST_EXIST = {
    "data": ("dataset", "lengths"),
    "pipeline": ("tokenizer", "processor"),
    "security": ("tls_cert", "tls_key", "tls_ca", "token_file"),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """A validated job config. `job` is a `batchd.core.JobSpec`."""

    job: Any
    data: DataConfig = DataConfig()
    pipeline: PipelineConfig = PipelineConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    rank: RankConfig = RankConfig()
    security: SecurityConfig = SecurityConfig()
    logging: LoggingConfig = LoggingConfig()
    source: str | None = None

    def security_object(self):
        """The `batchd.proto.Security` these settings describe, or None (plaintext, no token)."""
        if not self.security.enabled:
            return None
        s = self.security
        return Security.from_files(
            tls_cert=s.tls_cert,
            tls_key=s.tls_key,
            tls_ca=s.tls_ca,
            client_auth=s.client_auth,
            token_file=s.token_file,
        )


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Parses a TOML (.toml) or YAML (.yaml/.yml) file into nested dicts; errors name the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc.strerror or exc}") from None
    if p.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from None
        data = {} if data is None else data
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a table of sections, got {type(data).__name__}")
    return data


def _merge(
    raw: Mapping[str, Any], overrides: Mapping[str, Any], source: str | None = None
) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]; sections are {list(SECTIONS)}")
        if not isinstance(body, Mapping):
            raise ConfigError(f"[{section}] must be a table of keys, got {section}={body!r}")
        try:
            merged[section] = migrate_job(body, source or "config") if section == "job" else dict(body)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS or not key:
            raise ConfigError(f"override keys are 'section.key' with a known section, got {dotted!r}")
        if section == "job" and value is not None and value is not DROP:
            try:
                place_key(merged.setdefault("job", {}), key, value)  # a flag's key: into its part's table
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        elif value is DROP:
            merged.get(section, {}).pop(key, None)
        elif value is not None:
            merged.setdefault(section, {})[key] = value
    return merged


def _check_keys(section: str, body: Mapping[str, Any], known: tuple[str, ...]) -> None:
    for key in body:
        if key not in known:
            raise ConfigError(f"unknown key {section}.{key}; [{section}] takes {sorted(known)}")


def _resolve_paths(section: str, body: dict[str, Any], base: Path | None, from_file: set[str]) -> None:
    for name in PATH_FIELDS.get(section, ()):
        value = body.get(name)
        if isinstance(value, str) and base is not None and f"{section}.{name}" in from_file:
            body[name] = str((base / os.path.expanduser(value)) if not os.path.isabs(value) else Path(value))


def _check_files(cfg: Config) -> None:
    for section, names in MUST_EXIST.items():
        body = getattr(cfg, section)
        for name in names:
            value = getattr(body, name)
            if value is not None and not os.path.exists(value):
                raise ConfigError(
                    f"{section}.{name} names a file that does not exist, got {section}.{name}={value!r}"
                )


def _job_spec(body: dict[str, Any]) -> JobSpec:
    """The `JobSpec` of a nested [job] section, validated by JobSpec itself (its errors name the field)."""
    try:
        return job_spec(body)
    except ValueError as exc:  # its message names job.KEY and the value
        raise ConfigError(str(exc)) from None


def build_config(
    raw: Mapping[str, Any],
    overrides: Mapping[str, Any] | None = None,
    *,
    base_dir: str | os.PathLike | None = None,
    check_files: bool = True,
    source: str | None = None,
) -> Config:
    """Validates `raw` (parsed file contents) merged with `overrides` ({"section.key": value}).

    Args:
        raw: Nested sections as read from a file (`{}` for flags only).
        overrides: Values from the command line; None values are ignored (flag not given), `DROP`
            removes the key.
        base_dir: Directory that relative paths *from the file* are resolved against.
        check_files: Require the input files the config names to exist.
        source: Name used in error messages (the file path).
    """
    overrides = dict(overrides or {})
    from_file = {f"{s}.{k}" for s, body in raw.items() if isinstance(body, Mapping) for k in body}
    from_file -= {k for k, v in overrides.items() if v is not None}
    try:
        merged = _merge(raw, overrides, source)
        base = Path(base_dir) if base_dir is not None else None
        sections: dict[str, Any] = {}
        for name, cls in _SECTION_TYPES.items():
            body = merged.get(name, {})
            _check_keys(name, body, tuple(f.name for f in dataclasses.fields(cls)))
            _resolve_paths(name, body, base, from_file)
            try:
                sections[name] = cls(**body)
            except TypeError as exc:
                raise ConfigError(f"[{name}]: {exc}") from None
            except ValueError as exc:  # a validator's message already names section.key and the value
                raise ConfigError(str(exc)) from None
        cfg = Config(job=_job_spec(merged.get("job", {})), source=source, **sections)
        if check_files:
            _check_files(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}" if source else str(exc)) from None
    return cfg


def load_config(
    path: str | os.PathLike | None, overrides: Mapping[str, Any] | None = None, *, check_files: bool = True
) -> Config:
    """Reads, merges and validates a job config (`path` None: defaults and `overrides` only).

    Raises:
        ConfigError: (a ValueError) naming the file, the field and the bad value.
    """
    if path is None:
        return build_config({}, overrides, check_files=check_files)
    raw = read_config_file(path)
    return build_config(
        raw, overrides, base_dir=Path(path).resolve().parent, check_files=check_files, source=str(path)
    )


def example_config() -> str:
    """A commented example config with every section (`batchd config --example`)."""
    return EXAMPLE


EXAMPLE = """\
# batchd job config. Every party of a job (coordinator, rank services) reads the same file;
# command-line flags override single keys. Paths are relative to this file.

[job]                      # must be identical for every party (ranks register with it)
world_size = 2             # trainer ranks
token_budget = 8192        # L_max: tokens a rank's step may materialize
mode = "join"              # join (every sample once) | non-join (quota, then stop)
seed = 0
epochs = 1                 # each epoch: a new seeded view of the data per rank
# deterministic = true     # the same batches, steps and loss on every run (same data, seed, config),
                           # whatever the speed of actors and trainers; costs wall time (docs/benchmarks.md)

[job.policy]               # flags: --policy, --window, --depth, --over-budget, --collate, --nodes, ...
name = "balanced"          # balanced | local | odb | fixed | sorted
window = 128               # samples buffered per rank before grouping
depth = 4                  # batches a rank keeps ready
over_budget = "singleton"  # singleton | truncate | reject (samples longer than L_max)
collate = "padded"         # padded | packed rows
# nodes = "local"          # balanced + node agents: local (per-node rounds where they cost as node-blind:
                           # packed/attention cost), blind, or aware (balance inside each node first:
                           # padded cost where cross-node bytes dominate; docs/benchmarks.md, node-balance)

[job.cost]                 # flags: --cost, --quadratic
name = "padded"            # padded | packed | attention

# [job.phases]             # flags: --phases, --vision-quadratic, --audio-quadratic, --phase-exact-nodes
# count = 2                # balanced, join: also balance the vision encoder per step

# [job.updates]            # flags: --tokens-per-update, --samples-per-update, --update-rule
# tokens_per_update = 262144  # one optimizer update per this many global loss tokens (gradient
                           # accumulation over steps; off: one update per step)

[data]
dataset = "train.parquet"  # Parquet / JSONL / Arrow records; or lengths = "lengths.txt"
num_actors = 2             # Ray preprocessing actors per rank service
# ray_address = "auto"     # join the Ray running on this host, or give an address (default: this job's own
                           # Ray: its first rank service starts one, the job's others on this host join it)
quarantine = "quarantine.jsonl"
memory_budget = "2GiB"     # records a rank service holds read ahead: blocks are read in windows of a quarter
                           # of it, at most half of it is held (the rest: the process and its batches)
max_bad_fraction = 0.1     # the job fails once more than this share of the records read are bad

[pipeline]
tokenizer = "tok.json"     # a tokenizer.json or a Hugging Face tokenizer directory (read offline);
                           # `batchd tokenizer tok.json` writes the default (demo) one there
# processor = "Qwen2-VL-7B-Instruct"   # the model's own Hugging Face processor directory (read offline):
                           # its chat template, tokenizer and image processor replace template and vision
template = "qwen2"         # chatml | qwen2 | llama3 | Jinja text
vision = "qwen2_vl"        # qwen2_vl | llava | none
augment = false

[coordinator]
host = "127.0.0.1"         # listen address (0.0.0.0 to accept other hosts)
port = 7000
# address = "coordinator.example:7000"   # where rank services dial (default 127.0.0.1:port)
lease_s = 60.0             # a party silent this long is gone: the job fails naming it
startup_timeout_s = 600.0  # parties start in any order; each waits this long for the others
state_dir = "state/coordinator"  # its journal: killed and started again with the same command, it resumes
                           # the job (relative to this file; remove the directory to start a job over)
# metrics_port = 9100

[rank]
host = "127.0.0.1"
base_port = 7100           # rank r listens on base_port + r
# metrics_base_port = 9200
state_dir = "state/ranks"  # their journals (and the steps held since the trainers' checkpoints)
client_grace_s = 600.0     # a trainer that disconnected comes back within this: a torchrun restart
                           # that loads the model and the checkpoint
# retain_mb = 2048.0       # memory per rank for the steps held for trainers restarting from a checkpoint
# trainer_timeout_s = 1800.0   # ready batches wait this long for a trainer that has not connected

[security]
# tls_cert = "tls/server.crt"
# tls_key = "tls/server.key"
# tls_ca = "tls/ca.crt"
# client_auth = false      # mutual TLS
# token_file = "token"     # shared bearer token

[logging]
level = "INFO"
format = "text"            # text | json (one JSON object per line)
"""
