"""The `[job]` section and the job flags, both derived from `batchd.core.JobSpec` alone.

A `[job]` section holds the spec's top-level fields (`world_size`, `token_budget`, `mode`, ...) and one
table per part (`[job.policy]`, `[job.cost]`, `[job.phases]`, `[job.updates]`) whose keys are the part's
fields (`name`, `window`, ...). Command-line flags are the leaves' keys (`batchd.core.KEYS`: `--policy`,
`--window`, `--nodes`, `--cost`, `--phases`, ...); an override `job.KEY` lands in its part's table.

A file of the flat form of batchd 0.1.0's first drafts (`window = 64` under `[job]`, `node_aware` /
`node_local`) still loads: `migrate_job` moves each flat key to its nested place and logs one warning
line naming the new key.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from batchd.core import GROUPS, KEYS, REQUIRED, JobSpec

log = logging.getLogger("batchd.config")
TOP = tuple(f.name for f in dataclasses.fields(JobSpec) if f.name not in GROUPS)
# The two booleans of the first drafts, now `policy.nodes`: (node_aware, node_local) -> nodes.
_NODES = {(True, True): "aware", (True, False): "aware", (False, True): "local", (False, False): "blind"}


def migrate_job(body: Mapping[str, Any], where: str = "config") -> dict[str, Any]:
    """`body` ([job] as read from a file) in the nested form: each flat key of a part moved into its
    table, with one warning line naming the new key. Unknown keys are left for `job_spec` to refuse."""
    out: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    for key, value in body.items():
        if key in GROUPS and isinstance(value, Mapping):
            out[key] = dict(value)
        elif key in ("node_aware", "node_local") or (key in KEYS and KEYS[key].group is not None):
            flat[key] = value
        else:
            out[key] = value
    if "node_aware" in flat or "node_local" in flat:
        aware, local = flat.pop("node_aware", False), flat.pop("node_local", True)
        flat["nodes"] = _NODES.get((aware, local), f"node_aware={aware!r}, node_local={local!r}")
        log.warning(
            "%s: job.node_aware / job.node_local are now job.policy.nodes: [job.policy] nodes = %r",
            where,
            flat["nodes"],
        )
    for key, value in flat.items():
        item = KEYS[key]
        table = out.setdefault(str(item.group), {})
        if not isinstance(table, dict) or item.field.name in table:
            raise ValueError(f"job.{key} is set twice, flat and as job.{item.path}: keep job.{item.path}")
        table[item.field.name] = value
        if key != "nodes":
            log.warning("%s: job.%s is now job.%s: [job.%s] %s = %r", where, key, item.path, item.group,
                        item.field.name, value)  # fmt: skip
    return out


def place_key(body: dict[str, Any], key: str, value: Any) -> None:
    """Sets the leaf `key` (a flag's name, `KEYS`) in a nested [job] `body`; ValueError if unknown."""
    if key not in KEYS:
        raise ValueError(f"unknown job key {key!r}; the keys are {sorted(KEYS)}")
    item = KEYS[key]
    if item.group is None:
        body[key] = value
    else:
        body.setdefault(item.group, {})[item.field.name] = value


def job_spec(body: Mapping[str, Any]) -> JobSpec:
    """The `JobSpec` of a nested [job] section; ValueError names the bad key (`job.policy.window`)."""
    for key in body:
        if key not in TOP and key not in GROUPS:
            raise ValueError(f"unknown key job.{key}; [job] takes {sorted(TOP)} and tables {sorted(GROUPS)}")
    for req in REQUIRED:
        if req not in body:
            flag = "--" + req.replace("_", "-")
            raise ValueError(f"job.{req} is required: set it under [job] in the config file or pass {flag}")
    top = {k: v for k, v in body.items() if k in TOP}
    for name, cls in GROUPS.items():
        table = body.get(name, {})
        if not isinstance(table, Mapping):
            raise ValueError(f"job.{name} must be a table ([job.{name}]), got job.{name}={table!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in table:
            if key not in known:
                raise ValueError(f"unknown key job.{name}.{key}; [job.{name}] takes {sorted(known)}")
    try:
        parts = {name: cls(**body.get(name, {})) for name, cls in GROUPS.items()}
        return JobSpec(**top, **parts).check_daemon()
    except ValueError as exc:  # the constructors name the field: policy.window, cost, world_size, ...
        raise ValueError(f"job.{exc}") from None


def add_job_flags(
    parser: Any,
    only: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    defaults: Mapping[str, Any] | None = None,
    shown: Mapping[str, Any] | None = None,
    spec_defaults: bool = False,
) -> None:
    """Adds one flag per `JobSpec` leaf (`KEYS`) to `parser` (`--token-budget` for `token_budget`,
    `--window` for `policy.window`, `--shuffle` / `--no-shuffle` for a bool), with the help, choices and
    metavar of the leaf's metadata; `dest` is the key.

    A flag's default is None ("not given", so a config file's value survives) unless `defaults` gives
    one or `spec_defaults` (commands without a config file: demo, bench, simulate) takes the spec's own;
    `shown` changes only the default the help states. Values are validated by `JobSpec` when the spec
    is built, so errors name the field.
    """
    types = {"int": int, "int | None": int, "str": str}
    for key, item in KEYS.items():
        f = item.field
        if (only is not None and key not in only) or key in exclude:
            continue
        flag, meta = "--" + key.replace("_", "-"), f.metadata
        default = (defaults or {}).get(key)
        if default is None and spec_defaults and key not in REQUIRED:
            default = f.default
        shown = shown or {}
        stated = shown.get(key, f.default if default is None else default)
        if key in REQUIRED and default is None and key not in shown:
            text = meta["help"] + " (a flag or --config's [job])"
        else:
            text = f"{meta['help']} (default: {stated})"
        if f.type == "bool":
            parser.add_argument(
                flag, dest=key, action=argparse.BooleanOptionalAction, default=default, help=text
            )
        else:
            parser.add_argument(
                flag,
                dest=key,
                type=types[str(f.type)],
                choices=meta.get("choices"),
                metavar=meta.get("metavar"),
                default=default,
                help=text,
            )
