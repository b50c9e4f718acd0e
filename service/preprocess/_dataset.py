"""`RecordDataset`: conversation records from Parquet, JSONL and Arrow IPC files, read by blocks.

Opening a dataset reads metadata only, never the records: each file's schema (checked as a whole:
`_schema.check_arrow_schema`, so a column of the wrong type fails at once naming file and column) and
its blocks, the unit a reader reads:

    Parquet      one block per row group (footer metadata: rows and decoded bytes of the used columns)
    Arrow IPC    one block per record batch (file format: its footer; stream format: one pass over the
                 message headers, remembering each batch's byte range)
    JSONL        runs of up to `JSONL_BLOCK_LINES` lines / `JSONL_BLOCK_BYTES` bytes, through the file's
                 byte-offset index (`_jsonl_index`: built once, cached)

Sample ids are global: file 0's rows first, in row order, then file 1's, and so on; every non-blank JSONL
line is one record (an invalid one too). `read_block(k)` gives block k's rows (an Arrow table of the used
columns, or the JSONL lines as text; a line that is not UTF-8 as its bytes, quarantined as ``invalid_utf8``,
never decoded with replacement characters and trained) and `items(block, rows)` the per-record items a
preprocessing actor parses (`parse_item`): a bad record is a `Reject` for that id only, a JSONL row with a
wrongly typed field included (reason ``schema: field 'messages': expected a list of messages, got str``).
What a rank reads, in which order and how much it holds is `RaySource`'s (`BlockView`, `BlockReader`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as paipc
import pyarrow.parquet as pq

from ._files import _base_dir, _format_of, _is_uri, expand_paths, filesystem_of
from ._jsonl_index import line_index, line_numbers
from ._parse import Record, parse_record
from ._quarantine import Reject
from ._schema import SchemaError, _conversation_column, check_arrow_schema, check_json_row

JSONL_BLOCK_LINES = 1024
JSONL_BLOCK_BYTES = 8 << 20


class EmptyDatasetError(ValueError):
    """A dataset with no records at all (every file empty or blank): names the files."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        shown = ", ".join(self.paths[:3]) + (
            f" and {len(self.paths) - 3} more" if len(self.paths) > 3 else ""
        )
        super().__init__(f"the dataset has no records: {shown}")


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """One dataset file: where it is, its format, its rows, the id of its first row, its columns read."""

    path: str
    format: str
    num_rows: int
    offset: int
    base_dir: str
    columns: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Block:
    """Rows [offset, offset + rows) of the dataset: block `index` of file `file` (a row group, a record
    batch, a run of JSONL lines). `nbytes`: what a reader holds once it is read; `start`/`end`: its byte
    range (JSONL, Arrow stream), -1 when the format addresses blocks by index."""

    file: int
    index: int
    offset: int
    rows: int
    nbytes: int
    start: int = -1
    end: int = -1


def _columns(schema: pa.Schema) -> list[str]:
    wanted = (_conversation_column(schema.names), "images", "audios", "system")
    return [c for c in wanted if c is not None and c in schema.names]


def _parquet_blocks(path: str) -> tuple[list[tuple[int, int, int, int]], tuple[str, ...]]:
    fs, inner = filesystem_of(path)
    with fs.open_input_file(inner) as f:
        pf = pq.ParquetFile(f)
        check_arrow_schema(pf.schema_arrow, path)
        cols = _columns(pf.schema_arrow)
        md = pf.metadata
        blocks = []
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            used = sum(
                rg.column(c).total_uncompressed_size
                for c in range(rg.num_columns)
                if rg.column(c).path_in_schema.split(".", 1)[0] in cols
            )
            blocks.append((rg.num_rows, max(int(used), 1), -1, -1))
    return blocks, tuple(cols)


def _arrow_blocks(path: str) -> tuple[list[tuple[int, int, int, int]], tuple[str, ...], str]:
    """Blocks of an Arrow IPC file ('file' format: by index) or stream ('stream': by byte range)."""
    fs, inner = filesystem_of(path)
    with pa.memory_map(inner) if not _is_uri(path) else fs.open_input_file(inner) as f:
        try:
            reader = paipc.open_file(f)
        except pa.ArrowInvalid:
            reader = None
        if reader is not None:
            check_arrow_schema(reader.schema, path)
            cols = _columns(reader.schema)
            blocks = []
            for i in range(reader.num_record_batches):
                b = reader.get_batch(i)
                blocks.append((b.num_rows, max(b.select(cols).nbytes, 1), -1, -1))
            return blocks, tuple(cols), "file"
        f.seek(0)
        stream = paipc.open_stream(f)
        check_arrow_schema(stream.schema, path)
        cols = _columns(stream.schema)
        blocks = []
        start = f.tell()
        while True:
            try:
                b = stream.read_next_batch()
            except StopIteration:
                break
            end = f.tell()
            blocks.append((b.num_rows, max(b.select(cols).nbytes, 1), start, end))
            start = end
        return blocks, tuple(cols), "stream"


