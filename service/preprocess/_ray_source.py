"""`RaySource`: rank r's stream of preprocessed samples, from its sampler view through a `PreprocessPool`.

    RecordDataset (metadata) --> BlockReader (rank r's blocks, read ahead within memory_budget / 2)
        | raw records of a few ids, epoch, seed      PreprocessPool: N actors, each with the chain
        v                                            |  per task: [metadata list, payload_1, ..., payload_k]
    RaySource(rank r): its BlockView of the epoch,   v  (one object per sample; payloads stay in the store)
        at most `max_in_flight` samples outstanding,
        poll() -> (Sample, ObjectRef to the payload dict) | None | EXHAUSTED, quarantine for bad records

Reading: the rank reads only its own view, block by block (`BlockView`: its share of the epoch's shuffled
blocks, in windows of at most memory_budget / 4 bytes of blocks whose rows are shuffled together). The
reader holds the window being dispatched and reads the next one ahead: at most memory_budget / 2 bytes of
records (the rest of the budget is the process's own and its batches'). A block alone larger than a
window fails at start, naming file and block.

Bad records: each one is quarantined with its reason. Once more than `max_bad_fraction` of the records
read are bad, `poll` raises `TooManyBadRecords`, which fails the job with the counts by reason and the
quarantine file. The share is that of every source sharing its `bad_tally` (a node agent's ranks: one
rank's share of a small file's bad records can be well above the file's). While views are read it counts
at least `MIN_JUDGED` records, so a few bad ones early are not yet a share; once every view of the tally
ended it is judged on the records read, however few, so the rule holds for a dataset of any size.

Order: each pulled sample gets the next sequence number in a `Ledger` (`_ledger`), which tracks it from
in flight to ready to done and says which one leaves next (view order, or completion order); the source
itself holds what talks to Ray: the tasks in flight, their reruns, and the reader.

Only metadata (id, realized length, loss tokens, per-modality counts, payload bytes) reaches the
caller's process eagerly; `resolve(payload)` fetches the payload dict at collate time (a balanced plan
that moves a sample to another rank moves the reference, not the bytes).

A Ray that went away (`ray_lost`: its GCS or raylet unreachable) is no actor death: the call that
saw it raises `RayLost`, which fails the job naming the Ray.

Fault model, the source's part: RaySource resubmits the tasks that died with an actor (the pool has
Ray restart it). Preprocessing is a pure function of (record, seed, epoch, sample id), so the rerun
gives the identical sample: nothing is lost or duplicated. A sample whose actor died while it was
certainly executing is charged an attempt, and quarantined (`worker_crashed`) after `max_attempts`.
`state_dict` / `load_state_dict` resume a view exactly: what was emitted or quarantined is skipped,
what was in flight is requested again.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import ray
else:
    from ._lazy_ray import ray  # imported on first use

from batchd.core import BlockLayout, BlockView, Remainder, Sample

from ._dataset import RecordDataset
from ._ledger import Ledger
from ._pool import PreprocessPool
from ._quarantine import BadRecordTally, Quarantine, TooManyBadRecords
from ._ray import ray_lost
from ._ray_options import PoolOptions, StreamOptions
from ._reader import BlockReader
from ._sources import EXHAUSTED

log = logging.getLogger("batchd.preprocess")

STATE_VERSION = 2
MIN_JUDGED = 100


@dataclasses.dataclass(slots=True)
class _Task:
    seqs: list[int]
    actor: int
    payloads: list[ray.ObjectRef[Any]]
    probe: ray.ObjectRef[Any] | None  # set when the task ran alone on its actor (`PreprocessPool.submit`)


class RaySource:
    """Rank `rank`'s stream of preprocessed samples for one epoch (the rank service's source interface).

    `poll(timeout)` returns `(Sample, payload)`, `None` (nothing ready yet) or `EXHAUSTED`; the payload is
    an ObjectRef to the payload dict (`payload="dict"` fetches it instead); `resolve(payload)` gives the
    dict. Quarantined records never come out of `poll`: they are counted (`quarantined`, `reasons`) and
    written to the quarantine file. At the end of the view, `emitted + quarantined == len(self)`.

    Args:
        dataset: A RecordDataset or paths (None when `pool` is a shared pool: the pool's dataset).
        rank, world_size, seed, epoch, shuffle: The view (`batchd.core.BlockView`; its wrap: `options`).
        pool: A shared `PreprocessPool` (not closed by `close()`), or how to build its own
            (`PoolOptions`; None = `PoolOptions()`).
        options: How it streams (`StreamOptions`; None = `StreamOptions()`): backpressure, order, wrap,
            quarantine, attempts, payload, memory budget, bad-record share.
    """

    def __init__(
        self,
        dataset: RecordDataset | str | os.PathLike[str] | Sequence[Any] | None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        *,
        pool: PreprocessPool | PoolOptions | None = None,
        options: StreamOptions | None = None,
    ) -> None:
        options = StreamOptions() if options is None else options
        if not isinstance(options, StreamOptions):
            raise ValueError(f"options must be a StreamOptions, got {options=}")
        self.memory_budget = options.budget_bytes
        self.longest: int | None = None  # `Source.longest`: set by whoever chose the stages' cutoff
        self.max_bad_fraction = float(options.max_bad_fraction)
        self.bad_tally = options.bad_tally or BadRecordTally()
        self.bad_tally.join(rank)
        own_pool, self._own_pool = _open_pool(dataset, pool, self.memory_budget)
        self.pool = own_pool
        self.dataset = own_pool.dataset
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, epoch
        self.wrap, self.ordered = options.wrap, options.ordered
        self.chunk_size, self.max_attempts = options.chunk_size, options.max_attempts
        self.max_in_flight = options.max_in_flight or 4 * own_pool.num_actors * options.chunk_size
        self.fetch_payloads = options.payload == "dict"
        quarantine = options.quarantine
        self.quarantine = quarantine if isinstance(quarantine, Quarantine) else Quarantine(quarantine)
        layout = BlockLayout(self.dataset.block_rows, self.dataset.block_bytes, self.memory_budget // 4)
        self.view = BlockView(layout, rank, world_size, seed, epoch, shuffle, self.wrap)
        self.reader = BlockReader(self.dataset, self.memory_budget // 2)
        self._want_window = -1
        self._lock = threading.RLock()
        self._reset(0, set())
        self.emitted = 0
        self.reasons: collections.Counter[str] = collections.Counter()
        self.retries = 0
        self.wait_s = 0.0
        self._t_first: float | None = None
        self._t_last: float | None = None

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _reset(self, low: int, skip: set[int]) -> None:
        self._ledger = Ledger(low, skip, self.ordered)  # the pulled samples, from seq `low` on
        self._tasks: dict[ray.ObjectRef[Any], _Task] = {}
        self._suspects: collections.deque[int] = collections.deque()  # to rerun alone on an idle actor
        self._unsent: list[list[int]] = []  # pulled, not yet accepted by the pool
        self._hold(False)

    def __len__(self) -> int:
        return len(self.view)

    @property
    def quarantined(self) -> int:
        """Records of this source's views quarantined so far (all epochs)."""
        return sum(self.reasons.values())

    @property
    def records_read(self) -> int:
        return self.emitted + self.quarantined

    @property
    def in_flight(self) -> int:
        """Samples requested and not yet returned by poll (nor quarantined)."""
        return self._ledger.open

    def _pull(self) -> int | None:
        """Pulls the next id of the view as a new entry; returns its seq (None: exhausted or skipped)."""
        i = self.view.next()
        if i is None:
            return None
        return self._ledger.add(i)

    def _submit(self, seqs: list[int], mode: str = "normal") -> bool:
        if mode == "normal" and self.pool._holds > 0:  # refused anyway: do not read for nothing
            return False
        items = self.reader.items([self._ledger.entries[s].id for s in seqs])
        sent = self.pool.submit(items, self.epoch, self.seed, mode)
        if sent is None:
            return False
        actor, refs, probe = sent
        self._tasks[refs[0]] = _Task(seqs, actor, refs[1:], probe)
        return True

    def _hold(self, on: bool) -> None:
        if on != getattr(self, "_holding", False):
            self._holding = on
            self.pool.hold(on)

    def _read_ahead(self) -> None:
        """Tells the reader the blocks of the window the view reads from next and of the one after."""
        if self.view.exhausted():
            return
        n = len(self.view)
        w = self.view.window_of(self.view.position) if self.view.position < n else 0
        if w != self._want_window:
            self._want_window = w
            nxt = w + 1 if w + 1 < len(self.view.windows) else (0 if self.wrap else -1)
            self.reader.want(self.view.window_blocks(w) + self.view.window_blocks(nxt))

    def _top_up(self) -> None:
        self._read_ahead()
        # Samples whose actor died are rerun one at a time on an idle actor, so a crash is charged only
        # to the sample that was executing (see _finish); new work waits until they are all sent.
        while self._suspects and self._submit([self._suspects[0]], "isolated"):
            self._suspects.popleft()
        self._hold(bool(self._suspects))
        if not self._suspects:
            while self._unsent and self._submit(self._unsent[0]):
                self._unsent.pop(0)
            # Whole chunks only while work is in flight: topping up one freed slot at a time would
            # degrade to one-sample tasks and pay Ray's per-task cost on every sample.
            while not self._unsent and not self.view.exhausted():
                room = self.max_in_flight - self._ledger.open
                left = len(self.view) - self.view.position if not self.wrap else self.chunk_size
                if room <= 0 or (room < min(self.chunk_size, left) and self._tasks):
                    break
                batch: list[int] = []
                while len(batch) < min(room, self.chunk_size) and not self.view.exhausted():
                    if not batch:  # the windows of the chunk's first sample and the next stay held until
                        self._read_ahead()  # `_submit` reads its records (a chunk may straddle two windows)
                    seq = self._pull()
                    if seq is not None:
                        batch.append(seq)
                if batch and not self._submit(batch):
                    self._unsent.append(batch)
        self._ledger.advance()

    def _quarantine(self, seq: int, reason: str) -> None:
        e = self._ledger.entries[seq]
        e.payload = e.sample = None
        self._ledger.resolve(seq)
        self.reasons[Quarantine.code_of(reason)] += 1
        self.quarantine.add(e.id, self.dataset.source(e.id), reason, self.epoch)
        self._judge(final=False)

    def _judge(self, final: bool) -> None:
        """Raises TooManyBadRecords once the bad records pass `max_bad_fraction` of those read by every
        source of `bad_tally`. While a view is being read the share counts at least `MIN_JUDGED` records (a
        few bad records early are not yet a share); once every view is finished (this one: `final`) it is
        judged on what was read, however few, so the rule holds for every dataset size."""
        read = self.records_read + self._ledger.ready_count()
        reasons, read, final, ranks = self.bad_tally.totals(self.rank, self.reasons, read, final)
        bad, path = sum(reasons.values()), self.quarantine.path
        if self.max_bad_fraction >= 1.0 or not bad:
            return
        if bad <= self.max_bad_fraction * (read if final else max(read, MIN_JUDGED)):
            return
        raise TooManyBadRecords(
            ranks, bad, read, self.max_bad_fraction, reasons, None if path is None else str(path)
        )

    def _collect(self, wait: float) -> None:
        refs = list(self._tasks)
        if not refs:
            # Nothing of ours in flight (suspects wait for an idle actor, or the pool is held by another
            # source): loads drop as other tasks end, so look again shortly instead of spinning.
            if wait > 0:
                time.sleep(min(wait, 0.005))
            return
        t0 = time.perf_counter()
        done, _ = ray.wait(refs, num_returns=1, timeout=wait)
        if wait > 0:
            self.wait_s += time.perf_counter() - t0
        if not done:
            return
        if len(refs) > 1:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in done:
            self._finish(ref)

    def _finish(self, ref: ray.ObjectRef[Any]) -> None:
        task = self._tasks.pop(ref)
        try:
            metas = ray.get(ref)
        except ray.exceptions.RayError as exc:
            lost = ray_lost()  # the whole Ray went away, not one actor: no rerun can succeed
            if lost is not None:
                raise lost from None
            # The actor died (or the task failed) before this task ended. Only a task that ran alone with
            # nothing queued ahead of it, on an actor that answered the probe just before it, was certainly
            # executing: only then is the crash charged to its sample. The others were collateral (or
            # were sent to an actor that was already dead) and are rerun (alone) at no charge.
            self.retries += len(task.seqs)
            charged = self.pool.probe_ok(task.probe)
            for seq in task.seqs:
                e = self._ledger.entries[seq]
                if charged:
                    e.attempts += 1
                    if e.attempts >= self.max_attempts:
                        log.warning(
                            "sample %d: its actor died %d times while processing it; quarantined",
                            e.id,
                            e.attempts,
                        )
                        self._quarantine(
                            seq,
                            f"worker_crashed: the actor died {e.attempts} times while "
                            f"processing this sample ({type(exc).__name__})",
                        )
                        continue
                self._suspects.append(seq)
            return
        for seq, meta, pref in zip(task.seqs, metas, task.payloads, strict=False):
            length, loss, text, vision, reason, nbytes, images, audio = meta
            if reason is not None:
                self._quarantine(seq, reason)
                continue
            e = self._ledger.entries[seq]
            heard = sum(t for _, t in audio)
            mods = (("text", text), ("vision", vision)) + ((("audio", heard),) if heard else ())
            sample = Sample(e.id, length, loss, self.rank, mods, nbytes, images, audio)
            self._ledger.mark_ready(seq, sample, pref)

    def _pop_ready(self) -> tuple[Sample, Any] | None:
        seq = self._ledger.next_ready()
        if seq is None:
            return None
        e = self._ledger.entries[seq]
        assert e.sample is not None  # READY: `mark_ready` set it
        item = (e.sample, ray.get(e.payload) if self.fetch_payloads else e.payload)
        e.sample = e.payload = None
        self._ledger.resolve(seq)
        self.emitted += 1
        self._ledger.advance()
        self.bad_tally.note(self.rank, self.reasons, self.records_read)  # for the others' judgement
        return item

    def _finished(self) -> bool:
        return self._ledger.open == 0 and self.view.exhausted()

    # -- the source interface ------------------------------------------------------------------------
    def poll(self, timeout: float = 0.0) -> tuple[Sample, Any] | object | None:
        """The next `(Sample, payload)`, None if none is ready within `timeout` s, or EXHAUSTED."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._lock:
            if self._t_first is None:
                self._t_first = time.perf_counter()
            collected = False
            while True:
                self._top_up()
                item = self._pop_ready()
                if item is not None:
                    self._t_last = time.perf_counter()
                    return item
                if self._finished():
                    self._t_last = self._t_last or time.perf_counter()
                    self._judge(final=True)
                    return EXHAUSTED
                remaining = deadline - time.monotonic()
                if collected and remaining <= 0:
                    return None
                self._collect(max(remaining, 0.0))
                collected = True

    def unread(self) -> int | None:
        """This epoch's samples not yet returned by `poll`, in flight included (None with wrap)."""
        with self._lock:
            return None if self.wrap else max(len(self.view) - self.view.position, 0) + self._ledger.open

    def peek_id(self) -> int | None:
        """The id the next emitted sample will most likely have (exact in ordered mode, unless
        quarantined)."""
        with self._lock:
            sample_id = self._ledger.peek_id()
            return sample_id if sample_id is not None else self.view.peek()

    def materialize(self, sample_id: int) -> dict[str, np.ndarray]:
        """Preprocesses one sample again (deterministic: the same payload as when it was emitted).

        Raises:
            KeyError: if the record is quarantined.
        """
        return self.materialize_many([sample_id])[0]

    def materialize_many(self, sample_ids: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """`materialize` for several ids, spread over the pool."""
        out: dict[int, ray.ObjectRef[Any]] = {}  # id -> its payload's reference
        # In block order: each chunk then reads few blocks, and each block is read once per call.
        todo = sorted(dict.fromkeys(int(i) for i in sample_ids), key=lambda i: (self.dataset.block_of(i), i))
        for _attempt in range(self.max_attempts):
            if not todo:
                break
            tasks = []
            for k in range(0, len(todo), self.chunk_size):
                chunk = todo[k : k + self.chunk_size]
                sent = self.pool.submit(self.reader.items(chunk), self.epoch, self.seed, "force")
                assert sent is not None  # "force" is never refused (`PreprocessPool.submit`)
                tasks.append((chunk, sent[1]))
            failed: list[int] = []
            bad: list[str] = []
            for chunk, refs in tasks:
                try:
                    metas = ray.get(refs[0])
                except ray.exceptions.RayError:
                    lost = ray_lost()
                    if lost is not None:
                        raise lost from None
                    failed += chunk
                    continue
                for i, meta, pref in zip(chunk, metas, refs[1:], strict=False):
                    if meta[4] is not None:
                        bad.append(f"sample {i} is quarantined: {meta[4]}")
                    out[i] = pref
            if bad:
                raise KeyError("; ".join(bad))
            todo = failed
        if todo:
            raise RuntimeError(
                f"samples {todo[:10]} could not be preprocessed: actors died {self.max_attempts} times"
            )
        payloads: list[dict[str, np.ndarray]] = ray.get([out[int(i)] for i in sample_ids])
        return payloads

    # -- state ---------------------------------------------------------------------------------------
    def _view_state_at(self, seq: int) -> dict[str, Any]:
        return self.view.state_at(seq)

    def state_dict(self) -> dict[str, Any]:
        """Exact resume point: the view at the first unresolved sample, plus what is resolved beyond it."""
        with self._lock:
            ahead = self._ledger.resolved_ahead()
            low = self._ledger.low
            return {
                "version": STATE_VERSION,
                "kind": "RaySource",
                "view": self._view_state_at(low),
                "resolved_ahead": ahead,
                "emitted": self.emitted,
                "reasons": dict(self.reasons),
                "retries": self.retries,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from `state`: emitted/quarantined samples are skipped, the rest is requested again."""
        if state.get("kind") != "RaySource" or state.get("version") != STATE_VERSION:
            raise ValueError(
                f"not a RaySource state (version {STATE_VERSION}): kind={state.get('kind')!r} "
                f"version={state.get('version')!r}"
            )
        with self._lock:
            self.view.load_state_dict(state["view"])
            n = len(self.view)
            low = self.view.passes * n + self.view.position if self.wrap else self.view.position
            self._want_window = -1
            self._reset(low, {low + int(d) for d in state["resolved_ahead"]})
            self.emitted = int(state["emitted"])
            self.reasons = collections.Counter({str(k): int(v) for k, v in state["reasons"].items()})
            self.retries = int(state.get("retries", 0))

    # -- lifecycle -----------------------------------------------------------------------------------
    def actor_nodes(self, timeout: float = 10.0) -> list[str]:
        """The Ray node id each actor of its pool runs on (one round trip to the actors)."""
        return self.pool.actor_nodes(timeout)

    def stats(self) -> dict[str, Any]:
        """Counters for reports: actors, the node they are pinned to ("" = none), samples, quarantined (by
        reason), samples/s, time poll waited."""
        wall = (self._t_last or time.perf_counter()) - self._t_first if self._t_first else 0.0
        return {
            "actors": self.pool.num_actors,
            "node_id": self.pool.node_id or "",
            "samples": self.emitted,
            "quarantined": self.quarantined,
            **self.reader.stats(),
            "windows": len(self.view.windows),
            "reasons": dict(self.reasons),
            "records_read": self.records_read,
            "retries": self.retries,
            "wall_s": wall,
            "samples_per_s": self.emitted / wall if wall > 0 else 0.0,
            "poll_wait_s": self.wait_s,
        }

    def start_epoch(self, epoch: int, remainder: Remainder | None = None) -> None:
        """Moves to `epoch`'s view (a new seeded permutation) from its start, keeping the pool, the counters
        (they count all epochs) and the quarantine. Work still in flight (non-join mode stops mid-view) is
        dropped; its actors are released when it ends. With a resize's `remainder` (its epoch, at its
        world size) the view holds the ids it left, dealt to this rank by units (`batchd.core.BlockView`)."""
        with self._lock:
            self.epoch = epoch
            self.view = self.view.for_epoch(epoch, remainder)
            self._want_window = -1
            self._reset(0, set())

    def close(self) -> None:
        """Drops outstanding work; closes the pool if this source created it."""
        with self._lock:
            self._reset(self._ledger.low, set())
            self.reader.close()
            if self._own_pool:
                self.pool.close()

    def __enter__(self) -> RaySource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_blocks(dataset: RecordDataset, window_bytes: int) -> None:
    """Raises ValueError naming file and block when one block alone is larger than a window."""
    big = max(dataset.blocks, key=lambda b: b.nbytes)
    if big.nbytes > window_bytes:
        info = dataset.files[big.file]
        unit = {"parquet": "row group", "arrow": "record batch", "jsonl": "block of lines"}[info.format]
        raise ValueError(
            f"{info.path}: {unit} {big.index} holds {big.nbytes / 2**20:.0f} MiB once read, more than a "
            f"quarter of the memory budget ({4 * window_bytes / 2**20:.0f} MiB), the most one read-ahead "
            f"window may hold: rewrite the file with smaller {unit}s (e.g. "
            f"pyarrow.parquet.write_table(row_group_size=...)) or raise [data] memory_budget"
        )


def _open_pool(
    dataset: RecordDataset | str | os.PathLike[str] | Sequence[Any] | None,
    pool: PreprocessPool | PoolOptions | None,
    memory_budget: int,
) -> tuple[PreprocessPool, bool]:
    """The pool a `RaySource` runs on, and whether it is the source's own: `pool` when it is a shared pool
    (`dataset`, if given too, must have as many records as the pool's), else a new `PreprocessPool` over
    `dataset` (opened as a `RecordDataset` if it is paths) built as `pool` says (None: `PoolOptions()`).
    The dataset's blocks are checked against the read-ahead window (`check_blocks`, a quarter of
    `memory_budget`) before any actor starts."""
    if not isinstance(pool, PreprocessPool):
        build = PoolOptions() if pool is None else pool
        if not isinstance(build, PoolOptions):
            raise ValueError(f"pool must be a PreprocessPool, a PoolOptions or None, got {pool=}")
        if dataset is None:
            raise ValueError("RaySource needs a dataset or a pool")
        records = dataset if isinstance(dataset, RecordDataset) else RecordDataset(dataset)
        check_blocks(records, memory_budget // 4)
        own = PreprocessPool(
            records,
            build.stages,
            build.num_actors,
            ray_address=build.ray_address,
            actor_num_cpus=build.actor_num_cpus,
            node_id=build.node_id,
        )
        return own, True
    if isinstance(pool.dataset, RecordDataset):
        check_blocks(pool.dataset, memory_budget // 4)
    if dataset is not None:
        n = len(dataset) if isinstance(dataset, RecordDataset) else None
        if dataset is not pool.dataset and n is not None and n != len(pool.dataset):
            raise ValueError(f"dataset has {n} records but the pool's has {len(pool.dataset)}")
    return pool, False
