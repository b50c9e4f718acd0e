"""The per-rank batching service: buffer + grouping + alignment rounds + collation + trainer stream.

One `RankServiceCore` per trainer rank (one process, or several in a node agent), served over gRPC by
`create_rank_server`: `Batches` (the trainer client's bidi stream: credits and acks in, collated batches
out), `Ingest` (producers push samples), `Fetch` (payloads a balanced plan moved to another rank) and
`RankStatus`.

Private modules, one part each (each module's docstring states its contract):
    `_core`      `RankServiceCore`: the facade, its state and the round loop (fill, report, Align, lend,
                 Commit, finalize, collate, journal, expose), deterministic mode, failures
    `_limits`    `Limits`: the core's timeouts and what it retains for a rewind
    `_delivery`  the trainer streams over the pure `core.Delivery`: attach, credits, acks, output flow
                 control (`depth`), trainer liveness
    `_payloads`  payloads held, lent to peers and fetched from them for balancing moves; `collate`,
                 `resolve_payloads`, `materialize_many`
    `_journal`   the rank journal: `read_journal`, `JournalRecord` (parsed, written), `load_journal`,
                 `remake` (a restored rank re-collates its held steps); the core restores itself from it
    `_server`    the thin gRPC servicer, `create_rank_server`, `job_samples`
"""

from ._core import RankServiceCore
from ._delivery import RETAIN_BYTES
from ._journal import JOURNAL, JOURNAL_KEYS, JOURNAL_VERSION, read_journal
from ._limits import Limits
from ._payloads import FETCH_CHUNK, Payloads, collate, materialize_many, resolve_payloads
from ._server import FETCH_REPLY_BYTES, RankServicer, create_rank_server, job_samples

__all__ = [
    "FETCH_CHUNK",
    "FETCH_REPLY_BYTES",
    "JOURNAL",
    "JOURNAL_KEYS",
    "JOURNAL_VERSION",
    "Limits",
    "Payloads",
    "RETAIN_BYTES",
    "RankServiceCore",
    "RankServicer",
    "collate",
    "create_rank_server",
    "job_samples",
    "materialize_many",
    "read_journal",
    "resolve_payloads",
]
