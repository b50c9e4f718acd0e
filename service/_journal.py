"""An append-only journal file: versioned, one checksummed JSON record per line, fsynced, compactable.

The coordinator writes its decisions and totals here before any rank sees them (write-ahead), so a
coordinator killed with `kill -9` and restarted with the same command resumes the job exactly.

Format (text, one record per line):

    <crc32 of the JSON bytes, 8 hex digits> <JSON object>\\n

The first record is the header: {"kind": "header", "version": 1, "job": {...}} where "job" names the
job (its spec). Opening a journal whose header names another job, or another version, is refused with a
message that names the file and the fields that differ. A torn or corrupt tail (a crash in the middle of
a write; a record whose checksum or JSON does not hold) is cut off at the first bad record, with a log
line naming the file, the offset and the bytes dropped. `compact(records)` rewrites the file with the
header and `records` (atomically: a new file, fsynced, renamed over the old one).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger("batchd.journal")
VERSION = 1


class JournalError(ValueError):
    """The journal cannot be used for this job (the message names the file and why)."""


def encode_record(record: Mapping[str, Any]) -> bytes:
    body = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def decode_records(data: bytes) -> tuple[list[dict[str, Any]], int, str | None]:
    """Parses `data`: (records, bytes of valid records, why the rest is bad or None)."""
    records: list[dict[str, Any]] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:
            return records, pos, "a record without its line end (torn write)"
        line = data[pos:end]
        try:
            crc, body = int(line[:8], 16), line[9:]
            if line[8:9] != b" " or zlib.crc32(body) != crc:
                return records, pos, "a record whose checksum does not match"
            record = json.loads(body)
            if not isinstance(record, dict) or "kind" not in record:
                return records, pos, "a record that is not a journal entry"
        except ValueError:
            return records, pos, "a record that does not parse"
        records.append(record)
        pos = end + 1
    return records, pos, None


class Journal:
    """The journal at `path` for the job named by `job` (a JSON-safe mapping; see module docstring)."""

    def __init__(self, path: str | os.PathLike[str], job: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self.job = dict(job)
        self._fh: BinaryIO | None = None
        self.records_written = 0

    def _header(self) -> dict[str, Any]:
        return {"kind": "header", "version": VERSION, "job": self.job}

    def open(self) -> list[dict[str, Any]]:
        """Opens (or creates) the journal; returns its records after the header. Raises JournalError."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists() or self.path.stat().st_size == 0:
            self.compact([])
            return []
        data = self.path.read_bytes()
        records, valid, bad = decode_records(data)
        if not records:
            raise JournalError(
                f"{self.path}: not a batchd journal ({bad or 'no header'}); "
                f"remove it or use another state dir"
            )
        header, records = records[0], records[1:]
        if header.get("kind") != "header" or header.get("version") != VERSION:
            raise JournalError(
                f"{self.path}: journal version {header.get('version')!r}, this build reads version {VERSION}"
            )
        theirs = header.get("job") or {}
        diff = sorted(k for k in set(theirs) | set(self.job) if theirs.get(k) != self.job.get(k))
        if diff:
            detail = ", ".join(f"{k}: journal {theirs.get(k)!r}, this job {self.job.get(k)!r}" for k in diff)
            raise JournalError(
                f"{self.path} is the journal of another job ({detail}); use another state dir or remove it"
            )
        if bad is not None:
            log.error(
                "%s: %s at byte %d; cutting the journal there (%d bytes dropped)",
                self.path,
                bad,
                valid,
                len(data) - valid,
            )
            with open(self.path, "r+b") as fh:
                fh.truncate(valid)
                fh.flush()
                os.fsync(fh.fileno())
        self._fh = open(self.path, "ab")
        self.records_written = len(records)
        return records

    def append(self, record: Mapping[str, Any]) -> None:
        """Writes one record and fsyncs it: it is on disk when this returns."""
        if self._fh is None:
            raise RuntimeError(f"journal {self.path} is not open")
        self._fh.write(encode_record(record))
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.records_written += 1

    def compact(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Replaces the journal by the header and `records`, atomically."""
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(encode_record(self._header()))
            for r in records:
                fh.write(encode_record(r))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        if self._fh is not None:
            self._fh.close()
        self._fh = open(self.path, "ab")
        self.records_written = len(records)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
