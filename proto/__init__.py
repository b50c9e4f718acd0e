"""batchd's wire layer: the batchd.v1 schema (generated protobuf and gRPC stubs, see generate.py), the
conversion between its messages and the core's types (`wire`), and the transport every party shares
(channel options, TLS, the bearer token, which failures are transient; `_transport`), and how every
party reports long work to a human (`Progress`: a tqdm bar on a terminal, else a line every
$BATCHD_PROGRESS_S seconds; `_progress`).

Imports only `batchd.core`; the service and the client both build on it.
"""

from . import wire
from ._progress import PROGRESS_ENV, Progress, ProgressOutput, format_duration, progress_interval
from ._transport import (
    AUTH_HEADER,
    CHANNEL_OPTIONS,
    GRPC_OPTIONS,
    KEEPALIVE_MS,
    MAX_MESSAGE_BYTES,
    WAIT_LOG_S,
    BearerTokenChannel,
    Security,
    Unreachable,
    channel,
    check_token,
    retry_while_unreachable,
    transient,
)

__all__ = [
    "AUTH_HEADER",
    "BearerTokenChannel",
    "CHANNEL_OPTIONS",
    "GRPC_OPTIONS",
    "KEEPALIVE_MS",
    "MAX_MESSAGE_BYTES",
    "PROGRESS_ENV",
    "Progress",
    "ProgressOutput",
    "Security",
    "Unreachable",
    "WAIT_LOG_S",
    "channel",
    "check_token",
    "format_duration",
    "progress_interval",
    "retry_while_unreachable",
    "transient",
    "wire",
]
