"""The rank journal: what a restarted rank service resumes from.

With `state_dir`, a rank service rewrites one JSON object, `rank-{rank}.json` (`JOURNAL`), whole and
atomically (a temporary file, fsynced, renamed over the old one) after every round, and after every fill,
before the round's report. It is metadata only: the rank state, the source position, the steps the trainer
has not acknowledged. A restarted service is built from its record (`load_journal` parses it into a
`JournalRecord`; `RankServiceCore` restores itself from that), re-materializes the payloads by id
(`SyntheticSource`, `RaySource`; see `batchd.service.preprocess`), re-collates the unacknowledged steps,
re-registers and resends its report: the coordinator replays rounds that were already decided, so nothing
is lost or duplicated.

Format (version `JOURNAL_VERSION`, every key of `JOURNAL_KEYS` required, of its type, no other key):
`delivery` (`core.Delivery.state_dict`), `rank` (`core.RankState.state_dict`), `source` (the source's
`state_dict`), `ready` (the held steps of this epoch: consumed ones the floor keeps for a rewind, then
the unacknowledged ones; `Step.to_json`), `past` (the held steps of epochs before this one, by epoch),
`rejected_before` (over-budget rejections of the
epochs before this one), `finish_acked` (the coordinator took this rank's Finish), `resize` (the job's
resize generation the state is of, and that resize's remainder, which a restored source reads again) and
`filled`: the buffer
is the one this rank reports (or reported) for its current round; a restored rank reports it again without
filling, so a round the coordinator decided before a crash is replayed on exactly the buffer it was
decided on (a source whose readiness depends on timing, like a RaySource, would fill it differently).

This is not the append-only record journal of `batchd.service.Journal` (the coordinator's): the rank's
state is small and replaced whole every round, so one object rewritten atomically is all it needs.
Cost: one JSON encode and one fsync per round and per fill; a restore makes every payload it needs in one
`Source.materialize_many` call (`remake`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from batchd.core import Remainder, Step

from ..preprocess import Payload, Source
from ._payloads import materialize_many

log = logging.getLogger("batchd.rank")


JOURNAL = "rank-{rank}.json"
JOURNAL_VERSION = 5
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
J_RESIZE = "resize"  # {"generation": the job's resizes this state is of, "remainder": Remainder JSON or null}
J_PAST = "past"  # {"epoch": [held steps of that epoch, Step JSON]} for epochs before this one
JOURNAL_KEYS = {
    J_VERSION: int,
    J_DELIVERY: dict,
    J_RANK: dict,
    J_SOURCE: dict,
    J_READY: list,
    J_REJECTED_BEFORE: int,
    J_FINISH_ACKED: bool,
    J_FILLED: bool,
    J_RESIZE: dict,
    J_PAST: dict,
}  # every key required, this type


def journal_path(state_dir: str | os.PathLike[str] | None, rank: int) -> Path | None:
    """Rank `rank`'s journal in `state_dir` (created if missing: a bad directory fails at startup rather
    than mid-round at the first journal); None without a `state_dir`."""
    if not state_dir:
        return None
    path = Path(state_dir) / JOURNAL.format(rank=rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def read_journal(path: str | os.PathLike[str]) -> dict[str, Any]:
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


@dataclasses.dataclass(frozen=True)
class JournalRecord:
    """One rank journal, parsed (the format: module docstring). `delivery`, `rank` and `source` are their
    owners' `state_dict`s (checked when loaded); `ready` the held steps of this epoch, `past` those of
    earlier epochs by epoch; `finish_acked`, `filled`, `generation` and `remainder` as `J_FINISH_ACKED`,
    `J_FILLED` and `J_RESIZE` say."""

    delivery: dict[str, Any]
    rank: dict[str, Any]
    source: dict[str, Any]
    ready: tuple[Step, ...]
    past: dict[int, tuple[Step, ...]]
    rejected_before: int
    finish_acked: bool
    filled: bool
    generation: int
    remainder: Remainder | None

    def __post_init__(self) -> None:
        if self.rejected_before < 0 or self.generation < 0:
            raise ValueError(
                f"a rank journal needs rejected_before, generation >= 0, got {self.rejected_before=} "
                f"{self.generation=}"
            )

    @staticmethod
    def from_json(state: Mapping[str, Any]) -> JournalRecord:
        """The record of a journal object `read_journal` checked. Raises ValueError or KeyError on a
        malformed nested value."""
        resize = state[J_RESIZE]
        return JournalRecord(
            delivery=state[J_DELIVERY],
            rank=state[J_RANK],
            source=state[J_SOURCE],
            ready=tuple(Step.from_json(j) for j in state[J_READY]),
            past={int(q): tuple(Step.from_json(j) for j in steps) for q, steps in state[J_PAST].items()},
            rejected_before=state[J_REJECTED_BEFORE],
            finish_acked=state[J_FINISH_ACKED],
            filled=state[J_FILLED],
            generation=int(resize["generation"]),
            remainder=Remainder.from_json(resize["remainder"]) if resize.get("remainder") else None,
        )

    def to_json(self) -> dict[str, Any]:
        """The journal object (`JOURNAL_VERSION`): what `write_journal` writes."""
        return {
            J_VERSION: JOURNAL_VERSION,
            J_DELIVERY: self.delivery,
            J_RANK: self.rank,
            J_SOURCE: self.source,
            J_READY: [step.to_json() for step in self.ready],
            J_PAST: {str(q): [step.to_json() for step in steps] for q, steps in self.past.items()},
            J_REJECTED_BEFORE: self.rejected_before,
            J_FINISH_ACKED: self.finish_acked,
            J_FILLED: self.filled,
            J_RESIZE: {
                "generation": self.generation,
                "remainder": self.remainder.to_json() if self.remainder is not None else None,
            },
        }


def load_journal(path: Path, rank: int, world_size: int) -> JournalRecord | None:
    """The record a rank service of `rank` at `world_size` restores from (`RankServiceCore`), or None
    when the journal at `path` is of a job at another world size (the job was resized since): the rank
    then starts empty and resumes where the coordinator says (`RankServiceCore._resume`).

    Raises:
        ValueError: naming the file and why (`read_journal`; a malformed state).
    """
    state = read_journal(path)
    saved_world = state[J_RANK].get("world_size")
    if saved_world != world_size and state[J_RANK].get("rank") == rank:  # a resized job
        log.warning(
            "rank %d: %s is of a job at world size %s; this one runs at %d (a resize): not restored, the "
            "rank resumes where the coordinator says",
            rank,
            path,
            saved_world,
            world_size,
        )
        return None
    try:
        return JournalRecord.from_json(state)
    except (ValueError, KeyError) as exc:
        raise restore_error(path, rank, exc) from exc


def restore_error(path: Path, rank: int, exc: Exception) -> ValueError:
    """The error of a journal whose states do not fit this job, rank or configuration."""
    return ValueError(f"{path}: cannot resume rank {rank} from this journal: {type(exc).__name__}: {exc}")


def write_journal(path: Path, record: dict[str, Any]) -> None:
    """Replaces the journal at `path` by `record`, atomically (a temporary file, fsynced, renamed)."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(record))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


