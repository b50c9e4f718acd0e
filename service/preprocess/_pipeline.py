"""The Ray preprocessing data plane: an actor pool running the stage chain, and `RaySource` per rank.

    RecordDataset (pyarrow) --ray.put once--> PreprocessPool: N actors, each with the tables and the chain
        ^ ids, epoch, seed (tiny task args)          |  per task: [metadata list, payload_1, ..., payload_k]
        |                                            v  (one object per sample; payloads stay in the store)
    RaySource(rank r): its ViewSource of the epoch, at most `max_in_flight` samples outstanding,
        poll() -> (Sample, ObjectRef to the payload dict) | None | EXHAUSTED, quarantine for bad records

Only metadata (id, realized length, loss tokens, per-modality counts) reaches the caller's process
eagerly; `resolve(payload)` fetches the payload dict at collate time (a balanced plan that moves a sample
to another rank moves the reference, not the bytes).

Why an actor pool of our own rather than Ray Data (`map_batches` with an actor pool strategy):
batchd needs per-sample control that Ray Data's streaming executor does not expose.
- Order and exact resume: each rank walks its own epoch-seeded view in a fixed order, and a restarted
  rank service must continue from a saved state exactly: what was emitted is skipped, what was in flight
  is requested again. Ray Data's iterators (and `streaming_split`) are not checkpointable.
- Re-materialization by id: a restarted rank service (metadata-only journal) and a balanced plan need
  any single sample again, deterministically; Ray Data works on whole datasets and blocks.
- One object per sample: payloads must be addressable one by one (so a sample moves as a single
  ObjectRef); Ray Data yields blocks/batches of rows.
- Backpressure in samples, from the consumer: the rank's window decides how much may be outstanding.
- Faults at sample granularity: an actor that dies costs only its in-flight tasks, which are resubmitted
  (split into single samples, so a record that crashes the worker is isolated and quarantined after
  `max_attempts`, instead of being retried forever); Python errors in a stage quarantine one record.
What it costs: no autoscaling of the pool and no locality-aware block scheduling (actors can be spread
over nodes with Ray's scheduling options; the tables are shared through the object store).

Fault model: actors are created with `max_restarts=-1` and `max_task_retries=0`: Ray restarts a dead
actor (its __init__ fetches the shared tables again), and RaySource itself resubmits the tasks that
died with it. Preprocessing is a pure function of (record, seed, epoch, sample id), so the rerun gives
the identical sample: nothing is lost or duplicated.

Embedded default: `ensure_ray()` starts a local Ray when none is running and no address is given;
`ray_address` joins a running cluster (where batchd must be importable on every node). Rank services
use `share_ray()` instead: without an address they join a Ray already running on this host (one Ray
per host, however many rank services), start the embedded one only when there is none, and keep it up
until the last rank service using it has exited.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import logging
import os
import re
import socket
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray

from batchd.core import Sample, ViewSource

from ._records import DatasetHandle, Quarantine, RecordDataset, Reject
from ._sources import EXHAUSTED
from ._stages import Preprocessor, default_stages

log = logging.getLogger("batchd.preprocess")

STATE_VERSION = 1


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connects to Ray: no-op when initialized, joins `address` when given, else starts a local instance."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False)


def _gcs_reachable(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _ray_root() -> str:
    """Ray's temp root on this host (where `ray start` writes `ray_current_cluster`)."""
    base = os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR") if os.name == "posix" else None) or "/tmp"
    return os.path.join(base, "ray")


def running_ray_address() -> str | None:
    """The GCS address of a Ray already running on this host, or None.

    Looked for in order: `RAY_ADDRESS`; the cluster `ray start` last wrote to Ray's temp root; a Ray
    process of this user on this host whose session lives under the same temp root (the
    `--gcs-address=` of Ray's monitors and raylet). The temp root is Ray's: `$RAY_TMPDIR/ray`, else
    `$TMPDIR/ray`, else `/tmp/ray`, so processes with another `TMPDIR` do not see each other's Ray. An
    address counts only while its GCS accepts TCP connections (a stale address file, or a Ray being
    torn down, is skipped).
    """
    env = os.environ.get("RAY_ADDRESS")
    if env and env not in ("auto", "local"):
        return env
    candidates = []
    with contextlib.suppress(OSError):
        with open(os.path.join(_ray_root(), "ray_current_cluster"), encoding="utf-8") as f:
            candidates.append(f.read().strip())
    uid = os.getuid() if hasattr(os, "getuid") else None
    session = os.path.join(_ray_root(), "session_")
    with contextlib.suppress(OSError):
        for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
            try:
                if uid is not None and os.stat(f"/proc/{pid}").st_uid != uid:
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
            except OSError:
                continue
            if session in cmd:
                candidates += [m for m in re.findall(r"--gcs-address=([^\x00\s]+)", cmd) if m not in candidates]
    return next((a for a in candidates if a and _gcs_reachable(a)), None)


