"""The gRPC alignment coordinator: the core's `Coordinator` behind two barrier RPCs, with deadlines.

`CoordinatorState` holds the logic (thread-safe, no gRPC); `CoordinatorServicer` is a thin layer that
turns its exceptions into status codes; `create_server(address, spec) -> (server, port)`.

Per round: every rank calls `Align` (its report) and blocks until all N reports are in, then the core
decides T (or the balanced plan) and every call returns it; `Commit` works the same way and returns
exact per-step totals. A restarted rank may resend a report or commit of a round that is already
decided: the stored answer is replayed (the rank's state is deterministic, so it gets what it had).

Epochs: once epoch e is done, the first `Align` of epoch e+1 starts a fresh protocol core for it; the
job is done (the coordinator process exits) when epoch `spec.epochs - 1` is. Between epochs the job
stays running, so leases still hold while trainers finish their last steps.

Failure is fast and names its cause, never a silent hang:
- a barrier that has not heard from some rank within `round_timeout_s` fails the job, naming the
  missing ranks (DEADLINE_EXCEEDED for the callers, ABORTED for everyone afterwards);
- a registered rank silent for longer than `lease_s` (no heartbeat, no call) fails the job naming it;
- any party may call `Fail(rank, reason)`;
after which every pending and later call returns ABORTED with the failure message.

Status codes: INVALID_ARGUMENT for malformed messages, FAILED_PRECONDITION for protocol-order errors
(wrong epoch or round, unregistered rank, spec mismatch), ABORTED once the job failed.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent import futures

import grpc

from batchd import wire
from batchd.core import Coordinator, ProtocolError, RankCommit, RankReport, RoundDecision, RoundTotals
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc

from ._metrics import CoordinatorMetrics
from ._security import Security, add_port, server_interceptors
from ._spec import JobSpec

log = logging.getLogger("batchd.coordinator")


class JobFailed(RuntimeError):
    """The job failed; the message names the rank and the cause."""


class BarrierTimeout(JobFailed):
    """A round barrier missed its deadline."""


class CoordinatorState:
    """Thread-safe coordinator logic for one job (see module docstring)."""

    def __init__(self, spec: JobSpec, lease_s: float = 30.0, round_timeout_s: float = 120.0,
                 metrics: CoordinatorMetrics | None = None) -> None:
        if lease_s <= 0 or round_timeout_s <= 0:
            raise ValueError(f"timeouts must be positive, got {lease_s=} {round_timeout_s=}")
        self.spec = spec
        self.metrics = metrics  # Prometheus metrics (`_metrics`), updated once per round; None = off
        self.lease_s, self.round_timeout_s = lease_s, round_timeout_s
        self._cond = threading.Condition()
        self.epoch = 0
        self.core = self._new_core(0)
        self.failure: str | None = None
        self.addresses: dict[int, str] = {}
        self.last_seen: dict[int, float] = {}
        self._reports: dict[int, RankReport] = {}
        self._commits: dict[int, RankCommit] = {}
        self._decisions: dict[tuple[int, int], RoundDecision] = {}
        self._totals: dict[tuple[int, int], RoundTotals] = {}
        self._round_started: float | None = None
        self.latencies_ms: collections.deque[float] = collections.deque(maxlen=1000)
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="batchd-lease-watchdog", daemon=True)
        self._watchdog.start()
        if metrics is not None:
            metrics.bind(lambda: self.state, lambda: self.epoch, lambda: len(self.addresses))

    def _new_core(self, epoch: int) -> Coordinator:
        s = self.spec
        return Coordinator(s.world_size, s.make_policy(), s.token_budget, s.cost_model(), s.mode,
                           s.quota if s.mode == "non-join" else None, s.seed, epoch)

    # -- lifecycle -----------------------------------------------------------------------------------
    @property
    def job_done(self) -> bool:
        """The last epoch is done (between epochs the job is still running)."""
        return self.core.done and self.epoch + 1 >= self.spec.epochs

    @property
    def state(self) -> str:
        if self.failure is not None:
            return "failed"
        if self.job_done:
            return "done"
        return "running"

    def close(self) -> None:
        self._stop.set()

    def _fail_locked(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            log.error("job failed: %s", message)
        self._cond.notify_all()

    def fail(self, rank: int, reason: str) -> None:
        with self._cond:
            self._fail_locked(f"rank {rank}: {reason}")

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise JobFailed(self.failure)

    def _touch(self, rank: int) -> None:
        if not 0 <= rank < self.spec.world_size:
            raise ValueError(f"rank {rank} outside world_size={self.spec.world_size}")
        self.last_seen[rank] = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(self.lease_s / 4, 1.0)):
            with self._cond:
                if self.failure is not None or self.job_done:
                    continue
                now = time.monotonic()
                for rank, seen in sorted(self.last_seen.items()):
                    if now - seen > self.lease_s:
                        self._fail_locked(f"rank {rank} missed its lease: silent for {now - seen:.1f}s "
                                          f"(lease {self.lease_s:g}s)")
                        break

    # -- RPC logic -----------------------------------------------------------------------------------
    def register(self, rank: int, spec: JobSpec, address: str) -> tuple[int, int, list[str]]:
        with self._cond:
            self._check_alive()
            self._touch(rank)
            diff = self.spec.diff(spec)
            if diff:
                detail = ", ".join(f"{k}: coordinator {a!r}, rank {b!r}" for k, a, b in
                                   ((k, *v) for k, v in sorted(diff.items())))
                raise ProtocolError(f"rank {rank} registered with a different job spec ({detail})")
            self.addresses[rank] = address
            self._cond.notify_all()
            addrs = [self.addresses.get(r, "") for r in range(self.spec.world_size)]
            return self.epoch, self.core.round, addrs if all(addrs) else []

    def heartbeat(self, rank: int) -> tuple[str, str]:
        with self._cond:
            self._touch(rank)
            return self.state, self.failure or ""

    def _advance_epoch(self, epoch: int) -> None:
        if epoch == self.epoch:
            return
        if epoch >= self.spec.epochs:
            raise ProtocolError(f"epoch {epoch} requested, but the job runs {self.spec.epochs} epoch(s): "
                                f"0..{self.spec.epochs - 1}")
        if epoch == self.epoch + 1 and self.core.done:
            self.epoch = epoch
            self.core = self._new_core(epoch)
            self._reports.clear()
            self._commits.clear()
            return
        raise ProtocolError(f"epoch {epoch} requested while the coordinator is in epoch {self.epoch} "
                            f"({'done' if self.core.done else 'running'})")

    def _await(self, key: tuple[int, int], table: dict, pending: dict, what: str) -> object:
        deadline = time.monotonic() + self.round_timeout_s
        while key not in table:
            self._check_alive()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(self.spec.world_size) if r not in pending]
                msg = (f"epoch {key[0]} round {key[1]}: no {what} from rank(s) {missing} "
                       f"within {self.round_timeout_s:g}s")
                self._fail_locked(msg)
                raise BarrierTimeout(msg)
            self._cond.wait(left)
        return table[key]

    def align(self, epoch: int, report: RankReport) -> RoundDecision:
        with self._cond:
            self._check_alive()
            self._touch(report.rank)
            key = (epoch, report.round)
            if key in self._decisions:  # replay for a restarted rank
                return self._decisions[key]
            self._advance_epoch(epoch)
            if report.round != self.core.round:
                raise ProtocolError(f"rank {report.rank} reports round {report.round} of epoch {epoch}; "
                                    f"the coordinator is at round {self.core.round}")
            if not self._reports:
                self._round_started = time.perf_counter()
            self._reports[report.rank] = report
            if len(self._reports) == self.spec.world_size:
                t_last = time.perf_counter()
                try:
                    decision = self.core.decide(list(self._reports.values()))
                except ValueError as exc:
                    self._fail_locked(f"round {report.round} could not be decided: {exc}")
                    raise
                if self.metrics is not None:
                    self._observe(self.metrics.observe_decision, t_last - (self._round_started or t_last),
                                  time.perf_counter() - t_last)
                self._decisions[key] = decision
                self._forget(self._decisions)
                self._reports.clear()
                self._cond.notify_all()
                return decision
            return self._await(key, self._decisions, self._reports, "report")

    def commit(self, epoch: int, commit: RankCommit) -> RoundTotals:
        with self._cond:
            self._check_alive()
            self._touch(commit.rank)
            key = (epoch, commit.round)
            if key in self._totals:
                return self._totals[key]
            if epoch != self.epoch or commit.round != self.core.round or key not in self._decisions:
                raise ProtocolError(f"rank {commit.rank} commits round {commit.round} of epoch {epoch} "
                                    f"before it was decided (coordinator at epoch {self.epoch} "
                                    f"round {self.core.round})")
            self._commits[commit.rank] = commit
            if len(self._commits) == self.spec.world_size:
                try:
                    totals = self.core.commit(list(self._commits.values()))
                except ValueError as exc:
                    self._fail_locked(f"round {commit.round} could not be committed: {exc}")
                    raise
                self._totals[key] = totals
                self._forget(self._totals)
                if self.metrics is not None:
                    self._observe(self.metrics.observe_commit, list(self._commits.values()), totals,
                                  time.perf_counter() - (self._round_started or time.perf_counter()))
                self._commits.clear()
                if self._round_started is not None:
                    self.latencies_ms.append((time.perf_counter() - self._round_started) * 1000)
                self._cond.notify_all()
                return totals
            return self._await(key, self._totals, self._commits, "commit")

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
        with self._cond:
            return pb.StatusReply(state=self.state, failure=self.failure or "", epoch=self.epoch,
                                  round=self.core.round, registered=sorted(self.addresses),
                                  round_latency_ms=list(self.latencies_ms)[-100:])


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Thin gRPC layer over `CoordinatorState`: domain errors become status codes."""

    def __init__(self, state: CoordinatorState) -> None:
        self.state = state

    @staticmethod
    def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
        if isinstance(exc, BarrierTimeout):
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        elif isinstance(exc, JobFailed):
            code = grpc.StatusCode.ABORTED
        elif isinstance(exc, ProtocolError):
            code = grpc.StatusCode.FAILED_PRECONDITION
        else:
            code = grpc.StatusCode.INVALID_ARGUMENT
        log.warning("%s: %s", code.name, exc)
        context.abort(code, str(exc))

    def _call(self, context, fn, *args):
        try:
            return fn(*args)
        except (JobFailed, ValueError) as exc:
            self._abort(context, exc)

    def Register(self, request, context):
        def run():
            spec = JobSpec.from_pb(request.spec)
            epoch, rnd, addrs = self.state.register(request.rank, spec, request.address)
            return pb.RegisterReply(epoch=epoch, round=rnd, lease_ms=int(self.state.lease_s * 1000),
                                    round_timeout_ms=int(self.state.round_timeout_s * 1000),
                                    rank_addresses=addrs)
        return self._call(context, run)

    def Align(self, request, context):
        def run():
            decision = self.state.align(request.epoch, wire.report_from_pb(request))
            return wire.decision_to_pb(decision, request.epoch)
        return self._call(context, run)

    def Commit(self, request, context):
        def run():
            totals = self.state.commit(request.epoch, wire.commit_from_pb(request))
            return wire.totals_to_pb(totals, request.epoch)
        return self._call(context, run)

    def Heartbeat(self, request, context):
        def run():
            state, failure = self.state.heartbeat(request.rank)
            return pb.HeartbeatReply(state=state, failure=failure)
        return self._call(context, run)

    def Fail(self, request, context):
        self.state.fail(request.rank, request.reason or "reported a failure")
        return pb.FailReply()

    def Status(self, request, context):
        return self.state.status()


MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
# Channels between batchd parties retry a refused connection at least every second. gRPC's default
# backoff (1 s, x1.6 per failure, up to 120 s) makes a party that starts 20 s before its peer connect
# ~6 s after the peer is up, and one that started earlier miss its whole connect timeout.
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def create_server(address: str, spec: JobSpec, lease_s: float = 30.0, round_timeout_s: float = 120.0,
                  security: Security | None = None, metrics: CoordinatorMetrics | None = None,
                  ) -> tuple[grpc.Server, int, CoordinatorState]:
    """Builds (not starts) a coordinator server bound to `address` ("127.0.0.1:0" picks a free port).

    Returns (server, port, state). The thread pool holds one blocked barrier call per rank plus slack.
    `security` (TLS / mutual TLS / bearer token, see `_security`); None serves plaintext without a token.
    `metrics` (a `CoordinatorMetrics`) is updated once per round; serve it with `start_metrics_server`.
    """
    state = CoordinatorState(spec, lease_s, round_timeout_s, metrics=metrics)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2 * spec.world_size + 16,
                                                    thread_name_prefix="batchd-coord"),
                         options=GRPC_OPTIONS, interceptors=server_interceptors(security))
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(state), server)
    try:
        port = add_port(server, address, security)
    except ValueError:
        state.close()
        raise
    if port == 0:
        raise OSError(f"coordinator could not bind {address}")
    return server, port, state