Collate = Callable[[Step, list[Payload], list[Payload] | None, list[Payload] | None, int], Any]


def remake(
    source: Source, steps: Sequence[Step], ids: list[int], epoch: int, collate: Collate
) -> tuple[dict[int, Payload], list[Any]]:
    """Re-makes the payloads of `ids` and of `steps` (their samples, the images and clips they encode) in
    one `materialize_many` call of `source` (in `epoch`), and collates each step with `collate` (step,
    payloads, images, clips, epoch): (payloads by id, the steps' batches in order)."""
    wanted = list(
        dict.fromkeys(
            [
                *ids,
                *(s.id for st in steps for s in st.samples),
                *(im.sample_id for st in steps if st.exchange is not None for im in st.exchange.encode),
                *(
                    c.sample_id
                    for st in steps
                    if st.audio_exchange is not None
                    for c in st.audio_exchange.encode
                ),
            ]
        )
    )
    made = dict(zip(wanted, materialize_many(source, wanted), strict=False))  # each block read once
    batches = []
    for step in steps:
        payloads = [made[s.id] for s in step.samples]
        images = [made[im.sample_id] for im in step.exchange.encode] if step.exchange is not None else None
        clips = None
        if step.audio_exchange is not None:
            clips = [made[c.sample_id] for c in step.audio_exchange.encode]
        batches.append(collate(step, payloads, images, clips, epoch))
    return made, batches
