"""batchd's daemon: the gRPC alignment coordinator and the per-rank batching service."""

from ._coord_client import CoordinatorClient, CoordinatorError
from ._coordinator import CoordinatorServicer, CoordinatorState, JobFailed, create_server
from ._main import run_coordinator, run_rank
from ._metrics import CoordinatorMetrics, RankMetrics, start_metrics_server, stop_metrics_server
from ._rank_service import RankServiceCore, RankServicer, collate, create_rank_server
from ._security import Security, add_port, channel, server_interceptors
from ._sources import EXHAUSTED, IngestSource, SyntheticSource, loss_tokens_of, synthetic_payload
from ._spec import JobSpec

__all__ = sorted([
    "EXHAUSTED", "CoordinatorClient", "CoordinatorError", "CoordinatorServicer", "CoordinatorState",
    "IngestSource", "JobFailed", "JobSpec", "RankServiceCore", "RankServicer", "SyntheticSource", "collate",
    "create_rank_server", "create_server", "loss_tokens_of", "run_coordinator", "run_rank", "synthetic_payload",
    "CoordinatorMetrics", "RankMetrics", "start_metrics_server", "stop_metrics_server",
    "Security", "add_port", "channel", "server_interceptors",
])
