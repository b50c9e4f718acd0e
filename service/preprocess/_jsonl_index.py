"""The byte-offset index of a JSONL file: where each record (non-blank line) starts and ends.

Built once by one streaming pass over the file (numpy over 64 MiB chunks: newlines, and whether a line
holds anything but whitespace), then cached:

- beside the data, as `.<file name>.batchd-index.npy`, when the file is local and its directory is
  writable;
- else in the cache directory (`$BATCHD_CACHE_DIR`, default `~/.cache/batchd`), under a name hashed from
  the file's path or URI.

The cache records the file's size and modification time and is rebuilt when either changes (a file
rewritten in place within the same nanosecond and with the same size is not detected). A cache that
cannot be written is not an error: the index is then rebuilt by each process that opens the file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs

from ._files import _is_uri, filesystem_of

log = logging.getLogger("batchd.preprocess")

INDEX_VERSION = 1
_MAGIC = 0x62617463686449  # "batchdI"
_CHUNK = 64 << 20
_WS = np.zeros(256, dtype=bool)
_WS[[9, 10, 13, 32]] = True


def cache_dir() -> Path:
    """Where indexes go when they cannot sit beside the data: `$BATCHD_CACHE_DIR` or ~/.cache/batchd."""
    return Path(os.environ.get("BATCHD_CACHE_DIR") or Path.home() / ".cache" / "batchd")


def _stamp(path: str) -> tuple[int, int]:
    fs, inner = filesystem_of(path)
    info = fs.get_file_info(inner)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(f"dataset file not found: {path}")
    mtime = info.mtime_ns if info.mtime_ns is not None else 0
    return int(info.size), int(mtime)


def _candidates(path: str) -> list[Path]:
    digest = hashlib.sha1(path.encode()).hexdigest()[:20]
    name = os.path.basename(path.rstrip("/"))
    out = [] if _is_uri(path) else [Path(path).parent / f".{name}.batchd-index.npy"]
    return out + [cache_dir() / "jsonl-index" / f"{digest}-{name}.npy"]


def scan_lines(path: str, chunk_bytes: int = _CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) byte offsets of every non-blank line of `path` (end excludes the newline), reading
    `chunk_bytes` at a time (lines may span chunks)."""
    fs, inner = filesystem_of(path)
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    base = 0
    line_start = 0  # absolute offset where the current (unfinished) line starts
    line_text = False  # whether the unfinished line holds a non-whitespace byte so far
    with fs.open_input_stream(inner) as f:
        while True:
            chunk = f.read(chunk_bytes)
            if not chunk:
                break
            buf = np.frombuffer(chunk, dtype=np.uint8)
            nl = np.flatnonzero(buf == 10)
            text = np.cumsum(~_WS[buf], dtype=np.int64)  # non-whitespace bytes up to and including i
            if len(nl):
                # Line j of this chunk runs from prev newline + 1 to nl[j]; the first continues the carry.
                before = np.concatenate(([0], text[nl[:-1]]))
                has_text = (text[nl] - before) > 0
                has_text[0] |= line_text
                line_starts = np.concatenate(([line_start], base + nl[:-1] + 1))
                starts.append(line_starts[has_text])
                ends.append((base + nl)[has_text])
                line_start = base + int(nl[-1]) + 1
                line_text = bool(text[-1] - text[nl[-1]] > 0)
            else:
                line_text |= bool(text[-1] > 0)
            base += len(buf)
    if line_text:  # a last line without a newline
        starts.append(np.asarray([line_start]))
        ends.append(np.asarray([base]))
    return _concat(starts), _concat(ends)


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def line_numbers(path: str, starts: np.ndarray, chunk_bytes: int = _CHUNK) -> np.ndarray:
    """The 1-based line number (what an editor shows, blank lines counted) of each byte offset in `starts`
    (ascending: `scan_lines`' starts), by one streaming pass counting newlines, `chunk_bytes` at a time."""
    fs, inner = filesystem_of(path)
    out = np.empty(len(starts), dtype=np.int64)
    base, newlines, i = 0, 0, 0
    with fs.open_input_stream(inner) as f:
        while i < len(starts):
            chunk = f.read(chunk_bytes)
            if not chunk:
                break
            nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            j = int(np.searchsorted(starts, base + len(chunk), side="left"))  # starts inside this chunk
            out[i:j] = newlines + np.searchsorted(nl, starts[i:j] - base, side="left") + 1
            newlines += len(nl)
            base += len(chunk)
            i = j
    out[i:] = newlines + 1  # (only a start at the very end of the file)
    return out


def _load(p: Path, size: int, mtime: int) -> tuple[np.ndarray, np.ndarray] | None:
    try:
        arr = np.load(p, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if arr.ndim != 1 or len(arr) < 5 or arr[0] != _MAGIC or arr[1] != INDEX_VERSION:
        return None
    if arr[2] != size or arr[3] != mtime:
        return None
    n = int(arr[4])
    if len(arr) != 5 + 2 * n:
        return None
    return arr[5 : 5 + n].copy(), arr[5 + n :].copy()


def _save(p: Path, size: int, mtime: int, starts: np.ndarray, ends: np.ndarray) -> bool:
    arr = np.concatenate(([_MAGIC, INDEX_VERSION, size, mtime, len(starts)], starts, ends)).astype(np.int64)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=p.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, p)
        return True
    except OSError:
        return False


def line_index(path: str) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(starts, ends, where the index is cached or None) of `path`'s non-blank lines (module docstring)."""
    size, mtime = _stamp(path)
    for p in _candidates(path):
        got = _load(p, size, mtime)
        if got is not None:
            return got[0], got[1], str(p)
    starts, ends = scan_lines(path)
    for p in _candidates(path):
        if _save(p, size, mtime, starts, ends):
            return starts, ends, str(p)
    log.warning("%s: the JSONL index could not be cached (beside the data or in %s)", path, cache_dir())
    return starts, ends, None
