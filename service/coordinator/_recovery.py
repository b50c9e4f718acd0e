"""Restart: the coordinator's journal records, the replay tables, snapshot and restore.

With `state_dir`, every decision, totals, registration, finish and failure is appended to a journal
(`batchd.service._journal`: fsynced, checksummed) before any rank sees it (write-ahead). A coordinator
killed with `kill -9` and restarted with the same command resumes: ranks reconnect (their calls retry
while it is away, for up to a lease) and go on; rounds already decided are replayed from the journal.

Records (JSON objects, `kind` first):
- `register`: rank, address, and the node agent serving it (`node`, absent for a rank alone);
- `decision`: epoch, round, the serialized `AlignReply` (`reply`, base64);
- `totals`: epoch, round, the serialized `CommitReply`, the core's `state_dict` after those totals
  (`core`; in a snapshot only the newest totals carry it, older ones only fill the replay tables) and
  the round's `ledger` rows (`ledger_record`: the ids and loss tokens of its steps);
- `finish`: a rank's trainer took the job's last step; `failure`: the job failed (its message);
- `ledger`: epoch, the first step, and per step its ids and global loss tokens (`batchd.core.StepLedger`):
  a snapshot holds one with every step of the current epoch (a round's rows ride in its totals);
- `resize`: the job was resized (`_resize`): generation, world sizes, epoch, first round, step (null
  until a rank resumed);
- `budget`: a trainer ran out of memory (`budget_record`): the lowered token budget, the budget it was
  lowered from, the resize generation that goes on at it, and the step that failed (rank, epoch, step, cost).

A snapshot (`snapshot`, written by `Journal.compact` every `COMPACT_EVERY` records and after a restore)
holds the registrations, the replay tables, the finishes and the failure: about 20 records. Restoring
(`replay_records`, then `resume_core`) rebuilds the core from the newest totals, a decision newer than
those totals as the round's pending decision, the replay tables, and the ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from batchd.core import Coordinator, JobSpec, RoundDecision, RoundTotals, StepLedger

from ._convert import decode_decision, decode_totals, encode_decision, encode_totals

JOURNAL = "coordinator.journal"
COMPACT_EVERY = 4096  # journal records between compactions (a compacted journal holds ~20 records)
KEEP_ROUNDS = 8  # decisions and totals kept for replay (a restarted rank is at most a round or two behind)

Key = tuple[int, int]  # (epoch, round)
Record = dict[str, Any]


def job_of(spec: JobSpec) -> dict[str, Any]:
    """What names a job in its journal: its spec, by key (`JobSpec.keys`; `JobSpec.from_keys` reads it)."""
    return spec.keys()


def budget_record(
    token_budget: int, old: int, generation: int, rank: int, epoch: int, step: int, cost: float
) -> Record:
    """The token budget lowered to `token_budget` from `old` after rank `rank`'s step (`epoch`, `step`) of
    planned cost `cost` ran out of memory; resize generation `generation` goes on at it."""
    return {
        "kind": "budget",
        "token_budget": token_budget,
        "from": old,
        "generation": generation,
        "rank": rank,
        "epoch": epoch,
        "step": step,
        "cost": cost,
    }


def register_record(rank: int, address: str, node: str | None) -> Record:
    record: Record = {"kind": "register", "rank": rank, "address": address}
    if node is not None:
        record["node"] = node
    return record


def decision_record(key: Key, decision: RoundDecision) -> Record:
    return {
        "kind": "decision",
        "epoch": key[0],
        "round": key[1],
        "reply": encode_decision(decision, key[0]),
    }


def totals_record(
    key: Key, totals: RoundTotals, core_state: Mapping[str, Any] | None, ledger: StepLedger | None = None
) -> Record:
    """A round's totals; with `ledger`, also the ledger's rows of the round's steps (its last
    `totals.steps`), in the same record, so they reach the disk together."""
    record: Record = {
        "kind": "totals",
        "epoch": key[0],
        "round": key[1],
        "core": core_state,
        "reply": encode_totals(totals, key[0]),
    }
    if ledger is not None:
        record["ledger"] = ledger_record(ledger, ledger.steps - totals.steps)
    return record


def ledger_record(ledger: StepLedger, first: int) -> Record:
    """The ledger's steps from `first` on (a round's, or a snapshot's whole epoch)."""
    return {
        "kind": "ledger",
        "epoch": ledger.epoch,
        "first": first,
        "rows": ledger.rows(first, ledger.steps),
        "loss": ledger.loss_tokens(first, ledger.steps),
    }


def read_ledger(ledger: StepLedger | None, rec: Mapping[str, Any]) -> StepLedger:
    """`ledger` with a ledger record folded in: a later epoch starts a new ledger; steps from the
    record's first step on replace what the ledger held there (a resize forgot them)."""
    epoch, first = int(rec["epoch"]), int(rec["first"])
    if ledger is None or epoch > ledger.epoch:
        ledger = StepLedger(epoch)
    if epoch == ledger.epoch:
        if first > ledger.steps:
            raise ValueError(
                f"journal: a ledger record of epoch {epoch} from step {first}, but the ledger holds "
                f"{ledger.steps} step(s)"
            )
        ledger.truncate(first)
        ledger.add(rec["rows"], rec["loss"])
    return ledger


def _trim(table: dict[Key, Any]) -> None:
    while len(table) > KEEP_ROUNDS:
        table.pop(next(iter(table)))


