"""One conversation record: `parse_record` validates a raw row's values into a `Record`, or raises `Reject`.

A record is one conversation:

    {"messages": [{"role": "user", "content": "<image>What is this?"}, {"role": "assistant", ...}],
     "images": [b"\\x89PNG..." | "relative/or/absolute/path.png" | {"bytes": ..., "path": ...}],  # optional
     "audios": [b"RIFF..." | "clip.wav" | "clip.flac" | {"bytes": ..., "path": ...}],              # optional
     "system": "You are ..."}                                                                       # optional

Also accepted: ShareGPT rows (`conversations: [{from: human|gpt|system, value}]`), content given as a list
of parts (`[{"type": "text", "text": ...}, {"type": "image"}]`), a single image instead of a list, and
images as data URIs (`data:image/png;base64,...`) or base64 `{"bytes": ...}` objects in JSON. `<image>`
in a message marks where an image goes; images without a marker are put in front of the first user
message (the LLaVA / LLaMA-Factory convention). Audio clips alike: `audios` (LLaMA-Factory's key),
`<audio>` markers, `{"type": "audio"}` parts. Images and clips stay references (`ImageRef`) here: they are
read and decoded by the chain (`_vision.decode_images`, `_audio.decode_audios`).
"""

from __future__ import annotations

import base64
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ._files import _is_uri, _read_bytes
from ._quarantine import Reject
from ._schema import _conversation_column, _type_name

ROLES = ("system", "user", "assistant")
_ROLE_ALIASES = {
    "human": "user",
    "gpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
    "user": "user",
    "assistant": "assistant",
}
IMAGE_MARKER = "<image>"
AUDIO_MARKER = "<audio>"


@dataclasses.dataclass
class ImageRef:
    """An image (or audio clip) as stored in a record: raw bytes, or a path/URI (relative paths: to the
    record's file)."""

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
    """A validated conversation: messages with string content (`<image>`, `<audio>` markers), system, image
    and audio refs."""

    messages: list[dict[str, str]]
    system: str | None
    images: list[ImageRef]
    audios: list[ImageRef] = dataclasses.field(default_factory=list)


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
            elif kind == "audio":
                out.append(AUDIO_MARKER)
            else:
                raise Reject("unsupported_content", f"{field}[{k}].type = {kind!r}")
        return "".join(out)
    raise Reject("schema", f"field {field}: expected string, got {_type_name(content)}")


def _image_ref(im: Any, k: int, field: str = "images") -> ImageRef:
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
                bad = "bad_image" if field == "images" else "bad_audio"
                raise Reject(bad, f"{field}[{k}].bytes is not base64: {exc}") from None
        if data is None and not path:
            raise Reject("missing_field", f"{field}[{k}] has neither bytes nor path")
        return ImageRef(data=bytes(data) if data is not None else None, path=path)
    raise Reject("missing_field" if im is None else "schema", f"{field}[{k}] is {_type_name(im)}")


def _refs(raw: Mapping[str, Any], field: str, marker: str, messages: list[dict[str, str]]) -> list[ImageRef]:
    """The record's `field` refs; markers added in front of the first user message for refs without one."""
    items = raw.get(field)
    if items is None:
        items = []
    elif not isinstance(items, list):
        items = [items]
    refs = [_image_ref(x, k, field) for k, x in enumerate(items)]
    markers = sum(m["content"].count(marker) for m in messages)
    if markers > len(refs):
        what = "image" if field == "images" else "audio"
        raise Reject(f"{what}_mismatch", f"{markers} {marker} markers but {len(refs)} {field}")
    if markers < len(refs):
        first_user = next((m for m in messages if m["role"] == "user"), messages[0])
        first_user["content"] = marker * (len(refs) - markers) + first_user["content"]
    return refs


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
    images = _refs(raw, "images", IMAGE_MARKER, messages)
    audios = _refs(raw, "audios", AUDIO_MARKER, messages)
    return Record(messages, system, images, audios)
