"""Prometheus metrics of the coordinator and the rank services (served over HTTP by `_metrics_http`).

Each service instance owns one `CollectorRegistry` (never prometheus_client's global one: tests and
the demo run several services in one process, and a global registry would refuse the second set of
names). `CoordinatorMetrics` and `RankMetrics` hold the metric objects; the services call their
`observe_*` methods at round boundaries, and `start_metrics_server` serves a registry over HTTP.

Cost and honesty trade-offs:
- Updates happen once per round, not per batch: a round adds a handful of `inc`/`observe` calls
  (each one small lock inside prometheus_client) and no lock of ours on the protocol path. Values
  that are cheap to read live (ready batches, window depth, job state, rates over a sliding window,
  padding efficiency) are computed at scrape time from plain attributes, so the hot path does not
  touch them at all.
- "Emitted" means collated and queued for the trainer (what the trainer then receives, in order). A
  restarted rank service starts its counters at zero, as Prometheus counters do; the batches it replays
  from its journal are not counted again.
- Padded (materialized) tokens are the `input_ids` elements of emitted non-IDLE batches: rows x
  longest for `padded` collation, the packed sum for `packed`. The 1-token dummy of an IDLE step is
  not counted (it carries no sample), so padding efficiency is real / materialized over real steps.
- Rank imbalance is measured in the job's cost model (what the policies balance), not wall time: for
  each aligned step, the slowest rank's cost over the mean cost of all ranks (IDLE ranks cost 0);
  `batchd_rank_imbalance` is sum(max) / sum(mean) over the steps of the last round that had steps,
  1.0 = perfectly balanced. The two sums are also exported as counters, so any time range's ratio is
  `rate(batchd_job_step_cost_max_total) / rate(batchd_job_step_cost_mean_total)`.
- Names that the coordinator and the ranks would both export with different meanings are kept apart:
  the coordinator's job-wide counts are `batchd_job_*`, so summing a scrape of every party never
  double-counts.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, StateSetMetricFamily

from batchd.core import CostModel

log = logging.getLogger("batchd.metrics")

# Round-latency buckets: from 0.5 ms (every party in one process) to 120 s (a round lasts as long as its
# slowest rank's trainer needs). Measured latencies: docs/benchmarks.md (Alignment round latency).
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    math.inf,
)
JOB_STATES = ("running", "done", "failed")
DEFAULT_RATE_WINDOW_S = 10.0


def materialized_tokens(batch: Any) -> int:
    """Elements of a `pb.Batch`'s `input_ids` tensor (rows x columns), 0 if it has none."""
    for t in batch.tensors:
        if t.name == "input_ids":
            return math.prod(t.shape)
    return 0


class RateWindow:
    """Per-second rates of a few summed quantities over a sliding time window.

    One thread `add`s (the rank loop, once per round); any thread reads `rates` (the scrape). The
    span is `min(window_s, now - start)`, so a service younger than the window is not under-reported.

    Args:
        width: How many quantities each event carries.
        window_s: The window, in seconds.
        clock: Monotonic clock in seconds (tests pass their own).
    """

    def __init__(
        self, width: int, window_s: float = DEFAULT_RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width=}")
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s=}")
        self.width, self.window_s, self._clock = width, window_s, clock
        self._start = clock()
        self._events: collections.deque[tuple[float, tuple[float, ...]]] = collections.deque()

    def add(self, *values: float) -> None:
        """Records `values` (one per quantity) now and drops events older than the window."""
        if len(values) != self.width:
            raise ValueError(f"expected {self.width} values, got {values=}")
        now = self._clock()
        self._events.append((now, values))
        horizon = now - self.window_s
        while self._events and self._events[0][0] < horizon:
            self._events.popleft()

    def _snapshot(self) -> tuple[tuple[float, tuple[float, ...]], ...]:
        for _ in range(10):  # tuple(deque) runs in C under the GIL; the retry is for other runtimes
            try:
                return tuple(self._events)
            except RuntimeError:
                continue
        return ()

    def rates(self) -> tuple[float, ...]:
        """Sum of each quantity over the window, per second."""
        now = self._clock()
        span = min(self.window_s, now - self._start)
        if span <= 0:
            return (0.0,) * self.width
        horizon = now - self.window_s
        sums = [0.0] * self.width
        for t, values in self._snapshot():
            if t >= horizon:
                for i, v in enumerate(values):
                    sums[i] += v
        return tuple(s / span for s in sums)


