"""The gRPC alignment coordinator: the core's `Coordinator` behind two barrier RPCs, journaled.

`CoordinatorState` holds the logic (thread-safe, no gRPC); `CoordinatorServicer` is a thin grpc.aio
layer that turns its exceptions into status codes; `create_server(address, spec) -> (server, port, state)`.

Serving: one asyncio event loop (a daemon thread per process, `_EventLoop`) runs every call of every
coordinator server of the process; a `Node` stream is an async generator, not a thread. A barrier call
does not block: `CoordinatorState.submit_align/submit_commit` records the message and returns the
round's decision / totals when it completed the barrier (or replays one), else the pending `Barrier`,
which handlers await (one future per loop, resolved when the barrier completes) and sync callers (tests,
`align_many`/`commit_many`) block on. A failure completes every pending barrier with JobFailed
(ABORTED), `close()` with ShuttingDown (UNAVAILABLE).

Per round: every rank calls `Align` (its report) and blocks until all N reports are in, then the core
decides T (or the balanced plan) and every call returns it; `Commit` works the same way and returns
exact per-step totals. A restarted rank may resend a report or commit of a round that is already
decided: the stored answer is replayed (the rank's state is deterministic, so it gets what it had).

Epochs: once epoch e is done, the first `Align` of epoch e+1 starts a fresh protocol core for it.
Job end: after the last epoch's rounds, each rank calls `Finish` once its trainer took its last step;
the job is done (the coordinator process exits) when every rank finished. Until then the coordinator
stays, whatever the trainers' step times: a job never fails because a trainer is slow.

Timeouts judge liveness, never speed (`batchd.core.Liveness`):
- every rank must register within `startup_timeout_s` (parties start in any order; the coordinator
  logs every few seconds whom it waits for);
- a registered, unfinished rank silent for longer than `lease_s` (no heartbeat, no call) fails the job
  naming it; a barrier waits as long as every missing rank is alive;
- any party may call `Fail(rank, reason)`;
after which every pending and later call returns ABORTED with the failure message.

Restart: with `state_dir`, every decision, totals, registration, finish and failure is appended to a
journal (`_journal`: fsynced, checksummed) before any rank sees it. A coordinator killed with `kill -9`
and restarted with the same command resumes: ranks reconnect (their calls retry while it is away, for
up to a lease) and go on; rounds already decided are replayed from the journal.

Status codes: INVALID_ARGUMENT for malformed messages, FAILED_PRECONDITION for protocol-order errors
(wrong epoch or round, unregistered rank, spec mismatch), ABORTED once the job failed.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import collections.abc
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

import grpc
import grpc.aio

from batchd.core import (
    Coordinator,
    Exchange,
    JobFailed,
    JobSpec,
    Liveness,
    ProtocolError,
    RankCommit,
    RankReport,
    RoundDecision,
    RoundTotals,
    exchanged,
    plan_moves,
)
from batchd.proto import GRPC_OPTIONS, Security, wire
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc

from ._journal import Journal
from ._metrics import CoordinatorMetrics
from ._security import add_port, aio_server_interceptors

log = logging.getLogger("batchd.coordinator")


class ShuttingDown(RuntimeError):
    """This coordinator is stopping (a restart may follow): callers retry (UNAVAILABLE)."""


JOURNAL = "coordinator.journal"
COMPACT_EVERY = 4096  # journal records between compactions (a compacted journal holds ~20 records)
WAIT_LOG_S = 5.0  # how often a waiting coordinator says whom it waits for


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _settle(futures: list[asyncio.Future], barrier: Barrier) -> None:
    for fut in futures:
        if not fut.done():  # a waiter cancelled (its stream ended) cancelled its own future
            fut.set_result(barrier)


class Barrier:
    """The outcome of one barrier (the align or the commit of one round) for whoever waits on it.

    Completed once, under the state's lock, with the round's decision / totals or with an error (the job
    failed: `JobFailed`; the coordinator closes: `ShuttingDown`). Sync waiters block in
    `CoordinatorState.outcome(barrier, ranks, timeout)`; async ones await `CoordinatorState.barrier_future`
    (one asyncio future per waiter), resolved directly when the completing thread runs their loop (the
    usual case: the last message's handler completes the barrier), else by one `call_soon_threadsafe`
    per loop. Nothing else is woken.
    """

    __slots__ = ("key", "done", "result", "error", "_event", "_futures")

    def __init__(self, key: tuple[str, int, int]) -> None:
        self.key = key  # ("align" | "commit", epoch, round)
        self.done = False
        self.result: RoundDecision | RoundTotals | None = None
        self.error: tuple[type[Exception], str] | None = None  # raised anew for every waiter
        self._event = threading.Event()
        self._futures: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}

    def _complete(self, result=None, error: tuple[type[Exception], str] | None = None) -> None:
        if self.done:
            return
        self.done, self.result, self.error = True, result, error
        self._event.set()
        running = _running_loop()
        for loop, futures in self._futures.items():
            if loop is running:
                _settle(futures, self)
            else:
                try:
                    loop.call_soon_threadsafe(_settle, futures, self)
                except RuntimeError:  # that loop is closed: nobody awaits there any more
                    pass
        self._futures = {}

    def _future(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        fut = loop.create_future()
        if self.done:
            fut.set_result(self)
        else:
            self._futures.setdefault(loop, []).append(fut)
        return fut


class CoordinatorState:
    """Thread-safe coordinator logic for one job (see module docstring)."""

    def __init__(
        self,
        spec: JobSpec,
        lease_s: float = 60.0,
        startup_timeout_s: float = 600.0,
        metrics: CoordinatorMetrics | None = None,
        state_dir: str | os.PathLike | None = None,
    ) -> None:
        if lease_s <= 0 or startup_timeout_s <= 0:
            raise ValueError(f"timeouts must be positive, got {lease_s=} {startup_timeout_s=}")
        self.spec = spec
        self.metrics = metrics  # Prometheus metrics (`_metrics`), updated once per round; None = off
        self.lease_s, self.startup_timeout_s = lease_s, startup_timeout_s
        self._lock = threading.Lock()  # guards everything below; never held while waiting for a barrier
        self._barriers: dict[tuple[str, int, int], Barrier] = {}  # pending ones, completed exactly once
        self.epoch = 0
        self.core = self._new_core(0)
        self.failure: str | None = None
        self.informed: set[int] = set()  # ranks told of the failure (they fail their trainers with it)
        self.addresses: dict[int, str] = {}
        self.node_of: dict[int, str] = {}  # rank -> the name of the node agent serving it
        self.liveness = Liveness(spec.world_size, lease_s, startup_timeout_s, time.monotonic())
        self._reports: dict[int, RankReport] = {}
        self._commits: dict[int, RankCommit] = {}
        self._commit_sums: dict[int, tuple[tuple[int, int, int], ...]] = {}  # rank -> its steps' sums
        self._decisions: dict[tuple[int, int], RoundDecision] = {}
        self._totals: dict[tuple[int, int], RoundTotals] = {}
        self._round_started: float | None = None
        self.latencies_ms: collections.deque[float] = collections.deque(maxlen=1000)
        self._stop = threading.Event()
        self._last_core_state: dict | None = None  # the core's state after the newest totals (journal)
        self._last_totals_key: tuple[int, int] | None = None
        self.journal = Journal(Path(state_dir) / JOURNAL, _job_of(spec)) if state_dir is not None else None
        self.restored = False
        if self.journal is not None:
            self._restore(self.journal.open())
        self._watchdog = threading.Thread(target=self._watch, name="batchd-lease-watchdog", daemon=True)
        self._watchdog.start()
        if metrics is not None:
            metrics.bind(lambda: self.state, lambda: self.epoch, lambda: len(self.addresses))

    def _new_core(self, epoch: int) -> Coordinator:
        return Coordinator(self.spec, epoch)

    # -- journal -------------------------------------------------------------------------------------
    def _log(self, record: dict) -> None:
        """Journals `record` before anyone is told (write-ahead); compacts now and then."""
        if self.journal is None:
            return
        if self._stop.is_set():
            raise ShuttingDown("the coordinator is shutting down")
        self.journal.append(record)
        if self.journal.records_written >= COMPACT_EVERY:
            self.journal.compact(self._snapshot())

    def _snapshot(self) -> list[dict]:
        """The records a restart needs: ranks, the recent decisions and totals, finishes, the failure."""
        out: list[dict] = [
            {
                "kind": "register",
                "rank": r,
                "address": a,
                **({"node": self.node_of[r]} if r in self.node_of else {}),
            }
            for r, a in sorted(self.addresses.items())
        ]
        keys = sorted(set(self._decisions) | set(self._totals))
        for key in keys:
            if key in self._decisions:
                out.append(_decision_record(key, self._decisions[key]))
            if key in self._totals:
                out.append(_totals_record(key, self._totals[key], self._core_state_at(key)))
        out += [{"kind": "finish", "rank": r} for r in sorted(self.liveness.finished)]
        if self.failure is not None:
            out.append({"kind": "failure", "message": self.failure})
        return out

    def _core_state_at(self, key: tuple[int, int]) -> dict:
        # Only the newest totals' core state is read back (older ones only fill the replay tables).
        return self._last_core_state if key == self._last_totals_key else {}

    def _restore(self, records: list[dict]) -> None:
        """Rebuilds the state from journal records (see `_journal`): the core from the newest totals, a
        decision newer than those totals as the round's pending decision, the replay tables, the ranks."""
        core_state, core_key, pending = None, None, None
        registered, finished = set(), set()
        for rec in records:
            kind = rec["kind"]
            if kind == "register":
                self.addresses[rec["rank"]] = rec["address"]
                registered.add(rec["rank"])
                if rec.get("node"):
                    self.node_of[rec["rank"]] = rec["node"]
                else:
                    self.node_of.pop(rec["rank"], None)
            elif kind == "decision":
                key = (rec["epoch"], rec["round"])
                self._decisions[key] = wire.decision_from_pb(
                    pb.AlignReply.FromString(base64.b64decode(rec["reply"]))
                )
                pending = key
            elif kind == "totals":
                key = (rec["epoch"], rec["round"])
                self._totals[key] = wire.totals_from_pb(
                    pb.CommitReply.FromString(base64.b64decode(rec["reply"]))
                )
                if rec.get("core"):
                    core_state, core_key = rec["core"], key
            elif kind == "finish":
                finished.add(rec["rank"])
            elif kind == "failure":
                self.failure = rec["message"]
        self._forget(self._decisions)
        self._forget(self._totals)
        self._last_core_state, self._last_totals_key = core_state, core_key
        if core_state is not None:
            self.epoch = core_state["epoch"]
            self.core = self._new_core(self.epoch)
            self.core.load_state_dict(core_state)
        if pending is not None and pending not in self._totals:
            epoch, rnd = pending
            if epoch == self.epoch + 1 and self.core.done:
                self.epoch, self.core = epoch, self._new_core(epoch)
            self.core.resume_decided(self._decisions[pending])
        self.liveness.restore(registered, finished, time.monotonic())
        for node in set(self.node_of.values()):
            self._label_node(node)
        self.restored = bool(records)
        if self.restored:
            log.info(
                "coordinator restored from %s: epoch %d round %d%s, %d rank(s) registered, %d finished%s",
                self.journal.path,
                self.epoch,
                self.core.round,
                " (decided, waiting for commits)"
                if pending is not None and pending not in self._totals
                else "",
                len(registered),
                len(finished),
                f"; the job had failed: {self.failure}" if self.failure else "",
            )
            self.journal.compact(self._snapshot())

    # -- lifecycle -----------------------------------------------------------------------------------
    @property
    def rounds_done(self) -> bool:
        """The last epoch's rounds are done (between epochs the job is still running)."""
        return self.core.done and self.epoch + 1 >= self.spec.epochs

    @property
    def job_done(self) -> bool:
        """The last epoch is done and every rank's trainer took its last step."""
        return self.rounds_done and self.liveness.all_finished

    @property
    def state(self) -> str:
        if self.failure is not None:
            return "failed"
        if self.job_done:
            return "done"
        return "running"

    def close(self) -> None:
        """Stops the state (a shutdown: a restart may follow): every pending and later barrier call
        raises `ShuttingDown` (UNAVAILABLE: callers retry), the journal is closed."""
        with self._lock:
            self._stop.set()
            self._complete_all((ShuttingDown, "the coordinator is shutting down"))
            if self.journal is not None:
                self.journal.close()

    def _complete_all(self, error: tuple[type[Exception], str]) -> None:
        for barrier in self._barriers.values():
            barrier._complete(error=error)
        self._barriers.clear()

    def _fail_locked(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            log.error("job failed: %s", message)
            try:
                self._log({"kind": "failure", "message": message})
            except OSError as exc:
                log.error("could not journal the failure: %s", exc)
        self._complete_all((JobFailed, self.failure))

    def fail(self, rank: int, reason: str) -> None:
        """Fails the job (`Fail` RPC): every waiter, pending and later, gets JobFailed(ABORTED)."""
        with self._lock:
            self._fail_locked(f"rank {rank}: {reason}")

    def _check_alive(self, rank: int | list[int] | None = None) -> None:
        if self.failure is not None:
            if rank is not None:
                self.informed.update([rank] if isinstance(rank, int) else rank)
            raise JobFailed(self.failure)
        if self._stop.is_set():
            raise ShuttingDown("the coordinator is shutting down")

    def all_informed(self) -> bool:
        """Every registered rank that has not finished has been told of the failure (or the job is fine)."""
        with self._lock:
            waiting = set(self.addresses) - self.liveness.finished - self.informed
            return not waiting

    def _check_rank(self, rank: int, what: str) -> None:
        if not 0 <= rank < self.spec.world_size:
            raise ValueError(
                f"{what} from rank {rank}, but the job has ranks 0..{self.spec.world_size - 1} "
                f"(world_size={self.spec.world_size})"
            )

    def _touch(self, rank: int, what: str) -> None:
        self._check_rank(rank, what)
        if rank not in self.addresses:
            raise ProtocolError(f"{what} from rank {rank}, which has not registered")
        self.liveness.seen(rank, time.monotonic())

    def _touch_many(self, ranks: list[int], what: str) -> None:
        """`_touch` of every rank of one message (one clock read)."""
        now = time.monotonic()
        addresses, seen = self.addresses, self.liveness.seen
        for rank in ranks:
            if rank not in addresses:  # a registered rank is in range
                self._check_rank(rank, what)
                raise ProtocolError(f"{what} from rank {rank}, which has not registered")
            seen(rank, now)

    def _watch(self) -> None:
        last_log = time.monotonic()
        while not self._stop.wait(min(self.lease_s / 4, 1.0)):
            with self._lock:
                if self.failure is not None or self.job_done:
                    continue
                now = time.monotonic()
                failure = self.liveness.check(now)
                if failure is not None:
                    self._fail_locked(failure)
                    continue
                if now - last_log >= WAIT_LOG_S:
                    waiting = self.liveness.waiting(now) or self._waiting_barrier()
                    if waiting:
                        log.info("%s", waiting)
                        last_log = now

    def _waiting_barrier(self) -> str | None:
        if self.rounds_done:
            left = [r for r in range(self.spec.world_size) if r not in self.liveness.finished]
            return f"rounds done; waiting for the trainers of rank(s) {left} to take their last step"
        return None

    # -- RPC logic -----------------------------------------------------------------------------------
    def _check_spec(self, who: str, spec: JobSpec) -> None:
        diff = self.spec.diff(spec)
        if diff:
            party = who.split(" ")[0] if who.startswith("rank") else "node agent"
            detail = ", ".join(
                f"{k}: coordinator {a!r}, {party} {b!r}"
                for k, a, b in ((k, *v) for k, v in sorted(diff.items()))
            )
            raise ProtocolError(f"{who} registered with a different job spec ({detail})")

    def _register_locked(self, rank: int, address: str, node: str | None) -> None:
        if self.addresses.get(rank) != address or self.node_of.get(rank) != node:
            record = {"kind": "register", "rank": rank, "address": address}
            if node is not None:
                record["node"] = node
            self._log(record)
            self.addresses[rank] = address
            if node is None:
                self.node_of.pop(rank, None)
            else:
                self.node_of[rank] = node
        self.liveness.register(rank, time.monotonic())

    def _addresses(self) -> list[str]:
        addrs = [self.addresses.get(r, "") for r in range(self.spec.world_size)]
        return addrs if all(addrs) else []

    def register(self, rank: int, spec: JobSpec, address: str) -> tuple[int, int, list[str]]:
        with self._lock:
            self._check_alive(rank)
            self._check_rank(rank, "Register")
            self._check_spec(f"rank {rank}", spec)
            # A rank a node agent serves keeps its node when it registers alone (refreshing its peers).
            node = self.node_of.get(rank) if self.addresses.get(rank) == address else None
            self._register_locked(rank, address, node)
            return self.epoch, self.core.round, self._addresses()

    def register_node(
        self, node: str, ranks: list[int], spec: JobSpec, address: str
    ) -> tuple[int, int, list[str]]:
        """A node agent (`node`, its name) serving `ranks` at `address` registers them all (again, after a
        restart). Refuses a rank that another node agent serves and that is still alive (two agents
        configured with the same node rank)."""
        if not node:
            raise ValueError("a node agent must give its name")
        if not ranks:
            raise ValueError(f"node agent {node!r} serves no rank")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"node agent {node!r} names a rank twice: {sorted(ranks)}")
        with self._lock:
            self._check_alive(ranks)
            for r in ranks:
                self._check_rank(r, f"Register of node agent {node!r}")
            self._check_spec(f"node agent {node!r}", spec)
            now = time.monotonic()
            for r in ranks:
                owner = self.node_of.get(r)
                seen = self.liveness.last_seen.get(r)
                if (
                    owner is not None
                    and owner != node
                    and seen is not None
                    and r not in self.liveness.finished
                    and now - seen <= self.lease_s
                ):
                    raise ProtocolError(
                        f"node agent {node!r} claims rank {r}, which node agent {owner!r} at "
                        f"{self.addresses.get(r)} serves and is alive: are two agents "
                        f"configured with the same node rank?"
                    )
            for r in ranks:
                self._register_locked(r, address, node)
            self._label_node(node)
            log.info("node agent %r at %s registered rank(s) %s", node, address, _span(sorted(ranks)))
            return self.epoch, self.core.round, self._addresses()

    def _label_node(self, node: str) -> None:
        ranks = sorted(r for r, n in self.node_of.items() if n == node)
        for r in ranks:
            self.liveness.label(r, f"node agent {node!r} at {self.addresses.get(r)}, ranks {_span(ranks)}")

    def _topology(self) -> list[int] | None:
        """The node index of every rank (nodes in order of their lowest rank; a rank registered alone is a
        node of its own), or None while no node agent serves two ranks (the plan is then node-blind)."""
        if not self.node_of or len(set(self.node_of.values())) == len(self.node_of):
            return None
        names = [self.node_of.get(r, f"\0rank-{r}") for r in range(self.spec.world_size)]
        index: dict[str, int] = {}
        for name in names:
            index.setdefault(name, len(index))
        return [index[n] for n in names]

    def heartbeat(self, rank: int) -> tuple[str, str]:
        return self.heartbeat_many([rank])

    def heartbeat_many(self, ranks: list[int]) -> tuple[str, str]:
        with self._lock:
            for r in ranks:
                self._touch(r, "Heartbeat")
            if self.failure is not None:
                self.informed.update(ranks)
            return self.state, self.failure or ""

    def finish(self, rank: int) -> None:
        with self._lock:
            self._check_alive(rank)
            self._touch(rank, "Finish")
            if not self.rounds_done:
                raise ProtocolError(
                    f"rank {rank} finished while the job is in epoch {self.epoch} round "
                    f"{self.core.round} of {self.spec.epochs} epoch(s)"
                )
            if rank not in self.liveness.finished:
                self._log({"kind": "finish", "rank": rank})
                self.liveness.finish(rank, time.monotonic())
                log.info(
                    "rank %d finished (%d of %d)", rank, len(self.liveness.finished), self.spec.world_size
                )

    def _advance_epoch(self, epoch: int) -> None:
        if epoch == self.epoch:
            return
        if epoch >= self.spec.epochs:
            raise ProtocolError(
                f"epoch {epoch} requested, but the job runs {self.spec.epochs} epoch(s): "
                f"0..{self.spec.epochs - 1}"
            )
        if epoch == self.epoch + 1 and self.core.done:
            self.epoch = epoch
            self.core = self._new_core(epoch)
            self._reports.clear()
            self._commits.clear()
            self._commit_sums.clear()
            return
        raise ProtocolError(
            f"epoch {epoch} requested while the coordinator is in epoch {self.epoch} "
            f"({'done' if self.core.done else 'running'})"
        )

    # -- barriers ------------------------------------------------------------------------------------
    def _barrier(self, key: tuple[str, int, int]) -> Barrier:
        barrier = self._barriers.get(key)
        if barrier is None:
            barrier = self._barriers[key] = Barrier(key)
        return barrier

    def _complete(self, key: tuple[str, int, int], result) -> None:
        barrier = self._barriers.pop(key, None)
        if barrier is not None:
            barrier._complete(result)

    def barrier_future(self, barrier: Barrier) -> asyncio.Future:
        """A future of the running loop for one waiter, resolved (to `barrier`) once `barrier` completes:
        await it, then read `outcome`. Cancelling it (the waiter's call ended) touches no other waiter."""
        loop = asyncio.get_running_loop()
        with self._lock:
            return barrier._future(loop)

    def outcome(
        self, barrier: Barrier, ranks: list[int], timeout: float | None = None, active=None
    ) -> RoundDecision | RoundTotals:
        """The result of `barrier` for a waiter on behalf of `ranks`, blocking (in slices of <= 1 s) until
        it completes: the decision / totals, else raises what completed it (JobFailed, the ranks being
        then told of the failure; ShuttingDown). `active()` False (the caller's stream ended) stops the
        wait with ShuttingDown; `timeout` (s) raises TimeoutError. Returns at once once completed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not barrier.done:
            if active is not None and not active():
                raise ShuttingDown("the caller's stream ended")
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"barrier {barrier.key} not complete within {timeout=}")
            barrier._event.wait(left)
        if barrier.error is not None:
            cls, message = barrier.error
            if cls is JobFailed:
                with self._lock:
                    self.informed.update(ranks)
            raise cls(message)
        return barrier.result

    @staticmethod
    def _one_round(msgs: list, what: str) -> int:
        rounds = {m.round for m in msgs}
        if len(rounds) != 1:
            raise ProtocolError(
                f"one {what} message holds rounds {sorted(rounds)} of ranks "
                f"{sorted(m.rank for m in msgs)}; a message carries one round"
            )
        ranks = [m.rank for m in msgs]
        if len(set(ranks)) != len(ranks):
            raise ProtocolError(f"one {what} message names a rank twice: {sorted(ranks)}")
        return rounds.pop()

    def align(self, epoch: int, report: RankReport) -> RoundDecision:
        return self.align_many(epoch, [report])

    def align_many(self, epoch: int, reports: list[RankReport], active=None) -> RoundDecision:
        """The reports of one or more ranks (a node agent sends its ranks' at once) for one round; returns
        the round's decision once every rank of the job reported (blocking; see `submit_align`)."""
        got = self.submit_align(epoch, reports)
        if isinstance(got, Barrier):
            return self.outcome(got, [r.rank for r in reports], active=active)
        return got

    def submit_align(self, epoch: int, reports: list[RankReport]) -> RoundDecision | Barrier:
        """Non-blocking `align_many`: the decision when the round is decided (these reports completed it,
        or it is a replay for a restarted rank), else the pending barrier to wait on (`outcome`,
        `barrier_future`). The decision is journaled before anyone is told of it.

        Raises:
            ValueError: a malformed message (INVALID_ARGUMENT); ProtocolError (a ValueError): out of
                order (FAILED_PRECONDITION); JobFailed; ShuttingDown.
        """
        if not reports:
            raise ValueError("an Align without any report")
        ranks = [r.rank for r in reports]
        with self._lock:
            self._check_alive(ranks)
            self._touch_many(ranks, "Align")
            rnd = self._one_round(reports, "Align")
            key = (epoch, rnd)
            if key in self._decisions:  # replay for a restarted rank
                return self._decisions[key]
            self._advance_epoch(epoch)
            if rnd != self.core.round:
                raise ProtocolError(
                    f"rank(s) {ranks} report round {rnd} of epoch {epoch}; "
                    f"the coordinator is at round {self.core.round}"
                )
            if not self._reports:
                self._round_started = time.perf_counter()
            for report in reports:
                self._reports[report.rank] = report
            if len(self._reports) < self.spec.world_size:
                return self._barrier(("align", *key))
            t_last = time.perf_counter()
            topology = self._topology()
            self.core.nodes = topology if self.spec.node_aware else None
            self.core.vision_nodes = topology
            try:
                decision = self.core.decide(list(self._reports.values()))
            except ValueError as exc:
                self._fail_locked(f"round {rnd} could not be decided: {exc}")
                raise
            self._log(_decision_record(key, decision))
            if self.metrics is not None:
                self._observe(
                    self.metrics.observe_decision,
                    t_last - (self._round_started or t_last),
                    time.perf_counter() - t_last,
                )
                if decision.plan is not None:
                    self._observe(lambda: self.metrics.observe_moves(plan_moves(decision.plan, topology)))
                if decision.vision is not None:
                    self._observe(
                        lambda: self.metrics.observe_exchanges(_round_exchanges(decision.vision, topology))
                    )
            self._decisions[key] = decision
            self._forget(self._decisions)
            self._reports.clear()
            self._complete(("align", *key), decision)
            return decision

    def commit(self, epoch: int, commit: RankCommit) -> RoundTotals:
        return self.commit_many(epoch, [commit])

    def commit_many(self, epoch: int, commits: list[RankCommit], active=None) -> RoundTotals:
        """The commits of one or more ranks for one round; returns the round's totals once every rank
        committed (blocking; see `submit_commit`)."""
        got = self.submit_commit(epoch, commits, None)
        if isinstance(got, Barrier):
            return self.outcome(got, [c.rank for c in commits], active=active)
        return got

    def submit_commit(
        self,
        epoch: int,
        commits: list[RankCommit],
        sums: list[tuple[tuple[int, int, int], ...]] | None = None,
    ) -> RoundTotals | Barrier:
        """Non-blocking `commit_many`: the totals when the round is committed (these commits completed it,
        or a replay), else the pending barrier. The totals are journaled before anyone is told of them.
        `sums[i]`: per step of `commits[i]`, its (samples, tokens, loss tokens) (`commit_from_pb`); when
        every rank's commit of the round came with them, the core adds those instead of every sample.
        Raises as `submit_align`."""
        if not commits:
            raise ValueError("a Commit without any commit")
        ranks = [c.rank for c in commits]
        with self._lock:
            self._check_alive(ranks)
            self._touch_many(ranks, "Commit")
            rnd = self._one_round(commits, "Commit")
            key = (epoch, rnd)
            if key in self._totals:
                return self._totals[key]
            if epoch != self.epoch or rnd != self.core.round or key not in self._decisions:
                raise ProtocolError(
                    f"rank(s) {ranks} commit round {rnd} of epoch {epoch} "
                    f"before it was decided (coordinator at epoch {self.epoch} "
                    f"round {self.core.round})"
                )
            for i, commit in enumerate(commits):
                self._commits[commit.rank] = commit
                if sums is not None:
                    self._commit_sums[commit.rank] = sums[i]
                else:
                    self._commit_sums.pop(commit.rank, None)
            if len(self._commits) < self.spec.world_size:
                return self._barrier(("commit", *key))
            try:
                totals = self.core.commit(
                    list(self._commits.values()),
                    self._commit_sums if len(self._commit_sums) == len(self._commits) else None,
                )
            except ValueError as exc:
                self._fail_locked(f"round {rnd} could not be committed: {exc}")
                raise
            self._last_core_state, self._last_totals_key = self.core.state_dict(), key
            self._log(_totals_record(key, totals, self._last_core_state))
            self._totals[key] = totals
            self._forget(self._totals)
            if self.metrics is not None:
                self._observe(
                    self.metrics.observe_commit,
                    list(self._commits.values()),
                    totals,
                    time.perf_counter() - (self._round_started or time.perf_counter()),
                )
            self._commits.clear()
            self._commit_sums.clear()
            if self._round_started is not None:
                self.latencies_ms.append((time.perf_counter() - self._round_started) * 1000)
            self._complete(("commit", *key), totals)
            return totals

    @staticmethod
    def _observe(fn, *args) -> None:
        try:  # metrics must never fail or stall the protocol
            fn(*args)
        except Exception:  # noqa: BLE001
            log.exception("metrics update failed")

    @staticmethod
    def _forget(table: dict) -> None:
        while len(table) > 8:
            table.pop(next(iter(table)))

    def status(self) -> pb.StatusReply:
        with self._lock:
            return pb.StatusReply(
                state=self.state,
                failure=self.failure or "",
                epoch=self.epoch,
                round=self.core.round,
                registered=sorted(self.addresses),
                round_latency_ms=list(self.latencies_ms)[-100:],
                finished=sorted(self.liveness.finished),
            )


def _span(ranks: list[int]) -> str:
    """ "4-7" for a contiguous run of ranks, else the list."""
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return str(ranks)


def _job_of(spec: JobSpec) -> dict:
    """What names a job in its journal: its spec."""
    return dataclasses.asdict(spec)


def _decision_record(key: tuple[int, int], decision: RoundDecision) -> dict:
    return {
        "kind": "decision",
        "epoch": key[0],
        "round": key[1],
        "reply": base64.b64encode(wire.decision_to_pb(decision, key[0]).SerializeToString()).decode(),
    }


def _totals_record(key: tuple[int, int], totals: RoundTotals, core_state: dict) -> dict:
    return {
        "kind": "totals",
        "epoch": key[0],
        "round": key[1],
        "core": core_state,
        "reply": base64.b64encode(wire.totals_to_pb(totals, key[0]).SerializeToString()).decode(),
    }


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Thin grpc.aio layer over `CoordinatorState`: domain errors become status codes.

    Every handler is a coroutine run by the server's event loop (one thread for all calls): state calls
    take the state's lock briefly and never wait in it; a barrier is awaited on a future that completes
    when the round is decided / committed (or the job fails, or the coordinator closes). Decision and
    totals replies shared by every caller are serialized once per round (the Node, Align and Commit
    handlers hand gRPC bytes; see `_reply_serializer`).
    """

    def __init__(self, state: CoordinatorState) -> None:
        self.state = state
        # (identity of the decision / totals, epoch, serialized reply) of the newest round, per reply kind
        self._shared: dict[str, tuple[object, int, bytes]] = {}

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
        if isinstance(exc, ShuttingDown):
            code = grpc.StatusCode.UNAVAILABLE
        elif isinstance(exc, JobFailed):
            code = grpc.StatusCode.ABORTED
        elif isinstance(exc, ProtocolError):
            code = grpc.StatusCode.FAILED_PRECONDITION
        else:
            code = grpc.StatusCode.INVALID_ARGUMENT
        log.warning("%s: %s", code.name, exc)
        await context.abort(code, str(exc))

    async def _wait(self, got, ranks: list[int]):
        """The decision / totals `got` from a `submit_*`, awaiting its barrier if it is one."""
        if not isinstance(got, Barrier):
            return got
        fut = self.state.barrier_future(got)
        if not fut.done():
            await fut
        return self.state.outcome(got, ranks)

    def _reply(self, kind: str, value, epoch: int, build) -> bytes:
        """The serialized reply for `value` (a decision or totals that every caller of the round gets),
        built by `build(value, epoch)` once per (value, epoch)."""
        cached = self._shared.get(kind)
        if cached is not None and cached[0] is value and cached[1] == epoch:
            return cached[2]
        data = build(value, epoch).SerializeToString()
        self._shared[kind] = (value, epoch, data)
        return data

    async def Register(self, request, context):
        try:
            self.state._check_rank(request.rank, "Register")
            try:
                spec = wire.spec_from_pb(request.spec)
            except ValueError as exc:
                raise ValueError(
                    f"Register from rank {request.rank} carries an invalid job spec: {exc}"
                ) from None
            epoch, rnd, addrs = self.state.register(request.rank, spec, request.address)
            return pb.RegisterReply(
                epoch=epoch, round=rnd, lease_ms=int(self.state.lease_s * 1000), rank_addresses=addrs
            )
        except (JobFailed, ShuttingDown, ValueError) as exc:
            await self._abort(context, exc)

    async def Align(self, request, context):
        try:
            got = self.state.submit_align(request.epoch, [wire.report_from_pb(request)])
            decision = await self._wait(got, [request.rank])
            return self._reply("align", decision, request.epoch, wire.decision_to_pb)
        except (JobFailed, ShuttingDown, ValueError) as exc:
            await self._abort(context, exc)

    async def Commit(self, request, context):
        try:
            commit, sums = commit_from_pb(request)
            got = self.state.submit_commit(request.epoch, [commit], [sums])
            totals = await self._wait(got, [request.rank])
            return self._reply("commit", totals, request.epoch, wire.totals_to_pb)
        except (JobFailed, ShuttingDown, ValueError) as exc:
            await self._abort(context, exc)

    async def Heartbeat(self, request, context):
        try:
            ranks = [int(r) for r in request.ranks] or [int(request.rank)]
            state, failure = self.state.heartbeat_many(ranks)
            return pb.HeartbeatReply(state=state, failure=failure)
        except (JobFailed, ShuttingDown, ValueError) as exc:
            await self._abort(context, exc)

    async def Finish(self, request, context):
        try:
            self.state.finish(request.rank)
            return pb.FinishReply()
        except (JobFailed, ShuttingDown, ValueError) as exc:
            await self._abort(context, exc)

    async def Fail(self, request, context):
        self.state.fail(request.rank, request.reason or "reported a failure")
        return pb.FailReply()

    async def Status(self, request, context):
        return self.state.status()

    async def Node(self, request_iterator, context):
        """A node agent's stream: a hello first, then its ranks' aligns and commits, one reply each in
        order. Domain errors end the stream with their status code (the agent reports them)."""
        node: NodeView | None = None
        async for request in request_iterator:
            kind = request.WhichOneof("kind")
            try:
                if kind == "hello":
                    hello = request.hello
                    if hello.protocol != pb.NODE_PROTOCOL_V1:
                        raise ProtocolError(
                            f"node agent {hello.node!r} speaks node protocol {hello.protocol}; "
                            f"this coordinator speaks {pb.NODE_PROTOCOL_V1} (batchd.v1): run the "
                            f"same batchd version on every party"
                        )
                    try:
                        spec = wire.spec_from_pb(hello.spec)
                    except ValueError as exc:
                        raise ValueError(
                            f"node agent {hello.node!r} sent an invalid job spec: {exc}"
                        ) from None
                    ranks = [int(r) for r in hello.ranks]
                    epoch, rnd, addrs = self.state.register_node(hello.node, ranks, spec, hello.address)
                    node = NodeView(hello.node, ranks)
                    yield pb.NodeReply(
                        registered=pb.RegisterReply(
                            epoch=epoch,
                            round=rnd,
                            lease_ms=int(self.state.lease_s * 1000),
                            rank_addresses=addrs,
                        )
                    )
                elif kind in ("align", "commit"):
                    if node is None:
                        raise ProtocolError(f"a node stream sent {kind} before its hello")
                    msg = getattr(request, kind)
                    items = msg.reports if kind == "align" else msg.commits
                    ranks = [int(m.rank) for m in items]
                    if not node.ranks.issuperset(ranks):
                        foreign = sorted(set(ranks) - node.ranks)
                        raise ProtocolError(
                            f"node agent {node.name!r} sent {kind} for rank(s) {foreign}, which it "
                            f"did not register (it serves {sorted(node.ranks)})"
                        )
                    epoch = int(msg.epoch)
                    if kind == "align":
                        got = self.state.submit_align(epoch, [wire.report_from_pb(m) for m in items])
                        decision = await self._wait(got, ranks)
                        if decision.plan is None:
                            yield self._reply("node-align", decision, epoch, _node_decision)
                        else:
                            yield node.decision_reply(decision, epoch)
                    else:
                        converted = [commit_from_pb(m) for m in items]
                        got = self.state.submit_commit(
                            epoch, [c for c, _ in converted], [s for _, s in converted]
                        )
                        totals = await self._wait(got, ranks)
                        yield self._reply("node-commit", totals, epoch, _node_totals)
                else:
                    raise ValueError(f"a node stream sent an empty request ({kind=})")
            except (JobFailed, ShuttingDown, ValueError) as exc:
                if isinstance(exc, ShuttingDown) and context.cancelled():
                    return
                await self._abort(context, exc)


class WireStep(collections.abc.Sequence):
    """One committed step as it came off the wire: a sequence of the (length, loss_tokens) pairs of its
    samples (as `wire.commit_from_pb` builds them), made only when someone reads them (the metrics, a
    quota cut); its length is known at once."""

    __slots__ = ("_lengths", "_loss", "_pairs")

    def __init__(self, lengths: list[int], loss_tokens: list[int]) -> None:
        if len(lengths) != len(loss_tokens):
            raise ValueError(f"{len(lengths)} lengths but {len(loss_tokens)} loss counts")
        self._lengths, self._loss, self._pairs = lengths, loss_tokens, None

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        if self._pairs is None:
            self._pairs = tuple(zip(self._lengths, self._loss, strict=False))
        return self._pairs

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i):
        return self.pairs[i]

    def __iter__(self):
        return iter(self.pairs)

    def __eq__(self, other) -> bool:
        if isinstance(other, (WireStep, tuple)):
            return self.pairs == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"WireStep({self.pairs!r})"


def commit_from_pb(m: pb.CommitRequest) -> tuple[RankCommit, tuple[tuple[int, int, int], ...]]:
    """`wire.commit_from_pb` for the coordinator's hot path, plus per step its (samples, tokens, loss
    tokens): the repeated fields are copied to lists and summed in C, with no per-sample pair (the
    steps are `WireStep`s). Raises ValueError naming the rank on unequal lengths and loss counts."""
    steps, sums = [], []
    for st in m.steps:
        lengths, loss = st.lengths[:], st.loss_tokens[:]
        if len(lengths) != len(loss):
            raise ValueError(f"commit of rank {m.rank}: {len(lengths)} lengths but {len(loss)} loss counts")
        steps.append(WireStep(lengths, loss))
        sums.append((len(lengths), sum(lengths), sum(loss)))
    return RankCommit(int(m.rank), int(m.round), tuple(steps), int(m.remaining), bool(m.exhausted)), tuple(
        sums
    )


def _node_decision(decision: RoundDecision, epoch: int) -> pb.NodeReply:
    return pb.NodeReply(decision=wire.decision_to_pb(decision, epoch))


def _node_totals(totals: RoundTotals, epoch: int) -> pb.NodeReply:
    return pb.NodeReply(totals=wire.totals_to_pb(totals, epoch))


def _round_exchanges(vision, topology: list[int] | None) -> dict[str, int]:
    """`exchanged` summed over a round's steps (vision[rank][step])."""
    total: dict[str, int] = {}
    for step in zip(*vision, strict=False):
        for key, value in exchanged(step, topology).items():
            total[key] = total.get(key, 0) + value
    return total or {
        "intra_node_images": 0,
        "intra_node_rows": 0,
        "cross_node_images": 0,
        "cross_node_rows": 0,
    }


class NodeView:
    """What one node agent's stream sees: its ranks, and the part of a balanced plan it needs."""

    def __init__(self, name: str, ranks: list[int]) -> None:
        self.name, self.ranks = name, set(ranks)
        self._cache: tuple[int, int, object, pb.AlignReply] | None = None
        self._bytes: tuple[pb.AlignReply, bytes] | None = None

    def decision_pb(self, decision: RoundDecision, epoch: int) -> pb.AlignReply:
        """The decision as this node needs it: whole for its ranks; of every other rank's groups only the
        samples whose home is one of its ranks (those it lends), and (two-phase) of every other rank's
        exchanges only the images of such samples (their encoders fetch them). Without a plan: as is."""
        cached, original = self._cache, decision
        if (
            cached is not None
            and cached[0] == epoch
            and cached[1] == decision.round
            and cached[2] is decision
        ):
            return cached[3]
        if decision.plan is not None:
            mine = self.ranks
            plan = tuple(
                steps if r in mine else tuple(tuple(s for s in g if s.home_rank in mine) for g in steps)
                for r, steps in enumerate(decision.plan)
            )
            vision = decision.vision
            if vision is not None:
                vision = tuple(
                    exs
                    if r in mine
                    else tuple(
                        Exchange(r, x.world_size, tuple(im for im in x.encode if im.home_rank in mine))
                        for x in exs
                    )
                    for r, exs in enumerate(vision)
                )
            decision = RoundDecision(decision.round, decision.target, plan, vision)
        reply = wire.decision_to_pb(decision, epoch)
        self._cache = (epoch, decision.round, original, reply)
        return reply

    def decision_reply(self, decision: RoundDecision, epoch: int) -> bytes:
        """`decision_pb` as a serialized NodeReply (serialized once per round)."""
        reply = self.decision_pb(decision, epoch)
        if self._bytes is None or self._bytes[0] is not reply:
            self._bytes = (reply, pb.NodeReply(decision=reply).SerializeToString())
        return self._bytes[1]


def _reply_serializer(cls):
    """A response serializer that passes bytes (a reply serialized once for many callers) through."""
    serialize = cls.SerializeToString

    def serializer(message) -> bytes:
        return message if type(message) is bytes else serialize(message)

    return serializer


def _method_handlers(servicer: CoordinatorServicer) -> grpc.GenericRpcHandler:
    """The Coordinator service's handlers (as the generated `add_CoordinatorServicer_to_server`, with
    replies that may come pre-serialized)."""
    unary = {
        "Register": (pb.RegisterRequest, pb.RegisterReply),
        "Align": (pb.AlignRequest, pb.AlignReply),
        "Commit": (pb.CommitRequest, pb.CommitReply),
        "Heartbeat": (pb.HeartbeatRequest, pb.HeartbeatReply),
        "Fail": (pb.FailRequest, pb.FailReply),
        "Status": (pb.StatusRequest, pb.StatusReply),
        "Finish": (pb.FinishRequest, pb.FinishReply),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=req.FromString,
            response_serializer=_reply_serializer(rep),
        )
        for name, (req, rep) in unary.items()
    }
    handlers["Node"] = grpc.stream_stream_rpc_method_handler(
        servicer.Node,
        request_deserializer=pb.NodeRequest.FromString,
        response_serializer=_reply_serializer(pb.NodeReply),
    )
    return grpc.method_handlers_generic_handler("batchd.v1.Coordinator", handlers)


