"""`RecordDataset`: conversation records from Parquet, JSONL and Arrow IPC files, addressed by a global id.

Sample ids are global: file 0's rows first, in row order, then file 1's, and so on; every non-blank
JSONL line is one record (an invalid one too). Each file is read once into an Arrow table (images
included), its schema checked on the way (`_schema`); a record is parsed when it is asked for
(`_parse`), so a bad one is a `Reject` for that id only. The preprocessing pool shares the tables with
its actors through the Ray object store (`DatasetHandle`). Datasets larger than memory need a sharded
reader (not built yet).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.ipc as paipc
import pyarrow.parquet as pq

from ._files import _base_dir, _format_of, _read_bytes, expand_paths, filesystem_of
from ._parse import Record, parse_record
from ._quarantine import Reject
from ._schema import SchemaError, _conversation_column, check_arrow_schema, check_json_row


class EmptyDatasetError(ValueError):
    """A dataset with no records at all (every file empty or blank): names the files."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        shown = ", ".join(self.paths[:3]) + (f" and {len(self.paths) - 3} more" if len(self.paths) > 3 else "")
        super().__init__(f"the dataset has no records: {shown}")


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """One dataset file: where it is, its format, its rows and the id of its first row."""

    path: str
    format: str
    num_rows: int
    offset: int
    base_dir: str


def _read_table(path: str, fmt: str, strict: bool) -> tuple[pa.Table, list[str | None]]:
    """The file's table (JSONL: one 'line' column of raw text) and per-row pre-detected errors."""
    fs, inner = filesystem_of(path)
    if fmt == "parquet":
        with fs.open_input_file(inner) as f:
            schema = pq.read_schema(f)
            check_arrow_schema(schema, path)
            cols = [c for c in (_conversation_column(schema.names), "images", "system") if c in schema.names]
            table = pq.read_table(f, columns=cols)
        return table, []
    if fmt == "arrow":
        with fs.open_input_file(inner) as f:
            try:
                reader = paipc.open_file(f)
                schema = reader.schema
                check_arrow_schema(schema, path)
                table = reader.read_all()
            except pa.ArrowInvalid:
                f.seek(0)
                stream = paipc.open_stream(f)
                check_arrow_schema(stream.schema, path)
                table = stream.read_all()
        cols = [c for c in (_conversation_column(table.schema.names), "images", "system") if c in table.schema.names]
        return table.select(cols), []
    # JSONL: raw lines are kept (parsed again in the actors); here every row's types are checked.
    text = _read_bytes(path).decode("utf-8", errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors: list[str | None] = []
    for row, line in enumerate(lines):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"invalid_json: {exc.msg} at column {exc.colno}")
            continue
        try:
            check_json_row(obj, path, row)
        except SchemaError as exc:
            if strict:
                raise
            errors.append(f"schema: field {exc.field!r}: {exc.problem}")
            continue
        errors.append(None)
    return pa.table({"line": pa.array(lines, pa.large_string())}), errors


class RecordDataset:
    """Conversation records from Parquet / JSONL / Arrow IPC files (see the module docstring).

    Args:
        paths: A file, a directory, a filesystem URI, or a list of them.
        format: Force one format for every file (default: from each file's extension).
        strict: Raise SchemaError on JSONL rows with wrongly typed fields (default); False quarantines them.

    Raises:
        SchemaError: naming file, row and field, on a schema problem.
        EmptyDatasetError: (a ValueError) naming the files, when they hold no record at all: an epoch
            of 0 steps is never what a job means.
        FileNotFoundError: on a missing file.
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], format: str | None = None,
                 strict: bool = True) -> None:
        self.paths = expand_paths(paths)
        self.strict = strict
        self.files: list[FileInfo] = []
        self.tables: list[pa.Table] = []
        self._errors: list[list[str | None]] = []
        offset = 0
        for path in self.paths:
            fmt = _format_of(path, format)
            table, errors = _read_table(path, fmt, strict)
            self.files.append(FileInfo(path, fmt, table.num_rows, offset, _base_dir(path)))
            self.tables.append(table)
            self._errors.append(errors)
            offset += table.num_rows
        if offset == 0:
            raise EmptyDatasetError(self.paths)
        self._handle = DatasetHandle(self.files, self.tables, self._errors)

    def __len__(self) -> int:
        return len(self._handle)

    def __repr__(self) -> str:
        return f"RecordDataset({len(self)} records in {len(self.files)} files)"

    def locate(self, sample_id: int) -> tuple[int, int]:
        """(file index, row in that file) of a global sample id."""
        return self._handle.locate(sample_id)

    def source(self, sample_id: int) -> str:
        """'file:row' of a sample (row 0-based within its file)."""
        return self._handle.source(sample_id)

    def raw(self, sample_id: int) -> dict[str, Any]:
        """The row as Python objects; raises Reject for an invalid JSONL line (or a quarantined type error)."""
        return self._handle.raw(sample_id)

    def record(self, sample_id: int) -> Record:
        """The parsed record; raises Reject for a bad one."""
        return self._handle.record(sample_id)

    def handle(self) -> DatasetHandle:
        """A picklable description of the files and tables (the pool swaps the tables for object refs)."""
        return self._handle


@dataclasses.dataclass
class DatasetHandle:
    """What a preprocessing actor needs to read records: file infos and tables (or Ray refs to them)."""

    files: list[FileInfo]
    tables: list[Any]
    errors: list[list[str | None]]

    def __post_init__(self) -> None:
        self._offsets = [f.offset for f in self.files]

    def __len__(self) -> int:
        return (self.files[-1].offset + self.files[-1].num_rows) if self.files else 0

    def locate(self, sample_id: int) -> tuple[int, int]:
        if not 0 <= sample_id < len(self):
            raise IndexError(f"sample id {sample_id} out of range [0, {len(self)})")
        k = bisect.bisect_right(self._offsets, sample_id) - 1
        return k, sample_id - self._offsets[k]

    def source(self, sample_id: int) -> str:
        k, row = self.locate(sample_id)
        return f"{self.files[k].path}:{row}"

    def raw(self, sample_id: int) -> dict[str, Any]:
        k, row = self.locate(sample_id)
        return raw_row(self.files[k], self.tables[k], self.errors[k], row)

    def record(self, sample_id: int) -> Record:
        k, _ = self.locate(sample_id)
        return parse_record(self.raw(sample_id), self.files[k].base_dir)

    def with_tables(self, tables: list[Any]) -> DatasetHandle:
        return DatasetHandle(self.files, tables, self.errors)


def raw_row(info: FileInfo, table: pa.Table, errors: list[str | None], row: int) -> dict[str, Any]:
    if info.format == "jsonl":
        if errors and errors[row] is not None:
            raise Reject(*errors[row].split(": ", 1))
        return json.loads(table.column("line")[row].as_py())
    return table.slice(row, 1).to_pylist()[0]


def iter_records(dataset: RecordDataset, ids: Iterable[int] | None = None):
    """(id, Record | Reject) pairs: a convenience for inspecting a dataset without Ray."""
    for i in range(len(dataset)) if ids is None else ids:
        try:
            yield i, dataset.record(i)
        except Reject as exc:
            yield i, exc
