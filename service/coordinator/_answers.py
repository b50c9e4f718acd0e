"""What `CoordinatorState` answers, in core types: a registration, a resize's resume point, the job's
status. The servicer turns them into protobuf replies (`_convert`); the state knows no wire format."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Registration:
    """Where the job is for a party that registered: `epoch`, `round`, every rank's address (`addresses`,
    empty until all registered), the lease (`lease_s`), the job's resize `generation` and whether a fresh
    rank must Resume before its first round (`resume_needed`, `_resize`), and the job's token budget
    when an out-of-memory step lowered it (`token_budget`; 0: the spec's)."""

    epoch: int
    round: int
    addresses: tuple[str, ...]
    lease_s: float
    generation: int
    resume_needed: bool
    token_budget: int = 0  # the job's budget when an out-of-memory step lowered it, else 0

    def __post_init__(self) -> None:
        if self.epoch < 0 or self.round < 0 or self.generation < 0 or not self.lease_s > 0:
            raise ValueError(
                f"a registration needs epoch, round, generation >= 0 and lease_s > 0, got "
                f"{self.epoch=} {self.round=} {self.generation=} {self.lease_s=}"
            )


@dataclasses.dataclass(frozen=True)
class Resumed:
    """Where a resized job goes on (`_resize.resume`): `epoch`, its first `round` and `step`, the
    epoch's remainder as JSON text ("" when none), whether only the job's end is left for the trainers
    (`job_end`) and the job's resize `generation`."""

    epoch: int
    round: int
    step: int
    remainder: str
    job_end: bool
    generation: int

    def __post_init__(self) -> None:
        if min(self.epoch, self.round, self.step) < 0 or self.generation < 1:
            raise ValueError(
                f"a resume point needs epoch, round, step >= 0 and generation >= 1, got {self.epoch=} "
                f"{self.round=} {self.step=} {self.generation=}"
            )


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """The job as `Status` reports it: `state` ("running", "done" or "failed"), the failure ("" when
    none), epoch and round, the registered and finished ranks (sorted) and the last rounds' latencies
    (ms, first report -> totals)."""

    state: str
    failure: str
    epoch: int
    round: int
    registered: tuple[int, ...]
    finished: tuple[int, ...]
    round_latency_ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.state not in ("running", "done", "failed"):
            raise ValueError(f"state must be running, done or failed, got {self.state=}")