class _EventLoop:
    """The process's event loop for coordinator servers: one daemon thread, started on first use (again
    in a forked child, whose copy has no thread running it)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _pid: int | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(target=cls._run, args=(loop,), name="batchd-coord-aio", daemon=True).start()
                cls._loop, cls._pid = loop, os.getpid()
            return cls._loop

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.run_forever()


class CoordinatorServer:
    """A grpc.aio coordinator server on the process's coordinator event loop (`_EventLoop`), with the
    blocking interface of a sync `grpc.Server` that its callers use: `start()`, `stop(grace)` returning
    a `threading.Event` set once stopped, `wait_for_termination(timeout)`."""

    def __init__(self, servicer: CoordinatorServicer, security: Security | None) -> None:
        self._loop = _EventLoop.get()
        self.servicer = servicer

        async def build() -> grpc.aio.Server:
            server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=aio_server_interceptors(security))
            server.add_generic_rpc_handlers((_method_handlers(servicer),))
            return server

        self._server = self._run(build())
        self._stopped: threading.Event | None = None
        self._stop_lock = threading.Lock()

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def bind(self, address: str, security: Security | None) -> int:
        """Binds `address` (`_security.add_port`); the bound port, 0 if it could not bind."""

        async def bind() -> int:
            return add_port(self._server, address, security)

        return self._run(bind())

    def start(self) -> None:
        self._run(self._server.start())

    def stop(self, grace: float | None) -> threading.Event:
        """Stops serving (idempotent): with `grace` falsy, aborts every call and returns once the port is
        released (a restart may bind it at once); else calls get up to `grace` seconds to end, and the
        returned event is set once the server stopped."""
        with self._stop_lock:
            first = self._stopped is None
            if first:
                self._stopped = threading.Event()
                fut = asyncio.run_coroutine_threadsafe(self._stop_and_free(grace or None), self._loop)
                fut.add_done_callback(lambda _: self._stopped.set())
            stopped = self._stopped
        if not grace:
            stopped.wait(10.0)
        return stopped

    async def _stop_and_free(self, grace: float | None) -> None:
        """Stops the server, then frees it here, on the loop's own thread, before anyone is told it
        stopped. gRPC's asyncio module shuts down when its last server or channel is freed: it takes
        its poller's socket off the loop and closes it. Freed by another thread (the caller's
        `server` going out of scope as `run_coordinator` returns), that raced this loop running the
        socket's reader (`PollerCompletionQueue._handle_events`), which then printed an
        `OSError: [Errno 9] Bad file descriptor` traceback as the process ended. On this thread no
        reader runs meanwhile, and a reader already scheduled is cancelled."""
        server = self._server
        try:
            await server.stop(grace)
        finally:
            self._server = None
            del server

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until the server stopped; False if `timeout` (s) passed first."""
        with self._stop_lock:
            stopped = self._stopped
        if stopped is not None:
            return stopped.wait(timeout)
        return not self._run(self._server.wait_for_termination(timeout))


