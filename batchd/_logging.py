"""Process logging for the `batchd` services: plain text or structured JSON lines.

`--log-format json` writes one JSON object per record to stderr, with stable keys (`ts` ISO-8601 UTC,
`level`, `logger`, `pid`, `msg`) plus any `extra={...}` fields the caller attached (`rank`, `round`,
`port`, ...), so a log shipper can index by field instead of parsing sentences. Text format keeps the
familiar `time LEVEL logger[pid]: message` line.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys

_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line; `extra` fields are kept, exceptions go in `exc`."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": _dt.datetime.fromtimestamp(record.created, _dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = value if isinstance(value, str | int | float | bool | type(None)) else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str = "INFO", fmt: str = "text", stream=None) -> None:
    """Configures the root logger once for a `batchd` process (replaces earlier handlers)."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt=}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
