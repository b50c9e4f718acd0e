"""The plan of a chaos run (benchmarks/chaos.py): seeded jobs, each with the faults to inject and when.

A `JobPlan` is one job's settings (source, size, step time, world size, epochs, the rank services'
batching); a `Fault` is one party kill at a step, filled in by the run (injected, victim, recovery).
`plan_jobs` draws the jobs from a seed and `PlanOptions`.
"""

from __future__ import annotations

import dataclasses
import math
import random

KINDS = ("actor", "rank", "coordinator", "trainer", "trainer-gone")
DEFAULT_KINDS = ("actor", "rank", "coordinator", "trainer")
DATASET_CHOICES = ("auto", "always", "never")
UNRECOVERABLE = {"trainer-gone"}  # a job with such a fault must fail, naming the killed party
BUDGET, WINDOW, DEPTH = 1024, 32, 4
TRAIN_S = 40.0  # training time a job aims at (steps x step time), before faults and startup
SYNTH_TOKENS_PER_SAMPLE = 66  # demo_lengths(longest=512)'s mean, for the step estimate
DATASET_TOKENS_PER_RECORD = 160  # the demo dataset with 64-pixel images (measured), for the step estimate


@dataclasses.dataclass
class Fault:
    kind: str
    at_step: int  # when every rank has logged this many steps (summed over epochs)
    target: int | None = None  # rank (rank, trainer, trainer-gone); None: drawn at injection
    # filled in by the run:
    injected: bool = False
    t_s: float | None = None  # seconds after the trainers first started
    victim: str = ""
    note: str = ""
    recovered_s: float | None = None  # until the restarted party listens again (or the actor is back)


@dataclasses.dataclass
class JobPlan:
    index: int
    seed: int
    source: str  # "synthetic" | "dataset"
    num_samples: int  # samples (synthetic) or records (dataset)
    step_time: float
    faults: list[Fault]
    world_size: int = 2
    epochs: int = 2
    policy: str = "balanced"
    budget: int = BUDGET
    window: int = WINDOW
    depth: int = DEPTH
    client_grace: float | None = None  # rank services' --client-grace (None: theirs, 600 s)
    checkpoint_every: int = 5  # the trainers' --checkpoint-every

    def est_steps(self) -> int:
        """A rough number of steps of the whole job (for placing the faults)."""
        per = SYNTH_TOKENS_PER_SAMPLE if self.source == "synthetic" else DATASET_TOKENS_PER_RECORD
        return self.epochs * max(
            1, math.ceil(self.num_samples * per / (self.world_size * self.budget * 0.85))
        )


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """How `plan_jobs` draws its jobs: step times log-uniform in [min_step_time, max_step_time] seconds,
    `faults_per_job` faults each, `world_size` ranks, `epochs` epochs, a size that trains about `train_s`
    seconds, and which jobs read the dataset (`dataset`: "auto", "always" or "never")."""

    min_step_time: float = 0.01
    max_step_time: float = 5.0
    faults_per_job: int = 1
    world_size: int = 2
    epochs: int = 2
    train_s: float = TRAIN_S
    dataset: str = "auto"

    def __post_init__(self) -> None:
        if not 0 < self.min_step_time <= self.max_step_time:
            raise ValueError(
                f"need 0 < min_step_time <= max_step_time: {self.min_step_time=} {self.max_step_time=}"
            )
        if self.faults_per_job < 1 or self.world_size < 1 or self.epochs < 1:
            raise ValueError(f"need >= 1: {self.faults_per_job=} {self.world_size=} {self.epochs=}")
        if self.train_s <= 0:
            raise ValueError(f"need a positive {self.train_s=}")
        if self.dataset not in DATASET_CHOICES:
            raise ValueError(f"dataset is one of {DATASET_CHOICES}: {self.dataset=}")


def _source(dataset: str, index: int, kinds: list[str]) -> str:
    """A job with an `actor` fault reads the dataset (it has actors); the others as `dataset` says
    ("auto": every other job)."""
    if dataset == "always" or "actor" in kinds:
        return "dataset"
    if dataset == "never":
        return "synthetic"
    return "dataset" if index % 2 == 1 else "synthetic"


def plan_jobs(n: int, seed: int, kinds: list[str], options: PlanOptions | None = None) -> list[JobPlan]:
    """`n` seeded jobs. Fault kinds go round a seeded order of `kinds`, so each kind is drawn about
    equally often; a job with an `actor` fault reads the dataset (it has actors), the others alternate
    (`options.dataset`: "auto", "always" or "never"). Step times are log-uniform in [min, max]; a job's size
    is set so that its steps take about `options.train_s` seconds (64..400 synthetic samples, 48..160
    records)."""
    o = options or PlanOptions()
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    plans = []
    for i in range(n):
        jk = [order[(i * o.faults_per_job + k) % len(order)] for k in range(o.faults_per_job)]
        step_time = math.exp(rng.uniform(math.log(o.min_step_time), math.log(o.max_step_time)))
        source = _source(o.dataset, i, jk)
        steps_per_epoch = min(max(round(o.train_s / (o.epochs * max(step_time, 0.05))), 3), 24)
        tokens = steps_per_epoch * o.world_size * BUDGET * 0.85
        if source == "synthetic":
            num = min(max(int(tokens / SYNTH_TOKENS_PER_SAMPLE), 64), 400)
        else:
            num = min(max(int(tokens / DATASET_TOKENS_PER_RECORD), 48), 160)
        plan = JobPlan(
            i, rng.randrange(1 << 16), source, num, round(step_time, 3), [], o.world_size, o.epochs
        )
        est = plan.est_steps()
        # distinct trigger points in 10%..70% of the estimated job, in order; at least one step done
        points = sorted(
            rng.sample(
                range(max(1, int(0.1 * est)), max(2, int(0.7 * est)) + o.faults_per_job), o.faults_per_job
            )
        )
        plan.faults = [Fault(kind, at) for kind, at in zip(jk, points, strict=False)]
        if "trainer-gone" in jk and "trainer" not in jk:  # fail within seconds, as tests/test_multiprocess.py
            plan.client_grace = 3.0
        plans.append(plan)
    return plans
