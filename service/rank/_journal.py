"""The rank journal: what a restarted rank service resumes from.

With `state_dir`, a rank service rewrites one JSON object, `rank-{rank}.json` (`JOURNAL`), whole and
atomically (a temporary file, fsynced, renamed over the old one) after every round, and after every fill,
before the round's report. It is metadata only: the rank state, the source position, the steps the trainer
has not acknowledged. A restarted service (`restore`) reloads it, re-materializes the payloads by id
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
Cost: one JSON encode and one fsync per round and per fill; `restore` makes every payload it needs in one
`Source.materialize_many` call.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

from batchd.core import Remainder, Step

from ._payloads import materialize_many

log = logging.getLogger("batchd.rank")


class Journaled(Protocol):
    """What the journal reads from and restores into: `RankServiceCore`'s parts (`_core`), named here so
    this module does not import the core that imports it."""

    rank: int
    state: Any
    rejected_before: Any
    finished: bool
    restored_finished: bool
    filled: bool
    generation: int
    remainder: Any

    @property
    def epoch(self) -> int: ...
    @property
    def delivery(self) -> Any: ...
    @property
    def source(self) -> Any: ...
    @property
    def batches(self) -> Any: ...
    @property
    def streams(self) -> Any: ...
    @property
    def payloads(self) -> Any: ...

    def new_state(self, epoch: int) -> Any: ...

    def _batch(
        self,
        step: Step,
        payloads: list[Any],
        images: list[Any] | None,
        clips: list[Any] | None = None,
        epoch: int | None = None,
    ) -> Any: ...


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


def journal_record(core: Journaled, filled: bool) -> dict[str, Any]:
    """The journal object of `core` now (call with `core.cond` held: the states must not move under it)."""
    return {
        J_VERSION: JOURNAL_VERSION,
        J_DELIVERY: core.delivery.state_dict(),
        J_RANK: core.state.state_dict(),
        J_SOURCE: core.source.state_dict(),
        J_READY: [core.batches[i][0].to_json() for i in sorted(core.batches)],
        J_PAST: {
            str(q): [batches[i][0].to_json() for i in sorted(batches)]
            for q, batches in core.streams.past.items()
        },
        J_REJECTED_BEFORE: core.rejected_before,
        J_FINISH_ACKED: core.finished,
        J_FILLED: filled,
        J_RESIZE: {
            "generation": core.generation,
            "remainder": core.remainder.to_json() if core.remainder is not None else None,
        },
    }


def write_journal(path: Path, record: dict[str, Any]) -> None:
    """Replaces the journal at `path` by `record`, atomically (a temporary file, fsynced, renamed)."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(record))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def restore(core: Journaled, path: Path) -> None:
    """Loads `core`'s state from its journal at `path` (see module docstring): the delivery, the epoch's
    rank state and source position, the buffered payloads and the held steps (re-collated with
    `core._batch`), whether the trainer took the job's last step and whether the buffer was filled. A
    journal of another world size (the job was resized since) is left as it is: the rank starts empty
    and resumes where the coordinator says (`RankServiceCore._resume`).

    Raises:
        ValueError: naming the file and why (`read_journal`; a state of another job, rank or
            configuration).
    """
    state = read_journal(path)
    saved_world = state[J_RANK].get("world_size")
    if saved_world != core.state.world_size and state[J_RANK].get("rank") == core.rank:  # a resized job
        log.warning(
            "rank %d: %s is of a job at world size %s; this one runs at %d (a resize): not restored, the "
            "rank resumes where the coordinator says",
            core.rank,
            path,
            saved_world,
            core.state.world_size,
        )
        return
    try:
        resize = state[J_RESIZE]
        core.generation = int(resize["generation"])
        core.remainder = Remainder.from_json(resize["remainder"]) if resize.get("remainder") else None
        core.delivery.load_state_dict(state[J_DELIVERY], time.monotonic())
        remainder = (
            core.remainder if core.remainder is not None and core.remainder.epoch == core.epoch else None
        )
        past = {int(q): [Step.from_json(j) for j in steps] for q, steps in state[J_PAST].items()}
        for q in sorted(past):  # held for a rewind: re-made in their own epoch
            core.source.start_epoch(q)
            core.streams.past[q] = {
                step.info.step: (step, batch)
                for step, batch in zip(past[q], _remake(core, past[q], [], q)[1], strict=True)
            }
        if core.epoch != 0 or remainder is not None:
            core.state = core.new_state(core.epoch)
            core.source.start_epoch(core.epoch, remainder)
        core.rejected_before = state[J_REJECTED_BEFORE]
        core.state.load_state_dict(state[J_RANK])
        core.source.load_state_dict(state[J_SOURCE])
    except (ValueError, KeyError) as exc:  # a state of another job, rank or configuration
        raise ValueError(
            f"{path}: cannot resume rank {core.rank} from this journal: {type(exc).__name__}: {exc}"
        ) from exc
    ids = [entry.sample.id for entry in core.state.buffer]
    steps = [Step.from_json(step_json) for step_json in state[J_READY]]
    made, batches = _remake(core, steps, ids, core.epoch)
    core.payloads.update((i, made[i]) for i in ids)
    for step, batch in zip(steps, batches, strict=True):
        core.batches[step.info.step] = (step, batch)
    core.streams.recount()
    core.streams.prune()
    core.restored_finished = core.delivery.finished
    core.finished = state[J_FINISH_ACKED]  # the coordinator knew: it may be gone by now
    core.filled = state[J_FILLED]  # report the journaled buffer as it is (see module docstring)
    log.info(
        "rank %d restored from %s at epoch %d round %d (step %d)%s",
        core.rank,
        path,
        core.epoch,
        core.state.round,
        core.state.step,
        "; its trainer took the job's last step" if core.restored_finished else "",
    )


def _remake(
    core: Journaled, steps: list[Step], ids: list[int], epoch: int
) -> tuple[dict[int, Any], list[Any]]:
    """Re-makes the payloads of `ids` and of `steps` (their samples, the images and clips they encode) in
    one `materialize_many` call of the source (in `epoch`), and collates each step: (payloads by id, the
    steps' batches in order)."""
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
    made = dict(zip(wanted, materialize_many(core.source, wanted), strict=False))  # each block read once
    batches = []
    for step in steps:
        payloads = [made[s.id] for s in step.samples]
        images = [made[im.sample_id] for im in step.exchange.encode] if step.exchange is not None else None
        clips = None
        if step.audio_exchange is not None:
            clips = [made[c.sample_id] for c in step.audio_exchange.encode]
        batches.append(core._batch(step, payloads, images, clips, epoch))
    return made, batches
