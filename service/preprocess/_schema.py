"""Schema checks of dataset files, up front, when the dataset is opened: `SchemaError` names the problem.

The types are checked before any record is read: a Parquet/Arrow column of the wrong type fails for the
whole file (`check_arrow_schema`); in JSONL every row is checked (`check_json_row`, e.g.
`messages[1].role` holding a number). A `SchemaError` names the file, the row (where one applies) and
the field. With `RecordDataset(strict=False)` the JSONL type errors are quarantined instead. Missing or
null values are not schema problems: the record parser rejects them (`_parse`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa


class SchemaError(ValueError):
    """A dataset file whose schema does not fit: names the file, the row (or None) and the field."""

    def __init__(self, file: str, field: str, problem: str, row: int | None = None) -> None:
        self.file, self.field, self.row, self.problem = file, field, row, problem
        where = f"{file}" + (f": row {row}" if row is not None else "")
        super().__init__(f"{where}: field {field!r}: {problem}")


def _is_str(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))


def _is_bin(t: pa.DataType) -> bool:
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t))


def _is_list(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or pa.types.is_list_view(t)
    )


def _conversation_column(names: Sequence[str]) -> str | None:
    return "messages" if "messages" in names else "conversations" if "conversations" in names else None


def check_arrow_schema(schema: pa.Schema, file: str) -> None:
    """Raises SchemaError if a Parquet/Arrow file's columns cannot hold conversation records."""
    names = schema.names
    col = _conversation_column(names)
    if col is None:
        raise SchemaError(
            file,
            "messages",
            f"missing column (a conversation column 'messages' or "
            f"'conversations' is required; the file has {names})",
        )
    t = schema.field(col).type
    if not (_is_list(t) and pa.types.is_struct(t.value_type)):
        raise SchemaError(file, col, f"expected list<struct<role: string, content: string>>, got {t}")
    st = t.value_type
    fields = {st.field(i).name: st.field(i).type for i in range(st.num_fields)}
    role = "role" if "role" in fields else "from" if "from" in fields else None
    content = "content" if "content" in fields else "value" if "value" in fields else None
    if role is None:
        raise SchemaError(
            file, f"{col}[].role", f"missing struct field (the message struct has {sorted(fields)})"
        )
    if content is None:
        raise SchemaError(
            file, f"{col}[].content", f"missing struct field (the message struct has {sorted(fields)})"
        )
    if not _is_str(fields[role]):
        raise SchemaError(file, f"{col}[].{role}", f"expected string, got {fields[role]}")
    ct = fields[content]
    if not (_is_str(ct) or (_is_list(ct) and pa.types.is_struct(ct.value_type))):
        raise SchemaError(
            file, f"{col}[].{content}", f"expected string (or a list of content parts), got {ct}"
        )
    if "system" in names and not (
        _is_str(schema.field("system").type) or pa.types.is_null(schema.field("system").type)
    ):
        raise SchemaError(file, "system", f"expected string, got {schema.field('system').type}")
    for media in ("images", "audios"):
        if media in names:
            _check_media(file, media, schema.field(media).type)


def _check_media(file: str, media: str, it: Any) -> None:
    """A column of images or audio clips: list<binary>, list<string> or list<struct<bytes, path>>."""
    inner = it.value_type if _is_list(it) else it
    ok = pa.types.is_null(it) or _is_str(inner) or _is_bin(inner) or pa.types.is_null(inner)
    if pa.types.is_struct(inner):
        sub = {inner.field(i).name: inner.field(i).type for i in range(inner.num_fields)}
        ok = (
            ("bytes" in sub or "path" in sub)
            and ("bytes" not in sub or _is_bin(sub["bytes"]) or pa.types.is_null(sub["bytes"]))
            and ("path" not in sub or _is_str(sub["path"]) or pa.types.is_null(sub["path"]))
        )
    if not ok:
        raise SchemaError(
            file,
            media,
            f"expected list<binary> ({'image' if media == 'images' else 'audio'} bytes), list<string> "
            f"(paths) or list<struct<bytes: binary, path: string>>, got {it}",
        )


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def check_json_row(obj: Any, file: str, row: int) -> None:
    """Raises SchemaError if a parsed JSONL row has a field of the wrong type (missing or null is not
    checked)."""
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
                    raise SchemaError(
                        file, f"{col}[{j}].{key}", f"expected string, got {_type_name(m[key])}", row
                    )
            for key in ("content", "value"):
                c = m.get(key)
                if c is not None and not isinstance(c, (str, list)):
                    raise SchemaError(
                        file,
                        f"{col}[{j}].{key}",
                        f"expected string or list of parts, got {_type_name(c)}",
                        row,
                    )
                if isinstance(c, list):
                    for k, part in enumerate(c):
                        if not isinstance(part, (dict, str)):
                            raise SchemaError(
                                file,
                                f"{col}[{j}].{key}[{k}]",
                                f"expected an object, got {_type_name(part)}",
                                row,
                            )
    sys_prompt = obj.get("system")
    if sys_prompt is not None and not isinstance(sys_prompt, str):
        raise SchemaError(file, "system", f"expected string, got {_type_name(sys_prompt)}", row)
    for media in ("images", "audios"):
        found = obj.get(media)
        items = [] if found is None else found if isinstance(found, list) else [found]
        for k, im in enumerate(items):
            if not (im is None or isinstance(im, (str, dict))):
                raise SchemaError(
                    file,
                    f"{media}[{k}]",
                    f"expected a path, data URI or {{bytes, path}} object, got {_type_name(im)}",
                    row,
                )
