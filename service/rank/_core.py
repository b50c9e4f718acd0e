"""`RankServiceCore`: one rank's state and its round loop, the facade over its parts.

One process per trainer rank (or one per rank inside a node agent). A loop thread runs the core's round
protocol against the coordinator:

    fill the window from the source -> wait for a free output slot -> report -> Align -> lend
    -> Commit -> finalize -> fetch the moved payloads -> collate the steps -> journal -> expose them
    to the trainer

and a watcher thread judges the trainer's liveness. The parts, each in its own module:
    `_delivery`  the trainer streams (attach, credits, acks) over `core.Delivery`: `TrainerSide`
    `_payloads`  the payloads held, lent to and fetched from peers, and collation: `Payloads`, `collate`
    `_journal`   the rank journal (each round and fill; a restart builds the core from it: `_restore`)
    `_server`    the gRPC servicer over one or several cores;  `_limits`  its waits and its budget

Deterministic mode (`JobSpec.deterministic`): the rank reports only a full window (or its source's end),
waiting for the source as long as it takes, and a fixed capacity max(1, depth // 2) once that many slots
are free (`batchd.core.fill_may_stop`, `report_capacity`): no report depends on timing, so with an
ordered source (a `RaySource` emits in view order) the same data, seed and config make the same batches.

Failure: the coordinator's (it names the rank) reaches the trainer as ABORTED; a crash of the loop, a lost
Ray (`RayLost`) or too many bad records fail the job, named. Locking: `cond` guards the rank state, the
delivery and the held batches; the loop holds it only between its coordinator calls, never across one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sized
from pathlib import Path
from typing import Any

import grpc

from batchd.core import (
    CoordinatorError,
    Delivery,
    JobSpec,
    RankState,
    Remainder,
    Step,
    fill_may_stop,
    report_capacity,
)
from batchd.proto import Security
from batchd.proto import batchd_pb2 as pb

from .._coord_client import CoordinatorLink
from .._metrics import RankMetrics, materialized_tokens
from ..preprocess import (
    EXHAUSTED,
    IngestRefused,
    IngestSource,
    RayLost,
    Source,
    TooManyBadRecords,
    missing_source_members,
)
from ._delivery import WATCH_S, TrainerSide
from ._journal import JournalRecord, journal_path, load_journal, remake, restore_error, write_journal
from ._limits import Limits, adopt_budget
from ._payloads import FetchRefused, Payloads, batch_of, truncated

log = logging.getLogger("batchd.rank")
DETERMINISTIC_POLL_S = (
    0.5  # deterministic fill: how long one poll waits before failure and stop are looked at
)


class RankServiceCore:
    """State and loop of one rank service (see module docstring).

    Attributes (beside the constructor's): `delivery` (`core.Delivery`), `state` (this epoch's
    `core.RankState`), `cond` (the one lock), `failure` (the job's failure message, or None),
    `failure_told` (the trainer heard it), `finished` (the coordinator knows this rank's trainer took
    the job's last step), `restored_finished` (restored from a journal written after that),
    `waiting_for_trainer` (the loop waits for a free output slot), `samples_made` (samples of every rank
    in this epoch's steps so far), `journal` (its path, or None); its parts `streams` (`TrainerSide`:
    the trainer streams and the held batches) and `store` (`Payloads`: the payloads held, lent and
    fetched, the peers' addresses), which callers use directly.
    """

    def __init__(
        self,
        rank: int,
        spec: JobSpec,
        coordinator: CoordinatorLink,
        source: Source,
        state_dir: str | os.PathLike[str] | None = None,
        limits: Limits | None = None,
        security: Security | None = None,
        metrics: RankMetrics | None = None,
    ) -> None:
        """`limits`: its timeouts and what it retains for a rewind (default `Limits()`); `state_dir`: its
        journal; `security`: its server's and peer channels' TLS / token; `metrics`: Prometheus metrics
        (None: off). It starts in epoch 0, or where its journal or the coordinator's registration says.

        Raises TypeError naming the missing members when `source` is not a `Source`, and ValueError
        naming the value when `limits` is not a `Limits`, or the file and why when `state_dir` holds a
        journal this build cannot resume from."""
        limits = Limits() if limits is None else limits
        if not isinstance(limits, Limits):
            raise ValueError(f"rank {rank}: limits must be a Limits, got {limits=!r}")
        client_grace_s, trainer_timeout_s = limits.client_grace_s, limits.trainer_timeout_s
        if not isinstance(source, Source):
            raise TypeError(
                f"rank {rank}: the source must implement batchd.service.preprocess.Source; "
                f"{type(source).__name__} lacks {missing_source_members(source)}"
            )
        if spec.deterministic and getattr(source, "ordered", True) is False:
            raise ValueError(
                f"rank {rank}: deterministic=true needs a source that emits in its view's order, "
                f"got a {type(source).__name__} with ordered=False (completion order follows timing)"
            )
        self.rank, self.spec, self.coord, self.source = rank, spec, coordinator, source
        self.metrics = metrics  # Prometheus metrics (`_metrics`), updated once per round; None = off
        self.security = security  # this process's TLS / token: its server and its peer (Fetch) channels
        self.limits, retain_bytes = limits, limits.retain_bytes
        self.client_grace_s, self.fill_timeout_s = client_grace_s, limits.fill_timeout_s
        self.trainer_timeout_s = trainer_timeout_s
        self.delivery = Delivery(
            rank, spec.epochs, spec.policy.depth, client_grace_s, trainer_timeout_s, time.monotonic(), 0
        )
        self.state = self.new_state(0)
        self.rejected_before = 0  # over-budget rejections of the epochs before this one (metrics)
        self.finished = False
        self.filled = False  # the restored buffer is the current round's report (`_journal`)
        self.waiting_for_trainer = False  # (tests: the journal is stable while this holds)
        self.samples_made = 0
        self.generation = 0  # the job's resizes this rank's state is of (`_resume`)
        self.remainder: Remainder | None = None  # the epoch's remainder after the last resize, if any
        self.restored_finished = False
        self.failure: str | None = None
        self.failure_told = False  # the trainer heard the failure (ABORTED, or a RankStatus that said it)
        self.cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self.streams = TrainerSide(
            self.delivery, self.cond, self._stop, lambda: self.failure, self._write_journal, retain_bytes
        )
        self.store = Payloads(
            rank, spec.world_size, source, lambda: self.coord, security, self._stop, lambda: self.epoch
        )
        self.journal = journal_path(state_dir, rank)
        if self.journal is not None and self.journal.exists():
            record = load_journal(self.journal, rank, self.state.world_size)
            if record is not None:  # else a resized job's: the rank resumes where the coordinator says
                self._restore(record, self.journal)
        self.delivery.await_resume()  # trainers wait until the registration says whether the job was resized
        if metrics is not None:  # read at scrape time, lock-free: len() of a list / dict
            metrics.bind(lambda: len(self.state.buffer), lambda: len(self.delivery.ready), lambda: self.epoch)

    def new_state(self, epoch: int) -> RankState:
        """A fresh rank state of `epoch` for this rank."""
        return RankState(self.spec, self.rank, epoch)

    @property
    def epoch(self) -> int:
        return self.delivery.epoch

    @property
    def done(self) -> bool:
        """This epoch has no further step."""
        return self.delivery.done

    # -- kept for the launchers (service/_node.py, _run_node.py) until their rework lands: use `store` ----
    @property
    def fetched(self) -> dict[str, int]:
        return self.store.fetched

    @property
    def local_peers(self) -> Mapping[int, Payloads]:
        """The other ranks of this node agent, in process (their moved samples are handed over, no copy)."""
        return self.store.local_peers

    @local_peers.setter
    def local_peers(self, value: Mapping[int, RankServiceCore]) -> None:
        self.store.local_peers = {r: core.store for r, core in value.items()}

    # -- what the servicer calls beside the parts (`streams`: the trainers, `store`: lending) ------------
    def lend_out(self, ids: list[int], epoch: int, limit_bytes: int) -> list[pb.IngestRequest]:
        """`Payloads.lend_out` for a peer's `Fetch` of samples of `epoch`: this epoch or the one before (a
        peer still finishing it). Raises FetchRefused for another epoch, or a payload no one has."""
        if not self.epoch - 1 <= epoch <= self.epoch:
            raise FetchRefused(
                f"Fetch of samples of epoch {epoch}, but rank {self.rank} is in epoch {self.epoch} "
                f"(the job runs {self.spec.epochs} epoch(s))"
            )
        return self.store.lend_out(ids, epoch, limit_bytes)

    def ingest_source(self) -> IngestSource:
        """This rank's source, when producers push to it. Raises IngestRefused when it reads its own."""
        if not isinstance(self.source, IngestSource):
            raise IngestRefused(f"rank {self.rank} reads its own source; it does not accept Ingest streams")
        return self.source

    def wait_for_epoch(self, epoch: int, sample_id: int, active: Callable[[], bool]) -> None:
        """Holds a pushed record (sample `sample_id`) of `epoch` until this rank is in it: a later epoch of
        the job waits while `active()` (its stream is open) and the job has not failed.

        Raises:
            IngestRefused: the record is (still) for another epoch than this rank's.
        """
        if self.epoch < epoch < self.spec.epochs:  # a later epoch: wait until this rank starts it
            with self.cond:
                while self.epoch < epoch and self.failure is None and active():
                    self.cond.wait(0.5)
        if epoch != self.epoch:
            raise IngestRefused(
                f"sample {sample_id} is for epoch {epoch}; rank {self.rank} is in epoch {self.epoch}"
            )

    # -- journal (`_journal`) -----------------------------------------------------------------------
    def _write_journal(self, filled: bool = False) -> None:
        """Journals this rank now (call with `cond` held: the states must not move under it)."""
        if self.journal is None:
            return
        ready, past = self.streams.batches, self.streams.past
        record = JournalRecord(
            delivery=self.delivery.state_dict(),
            rank=self.state.state_dict(),
            source=self.source.state_dict(),
            ready=tuple(ready[i][0] for i in sorted(ready)),
            past={q: tuple(held[i][0] for i in sorted(held)) for q, held in past.items()},
            rejected_before=self.rejected_before,
            finish_acked=self.finished,
            filled=filled,
            generation=self.generation,
            remainder=self.remainder,
        )
        write_journal(self.journal, record.to_json())

    def _restore(self, record: JournalRecord, path: Path) -> None:
        """Builds this (new) rank service's state from its journal `record` (`_journal` module docstring):
        the delivery, the epoch's rank state and source position, the buffered payloads and the held steps
        (re-collated), whether the trainer took the job's last step and whether the buffer was filled.
        Raises ValueError naming `path` when a state is of another job, rank or configuration."""
        self.generation, self.remainder = record.generation, record.remainder
        try:
            self.delivery.load_state_dict(record.delivery, time.monotonic())
            rem = (
                self.remainder if self.remainder is not None and self.remainder.epoch == self.epoch else None
            )
            for q in sorted(record.past):  # held for a rewind: re-made in their own epoch
                self.source.start_epoch(q)
                _, batches = remake(self.source, record.past[q], [], q, self._batch)
                held = zip(record.past[q], batches, strict=True)
                self.streams.past[q] = {step.info.step: (step, batch) for step, batch in held}
            adopt_budget(self, RankState.budget_in(record.rank), "its journal's")
            self.state = self.new_state(self.epoch)
            if self.epoch != 0 or rem is not None:
                self.source.start_epoch(self.epoch, rem)
            self.rejected_before = record.rejected_before
            self.state.load_state_dict(record.rank)
            self.source.load_state_dict(record.source)
        except (ValueError, KeyError) as exc:  # a state of another job, rank or configuration
            raise restore_error(path, self.rank, exc) from exc
        ids = [entry.sample.id for entry in self.state.buffer]
        made, batches = remake(self.source, record.ready, ids, self.epoch, self._batch)
        self.store.held.update((i, made[i]) for i in ids)
        for step, batch in zip(record.ready, batches, strict=True):
            self.streams.batches[step.info.step] = (step, batch)
        self.streams.recount()
        self.streams.prune()
        self.restored_finished = self.delivery.finished
        self.finished = record.finish_acked  # the coordinator knew: it may be gone by now
        self.filled = record.filled  # report the journaled buffer as it is (see `_journal`)
        log.info(
            "rank %d restored from %s at epoch %d round %d (step %d)%s",
            self.rank,
            path,
            self.epoch,
            self.state.round,
            self.state.step,
            "; its trainer took the job's last step" if self.restored_finished else "",
        )

    # -- loop ---------------------------------------------------------------------------------------
    def start(self, my_address: str) -> None:
        self.store.address = my_address
        self._thread = threading.Thread(target=self._run, name=f"batchd-rank-{self.rank}", daemon=True)
        self._thread.start()
        self._watcher = threading.Thread(
            target=self._watch, name=f"batchd-rank-watch-{self.rank}", daemon=True
        )
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        self.store.close()

    def join(self, timeout: float | None = None) -> None:
        for thread in filter(None, (self._thread, self._watcher)):
            thread.join(timeout)

    def set_failure(self, message: str) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = message
                log.error("rank %d: job failed: %s", self.rank, message)
            self.cond.notify_all()

    def fail_ray(self, lost: RayLost) -> None:
        """Fails the job because this rank's Ray went away (`RayLost`): tells the coordinator (which names
        this rank to every party) and this rank's trainer."""
        with self.cond:
            first = self.failure is None
        self.set_failure(f"rank {self.rank}: {lost}")
        if first:
            self.coord.fail(str(lost))

    def _watch(self) -> None:
        """Judges the trainer's liveness (`Delivery.check`) every WATCH_S: a gone trainer fails the job,
        naming this rank."""
        while not self._stop.wait(WATCH_S):
            with self.cond:
                if self.failure is not None:
                    return
                why = self.delivery.check(time.monotonic())
            if why is not None:
                self.coord.fail(why)
                self.set_failure(f"rank {self.rank}: {why}")
                return

    def _run(self) -> None:
        if self.finished:  # restored after the coordinator took this rank's Finish: nothing left to ask it
            with self.cond:
                self.delivery.release()
                self.cond.notify_all()
            log.info(
                "rank %d: the job's last step was taken before this restart; serving only its end", self.rank
            )
            return
        try:
            self._epochs()
        except CoordinatorError as exc:
            if self._stop.is_set() and self.failure is None:  # stopping (a restart may follow):
                log.debug("rank %d loop ended by stop(): %s", self.rank, exc)  # not a failure of the job
                return
            if exc.code != grpc.StatusCode.ABORTED and not self._stop.is_set():  # not the job's: tell it
                self.coord.fail(str(exc))
            self.set_failure(str(exc))
        except RayLost as exc:  # its Ray went away: the job's failure, named, no traceback
            self.fail_ray(exc)
        except TooManyBadRecords as exc:  # the data's failure, not the service's: no traceback
            self.coord.fail(str(exc))  # (the coordinator names the rank)
            self.set_failure(f"rank {self.rank}: {exc}")
        except Exception as exc:  # noqa: BLE001 - any bug must reach the trainer and the job, not vanish
            if self._stop.is_set():  # stopped mid-round: its channels are closing under it, not a crash
                log.debug("rank %d loop ended by stop(): %s: %s", self.rank, type(exc).__name__, exc)
                return
            log.exception("rank %d loop crashed", self.rank)
            msg = f"rank {self.rank} service crashed: {type(exc).__name__}: {exc}"
            self.coord.fail(msg)
            self.set_failure(msg)

    def _epochs(self) -> None:
        """Registers, then runs the rounds of each epoch until the trainer took the job's last step."""
        reply = self.coord.register(self.store.address)
        adopt_budget(self, reply.token_budget, "the coordinator's")
        self.store.peers = list(reply.rank_addresses)
        self.coord.start_heartbeats(self.set_failure)
        if reply.generation != self.generation:
            self._resume(reply)
        else:
            with self.cond:
                self.delivery.release()
                self.cond.notify_all()
        while True:
            while not self.done and not self._stop.is_set():
                self._round()
            if not self._end_sent():
                break
            if self.delivery.finished:
                self.coord.finish()
                with self.cond:
                    self.finished = True
                    self._write_journal()
                    self.cond.notify_all()
                log.info("rank %d: its trainer took the job's last step", self.rank)
                break
            self._next_epoch()  # unless a trainer rewound into this epoch since: then it takes its end again

    def _resume(self, registered: pb.RegisterReply) -> None:
        """The job was resized (`batchd.core._resize`; generation `registered.generation`): what this rank
        holds, of another world size or of nothing, is stale. Its first trainer to connect says where the
        job goes on (the step of its checkpoint); the coordinator answers with the epoch's first round and
        step at the new size and the samples left; the source then reads this rank's share of them."""
        if not registered.resume_needed:
            raise CoordinatorError(
                f"rank {self.rank}'s state is of resize generation {self.generation}, the job's is "
                f"{registered.generation}, and it has gone on: a rank of it that lost its state cannot rejoin"
            )
        with self.cond:
            if not self.delivery.awaiting:
                self.delivery.await_resume()
            self.streams.clear()
            self.store.held.clear()
            self.finished = self.restored_finished = self.filled = False
            deadline = time.monotonic() + self.trainer_timeout_s
            while self.delivery.resume_request is None:
                if self.failure is not None or self._stop.is_set():
                    raise CoordinatorError(self.failure or "stopped")
                if time.monotonic() > deadline:
                    raise CoordinatorError(
                        f"rank {self.rank}: no trainer connected within {self.trainer_timeout_s:g}s to say "
                        f"where the resized job resumes"
                    )
                self.cond.wait(0.5)
            epoch, step = self.delivery.resume_request
        reply = self.coord.resume(epoch, step, self.streams.resize_from)
        remainder = Remainder.from_json(json.loads(reply.remainder)) if reply.remainder else None
        with self.cond:
            self.generation, self.remainder = int(reply.generation), remainder
            self.state = self.new_state(int(reply.epoch))
            self.state.start_at(int(reply.round), int(reply.step))
            self.source.start_epoch(int(reply.epoch), remainder)
            self.samples_made = len(remainder.consumed) if remainder is not None else 0
            self.delivery.start_at(int(reply.epoch), int(reply.step), time.monotonic())
            if reply.job_end:  # the job's last epoch is complete: its end is all the trainer has to take
                self.delivery.close()
            self._write_journal()
            self.cond.notify_all()
        share = len(self.source) if isinstance(self.source, Sized) else "?"
        left = f", {share} sample(s) of its share left" if remainder is not None else ""
        log.info(
            "rank %d: the resized job goes on at epoch %d step %d%s", self.rank, reply.epoch, reply.step, left
        )

    def _end_sent(self) -> bool:
        """Waits until the trainer has taken this epoch's end (every step acknowledged); False if the job
        failed or the service stops first."""
        with self.cond:
            while not self.delivery.end_sent and self.failure is None and not self._stop.is_set():
                self.cond.wait(0.5)
            return self.delivery.end_sent and self.failure is None and not self._stop.is_set()

    def _next_epoch(self) -> None:
        """Starts the next epoch: a fresh rank state and the source's next view. In non-join mode the
        samples still buffered at the quota are dropped, as at the end of a one-epoch job."""
        with self.cond:
            if not self.delivery.can_advance:  # a trainer rewound into this epoch after taking its end
                return
            self.rejected_before += self.state.counters["rejected"]
            self.streams.end_epoch()
            self.delivery.advance(time.monotonic())
            self.state = self.new_state(self.epoch)
            self.source.start_epoch(self.epoch)
            self.samples_made = 0
            self.store.held.clear()
            self.streams.prune()
            self._write_journal()
            self.cond.notify_all()
        log.info("rank %d: epoch %d of %d starts", self.rank, self.epoch, self.spec.epochs)

    def _fill(self) -> None:
        """Tops the buffer up from the source (`fill_may_stop`): by default with what it has ready by a short
        deadline; in deterministic mode until the window is full or the source exhausted, waiting for it as
        long as it takes (a failure or a stop ends the wait)."""
        deterministic = self.spec.deterministic
        deadline = time.monotonic() + self.fill_timeout_s
        held = self.store.held
        while self.state.room > 0 and not self.state.exhausted:
            if self.spec.mode == "non-join":
                peek = self.source.peek_id()
                if peek is not None and self.state.holds(peek):
                    break  # wrap-around: this id's previous pass is still buffered
            if deterministic:
                wait = DETERMINISTIC_POLL_S
            else:
                wait = 0.0 if self.state.buffer else max(deadline - time.monotonic(), 0.0)
            item = self.source.poll(wait)
            if item is EXHAUSTED:
                self.state.mark_exhausted()
                break
            if item is None:
                if fill_may_stop(
                    self.state.room,
                    self.state.exhausted,
                    len(self.state.buffer),
                    deterministic,
                    time.monotonic() >= deadline,
                ):
                    break
                if deterministic and (self.failure is not None or self._stop.is_set()):
                    raise CoordinatorError(self.failure or "stopped")
                continue
            sample, payload = item
            if self.state.was_rejected(sample.id):
                continue
            cut = None
            if self.spec.policy.over_budget == "truncate" and sample.length > self.state.truncate_length:
                payload, cut = truncated(payload, self.state.truncate_length)
            if self.state.push(sample, cut) == "rejected":
                continue
            held[sample.id] = payload
        unread = getattr(self.source, "unread", None)  # optional in `Source`
        self.state.set_unread(0 if self.state.exhausted else unread() if callable(unread) else None)

    def _wait_for_room(self) -> int:
        """Waits until the trainer has freed output slots (a slow trainer as long as it takes; a gone one
        fails in `_watch`); returns the capacity to report. Raises CoordinatorError on failure or stop."""
        with self.cond:
            spec = self.spec
            while (
                capacity := report_capacity(self.delivery.capacity, spec.policy.depth, spec.deterministic)
            ) is None:
                if self.failure is not None or self._stop.is_set():
                    break
                self.waiting_for_trainer = True
                self.cond.wait(0.5)
            self.waiting_for_trainer = False
            if capacity is None or self.failure is not None or self._stop.is_set():
                raise CoordinatorError(self.failure or "stopped")
        return capacity

    def _round(self) -> None:
        if self.filled:  # restored with the buffer of this round's report: no fill
            self.filled = False
        else:  # journaled before it is reported, even unchanged: a restored rank must not fill it again
            self._fill()
            with self.cond:
                self._write_journal(filled=True)
        metrics = self.metrics
        if metrics is not None:
            self._observe(
                metrics.observe_quarantine,
                self.source.reasons,
                self.rejected_before + self.state.counters["rejected"],
            )
        t_wait = time.perf_counter()
        capacity = self._wait_for_room()
        t_report = time.perf_counter()
        report = self.state.report(capacity)
        decision = self.coord.align(self.epoch, report)
        commit = self.state.apply(decision)
        self.store.lend(decision)  # before the commit: peers fetch only once every rank committed
        totals = self.coord.commit(self.epoch, commit)
        t_totals = time.perf_counter()
        steps = self.state.finalize(totals)
        self.samples_made += sum(st.info.global_samples for st in steps)
        batches = self._collate_steps(steps)
        if metrics is not None:  # before the batches become visible: a drained trainer sees final counts
            self._observe(metrics.observe_output_wait, t_report - t_wait)
            self._observe(
                metrics.observe_round,
                t_totals - t_report,
                [st.info for st in steps],
                [materialized_tokens(b) for _, _, b in batches],
            )
        with self.cond:
            for i, step, b in batches:
                self.streams.batches[i] = (step, b)
            self.delivery.add([i for i, _, _ in batches])
            if totals.done:
                self.delivery.close()
            self._write_journal()
            self.cond.notify_all()

    def _collate_steps(self, steps: list[Step]) -> list[tuple[int, Step, pb.Batch]]:
        """Fetches the payloads the plan moved here and collates each step: (step number, step, batch)."""
        self.store.fetch_moved(steps)
        batches = []
        image_only: set[int] = set()
        for step in steps:  # the images' and clips' payloads before the LLM ones: a sample may be in both
            images, clips = self.store.encoded(step.exchange), self.store.encoded(step.audio_exchange)
            for ex in (step.exchange, step.audio_exchange):
                if ex is not None:
                    image_only.update(im.sample_id for im in ex.encode)
            payloads = [self.store.take(s) for s in step.samples]
            batches.append((step.info.step, step, self._batch(step, payloads, images, clips)))
        for sample_id in image_only:  # pixels of other ranks' LLM samples, encoded here: done with
            self.store.held.pop(sample_id, None)
        return batches

    @staticmethod
    def _observe(fn: Callable[..., Any], *args: Any) -> None:
        try:  # metrics must never fail or stall the round loop
            fn(*args)
        except Exception:  # noqa: BLE001
            log.exception("metrics update failed")

    def _batch(
        self,
        step: Step,
        payloads: list[Any],
        images: list[Any] | None = None,
        clips: list[Any] | None = None,
        epoch: int | None = None,
    ) -> pb.Batch:
        """`batch_of` in this rank's epoch, or `epoch` (one attribute, so a benchmark can wrap it per
        instance)."""
        return batch_of(self.spec, self.epoch if epoch is None else epoch, step, payloads, images, clips)
