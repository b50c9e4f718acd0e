"""A resized job: the coordinator restarted on its state dir with another world size (`--resize`).

1. `batchd coordinator --resize`, the new world size W' and the old state dir: the journal's job must
   differ from the command's in `world_size` only (another field is refused, naming it; a different world
   size without `--resize` is refused, naming the flag: a typo cannot resize a job). The old state is
   restored at its world size W, then the job becomes resize generation g + 1 (`begin`): the
   registrations, finishes, the failure (the lost party's) and the replay tables are dropped, the
   epoch's step ledger is kept, and the journal is rewritten with the new job in its header and a
   `resize` record, atomically: a coordinator killed after this restarts resized.
2. The ranks of the new size register (`RegisterReply.generation`, `resume_needed`) and each says at
   which (epoch, step) its trainer resumes (`Resume`, from its checkpoint). The first one fixes S
   (`resume`): S must end an optimizer update and lie within the ledger (`batchd.core.resume_point`),
   else FAILED_PRECONDITION names why; the epoch's protocol core at W' starts at round R0 from S, the
   update windows replayed; the `resize` record is journaled again with its step. Every later Resume
   must name the same position. A trainer that took the end of the epoch resumes the next epoch at
   step 0: it starts whole at W'; at the end of the job's last epoch only that end is left (`job_end`:
   the ranks hand it to their trainers and finish). Aligning before the resize is resumed is refused.
3. `restore` (a restart of a resized coordinator) rebuilds the resize from its journal record: the
   core of the new size at R0 when no round was committed since (later rounds' totals carry the core).

The seam with `CoordinatorState`: these are functions over explicit values (the resize, the spec, where
the job is); what a step changes comes back as a `Position` (epoch and protocol core) that the state
installs, and the state alone forgets parties, journals and compacts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from batchd.core import Coordinator, JobSpec, ProtocolError, Remainder, StepLedger, resume_point

from .._journal import JournalError, decode_records
from . import _recovery as recovery
from ._answers import Resumed

log = logging.getLogger("batchd.coordinator")


def journal_job(path: Path) -> dict[str, Any] | None:
    """The job named in the header of the journal at `path`, or None (no journal, or no header)."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    with open(path, "rb") as fh:
        records, _, _ = decode_records(fh.readline())
    return dict(records[0].get("job") or {}) if records and records[0].get("kind") == "header" else None


def resize_from(path: Path, job: dict[str, Any], resize: bool) -> JobSpec | None:
    """The job spec the journal at `path` ran with when this command resizes it (`resize` and the job
    differs in world_size only), else None (no journal, or the same job). Raises JournalError when the
    jobs differ otherwise, or in world_size without `resize`."""
    theirs = journal_job(path)
    if theirs is None or theirs == job:
        return None
    diff = sorted(k for k in set(theirs) | set(job) if theirs.get(k) != job.get(k))
    if diff == ["world_size"]:
        if resize:
            return JobSpec.from_keys(**theirs)
        raise JournalError(
            f"{path}: the job ran at world_size {theirs['world_size']}, this command says "
            f"{job['world_size']}; to go on at {job['world_size']} ranks from the trainers' checkpoint, "
            f"restart the coordinator with --resize"
        )
    if resize:
        detail = ", ".join(
            f"{k}: journal {theirs.get(k)!r}, this job {job.get(k)!r}" for k in diff if k != "world_size"
        )
        raise JournalError(
            f"{path}: cannot resize: a resize changes world_size only, this job also changes {detail}"
        )
    return None  # Journal.open refuses it, naming every field