class SharedRay:
    """This process's use of a Ray (`share_ray`): `address` (GCS), `started` (this process started it).

    While it is held, the process holds a shared lock on a per-Ray "users" file in the temp dir; the
    lock dies with the process, however it ends (kill -9 included). `close()`: a Ray only joined is
    left alone (never stopped, not even `ray.shutdown()`: the process's exit disconnects it); a Ray
    started here is stopped (`ray.shutdown()`) only once no other process holds the lock, since the
    rank services that joined it keep their payloads in its object store. Waiting for them is logged.
    """

    def __init__(self, address: str, started: bool) -> None:
        self.address, self.started = address, started
        name = re.sub(r"[^0-9A-Za-z.]+", "_", address)
        self.users_file = os.path.join(tempfile.gettempdir(), f"batchd-ray-{name}.users")
        self._fd: int | None = os.open(self.users_file, os.O_RDWR | os.O_CREAT, 0o600)
        _flock(self._fd, shared=True, wait=True)

    def close(self, poll_s: float = 0.5) -> None:
        """Releases this process's use; stops a Ray started here once nobody else uses it (see class)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self.started:
                if not _flock(fd, shared=False, wait=False):
                    log.info("waiting for the other rank services that joined the Ray at %s to exit before "
                             "stopping it", self.address)
                    while not _flock(fd, shared=False, wait=False):
                        time.sleep(poll_s)
                ray.shutdown()
                log.info("stopped the embedded Ray at %s", self.address)
        finally:
            os.close(fd)


def _flock(fd: int, shared: bool, wait: bool) -> bool:
    try:
        import fcntl
    except ImportError:  # not POSIX: no sharing protocol, every process acts alone
        return True
    flags = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        return False
    return True


def _local_auth() -> None:
    """Enables Ray's token auth the way Ray's own discovery of a local cluster does (`ray.init()` without
    an address): a Ray started on this host by `ray.init` (Ray >= 2.5x) requires the token in
    ~/.ray/auth_token, and an explicit address does not turn token auth on by itself."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token auth
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