class RankMetrics:
    """Metrics of one rank service (label `rank` on every series).

    The rank loop calls `observe_round` once per round, `observe_output_wait` after waiting for a free
    output slot and `observe_quarantine` after filling its window; the `Ingest` handler calls
    `ingest_quarantined`. `bind` gives the scrape-time gauges their live values.

    Args:
        rank: The service's rank.
        registry: Where to register; a fresh `CollectorRegistry` when None.
        rate_window_s: Window of the per-second gauges.
        clock: Monotonic clock for the rates (tests pass their own).
    """

    def __init__(
        self,
        rank: int,
        registry: CollectorRegistry | None = None,
        rate_window_s: float = DEFAULT_RATE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank=}")
        self.rank = rank
        self.registry = registry if registry is not None else CollectorRegistry()
        r, lbl = self.registry, {"rank": str(rank)}

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["rank"], registry=r).labels(**lbl)

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> Any:
            g = Gauge(name, doc, ["rank"], registry=r).labels(**lbl)
            g.set_function(fn)
            return g

        self.samples = counter("batchd_samples_total", "Samples in batches emitted to the trainer.")
        self.real_tokens = counter("batchd_real_tokens_total", "Sample tokens in emitted batches.")
        self.padded_tokens = counter(
            "batchd_padded_tokens_total",
            "Materialized tokens (input_ids elements) of emitted non-IDLE batches, padding included.",
        )
        self.steps = counter("batchd_steps_total", "Steps emitted to the trainer, IDLE steps included.")
        self.idle_steps = counter("batchd_idle_steps_total", "IDLE steps (no sample on this rank) emitted.")
        self.rounds = counter("batchd_rounds_total", "Alignment rounds completed by this rank.")
        self.output_wait = counter(
            "batchd_output_wait_seconds_total",
            "Time the rank loop waited for the trainer to free an output slot.",
        )
        self.round_latency = Histogram(
            "batchd_round_latency_seconds",
            "Report -> decision -> commit round trip of one alignment round, "
            "as seen by this rank (includes waiting for the other ranks).",
            ["rank"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        ).labels(**lbl)
        self._rates = RateWindow(3, rate_window_s, clock)
        self._totals = (0, 0)  # (real, padded), replaced as one tuple so a scrape sees a consistent pair
        self._buffer_fn: Callable[[], int] = lambda: 0
        self._ready_fn: Callable[[], int] = lambda: 0
        self._epoch_fn: Callable[[], int] = lambda: 0
        gauge(
            "batchd_padding_efficiency",
            "Real / materialized tokens of the emitted non-IDLE batches "
            "(cumulative; 1.0 = no padding; 0 before the first batch).",
            self._efficiency,
        )
        gauge("batchd_buffer_depth", "Samples in the rank's window now.", lambda: self._buffer_fn())
        gauge(
            "batchd_ready_batches",
            "Collated batches held for the trainer, not yet acknowledged (filled output slots).",
            lambda: self._ready_fn(),
        )
        gauge("batchd_rank_epoch", "The epoch this rank service is in (0-based).", lambda: self._epoch_fn())
        self._quarantine_snapshot: dict[str, int] = {}
        self._ingest_quarantined = 0
        self._ingest_lock = threading.Lock()
        self.registry.register(_QuarantineCollector(self))
        self.registry.register(_RateCollector(self))

    def bind(
        self,
        buffer_depth: Callable[[], int],
        ready_batches: Callable[[], int],
        epoch: Callable[[], int] = lambda: 0,
    ) -> None:
        """Sets the live readers of the window depth, the ready-batch count and the epoch (read at scrape
        time)."""
        self._buffer_fn, self._ready_fn, self._epoch_fn = buffer_depth, ready_batches, epoch

    def _efficiency(self) -> float:
        real, padded = self._totals
        return real / padded if padded else 0.0

    def observe_round(self, latency_s: float, infos: Iterable[Any], materialized: Iterable[int]) -> None:
        """Counts one completed round: its latency and its emitted steps.

        Args:
            latency_s: Seconds from sending the report to receiving the commit totals.
            infos: The `StepInfo` of each emitted step.
            materialized: For each step, its batch's materialized tokens (`materialized_tokens`).
        """
        steps = idle = samples = real = padded = 0
        for info, mat in zip(infos, materialized, strict=True):
            steps += 1
            if info.is_idle:
                idle += 1
                continue
            samples += info.local_samples
            real += info.local_tokens
            padded += mat
        self.rounds.inc()
        self.round_latency.observe(latency_s)
        if steps:
            self.steps.inc(steps)
            if idle:
                self.idle_steps.inc(idle)
            if samples:
                self.samples.inc(samples)
                self.real_tokens.inc(real)
                self.padded_tokens.inc(padded)
                r, p = self._totals
                self._totals = (r + real, p + padded)
        self._rates.add(samples, real, padded)

    def observe_output_wait(self, seconds: float) -> None:
        """Adds time the loop spent waiting for the trainer to consume batches."""
        if seconds > 0:
            self.output_wait.inc(seconds)

    def observe_quarantine(self, source_reasons: Mapping[str, int] | None, rejected: int) -> None:
        """Records the quarantine counts: the source's per-reason counts and the over-budget rejections.

        Called from the rank loop (the thread that polls the source), so reading the source's counters
        does not race with their updates.
        """
        snap = dict(source_reasons or {})
        if rejected:
            snap["over_budget"] = snap.get("over_budget", 0) + rejected
        self._quarantine_snapshot = snap

    def ingest_quarantined(self, n: int = 1) -> None:
        """Counts samples the `Ingest` handler refused as malformed (reason `invalid_ingest`)."""
        with self._ingest_lock:  # several Ingest streams may run at once; bad samples are rare
            self._ingest_quarantined += n

    def quarantined(self) -> dict[str, int]:
        """Quarantined records by reason, as the endpoint reports them."""
        out = dict(self._quarantine_snapshot)
        if self._ingest_quarantined:
            out["invalid_ingest"] = out.get("invalid_ingest", 0) + self._ingest_quarantined
        return out


class _RateCollector:
    """Yields the three per-second gauges from one pass over the window (one consistent time span)."""

    NAMES = (
        ("batchd_samples_per_second", "Samples emitted per second over the rate window."),
        ("batchd_real_tokens_per_second", "Sample tokens emitted per second over the rate window."),
        ("batchd_padded_tokens_per_second", "Materialized tokens emitted per second over the rate window."),
    )

    def __init__(self, metrics: RankMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(name, "", labels=["rank"]) for name, _ in self.NAMES]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        for (name, doc), rate in zip(self.NAMES, self.m._rates.rates(), strict=False):
            fam = GaugeMetricFamily(name, doc, labels=["rank"])
            fam.add_metric([str(self.m.rank)], rate)
            yield fam


class _QuarantineCollector:
    """Yields `batchd_quarantined_total{rank, reason}` from the rank's latest snapshot."""

    def __init__(self, metrics: RankMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily("batchd_quarantined", "", labels=["rank", "reason"])]

    def collect(self) -> Iterable[CounterMetricFamily]:
        fam = CounterMetricFamily(
            "batchd_quarantined",
            "Records quarantined instead of batched, by reason (source preprocessing "
            "errors, malformed Ingest samples, over-budget samples under --over-budget reject).",
            labels=["rank", "reason"],
        )
        for reason, n in sorted(self.m.quarantined().items()):
            fam.add_metric([str(self.m.rank), reason], n)
        yield fam


class CoordinatorMetrics:
    """Metrics of the alignment coordinator (job-wide counts are `batchd_job_*`).

    `CoordinatorState` calls `observe_decision` when the last report of a round arrives and
    `observe_commit` when the last commit does; `bind` gives the scrape-time gauges (job state, epoch,
    registered ranks) their live values.

    Args:
        world_size: Ranks in the job (the per-rank series are created for each, at zero).
        cost: The job's cost model (rank imbalance and per-rank cost are in its units).
        registry: Where to register; a fresh `CollectorRegistry` when None.
    """

    def __init__(
        self, world_size: int, cost: CostModel | None = None, registry: CollectorRegistry | None = None
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size=}")
        self.world_size = world_size
        self.cost = cost or CostModel()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rounds = Counter(
            "batchd_job_rounds_total", "Alignment rounds committed.", registry=self.registry
        )
        self._register_moves(self.registry)
        self._register_counts(self.registry)
        self._register_costs(self.registry, world_size)
        self._register_latencies(self.registry)
        self._state_fn: Callable[[], str] = lambda: "running"
        self._epoch_fn: Callable[[], int] = lambda: 0
        self._registered_fn: Callable[[], int] = lambda: 0
        self.registry.register(_JobCollector(self))

    def _register_moves(self, r: CollectorRegistry) -> None:
        """Samples a balanced plan moved and images a two-phase step exchanged, by scope."""
        moved = Counter(
            "batchd_job_moved_samples_total",
            "Samples a balanced plan placed off their home rank, "
            "by scope: intra_node (handed over in process by a node agent) or cross_node.",
            ["scope"],
            registry=r,
        )
        moved_b = Counter(
            "batchd_job_moved_bytes_total", "Payload bytes of those samples, by scope.", ["scope"], registry=r
        )
        self._moved = {
            scope: (moved.labels(scope=scope), moved_b.labels(scope=scope))
            for scope in ("intra_node", "cross_node")
        }
        exch = Counter(
            "batchd_job_exchanged_images_total",
            "Two-phase steps: images encoded on another rank than "
            "their sample's (their embeddings cross in the step's all-to-all), by scope.",
            ["scope"],
            registry=r,
        )
        exch_rows = Counter(
            "batchd_job_exchanged_rows_total",
            "Embedding rows (image tokens) of those images, by scope.",
            ["scope"],
            registry=r,
        )
        self._exchanged = {
            scope: (exch.labels(scope=scope), exch_rows.labels(scope=scope))
            for scope in ("intra_node", "cross_node")
        }
        clips = Counter(
            "batchd_job_exchanged_clips_total",
            "Steps with the audio phase balanced: audio clips encoded on another rank than their sample's, "
            "by scope.",
            ["scope"],
            registry=r,
        )
        clip_rows = Counter(
            "batchd_job_exchanged_clip_rows_total",
            "Embedding rows (audio tokens) of those clips, by scope.",
            ["scope"],
            registry=r,
        )
        self._exchanged_audio = {
            scope: (clips.labels(scope=scope), clip_rows.labels(scope=scope))
            for scope in ("intra_node", "cross_node")
        }

    def _register_counts(self, r: CollectorRegistry) -> None:
        """The job-wide counts of the committed steps, their samples and sample tokens."""
        self.steps = Counter(
            "batchd_job_steps_total", "Aligned steps kept (one per step, not per rank).", registry=r
        )
        self.samples = Counter(
            "batchd_job_samples_total", "Samples in the committed steps, all ranks.", registry=r
        )
        self.real_tokens = Counter(
            "batchd_job_real_tokens_total", "Sample tokens in the committed steps, all ranks.", registry=r
        )

    def _register_costs(self, r: CollectorRegistry, world_size: int) -> None:
        """Per-rank IDLE steps and costs (created at zero for every rank), and the rank imbalance."""
        idle = Counter(
            "batchd_job_idle_steps_total", "IDLE steps (no sample on that rank).", ["rank"], registry=r
        )
        cost_c = Counter(
            "batchd_job_rank_cost_total",
            "Cost-model cost of the rank's committed steps.",
            ["rank"],
            registry=r,
        )
        self.idle_steps = [idle.labels(rank=str(k)) for k in range(world_size)]
        self.rank_cost = [cost_c.labels(rank=str(k)) for k in range(world_size)]
        self.step_cost_max = Counter(
            "batchd_job_step_cost_max_total", "Sum over steps of the slowest rank's cost.", registry=r
        )
        self.step_cost_mean = Counter(
            "batchd_job_step_cost_mean_total",
            "Sum over steps of the mean rank cost (IDLE ranks count 0).",
            registry=r,
        )
        self.imbalance = Gauge(
            "batchd_rank_imbalance",
            "Last round with steps: sum of the slowest rank's step "
            "cost / sum of the mean rank step cost (1.0 = balanced).",
            registry=r,
        )

    def _register_latencies(self, r: CollectorRegistry) -> None:
        """The histograms of a round's alignment latency, barrier wait and duration."""
        self.align_latency = Histogram(
            "batchd_align_latency_seconds",
            "From the last rank's report to the round's decision.",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.barrier_wait = Histogram(
            "batchd_align_barrier_wait_seconds",
            "From a round's first report to its last (waiting for stragglers).",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.round_duration = Histogram(
            "batchd_align_round_seconds",
            "From a round's first report to its last commit.",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )

    def bind(self, state: Callable[[], str], epoch: Callable[[], int], registered: Callable[[], int]) -> None:
        """Sets the live readers of the job state, the epoch and the number of registered ranks."""
        self._state_fn, self._epoch_fn, self._registered_fn = state, epoch, registered

    def observe_decision(self, barrier_wait_s: float, decide_s: float) -> None:
        """One decided round: how long its barrier waited for reports, and how long the decision took."""
        self.barrier_wait.observe(barrier_wait_s)
        self.align_latency.observe(decide_s)

    def observe_exchanges(self, counts: dict[str, int], audio: bool = False) -> None:
        """One round's vision exchanges (`batchd.core.exchanged`, summed over its steps); with `audio`, its
        audio exchanges (the same counts, of clips)."""
        for scope, (images, rows) in (self._exchanged_audio if audio else self._exchanged).items():
            images.inc(counts[f"{scope}_images"])
            rows.inc(counts[f"{scope}_rows"])

    def observe_moves(self, moves: dict[str, int]) -> None:
        """One balanced plan's moves (`batchd.core.plan_moves`)."""
        for scope, (samples, nbytes) in self._moved.items():
            samples.inc(moves[f"{scope}_samples"])
            nbytes.inc(moves[f"{scope}_bytes"])

    def observe_commit(self, commits: Sequence[Any], totals: Any, round_s: float) -> None:
        """One committed round.

        Args:
            commits: The ranks' `RankCommit`s (any order).
            totals: The round's `RoundTotals` (its `steps` and `keep_last` cut apply).
            round_s: Seconds from the round's first report to its last commit.
        """
        self.rounds.inc()
        self.round_duration.observe(round_s)
        n = totals.steps
        if n <= 0:
            return
        by_rank = sorted(commits, key=lambda c: c.rank)
        cost = self.cost.cost
        idle = [0] * len(by_rank)
        rank_cost = [0.0] * len(by_rank)
        sum_max = sum_mean = 0.0
        for s in range(n):
            row = []
            for k, c in enumerate(by_rank):
                group = c.steps[s] if s < len(c.steps) else ()  # an epoch's closing IDLE step
                if totals.keep_last is not None and s == n - 1:
                    group = group[: totals.keep_last[c.rank]]
                if not group:
                    idle[k] += 1
                    row.append(0.0)
                    continue
                x = cost([length for length, _ in group])
                rank_cost[k] += x
                row.append(x)
            sum_max += max(row)
            sum_mean += sum(row) / len(row)
        self.steps.inc(n)
        self.samples.inc(sum(totals.step_samples))
        self.real_tokens.inc(sum(totals.step_tokens))
        for c, k_idle, k_cost in zip(by_rank, idle, rank_cost, strict=False):
            if k_idle:
                self.idle_steps[c.rank].inc(k_idle)
            if k_cost:
                self.rank_cost[c.rank].inc(k_cost)
        self.step_cost_max.inc(sum_max)
        self.step_cost_mean.inc(sum_mean)
        if sum_mean > 0:
            self.imbalance.set(sum_max / sum_mean)


class _JobCollector:
    """Yields the coordinator's live gauges: job state, epoch, registered ranks."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[Any]:
        return [
            StateSetMetricFamily("batchd_job_state", "", {}),
            GaugeMetricFamily("batchd_job_epoch", ""),
            GaugeMetricFamily("batchd_ranks_registered", ""),
        ]

    def collect(self) -> Iterable[Any]:
        state = self.m._state_fn()
        yield StateSetMetricFamily(
            "batchd_job_state",
            "The job's state (one of running, done, failed is 1).",
            {s: s == state for s in JOB_STATES},
        )
        yield GaugeMetricFamily(
            "batchd_job_epoch", "The epoch the coordinator is in.", value=self.m._epoch_fn()
        )
        yield GaugeMetricFamily(
            "batchd_ranks_registered",
            "Ranks that have registered with the coordinator.",
            value=self.m._registered_fn(),
        )
