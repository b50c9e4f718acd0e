"""The coordinator's logic for one job: registration, the two barriers of every round, epochs, job end.

`CoordinatorState` is thread-safe and knows no gRPC nor protobuf: it takes and answers core types
(`_answers`); `_servicer` is the wire layer over it, with `_convert` for the replies.

Per round: every rank sends `Align` (its report) and waits until all N reports are in, then the core
decides T (or the balanced plan) and every call returns it; `Commit` works the same way and returns
exact per-step totals. A barrier call does not block: `submit_align` / `submit_commit` records the
message and returns the round's decision / totals when it completed the barrier (or replays one), else
the pending `Barrier`, which handlers await (`barrier_future`: one future per waiter, resolved when the
barrier completes) and sync callers block on (`outcome`). A failure completes every pending barrier
with JobFailed (ABORTED), `close()` with ShuttingDown (UNAVAILABLE).

A restarted rank may resend a report or commit of a round that is already decided: the stored answer is
replayed (`_recovery.ReplayTables`; the rank's state is deterministic, so it gets what it had).

Epochs: once epoch e is done, the first `Align` of epoch e+1 starts a fresh protocol core for it.
Job end: after the last epoch's rounds, each rank calls `Finish` once its trainer took its last step;
the job is done (the coordinator process exits) when every rank finished.

Who else owns what: the round's pending messages and barriers `_round`; liveness and its watchdog thread
`_watchdog`; journal records, snapshot and restore `_recovery`; what a resize changes `_resize` (this
state installs it); node agents and the topology `_topology`; per-round metrics `_observe`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from batchd.core import (
    Coordinator,
    JobFailed,
    JobSpec,
    Liveness,
    ProtocolError,
    RankCommit,
    RankReport,
    RoundDecision,
    RoundTotals,
)

from .._journal import Journal
from .._metrics import CoordinatorMetrics
from . import _oom as oom
from . import _recovery as recovery
from . import _resize as resizing
from . import _topology as topo
from ._answers import JobStatus, Registration, Resumed
from ._barrier import Barrier, ShuttingDown
from ._gone import BrokenStreams
from ._observe import observe_commit, observe_decision
from ._round import RoundInbox, Sums, one_round
from ._watchdog import LeaseWatchdog

log = logging.getLogger("batchd.coordinator")


class CoordinatorState:
    """Thread-safe coordinator logic for one job (see module docstring).

    `lease_s`, `startup_timeout_s` (> 0, else ValueError): see `_watchdog`. `metrics`: updated once per
    round (None: off). `state_dir`: journal the job there and resume from a journal found there (a
    journal of another job raises `JournalError`). Starts the lease watchdog; `close()` stops it.
    """

    def __init__(
        self,
        spec: JobSpec,
        lease_s: float = 60.0,
        startup_timeout_s: float = 600.0,
        metrics: CoordinatorMetrics | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        compact_every: int = recovery.COMPACT_EVERY,
        resize: bool = False,
    ) -> None:
        """`resize`: the journal in `state_dir` may be of this job at another world size: go on at this
        one from the trainers' checkpoint (`_resize`)."""
        path = Path(state_dir) / recovery.JOURNAL if state_dir is not None else None
        old = resizing.resize_from(path, recovery.job_of(spec), resize) if path is not None else None
        new, spec = spec, old or spec
        self.configured_budget = new.token_budget  # the commands' (`_oom`: the job's may be lowered)
        self.budget: dict[str, Any] | None = None  # the newest lowered budget's journal record
        if lease_s <= 0 or startup_timeout_s <= 0:
            raise ValueError(f"timeouts must be positive, got {lease_s=} {startup_timeout_s=}")
        if compact_every < 1:
            raise ValueError(f"compact_every must be >= 1, got {compact_every=}")
        self.compact_every = compact_every
        self.spec = spec
        self.metrics = metrics
        self.lease_s, self.startup_timeout_s = lease_s, startup_timeout_s
        self._lock = threading.Lock()  # guards everything below; never held while waiting for a barrier
        self.inbox = RoundInbox()  # the round's messages and pending barriers (`_round`)
        self.epoch = 0
        self.core = self._new_core(0)
        self.failure: str | None = None
        self.informed: set[int] = set()  # ranks told of the failure (they fail their trainers with it)
        self.addresses: dict[int, str] = {}
        self.node_of: dict[int, str] = {}  # rank -> the name of the node agent serving it
        self.liveness = Liveness(spec.world_size, lease_s, startup_timeout_s, time.monotonic())
        self.broken = BrokenStreams(lease_s)  # node agents whose stream broke (`_gone`)
        self._replay = recovery.ReplayTables()
        self.latencies_ms: collections.deque[float] = collections.deque(maxlen=1000)
        self._stop = threading.Event()
        self.journal = Journal(path, recovery.job_of(spec)) if path is not None else None
        self.restored = False
        self.resize_state: resizing.ResizeState | None = None
        if self.journal is not None:
            self._restore(self.journal.open())
        lowered = oom.pending(self.budget, resizing.generation(self.resize_state))
        if (old is not None or lowered) and not self.job_done:  # a finished job has nothing left to resize
            self._begin_resize(self.spec, oom.at_budget(new, self.budget))  # at its restored budget
        self._watchdog = LeaseWatchdog(self.check_leases, min(lease_s / 4, 1.0), self._stop)
        self._watchdog.start()
        if metrics is not None:
            metrics.bind(lambda: self.state, lambda: self.epoch, lambda: len(self.addresses))

    def _new_core(self, epoch: int) -> Coordinator:
        return Coordinator(self.spec, epoch)

    # -- journal -------------------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        """Journals `record` before anyone is told (write-ahead). The caller then updates its tables and
        calls `_compact_if_due`, so a compaction's snapshot holds what `record` says."""
        if self.journal is None:
            return
        if self._stop.is_set():
            raise ShuttingDown("the coordinator is shutting down")
        self.journal.append(record)

    def _compact_if_due(self) -> None:
        """Rewrites the journal as a snapshot every `compact_every` records."""
        if self.journal is not None and self.journal.records_written >= self.compact_every:
            self.journal.compact(self._snapshot())

    def _snapshot(self) -> list[dict[str, Any]]:
        rs = self.resize_state
        ledger = rs.ledger if rs is not None and rs.pending else self.core.ledger
        resize = rs.record() if rs is not None else None
        return recovery.snapshot(
            self.addresses, self.node_of, self._replay, self.liveness.finished, self.failure, ledger, resize,
            self.budget,
        )  # fmt: skip

    # -- resize (`_resize`) ------------------------------------------------------------------------------
    def _begin_resize(self, old: JobSpec, new: JobSpec) -> None:
        """Makes this state, restored at `old`'s world size, a resize to `new` (`_resize.begin`): the
        parties of the old size are forgotten and the journal is rewritten with the new job. Call before
        any party connects."""
        rs, at = resizing.begin(old, new, resizing.generation(self.resize_state) + 1, self.epoch, self.core)
        self.spec = new
        self._reset_parties()
        self.epoch, self.core = at.epoch, at.core
        self.resize_state = rs
        if self.journal is not None:
            self.journal.job = recovery.job_of(oom.configured(new, self.configured_budget))
            self.journal.compact(self._snapshot())

    def _reset_parties(self) -> None:
        """Forgets every party of the old size: registrations, finishes, the failure, the rounds' replay
        tables (a resize)."""
        self.addresses, self.node_of, self.informed = {}, {}, set()
        spec = self.spec
        self.liveness = Liveness(spec.world_size, self.lease_s, self.startup_timeout_s, time.monotonic())
        self.failure = None
        self.inbox.clear()
        self._replay = recovery.ReplayTables()

    def resume(self, rank: int, epoch: int, step: int, from_world: int) -> Resumed:
        """A rank of the resized job resumes its trainer's (epoch, step) (`_resize.resume`); the first one
        fixes where the job goes on, journaled before anyone is told."""
        with self._lock:
            self._check_alive([rank])
            self._touch([rank], "Resume")
            rs = self.resize_state
            resumed, moved = resizing.resume(
                rs, self.spec, (self.epoch, self.core.round), rank, epoch, step, from_world
            )
            if moved is not None and rs is not None:
                self.epoch, self.core = moved.epoch, moved.core
                self._log(rs.record())
                self._compact_if_due()
                resizing.log_fixed(rs, rank)
            return resumed

    def _restore(self, records: list[dict[str, Any]]) -> None:
        """Rebuilds the state from the journal's records (`_recovery`), then compacts the journal."""
        got = recovery.replay_records(records)
        self.addresses, self.node_of, self._replay = got.addresses, got.node_of, got.replay
        self.failure, self.budget, self.spec = got.failure, got.budget, oom.restored(self.spec, got)
        core = self._new_core(self.epoch)
        epoch, core = recovery.resume_core(got, self.epoch, core, self._new_core)
        self.resize_state, at = resizing.restore(got, self.spec, resizing.Position(epoch, core))
        self.epoch, self.core = at.epoch, at.core
        self.liveness.restore(got.registered, got.finished, time.monotonic())
        for node in set(self.node_of.values()):
            topo.label_node(node, self.node_of, self.addresses, self.liveness)
        self.restored = bool(records)
        if self.restored and self.journal is not None:
            log.info(
                "coordinator restored from %s: epoch %d round %d%s, %d rank(s) registered, %d finished%s",
                self.journal.path,
                self.epoch,
                self.core.round,
                " (decided, waiting for commits)" if got.awaiting_commits else "",
                len(got.registered),
                len(got.finished),
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
        """ "failed", "done" or "running"."""
        if self.failure is not None:
            return "failed"
        if self.job_done:
            return "done"
        return "running"

    def close(self) -> None:
        """Stops the state (a shutdown: a restart may follow): every pending and later barrier call
        raises `ShuttingDown` (UNAVAILABLE: callers retry), the watchdog stops, the journal is closed."""
        with self._lock:
            self._stop.set()
            self.inbox.complete_all((ShuttingDown, "the coordinator is shutting down"))
            if self.journal is not None:
                self.journal.close()

    def _fail_locked(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            log.error("job failed: %s", message)
            try:
                self._log({"kind": "failure", "message": message})
                self._compact_if_due()
            except OSError as exc:
                log.error("could not journal the failure: %s", exc)
        self.inbox.complete_all((JobFailed, self.failure))

    def fail(self, rank: int, reason: str) -> None:
        """Fails the job (`Fail` RPC): every waiter, pending and later, gets JobFailed(ABORTED)."""
        with self._lock:
            self._fail_locked(f"rank {rank}: {reason}")

    def oom(self, rank: int, epoch: int, step: int, cost: float) -> tuple[int, str]:
        """Rank `rank`'s trainer ran out of memory on (`epoch`, `step`), of planned cost `cost` (`_oom`):
        journals the lowered budget, fails the job; returns (the job's budget after the restart, the
        job's failure)."""
        with self._lock:
            self.check_rank(rank, "Oom")
            gen = resizing.generation(self.resize_state)
            rec, message = oom.report(self.budget, self.spec, gen, rank, (epoch, step), cost)
            if rec is not None:
                self._log(rec)
                self.budget = rec
            self._fail_locked(message)
            return oom.at_budget(self.spec, self.budget).token_budget, self.failure or message

    def check_leases(self, log_after: float) -> tuple[float, str | None]:
        """The watchdog's tick (`_watchdog`): fails the job if a party's lease or the start-up timeout
        lapsed. Returns (now, whom the job waits for, or None): the latter only at now >= `log_after`,
        while the job runs."""
        with self._lock:
            now = time.monotonic()
            if self.failure is not None or self.job_done:
                return now, None
            failure = self.liveness.check(now) or self.broken.check(now)
            if failure is not None:
                self._fail_locked(failure)
                return now, None
            if now < log_after:
                return now, None
            return now, self.liveness.waiting(now) or self._waiting_for_trainers()

    def node_stream_ended(self, node: str, ranks: list[int], journaled: bool) -> None:
        """A node agent's stream ended (`_gone`): noticed unless the job or its ranks are done."""
        with self._lock:
            if self.failure is None and not self.job_done and not set(ranks) <= self.liveness.finished:
                self.broken.broke(node, ranks, journaled, time.monotonic())

    def _waiting_for_trainers(self) -> str | None:
        if self.rounds_done:
            left = [r for r in range(self.spec.world_size) if r not in self.liveness.finished]
            return f"rounds done; waiting for the trainers of rank(s) {left} to take their last step"
        return None

    def _check_alive(self, ranks: list[int] | None = None) -> None:
        """Raises JobFailed (the ranks then count as told) or ShuttingDown unless the job runs."""
        if self.failure is not None:
            if ranks is not None:
                self.informed.update(ranks)
            raise JobFailed(self.failure)
        if self._stop.is_set():
            raise ShuttingDown("the coordinator is shutting down")

    def all_informed(self) -> bool:
        """Every registered rank that has not finished has been told of the failure (or the job is fine)."""
        with self._lock:
            waiting = set(self.addresses) - self.liveness.finished - self.informed
            return not waiting

    def check_rank(self, rank: int, what: str) -> None:
        """Raises ValueError (INVALID_ARGUMENT) naming `what` unless 0 <= rank < world_size."""
        if not 0 <= rank < self.spec.world_size:
            raise ValueError(
                f"{what} from rank {rank}, but the job has ranks 0..{self.spec.world_size - 1} "
                f"(world_size={self.spec.world_size})"
            )

    def _touch(self, ranks: list[int], what: str) -> None:
        """Every rank of one message was seen now (one clock read); ProtocolError on an unregistered one."""
        now = time.monotonic()
        addresses, seen = self.addresses, self.liveness.seen
        for rank in ranks:
            if rank not in addresses:  # a registered rank is in range
                self.check_rank(rank, what)
                raise ProtocolError(f"{what} from rank {rank}, which has not registered")
            seen(rank, now)

    # -- registration --------------------------------------------------------------------------------
    def _check_spec(self, who: str, spec: JobSpec) -> None:
        diff = oom.configured(self.spec, self.configured_budget).diff(spec)
        if diff:
            party = who.split(" ")[0] if who.startswith("rank") else "node agent"
            detail = ", ".join(
                f"{k}: coordinator {a!r}, {party} {b!r}"
                for k, a, b in ((k, *v) for k, v in sorted(diff.items()))
            )
            raise ProtocolError(f"{who} registered with a different job spec ({detail})")

    def _register_locked(self, rank: int, address: str, node: str | None) -> None:
        if self.addresses.get(rank) != address or self.node_of.get(rank) != node:
            self._log(recovery.register_record(rank, address, node))
            self.addresses[rank] = address
            if node is None:
                self.node_of.pop(rank, None)
            else:
                self.node_of[rank] = node
            self._compact_if_due()
        self.liveness.register(rank, time.monotonic())

    def _registration(self) -> Registration:
        addrs = tuple(self.addresses.get(r, "") for r in range(self.spec.world_size))
        return Registration(
            self.epoch,
            self.core.round,
            addrs if all(addrs) else (),
            self.lease_s,
            resizing.generation(self.resize_state),
            resizing.resume_needed(self.resize_state, (self.epoch, self.core.round)),
            self.spec.token_budget if self.budget is not None else 0,
        )

    def register(self, rank: int, spec: JobSpec, address: str) -> Registration:
        """Rank `rank` at `address` registers (again, after a restart): where the job is, every rank's
        address (none until all registered), the lease and the resize. Raises ValueError, ProtocolError,
        JobFailed, ShuttingDown."""
        with self._lock:
            self._check_alive([rank])
            self.check_rank(rank, "Register")
            self._check_spec(f"rank {rank}", spec)
            # A rank a node agent serves keeps its node when it registers alone (refreshing its peers).
            node = self.node_of.get(rank) if self.addresses.get(rank) == address else None
            self._register_locked(rank, address, node)
            return self._registration()

    def register_node(self, node: str, ranks: list[int], spec: JobSpec, address: str) -> Registration:
        """A node agent (`node`, its name) serving `ranks` at `address` registers them all (again, after a
        restart); returns as `register`. Refuses a rank that another node agent serves and that is still
        alive (`_topology.check_claim`)."""
        topo.check_node_message(node, ranks)
        with self._lock:
            self._check_alive(ranks)
            for r in ranks:
                self.check_rank(r, f"Register of node agent {node!r}")
            self._check_spec(f"node agent {node!r}", spec)
            topo.check_claim(node, ranks, self.node_of, self.addresses, self.liveness, time.monotonic())
            for r in ranks:
                self._register_locked(r, address, node)
            topo.label_node(node, self.node_of, self.addresses, self.liveness)
            self.broken.back(node)
            log.info("node agent %r at %s registered rank(s) %s", node, address, topo.span(sorted(ranks)))
            return self._registration()

    def topology(self) -> list[int] | None:
        """The node index of every rank, or None while node-blind (`_topology.node_indices`)."""
        return topo.node_indices(self.node_of, self.spec.world_size)

    def heartbeat_many(self, ranks: list[int]) -> tuple[str, str]:
        """The ranks are alive: (state, failure or ""); the ranks count as told of a failure."""
        with self._lock:
            self._touch(ranks, "Heartbeat")
            if self.failure is not None:
                self.informed.update(ranks)
            return self.state, self.failure or ""

    def finish(self, rank: int) -> None:
        """Rank `rank`'s trainer took the job's last step (ProtocolError before the last round)."""
        with self._lock:
            self._check_alive([rank])
            self._touch([rank], "Finish")
            if not self.rounds_done:
                raise ProtocolError(
                    f"rank {rank} finished while the job is in epoch {self.epoch} round "
                    f"{self.core.round} of {self.spec.epochs} epoch(s)"
                )
            if rank not in self.liveness.finished:
                self._log({"kind": "finish", "rank": rank})
                self.liveness.finish(rank, time.monotonic())
                self._compact_if_due()
                log.info(
                    "rank %d finished (%d of %d)", rank, len(self.liveness.finished), self.spec.world_size
                )

    # -- barriers ------------------------------------------------------------------------------------
    def barrier_future(self, barrier: Barrier) -> asyncio.Future[Barrier]:
        """A future of the running loop for one waiter, resolved (to `barrier`) once `barrier` completes:
        await it, then read `outcome`. Cancelling it (the waiter's call ended) touches no other waiter."""
        loop = asyncio.get_running_loop()
        with self._lock:
            return barrier.future(loop)

    def outcome(
        self, barrier: Barrier, ranks: list[int], timeout: float | None = None
    ) -> RoundDecision | RoundTotals:
        """The result of `barrier` for a waiter on behalf of `ranks`, blocking until it completes: the
        decision / totals, else raises what completed it (JobFailed, the ranks being then told of the
        failure; ShuttingDown). `timeout` (s) raises TimeoutError. Returns at once once completed."""
        if not barrier.wait(timeout):
            raise TimeoutError(f"barrier {barrier.key} not complete within {timeout=}")
        if barrier.error is not None:
            cls, message = barrier.error
            if cls is JobFailed:
                with self._lock:
                    self.informed.update(ranks)
            raise cls(message)
        assert barrier.result is not None  # a barrier completes with a result or an error
        return barrier.result

    # -- align -----------------------------------------------------------------------------------------
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
            self.inbox.clear()
            return
        raise ProtocolError(
            f"epoch {epoch} requested while the coordinator is in epoch {self.epoch} "
            f"({'done' if self.core.done else 'running'})"
        )

    def submit_align(self, epoch: int, reports: list[RankReport]) -> RoundDecision | Barrier:
        """The reports of one or more ranks (a node agent sends its ranks' at once) for one round,
        without blocking: the decision when the round is decided (these reports completed it, or it is
        a replay for a restarted rank), else the pending barrier to wait on (`outcome`,
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
            self._touch(ranks, "Align")
            rnd = one_round(reports, "Align")
            key = (epoch, rnd)
            replay = self._replay.decisions.get(key)
            if replay is not None:  # for a restarted rank
                return replay
            if self.resize_state is not None and self.resize_state.pending:
                raise ProtocolError(
                    f"rank(s) {ranks} report round {rnd} of epoch {epoch}, but the job was resized and "
                    f"no rank resumed it yet: a rank calls Resume with its trainer's step first"
                )
            self._advance_epoch(epoch)
            if rnd != self.core.round:
                raise ProtocolError(
                    f"rank(s) {ranks} report round {rnd} of epoch {epoch}; "
                    f"the coordinator is at round {self.core.round}"
                )
            self.inbox.add_reports(reports)
            if len(self.inbox.reports) < self.spec.world_size:
                return self.inbox.barrier(("align", *key))
            return self._decide(key)

    def _decide(self, key: tuple[int, int]) -> RoundDecision:
        """Every report of round `key` is in: decides, journals, completes the barrier."""
        t_last = time.perf_counter()
        topology = self.topology()
        try:
            planned = self.spec.policy.nodes != "blind"
            self.core.set_topology(topology if planned else None, topology)
            decision = self.core.decide(list(self.inbox.reports.values()))
        except ValueError as exc:
            self._fail_locked(f"round {key[1]} could not be decided: {exc}")
            raise
        self._log(recovery.decision_record(key, decision))
        if self.metrics is not None:
            wait_s = t_last - (self.inbox.started or t_last)
            observe_decision(self.metrics, decision, topology, wait_s, time.perf_counter() - t_last)
        self._replay.decided(key, decision)
        self._compact_if_due()
        self.inbox.reports.clear()
        self.inbox.complete(("align", *key), decision)
        return decision

    # -- commit ----------------------------------------------------------------------------------------
    def submit_commit(
        self, epoch: int, commits: list[RankCommit], sums: list[Sums] | None = None
    ) -> RoundTotals | Barrier:
        """The commits of one or more ranks for one round, without blocking: the totals when the round is
        committed (these commits completed it, or a replay), else the pending barrier. The totals are
        journaled before anyone is told of them. `sums[i]`: per step of `commits[i]`, its (samples,
        tokens, loss tokens) (`wire.commit_with_sums_from_pb`); when every rank's commit of the round
        came with them, the core adds those instead of every sample. Raises as `submit_align`."""
        if not commits:
            raise ValueError("a Commit without any commit")
        ranks = [c.rank for c in commits]
        with self._lock:
            self._check_alive(ranks)
            self._touch(ranks, "Commit")
            rnd = one_round(commits, "Commit")
            key = (epoch, rnd)
            replay = self._replay.totals.get(key)
            if replay is not None:
                return replay
            if epoch != self.epoch or rnd != self.core.round or key not in self._replay.decisions:
                raise ProtocolError(
                    f"rank(s) {ranks} commit round {rnd} of epoch {epoch} "
                    f"before it was decided (coordinator at epoch {self.epoch} "
                    f"round {self.core.round})"
                )
            self.inbox.add_commits(commits, sums)
            if len(self.inbox.commits) < self.spec.world_size:
                return self.inbox.barrier(("commit", *key))
            return self._total(key)

    def _total(self, key: tuple[int, int]) -> RoundTotals:
        """Every commit of round `key` is in: totals, journals, completes the barrier."""
        commits = list(self.inbox.commits.values())
        try:
            totals = self.core.commit(commits, self.inbox.all_sums())
        except ValueError as exc:
            self._fail_locked(f"round {key[1]} could not be committed: {exc}")
            raise
        core_state = self.core.state_dict()
        self._log(recovery.totals_record(key, totals, core_state, self.core.ledger))
        self._replay.committed(key, totals, core_state)
        self._compact_if_due()
        if self.metrics is not None:
            round_s = time.perf_counter() - (self.inbox.started or time.perf_counter())
            observe_commit(self.metrics, commits, totals, round_s)
        self.inbox.commits.clear()
        self.inbox.sums.clear()
        if self.inbox.started is not None:
            self.latencies_ms.append((time.perf_counter() - self.inbox.started) * 1000)
        self.inbox.complete(("commit", *key), totals)
        return totals

    def status(self) -> JobStatus:
        """What `Status` reports: state, failure, epoch, round, registered and finished ranks, the last 100
        rounds' latencies (ms, first report -> totals)."""
        with self._lock:
            return JobStatus(
                state=self.state,
                failure=self.failure or "",
                epoch=self.epoch,
                round=self.core.round,
                registered=tuple(sorted(self.addresses)),
                finished=tuple(sorted(self.liveness.finished)),
                round_latency_ms=tuple(list(self.latencies_ms)[-100:]),
            )
