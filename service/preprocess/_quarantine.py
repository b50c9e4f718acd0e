"""Bad records: `Reject`, the exception that quarantines one record, and the `Quarantine` that logs them.

Problems with a record's values (invalid JSON lines, missing or null fields, an empty conversation,
unknown roles, no assistant turn, undecodable images, a stage's error...) are raised as `Reject(code,
detail)` by the record parser or a stage, inside the pipeline, and end up in a `Quarantine`: a JSONL
file of `{id, source, reason, epoch}` lines plus counts by reason code. They are never raised to the
caller: a bad record never kills the epoch. (Problems with a file's schema are `SchemaError`, raised
when the dataset is opened: see `_schema`.) Too many of them fail the job (`TooManyBadRecords`), judged
over the records of every source that shares a `BadRecordTally`: a node agent's ranks share one.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class Reject(Exception):
    """Raised by a stage (or the record parser) to quarantine a record: `code` groups the counts."""

    def __init__(self, code: str, detail: str = "") -> None:
        self.code, self.detail = code, detail
        super().__init__(f"{code}: {detail}" if detail else code)

    @property
    def reason(self) -> str:
        return str(self)


K_COUNTS = "counts"  # Quarantine.state_dict(): counts by reason code


class Quarantine:
    """Bad records: appended to a JSONL file (one `{id, source, reason, epoch}` object per line) and counted.

    Counts are keyed by the reason's code (the part before the first ':', e.g. ``invalid_json``,
    ``missing_field``, ``empty_conversation``, ``bad_image``, ``over_cutoff``). Thread-safe; several
    processes may append to the same file (one short write per line, O_APPEND). The file is an
    at-least-once log: after a resume, records quarantined between the checkpoint and the crash are
    written again; the counts (restored with `load_state_dict`) stay exact.

    Args:
        path: JSONL file to append to (parent directories are created); None keeps counts only.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def code_of(reason: str) -> str:
        return reason.split(":", 1)[0].strip() or "unknown"

    def add(self, sample_id: int, source: str, reason: str, epoch: int | None = None) -> None:
        line = {"id": int(sample_id), "source": source, "reason": reason}
        if epoch is not None:
            line["epoch"] = int(epoch)
        with self._lock:
            self.counts[self.code_of(reason)] += 1
            if self.path is not None:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(line) + "\n")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __len__(self) -> int:
        return self.total

    def state_dict(self) -> dict[str, Any]:
        """The counts by reason code (JSON-safe); the file is not part of the state (it is a log)."""
        return {K_COUNTS: dict(self.counts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the counts of a `state_dict()`; raises ValueError naming the field of a malformed one."""
        if K_COUNTS not in state:
            raise ValueError(f"Quarantine state lacks the {K_COUNTS!r} field, got fields {sorted(state)}")
        counts = state[K_COUNTS]
        if not isinstance(counts, Mapping) or not all(
            isinstance(k, str) and type(v) is int and v >= 0 for k, v in counts.items()
        ):
            raise ValueError(
                f"Quarantine state field {K_COUNTS!r} must map reason codes to counts >= 0, got {counts!r}"
            )
        with self._lock:
            self.counts = collections.Counter(counts)

    @staticmethod
    def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """The lines of a quarantine file."""
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


class TooManyBadRecords(RuntimeError):
    """More than `max_bad_fraction` of the records read were bad (by `ranks`: one rank, or the ranks whose
    sources share a `BadRecordTally`): the job stops (names the counts, the reasons and the quarantine file).
    """

    def __init__(
        self,
        ranks: int | Sequence[int],
        bad: int,
        read: int,
        max_bad_fraction: float,
        reasons: Mapping[str, int],
        path: str | None,
    ) -> None:
        self.ranks = [ranks] if isinstance(ranks, int) else sorted(ranks)
        self.rank, self.bad, self.read, self.max_bad_fraction = self.ranks[0], bad, read, max_bad_fraction
        self.reasons, self.path = dict(reasons), path
        top = ", ".join(
            f"{code} {n}" for code, n in sorted(self.reasons.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        where = f"see {path}" if path else "no quarantine file was given ([data] quarantine)"
        who = "this rank" if len(self.ranks) == 1 else "ranks " + ", ".join(map(str, self.ranks))
        super().__init__(
            f"{bad} of the {read} records {who} read ({100 * bad / read:.1f}%) are bad, more than "
            f"[data] max_bad_fraction = {max_bad_fraction:g}; by reason: {top}; {where}. Fix the data, or "
            f"raise max_bad_fraction to train on the rest"
        )


class BadRecordTally:
    """The bad-record counts of several sources (one per rank), judged together: the ranks a node agent
    serves share one, so `max_bad_fraction` judges the share of bad records among all their records (the
    job's, where one agent serves every rank), not one rank's, whose share of a small file's few bad
    records can be well above the file's. A source `join`s with its rank, `note`s its counts as it emits
    and, to judge, gets everyone's from `totals`. Thread-safe (the sources poll on their own threads).

    Each source reports when it judges (a quarantine, the end of its view) and as it emits, so the others'
    counts lag by at most the samples they hold ready; at the end of a view the source reports exact ones."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._counts: dict[int, tuple[dict[str, int], int, bool]] = {}  # rank -> (reasons, read, finished)

    def join(self, rank: int) -> None:
        """Counts `rank` from now on (nothing read yet, not finished): until it reports, a view's end is
        not the end of every view."""
        with self._lock:
            self._counts.setdefault(rank, ({}, 0, False))

    def note(self, rank: int, reasons: Mapping[str, int], read: int, finished: bool = False) -> None:
        """Records `rank`'s counts: bad records by reason code, records read, its view finished."""
        with self._lock:
            self._counts[rank] = (dict(reasons), read, finished)

    def totals(
        self, rank: int, reasons: Mapping[str, int], read: int, finished: bool
    ) -> tuple[dict[str, int], int, bool, list[int]]:
        """`note`s `rank`'s counts; returns (bad records by reason, records read, every view finished,
        ranks) over every rank."""
        with self._lock:
            self.note(rank, reasons, read, finished)
            total: collections.Counter[str] = collections.Counter()
            for counted, _, _ in self._counts.values():
                total.update(counted)
            counts = self._counts.values()
            return dict(total), sum(c[1] for c in counts), all(c[2] for c in counts), sorted(self._counts)
