"""The gRPC alignment coordinator: the core's `Coordinator` behind two barrier RPCs, journaled.

`create_server(address, spec) -> (server, port, state)` builds it. Where each part lives:

- `_state`: `CoordinatorState`, the job's logic (thread-safe, no gRPC, no protobuf): registration, the
  align and commit barriers of every round, epochs, job end; its answers are `_answers`' core types;
- `_round`: `RoundInbox`, the round in progress: its reports and commits, its pending barriers;
- `_barrier`: `Barrier`, one barrier's outcome and how sync and async waiters get it; `ShuttingDown`;
- `_watchdog`: the lease watchdog thread (liveness, never speed);
- `_recovery`: the journal's records, the replay tables, snapshot and restore (restart after kill -9);
- `_resize`: a resized job, as functions over explicit values returning what changes (`Position`);
- `_topology`: node agents' claims on ranks, their labels, the node index per rank;
- `_observe`: the per-round metrics;
- `_session`: `NodeSession`, one node agent's `Node` stream (version and ownership checks, its view of
  a balanced plan, `batchd.core.decision_for_node`);
- `_servicer`: `CoordinatorServicer`, the thin grpc.aio layer (decode, call, encode; status codes);
- `_convert`: the coordinator's protobuf conversions (the answers into replies; the decisions and totals
  its journal keeps serialized);
- `_server`: the process's event loop, `CoordinatorServer`, `create_server`, the method registration.

The wire conversions it uses (`commit_with_sums_from_pb`, `WireStep`, the node reply builders) live in
`batchd.proto.wire`.
"""

from ._barrier import Barrier, ShuttingDown
from ._recovery import COMPACT_EVERY, JOURNAL
from ._server import CoordinatorServer, create_server, method_handlers
from ._servicer import CoordinatorServicer
from ._session import NodeSession
from ._state import CoordinatorState
from ._watchdog import WAIT_LOG_S

__all__ = [
    "Barrier",
    "COMPACT_EVERY",
    "CoordinatorServer",
    "CoordinatorServicer",
    "CoordinatorState",
    "JOURNAL",
    "NodeSession",
    "ShuttingDown",
    "WAIT_LOG_S",
    "create_server",
    "method_handlers",
]
