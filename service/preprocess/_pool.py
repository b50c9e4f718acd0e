"""The preprocessing actor pool: `PreprocessPool`, N Ray actors (`PreprocessWorker`) running one stage chain.

Actors hold no dataset: the rank's `RaySource` reads its records (by blocks, `BlockReader`) and sends
each task its records' raw items (`RecordDataset.items`); each actor builds the chain once and runs tasks
of a few samples: per task it returns [metadata list, payload_1, ..., payload_k], one object per sample,
so payloads stay in the store and move as references. Seed and epoch travel with each task, so several
`RaySource`s (ranks, epochs, seeds) may share a pool.

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
What it costs: no autoscaling of the pool; a record's raw bytes cross from the reading rank to an actor
(on the same node by default, see Placement).

Placement: by default a pool's actors are pinned, softly, to the node of the process that creates it
(`NodeAffinitySchedulingStrategy(node_id, soft=True, _spill_on_unavailable=True)`), so a node agent's
preprocessing runs where its trainer ranks are and payloads are made in that node's object store.
Soft: an actor whose node is dead or lacks the resources goes elsewhere. Plain `soft=True` falls back
only when the node is dead or infeasible (too small for an actor, ever); a feasible but busy node would
make the actor wait for a free CPU there, hence `_spill_on_unavailable` (private since Ray 2.4, made
for Ray Data's own locality: ray-project/ray#34224): an actor that finds no free CPU on its node
borrows one on another node. `node_id=""`
opts out (Ray's default placement, e.g. to spread a big pool over the cluster); `actor_options` with
a `scheduling_strategy` overrides both. Each actor reports the node it runs on (`stats`, `actor_nodes`).

Fault model, the pool's part: actors are created with `max_restarts=-1` and `max_task_retries=0`: Ray
restarts a dead actor (its __init__ builds the chain again); resubmitting the tasks that died
with it is the caller's (`RaySource`). `submit`'s probe tells whether a dead task was the one executing.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import ray
else:
    from ._lazy_ray import ray  # imported on first use

from ._chain import Preprocessor, default_stages
from ._dataset import RecordDataset, parse_item
from ._quarantine import Reject
from ._ray import ensure_ray, ray_lost
from ._sources import payload_nbytes

log = logging.getLogger("batchd.preprocess")
START_LOG_S = 30.0  # how often a slow actor start is logged
INLINE_ARGS_BYTES = 90_000  # below Ray's max_direct_call_object_size (100 KiB): passed inline
START_CHECK_S = 5.0  # how often a slow actor start checks that the Ray is still there


_Pairs = tuple[tuple[int, int], ...]  # (encoder patches or frames, tokens) per image or clip


class PreprocessWorker:
    """The actor: parses the records it is sent and runs the chain (one task = a few samples)."""

    def __init__(self, args: bytes | list[ray.ObjectRef[Any]]) -> None:
        stages = ray.cloudpickle.loads(args) if isinstance(args, bytes) else ray.get(args[0])
        self.pre = Preprocessor(stages)
        self.pre.setup()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.processed = 0
        self.busy_s = 0.0
        self.cpu_s = 0.0

    def process(self, items: Sequence[tuple[int, str, str, Any]], epoch: int, seed: int) -> list[Any]:
        """[metadata per sample, payload per sample...] for `items` = (id, source, base_dir, raw) each
        (`RecordDataset.items`).

        metadata = (length, loss, text, vision, reason, nbytes, images, audio): nbytes =
        `payload_nbytes(payload)`, images = ((patches, tokens) per image), audio = ((frames, tokens) per
        clip).
        """
        t0, c0 = time.perf_counter(), time.process_time()
        # (length, loss, text, vision, reason, nbytes, images, audio): see above
        metas: list[tuple[int, int, int, int, str | None, int, _Pairs, _Pairs]] = []
        payloads: list[dict[str, np.ndarray] | None] = []
        for i, source, base_dir, raw in items:
            try:
                meta, payload = self.pre(parse_item(raw, source, base_dir), i, epoch, source, base_dir, seed)
                metas.append(
                    (
                        meta.length,
                        meta.loss_tokens,
                        meta.text_tokens,
                        meta.vision_tokens,
                        None,
                        payload_nbytes(payload),
                        meta.images,
                        meta.audio,
                    )
                )
                payloads.append(payload)
            except Reject as exc:
                metas.append((0, 0, 0, 0, exc.reason, 0, (), ()))
                payloads.append(None)
            except Exception as exc:
                metas.append((0, 0, 0, 0, f"stage_error: {type(exc).__name__}: {exc}", 0, (), ()))
                payloads.append(None)
        self.processed += len(items)
        self.busy_s += time.perf_counter() - t0
        self.cpu_s += time.process_time() - c0
        return [metas, *payloads]

    def ping(self) -> int:
        return os.getpid()

    def stats(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "node_id": self.node_id,
            "processed": self.processed,
            "busy_s": self.busy_s,
            "cpu_s": self.cpu_s,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }


def affinity_node(node_id: str | None) -> str | None:
    """The node a pool's actors are pinned to: `node_id`, this process's node when None, none when ""."""
    if node_id is None:
        return ray.get_runtime_context().get_node_id()
    return node_id or None


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
        start_timeout_s: How long to wait for the actors to start before failing with a clear error (a
            liveness bound, not a speed one: an actor that loads a Hugging Face processor on a busy machine
            takes minutes; the wait is logged every `START_LOG_S`).
        actor_options: Extra `ray.remote` options for the actors; a `scheduling_strategy` here replaces
            the node affinity.
        node_id: The Ray node (hex id) the actors are pinned to, softly (see module docstring). None
            (default): the node of this process (`ray.get_runtime_context().get_node_id()`: in a driver, the
            raylet it attached to); "": no affinity (Ray places them). The target is `self.node_id`
            (None when unpinned).
    """

    def __init__(
        self,
        dataset: RecordDataset | str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        stages: Sequence[Any] | None = None,
        num_actors: int = 2,
        *,
        actor_num_cpus: float = 1.0,
        ray_address: str | None = None,
        start_timeout_s: float = 600.0,
        actor_options: Mapping[str, Any] | None = None,
        node_id: str | None = None,
    ) -> None:
        if num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got {num_actors=}")
        self.dataset = dataset if isinstance(dataset, RecordDataset) else RecordDataset(dataset)
        self.stages = list(default_stages() if stages is None else stages)
        Preprocessor(self.stages)  # fail fast, here, on a stage that cannot be imported or built
        ensure_ray(ray_address)
        # The chain goes to the actors inline (pickled) when small: it then lives in the actor's creation
        # spec, so a restarted actor always gets it again, and Ray does not warn at every start that an
        # actor with max_restarts > 0 has constructor arguments in the object store. A large one goes
        # through the store, referenced by the pool for its lifetime (passed nested, fetched by the actor).
        pickled = ray.cloudpickle.dumps(self.stages)  # type: ignore[no-untyped-call]  # Ray: untyped
        self._args_ref = ray.put(self.stages) if len(pickled) > INLINE_ARGS_BYTES else None
        args = pickled if self._args_ref is None else [self._args_ref]
        options: dict[str, Any] = {"max_restarts": -1, "max_task_retries": 0, "num_cpus": actor_num_cpus}
        self.node_id = affinity_node(node_id) if "scheduling_strategy" not in (actor_options or {}) else None
        if self.node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                self.node_id, soft=True, _spill_on_unavailable=True
            )
        options.update(actor_options or {})
        cls = ray.remote(PreprocessWorker).options(**options)
        # Ray actor handles: their remote methods carry no types.
        self.actors: list[Any] = [cls.remote(args) for _ in range(num_actors)]
        self.loads = [0] * num_actors  # tasks submitted and not finished, per actor
        self._holds = 0  # sources waiting for an idle actor (normal submissions pause meanwhile)
        self._lock = threading.Lock()
        self._closed = False
        pending = [a.ping.remote() for a in self.actors]
        t0 = last_log = time.monotonic()
        while pending:
            left = start_timeout_s - (time.monotonic() - t0)
            if left <= 0:
                break
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, START_CHECK_S))
            if pending:
                lost = ray_lost()
                if lost is not None:
                    self._abandon()
                    raise lost
                if time.monotonic() - last_log >= START_LOG_S:
                    last_log = time.monotonic()
                    log.info(
                        "waiting for %d of %d preprocessing actors to start (%.0fs of %.0fs)",
                        len(pending),
                        num_actors,
                        time.monotonic() - t0,
                        start_timeout_s,
                    )
        if pending:
            total = ray.cluster_resources().get("CPU", 0)  # type: ignore[no-untyped-call]  # Ray: untyped
            self.close()
            raise RuntimeError(
                f"only {num_actors - len(pending)} of {num_actors} preprocessing actors started "
                f"within {start_timeout_s:.0f}s: each reserves {actor_num_cpus} CPU and the Ray cluster "
                f"has {total:g} CPUs in all (other pools may hold some); lower num_actors or "
                f"actor_num_cpus, or start Ray with more logical CPUs"
            )
        try:
            ray.get([a.ping.remote() for a in self.actors])  # an actor whose start failed raises here
        except ray.exceptions.RayError:
            lost = ray_lost()
            if lost is None:
                raise
            self._abandon()
            raise lost from None

    def _abandon(self) -> None:
        """Forgets the actors of a Ray that went away (nothing there to kill)."""
        self._closed = True
        self.actors = []

    @property
    def num_actors(self) -> int:
        return len(self.actors)

    def submit(
        self, items: Sequence[tuple[int, str, str, Any]], epoch: int, seed: int, mode: str = "normal"
    ) -> tuple[int, list[ray.ObjectRef[Any]], ray.ObjectRef[Any] | None] | None:
        """Sends `items` (`RecordDataset.items`) to an actor: (actor index, [metadata ref, payload
        refs...], probe), or None if refused.

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
            alone = self.loads[k] == 0 and len(items) == 1
            self.loads[k] += 1
        probe = self.actors[k].ping.remote() if alone else None  # actor tasks run in submission order
        refs = self.actors[k].process.options(num_returns=len(items) + 1).remote(list(items), epoch, seed)
        # Released when the task really ends (result or failure), whoever reads it and whenever.
        refs[0].future().add_done_callback(lambda _f, k=k: self._release(k))
        return k, refs, probe

    @staticmethod
    def probe_ok(probe: ray.ObjectRef[Any] | None) -> bool:
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
        """Per actor: pid, node_id (the Ray node it runs on), samples processed, busy (wall) and CPU seconds
        inside `process`, since its last start, and its peak resident memory (`peak_rss_bytes`)."""
        return ray.get([a.stats.remote() for a in self.actors], timeout=timeout)

    def actor_nodes(self, timeout: float = 10.0) -> list[str]:
        """The Ray node id each actor runs on now (a restarted actor may have moved)."""
        return [s["node_id"] for s in self.stats(timeout)]

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