def _jsonl_blocks(path: str) -> tuple[list[tuple[int, int, int, int]], np.ndarray, np.ndarray]:
    starts, ends, _ = line_index(path)
    blocks = []
    i, n = 0, len(starts)
    while i < n:
        j = i + 1
        while j < n and j - i < JSONL_BLOCK_LINES and ends[j] - starts[i] <= JSONL_BLOCK_BYTES:
            j += 1
        lo, hi = int(starts[i]), int(ends[j - 1])
        blocks.append((j - i, max(hi - lo, 1), lo, hi))
        i = j
    return blocks, starts, ends


class RecordDataset:
    """Conversation records from Parquet / JSONL / Arrow IPC files, read by blocks (module docstring).

    Args:
        paths: A file, a directory, a filesystem URI, or a list of them.
        format: Force one format for every file (default: from each file's extension).

    Raises:
        SchemaError: naming file and column, when a file's schema cannot hold conversation records.
        EmptyDatasetError: (a ValueError) naming the files, when they hold no record at all: an epoch
            of 0 steps is never what a job means.
        FileNotFoundError: on a missing file.
    """

    def __init__(
        self, paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], format: str | None = None
    ) -> None:
        self.paths = expand_paths(paths)
        self.files: list[FileInfo] = []
        self.blocks: list[Block] = []
        self._arrow_kind: dict[int, str] = {}
        self._lines: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._line_numbers: dict[int, np.ndarray] = {}
        offset = 0
        for k, path in enumerate(self.paths):
            fmt = _format_of(path, format)
            cols: tuple[str, ...] = ()
            if fmt == "parquet":
                found, cols = _parquet_blocks(path)
            elif fmt == "arrow":
                found, cols, self._arrow_kind[k] = _arrow_blocks(path)
            else:
                found, starts, ends = _jsonl_blocks(path)
                self._lines[k] = (starts, ends)
            first = offset
            for i, (rows, nbytes, start, end) in enumerate(found):
                if rows:
                    self.blocks.append(Block(k, i, offset, rows, nbytes, start, end))
                    offset += rows
            self.files.append(FileInfo(path, fmt, offset - first, first, _base_dir(path), cols))
        if offset == 0:
            raise EmptyDatasetError(self.paths)
        self._num = offset
        self._block_offsets = [b.offset for b in self.blocks]
        self._file_offsets = [f.offset for f in self.files]
        self._cache: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._cache_lock = threading.Lock()

    def __len__(self) -> int:
        return self._num

    def __repr__(self) -> str:
        return f"RecordDataset({len(self)} records in {len(self.files)} files, {len(self.blocks)} blocks)"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = collections.OrderedDict()
        state.pop("_cache_lock")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cache_lock = threading.Lock()

    # -- addressing ----------------------------------------------------------------------------------
    @property
    def block_rows(self) -> list[int]:
        return [b.rows for b in self.blocks]

    @property
    def block_bytes(self) -> list[int]:
        return [b.nbytes for b in self.blocks]

    def _check(self, sample_id: int) -> None:
        if not 0 <= sample_id < self._num:
            raise IndexError(f"sample id {sample_id} out of range [0, {self._num})")

    def block_of(self, sample_id: int) -> int:
        """The index (in `blocks`) of the block holding `sample_id`."""
        self._check(sample_id)
        return bisect.bisect_right(self._block_offsets, sample_id) - 1

    def locate(self, sample_id: int) -> tuple[int, int]:
        """(file index, row in that file) of a global sample id."""
        self._check(sample_id)
        k = bisect.bisect_right(self._file_offsets, sample_id) - 1
        return k, sample_id - self._file_offsets[k]

    def source(self, sample_id: int) -> str:
        """'file:row' of a sample: for JSONL the 1-based line, as editors show it (blank lines counted);
        for Parquet and Arrow the 0-based row within the file, as pyarrow indexes it."""
        k, row = self.locate(sample_id)
        if k in self._lines:
            if k not in self._line_numbers:  # one pass over the file, on its first bad record only
                self._line_numbers[k] = line_numbers(self.files[k].path, self._lines[k][0])
            row = int(self._line_numbers[k][row])
        return f"{self.files[k].path}:{row}"

    # -- reading -------------------------------------------------------------------------------------
    def read_block(self, k: int) -> pa.Table | list[str | bytes]:
        """Block k's rows: an Arrow table of the used columns, or (JSONL) the lines' text (the bytes of a line
        that is not UTF-8: `raw_object` rejects it)."""
        b = self.blocks[k]
        info = self.files[b.file]
        fs, inner = filesystem_of(info.path)
        if info.format == "parquet":
            with fs.open_input_file(inner) as f:
                return pq.ParquetFile(f).read_row_group(b.index, columns=list(info.columns))
        if info.format == "arrow":
            if self._arrow_kind[b.file] == "file":
                with fs.open_input_file(inner) as f:
                    batch = paipc.open_file(f).get_batch(b.index)
                    return pa.Table.from_batches([batch.select(list(info.columns))])
            with fs.open_input_file(inner) as f:
                schema = paipc.open_stream(f).schema
                f.seek(b.start)
                batch = paipc.read_record_batch(paipc.read_message(f), schema)
            return pa.Table.from_batches([batch.select(list(info.columns))])
        starts, ends = self._lines[b.file]
        i0 = int(np.searchsorted(starts, b.start))
        with fs.open_input_file(inner) as f:
            f.seek(b.start)
            data = f.read(b.end - b.start)
        rel_s = starts[i0 : i0 + b.rows] - b.start
        rel_e = ends[i0 : i0 + b.rows] - b.start
        return [_text(data[s:e]) for s, e in zip(rel_s.tolist(), rel_e.tolist(), strict=False)]

    def items(
        self, k: int, data: pa.Table | list[str | bytes], ids: Sequence[int]
    ) -> list[tuple[int, str, str, Any]]:
        """(id, source, base_dir, raw) of `ids` (all in block k) from its `read_block` data: raw is the row
        as Python objects, or a JSONL line's text (parsed by `parse_item`)."""
        b = self.blocks[k]
        info = self.files[b.file]
        rows = [int(i) - b.offset for i in ids]
        if isinstance(data, list):
            raws: list[Any] = [data[r] for r in rows]
        else:
            raws = data.take(pa.array(rows, pa.int64())).to_pylist()
        first_row = b.offset - info.offset
        return [
            (int(i), f"{info.path}:{first_row + r}", info.base_dir, raw)
            for i, r, raw in zip(ids, rows, raws, strict=True)
        ]

    def _cached_block(self, k: int) -> pa.Table | list[str | bytes]:
        with self._cache_lock:
            if k in self._cache:
                self._cache.move_to_end(k)
                return self._cache[k]
        data = self.read_block(k)
        with self._cache_lock:
            self._cache[k] = data
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return data

    def item(self, sample_id: int) -> tuple[int, str, str, Any]:
        """`items` for one id (random access: reads its block, keeping the last two blocks read)."""
        k = self.block_of(sample_id)
        return self.items(k, self._cached_block(k), [sample_id])[0]

    def raw(self, sample_id: int) -> dict[str, Any]:
        """The row as Python objects; raises Reject for an invalid JSONL line or a wrongly typed field."""
        _, source, _, raw = self.item(sample_id)
        return raw_object(raw, source)

    def record(self, sample_id: int) -> Record:
        """The parsed record; raises Reject for a bad one."""
        _, source, base_dir, raw = self.item(sample_id)
        return parse_item(raw, source, base_dir)


