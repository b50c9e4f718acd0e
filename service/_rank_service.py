"""The per-rank batching service: buffer + grouping + alignment rounds + collation + trainer stream.

One process per trainer rank. A loop thread runs the core's round protocol against the coordinator:

    fill the window from the source -> wait for a free output slot -> report -> Align -> apply
    -> Commit -> finalize -> collate the steps -> journal -> expose them to the trainer

and a gRPC server serves `Batches` (the trainer client's bidi stream: credits and acks in, collated
batches out), `Ingest` (producers push samples), `Fetch` (payloads a balanced plan moved to another
rank) and `RankStatus`.

Output flow control: at most `depth` collated batches wait for the trainer (D of the ODB paper); the
capacity the rank reports is `depth - ready`, so the round never makes more steps than fit.
Deterministic mode (`JobSpec.deterministic`): the rank reports only a full window (or its source's end),
waiting for the source as long as it takes, and a fixed capacity max(1, depth // 2) once that many slots
are free (`batchd.core.fill_may_stop`, `report_capacity`): no report depends on timing, so with an
ordered source (a `RaySource` emits in view order) the same data, seed and config make the same batches.
A batch stays held until the trainer acknowledges it (it asks for the next step), so a restarted trainer
gets it again; end of epoch is sent only after every step is acknowledged.

Payloads: a dict of numpy arrays, or a reference to one (a `RaySource` yields Ray ObjectRefs; the bytes
stay in the Ray object store). References are resolved at collate time, one `ray.get` per step
(`resolve_many`), when a peer `Fetch`es a lent sample, and when a restart re-materializes payloads.

Restart: with `state_dir`, after every round the service writes a metadata-only journal (the rank
state, the source position, the steps the trainer has not acknowledged). A restarted service reloads
it, re-materializes payloads by id (`SyntheticSource`, `RaySource`; see `_sources`), re-registers and resends its
report: the coordinator replays rounds that were already decided, so nothing is lost or duplicated.

Failure: the coordinator's failure (it names the rank) is passed to the trainer as ABORTED. A trainer
that disconnects mid-epoch and does not come back within `client_grace_s` (30 s) fails the job, naming
this rank; so does a trainer that never connects, or does not come back for the next epoch, while the
rank's batches wait for it for `trainer_timeout_s` (30 min: model loading and evaluation take long).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from batchd.core import (
    ATTACHED,
    SEND_END,
    WAIT,
    Connect,
    CoordinatorError,
    Delivery,
    JobSpec,
    RankState,
    RoundDecision,
    Sample,
    Step,
    collate_images,
    collate_packed,
    collate_padded,
    exchange_arrays,
    fill_may_stop,
    idle_batch,
    image_of,
    llm_grids,
    report_capacity,
    strip_vision,
)
from batchd.proto import (
    CHANNEL_OPTIONS,
    Security,
    Unreachable,
    channel,
    retry_while_unreachable,
    wire,
)
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc

from ._coord_client import CoordinatorClient
from ._metrics import RankMetrics, materialized_tokens
from .preprocess import (
    EXHAUSTED,
    Payload,
    RayLost,
    Source,
    TooManyBadRecords,
    loss_tokens_of,
    missing_source_members,
    resolve_many,
)

log = logging.getLogger("batchd.rank")
FETCH_CHUNK = 64  # sample ids per Fetch request

JOURNAL = "rank-{rank}.json"
# The rank journal (one JSON object, rewritten whole after every round, and after every fill, before the
# round's report): its version and keys. `filled`: the buffer is the one this
# rank reports (or reported) for its current round; a restored rank reports it again without filling, so
# a round the coordinator decided before a crash is replayed on exactly the buffer it was decided on (a
# source whose readiness depends on timing, like a RaySource, would fill it differently).
JOURNAL_VERSION = 3
J_VERSION, J_DELIVERY, J_RANK, J_SOURCE, J_READY, J_REJECTED_BEFORE, J_FINISH_ACKED, J_FILLED = (
    "version",
    "delivery",
    "rank",
    "source",
    "ready",
    "rejected_before",
    "finish_acked",
    "filled",
)
JOURNAL_KEYS = {
    J_VERSION: int,
    J_DELIVERY: dict,
    J_RANK: dict,
    J_SOURCE: dict,
    J_READY: list,
    J_REJECTED_BEFORE: int,
    J_FINISH_ACKED: bool,
    J_FILLED: bool,
}  # every key required, this type


def resolve_payloads(payloads: list[Any]) -> list[Payload]:
    """Payload dicts for `payloads`, fetching Ray ObjectRefs (if any) with one `ray.get`."""
    if all(isinstance(p, dict) for p in payloads):
        return payloads
    return resolve_many(payloads)


def materialize_many(source: Source, ids: list[int]) -> list[Payload]:
    """The payload dicts of `ids`, re-made by `source` (in one batch: `Source.materialize_many`)."""
    if not ids:
        return []
    return resolve_payloads(list(source.materialize_many(ids)))


def read_journal(path: str | os.PathLike) -> dict[str, Any]:
    """The rank journal at `path`, checked strictly: a JSON object of version JOURNAL_VERSION with every key
    of JOURNAL_KEYS, each of its type, and no other key.

    Raises:
        ValueError: naming the file and what is wrong (unreadable, the version found and the one this build
            reads, a missing or unknown key, a key of the wrong type); the nested states are checked by
            their owners when they are loaded.
    """
    path = Path(path)
    try:
        state = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not a readable rank journal ({exc}); remove it to start over") from None
    if not isinstance(state, dict):
        raise ValueError(
            f"{path}: not a rank journal: a JSON {type(state).__name__}, expected an object "
            f"of version {JOURNAL_VERSION}; remove it to start over"
        )
    if J_VERSION not in state:
        raise ValueError(
            f"{path}: rank journal without a {J_VERSION!r} key, this build reads version "
            f"{JOURNAL_VERSION}; remove it to start over"
        )
    version = state[J_VERSION]
    if type(version) is not int or version != JOURNAL_VERSION:
        raise ValueError(
            f"{path}: rank journal version {version!r}, this build reads version {JOURNAL_VERSION}; "
            f"remove it to start over"
        )
    missing = [k for k in JOURNAL_KEYS if k not in state]
    if missing:
        raise ValueError(
            f"{path}: rank journal version {version} lacks the required key(s) {missing}; "
            f"remove it to start over"
        )
    unknown = sorted(set(state) - set(JOURNAL_KEYS))
    if unknown:
        raise ValueError(
            f"{path}: rank journal version {version} has unknown key(s) {unknown}; remove it to start over"
        )
    for key, kind in JOURNAL_KEYS.items():
        if type(state[key]) is not kind:
            raise ValueError(
                f"{path}: rank journal version {version}: {key!r} is a {type(state[key]).__name__}, "
                f"expected a {kind.__name__}; remove it to start over"
            )
    return state


def collate(
    spec: JobSpec,
    payloads: list[Payload],
    pad_id: int = 0,
    step: Step | None = None,
    images: list[Payload] | None = None,
) -> dict[str, Any]:
    """Collates payloads into the step's arrays (padded or packed, per the job spec; numpy, no torch).

    A two-phase step (`step.exchange` set) carries its LLM samples without their pixels, the pixels of the
    images it encodes (`images`: their samples' payloads, one per `exchange.encode` entry, in order) and the
    exchange arrays (`batchd.core.exchange_arrays`)."""
    if step is not None and step.exchange is not None:
        out = collate(spec, strip_vision(payloads), pad_id)
        out.update(llm_grids(payloads))
        encode = step.exchange.encode
        if images is None or len(images) != len(encode):
            raise ValueError(
                f"step {step.info.step}: {len(encode)} images to encode, got "
                f"{None if images is None else len(images)} payloads"
            )
        out.update(collate_images([image_of(p, im.index) for p, im in zip(images, encode, strict=False)]))
        out.update(exchange_arrays(step.exchange))
        return out
    if not payloads:
        return idle_batch(pad_id)
    if spec.collate == "packed":
        return collate_packed(payloads)
    return collate_padded(payloads, pad_id=pad_id)


DETERMINISTIC_POLL_S = (
    0.5  # deterministic fill: how long one poll waits before failure and stop are looked at
)
WATCH_S = 0.5  # how often the liveness of the trainer is judged (`Delivery.check`)
BUSY_WAIT_S = 2.0  # a new trainer stream waits this long for a holder whose stream is ending


class _Stream:
    """One trainer `Batches` stream: identity per call, shown as the trainer's address."""

    __slots__ = ("peer", "context")

    def __init__(self, peer: str, context) -> None:
        self.peer, self.context = peer, context

    def __str__(self) -> str:
        return self.peer


class RankServiceCore:
    """State and loop of one rank service (see module docstring)."""

    def __init__(
        self,
        rank: int,
        spec: JobSpec,
        coordinator: CoordinatorClient,
        source: Source,
        state_dir: str | os.PathLike | None = None,
        epoch: int = 0,
        client_grace_s: float = 30.0,
        fill_timeout_s: float = 0.5,
        security: Security | None = None,
        metrics: RankMetrics | None = None,
        trainer_timeout_s: float = 1800.0,
    ) -> None:
        """Raises TypeError naming the missing members when `source` is not a `Source`, and ValueError
        naming the file and why when `state_dir` holds a journal this build cannot resume from."""
        if not trainer_timeout_s > 0 or not client_grace_s > 0:
            raise ValueError(f"timeouts must be > 0, got {trainer_timeout_s=} {client_grace_s=}")
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
        self.client_grace_s, self.fill_timeout_s = client_grace_s, fill_timeout_s
        self.trainer_timeout_s = trainer_timeout_s
        self.delivery = Delivery(
            rank, spec.epochs, spec.depth, client_grace_s, trainer_timeout_s, time.monotonic(), epoch
        )
        self.state = self._new_state(epoch)
        self._rejected_before = 0  # over-budget rejections of the epochs before this one (metrics)
        self.payloads: dict[int, Payload] = {}
        self.lent: dict[int, Payload] = {}
        self.lent_takers: dict[int, int] = {}  # lent sample -> ranks still to take it (LLM owner, encoders)
        self._lend_lock = threading.Lock()
        self.batches: dict[int, tuple[Step, pb.Batch]] = {}  # ready steps (Delivery.ready) by number
        self.finished = False  # the coordinator knows this rank's trainer took the job's last step
        self._filled = False  # the restored buffer is the current round's report (`JOURNAL`)
        self.waiting_for_trainer = False  # the loop waits for the trainer to take batches (no room for more)
        self.samples_made = (
            0  # samples of every rank in this epoch's steps so far (the node agent's progress)
        )
        self.restored_finished = False  # restored from a journal written after the job's last end
        self.failure: str | None = None
        self.failure_told = False  # the trainer heard the failure (ABORTED, or a RankStatus that said it)
        self.address = ""
        self.peers: list[str] = []
        self.local_peers: dict[int, RankServiceCore] = {}  # the other ranks of this node agent, in process
        self.fetched = {"local": 0, "remote": 0}  # moved-in samples taken in process / fetched over gRPC
        self._peer_stubs: dict[str, pb_grpc.RankServiceStub] = {}  # one channel per peer address, for the job
        self._peer_channels: list[grpc.Channel] = []
        self.cond = threading.Condition()
        self.journal = Path(state_dir) / JOURNAL.format(rank=rank) if state_dir else None
        if self.journal is not None:  # fail here, at startup, rather than mid-round at the first journal
            self.journal.parent.mkdir(parents=True, exist_ok=True)
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()
        if self.journal is not None and self.journal.exists():
            self._restore()
        if metrics is not None:  # read at scrape time, lock-free: len() of a list / dict
            metrics.bind(lambda: len(self.state.buffer), lambda: len(self.batches), lambda: self.epoch)

    def _new_state(self, epoch: int) -> RankState:
        return RankState(self.spec, self.rank, epoch)

    @property
    def epoch(self) -> int:
        return self.delivery.epoch

    @property
    def done(self) -> bool:
        """This epoch has no further step."""
        return self.delivery.done

    # -- journal -------------------------------------------------------------------------------------
    def _write_journal(self, filled: bool = False) -> None:
        if self.journal is None:
            return
        state = {
            J_VERSION: JOURNAL_VERSION,
            J_DELIVERY: self.delivery.state_dict(),
            J_RANK: self.state.state_dict(),
            J_SOURCE: self.source.state_dict(),
            J_READY: [self.batches[i][0].to_json() for i in self.delivery.ready],
            J_REJECTED_BEFORE: self._rejected_before,
            J_FINISH_ACKED: self.finished,
            J_FILLED: filled,
        }
        tmp = self.journal.with_suffix(".tmp")
        with open(tmp, "w") as fh:
            fh.write(json.dumps(state))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.journal)

    def _restore(self) -> None:
        state = read_journal(self.journal)
        try:
            self.delivery.load_state_dict(state[J_DELIVERY], time.monotonic())
            if self.epoch != 0:
                self.state = self._new_state(self.epoch)
                self.source.start_epoch(self.epoch)
            self._rejected_before = state[J_REJECTED_BEFORE]
            self.state.load_state_dict(state[J_RANK])
            self.source.load_state_dict(state[J_SOURCE])
        except (ValueError, KeyError) as exc:  # a state of another job, rank or configuration
            raise ValueError(
                f"{self.journal}: cannot resume rank {self.rank} from this journal: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        ids = [entry.sample.id for entry in self.state.buffer]
        steps = [Step.from_json(step_json) for step_json in state[J_READY]]
        wanted = list(
            dict.fromkeys(
                [
                    *ids,
                    *(s.id for st in steps for s in st.samples),
                    *(im.sample_id for st in steps if st.exchange is not None for im in st.exchange.encode),
                ]
            )
        )
        made = dict(
            zip(wanted, materialize_many(self.source, wanted), strict=False)
        )  # one call: each block read once
        self.payloads.update((i, made[i]) for i in ids)
        for step in steps:
            payloads = [made[s.id] for s in step.samples]
            images = None
            if step.exchange is not None:
                images = [made[im.sample_id] for im in step.exchange.encode]
            self.batches[step.info.step] = (step, self._batch(step, payloads, images))
        self.restored_finished = self.delivery.finished
        self.finished = state[J_FINISH_ACKED]  # the coordinator knew: it may be gone by now
        self._filled = state[J_FILLED]  # report the journaled buffer as it is (see JOURNAL)
        log.info(
            "rank %d restored from %s at epoch %d round %d (step %d)%s",
            self.rank,
            self.journal,
            self.epoch,
            self.state.round,
            self.state.step,
            "; its trainer took the job's last step" if self.restored_finished else "",
        )

    # -- loop ----------------------------------------------------------------------------------------
    def start(self, my_address: str) -> None:
        self.address = my_address
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
        for ch in self._peer_channels:
            ch.close()
        self._peer_channels.clear()

    def join(self, timeout: float | None = None) -> None:
        if self._thread:
            self._thread.join(timeout)

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
        """Judges the trainer's liveness (`Delivery.check`): a gone trainer fails the job, naming this rank."""
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
            log.info(
                "rank %d: the job's last step was taken before this restart; serving only its end", self.rank
            )
            return
        try:
            reply = self.coord.register(self.address)
            self.peers = list(reply.rank_addresses)
            self.coord.start_heartbeats(self.set_failure)
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
                self._next_epoch()
        except CoordinatorError as exc:
            if (
                self._stop.is_set() and self.failure is None
            ):  # this service is stopping (a restart may follow):
                log.debug("rank %d loop ended by stop(): %s", self.rank, exc)  # not a failure of the job
                return
            if (
                exc.code != grpc.StatusCode.ABORTED and not self._stop.is_set()
            ):  # not the job's failure: tell it
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
            self._rejected_before += self.state.counters["rejected"]
            self.delivery.advance(time.monotonic())
            self.state = self._new_state(self.epoch)
            self.source.start_epoch(self.epoch)
            self.samples_made = 0
            self.payloads.clear()
            self.batches.clear()
            self._write_journal()
            self.cond.notify_all()
        log.info("rank %d: epoch %d of %d starts", self.rank, self.epoch, self.spec.epochs)

    def _fill(self) -> None:
        """Tops the buffer up from the source (`fill_may_stop`): by default with what it has ready by a short
        deadline; in deterministic mode until the window is full or the source exhausted, waiting for it as
        long as it takes (a failure or a stop ends the wait)."""
        deterministic = self.spec.deterministic
        deadline = time.monotonic() + self.fill_timeout_s
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
            if self.spec.over_budget == "truncate" and sample.length > self.state.truncate_length:
                # Cut the token sequences only. Other arrays (pixel_values, image_grid_thw) are kept whole:
                # an image whose tokens are cut would need the pipeline's spans to drop consistently, which
                # is why `batchd rank --dataset` preprocesses with cutoff <= truncate_length (the Truncate
                # stage drops whole images) and never reaches this branch.
                n = self.state.truncate_length
                payload = dict(resolve_payloads([payload])[0])
                for k in ("input_ids", "labels"):
                    if k in payload:
                        payload[k] = payload[k][:n]
                cut = loss_tokens_of(payload["labels"]) if "labels" in payload else n - 1
            if self.state.push(sample, cut) == "rejected":
                continue
            self.payloads[sample.id] = payload

    def _round(self) -> None:
        if self._filled:  # restored with the buffer of this round's report: no fill
            self._filled = False
        else:  # journaled before it is reported, even unchanged: a restored rank must not fill it again
            self._fill()
            with self.cond:
                self._write_journal(filled=True)
        metrics = self.metrics
        if metrics is not None:
            self._observe(
                metrics.observe_quarantine,
                self.source.reasons,
                self._rejected_before + self.state.counters["rejected"],
            )
        t_wait = time.perf_counter()
        with self.cond:  # a slow trainer is waited for as long as it takes; a gone one fails in `_watch`
            while (
                (
                    capacity := report_capacity(
                        self.delivery.capacity, self.spec.depth, self.spec.deterministic
                    )
                )
                is None
                and self.failure is None
                and not self._stop.is_set()
            ):
                self.waiting_for_trainer = True  # (tests: the journal is stable while this holds)
                self.cond.wait(0.5)
            self.waiting_for_trainer = False
            if self.failure is not None or self._stop.is_set():
                raise CoordinatorError(self.failure or "stopped")
        t_report = time.perf_counter()
        report = self.state.report(capacity)
        decision = self.coord.align(self.epoch, report)
        commit = self.state.apply(decision)
        self._lend(decision)  # before the commit: peers fetch only once every rank committed
        totals = self.coord.commit(self.epoch, commit)
        t_totals = time.perf_counter()
        steps = self.state.finalize(totals)
        self.samples_made += sum(st.info.global_samples for st in steps)
        self._fetch_moved(steps)
        batches = []
        image_only: set[int] = set()
        for step in steps:
            images = None
            if step.exchange is not None:  # before the LLM payloads are taken: a sample may be in both
                images = [self._image_payload(im.sample_id, im.home_rank) for im in step.exchange.encode]
                image_only.update(im.sample_id for im in step.exchange.encode)
            payloads = [self._take_payload(s) for s in step.samples]
            batches.append((step.info.step, step, self._batch(step, payloads, images)))
        for sample_id in image_only:  # pixels of other ranks' LLM samples, encoded here: done with
            self.payloads.pop(sample_id, None)
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
                self.batches[i] = (step, b)
            self.delivery.add([i for i, _, _ in batches])
            if totals.done:
                self.delivery.close()
            self._write_journal()
            self.cond.notify_all()

    @staticmethod
    def _observe(fn, *args) -> None:
        try:  # metrics must never fail or stall the round loop
            fn(*args)
        except Exception:  # noqa: BLE001
            log.exception("metrics update failed")

    def _take_payload(self, s: Sample) -> Payload:
        payload = self.payloads.pop(s.id, None)
        if payload is not None:
            return payload
        if s.home_rank != self.rank:  # a moved sample that _fetch_moved did not prefetch
            return self._fetch_ids(s.home_rank, [s.id])[0]
        return self.source.materialize(s.id)

    def _lend(self, decision: RoundDecision) -> None:
        """Sets aside the payloads of this rank's samples that other ranks will take this round: the LLM
        owner a balanced plan placed them on, and (two-phase) every rank encoding one of their images.
        A payload this rank also uses itself (its own LLM group, images it encodes) stays in `payloads`
        too: the same reference, no copy."""
        if decision.plan is None:
            return
        me = self.rank
        takers: dict[int, set[int]] = {}
        mine: set[int] = {s.id for group in decision.plan[me] for s in group}
        for rank, plan_steps in enumerate(decision.plan):
            if rank != me:
                for group in plan_steps:
                    for s in group:
                        if s.home_rank == me:
                            takers.setdefault(s.id, set()).add(rank)
        for rank, exchanges in enumerate(decision.vision or ()):
            for ex in exchanges:
                for im in ex.encode:
                    if im.home_rank == me:
                        if rank == me:
                            mine.add(im.sample_id)
                        else:
                            takers.setdefault(im.sample_id, set()).add(rank)
        with self._lend_lock:
            for sample_id, ranks in takers.items():
                payload = (
                    self.payloads.get(sample_id) if sample_id in mine else self.payloads.pop(sample_id, None)
                )
                if payload is not None:
                    self.lent[sample_id] = payload
                    self.lent_takers[sample_id] = len(ranks)

    def take_lent(self, sample_id: int) -> Payload | None:
        """The payload of a sample of this rank that the plan placed elsewhere, handed to each rank that
        takes it (None when it is not held, e.g. after a restart: the caller re-makes it from the source)."""
        with self._lend_lock:
            payload = self.lent.get(sample_id)
            if payload is not None:
                left = self.lent_takers.pop(sample_id, 1) - 1
                if left > 0:
                    self.lent_takers[sample_id] = left
                else:
                    del self.lent[sample_id]
            return payload

    def untake_lent(self, sample_id: int, payload: Payload) -> None:
        """Undoes one `take_lent` (a Fetch reply that had no room for it: the peer asks again)."""
        with self._lend_lock:
            if sample_id in self.lent:
                self.lent_takers[sample_id] = self.lent_takers.get(sample_id, 1) + 1
            else:
                self.lent[sample_id], self.lent_takers[sample_id] = payload, 1

    def _image_payload(self, sample_id: int, home: int) -> Payload:
        """The payload of a sample whose image this rank encodes: held here (its LLM sample, or a sample of
        this rank), fetched by `_fetch_moved`, or fetched now."""
        payload = self.payloads.get(sample_id)
        if payload is not None:
            return payload
        if home != self.rank:
            payload = self._fetch_ids(home, [sample_id])[0]
        else:
            payload = self.source.materialize(sample_id)
        self.payloads[sample_id] = payload
        return payload

    def _take_local(self, home: RankServiceCore, ids: list[int]) -> list[Payload]:
        """Moved samples of a rank of this node agent: references handed over in process, no copy."""
        out = []
        for i in ids:
            payload = home.take_lent(i)
            out.append(payload if payload is not None else home.source.materialize(i))
        self.fetched["local"] += len(ids)
        return out

    def _peer(self, rank: int) -> pb_grpc.RankServiceStub:
        if len(self.peers) != self.spec.world_size or not all(self.peers):
            # The coordinator sends the addresses only once every rank registered, so the first ranks
            # to register have none; a plan that moves samples comes after every rank reported.
            self.peers = list(self.coord.register(self.address).rank_addresses)
            if len(self.peers) != self.spec.world_size or not all(self.peers):
                raise CoordinatorError(
                    f"rank {self.rank}: the coordinator does not know every rank's address"
                )
        address = self.peers[rank]
        stub = self._peer_stubs.get(address)
        if stub is None:
            ch = channel(address, self.security, CHANNEL_OPTIONS)
            self._peer_channels.append(ch)
            stub = self._peer_stubs[address] = pb_grpc.RankServiceStub(ch)
        return stub

    def _fetch_ids(self, home: int, ids: list[int]) -> list[Payload]:
        """The payloads of `ids` from rank `home`. A peer that is unreachable (restarting from its journal)
        is retried, with its address asked anew of the coordinator, for up to the coordinator's lease;
        one that stays away fails the job, naming it. A rank of this node agent hands them over in process."""
        if home in self.local_peers:
            return self._take_local(self.local_peers[home], ids)
        out: list[Payload] = []
        while len(out) < len(ids):  # a reply may hold a prefix (size cap): ask for the rest
            request = pb.FetchRequest(ids=ids[len(out) :], epoch=self.epoch, rank=home)
            try:
                reply = retry_while_unreachable(
                    lambda: self._peer(home).Fetch(request, timeout=60),
                    self.coord.lease_s,
                    f"rank {home} (rank {self.rank} fetching moved samples)",
                    stop=self._stop,
                    on_retry=self._refresh_peers,
                    logger=log,
                )
            except Unreachable as gone:
                raise CoordinatorError(
                    f"rank {home} at {self.peers[home]} unreachable for {gone.elapsed_s:.0f}s "
                    f"(rank {self.rank} fetching moved samples): {gone.error.details()}"
                ) from None
            except grpc.RpcError as exc:
                raise CoordinatorError(
                    f"rank {self.rank} could not fetch moved samples from rank {home} at "
                    f"{self.peers[home]}: {exc.code().name}: {exc.details()}"
                ) from None
            if not reply.samples:
                raise RuntimeError(f"rank {home} returned no payload for samples {ids[len(out) :]}")
            out += [wire.tensors_from_pb(m.tensors) for m in reply.samples]
        self.fetched["remote"] += len(out)
        return out

    def _refresh_peers(self) -> None:
        """Asks the coordinator for the ranks' addresses again (a restarted peer may listen elsewhere)."""
        peers = list(self.coord.register(self.address).rank_addresses)
        if peers and peers != self.peers:
            for old, new in zip(self.peers, peers, strict=False):
                if old != new:
                    self._peer_stubs.pop(old, None)
            self.peers = peers

    def _fetch_moved(self, steps) -> None:
        """Fetches the payloads of the samples the balanced plan moved here: one Fetch per home rank
        and round over one long-lived channel per peer (FETCH_CHUNK ids per request; a reply stops at
        `_rank_server.FETCH_REPLY_BYTES`, far below the message cap, and the rest is asked for again)."""
        wanted: dict[int, list[int]] = {}
        seen: set[int] = set()
        for step in steps:
            refs = [(s.id, s.home_rank) for s in step.samples]
            if step.exchange is not None:  # two-phase: the samples of the images this rank encodes
                refs += [(im.sample_id, im.home_rank) for im in step.exchange.encode]
            for sample_id, home in refs:
                if home != self.rank and sample_id not in self.payloads and sample_id not in seen:
                    seen.add(sample_id)
                    wanted.setdefault(home, []).append(sample_id)
        for home, ids in wanted.items():
            for k in range(0, len(ids), FETCH_CHUNK):
                chunk = ids[k : k + FETCH_CHUNK]
                self.payloads.update(zip(chunk, self._fetch_ids(home, chunk), strict=True))

    def _batch(self, step: Step, payloads: list[Any], images: list[Any] | None = None) -> pb.Batch:
        tensors = collate(
            self.spec,
            resolve_payloads(payloads),
            step=step,
            images=resolve_payloads(images) if images else images,
        )
        return pb.Batch(
            info=wire.info_to_pb(step.info, self.epoch),
            tensors=wire.tensors_to_pb(tensors),
            sample_ids=[s.id for s in step.samples],
        )

    # -- trainer side --------------------------------------------------------------------------------
    def _prune_locked(self) -> None:
        for i in [i for i in self.batches if i < self.delivery.acked]:
            del self.batches[i]

    def detach(self, stream: _Stream) -> None:
        with self.cond:
            self.delivery.disconnect(stream, time.monotonic())
            self.cond.notify_all()

    def ack(self, stream: _Stream, step: int) -> None:
        with self.cond:
            self.delivery.ack(stream, step)
            self._prune_locked()
            self.cond.notify_all()

    def connect(
        self, stream: _Stream, epoch: int, start_step: int, credits: int, member: int = 0, group_size: int = 1
    ) -> Connect:
        """Attaches a trainer stream, member `member` of a group of `group_size` (see `Delivery.connect`):
        waits while the next epoch is about to start or a previous stream of this member is ending; returns
        the final outcome."""
        busy_until = time.monotonic() + BUSY_WAIT_S
        with self.cond:
            while True:
                if self.failure is not None:
                    raise RuntimeError(self.failure)
                holder = self.delivery.holder_of(member)
                now = time.monotonic()
                if holder is not None and holder is not stream:
                    if not holder.context.is_active():  # its end is not processed yet
                        self.delivery.disconnect(holder, now)
                    elif now < busy_until and stream.context.is_active():
                        self.cond.wait(0.1)
                        continue
                outcome = self.delivery.connect(stream, epoch, start_step, credits, now, member, group_size)
                if outcome.outcome != WAIT or not stream.context.is_active() or self._stop.is_set():
                    if outcome.outcome == ATTACHED:
                        self._prune_locked()
                    self.cond.notify_all()
                    return outcome
                self.cond.wait(0.5)

    def next_item(self, stream: _Stream) -> tuple[int, pb.Batch] | None:
        """Waits for what to send `stream` next: (step, batch), or None for the end of the epoch (journaled
        as sent before it is written). Raises RuntimeError with the job failure; ConnectionAbortedError when
        the stream ended."""
        with self.cond:
            while True:
                if self.failure is not None:
                    raise RuntimeError(self.failure)
                if not stream.context.is_active() or self._stop.is_set() or not self.delivery.holds(stream):
                    raise ConnectionAbortedError
                nxt = self.delivery.next_for(stream)
                if nxt == SEND_END:
                    self.delivery.mark_end_sent(stream)
                    self._write_journal()
                    self.cond.notify_all()
                    return None
                if nxt is not None:
                    return nxt, self.batches[nxt][1]
                self.cond.wait(0.5)

    def sent(self, stream: _Stream, step: int) -> None:
        with self.cond:
            self.delivery.sent(stream, step)