def create_server(
    address: str,
    spec: JobSpec,
    lease_s: float = 60.0,
    startup_timeout_s: float = 600.0,
    security: Security | None = None,
    metrics: CoordinatorMetrics | None = None,
    state_dir: str | os.PathLike | None = None,
) -> tuple[CoordinatorServer, int, CoordinatorState]:
    """Builds (not starts) a coordinator server bound to `address` ("127.0.0.1:0" picks a free port).

    Returns (server, port, state): `server` is a `CoordinatorServer` (grpc.aio on the process's
    coordinator event loop; `start()`, `stop(grace)`), `state` its `CoordinatorState`.
    `state_dir` journals the job there (`coordinator.journal`) and resumes it from a journal left by a
    coordinator that was killed; a journal of another job raises `JournalError`.
    `security` (TLS / mutual TLS / bearer token, see `_security`); None serves plaintext without a token.
    `metrics` (a `CoordinatorMetrics`) is updated once per round; serve it with `start_metrics_server`.

    Raises:
        ValueError: `security` cannot serve (see `Security.server_credentials`).
        OSError: `address` cannot be bound.
    """
    state = CoordinatorState(spec, lease_s, startup_timeout_s, metrics=metrics, state_dir=state_dir)
    try:
        server = CoordinatorServer(CoordinatorServicer(state), security)
        port = server.bind(address, security)
    except BaseException:
        state.close()
        raise
    if port == 0:
        state.close()
        server.stop(0)
        raise OSError(f"coordinator could not bind {address}")
    return server, port, state
