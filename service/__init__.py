"""batchd's daemon: the gRPC alignment coordinator, the per-rank batching service, the node agent that
serves a host's ranks over one coordinator stream, the server side of
the security policy, metrics, and (in `batchd.service.preprocess`) the preprocessing data plane.

Imports `batchd.core` and `batchd.proto` only; it needs no torch (batches are collated in numpy).
"""

from ._coord_client import CoordinatorClient
from ._journal import Journal, JournalError, decode_records, encode_record
from ._metrics import CoordinatorMetrics, RankMetrics, RateWindow
from ._metrics_http import MergedRegistry, start_metrics_server, stop_metrics_server
from ._node import NodeAgent
from ._node_link import LocalRankClient, NodeLink
from ._run_coordinator import run_coordinator
from ._run_node import node_ranks, run_node
from ._run_rank import run_rank
from ._security import add_port, server_interceptors
from ._service_config import Endpoint, ServiceConfig, SourceOptions
from .coordinator import CoordinatorServicer, CoordinatorState, create_server
from .rank import Limits, RankServiceCore, RankServicer, collate, create_rank_server

__all__ = [
    "CoordinatorClient",
    "CoordinatorMetrics",
    "CoordinatorServicer",
    "CoordinatorState",
    "Endpoint",
    "Journal",
    "JournalError",
    "Limits",
    "LocalRankClient",
    "MergedRegistry",
    "NodeAgent",
    "NodeLink",
    "RankMetrics",
    "RankServiceCore",
    "RankServicer",
    "RateWindow",
    "ServiceConfig",
    "SourceOptions",
    "add_port",
    "collate",
    "create_rank_server",
    "create_server",
    "decode_records",
    "encode_record",
    "node_ranks",
    "run_coordinator",
    "run_node",
    "run_rank",
    "server_interceptors",
    "start_metrics_server",
    "stop_metrics_server",
]
