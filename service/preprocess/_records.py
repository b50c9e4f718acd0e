"""Conversation records read through pyarrow: Parquet, JSONL and Arrow IPC, with a quarantine.

A record is one conversation:

    {"messages": [{"role": "user", "content": "<image>What is this?"}, {"role": "assistant", ...}],
     "images": [b"\\x89PNG..." | "relative/or/absolute/path.png" | {"bytes": ..., "path": ...}],   # optional
     "system": "You are ..."}                                                                        # optional

Also accepted: ShareGPT rows (`conversations: [{from: human|gpt|system, value}]`), content given as a list
of parts (`[{"type": "text", "text": ...}, {"type": "image"}]`), a single image instead of a list, and
images as data URIs (`data:image/png;base64,...`) or base64 `{"bytes": ...}` objects in JSON. `<image>`
in a message marks where an image goes; images without a marker are put in front of the first user
message (the LLaVA / LLaMA-Factory convention).

Two kinds of problems, handled differently:

- **Schema** (the types): checked up front, when the dataset is opened, and raised as `SchemaError`
  naming the file, the row (where one applies) and the field. A Parquet/Arrow column of the wrong type
  fails for the whole file; in JSONL every row is checked (e.g. `messages[1].role` holding a number).
  With `strict=False` the JSONL type errors are quarantined instead.
- **Records** (the values): invalid JSON lines, missing or null fields, an empty conversation, unknown
  roles, no assistant turn, undecodable images... are raised as `Reject` inside the pipeline and end up
  in a `Quarantine` (a JSONL file of `{id, source, reason}` lines plus counts by reason). They are never
  raised to the caller: a bad record never kills the epoch.

Files are given as local paths, directories (every supported file inside, sorted) or filesystem URIs that
pyarrow understands (`file://`, `s3://`, `gs://`, `hdfs://`...). Sample ids are global: file 0's rows
first, in row order, then file 1's, and so on; every non-blank JSONL line is one record (an invalid one
too). Each file is read once into an Arrow table (images included); the preprocessing pool shares the
tables with its actors through the Ray object store. Datasets larger than memory need a sharded reader
(not built yet).
"""

from __future__ import annotations

import base64
import bisect
import collections
import dataclasses
import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as paipc
import pyarrow.parquet as pq

FORMATS = ("parquet", "jsonl", "arrow")
_EXTENSIONS = {
    ".parquet": "parquet", ".pq": "parquet",
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
    ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow", ".arrows": "arrow",
}
ROLES = ("system", "user", "assistant")
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant", "bot": "assistant",
                 "system": "system", "user": "user", "assistant": "assistant"}
IMAGE_MARKER = "<image>"


class SchemaError(ValueError):
    """A dataset file whose schema does not fit: names the file, the row (or None) and the field."""

    def __init__(self, file: str, field: str, problem: str, row: int | None = None) -> None:
        self.file, self.field, self.row, self.problem = file, field, row, problem
        where = f"{file}" + (f": row {row}" if row is not None else "")
        super().__init__(f"{where}: field {field!r}: {problem}")


class EmptyDatasetError(ValueError):
    """A dataset with no records at all (every file empty or blank): names the files."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        shown = ", ".join(self.paths[:3]) + (f" and {len(self.paths) - 3} more" if len(self.paths) > 3 else "")
        super().__init__(f"the dataset has no records: {shown}")


class Reject(Exception):
    """Raised by a stage (or the record parser) to quarantine a record: `code` groups the counts."""

    def __init__(self, code: str, detail: str = "") -> None:
        self.code, self.detail = code, detail
        super().__init__(f"{code}: {detail}" if detail else code)

    @property
    def reason(self) -> str:
        return str(self)


# ---------------------------------------------------------------------------------------------------
# Quarantine
# ---------------------------------------------------------------------------------------------------
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

    def __init__(self, path: str | os.PathLike | None = None) -> None:
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
                isinstance(k, str) and type(v) is int and v >= 0 for k, v in counts.items()):
            raise ValueError(f"Quarantine state field {K_COUNTS!r} must map reason codes to counts >= 0, "
                             f"got {counts!r}")
        with self._lock:
            self.counts = collections.Counter(counts)

    @staticmethod
    def read(path: str | os.PathLike) -> list[dict[str, Any]]:
        """The lines of a quarantine file."""
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------------
# Files and filesystems
# ---------------------------------------------------------------------------------------------------
def _is_uri(path: str) -> bool:
    return "://" in path


def filesystem_of(path: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a local path or a filesystem URI."""
    s = os.fspath(path)
    if _is_uri(s):
        return pafs.FileSystem.from_uri(s)
    return pafs.LocalFileSystem(), os.path.abspath(s)