@dataclasses.dataclass
class ResizeState:
    """A resize of the job (module docstring): generation, world sizes, the epoch it happened in and its
    ledger, the first round at the new size, and S once fixed (None: pending)."""

    generation: int
    old_world: int
    world: int
    epoch: int
    round: int
    epoch_done: bool
    ledger: StepLedger
    step: int | None = None
    next_epoch: bool = False  # S fixed at the epoch's end: the next epoch starts whole
    job_end: bool = False  # S fixed at the end of the job's last epoch: only its end is left to take
    remainder: Remainder | None = None

    def record(self) -> dict[str, Any]:
        return {
            "kind": "resize",
            "generation": self.generation,
            "from": self.old_world,
            "to": self.world,
            "epoch": self.epoch,
            "round": self.round,
            "epoch_done": self.epoch_done,
            "step": self.step,
            "next_epoch": self.next_epoch,
            "job_end": self.job_end,
        }

    @staticmethod
    def from_record(rec: dict[str, Any], ledger: StepLedger | None) -> ResizeState:
        epoch = int(rec["epoch"])
        rs = ResizeState(
            int(rec["generation"]),
            int(rec["from"]),
            int(rec["to"]),
            epoch,
            int(rec["round"]),
            bool(rec["epoch_done"]),
            ledger if ledger is not None and ledger.epoch == epoch else StepLedger(epoch),
            None if rec.get("step") is None else int(rec["step"]),
            bool(rec.get("next_epoch", False)),
            bool(rec.get("job_end", False)),
        )
        if rs.step is not None and not rs.next_epoch and not rs.job_end:
            rs.remainder = Remainder(epoch, rs.step, rs.world, rs.generation, rs.ledger.consumed(rs.step))
        return rs

    @property
    def pending(self) -> bool:
        return self.step is None


@dataclasses.dataclass(frozen=True)
class Position:
    """What a resize step changes in the coordinator: the epoch and the protocol core it goes on with."""

    epoch: int
    core: Coordinator


def generation(rs: ResizeState | None) -> int:
    """Resizes of the job so far (`rs`: its newest resize, or None)."""
    return rs.generation if rs is not None else 0


def resume_needed(rs: ResizeState | None, at: tuple[int, int]) -> bool:
    """A fresh rank must Resume before its first round: the job was resized and, at `at` (its epoch and
    round now), has not gone past the first round at the new size."""
    if rs is None:
        return False
    return rs.pending or at == (position(rs)[0], first_round(rs))


def begin(
    old: JobSpec, new: JobSpec, generation: int, epoch: int, core: Coordinator
) -> tuple[ResizeState, Position]:
    """A resize to `new` of a job restored at `old`'s world size in `epoch` with protocol `core` (module
    docstring, step 1): the resize and the placeholder position the coordinator waits at until a rank
    resumes. The caller forgets the parties of the old size and journals the new job."""
    rs = ResizeState(
        generation, old.world_size, new.world_size, epoch, core.round + 1, core.done, core.ledger
    )
    budget = (
        f", token budget {old.token_budget} -> {new.token_budget} (an out-of-memory step)"
        if old.token_budget != new.token_budget
        else ""
    )
    log.warning(
        "job resized from %d to %d rank(s)%s (generation %d) in epoch %d after %d step(s)%s: the ranks "
        "resume at their trainers' checkpoint",
        old.world_size,
        new.world_size,
        budget,
        generation,
        rs.epoch,
        rs.ledger.steps,
        " (its last)" if rs.epoch_done else "",
    )
    return rs, Position(rs.epoch, placeholder(new, rs))


def placeholder(spec: JobSpec, rs: ResizeState) -> Coordinator:
    """The core while a resize is pending: the epoch at the new size, at its first round, not planning."""
    core = Coordinator(spec, rs.epoch)
    core.round = rs.round
    return core


def resume(
    rs: ResizeState | None,
    spec: JobSpec,
    at: tuple[int, int],
    rank: int,
    epoch: int,
    step: int,
    from_world: int,
) -> tuple[Resumed, Position | None]:
    """A rank's Resume (module docstring, step 2) of the job `spec` at `at` (its epoch and round now):
    where the job goes on (`Resumed`), and, when this Resume fixed S, the position the coordinator goes on
    from (then the caller journals `rs.record()`; `rs` holds S). Raises ProtocolError naming what cannot be
    resumed."""
    if rs is None:
        raise ProtocolError(f"rank {rank} asked to resume, but the job was never resized")
    if from_world and from_world != rs.old_world:
        raise ProtocolError(
            f"rank {rank}'s trainer resumes a state saved at world size {from_world}, but the job ran at "
            f"{rs.old_world} before it was resized to {rs.world}: another job's checkpoint"
        )
    moved = None
    if rs.pending:
        moved = fix(spec, rs, rank, epoch, step)
    elif (epoch, step) != position(rs):
        raise ProtocolError(
            f"rank {rank}'s trainer resumes epoch {epoch} at step {step}, but the resized job goes on from "
            f"epoch {position(rs)[0]} step {position(rs)[1]} (another rank's trainer resumed there): the "
            f"trainers must resume from the same checkpoint"
        )
    elif at != (position(rs)[0], first_round(rs)):
        raise ProtocolError(
            f"rank {rank} asks to resume the resized job, which has gone on past its first round: a rank "
            f"of it that lost its state cannot rejoin"
        )
    remainder = "" if rs.remainder is None else json.dumps(rs.remainder.to_json())
    epoch, step = position(rs)
    return Resumed(epoch, first_round(rs), step, remainder, rs.job_end, rs.generation), moved