class ReplayTables:
    """The newest `KEEP_ROUNDS` rounds' decisions and totals (a restarted rank that resends a message of
    a decided round gets the stored answer: its state is deterministic, so it gets what it had), and
    the core's state after the newest totals (what a snapshot needs to rebuild the core)."""

    def __init__(self) -> None:
        self.decisions: dict[Key, RoundDecision] = {}
        self.totals: dict[Key, RoundTotals] = {}
        self.core_state: dict[str, Any] | None = None
        self.core_key: Key | None = None

    def decided(self, key: Key, decision: RoundDecision) -> None:
        self.decisions[key] = decision
        _trim(self.decisions)

    def committed(self, key: Key, totals: RoundTotals, core_state: dict[str, Any]) -> None:
        self.totals[key] = totals
        _trim(self.totals)
        self.core_state, self.core_key = core_state, key

    def records(self) -> list[Record]:
        """Their journal records, in round order (a round's decision before its totals)."""
        out: list[Record] = []
        for key in sorted(set(self.decisions) | set(self.totals)):
            if key in self.decisions:
                out.append(decision_record(key, self.decisions[key]))
            if key in self.totals:
                core = self.core_state if key == self.core_key else {}
                out.append(totals_record(key, self.totals[key], core))
        return out


def snapshot(
    addresses: Mapping[int, str],
    node_of: Mapping[int, str],
    replay: ReplayTables,
    finished: Iterable[int],
    failure: str | None,
    ledger: StepLedger | None = None,
    resize: Record | None = None,
    budget: Record | None = None,
) -> list[Record]:
    """The records a restart needs: ranks, the resize, the lowered budget, the epoch's ledger, the replay
    tables, finishes (sorted), the failure."""
    out = [register_record(r, a, node_of.get(r)) for r, a in sorted(addresses.items())]
    out += [resize] if resize is not None else []
    out += [budget] if budget is not None else []
    out += [ledger_record(ledger, 0)] if ledger is not None else []
    out += replay.records()
    out += [{"kind": "finish", "rank": r} for r in sorted(finished)]
    if failure is not None:
        out.append({"kind": "failure", "message": failure})
    return out


@dataclasses.dataclass
class Recovered:
    """What a journal's records say (`replay_records`): the ranks, the replay tables, the newest
    decision (`pending`, its key), finishes and the failure."""

    addresses: dict[int, str] = dataclasses.field(default_factory=dict)
    node_of: dict[int, str] = dataclasses.field(default_factory=dict)
    registered: set[int] = dataclasses.field(default_factory=set)
    finished: set[int] = dataclasses.field(default_factory=set)
    replay: ReplayTables = dataclasses.field(default_factory=ReplayTables)
    pending: Key | None = None
    failure: str | None = None
    ledger: StepLedger | None = None  # the newest epoch's
    resize: Record | None = None  # the newest resize record
    budget: Record | None = None  # the newest lowered budget (`budget_record`)

    @property
    def awaiting_commits(self) -> bool:
        """The newest decision has no totals yet: the round is decided, its commits are pending."""
        return self.pending is not None and self.pending not in self.replay.totals

    def _register(self, rec: Mapping[str, Any]) -> None:
        rank = rec["rank"]
        self.addresses[rank] = rec["address"]
        self.registered.add(rank)
        if rec.get("node"):
            self.node_of[rank] = rec["node"]
        else:
            self.node_of.pop(rank, None)

    def _totals(self, rec: Mapping[str, Any]) -> None:
        key = (rec["epoch"], rec["round"])
        self.replay.totals[key] = decode_totals(rec["reply"])
        if rec.get("ledger"):
            self.ledger = read_ledger(self.ledger, rec["ledger"])
        if rec.get("core"):
            self.replay.core_state, self.replay.core_key = rec["core"], key

    def read(self, rec: Mapping[str, Any]) -> None:
        """Folds one record in (records of an unknown kind are skipped)."""
        kind = rec["kind"]
        if kind == "register":
            self._register(rec)
        elif kind == "decision":
            key = (rec["epoch"], rec["round"])
            self.replay.decisions[key] = decode_decision(rec["reply"])
            self.pending = key
        elif kind == "totals":
            self._totals(rec)
        elif kind == "finish":
            self.finished.add(rec["rank"])
        elif kind == "failure":
            self.failure = rec["message"]
        elif kind == "ledger":
            self.ledger = read_ledger(self.ledger, rec)
        elif kind == "resize":
            self.resize = dict(rec)
        elif kind == "budget":
            self.budget = dict(rec)


def replay_records(records: Sequence[Mapping[str, Any]]) -> Recovered:
    """Reads journal records (oldest first) into a `Recovered`; the replay tables keep the newest
    `KEEP_ROUNDS` rounds. O(records)."""
    out = Recovered()
    for rec in records:
        out.read(rec)
    _trim(out.replay.decisions)
    _trim(out.replay.totals)
    return out


def resume_core(
    recovered: Recovered, epoch: int, core: Coordinator, new_core: Callable[[int], Coordinator]
) -> tuple[int, Coordinator]:
    """The (epoch, protocol core) a restart resumes with, from (`epoch`, `core`), a fresh start: the core
    of the newest totals' epoch loaded from their state, then, when the newest decision has no totals,
    that decision resumed (in a fresh core of the next epoch when it opened one). `new_core(epoch)`
    builds a fresh core. Raises ValueError when a journaled core state does not fit the spec."""
    replay = recovered.replay
    if replay.core_state is not None:
        epoch = replay.core_state["epoch"]
        core = new_core(epoch)
        core.load_state_dict(replay.core_state)
    pending = recovered.pending
    if pending is not None and recovered.awaiting_commits:
        if pending[0] == epoch + 1 and core.done:
            epoch, core = pending[0], new_core(pending[0])
        core.resume_decided(replay.decisions[pending])
    if recovered.ledger is not None and recovered.ledger.epoch == epoch:
        core.ledger = recovered.ledger
    return epoch, core