def _format_of(path: str, fmt: str | None) -> str:
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}, got format={fmt!r}")
        return fmt
    ext = os.path.splitext(path)[1].lower()
    if ext not in _EXTENSIONS:
        raise ValueError(f"{path}: cannot tell the format from the extension {ext!r}; "
                         f"pass format= one of {list(FORMATS)} (known extensions: {sorted(_EXTENSIONS)})")
    return _EXTENSIONS[ext]


def expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Files behind `paths`: each a file, a directory (its supported files, sorted) or a URI."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise ValueError("no dataset files given")
    out: list[str] = []
    for item in items:
        s = os.fspath(item)
        fs, inner = filesystem_of(s)
        info = fs.get_file_info(inner)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"dataset file not found: {s}")
        if info.type == pafs.FileType.Directory:
            found = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(inner, recursive=False))
                           if i.type == pafs.FileType.File and os.path.splitext(i.path)[1].lower() in _EXTENSIONS)
            if not found:
                raise FileNotFoundError(f"no {sorted(_EXTENSIONS)} files in directory {s}")
            prefix = s[: s.index("://") + 3] if _is_uri(s) else ""
            out.extend(prefix + f if prefix and not f.startswith(prefix) else f for f in found)
        else:
            out.append(s if _is_uri(s) else os.path.abspath(s))
    return out


def _base_dir(path: str) -> str:
    """The directory that relative image paths in `path`'s records are relative to."""
    if _is_uri(path):
        return path.rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(path))