def finished_core(spec: JobSpec, rs: ResizeState) -> Coordinator:
    """The core of the resize's epoch, the job's last, complete: no round is left to run."""
    core = placeholder(spec, rs)
    core.ledger, core.done = rs.ledger, True
    return core


def position(rs: ResizeState) -> tuple[int, int]:
    """(epoch, step) the resized job goes on from."""
    assert rs.step is not None
    return (rs.epoch + 1, 0) if rs.next_epoch else (rs.epoch, rs.step)


def first_round(rs: ResizeState) -> int:
    return 0 if rs.next_epoch else rs.round


def fix(spec: JobSpec, rs: ResizeState, rank: int, epoch: int, step: int) -> Position:
    """Fixes S in `rs` from the first Resume: the position of the new size the job goes on from."""
    whole_epoch_done = rs.epoch_done and step == rs.ledger.steps
    if epoch == rs.epoch + 1 and step == 0 and rs.epoch_done or (epoch == rs.epoch and whole_epoch_done):
        rs.step = rs.ledger.steps
        if rs.epoch + 1 >= spec.epochs:  # the job's last epoch is complete: its end is all there is left
            rs.job_end = True
            return Position(rs.epoch, finished_core(spec, rs))
        rs.next_epoch = True
        return Position(rs.epoch + 1, Coordinator(spec, rs.epoch + 1))
    if epoch == rs.epoch:
        try:
            point = resume_point(rs.ledger, step, spec.update_windows())
        except ValueError as exc:
            raise ProtocolError(f"rank {rank}: {exc}") from None
        core = Coordinator(spec, rs.epoch)
        rs.remainder = Remainder(rs.epoch, step, rs.world, rs.generation, rs.ledger.consumed(step))
        core.resume_at(point, rs.round, rs.ledger)
        rs.step = step
        return Position(rs.epoch, core)
    raise ProtocolError(
        f"rank {rank}'s trainer resumes epoch {epoch} at step {step}, but the job was resized in epoch "
        f"{rs.epoch}{' (done)' if rs.epoch_done else ''}: its checkpoint must be of that epoch, or "
        f"taken at its end"
    )


def log_fixed(rs: ResizeState, rank: int) -> None:
    """Says where the resized job goes on, once S is fixed and journaled."""
    log.warning(
        "resized job goes on at %d rank(s) from epoch %d step %d (rank %d's trainer)%s",
        rs.world,
        *position(rs),
        rank,
        "" if rs.remainder is None else f": {len(rs.remainder.consumed)} sample(s) consumed before it",
    )


def restore(
    recovered: recovery.Recovered, spec: JobSpec, now: Position
) -> tuple[ResizeState | None, Position]:
    """The resize a restarted coordinator rebuilds from the newest `resize` record of its journal (module
    docstring, step 3), and the position it goes on from (`now`, what the rounds' records restored, when
    no record says otherwise)."""
    if recovered.resize is None:
        return None, now
    rs = ResizeState.from_record(recovered.resize, recovered.ledger)
    if rs.pending:
        return rs, Position(rs.epoch, placeholder(spec, rs))
    epoch, rnd = position(rs)[0], first_round(rs)
    if (now.core.epoch, now.core.round) >= (epoch, rnd) and recovered.replay.core_state is not None:
        return rs, now  # rounds of the new size were committed: their totals restored the core
    if rs.next_epoch:
        return rs, Position(epoch, Coordinator(spec, epoch))
    if rs.job_end:
        return rs, Position(rs.epoch, finished_core(spec, rs))
    core = Coordinator(spec, rs.epoch)
    core.resume_at(resume_point(rs.ledger, position(rs)[1], spec.update_windows()), rnd, rs.ledger)
    return rs, Position(rs.epoch, core)