def _text(line: bytes) -> str | bytes:
    """A JSONL line's text, or its bytes when it is not UTF-8 (JSON text is UTF-8, RFC 8259)."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        return line


def raw_object(raw: Any, source: str) -> dict[str, Any]:
    """A row as Python objects: JSONL text is parsed and its field types checked (Reject on a bad line:
    ``invalid_utf8`` for a line that is not UTF-8, ``invalid_json``, ``schema``)."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Reject(
                "invalid_utf8", f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1} is not UTF-8"
            ) from None
    if not isinstance(raw, str):
        parsed: dict[str, Any] = raw  # an Arrow row: Python objects already
        return parsed
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise Reject("invalid_json", f"{exc.msg} at column {exc.colno}") from None
    file, _, row = source.rpartition(":")
    try:
        check_json_row(obj, file, int(row) if row.isdigit() else 0)
    except SchemaError as exc:
        raise Reject("schema", f"field {exc.field!r}: {exc.problem}") from None
    checked: dict[str, Any] = obj
    return checked


def parse_item(raw: Any, source: str, base_dir: str) -> Record:
    """The parsed record of an item's raw value (`RecordDataset.items`); Reject for a bad one."""
    return parse_record(raw_object(raw, source), base_dir)


def iter_records(
    dataset: RecordDataset, ids: Iterable[int] | None = None
) -> Iterator[tuple[int, Record | Reject]]:
    """(id, Record | Reject) pairs: a convenience for inspecting a dataset without Ray."""
    for i in range(len(dataset)) if ids is None else ids:
        try:
            yield i, dataset.record(i)
        except Reject as exc:
            yield i, exc