@contextlib.contextmanager
def _host_lock():
    """Serializes `share_ray`'s look-or-start across the processes of this host (a lock file in the temp dir)."""
    fd = os.open(os.path.join(tempfile.gettempdir(), "batchd-ray-start.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _flock(fd, shared=False, wait=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def share_ray(address: str | None = None, num_cpus: int | None = None, who: str = "batchd") -> SharedRay:
    """Connects this process to Ray the way a rank service does; returns the `SharedRay` to close at exit.

    `address` given: joins it. None: joins a Ray already running on this host (`running_ray_address`),
    else starts the embedded one (logged). Look-and-start is serialized across the host, so rank
    services started together share one Ray rather than each starting their own.

    A process already connected to Ray keeps that connection, as joined (not its to stop).
    """
    if ray.is_initialized():
        return SharedRay(ray.get_runtime_context().gcs_address, started=False)
    if address:
        ray.init(address=address)
        gcs = ray.get_runtime_context().gcs_address
        log.info("%s: joined the Ray cluster at %s (gcs %s)", who, address, gcs)
        return SharedRay(gcs, started=False)
    with _host_lock():
        found = running_ray_address()
        if found:
            _local_auth()
            ray.init(address=found)
            gcs = ray.get_runtime_context().gcs_address
            log.info("%s: joined the Ray already running on this host (gcs %s)", who, gcs)
            return SharedRay(gcs, started=False)
        ray.init(num_cpus=num_cpus, include_dashboard=False)
        gcs = ray.get_runtime_context().gcs_address
        shared = SharedRay(gcs, started=True)  # holds its lock before the next process may look
    log.info("%s: no Ray running on this host: started an embedded Ray (gcs %s); rank services started later "
             "on this host join it", who, gcs)
    return shared


def resolve(payload: Any) -> dict[str, np.ndarray]:
    """The payload dict of a sample: `ray.get` when it is an ObjectRef, the value itself otherwise."""
    if isinstance(payload, ray.ObjectRef):
        return ray.get(payload)
    return payload


def resolve_many(payloads: Sequence[Any]) -> list[dict[str, np.ndarray]]:
    """`resolve` for a list, with one `ray.get` round trip for all the references in it."""
    idx = [k for k, p in enumerate(payloads) if isinstance(p, ray.ObjectRef)]
    out = list(payloads)
    if idx:
        for k, value in zip(idx, ray.get([payloads[k] for k in idx])):
            out[k] = value
    return out


# ---------------------------------------------------------------------------------------------------
# Actor pool
# ---------------------------------------------------------------------------------------------------
class PreprocessWorker:
    """The actor: reads records from the shared tables and runs the chain (one task = a few samples)."""

    def __init__(self, args: list[ray.ObjectRef]) -> None:
        handle, stages = ray.get(args[0])
        tables = [ray.get(t) if isinstance(t, ray.ObjectRef) else t for t in handle.tables]
        self.handle: DatasetHandle = handle.with_tables(tables)
        self.pre = Preprocessor(stages)
        self.pre.setup()
        self.processed = 0
        self.busy_s = 0.0
        self.cpu_s = 0.0

    def process(self, ids: Sequence[int], epoch: int, seed: int) -> list[Any]:
        """[metadata per sample, payload per sample...]; metadata = (length, loss, text, vision, reason)."""
        t0, c0 = time.perf_counter(), time.process_time()
        metas, payloads = [], []
        for i in ids:
            try:
                k, _ = self.handle.locate(i)
                meta, payload = self.pre(self.handle.record(i), i, epoch, self.handle.source(i),
                                         self.handle.files[k].base_dir, seed)
                metas.append((meta.length, meta.loss_tokens, meta.text_tokens, meta.vision_tokens, None))
                payloads.append(payload)
            except Reject as exc:
                metas.append((0, 0, 0, 0, exc.reason))
                payloads.append(None)
            except Exception as exc:
                metas.append((0, 0, 0, 0, f"stage_error: {type(exc).__name__}: {exc}"))
                payloads.append(None)
        self.processed += len(ids)
        self.busy_s += time.perf_counter() - t0
        self.cpu_s += time.process_time() - c0
        return [metas, *payloads]

    def ping(self) -> int:
        return os.getpid()

    def stats(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "processed": self.processed, "busy_s": self.busy_s, "cpu_s": self.cpu_s}


class PreprocessPool:
    """`num_actors` Ray actors that preprocess samples of one dataset with one stage chain.

    Several RaySources (ranks, epochs, seeds) may share a pool: seed and epoch travel with each task.

    Args:
        dataset: A RecordDataset, or what `RecordDataset` accepts (paths, directory, URIs).
        stages: The chain (instances, classes, functions, 'module:attr' strings); None = `default_stages()`.
            Validated here (imported and built once in this process) before any actor starts.
        num_actors: Actors in the pool.
        actor_num_cpus: Logical CPUs each actor reserves (Ray scheduling; lower it to oversubscribe).
        ray_address: Join this Ray cluster instead of starting a local one (when Ray is not initialized).
        start_timeout_s: How long to wait for the actors to start before failing with a clear error.
        actor_options: Extra `ray.remote` options for the actors (e.g. a scheduling strategy).
    """

    def __init__(self, dataset: RecordDataset | str | os.PathLike | Sequence[str | os.PathLike],
                 stages: Sequence[Any] | None = None, num_actors: int = 2, *, actor_num_cpus: float = 1.0,
                 ray_address: str | None = None, start_timeout_s: float = 120.0,
                 actor_options: Mapping[str, Any] | None = None) -> None:
        if num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got {num_actors=}")
        self.dataset = dataset if isinstance(dataset, RecordDataset) else RecordDataset(dataset)
        self.stages = list(default_stages() if stages is None else stages)
        Preprocessor(self.stages)  # fail fast, here, on a stage that cannot be imported or built
        ensure_ray(ray_address)
        handle = self.dataset.handle()
        self._table_refs = [ray.put(t) for t in handle.tables]
        # The constructor arguments stay referenced by the pool for its lifetime, so a restarted actor
        # can always fetch them again (they are passed nested, and fetched by the actor itself).
        self._args_ref = ray.put((handle.with_tables(self._table_refs), self.stages))
        options = {"max_restarts": -1, "max_task_retries": 0, "num_cpus": actor_num_cpus, **dict(actor_options or {})}
        cls = ray.remote(PreprocessWorker).options(**options)
        self.actors = [cls.remote([self._args_ref]) for _ in range(num_actors)]
        self.loads = [0] * num_actors  # tasks submitted and not finished, per actor
        self._holds = 0  # sources waiting for an idle actor (normal submissions pause meanwhile)
        self._lock = threading.Lock()
        self._closed = False
        try:
            ray.get([a.ping.remote() for a in self.actors], timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            total = ray.cluster_resources().get("CPU", 0)
            self.close()
            raise RuntimeError(
                f"only some of {num_actors} preprocessing actors started within {start_timeout_s:.0f}s: each "
                f"reserves {actor_num_cpus} CPU and the Ray cluster has {total:g} CPUs in all (other pools may "
                f"hold some); lower num_actors or actor_num_cpus, or start Ray with more logical CPUs") from None

    @property
    def num_actors(self) -> int:
        return len(self.actors)

    def submit(self, ids: Sequence[int], epoch: int, seed: int, mode: str = "normal"
               ) -> tuple[int, list[ray.ObjectRef], ray.ObjectRef | None] | None:
        """Sends `ids` to an actor: (actor index, [metadata ref, payload refs...], probe) or None if refused.

        mode "normal": the least loaded actor; refused while a source waits for an idle actor (`hold`).
        mode "isolated": only an idle actor (nothing queued ahead), else refused.
        mode "force": the least loaded actor, always.
        `probe` is set when the task is a single sample with nothing queued ahead of it on its actor: a
        `ping` sent to the same actor just before it. If that actor dies before the task finishes and
        the probe succeeded (`probe_ok`), the actor was alive when the task started: the task was the one
        executing. A failed probe means the actor was already dead (e.g. a restart not yet seen here).
        """
        if self._closed:
            raise RuntimeError("the preprocessing pool is closed")
        with self._lock:
            if mode == "isolated":
                idle = [k for k, load in enumerate(self.loads) if load == 0]
                if not idle:
                    return None
                k = idle[0]
            elif mode == "normal" and self._holds > 0:
                return None
            else:
                k = min(range(len(self.actors)), key=self.loads.__getitem__)
            alone = self.loads[k] == 0 and len(ids) == 1
            self.loads[k] += 1
        probe = self.actors[k].ping.remote() if alone else None  # actor tasks run in submission order
        refs = self.actors[k].process.options(num_returns=len(ids) + 1).remote(list(ids), epoch, seed)
        # Released when the task really ends (result or failure), whoever reads it and whenever.
        refs[0].future().add_done_callback(lambda _f, k=k: self._release(k))
        return k, refs, probe

    @staticmethod
    def probe_ok(probe: ray.ObjectRef | None) -> bool:
        """Whether a `submit` probe succeeded (the actor answered it before running the task)."""
        if probe is None:
            return False
        try:
            ray.get(probe, timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            return False
        return True

    def _release(self, actor: int) -> None:
        with self._lock:
            self.loads[actor] = max(self.loads[actor] - 1, 0)

    def hold(self, on: bool) -> None:
        """A source starts (on) or stops waiting for an idle actor; normal submissions pause meanwhile."""
        with self._lock:
            self._holds = max(self._holds + (1 if on else -1), 0)

    def stats(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Per actor: pid, samples processed, busy (wall) and CPU seconds inside `process`, since its last start."""
        return ray.get([a.stats.remote() for a in self.actors], timeout=timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self.actors = []

    def __enter__(self) -> PreprocessPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------
# RaySource
# ---------------------------------------------------------------------------------------------------
_FLIGHT, _READY, _DONE = 0, 1, 2


@dataclasses.dataclass(slots=True)
class _Entry:
    id: int
    status: int
    attempts: int = 0
    sample: Sample | None = None
    payload: Any = None


@dataclasses.dataclass(slots=True)
class _Task:
    seqs: list[int]
    actor: int
    payloads: list[ray.ObjectRef]
    probe: ray.ObjectRef | None  # set when the task ran alone on its actor (`PreprocessPool.submit`)


class RaySource:
    """Rank `rank`'s stream of preprocessed samples for one epoch (the rank service's source interface).

    `poll(timeout)` returns `(Sample, payload)`, `None` (nothing ready yet) or `EXHAUSTED`; the payload is
    an ObjectRef to the payload dict (`payload="dict"` fetches it instead); `resolve(payload)` gives the
    dict. Quarantined records never come out of `poll`: they are counted (`quarantined`, `reasons`) and
    written to the quarantine file. At the end of the view, `emitted + quarantined == len(self)`.

    Args:
        dataset: A RecordDataset or paths (None when `pool` is given: the pool's dataset).
        rank, world_size, seed, epoch, shuffle, wrap: The view (`batchd.core.ViewSource`).
        stages: The chain when this source builds its own pool (None = `default_stages()`).
        num_actors: Actors of its own pool (ignored with `pool`).
        pool: A shared `PreprocessPool` (not closed by `close()`).
        max_in_flight: Samples requested but not yet returned by poll (backpressure); default
            4 x actors x chunk_size.
        chunk_size: Samples per actor task (amortizes Ray's per-task cost: see docs/benchmarks.md).
        ordered: Emit in view order (deterministic; default) or in completion order (no head-of-line wait;
            not with `wrap`).
        quarantine: A Quarantine, a JSONL path for one, or None (counts only).
        max_attempts: Actor deaths a sample may see before it is quarantined as `worker_crashed`.
        payload: "ref" (default) or "dict".
        ray_address, actor_num_cpus: For its own pool (see PreprocessPool).
    """

    def __init__(self, dataset: RecordDataset | str | os.PathLike | Sequence[Any] | None, rank: int = 0,
                 world_size: int = 1, seed: int = 0, epoch: int = 0, shuffle: bool = True, *,
                 stages: Sequence[Any] | None = None, num_actors: int = 2, pool: PreprocessPool | None = None,
                 max_in_flight: int | None = None, chunk_size: int = 8, ordered: bool = True, wrap: bool = False,
                 quarantine: Quarantine | str | os.PathLike | None = None, max_attempts: int = 3,
                 payload: str = "ref", ray_address: str | None = None, actor_num_cpus: float = 1.0) -> None:
        if payload not in ("ref", "dict"):
            raise ValueError(f"payload must be 'ref' or 'dict', got {payload=}")
        if wrap and not ordered:
            raise ValueError("wrap=True (non-join mode) needs ordered=True: peek_id must name the next sample")
        if chunk_size < 1 or max_attempts < 1:
            raise ValueError(f"chunk_size and max_attempts must be >= 1, got {chunk_size=} {max_attempts=}")
        if pool is None:
            if dataset is None:
                raise ValueError("RaySource needs a dataset or a pool")
            pool = PreprocessPool(dataset, stages, num_actors, ray_address=ray_address, actor_num_cpus=actor_num_cpus)
            self._own_pool = True
        else:
            if dataset is not None:
                n = len(dataset) if isinstance(dataset, RecordDataset) else None
                if dataset is not pool.dataset and n is not None and n != len(pool.dataset):
                    raise ValueError(f"dataset has {n} records but the pool's has {len(pool.dataset)}")
            self._own_pool = False
        self.pool = pool
        self.dataset = pool.dataset
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, epoch
        self.wrap, self.ordered, self.chunk_size, self.max_attempts = wrap, ordered, chunk_size, max_attempts
        self.max_in_flight = max_in_flight or 4 * pool.num_actors * chunk_size
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight=}")
        self.fetch_payloads = payload == "dict"
        self.quarantine = quarantine if isinstance(quarantine, Quarantine) else Quarantine(quarantine)
        self.view = ViewSource(len(self.dataset), rank, world_size, seed, epoch, shuffle, wrap)
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
        self._entries: dict[int, _Entry] = {}
        self._tasks: dict[ray.ObjectRef, _Task] = {}
        self._suspects: collections.deque[int] = collections.deque()  # to rerun alone on an idle actor
        self._unsent: list[list[int]] = []  # pulled, not yet accepted by the pool
        self._hold(False)
        self._ready: list[int] = []  # heap of READY seqs (completion-order mode)
        self._low = self._next = low
        self._skip = skip
        self._open = 0

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
        return self._open

    def _pull(self) -> int | None:
        """Pulls the next id of the view as a new entry; returns its seq (None: exhausted or skipped)."""
        i = self.view.next()
        if i is None:
            return None
        seq = self._next
        self._next += 1
        if seq in self._skip:
            self._skip.discard(seq)
            self._entries[seq] = _Entry(i, _DONE)
            return None
        self._entries[seq] = _Entry(i, _FLIGHT)
        self._open += 1
        return seq

    def _submit(self, seqs: list[int], mode: str = "normal") -> bool:
        sent = self.pool.submit([self._entries[s].id for s in seqs], self.epoch, self.seed, mode)
        if sent is None:
            return False
        actor, refs, probe = sent
        self._tasks[refs[0]] = _Task(seqs, actor, refs[1:], probe)
        return True

    def _hold(self, on: bool) -> None:
        if on != getattr(self, "_holding", False):
            self._holding = on
            self.pool.hold(on)

    def _top_up(self) -> None:
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
                room = self.max_in_flight - self._open
                left = len(self.view) - self.view.position if not self.wrap else self.chunk_size
                if room <= 0 or (room < min(self.chunk_size, left) and self._tasks):
                    break
                batch: list[int] = []
                while len(batch) < min(room, self.chunk_size) and not self.view.exhausted():
                    seq = self._pull()
                    if seq is not None:
                        batch.append(seq)
                if batch and not self._submit(batch):
                    self._unsent.append(batch)
        self._advance_low()

    def _advance_low(self) -> None:
        while self._low < self._next and self._entries[self._low].status == _DONE:
            del self._entries[self._low]
            self._low += 1

    def _resolve_done(self, seq: int) -> None:
        self._entries[seq].status = _DONE
        self._open -= 1

    def _quarantine(self, seq: int, reason: str) -> None:
        e = self._entries[seq]
        e.payload = e.sample = None
        self._resolve_done(seq)
        self.reasons[Quarantine.code_of(reason)] += 1
        self.quarantine.add(e.id, self.dataset.source(e.id), reason, self.epoch)

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

    def _finish(self, ref: ray.ObjectRef) -> None:
        task = self._tasks.pop(ref)
        try:
            metas = ray.get(ref)
        except ray.exceptions.RayError as exc:
            # The actor died (or the task failed) before this task ended. Only a task that ran alone with
            # nothing queued ahead of it, on an actor that answered the probe just before it, was certainly
            # executing: only then is the crash charged to its sample. The others were collateral (or
            # were sent to an actor that was already dead) and are rerun (alone) at no charge.
            self.retries += len(task.seqs)
            charged = self.pool.probe_ok(task.probe)
            for seq in task.seqs:
                e = self._entries[seq]
                if charged:
                    e.attempts += 1
                    if e.attempts >= self.max_attempts:
                        log.warning("sample %d: its actor died %d times while processing it; quarantined",
                                    e.id, e.attempts)
                        self._quarantine(seq, f"worker_crashed: the actor died {e.attempts} times while "
                                              f"processing this sample ({type(exc).__name__})")
                        continue
                self._suspects.append(seq)
            return
        for seq, meta, pref in zip(task.seqs, metas, task.payloads):
            length, loss, text, vision, reason = meta
            if reason is not None:
                self._quarantine(seq, reason)
                continue
            e = self._entries[seq]
            e.sample = Sample(e.id, length, loss, self.rank, (("text", text), ("vision", vision)))
            e.payload = pref
            e.status = _READY
            if not self.ordered:
                heapq.heappush(self._ready, seq)

    def _pop_ready(self) -> tuple[Sample, Any] | None:
        self._advance_low()
        seq = None
        if self.ordered:
            if self._low < self._next and self._entries[self._low].status == _READY:
                seq = self._low
        elif self._ready:
            seq = heapq.heappop(self._ready)
        if seq is None:
            return None
        e = self._entries[seq]
        item = (e.sample, ray.get(e.payload) if self.fetch_payloads else e.payload)
        e.sample = e.payload = None
        self._resolve_done(seq)
        self.emitted += 1
        self._advance_low()
        return item

    def _finished(self) -> bool:
        return self._open == 0 and self.view.exhausted()

    # -- the source interface ------------------------------------------------------------------------
    def poll(self, timeout: float = 0.0):
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
                    return EXHAUSTED
                remaining = deadline - time.monotonic()
                if collected and remaining <= 0:
                    return None
                self._collect(max(remaining, 0.0))
                collected = True

    def peek_id(self) -> int | None:
        """The id the next emitted sample will most likely have (exact in ordered mode, unless quarantined)."""
        with self._lock:
            self._advance_low()
            if not self.ordered and self._ready:
                return self._entries[self._ready[0]].id
            for seq in range(self._low, self._next):
                if self._entries[seq].status != _DONE:
                    return self._entries[seq].id
            return self.view.peek()

    def materialize(self, sample_id: int) -> dict[str, np.ndarray]:
        """Preprocesses one sample again (deterministic: the same payload as when it was emitted).

        Raises:
            KeyError: if the record is quarantined.
        """
        return self.materialize_many([sample_id])[0]

    def materialize_many(self, sample_ids: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """`materialize` for several ids, spread over the pool."""
        out: dict[int, dict[str, np.ndarray]] = {}
        todo = list(dict.fromkeys(int(i) for i in sample_ids))
        for attempt in range(self.max_attempts):
            if not todo:
                break
            tasks = []
            for k in range(0, len(todo), self.chunk_size):
                chunk = todo[k:k + self.chunk_size]
                tasks.append((chunk, self.pool.submit(chunk, self.epoch, self.seed, "force")[1]))
            failed: list[int] = []
            bad: list[str] = []
            for chunk, refs in tasks:
                try:
                    metas = ray.get(refs[0])
                except ray.exceptions.RayError:
                    failed += chunk
                    continue
                for i, meta, pref in zip(chunk, metas, refs[1:]):
                    if meta[4] is not None:
                        bad.append(f"sample {i} is quarantined: {meta[4]}")
                    out[i] = pref
            if bad:
                raise KeyError("; ".join(bad))
            todo = failed
        if todo:
            raise RuntimeError(f"samples {todo[:10]} could not be preprocessed: actors died {self.max_attempts} times")
        refs = [out[int(i)] for i in sample_ids]
        return ray.get(refs)

    # -- state ---------------------------------------------------------------------------------------
    def _view_state_at(self, seq: int) -> dict[str, Any]:
        return self.view.state_at(seq)

    def state_dict(self) -> dict[str, Any]:
        """Exact resume point: the view at the first unresolved sample, plus what is resolved beyond it."""
        with self._lock:
            self._advance_low()
            low = self._low
            ahead = sorted({s - low for s, e in self._entries.items() if e.status == _DONE and s > low}
                           | {s - low for s in self._skip if s >= low})
            return {"version": STATE_VERSION, "kind": "RaySource", "view": self._view_state_at(low),
                    "resolved_ahead": ahead, "emitted": self.emitted, "reasons": dict(self.reasons),
                    "retries": self.retries}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from `state`: emitted/quarantined samples are skipped, the rest is requested again."""
        if state.get("kind") != "RaySource" or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a RaySource state (version {STATE_VERSION}): kind={state.get('kind')!r} "
                             f"version={state.get('version')!r}")
        with self._lock:
            self.view.load_state_dict(state["view"])
            n = len(self.view)
            low = self.view.passes * n + self.view.position if self.wrap else self.view.position
            self._reset(low, {low + int(d) for d in state["resolved_ahead"]})
            self.emitted = int(state["emitted"])
            self.reasons = collections.Counter({str(k): int(v) for k, v in state["reasons"].items()})
            self.retries = int(state.get("retries", 0))

    # -- lifecycle -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for reports: actors, samples, quarantined (by reason), samples/s, time poll waited."""
        wall = (self._t_last or time.perf_counter()) - self._t_first if self._t_first else 0.0
        return {"actors": self.pool.num_actors, "samples": self.emitted, "quarantined": self.quarantined,
                "reasons": dict(self.reasons), "records_read": self.records_read, "retries": self.retries,
                "wall_s": wall, "samples_per_s": self.emitted / wall if wall > 0 else 0.0, "poll_wait_s": self.wait_s}

    def start_epoch(self, epoch: int) -> None:
        """Moves to `epoch`'s view (a new seeded permutation) from its start, keeping the pool, the counters
        (they count all epochs) and the quarantine. Work still in flight (non-join mode stops mid-view) is
        dropped; its actors are released when it ends."""
        with self._lock:
            self.epoch = epoch
            self.view = self.view.for_epoch(epoch)
            self._reset(0, set())

    def close(self) -> None:
        """Drops outstanding work; closes the pool if this source created it."""
        with self._lock:
            self._reset(self._low, set())
            if self._own_pool:
                self.pool.close()

    def __enter__(self) -> RaySource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
