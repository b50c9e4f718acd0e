"""The flags and helpers the `batchd` commands share: `--config`, the job spec, serving, security, and
the overrides they make of a job config's keys (`batchd._config.load_config`).

Flags default to None ("not given") so a config file's value survives unless the flag is given; the help
strings state the built-in defaults, which live in the config dataclasses and `batchd.core.JobSpec` (the
job flags are derived from its leaves, `KEYS`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from batchd._job_keys import add_job_flags
from batchd._logging import setup_logging
from batchd.core import KEYS


def positive(text: str) -> int:
    """argparse type: an integer >= 1 (else its error message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="job config file (TOML, or YAML by extension); flags override its keys. "
        "`batchd config --example` prints a commented one",
    )


def add_spec(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job spec ([job]; identical on the coordinator and every rank)")
    add_job_flags(g)


SPEC_FLAGS = tuple(KEYS)


def add_security(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security ([security]; default: plaintext, no token, loopback only)")
    g.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain this service presents")
    g.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", metavar="FILE", help="PEM CA bundle that peers' certificates must chain to")
    g.add_argument(
        "--tls-client-auth",
        dest="client_auth",
        action="store_const",
        const=True,
        help="mutual TLS: require callers to present a certificate signed by --tls-ca",
    )
    g.add_argument("--token-file", metavar="FILE", help="file holding the shared bearer token")


SECURITY_FLAGS = ("tls_cert", "tls_key", "tls_ca", "client_auth", "token_file")


def add_server(p: argparse.ArgumentParser, role: str) -> None:
    g = p.add_argument_group(f"serving ([{role}], [logging])")
    g.add_argument("--host", help="address to listen on (default: 127.0.0.1, loopback only)")
    g.add_argument("--port", type=int, help="port (0 picks a free one; default from the config, else 0)")
    g.add_argument("--port-file", default=None, help="write the bound ports here as JSON")
    g.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: a free one)")
    g.add_argument("--metrics-host", help="address of the metrics endpoint (default: --host)")
    g.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="logging level (default INFO)",
    )
    g.add_argument("--log-format", choices=("text", "json"), help="text lines or one JSON object per line")


def overrides(
    args: argparse.Namespace, section: str, names: Sequence[str], rename: dict[str, str] | None = None
) -> dict[str, object]:
    """{"SECTION.KEY": value} of the flags `names` that were given (not None); `rename`: flag -> key."""
    rename = rename or {}
    return {
        f"{section}.{rename.get(n, n)}": getattr(args, n) for n in names if getattr(args, n, None) is not None
    }


def common_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The overrides of the flags every service takes: the job spec, security and logging."""
    out = overrides(args, "job", SPEC_FLAGS)
    out |= overrides(args, "security", SECURITY_FLAGS)
    out |= overrides(
        args, "logging", ("log_level", "log_format"), {"log_level": "level", "log_format": "format"}
    )
    return out


def setup_job_logging(cfg: Any) -> None:
    """Sets up logging as the merged config's [logging] says."""
    setup_logging(cfg.logging.level, cfg.logging.format)