# ---------------------------------------------------------------------------------------------------
# Schema checks
# ---------------------------------------------------------------------------------------------------
def _is_str(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_bin(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t) \
        or pa.types.is_list_view(t)


def _conversation_column(names: Sequence[str]) -> str | None:
    return "messages" if "messages" in names else "conversations" if "conversations" in names else None


def check_arrow_schema(schema: pa.Schema, file: str) -> None:
    """Raises SchemaError if a Parquet/Arrow file's columns cannot hold conversation records."""
    names = schema.names
    col = _conversation_column(names)
    if col is None:
        raise SchemaError(file, "messages", f"missing column (a conversation column 'messages' or "
                                            f"'conversations' is required; the file has {names})")
    t = schema.field(col).type
    if not (_is_list(t) and pa.types.is_struct(t.value_type)):
        raise SchemaError(file, col, f"expected list<struct<role: string, content: string>>, got {t}")
    st = t.value_type
    fields = {st.field(i).name: st.field(i).type for i in range(st.num_fields)}
    role = "role" if "role" in fields else "from" if "from" in fields else None
    content = "content" if "content" in fields else "value" if "value" in fields else None
    if role is None:
        raise SchemaError(file, f"{col}[].role", f"missing struct field (the message struct has {sorted(fields)})")
    if content is None:
        raise SchemaError(file, f"{col}[].content", f"missing struct field (the message struct has {sorted(fields)})")
    if not _is_str(fields[role]):
        raise SchemaError(file, f"{col}[].{role}", f"expected string, got {fields[role]}")
    ct = fields[content]
    if not (_is_str(ct) or (_is_list(ct) and pa.types.is_struct(ct.value_type))):
        raise SchemaError(file, f"{col}[].{content}", f"expected string (or a list of content parts), got {ct}")
    if "system" in names and not (_is_str(schema.field("system").type) or pa.types.is_null(schema.field("system").type)):
        raise SchemaError(file, "system", f"expected string, got {schema.field('system').type}")
    if "images" in names:
        it = schema.field("images").type
        inner = it.value_type if _is_list(it) else it
        ok = pa.types.is_null(it) or _is_str(inner) or _is_bin(inner) or pa.types.is_null(inner)
        if pa.types.is_struct(inner):
            sub = {inner.field(i).name: inner.field(i).type for i in range(inner.num_fields)}
            ok = ("bytes" in sub or "path" in sub) and ("bytes" not in sub or _is_bin(sub["bytes"])
                                                        or pa.types.is_null(sub["bytes"])) \
                and ("path" not in sub or _is_str(sub["path"]) or pa.types.is_null(sub["path"]))
        if not ok:
            raise SchemaError(file, "images", f"expected list<binary> (image bytes), list<string> (paths) or "
                                              f"list<struct<bytes: binary, path: string>>, got {it}")


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def check_json_row(obj: Any, file: str, row: int) -> None:
    """Raises SchemaError if a parsed JSONL row has a field of the wrong type (missing/null is not checked)."""
    if not isinstance(obj, dict):
        raise SchemaError(file, "<row>", f"expected a JSON object, got {_type_name(obj)}", row)
    col = _conversation_column(list(obj)) or "messages"
    msgs = obj.get(col)
    if msgs is not None:
        if not isinstance(msgs, list):
            raise SchemaError(file, col, f"expected a list of messages, got {_type_name(msgs)}", row)
        for j, m in enumerate(msgs):
            if m is None:
                continue
            if not isinstance(m, dict):
                raise SchemaError(file, f"{col}[{j}]", f"expected an object, got {_type_name(m)}", row)
            for key in ("role", "from"):
                if m.get(key) is not None and not isinstance(m[key], str):
                    raise SchemaError(file, f"{col}[{j}].{key}", f"expected string, got {_type_name(m[key])}", row)
            for key in ("content", "value"):
                c = m.get(key)
                if c is not None and not isinstance(c, (str, list)):
                    raise SchemaError(file, f"{col}[{j}].{key}", f"expected string or list of parts, got "
                                                                f"{_type_name(c)}", row)
                if isinstance(c, list):
                    for k, part in enumerate(c):
                        if not isinstance(part, (dict, str)):
                            raise SchemaError(file, f"{col}[{j}].{key}[{k}]", f"expected an object, got "
                                                                             f"{_type_name(part)}", row)
    sys_prompt = obj.get("system")
    if sys_prompt is not None and not isinstance(sys_prompt, str):
        raise SchemaError(file, "system", f"expected string, got {_type_name(sys_prompt)}", row)
    imgs = obj.get("images")
    if imgs is not None:
        items = imgs if isinstance(imgs, list) else [imgs]
        for k, im in enumerate(items):
            if not (im is None or isinstance(im, (str, dict))):
                raise SchemaError(file, f"images[{k}]", f"expected a path, data URI or {{bytes, path}} object, "
                                                        f"got {_type_name(im)}", row)


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FileInfo:
    """One dataset file: where it is, its format, its rows and the id of its first row."""

    path: str
    format: str
    num_rows: int
    offset: int
    base_dir: str


def _read_bytes(path: str) -> bytes:
    fs, inner = filesystem_of(path)
    with fs.open_input_stream(inner) as f:
        return f.read()


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


# ---------------------------------------------------------------------------------------------------
# Parsing one record
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ImageRef:
    """An image as stored in a record: raw bytes, or a path/URI (relative paths: to the record's file)."""

    data: bytes | None = None
    path: str | None = None

    def read(self, base_dir: str) -> bytes:
        if self.data is not None:
            return self.data
        p = self.path or ""
        if p.startswith("data:"):
            return base64.b64decode(p.split(",", 1)[1])
        if not (_is_uri(p) or os.path.isabs(p)):
            p = f"{base_dir.rstrip('/')}/{p}" if _is_uri(base_dir) else os.path.join(base_dir, p)
        return _read_bytes(p)


@dataclasses.dataclass
class Record:
    """A validated conversation: messages with string content (`<image>` markers), system, image refs."""

    messages: list[dict[str, str]]
    system: str | None
    images: list[ImageRef]


def _content_text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
                continue
            if not isinstance(part, dict):
                raise Reject("schema", f"field {field}[{k}]: expected a content part object")
            kind = part.get("type") or ("text" if part.get("text") is not None else "image")
            if kind == "text":
                if part.get("text") is None:
                    raise Reject("missing_field", f"{field}[{k}].text")
                out.append(part["text"])
            elif kind == "image":
                out.append(IMAGE_MARKER)
            else:
                raise Reject("unsupported_content", f"{field}[{k}].type = {kind!r}")
        return "".join(out)
    raise Reject("schema", f"field {field}: expected string, got {_type_name(content)}")


def _image_ref(im: Any, k: int) -> ImageRef:
    if isinstance(im, (bytes, bytearray, memoryview)):
        return ImageRef(data=bytes(im))
    if isinstance(im, str):
        return ImageRef(path=im)
    if isinstance(im, dict):
        data, path = im.get("bytes"), im.get("path")
        if isinstance(data, str):
            try:
                data = base64.b64decode(data, validate=True)
            except (ValueError, TypeError) as exc:
                raise Reject("bad_image", f"images[{k}].bytes is not base64: {exc}") from None
        if data is None and not path:
            raise Reject("missing_field", f"images[{k}] has neither bytes nor path")
        return ImageRef(data=bytes(data) if data is not None else None, path=path)
    raise Reject("missing_field" if im is None else "schema", f"images[{k}] is {_type_name(im)}")


def parse_record(raw: Mapping[str, Any], base_dir: str = "") -> Record:
    """Validates a raw row's values and normalizes it; raises Reject (quarantine) on a bad record."""
    col = _conversation_column(list(raw))
    if col is None or raw[col] is None:
        raise Reject("missing_field", "messages")
    msgs_in = raw[col]
    if not isinstance(msgs_in, list):
        raise Reject("schema", f"field {col}: expected a list, got {_type_name(msgs_in)}")
    if not msgs_in:
        raise Reject("empty_conversation", f"{col} is empty")
    system = raw.get("system")
    if system is not None and not isinstance(system, str):
        raise Reject("schema", f"field system: expected string, got {_type_name(system)}")
    messages: list[dict[str, str]] = []
    for j, m in enumerate(msgs_in):
        if m is None:
            raise Reject("missing_field", f"{col}[{j}]")
        role = m.get("role") if m.get("role") is not None else m.get("from")
        content = m.get("content") if m.get("content") is not None else m.get("value")
        if role is None:
            raise Reject("missing_field", f"{col}[{j}].role")
        if content is None:
            raise Reject("missing_field", f"{col}[{j}].content")
        if not isinstance(role, str):
            raise Reject("schema", f"field {col}[{j}].role: expected string, got {_type_name(role)}")
        canon = _ROLE_ALIASES.get(role.lower())
        if canon is None:
            raise Reject("bad_role", f"{col}[{j}].role = {role!r} (expected one of {list(ROLES)})")
        text = _content_text(content, f"{col}[{j}].content")
        if canon == "system":
            if j != 0:
                raise Reject("bad_role", f"{col}[{j}]: a system message must come first")
            system = text if system is None else system
            continue
        messages.append({"role": canon, "content": text})
    if not messages:
        raise Reject("empty_conversation", f"{col} has no user or assistant message")
    if not any(m["role"] == "assistant" for m in messages):
        raise Reject("no_assistant", "no assistant message: nothing carries loss")
    imgs_in = raw.get("images")
    if imgs_in is None:
        imgs_in = []
    elif not isinstance(imgs_in, list):
        imgs_in = [imgs_in]
    images = [_image_ref(im, k) for k, im in enumerate(imgs_in)]
    markers = sum(m["content"].count(IMAGE_MARKER) for m in messages)
    if markers > len(images):
        raise Reject("image_mismatch", f"{markers} {IMAGE_MARKER} markers but {len(images)} images")
    if markers < len(images):
        first_user = next((m for m in messages if m["role"] == "user"), messages[0])
        first_user["content"] = IMAGE_MARKER * (len(images) - markers) + first_user["content"]
    return Record(messages, system, images)


def iter_records(dataset: RecordDataset, ids: Iterable[int] | None = None):
    """(id, Record | Reject) pairs: a convenience for inspecting a dataset without Ray."""
    for i in range(len(dataset)) if ids is None else ids:
        try:
            yield i, dataset.record(i)
        except Reject as exc:
            yield i, exc
